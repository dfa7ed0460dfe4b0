"""The reference model: a small, real torch model in the shape of DeepSeek V4.1.

Who calls it: ``engine_plugin.reference.engine.Engine`` (prefill, decode and
replay, one request chunk at a time); whoever builds an engine (the serving worker,
tests, tools) builds the model first, and ``tools/fit_cost_model.py`` also times it directly.

Shape (``ModelConfig`` names in brackets)::

    tokens -> embed
      -> L1 x [n_swa_layers]  { x += SWA(x) ; x += MLP(x) }      window W, RoPE
      -> g_t = rope(W_g . norm(x_t))            one global KV vector per token, [d_global]
      -> L2 x [n_cross_layers] { x += SWA(x) ; x += GA(x, g_0..g_t) ; x += MLP(x) }
      -> norm -> lm_head -> logits

``GA`` is MLA-style attention over the global KV of every position <= t: the
first ``d_latent`` channels are key and value, the last ``d_rope`` carry RoPE
(absolute positions, applied when g is produced, so a stored block is
position-exact). ``g`` is what the store persists as block KV.

Replay (the reason this model exists)
-------------------------------------
Window caches are not persisted per block. ``forward_chunk(..., replay=True)``
runs tokens only to rebuild the windows: it does not write ``g`` (the loaded
global KV stays as loaded: early positions of a replay span see a truncated
window, so their recomputed ``g`` would be wrong) and reads ``g`` from the
pool instead. A layer-l input at position p depends on positions
``[p - l*(W-1), p]`` through the windows and on the (exact) loaded g, so the
window K/V of the last W-1 positions of every layer are exact after a replay
of ``replay_span("exact") = (L1+L2)*(W-1)`` tokens. ``replay_span("window")``
(= W, the production choice of the public V4.1 serving code) is cheaper and
approximate.

Window state (``WindowState.buf``) layout, one tensor per request::

    [n_layers, 2 (K, V), W-1, n_heads, head_dim]   positions end-(W-1) .. end-1
    rows before W-1-valid are zero (fewer than W-1 positions seen yet)
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine_plugin.contract import KVLayout
from engine_plugin.reference.config import ModelConfig
from kvstore.errors import InvalidRequest
from kvstore.keys import Namespace

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Replay span policies: name -> span in tokens for a config. A registry, so a new
# policy is a row here, not an ``if`` in the connector.
REPLAY_SPANS: dict[str, Callable[[ModelConfig], int]] = {
    "exact": lambda c: c.n_layers * (c.window - 1),  # full receptive field: exact windows
    "window": lambda c: c.window,  # production-style: the window alone (approximate)
}


class GlobalKVAccess(Protocol):
    """How the model reaches one request's paged global KV (the engine implements it)."""

    def read(self, end: int) -> torch.Tensor:
        """Global KV of positions ``[0, end)`` as ``[end, d_global]``."""

    def write(self, start: int, g: torch.Tensor) -> None:
        """Store ``g`` (``[T, d_global]``) at positions ``[start, start + T)``."""


class WindowState:
    """Sliding-window K/V of every layer for one request (see the module docstring).

    ``valid`` = number of real rows at the end of the window (``min(W-1, end)``);
    ``end`` = the position the next token will have.
    """

    __slots__ = ("buf", "valid", "end")

    def __init__(self, buf: torch.Tensor, end: int):
        self.buf = buf
        self.end = end
        self.valid = min(buf.shape[2], end)

    @classmethod
    def empty(cls, cfg: ModelConfig, device: torch.device | str, end: int = 0) -> "WindowState":
        dt = TORCH_DTYPES[cfg.dtype]
        buf = torch.zeros(snapshot_shape(cfg), dtype=dt, device=device)
        return cls(buf, end)

    def export(self) -> torch.Tensor:
        """A copy of the window, ``[n_layers, 2, W-1, n_heads, head_dim]``."""
        return self.buf.clone()


