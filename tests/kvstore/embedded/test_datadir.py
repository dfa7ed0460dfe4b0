"""Opening a data directory (``kvstore.embedded.datadir``): a resolved config, and the targets the
marker records for openers that name none."""

from __future__ import annotations

import pytest

import kvstore


def test_a_store_opens_with_another_stores_resolved_config(tmp_path):
    """A config that already names the directory's code (``store.config`` of an earlier
    store) opens the directory's targets too: before, they were never opened (AttributeError)."""
    from kvstore.embedded.store import EmbeddedStore

    with kvstore.connect(str(tmp_path / "d"), fsync=False) as s:
        assert s.put(b"k" * 16, b"v" * 100)
        cfg = s.config
    with EmbeddedStore(cfg) as again:
        assert again.get(b"k" * 16) == b"v" * 100
        assert again.check() == []


def test_the_directory_records_its_targets_for_openers_that_name_none(tmp_path):
    """Opened without targets (kvtool, a daemon without KVSTORE_TARGETS), a directory written
    to configured targets uses the ones its marker records; before, it opened the default
    t0..tN under the data directory and every entry read as lost. Credentials in a URL are
    never recorded; targets given explicitly win and are recorded in their turn; the default
    layout records nothing (the directory may move)."""
    import json

    from kvstore.config import TargetSpec

    roots = [tmp_path / f"disk{i}" for i in range(6)]
    specs = ",".join(f"file://{r}#rack{i % 3}" for i, r in enumerate(roots))
    data = tmp_path / "d"
    with kvstore.connect(str(data), targets=specs, fsync=False) as s:
        assert s.put(b"k" * 16, b"v" * 1000)
        want = s.target_specs
    marker = json.loads((data / "kvstore.json").read_text())
    assert [t["url"] for t in marker["targets"]] == [t.url for t in want]
    with kvstore.connect(str(data), fsync=False) as again:  # no targets named
        assert again.target_specs == want
        assert again.get(b"k" * 16) == b"v" * 1000 and again.check() == []
    assert not (data / "targets").exists()
    # Credentials never reach the marker.
    from kvstore.embedded.datadir import _targets_record
    from kvstore.config import StoreConfig

    assert _targets_record(StoreConfig(data_dir=str(data), targets=(TargetSpec("s3://AKIA:s3cr3t@bucket/p"),))) is None
    # The default layout records nothing.
    with kvstore.connect(str(tmp_path / "plain"), fsync=False):
        pass
    assert "targets" not in json.loads((tmp_path / "plain" / "kvstore.json").read_text())


def test_recorded_targets_are_absolute_and_a_moved_set_is_refused_not_lost(tmp_path, monkeypatch, caplog):
    """Relative target paths are recorded as the store resolved them (not resolved again from
    the next opener's working directory); recorded roots that are all gone (the directory
    moved with its disks, disks not mounted) refuse the open instead of marking every entry
    lost; a hand-edited record that is unusable names the marker; explicit targets that
    differ from the record are recorded with a warning."""
    import json
    import logging
    import shutil

    from kvstore.errors import IncompatibleFormat, InvalidRequest

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    data = tmp_path / "data"
    with kvstore.connect(str(data), targets="d0,d1,d2", ec_k=2, ec_m=1, fsync=False) as s:
        assert s.put(b"k" * 16, b"hello" * 100)
    rec = json.loads((data / "kvstore.json").read_text())["targets"]
    assert [t["url"] for t in rec] == [str(tmp_path / "a" / f"d{i}") for i in range(3)]
    monkeypatch.chdir(tmp_path / "b")
    with kvstore.connect(str(data), fsync=False) as s:
        assert s.get(b"k" * 16) == b"hello" * 100
    # The directory and its disks moved: refused, nothing marked lost.
    shutil.move(str(tmp_path / "a"), str(tmp_path / "moved"))
    with pytest.raises(InvalidRequest, match="moved"):
        kvstore.connect(str(data), fsync=False)
    targets = ",".join(f"{tmp_path / 'moved' / f'd{i}'}#default#d{i}" for i in range(3))  # same names
    with caplog.at_level(logging.WARNING, logger="kvstore.embedded.store"):
        with kvstore.connect(str(data), targets=targets, fsync=False) as s:  # named: used and recorded
            assert s.get(b"k" * 16) == b"hello" * 100 and s.stats()["lost_entries"] == 0
    assert "differ from those kvstore.json records" in caplog.text
    with kvstore.connect(str(data), fsync=False) as s:
        assert s.get(b"k" * 16) == b"hello" * 100
    doc = json.loads((data / "kvstore.json").read_text())
    doc["targets"] = [{"url": "", "domain": "x", "name": "t"}]
    (data / "kvstore.json").write_text(json.dumps(doc))
    with pytest.raises(IncompatibleFormat, match="kvstore.json"):
        kvstore.connect(str(data), fsync=False)


