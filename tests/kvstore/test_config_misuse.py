"""Misuse of ``StoreConfig``, ``load_config`` and ``kvstore.connect``: each case is one
``InvalidRequest`` naming what is wrong, raised before anything is created on disk, or,
where the caller's intent is plain, the same store as the canonical spelling.

Covers: non-bool values for bool fields and wrong types for ``targets`` built directly
(text is parsed only by ``load_config``), ``data_dir=None`` as "not given", URL schemes
in any case, ``file:`` URLs with a query or fragment, and a bad value in a lower
source (``KVSTORE_*``, a TOML file) that a higher one overrides: a warning, not a refusal.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

import kvstore
from kvstore import InvalidRequest, StoreConfig, TargetSpec
from kvstore.config import load_config

BOOL_FIELDS = [f.name for f in dataclasses.fields(StoreConfig) if f.type == "bool"]


def _specs(tmp_path, n: int = 3) -> tuple[TargetSpec, ...]:
    return tuple(TargetSpec(f"file://{tmp_path}/t{i}", f"rack{i}") for i in range(n))


# ---- 1. bool fields built directly take a bool only ------------------------------------

def test_every_bool_field_is_found() -> None:
    assert {"fsync", "pack_batches", "tune_malloc"} <= set(BOOL_FIELDS)


@pytest.mark.parametrize("field", BOOL_FIELDS)
@pytest.mark.parametrize("value", ["false", "true", "", 0, 1, 0.0, None, [False]])
def test_a_bool_field_built_directly_refuses_a_non_bool(field, value) -> None:
    with pytest.raises(InvalidRequest, match=f"{field} must be True or False"):
        StoreConfig(**{field: value})


@pytest.mark.parametrize("field", BOOL_FIELDS)
def test_a_bool_field_takes_text_only_through_load_config(field) -> None:
    assert getattr(StoreConfig(**{field: False}), field) is False
    assert getattr(load_config(None, env={}, **{field: "off"}), field) is False
    assert getattr(load_config(None, env={f"KVSTORE_{field.upper()}": "yes"}), field) is True


@pytest.mark.parametrize("value", [1, 0, 2.0])
def test_load_config_refuses_a_number_for_a_bool(value) -> None:
    with pytest.raises(InvalidRequest, match="'fsync'"):
        load_config(None, env={}, fsync=value)


def test_a_number_for_a_bool_in_a_config_file_is_refused(tmp_path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[store]\nfsync = 0\n")
    with pytest.raises(InvalidRequest, match="'fsync'"):
        load_config(toml, env={})


@pytest.mark.parametrize("field", ["data_dir", "ec_type", "compression", "sync_mode", "parallel_reads"])
def test_a_string_field_built_directly_refuses_a_non_string(field) -> None:
    with pytest.raises(InvalidRequest, match=field):
        StoreConfig(**{field: 5})


def test_data_dir_may_be_a_path_object(tmp_path) -> None:
    assert StoreConfig(data_dir=tmp_path).data_dir == str(tmp_path)


# ---- 2. targets: a tuple of TargetSpec built directly; text through load_config ----------

@pytest.mark.parametrize("value", ["file:///x", b"file:///x", 5, None, {"url": "file:///x"},
                                   ["file:///x", "file:///y", "file:///z"]])
def test_targets_of_the_wrong_type_show_the_expected_form(value) -> None:
    with pytest.raises(InvalidRequest, match=r"targets must be a tuple of TargetSpec.*URL\[#DOMAIN\[#NAME\]\]"):
        StoreConfig(targets=value)


def test_a_mixed_targets_tuple_is_refused(tmp_path) -> None:
    with pytest.raises(InvalidRequest, match="TargetSpec"):
        StoreConfig(targets=(*_specs(tmp_path), "file:///y"))


def test_a_list_of_target_specs_is_kept_as_a_tuple(tmp_path) -> None:
    cfg = StoreConfig(targets=list(_specs(tmp_path)))
    assert cfg.targets == _specs(tmp_path)
    hash(cfg)  # frozen and hashable: no list inside


@pytest.mark.parametrize("kw", [dict(url=5), dict(url="file:///x", domain=1), dict(url="file:///x", name=b"n"),
                                dict(url=None)])
def test_a_target_spec_part_of_the_wrong_type_is_refused(kw) -> None:
    with pytest.raises(InvalidRequest, match="must be a string"):
        TargetSpec(**kw)


@pytest.mark.parametrize("value", [5, 2.5, {"url": "file:///x"}, [5], [None], [{"uri": "file:///x"}]])
def test_load_config_refuses_targets_of_the_wrong_form(value) -> None:
    with pytest.raises(InvalidRequest, match="targets"):
        load_config(None, env={}, targets=value)


def test_targets_as_text_and_tables_still_load(tmp_path) -> None:
    want = _specs(tmp_path, 2)
    text = ",".join(f"{t.url}#{t.domain}" for t in want)
    assert load_config(None, env={}, targets=text).targets == want
    assert load_config(None, env={"KVSTORE_TARGETS": text}).targets == want
    spaced = " , ".join(f" {t.url}#{t.domain} " for t in want) + ", "  # spaces around commas, a trailing one
    assert load_config(None, env={"KVSTORE_TARGETS": spaced}).targets == want
    toml = tmp_path / "c.toml"
    toml.write_text("[store]\ntargets = [" + ", ".join(f'{{url = "{t.url}", domain = "{t.domain}"}}' for t in want)
                    + "]\n")
    assert load_config(toml, env={}).targets == want


def test_a_store_key_that_is_not_a_table_is_refused(tmp_path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("store = 5\n")
    with pytest.raises(InvalidRequest, match=r"\[store\] table"):
        load_config(toml, env={})


# ---- 3. data_dir=None is "not given" ----------------------------------------------------

def test_data_dir_none_with_a_url_opens_the_url(tmp_path) -> None:
    d = tmp_path / "store"
    with kvstore.connect(str(d), data_dir=None, fsync=False) as s:
        assert s.data_dir == d.resolve()
    with pytest.raises(InvalidRequest, match="once"):
        kvstore.connect(str(d), data_dir=str(tmp_path / "other"))


def test_data_dir_none_without_a_url_falls_through_to_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_DATA_DIR", str(tmp_path / "env"))
    with kvstore.connect(data_dir=None, fsync=False) as s:
        assert s.data_dir == tmp_path / "env"


def test_data_dir_none_with_a_daemon_url_is_not_an_unknown_option() -> None:
    s = kvstore.connect("grpc://127.0.0.1:1", data_dir=None)  # no call made: channels connect lazily
    s.close()


# ---- 4. URL schemes are case-insensitive (RFC 3986 3.1) ----------------------------------

@pytest.mark.parametrize("form", ["FILE://{d}", "File://{d}", "fIlE://localhost{d}", "FILE:{d}"])
def test_a_file_scheme_in_any_case_opens_the_directory(tmp_path, form) -> None:
    d = tmp_path / "store"
    with kvstore.connect(form.format(d=d), fsync=False) as s:
        assert s.data_dir == d.resolve()
    assert [p.name for p in tmp_path.iterdir()] == ["store"]


@pytest.mark.parametrize("url", ["GRPC://127.0.0.1:1", "Grpc://127.0.0.1:1", "GRPCS://127.0.0.1:1"])
def test_a_daemon_scheme_in_any_case_is_the_daemon(url) -> None:
    s = kvstore.connect(url)
    try:
        assert s.url == url.lower()
    finally:
        s.close()


def test_a_shard_list_is_lowercased_entry_by_entry() -> None:
    s = kvstore.connect("GRPC://127.0.0.1:1, Grpc://127.0.0.1:2")
    try:
        assert s.urls == ["grpc://127.0.0.1:1", "grpc://127.0.0.1:2"]
    finally:
        s.close()
    with pytest.raises(InvalidRequest, match="distinct"):  # one daemon, two spellings
        kvstore.connect("GRPC://127.0.0.1:1,grpc://127.0.0.1:1")


def test_register_connector_keeps_the_scheme_lowercased(monkeypatch) -> None:
    monkeypatch.setattr(kvstore, "CONNECTORS", dict(kvstore.CONNECTORS))
    kvstore.register_connector("MEM", "kvstore.embedded.store:open_embedded")
    assert "mem" in kvstore.CONNECTORS and "MEM" not in kvstore.CONNECTORS


# ---- 5. a file URL holds a path only ----------------------------------------------------

@pytest.mark.parametrize("form", ["file://{d}?x=1", "file://{d}?", "file://{d}#frag", "FILE://{d}?x=1",
                                  "file:{d}?x=1", "file://localhost{d}#a", " file://{d}", ",file://{d}"])
def test_a_file_url_with_a_query_or_fragment_is_refused_and_creates_nothing(tmp_path, monkeypatch, form) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidRequest, match="file"):
        kvstore.connect(form.format(d=tmp_path / "p"), fsync=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["p?x=1", "p#frag"])
def test_a_plain_path_may_hold_query_and_fragment_characters(tmp_path, name) -> None:
    with kvstore.connect(str(tmp_path / name), fsync=False) as s:
        assert s.data_dir == (tmp_path / name).resolve()
    assert (tmp_path / name).is_dir()


# ---- 6. a bad value in a lower source that a higher one overrides -----------------------

def test_a_bad_variable_overridden_by_an_argument_is_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        cfg = load_config(None, env={"KVSTORE_FSYNC": "maybe", "KVSTORE_EC_K": "four"}, fsync=False, ec_k=2)
    assert (cfg.fsync, cfg.ec_k) == (False, 2)
    text = caplog.text
    assert "KVSTORE_FSYNC" in text and "'maybe'" in text and "KVSTORE_EC_K" in text and "'four'" in text


def test_a_bad_variable_that_is_used_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequest, match="KVSTORE_FSYNC.*'maybe'"):
        load_config(None, env={"KVSTORE_FSYNC": "maybe"})


def test_a_bad_file_key_overridden_by_a_variable_is_a_warning(tmp_path, caplog) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[store]\nread_workers = "many"\ntargets = 5\n')
    with pytest.raises(InvalidRequest, match="read_workers"):
        load_config(toml, env={})
    text = ",".join(f"file://{tmp_path}/t{i}" for i in range(3))
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        cfg = load_config(toml, env={"KVSTORE_READ_WORKERS": "3", "KVSTORE_TARGETS": text})
    assert cfg.read_workers == 3 and len(cfg.targets) == 3
    assert str(toml) in caplog.text and "'many'" in caplog.text


def test_connect_with_a_bad_variable_overridden_by_an_argument_opens(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_FSYNC", "sometimes")
    with kvstore.connect(str(tmp_path / "store"), fsync=False) as s:
        assert s.config.fsync is False


def test_open_embedded_itself_refuses_a_file_url_with_a_query(tmp_path, monkeypatch) -> None:
    """The opener behind ``connect`` checks too: code that calls it directly gets no ``p?x=1``."""
    from kvstore.embedded.store import open_embedded

    monkeypatch.chdir(tmp_path)
    for form in ("file://{d}?x=1", "file://{d}#a"):
        with pytest.raises(InvalidRequest, match="query"):
            open_embedded(form.format(d=tmp_path / "p"), fsync=False)
    assert list(tmp_path.iterdir()) == []


def test_a_daemon_config_file_serves_connect_too(tmp_path) -> None:
    """The daemon's file form ([server] and/or [store] tables) read by ``connect(config_file=)``:
    [server] is the daemon's and skipped, a server-only file sets no store field, and a stray
    top-level key beside the tables is refused rather than silently dropped."""
    both = tmp_path / "both.toml"
    both.write_text("[server]\nport = 7071\n[store]\nzstd_level = 7\n")
    assert load_config(both, env={}).zstd_level == 7
    server_only = tmp_path / "server.toml"
    server_only.write_text("[server]\nport = 7071\n")
    assert load_config(server_only, env={}) == load_config(None, env={})
    stray = tmp_path / "stray.toml"
    stray.write_text("zstd_level = 5\n[store]\nfsync = false\n")
    with pytest.raises(InvalidRequest, match="top level"):
        load_config(stray, env={})


# ---- 7. an empty KVSTORE_* variable is unset; a TOML string is no number or bool ---------

def test_an_empty_variable_counts_as_unset_with_a_warning(tmp_path, caplog) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[store]\nzstd_level = 7\nfsync = false\ndefault_ttl_s = 60\nec_type = "isa_l_rs_vand"\n')
    env = {"KVSTORE_ZSTD_LEVEL": "", "KVSTORE_FSYNC": "", "KVSTORE_DEFAULT_TTL_S": "", "KVSTORE_EC_TYPE": ""}
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        cfg = load_config(toml, env=env)
    assert (cfg.zstd_level, cfg.fsync, cfg.default_ttl_s, cfg.ec_type) == (7, False, 60.0, "isa_l_rs_vand")
    for var in env:
        assert f"{var} is set but empty; ignored" in caplog.text, caplog.text
    assert load_config(toml, env={"KVSTORE_DEFAULT_TTL_S": "none"}).default_ttl_s is None  # how to clear it


@pytest.mark.parametrize("line", ['ec_k = "4"', 'zstd_level = "3"', 'high_watermark = "0.9"', 'fsync = "off"',
                                  'default_ttl_s = "60"', 'pack_batches = "true"'])
def test_a_quoted_number_or_bool_in_a_config_file_is_refused(tmp_path, line) -> None:
    name = line.split()[0]
    toml = tmp_path / "c.toml"
    toml.write_text(f"[store]\n{line}\n")
    with pytest.raises(InvalidRequest, match=f"'{name}' in {toml}.*(integer|number|true or false).*TOML string"):
        load_config(toml, env={})
    toml.write_text(f"{line}\n")  # the flat, store-only form too
    with pytest.raises(InvalidRequest, match=f"'{name}'"):
        load_config(toml, env={})
    value = line.split("=", 1)[1].strip().strip('"')
    assert load_config(None, env={f"KVSTORE_{name.upper()}": value}) is not None  # text from a variable parses


@pytest.mark.parametrize("field, value", [("write_timeout_s", -1.0), ("write_timeout_s", 1e12),
                                          ("index_reserve_bytes", -1), ("index_reserve_bytes", 1 << 41)])
def test_write_timeout_and_index_reserve_out_of_range_are_refused(field, value) -> None:
    with pytest.raises(InvalidRequest, match=field):
        StoreConfig(**{field: value})
