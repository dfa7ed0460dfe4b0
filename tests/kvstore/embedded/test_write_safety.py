"""The file-per-fragment and pack-per-batch write paths: a failed target's replacement keeps
the fragments spread over failure domains; syncfs reports the writeback errors of the files it
makes durable; a new data directory refuses targets that already hold files."""

from __future__ import annotations

import os

import pytest

import kvstore
from kvstore.embedded import durability
from kvstore.embedded.placement import place
from kvstore.embedded.targets import LocalTarget

from tests.fragments import fragment_refs
from tests.kvstore.conftest import value_for


def test_spare_replacement_keeps_fragments_in_distinct_domains(tmp_path, keys):
    """3 domains x 2 targets, 2+1: placement puts the 3 fragments in 3 domains. When the
    target of fragment 1 fails, its replacement is the other target of its own domain, not
    the next target in rendezvous order, which may sit in a domain holding a fragment already
    (one domain with 2 of 3 fragments: losing it, m=1, would lose the entry)."""
    urls = [f"file://{tmp_path}/t{i}#d{i // 2}#t{i}" for i in range(6)]
    with kvstore.connect(str(tmp_path / "store"), targets=",".join(urls), ec_k=2, ec_m=1,
                         segments=False, fsync=False) as s:
        specs = s.target_specs
        dom = {t.name: t.domain for t in specs}
        key = keys[0]
        order = place(key, specs, len(specs))
        assert len({dom[n] for n in order[:3]}) == 3  # placement spreads them
        failed = order[1]
        root = s.targets[failed].root
        os.rename(root, root + ".away")
        assert s.put(key, value_for(key))
        placed = [r.target for r in fragment_refs(s, key)]
        assert failed not in placed
        assert len({dom[n] for n in placed}) == 3, (
            f"fragments on {placed}, domains {[dom[n] for n in placed]}: a domain holds 2 of 3 (m=1) "
            f"although {[n for n in order if dom[n] == dom[failed] and n != failed]} of the failed "
            "target's domain was free")


def test_fs_sync_mode_opens_syncfs_descriptor_before_the_writes(tmp_path, keys, monkeypatch):
    """sync_mode "fs": syncfs(2) reports a writeback error only if it happened after the
    descriptor passed to it was opened (Linux >= 5.8), so the descriptor of each target's
    filesystem is opened before the put's first write there, never after (a writeback error
    of its pages in between would go unreported and the put be acknowledged)."""
    if durability._SYNCFS is None:
        pytest.skip("no syncfs")
    events: list[tuple[str, str]] = []
    real_open, real_write = os.open, LocalTarget.write

    def traced_open(path, *a, **kw):
        events.append(("open", os.path.realpath(os.fspath(path))))
        return real_open(path, *a, **kw)

    def traced_write(self, rel, data, *, fsync):
        events.append(("write", os.path.realpath(self.root)))
        return real_write(self, rel, data, fsync=fsync)

    with kvstore.connect(str(tmp_path / "store"), segments=False, fsync=True, sync_mode="fs") as s:
        assert s.fragments.writer.sync_mode() == "fs"
        monkeypatch.setattr(LocalTarget, "write", traced_write)
        monkeypatch.setattr(durability.os, "open", traced_open)
        s.put(keys[0], value_for(keys[0]))
        monkeypatch.undo()
    roots = {r for kind, r in events if kind == "write"}
    assert roots
    first_write = next(i for i, e in enumerate(events) if e[0] == "write")
    synced = [i for i, e in enumerate(events) if e[0] == "open" and e[1] in roots]  # syncfs(root): one per filesystem
    assert synced, "syncfs never opened a target root"
    assert min(synced) < first_write, (
        f"the descriptor syncfs uses ({events[synced[0]][1]}) is opened after this put's "
        f"{sum(e[0] == 'write' for e in events)} writes: writeback errors before it are not reported")


def test_new_data_directory_refuses_targets_holding_another_directorys_fragments(tmp_path, keys, clock):
    """Two data directories given the same targets: the second, new, is refused, since its GC
    would take the first one's fragments for orphans and delete them; the first one's entries
    stay readable."""
    targets = ",".join(f"file://{tmp_path}/shared/t{i}" for i in range(6))
    with kvstore.connect(str(tmp_path / "a"), targets=targets, segments=False, fsync=False, clock=clock) as a:
        a.put_many([kvstore.PutItem(k, value_for(k)) for k in keys[:4]])
    with pytest.raises(kvstore.InvalidRequest, match="already holds files"):
        kvstore.connect(str(tmp_path / "b"), targets=targets, segments=False, fsync=False, clock=clock,
                        orphan_grace_s=0)
    with kvstore.connect(str(tmp_path / "a"), targets=targets, segments=False, fsync=False, clock=clock) as a:
        assert a.get_many(keys[:4]) == [value_for(k) for k in keys[:4]]