def test_credentials_in_target_urls_reach_neither_the_index_nor_stats_nor_errors(tmp_path, caplog):
    """A target URL with ``user:password@`` is named without it: before, the name defaulted to
    the URL, so the secret was written into the LMDB index (every record names its targets)
    and shown by stats and an admin's ``inspect``. An index written that way is scrubbed when
    opened, and its records still name their targets."""
    import json

    import lmdb

    from kvstore.config import TargetSpec, strip_userinfo

    secret = "s3cr3tPW"
    assert TargetSpec(f"s3://AKIA:{secret}@bucket/kv").name == "s3://bucket/kv"
    assert TargetSpec(f"s3://AKIA:{secret}@bucket/kv", name=f"s3://AKIA:{secret}@bucket/kv").name == "s3://bucket/kv"
    assert strip_userinfo("/data/a@b") == "/data/a@b" and strip_userinfo("file:///x/a@b") == "file:///x/a@b"
    assert strip_userinfo(f"s3://AKIA:{secret}%2Fx@bucket/kv") == "s3://bucket/kv"
    # An unencoded '/' in the password hides the '@' from URL parsers (the whole URL was
    # recorded as the name before): refused, without showing the secret.
    with pytest.raises(kvstore.InvalidRequest, match="percent-encode") as exc:
        kvstore.connect(str(tmp_path / "x"), targets=f"memory://AKIA:wJa/{secret}@b-t0/kv")
    assert secret not in str(exc.value) and not (tmp_path / "x").exists()
    # A '#' in the password cut the URL at TargetSpec.parse (the rest became the domain, the
    # whole secret was recorded in kvstore.json); config errors quoted the text as given.
    from kvstore.config import load_config

    for text in (f"memory://AK:{secret}#x@b-t0/kv", f"s3://AK:{secret}@b/p#d#n#extra"):
        with pytest.raises(kvstore.InvalidRequest) as exc:
            load_config(None, env={}, targets=text)
        assert secret not in str(exc.value), exc.value
    assert secret not in repr(TargetSpec(f"s3://AK:{secret}@bucket/kv"))
    urls = [f"memory://AKIA:{secret}@{tmp_path.name}-t{i}/kv" for i in range(6)]
    data = tmp_path / "d"
    with kvstore.connect(str(data), targets=",".join(urls), fsync=False) as s:
        assert s.put(b"k" * 16, b"v" * 5000)
        stats = s.stats()
        assert secret not in json.dumps(stats, default=str)
        assert [t["url"] for t in stats["targets"]] == [strip_userinfo(u) for u in urls]
        assert all(secret not in n for n in s.targets)
        # An error naming an unreachable target names it without the secret.
        t = next(iter(s.targets.values()))
        t._unreachable_at, t._unreachable_why = __import__("time").monotonic(), "test"
        with pytest.raises(Exception) as exc:
            t.read("x")
        assert secret not in str(exc.value)
        t._unreachable_at = float("-inf")
    index_bytes = (data / "index" / "data.mdb").read_bytes()
    assert secret.encode() not in index_bytes
    # An index written by the old code (names = credentialed URLs) is scrubbed on open.
    env = lmdb.open(str(data / "index"), max_dbs=16)
    tids = env.open_db(b"tids")
    with env.begin(write=True) as txn:
        for k, v in list(txn.cursor(db=tids)):
            txn.put(k, urls[[strip_userinfo(u) for u in urls].index(v.decode())].encode(), db=tids)
    env.close()
    with kvstore.connect(str(data), targets=",".join(urls), fsync=False) as again:
        assert again.get(b"k" * 16) == b"v" * 5000 and again.check() == []
    env = lmdb.open(str(data / "index"), max_dbs=16)
    tids = env.open_db(b"tids")
    with env.begin() as txn:
        names = [v.decode() for _, v in txn.cursor(db=tids)]
    env.close()
    assert len(names) == 6 and all(secret not in n for n in names)


