"""``kvstore.connect``'s URL forms and ``StoreConfig``'s checks: every bad argument is one
typed error, raised before anything is created on disk."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

import kvstore
from kvstore import InvalidRequest
from kvstore.config import StoreConfig, load_config


@pytest.mark.parametrize("url", ["", "   ", ",", b"data", 5,
                                 "grpc:/127.0.0.1:7070", "grpc:127.0.0.1:7070", "grpcs:/h:1",
                                 "file://relative/x", "file://otherhost/abs/x", "file:relative"])
def test_a_mistyped_url_is_refused_and_creates_nothing(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidRequest):
        kvstore.connect(url)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("form", ["plain", "path", "file3", "localhost", "file1"])
def test_local_url_forms_open_the_same_directory(tmp_path, form):
    d = tmp_path / "store"
    url = {"plain": str(d), "path": d, "file3": f"file://{d}", "localhost": f"file://localhost{d}",
           "file1": f"file:{d}"}[form]
    with kvstore.connect(url, fsync=False) as s:
        assert s.data_dir == d.resolve()


def test_no_url_is_data_dir_then_the_environment_then_the_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVSTORE_DATA_DIR", raising=False)
    with kvstore.connect(fsync=False) as s:
        assert s.data_dir == (tmp_path / "kvstack-data").resolve()
    monkeypatch.setenv("KVSTORE_DATA_DIR", str(tmp_path / "env"))
    with kvstore.connect(fsync=False) as s:
        assert s.data_dir == tmp_path / "env"
    with kvstore.connect(data_dir=str(tmp_path / "given"), fsync=False) as s:
        assert s.data_dir == tmp_path / "given"
    with pytest.raises(InvalidRequest, match="once"):
        kvstore.connect(str(tmp_path / "a"), data_dir=str(tmp_path / "b"))


@pytest.mark.parametrize("bad", [
    dict(read_workers=0), dict(read_workers=-1), dict(lmdb_map_size=-1), dict(lmdb_map_size=4096),
    dict(lmdb_map_size=2**62), dict(max_readers=0), dict(max_readers=-5), dict(default_ttl_s=math.inf),
    dict(default_ttl_s=math.nan), dict(default_ttl_s=1e30), dict(clock_offset_s=math.nan),
    dict(clock_offset_s=-1e10), dict(zstd_level=100), dict(min_compress_ratio=-1), dict(min_compress_ratio=math.nan),
    dict(orphan_grace_s=-1), dict(delete_grace_s=math.nan), dict(access_flush_s=-1), dict(access_flush_s=math.inf),
    dict(read_timeout_s=math.nan), dict(ec_k=4.7), dict(ec_k=True), dict(fsync="yes please"),
    dict(capacity_bytes=1.5), dict(compression=3),
])
def test_a_bad_knob_is_one_typed_error_and_creates_nothing(tmp_path, bad):
    d = tmp_path / "store"
    with pytest.raises(InvalidRequest, match="|".join(bad)):
        kvstore.connect(str(d), **bad)
    assert not d.exists()


def test_knobs_are_checked_when_built_directly_too():
    with pytest.raises(InvalidRequest, match="read_workers must be an integer"):
        StoreConfig(read_workers="8")
    with pytest.raises(InvalidRequest, match="high_watermark must be a number"):
        StoreConfig(high_watermark=True)
    assert StoreConfig(high_watermark=1).high_watermark == 1


def test_strings_from_the_environment_still_coerce(tmp_path):
    cfg = load_config(None, env={"KVSTORE_READ_WORKERS": "3", "KVSTORE_EC_K": "2", "KVSTORE_EC_M": "",
                                 "KVSTORE_DEFAULT_TTL_S": "60", "KVSTORE_FSYNC": "off"},
                      data_dir=Path(os.fspath(tmp_path)))
    assert (cfg.read_workers, cfg.ec_k, cfg.ec_m, cfg.default_ttl_s, cfg.fsync) == (3, 2, None, 60.0, False)
    assert cfg.data_dir == str(tmp_path)
