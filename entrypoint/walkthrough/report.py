"""The walkthrough's outputs: the per-hop terminal timeline and a self-contained HTML report.

``VariantResult`` is what one run of turn 3 produced (its hop events, tokens,
summary). ``render_html`` writes one HTML file with inline SVG charts and no
external resources or scripts, so it opens offline and in a sandboxed CI
browser: a timeline per variant, prefilled vs loaded vs replayed tokens, and
TTFT against the cold run.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

COLORS = {"prefilled": "#d1495b", "loaded": "#2e86ab", "replayed": "#edae49"}
HOP_COLORS = {"ve": "#6c5b7b", "lookup": "#355c7d", "prefill": "#d1495b", "decode_start": "#99b898",
              "decode": "#2a9d8f", "failover": "#e76f51"}


@dataclass(slots=True)
class VariantResult:
    name: str
    tokens: list[int]
    hops: list[dict]
    summary: dict
    cold_tokens: list[int] = field(default_factory=list)
    note: str = ""

    @property
    def prefill(self) -> dict:
        return next((h for h in self.hops if h["hop"] == "prefill"), {})

    @property
    def matches_cold(self) -> bool:
        return bool(self.cold_tokens) and self.tokens == self.cold_tokens

    def figures(self) -> dict:
        p = self.prefill
        tiers = p.get("loaded_tokens_by_tier", {})
        ve = [h for h in self.hops if h["hop"] == "ve"]
        fo = [h for h in self.hops if h["hop"] == "failover"]
        return {
            "ttft_ms": self.summary.get("ttft_ms", 0.0),
            "total_ms": self.summary.get("total_ms", 0.0),
            "prompt_tokens": p.get("prompt_tokens", 0),
            "prefilled": p.get("prefilled_tokens", 0),
            "loaded": p.get("hit_tokens", 0),
            "replayed": p.get("replayed_tokens", 0),
            "loaded_by_tier": tiers,
            "bytes_by_tier": p.get("bytes_by_tier", {}),
            "snapshot_hit": p.get("snapshot_hit", False),
            "ve_cache_hit": all(h.get("cache_hit") for h in ve) if ve else None,
            "failover_ms": sum(h.get("ms", 0.0) for h in fo),
            "failovers": len(fo),
            # tokens streamed after the (first) failover, by the worker(s) it re-dispatched to
            "restreamed": len(self.tokens) - fo[0]["resumed_at"] if fo else 0,
            "prefill_worker": p.get("worker", ""),
        }


def hop_line(h: dict) -> str:
    """One terminal line per hop event."""
    name = h["hop"]
    extra = {
        "ve": lambda: f"{h['worker']}: {h['tokens']} image tokens, cache {'HIT' if h['cache_hit'] else 'miss'}",
        "lookup": lambda: f"store: {h['hit_blocks']}/{h['blocks']} blocks cached, SWA snapshot at "
                          f"{h['swa_at'] if h['swa_at'] is not None else 'none'}",
        "prefill": lambda: (f"{h['worker']}: loaded {h['hit_tokens']} tokens "
                            f"({', '.join(f'{t} {n}' for t, n in h['loaded_tokens_by_tier'].items() if n) or 'none'}), "
                            f"replayed {h['replayed_tokens']}, prefilled {h['prefilled_tokens']}"),
        "decode_start": lambda: f"{h['worker']}: streaming from token {h['resume_at']}",
        "decode": lambda: f"{h['worker']}: {h['tokens']} tokens done",
        "failover": lambda: f"{h['worker']} died ({h['code']}); re-dispatching from token {h['resumed_at']}",
    }.get(name, lambda: "")()
    return f"  {h['t_ms']:9.1f} ms  {name:<13} {extra}"


def _bar_chart(rows: list[tuple[str, dict[str, float]]], keys: list[str], colors: dict[str, str],
               unit: str, width: int = 720) -> str:
    """Horizontal stacked bars: one row per label."""
    total = max([sum(v.get(k, 0) for k in keys) for _, v in rows] + [1e-9])
    bar_h, gap, left = 26, 12, 250
    h = len(rows) * (bar_h + gap) + 40
    out = [f'<svg width="{width}" height="{h}" role="img">']
    for i, (label, vals) in enumerate(rows):
        y = i * (bar_h + gap) + 10
        out.append(f'<text x="0" y="{y + 18}" font-size="13">{html.escape(label)}</text>')
        x = left
        for k in keys:
            w = (width - left - 80) * vals.get(k, 0) / total
            if w > 0:
                out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colors[k]}">'
                           f'<title>{html.escape(k)}: {vals.get(k, 0):.0f} {unit}</title></rect>')
            x += w
        out.append(f'<text x="{x + 6:.1f}" y="{y + 18}" font-size="12">'
                   f'{sum(vals.get(k, 0) for k in keys):,.0f} {unit}</text>')
    ly = len(rows) * (bar_h + gap) + 28
    for j, k in enumerate(keys):
        out.append(f'<rect x="{left + j * 130}" y="{ly - 10}" width="12" height="12" fill="{colors[k]}"/>'
                   f'<text x="{left + j * 130 + 16}" y="{ly}" font-size="12">{html.escape(k)}</text>')
    out.append("</svg>")
    return "".join(out)


def _timeline(v: VariantResult, width: int = 720) -> str:
    hops = [h for h in v.hops]
    end = max([v.summary.get("total_ms", 0.0)] + [h["t_ms"] for h in hops] + [1.0])
    left, row = 110, 22
    out = [f'<svg width="{width}" height="{len(hops) * row + 30}" role="img">']
    for i, h in enumerate(hops):
        dur = h.get("ms", 0.0) or 0.0
        x0 = left + (width - left - 10) * max(0.0, h["t_ms"] - dur) / end
        w = max(2.0, (width - left - 10) * dur / end)
        y = i * row + 5
        out.append(f'<text x="0" y="{y + 14}" font-size="12">{html.escape(h["hop"])}</text>'
                   f'<rect x="{x0:.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" '
                   f'fill="{HOP_COLORS.get(h["hop"], "#888")}"><title>{html.escape(hop_line(h).strip())}</title></rect>')
    out.append(f'<text x="{left}" y="{len(hops) * row + 22}" font-size="11">0 ms</text>'
               f'<text x="{width - 80}" y="{len(hops) * row + 22}" font-size="11">{end:,.0f} ms</text></svg>')
    return "".join(out)


def render_html(title: str, intro: str, cold: VariantResult, variants: list[VariantResult]) -> str:
    rows_tok = [(v.name, {k: v.figures()[k] for k in ("prefilled", "loaded", "replayed")}) for v in [cold, *variants]]
    rows_ttft = [(v.name, {"ttft": v.figures()["ttft_ms"]}) for v in [cold, *variants]]
    table = ["<table><tr><th>variant</th><th>same tokens as cold</th><th>TTFT ms</th><th>vs cold</th>"
             "<th>prefilled</th><th>loaded (device / host / store)</th><th>replayed</th><th>bytes read per tier</th>"
             "<th>VE cache</th><th>failover ms</th></tr>"]
    cold_ttft = cold.figures()["ttft_ms"] or 1e-9
    for v in [cold, *variants]:
        f = v.figures()
        t = f["loaded_by_tier"]
        b = f["bytes_by_tier"]
        table.append(
            f"<tr><td>{html.escape(v.name)}</td><td>{'yes' if v is cold or v.matches_cold else 'NO'}</td>"
            f"<td>{f['ttft_ms']:,.1f}</td><td>{f['ttft_ms'] / cold_ttft:.2f}x</td><td>{f['prefilled']:,}</td>"
            f"<td>{t.get('device', 0):,} / {t.get('host', 0):,} / {t.get('store', 0):,}</td><td>{f['replayed']:,}</td>"
            f"<td>{', '.join(f'{k} {n / 1024:,.0f} KiB' for k, n in b.items() if n) or '-'}</td>"
            f"<td>{'-' if f['ve_cache_hit'] is None else ('hit' if f['ve_cache_hit'] else 'miss')}</td>"
            f"<td>{f['failover_ms']:,.1f}</td></tr>")
    table.append("</table>")
    timelines = "".join(
        f"<h3>{html.escape(v.name)}</h3><p>{html.escape(v.note)}</p>{_timeline(v)}"
        f"<pre>{html.escape(chr(10).join(hop_line(h) for h in v.hops))}</pre>" for v in [cold, *variants])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:980px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}
td:first-child,th:first-child{{text-align:left}}pre{{background:#f6f6f6;padding:8px;font-size:12px;overflow-x:auto}}</style>
</head><body>
<h1>{html.escape(title)}</h1><p>{html.escape(intro)}</p>
<h2>Turn 3, variant by variant</h2>{''.join(table)}
<h2>Tokens: prefilled vs loaded vs replayed</h2>{_bar_chart(rows_tok, ["prefilled", "loaded", "replayed"], COLORS, "tokens")}
<h2>Time to first token</h2>{_bar_chart(rows_ttft, ["ttft"], {"ttft": "#2e86ab"}, "ms")}
<h2>Timelines</h2>{timelines}
</body></html>
"""