def test_a_directory_whose_records_live_on_none_of_the_configured_targets_is_refused(tmp_path):
    """Its marker lost (or the wrong targets given), a directory written to configured targets
    would open with the default layout and ``verify`` would mark every entry lost (kvtool
    opens such a directory since the marker is rewritten from the index). Now the open is
    refused, naming the targets the records use, and nothing is created or rewritten."""
    from kvstore.errors import InvalidRequest

    roots = ",".join(f"file://{tmp_path}/disk{i}" for i in range(6))
    data = tmp_path / "d"
    with kvstore.connect(str(data), targets=roots, fsync=False) as s:
        assert s.put(b"k" * 16, b"v" * 3000)
    (data / "kvstore.json").unlink()
    with pytest.raises(InvalidRequest, match=f"live on targets .*{tmp_path}/disk.*missing"):
        kvstore.connect(str(data), fsync=False)
    assert sorted(p.name for p in data.iterdir()) == ["index"]  # no default targets, no marker
    other = ",".join(f"file://{tmp_path}/other{i}" for i in range(6))
    with pytest.raises(InvalidRequest, match="none of which is configured"):
        kvstore.connect(str(data), targets=other, fsync=False)
    with kvstore.connect(str(data), targets=roots, fsync=False) as s:  # the right ones: all there
        assert s.get(b"k" * 16) == b"v" * 3000 and s.check() == []
    assert (data / "kvstore.json").is_file()
    with pytest.raises(InvalidRequest, match="not this directory's"):  # marker there, wrong targets
        kvstore.connect(str(data), targets=other, fsync=False)
    # Any recorded target configured is enough (a subset, or new ones beside them): opens.
    some = ",".join([f"file://{tmp_path}/disk0"] + [f"file://{tmp_path}/other{i}" for i in range(5)])
    with kvstore.connect(str(data), targets=some, fsync=False):
        pass
    # Only lost entries: it opens with new targets (to be repaired or emptied).
    with kvstore.connect(str(data), targets=roots, fsync=False) as s:
        s.delete(b"k" * 16)
        assert s.put(b"j" * 16, b"w" * 3000)
    for i in range(6):
        __import__("shutil").rmtree(tmp_path / f"disk{i}", ignore_errors=True)
    with kvstore.connect(str(data), targets=roots, fsync=False) as s:
        s.check(fix=True)
        assert s.stats()["entries"] == 0 and s.stats()["lost_entries"] == 1
    with kvstore.connect(str(data), targets=other, fsync=False) as s:
        assert s.stats()["lost_entries"] == 1


def test_a_renamed_target_is_refused_a_replaced_one_is_not(tmp_path, caplog):
    """Records name their targets: a target given a new name at its old URL would read as
    missing (every fragment there degraded, repair rewriting them beside themselves). Before,
    the store opened with a warning; now it refuses and names the old name. A target replaced
    by another (a new URL and name) still opens, for repair to rebuild onto."""
    import logging

    from kvstore.errors import InvalidRequest

    data = tmp_path / "data"
    spec = lambda i, name: f"{tmp_path / f'd{i}'}#default#{name}"  # noqa: E731
    targets = [spec(i, f"t{i}") for i in range(6)]
    with kvstore.connect(str(data), targets=",".join(targets), fsync=False) as s:
        s.put(b"k" * 16, b"hello" * 100)
    renamed = [*targets[:2], spec(2, "fast"), *targets[3:]]
    with pytest.raises(InvalidRequest, match="'t2' is now configured as 'fast'.*recorded name"):
        kvstore.connect(str(data), targets=",".join(renamed), fsync=False)
    with kvstore.connect(str(data), targets=",".join(targets), fsync=False) as s:  # the marker is unchanged
        assert s.get(b"k" * 16) == b"hello" * 100 and s.counters["degraded_reads"] == 0
    replaced = [*targets[:2], spec(9, "t9"), *targets[3:]]
    (tmp_path / "d9").mkdir()  # a new disk, mounted
    with caplog.at_level(logging.WARNING, logger="kvstore.embedded.store"):
        with kvstore.connect(str(data), targets=",".join(replaced), fsync=False) as s:
            assert s.get(b"k" * 16) == b"hello" * 100
            assert s.repair()["unfixed"] == 0
    assert "differ from those kvstore.json records" in caplog.text


@pytest.mark.parametrize("first, then", [("plain", "file"), ("file", "plain")])
def test_a_rename_is_refused_however_the_local_url_is_spelled(tmp_path, first, then):
    """A target renamed at its old directory, the directory spelled ``/x`` once and
    ``file:///x`` the other time (either way round). Before, the URLs were compared as
    written, so the rename opened and every fragment there read as missing."""
    from kvstore.errors import InvalidRequest

    data = tmp_path / "data"
    url = lambda i, how: (f"file://{tmp_path / f'd{i}'}" if how == "file" else str(tmp_path / f"d{i}"))  # noqa: E731
    targets = lambda how, names: ",".join(f"{url(i, how)}#default#{n}" for i, n in enumerate(names))  # noqa: E731
    names = [f"t{i}" for i in range(6)]
    with kvstore.connect(str(data), targets=targets(first, names), fsync=False) as s:
        s.put(b"k" * 16, b"hello" * 100)
    with pytest.raises(InvalidRequest, match="'t2' is now configured as 'fast'"):
        kvstore.connect(str(data), targets=targets(then, [*names[:2], "fast", *names[3:]]), fsync=False)
    with kvstore.connect(str(data), targets=targets(then, names), fsync=False) as s:  # the same names: fine
        assert s.get(b"k" * 16) == b"hello" * 100 and s.counters["degraded_reads"] == 0