def snapshot_shape(cfg: ModelConfig) -> tuple[int, ...]:
    return (cfg.n_layers, 2, cfg.window - 1, cfg.n_heads, cfg.head_dim)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate channel pairs of ``x`` ``[T, ..., d]`` by absolute positions ``pos`` ``[T]``."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]  # [T, d/2], float64: exact at 1M positions
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos = ang.cos().to(x.dtype).reshape(shape)
    sin = ang.sin().to(x.dtype).reshape(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model)
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class SWAAttention(nn.Module):
    """Multi-head attention over the last W positions; updates the window rows of its layer."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.norm = RMSNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.n_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, win: WindowState,
                mask: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        T, H, D, W = x.shape[0], c.n_heads, c.head_dim, c.window
        q, k, v = self.qkv(self.norm(x)).view(T, 3, H, D).unbind(1)
        q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
        valid, w1 = win.valid, W - 1
        ck = win.buf[self.layer, 0, w1 - valid:]
        cv = win.buf[self.layer, 1, w1 - valid:]
        K, V = torch.cat([ck, k]), torch.cat([cv, v])  # [valid + T, H, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], K.transpose(0, 1)[None], V.transpose(0, 1)[None], attn_mask=mask
        )[0].transpose(0, 1).reshape(T, H * D)
        if w1:
            n = min(w1, K.shape[0])
            win.buf[self.layer, 0, w1 - n:] = K[-n:]
            win.buf[self.layer, 1, w1 - n:] = V[-n:]
        return self.o(out)


class GlobalAttention(nn.Module):
    """MLA-style attention of every head over the global KV of positions <= t."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(cfg.d_model)
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.d_global, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.d_latent, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, g: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        T, H = x.shape[0], c.n_heads
        q = self.q(self.norm(x)).view(T, H, c.d_global)
        q = torch.cat([q[..., : c.d_latent], rope(q[..., c.d_latent:], pos, c.rope_theta)], dim=-1)
        # every head reads the same K (= g) and V (= g[:, :d_latent]): fold the heads into the
        # query rows and run one single-head attention (no H-fold copy of the global KV)
        out = F.scaled_dot_product_attention(
            q.reshape(1, 1, T * H, c.d_global), g[None, None], g[None, None], attn_mask=mask)
        # V = the latent part: attending with V = all of g and dropping the RoPE channels after
        # keeps q/k/v head dims equal, which the fused CPU kernel needs
        return self.o(out[0, 0, :, : c.d_latent].reshape(T, H * c.d_latent))


class SWABlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn, self.mlp = SWAAttention(cfg, layer), MLP(cfg)

    def forward(self, x, pos, win, swa_mask):
        x = x + self.attn(x, pos, win, swa_mask)
        return x + self.mlp(x)


class CrossBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn, self.ga, self.mlp = SWAAttention(cfg, layer), GlobalAttention(cfg), MLP(cfg)

    def forward(self, x, pos, win, g, swa_mask, ga_mask):
        x = x + self.attn(x, pos, win, swa_mask)
        x = x + self.ga(x, pos, g, ga_mask)
        return x + self.mlp(x)