@pytest.mark.parametrize("first, then", [("plain", "file"), ("file", "plain"), ("file", "local")])
def test_the_same_targets_spelled_otherwise_are_not_taken_for_others(tmp_path, caplog, first, then):
    """The directory's own targets, a local one spelled ``/x`` once and ``file:///x`` (or
    ``local:///x``) the next time: the same targets, so no "configured targets differ" warning
    and the marker is left as it is. Before, the records were compared as written: a warning
    on every open and the marker rewritten each time the spelling changed."""
    import logging

    data = tmp_path / "data"
    url = lambda i, how: str(tmp_path / f"d{i}") if how == "plain" else f"{how}://{tmp_path / f'd{i}'}"  # noqa: E731
    targets = lambda how: ",".join(f"{url(i, how)}#default#t{i}" for i in range(6))  # noqa: E731
    with kvstore.connect(str(data), targets=targets(first), fsync=False) as s:
        s.put(b"k" * 16, b"hello" * 100)
    before = (data / "kvstore.json").read_bytes()
    with caplog.at_level(logging.WARNING, logger="kvstore.embedded.store"):
        with kvstore.connect(str(data), targets=targets(then), fsync=False) as s:
            assert s.get(b"k" * 16) == b"hello" * 100
    assert "differ from those kvstore.json records" not in caplog.text
    assert (data / "kvstore.json").read_bytes() == before


def test_a_relative_file_url_is_recorded_absolute_as_a_relative_path_is(tmp_path, monkeypatch):
    """``file://d0`` is the relative directory ``d0`` (fsspec reads everything after ``://`` as
    the path): recorded as written, the next opener in another working directory opened other,
    empty directories and every entry read as lost. Now recorded as absolute as ``d0`` is."""
    import json

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    data = tmp_path / "data"
    with kvstore.connect(str(data), targets="file://d0,file://d1,local://d2", ec_k=2, ec_m=1, fsync=False) as s:
        assert s.put(b"k" * 16, b"hello" * 100)
    rec = json.loads((data / "kvstore.json").read_text())["targets"]
    assert [t["url"] for t in rec] == [f"{s}://{tmp_path / 'a' / f'd{i}'}" for i, s in
                                       enumerate(["file", "file", "local"])]
    monkeypatch.chdir(tmp_path / "b")
    with kvstore.connect(str(data), fsync=False) as s:  # the targets as recorded
        assert s.get(b"k" * 16) == b"hello" * 100 and s.stats()["lost_entries"] == 0


def test_a_moved_set_of_local_scheme_targets_is_refused_not_lost(tmp_path):
    """Recorded ``local:///x`` targets that are all gone refuse the open, as plain paths and
    ``file://`` URLs do; before, only those two counted as local, so the store opened on the
    missing roots and the first read marked the entry lost."""
    import shutil

    from kvstore.errors import InvalidRequest

    data = tmp_path / "data"
    targets = ",".join(f"local://{tmp_path / 'disks' / f'd{i}'}" for i in range(3))
    with kvstore.connect(str(data), targets=targets, ec_k=2, ec_m=1, fsync=False) as s:
        assert s.put(b"k" * 16, b"hello" * 100)
    shutil.move(str(tmp_path / "disks"), str(tmp_path / "moved"))
    with pytest.raises(InvalidRequest, match="moved"):
        kvstore.connect(str(data), fsync=False)
    shutil.move(str(tmp_path / "moved"), str(tmp_path / "disks"))
    with kvstore.connect(str(data), fsync=False) as s:
        assert s.get(b"k" * 16) == b"hello" * 100 and s.stats()["lost_entries"] == 0


def _store_with_an_old_relative_marker(tmp_path, monkeypatch):
    """A store written from ``tmp_path/a`` on targets ``a/d0..d2`` (one entry), its marker then
    given the relative URLs older code recorded (``file://d0``); (data directory, the targets
    as named absolutely). The working directory is left at ``a``."""
    import json

    monkeypatch.chdir(tmp_path / "a")
    data = tmp_path / "data"
    targets = ",".join(f"file://{tmp_path / 'a' / f'd{i}'}#default#t{i}" for i in range(3))
    with kvstore.connect(str(data), targets=targets, ec_k=2, ec_m=1, fsync=False) as s:
        assert s.put(b"k" * 16, b"hello" * 100)
    marker = json.loads((data / "kvstore.json").read_text())
    marker["targets"] = [dict(t, url=f"file://d{i}") for i, t in enumerate(marker["targets"])]  # the old form
    (data / "kvstore.json").write_text(json.dumps(marker))
    return data, targets


def test_an_old_marker_with_relative_urls_is_rewritten_absolute_by_an_opener_naming_them(tmp_path, monkeypatch):
    """A marker written before relative ``file://d0`` URLs were recorded absolute holds them as
    written (meaning the opener's working directory). An opener naming the same directories
    absolutely rewrites the marker in absolute form; before, the records compared equal by
    place, the marker stayed relative, and a later opener elsewhere naming no targets opened
    other, empty directories and marked the entry lost."""
    import json

    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "d1").mkdir(parents=True)  # an unrelated directory where the old URL points from b
    data, targets = _store_with_an_old_relative_marker(tmp_path, monkeypatch)
    with kvstore.connect(str(data), targets=targets, fsync=False) as s:
        assert s.get(b"k" * 16) == b"hello" * 100
    rec = json.loads((data / "kvstore.json").read_text())["targets"]
    assert [t["url"] for t in rec] == [f"file://{tmp_path / 'a' / f'd{i}'}" for i in range(3)]
    monkeypatch.chdir(tmp_path / "b")
    with kvstore.connect(str(data), fsync=False) as s:  # the targets as recorded
        assert s.get(b"k" * 16) == b"hello" * 100 and s.stats()["lost_entries"] == 0


@pytest.mark.parametrize("how", ["symlink", "file-single-slash", "local-no-slashes", "home"])
def test_a_rename_is_refused_whatever_spelling_opens_the_same_directory(tmp_path, monkeypatch, how):
    """The rename check compares what the targets open: a symlinked spelling of the recorded
    directories, ``file:/x`` (one slash) and ``local:x`` (opened as ``/x`` and ``x``) and ``~/x``.
    Before, the URLs were cut up by hand (``file:/x`` read as ``<cwd>/file:/x``, ``~`` kept) and
    symlinks not resolved, so the rename opened and every fragment there read as missing."""
    import json
    import os

    from kvstore.errors import InvalidRequest

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "disks").mkdir()
    os.symlink(tmp_path / "disks", tmp_path / "link")
    data = tmp_path / "data"
    spell = {"symlink": lambda i: str(tmp_path / "link" / f"d{i}"),
             "file-single-slash": lambda i: f"file:{tmp_path / 'disks' / f'd{i}'}",
             "local-no-slashes": lambda i: f"local:disks/d{i}",
             "home": lambda i: f"~/disks/d{i}"}[how]
    names = [f"t{i}" for i in range(6)]
    with kvstore.connect(str(data), targets=",".join(f"{tmp_path / 'disks' / f'd{i}'}#default#{n}"
                                                     for i, n in enumerate(names)), fsync=False) as s:
        s.put(b"k" * 16, b"hello" * 100)
    targets = lambda names: ",".join(f"{spell(i)}#default#{n}" for i, n in enumerate(names))  # noqa: E731
    with pytest.raises(InvalidRequest, match="'t2' is now configured as 'fast'"):
        kvstore.connect(str(data), targets=targets([*names[:2], "fast", *names[3:]]), fsync=False)
    with kvstore.connect(str(data), targets=targets(names), fsync=False) as s:  # the same names: fine
        assert s.get(b"k" * 16) == b"hello" * 100 and s.counters["degraded_reads"] == 0
    # recorded as the targets open, so an opener elsewhere naming none finds them
    rec = [t["url"] for t in json.loads((data / "kvstore.json").read_text())["targets"]]
    assert all(os.path.realpath(u.partition("://")[2] or u) == str(tmp_path / "disks" / f"d{i}")
               for i, u in enumerate(rec)), rec
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with kvstore.connect(str(data), fsync=False) as s:
        assert s.get(b"k" * 16) == b"hello" * 100 and s.stats()["lost_entries"] == 0