def _additive_mask(kpos: torch.Tensor, qpos: torch.Tensor, window: int | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """``[len(qpos), len(kpos)]``: 0 where q may attend k (causal, within ``window`` if given),
    -inf elsewhere. Built once per chunk and shared by every layer of its kind."""
    ok = kpos[None, :] <= qpos[:, None]
    if window is not None:
        ok &= kpos[None, :] > qpos[:, None] - window
    mask = torch.zeros(ok.shape, dtype=dtype, device=kpos.device)
    return mask.masked_fill_(~ok, float("-inf"))


LayerHook = Callable[[str], None]
"""Called with a layer-group name (``"swa.<i>"`` before layer i, ``"global"`` before
the first consumer of global KV) so that a connector can wait for that group's load."""


class ReferenceModel(nn.Module):
    """See the module docstring. Weights are seeded from ``cfg.seed`` (no download).

    Identity (what the store namespace hashes), with reasons:
      1. A seeded model is ``cfg.model_id``, which already covers the seed and every
         other field that changes the weights (``ModelConfig.model_id``).
      2. ``load_weights`` folds a digest of the *loaded tensors* (names, dtypes, shapes,
         bytes; not the file, so two files with the same tensors are one model) into
         ``model_id``: a fine-tune has the base model's config, and sharing its
         namespace would load the base model's KV (wrong tokens, no error).
      3. Weights loaded from a file are always keyed by their digest, even if they equal
         the seeded ones: a spurious miss, never a wrong hit.
      4. An ``Engine`` derives its namespace from ``model_id`` when it is built and
         refuses requests once the model's identity changed (``load_weights`` after the
         engine was built): its pool and prefix cache hold KV of the old weights.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.swa = nn.ModuleList(SWABlock(cfg, i) for i in range(cfg.n_swa_layers))
        self.g_norm = RMSNorm(cfg.d_model)
        self.g_proj = nn.Linear(cfg.d_model, cfg.d_global, bias=False)
        self.cross = nn.ModuleList(
            CrossBlock(cfg, cfg.n_swa_layers + j) for j in range(cfg.n_cross_layers))
        self.final_norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        self.weights_digest: str | None = None  # set by load_weights (see the class docstring)
        self.to(device=device, dtype=TORCH_DTYPES[cfg.dtype])
        self.eval().requires_grad_(False)

    def _init_weights(self) -> None:
        gen = torch.Generator().manual_seed(self.cfg.seed)
        for name, p in sorted(self.named_parameters()):  # sorted: order-independent seeding
            if name.endswith("norm.weight"):
                continue
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * self.cfg.init_std)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def model_id(self) -> str:
        """``cfg.model_id``, plus ``-w<digest>`` once weights were loaded from a file."""
        if self.weights_digest is None:
            return self.cfg.model_id
        return f"{self.cfg.model_id}-w{self.weights_digest}"

    def namespace(self, rank: int = 0) -> Namespace:
        """The store key namespace of this model's global KV: ``cfg.namespace`` with ``model_id``."""
        return replace(self.cfg.namespace(rank), model_id=self.model_id)

    def kv_layout(self) -> KVLayout:
        """What the connector needs to know about this model's KV (see ``connector.KVLayout``)."""
        c = self.cfg
        return KVLayout(c.d_global, c.dtype, snapshot_shape(c),
                        tuple((name, fn(c)) for name, fn in REPLAY_SPANS.items()))

    def replay_span(self, policy: str = "exact") -> int:
        """Tokens to replay before a hit boundary to rebuild the windows (see module doc)."""
        try:
            return REPLAY_SPANS[policy](self.cfg)
        except KeyError:
            raise InvalidRequest(f"unknown replay policy {policy!r}; known: {sorted(REPLAY_SPANS)}") from None

    @torch.no_grad()
    def forward_chunk(self, tokens: torch.Tensor, start: int, win: WindowState, kv: GlobalKVAccess,
                      *, replay: bool = False, hook: LayerHook | None = None) -> torch.Tensor | None:
        """Run tokens at positions ``[start, start + T)``; return logits ``[vocab]`` of the last.

        Preconditions (misuse raises ``InvalidRequest``): ``win.end == start``;
        with ``replay=True`` the pool already holds g for ``[0, start + T)``.
        Side effects: ``win`` advances to ``start + T``; without replay, g of the
        chunk is written through ``kv``. Replay returns ``None`` (no logits).
        """
        if win.end != start:
            raise InvalidRequest(f"window state is at position {win.end}, chunk starts at {start}")
        T = int(tokens.shape[0])
        if T == 0:
            raise InvalidRequest("empty chunk")
        pos = torch.arange(start, start + T, device=self.device)
        x = self.embed(tokens.to(self.device))
        swa_mask = _additive_mask(torch.arange(start - win.valid, start + T, device=self.device), pos,
                                  self.cfg.window, x.dtype)
        for i, blk in enumerate(self.swa):
            if hook:
                hook(f"swa.{i}")
            x = blk(x, pos, win, swa_mask)
        if not replay:
            c = self.cfg
            g = self.g_proj(self.g_norm(x))
            g = torch.cat([g[:, : c.d_latent], rope(g[:, c.d_latent:], pos, c.rope_theta)], dim=-1)
            kv.write(start, g)
        if hook:
            hook("global")
        g_all = kv.read(start + T)
        ga_mask = _additive_mask(torch.arange(start + T, device=self.device),
                                 pos.repeat_interleave(self.cfg.n_heads), None, x.dtype)
        for j, blk in enumerate(self.cross):
            if hook:
                hook(f"swa.{self.cfg.n_swa_layers + j}")
            x = blk(x, pos, win, g_all, swa_mask, ga_mask)
        win.end, win.valid = start + T, min(self.cfg.window - 1, start + T)
        if replay:
            return None
        return self.lm_head(self.final_norm(x[-1:]))[0].float()

    def save_weights(self, path: str) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, path)

    def load_weights(self, path: str) -> None:
        from safetensors.torch import load_file

        state = load_file(path, device=str(self.device))
        missing, unexpected = self.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise InvalidRequest(f"weights at {path} do not fit {self.cfg.model_id}: "
                                 f"missing {missing}, unexpected {unexpected}")
        # After the copy: the digest is of the weights the model runs (cast to its dtype).
        self.weights_digest = weights_digest(self)


def weights_digest(model: nn.Module) -> str:
    """Hex digest of ``model``'s tensors: name, dtype, shape and bytes, in name order."""
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