def test_a_file_url_with_host_localhost_is_the_local_path(tmp_path, monkeypatch, caplog):
    """``file://localhost/x`` (RFC 8089: host ``localhost`` is this machine) opens ``/x``, is
    recorded as ``file:///x`` and equals ``file:///x`` when compared with the marker; before,
    fsspec's reading made it ``<cwd>/localhost/x``: fragments went under the working directory,
    and an opener spelling the same targets ``file:///x`` found none of them."""
    import json
    import logging

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    disks = tmp_path / "disks"
    targets = ",".join(f"file://localhost{disks / f'd{i}'}#default#t{i}" for i in range(3))
    with kvstore.connect(str(data), targets=targets, ec_k=2, ec_m=1, fsync=False) as s:
        assert s.put(b"k" * 16, b"hello" * 100)
    assert not (tmp_path / "localhost").exists()
    assert all(any(p.is_file() for p in (disks / f"d{i}").rglob("*")) for i in range(3))
    rec = json.loads((data / "kvstore.json").read_text())["targets"]
    assert [t["url"] for t in rec] == [f"file://{disks / f'd{i}'}" for i in range(3)]
    before = (data / "kvstore.json").read_bytes()
    plain = ",".join(f"file://{disks / f'd{i}'}#default#t{i}" for i in range(3))
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        for spelled in (plain, targets):  # either spelling: the same targets, the marker as it was
            with kvstore.connect(str(data), targets=spelled, fsync=False) as s:
                assert s.get(b"k" * 16) == b"hello" * 100 and s.stats()["lost_entries"] == 0
    assert "differ from those kvstore.json records" not in caplog.text
    assert (data / "kvstore.json").read_bytes() == before


def test_an_old_marker_with_relative_urls_is_refused_by_an_opener_naming_no_targets(tmp_path, monkeypatch):
    """A marker written before relative URLs were recorded absolute holds ``file://d0``: the
    working directory of the process that wrote it, which an opener naming no targets does not
    know. Before, it opened them under its own working directory: there, other directories of
    those names (empty, or another store's for the orphan sweep to empty) read every entry as
    lost. Now it is refused, saying to name the targets, which rewrites the marker absolute."""
    from kvstore.errors import InvalidRequest

    (tmp_path / "a").mkdir()
    for i in range(3):
        (tmp_path / "b" / f"d{i}").mkdir(parents=True)  # other directories of the recorded names
    data, targets = _store_with_an_old_relative_marker(tmp_path, monkeypatch)
    for where in ("b", "a"):  # even the writer's own directory: nothing says it is
        monkeypatch.chdir(tmp_path / where)
        with pytest.raises(InvalidRequest, match="relative paths.*Name the targets"):
            kvstore.connect(str(data), fsync=False)
    assert not any(p.is_file() for p in (tmp_path / "b").rglob("*"))
    with kvstore.connect(str(data), targets=targets, fsync=False) as s:  # named once: recorded absolute
        assert s.get(b"k" * 16) == b"hello" * 100
    monkeypatch.chdir(tmp_path / "b")
    with kvstore.connect(str(data), fsync=False) as s:
        assert s.get(b"k" * 16) == b"hello" * 100 and s.stats()["lost_entries"] == 0


def test_a_default_target_name_spells_host_localhost_as_the_local_path(tmp_path, monkeypatch, caplog):
    """A target's name defaults to its URL: ``file://localhost/x`` and ``file:///x`` open one
    directory, but their default names differed, so a store created with one spelling was
    refused when reopened with the other ("none of which is configured", after logging that
    the targets differ). Now both name ``file:///x``; a name recorded as ``file://localhost/x``
    (by code between the two fixes) is read, and rewritten in the index, as ``file:///x``."""
    import json
    import logging

    monkeypatch.chdir(tmp_path)
    data, disks = tmp_path / "data", tmp_path / "disks"
    plain = ",".join(f"file://{disks / f'd{i}'}" for i in range(3))
    local = ",".join(f"file://localhost{disks / f'd{i}'}" for i in range(3))
    with kvstore.connect(str(data), targets=plain, ec_k=2, ec_m=1, fsync=False) as s:
        assert s.put(b"k" * 16, b"hello" * 100)
    before = (data / "kvstore.json").read_bytes()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with kvstore.connect(str(data), targets=local, fsync=False) as s:
            assert sorted(s.targets) == [f"file://{disks / f'd{i}'}" for i in range(3)]
            assert s.get(b"k" * 16) == b"hello" * 100 and s.check() == []
    assert "differ from those kvstore.json records" not in caplog.text
    assert (data / "kvstore.json").read_bytes() == before
    # names recorded in the localhost spelling, in the marker and in the index's target table
    doc = json.loads(before)
    for t in doc["targets"]:
        t["name"] = t["name"].replace("file://", "file://localhost", 1)
    (data / "kvstore.json").write_text(json.dumps(doc))
    with kvstore.connect(str(data), fsync=False) as s:
        tids = s.index.db["tids"]
        with s.index.env.begin(write=True) as txn:
            for k, v in list(txn.cursor(db=tids)):
                txn.put(k, v.replace(b"file://", b"file://localhost", 1), db=tids)
    for spelled in (plain, local, None):
        with kvstore.connect(str(data), targets=spelled, fsync=False) as s:
            assert s.get(b"k" * 16) == b"hello" * 100 and s.check() == []
            assert s.index.target_names() == set(s.targets)


def test_a_name_recorded_for_a_directory_that_holds_fragments_is_not_re_pointed(tmp_path, monkeypatch):
    """A marker that records the name ``file://localhost/x`` at ``<cwd>/localhost/x``: given
    the same URLs, the store would open ``/x`` under the same name, the checks for renamed and
    foreign targets would pass, the marker would be rewritten to ``/x`` and the first reads
    would mark every entry lost. Refused, with both places named; once the directories are
    moved there, the store opens."""
    import json

    from kvstore.errors import InvalidRequest

    run, disks, data = tmp_path / "run", tmp_path / "disks", tmp_path / "data"
    run.mkdir()
    monkeypatch.chdir(run)
    old = ",".join(f"file://{run}/localhost{disks / f'd{i}'}#default#file://localhost{disks / f'd{i}'}"
                   for i in range(3))  # recorded at <cwd>/localhost/...
    local = ",".join(f"file://localhost{disks / f'd{i}'}" for i in range(3))
    with kvstore.connect(str(data), targets=old, ec_k=2, ec_m=1, fsync=False) as s:
        assert s.put(b"k" * 16, b"hello" * 100)
    before = (data / "kvstore.json").read_bytes()
    with pytest.raises(InvalidRequest, match="targets moved") as err:
        kvstore.connect(str(data), targets=local, fsync=False)
    assert f"{run}/localhost{disks / 'd0'}" in str(err.value) and "localhost/PATH" in str(err.value)
    assert (data / "kvstore.json").read_bytes() == before
    with kvstore.connect(str(data), fsync=False) as s:  # as recorded: all there
        assert s.get(b"k" * 16) == b"hello" * 100 and s.stats()["lost_entries"] == 0
    (run / "localhost" / str(disks)[1:]).rename(disks)  # moved where the URLs now point
    with kvstore.connect(str(data), targets=local, fsync=False) as s:
        assert s.get(b"k" * 16) == b"hello" * 100 and s.check() == []
    rec = json.loads((data / "kvstore.json").read_text())["targets"]
    assert [t["url"] for t in rec] == [f"file://{disks / f'd{i}'}" for i in range(3)]


def _moved_store(tmp_path, root):
    data = tmp_path / "data"
    urls = ",".join(f"file://{root}/d{i}#default#t{i}" for i in range(3))
    with kvstore.connect(str(data), targets=urls, ec_k=2, ec_m=1, fsync=False) as s:
        assert s.put(b"k" * 16, b"v" * 500)
    return data


def test_a_target_moved_into_a_subdirectory_of_its_old_place_opens(tmp_path):
    """Fragments moved one level down (d0 -> d0/kv) under the same names: the old place's only
    files are the configured target's own, so nothing was left behind (refused as moved)."""
    disks = tmp_path / "disks"
    data = _moved_store(tmp_path, disks)
    for i in range(3):
        d, tmp = disks / f"d{i}", disks / f"tmp{i}"
        d.rename(tmp)
        d.mkdir()
        tmp.rename(d / "kv")
    urls = ",".join(f"file://{disks}/d{i}/kv#default#t{i}" for i in range(3))
    with kvstore.connect(str(data), targets=urls, fsync=False) as s:
        assert s.get(b"k" * 16) == b"v" * 500 and s.check() == []


def test_the_same_directories_through_a_bind_mount_open(tmp_path):
    """The recorded directories reached through a bind mount (one inode, another path) are not
    moved (refused, with advice to move them where they already were)."""
    import subprocess

    disks, alias = tmp_path / "disks", tmp_path / "alias"
    data = _moved_store(tmp_path, disks)
    alias.mkdir()
    r = subprocess.run(["mount", "--bind", str(disks), str(alias)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"no bind mount here: {r.stderr.strip()}")
    try:
        urls = ",".join(f"file://{alias}/d{i}#default#t{i}" for i in range(3))
        with kvstore.connect(str(data), targets=urls, fsync=False) as s:
            assert s.get(b"k" * 16) == b"v" * 500 and s.check() == []
    finally:
        subprocess.run(["umount", str(alias)], check=False)


def test_targets_refused_as_moved_or_renamed_are_not_said_to_be_recorded(tmp_path, caplog):
    """"The configured targets differ ... recording them instead" was logged before the checks
    for renamed and moved targets, which then refused the open: the log said the new targets
    were recorded, and the marker still held the old ones. Logged once they are recorded."""
    import logging

    from kvstore.errors import InvalidRequest

    disks, other = tmp_path / "disks", tmp_path / "other"
    data = _moved_store(tmp_path, disks)
    before = (data / "kvstore.json").read_bytes()
    moved = ",".join(f"file://{other}/d{i}#default#t{i}" for i in range(3))
    renamed = ",".join(f"file://{disks}/d{i}#default#{'x' if i == 2 else 't'}{i}" for i in range(3))
    for urls, why in ((moved, "targets moved"), (renamed, "targets renamed")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            with pytest.raises(InvalidRequest, match=why):
                kvstore.connect(str(data), targets=urls, fsync=False)
        assert "differ from those kvstore.json records" not in caplog.text
        assert (data / "kvstore.json").read_bytes() == before
    (other / "d0").mkdir(parents=True)  # a new disk, t3, beside the others: recorded, and said so
    added = ",".join([f"file://{other}/d0#default#t3", *(f"file://{disks}/d{i}#default#t{i}" for i in range(3))])
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with kvstore.connect(str(data), targets=added, fsync=False) as s:
            assert s.get(b"k" * 16) == b"v" * 500
    assert "differ from those kvstore.json records; recording them instead" in caplog.text
    assert (data / "kvstore.json").read_bytes() != before


def _entries_written(data, n: int = 12) -> dict[bytes, bytes]:
    """Entries written by this code: a batch (pack files) and single puts; key -> bytes."""
    import os as _os

    blobs = {bytes([i]) * 16: _os.urandom(1000 + 997 * i) for i in range(n)}
    items = list(blobs.items())
    with kvstore.connect(str(data), fsync=False) as s:
        assert all(s.put_many([kvstore.PutItem(k, v) for k, v in items[: n // 2]]))
        for k, v in items[n // 2:]:
            assert s.put(k, v)
    return blobs


def _set_version(data, version: int) -> dict:
    """Rewrite the marker's ``format_version``; returns the marker as it was."""
    import json

    marker = data / "kvstore.json"
    doc = json.loads(marker.read_text())
    marker.write_text(json.dumps({**doc, "format_version": version}))
    return doc


def test_the_marker_records_this_format_version(tmp_path):
    """A new directory is written as version 3, the one whose packs may grow by appends; a
    version 2 directory is the one kvtool migrate takes to it."""
    import json

    from kvstore.embedded.datadir import DATA_FORMAT_VERSION, MIGRATES_FROM

    assert DATA_FORMAT_VERSION == 3 and MIGRATES_FROM == {2}
    with kvstore.connect(str(tmp_path / "d"), fsync=False):
        pass
    assert json.loads((tmp_path / "d" / "kvstore.json").read_text())["format_version"] == DATA_FORMAT_VERSION


def test_a_version_2_directory_is_refused_until_migrated_then_reads_back_every_byte(tmp_path):
    """A version 2 directory (a kvstack that assumes packs never grow may still use it) is
    refused at open with what to do, `kvtool migrate DIR`, and nothing in it is changed; once
    migrated it opens, every entry reads back byte for byte and check finds nothing."""
    from kvstore.errors import IncompatibleFormat
    from kvstore.maintenance.migrate import migrate

    data = tmp_path / "d"
    blobs = _entries_written(data)
    before = _set_version(data, 2)
    marker = (data / "kvstore.json").read_bytes()
    with pytest.raises(IncompatibleFormat) as refused:
        kvstore.connect(str(data), fsync=False)
    message = str(refused.value)
    assert f"kvtool migrate {data}" in message and "format version 2" in message
    assert "stop every process using the directory" in message
    assert (data / "kvstore.json").read_bytes() == marker  # a refused open writes nothing

    result = migrate(data)
    assert (result.from_version, result.to_version, result.migrated) == (2, 3, True)
    import json

    assert json.loads((data / "kvstore.json").read_text()) == {**before, "format_version": 3}
    with kvstore.connect(str(data), fsync=False) as s:
        for k, v in blobs.items():
            assert s.get(k) == v
        assert s.check() == []


@pytest.mark.parametrize("version", [1, 4, 99])
def test_a_directory_of_a_version_migrate_does_not_take_is_refused_by_both(tmp_path, version):
    """Version 1 keeps its refusal (no migration from it: a matching release, or a fresh
    directory); a newer version than this code's is refused alike. migrate refuses both and
    leaves the marker as it was."""
    from kvstore.errors import IncompatibleFormat
    from kvstore.maintenance.migrate import migrate

    data = tmp_path / "d"
    _entries_written(data, n=2)
    _set_version(data, version)
    marker = (data / "kvstore.json").read_bytes()
    with pytest.raises(IncompatibleFormat, match=f"format version {version}, this kvstore reads version 3") as refused:
        kvstore.connect(str(data), fsync=False)
    assert "kvtool migrate" not in str(refused.value)
    with pytest.raises(IncompatibleFormat, match=f"format version {version}.*takes only version 2"):
        migrate(data)
    assert (data / "kvstore.json").read_bytes() == marker
