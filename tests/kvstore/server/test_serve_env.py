"""``kvstore serve``'s sources, flags > ``KVSTORE_*`` > ``--config`` file > defaults: only
the value used for a field must be valid. A bad value that a higher source overrides is a
warning naming it (the daemon starts); a bad value that would be used is one
``kvstore serve:`` line and exit 2.

Every field of ``ServerConfig`` and ``StoreConfig`` is checked through
``load_server_config`` (what the CLI calls); two subprocess runs check the CLI itself.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.errors import InvalidRequest
from kvstore.server.config import SERVER_FIELDS, STORE_FIELDS, ServerConfig, load_server_config

from tests.kvstore.daemons import ROOT, subprocess_env

FIELDS = {**SERVER_FIELDS, **STORE_FIELDS}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _good_text(name: str, tmp_path: Path) -> str:
    """A value for the field, as text (a flag, a variable), that loads on its own; empty
    (which a variable cannot give: it counts as unset) only for the TLS files, which load
    only in pairs."""
    special = {"ec_k": "2", "ec_m": "1", "default_ttl_s": "60", "data_dir": str(tmp_path / "data"),
               "targets": ",".join(f"file://{tmp_path}/t{i}" for i in range(3)),
               "tls_cert": "", "tls_key": "", "tls_client_ca": "", "ec_type": "isa_l_rs_cauchy",
               "tokens_file": str(tmp_path / "tokens.toml"), "tenant_secret_file": str(tmp_path / "tenant.secret")}
    if name in special:
        return special[name]
    value = _default(FIELDS[name])
    return str(value).lower() if isinstance(value, bool) else str(value)


def _bad_text(name: str) -> str | None:
    """Text that cannot be coerced to the field's type (None: every text is a string)."""
    kind = str(FIELDS[name].type).removesuffix(" | None")
    if name == "targets":
        return "file:///a#d#n#extra"
    return {"int": "abc", "float": "abc", "bool": "maybe"}.get(kind)


ENV_BAD = [n for n in FIELDS if _bad_text(n) is not None]


def test_every_non_string_field_has_a_bad_value() -> None:
    assert {"port", "metrics_port", "gc_interval_s", "allow_direct_reads", "ec_k", "fsync", "targets"} <= set(ENV_BAD)


@pytest.mark.parametrize("name", ENV_BAD)
def test_a_bad_variable_under_a_flag_is_a_warning(name, tmp_path, caplog) -> None:
    var, bad = f"KVSTORE_{name.upper()}", _bad_text(name)
    over = {"data_dir": str(tmp_path / "data"), name: _good_text(name, tmp_path)}
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        scfg, stcfg = load_server_config(None, env={var: bad}, **over)
    assert var in caplog.text and repr(bad) in caplog.text, caplog.text
    assert f"option --{name.replace('_', '-')} overrides it" in caplog.text


@pytest.mark.parametrize("name", ENV_BAD)
def test_a_bad_variable_that_is_used_is_refused_naming_it(name, tmp_path) -> None:
    var = f"KVSTORE_{name.upper()}"
    with pytest.raises(InvalidRequest, match=var):
        load_server_config(None, env={var: _bad_text(name)}, data_dir=str(tmp_path / "data"))


def _toml_bad(name: str) -> str:
    """A TOML value of the wrong type for the field."""
    return "5" if str(FIELDS[name].type) == "str" or name == "targets" else '"abc"'


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_a_bad_file_key_under_a_variable_or_flag_is_a_warning(name, tmp_path, caplog) -> None:
    table = "server" if name in SERVER_FIELDS else "store"
    cfg = tmp_path / "kv.toml"
    cfg.write_text(f"[{table}]\n{name} = {_toml_bad(name)}\n")
    base = {} if name == "data_dir" else {"data_dir": str(tmp_path / "data")}
    with pytest.raises(InvalidRequest, match=name):
        load_server_config(cfg, env={}, **base)
    good = _good_text(name, tmp_path)
    env = {f"KVSTORE_{name.upper()}": good}
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        if good:
            load_server_config(cfg, env=env, **base)  # the variable wins
        else:  # an empty variable is unset: it never hides the file's value
            with pytest.raises(InvalidRequest, match=name):
                load_server_config(cfg, env=env, **base)
        load_server_config(cfg, env={}, **base, **{name: good})  # the flag wins
    assert caplog.text.count(str(cfg)) == (2 if good else 1), caplog.text


def test_a_precedence_chain_flag_over_env_over_file(tmp_path) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text("[server]\nport = 7001\ndrain_s = 1\ngc_interval_s = 2\n")
    scfg, _ = load_server_config(cfg, env={"KVSTORE_PORT": "7002", "KVSTORE_DRAIN_S": "3"}, port="7003",
                                 data_dir=str(tmp_path / "data"))
    assert (scfg.port, scfg.drain_s, scfg.gc_interval_s) == (7003, 3.0, 2.0)


def _serve(tmp_path: Path, *args: str, env: dict[str, str], timeout: float = 60) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvstore.server.cli", "serve", "--data-dir", str(tmp_path / "data"),
           "--gc-interval-s", "0", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=subprocess_env(**env))


def test_serve_starts_when_a_flag_overrides_a_bad_variable(tmp_path) -> None:
    p = _serve(tmp_path, "--port", "0", "--fsync", "false",
               env={"KVSTORE_PORT": "abc", "KVSTORE_FSYNC": "maybe", "KVSTORE_HOST": "127.0.0.1"})
    try:
        line = p.stdout.readline()
        assert line.startswith("kvstore serving grpc://127.0.0.1:"), (line, p.stderr.read()[-3000:] if not line else "")
        p.terminate()
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)
    assert p.returncode == 0, err[-3000:]
    warnings = [ln for ln in err.splitlines() if "WARNING" in ln]
    assert any("KVSTORE_PORT" in ln and "'abc'" in ln and "--port" in ln for ln in warnings), err[-3000:]
    assert any("KVSTORE_FSYNC" in ln and "'maybe'" in ln for ln in warnings), err[-3000:]


def test_serve_refuses_a_bad_variable_it_would_use_with_one_line(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvstore.server.cli", "serve", "--data-dir", str(tmp_path / "data")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=subprocess_env(KVSTORE_PORT="abc"))
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvstore serve:")]
    assert len(lines) == 1 and "KVSTORE_PORT" in lines[0] and "'abc'" in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not (tmp_path / "data").exists()


# ---- an empty KVSTORE_* variable counts as unset (a warning names it) ---------------------

@pytest.mark.parametrize("name", sorted(FIELDS))
def test_an_empty_variable_is_unset_and_warned(name, tmp_path, caplog) -> None:
    var = f"KVSTORE_{name.upper()}"
    base = {} if name == "data_dir" else {"data_dir": str(tmp_path / "data")}
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        scfg, stcfg = load_server_config(None, env={var: ""}, **base)
    cfg = scfg if name in SERVER_FIELDS else stcfg
    # a server default may be derived from others (workers, max_concurrent_requests): as constructed
    want = ("./kvstack-data" if name == "data_dir" else
            getattr(ServerConfig(), name) if name in SERVER_FIELDS else _default(FIELDS[name]))
    assert getattr(cfg, name) == want
    assert f"{var} is set but empty; ignored" in caplog.text, caplog.text


def test_empty_variables_do_not_turn_off_the_files_auth_or_tls(tmp_path, caplog) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text('[server]\ntokens_file = "/etc/kv/tokens.toml"\ntls_cert = "/etc/kv/c.pem"\n'
                   'tls_key = "/etc/kv/k.pem"\nport = 7001\n')
    env = {"KVSTORE_TOKENS_FILE": "", "KVSTORE_TLS_CERT": "", "KVSTORE_TLS_KEY": "", "KVSTORE_PORT": ""}
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        scfg, _ = load_server_config(cfg, env=env, data_dir=str(tmp_path / "data"))
    assert (scfg.tokens_file, scfg.tls_cert, scfg.tls_key, scfg.port) == (
        "/etc/kv/tokens.toml", "/etc/kv/c.pem", "/etc/kv/k.pem", 7001)
    for var in env:
        assert f"{var} is set but empty; ignored" in caplog.text, caplog.text


def test_serve_keeps_auth_on_under_an_empty_tokens_file_variable(tmp_path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('admin_tenants = ["ops"]\n[tokens]\n"secret-token-1" = "ops"\n')
    cfg = tmp_path / "auth.toml"
    cfg.write_text(f'[server]\ntokens_file = "{tokens}"\nhost = "127.0.0.1"\n')
    p = _serve(tmp_path, "--config", str(cfg), "--port", "0", env={"KVSTORE_TOKENS_FILE": ""})
    try:
        line = p.stdout.readline()
        assert line.startswith("kvstore serving grpc://127.0.0.1:"), (line, p.stderr.read()[-3000:] if not line else "")
        p.terminate()
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)
    assert "auth=True" in err, err[-3000:]
    assert any("WARNING" in ln and "KVSTORE_TOKENS_FILE is set but empty" in ln for ln in err.splitlines()), err[-3000:]


# ---- a host gRPC cannot bind: one line naming --host, no gRPC log line --------------------

@pytest.mark.parametrize("host", ["nosuch.invalid", "192.0.2.1"])  # unresolvable; TEST-NET-1, not local
def test_a_host_that_cannot_be_bound_is_refused_naming_it(host) -> None:
    from kvstore.netaddr import port_taken

    for port in (0, 7070):
        with pytest.raises(InvalidRequest, match=f"--host '{host}'"):
            port_taken(host, port)
    assert port_taken("127.0.0.1", 0) is False


def test_serve_refuses_an_unresolvable_host_in_one_line(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvstore.server.cli", "serve", "--log-level", "ERROR",
                        "--data-dir", str(tmp_path / "data"), "--host", "nosuch.invalid", "--port", "0"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=subprocess_env())
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore serve:") and "--host 'nosuch.invalid'" in lines[0], lines
    assert r.stdout == ""


# ---- a TOML string is no number or bool (text is parsed from variables and flags only) -----

def _typed_fields() -> list[str]:
    return [n for n in sorted(FIELDS)
            if str(FIELDS[n].type).removesuffix(" | None") in ("int", "float", "bool")]


@pytest.mark.parametrize("name", _typed_fields())
def test_a_quoted_number_or_bool_in_the_file_is_refused(name, tmp_path, caplog) -> None:
    table = "server" if name in SERVER_FIELDS else "store"
    good = _good_text(name, tmp_path)
    cfg = tmp_path / "kv.toml"
    cfg.write_text(f'[{table}]\n{name} = "{good}"\n')
    base = {"data_dir": str(tmp_path / "data")}
    with pytest.raises(InvalidRequest, match=f"'{name}'.*{cfg}"):
        load_server_config(cfg, env={}, **base)
    cfg.write_text(f"[{table}]\n{name} = {good}\n")  # unquoted: the TOML type
    load_server_config(cfg, env={}, **base)
    cfg.write_text(f'[{table}]\n{name} = "{good}"\n')
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        load_server_config(cfg, env={f"KVSTORE_{name.upper()}": good}, **base)  # the variable wins: a warning
    assert str(cfg) in caplog.text, caplog.text


def test_serve_refuses_a_quoted_port_in_the_file_in_one_line(tmp_path) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text('[server]\nport = "7071"\n')
    r = subprocess.run([sys.executable, "-m", "kvstore.server.cli", "serve", "--log-level", "ERROR",
                        "--data-dir", str(tmp_path / "data"), "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=subprocess_env())
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "'port'" in lines[0] and "an integer" in lines[0], lines
    assert r.stdout == ""


@pytest.mark.parametrize("host", ["[::1]", "::1"])
def test_serve_on_ipv6_loopback_with_metrics(host) -> None:
    """``--host [::1]`` failed to start the metrics endpoint (the brackets went to the HTTP
    server) and ``--host ::1`` was refused ('::1:0' is no address); both now serve gRPC and
    metrics on ::1 and print bracketed URLs."""
    import socket as _socket
    import subprocess
    import sys
    import tempfile
    import urllib.request

    import kvstore

    if not _socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        with _socket.socket(_socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.Popen([sys.executable, "-m", "kvstore.server.cli", "serve", "--data-dir", d, "--port", "0",
                              "--metrics-port", "0", "--host", host, "--log-level", "WARNING"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = p.stdout.readline()
            assert line.startswith("kvstore serving grpc://[::1]:"), (line, p.stderr.read() if p.poll() else "")
            metrics = line.split(" metrics ")[1].strip()
            assert metrics.startswith("http://[::1]:")
            with kvstore.connect(line.split()[2]) as s:
                assert s.put(b"6" * 16, b"v") and s.get(b"6" * 16) == b"v"
            body = urllib.request.urlopen(metrics, timeout=10).read().decode()
            assert 'kvstore_requests_total{code="OK",method="Put"} 1.0' in body
        finally:
            p.terminate()
            p.wait(30)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_a_non_finite_number_is_refused_and_warned_about_when_overridden(bad, tmp_path, caplog) -> None:
    """No knob takes nan or inf; one given as a variable under a flag was ignored without
    the warning every other unusable overridden value gets, since it converts to a float."""
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        load_server_config(None, env={"KVSTORE_STREAM_SEND_S": bad}, data_dir=str(tmp_path / "d"), stream_send_s="4")
    assert "KVSTORE_STREAM_SEND_S" in caplog.text and "option --stream-send-s overrides it" in caplog.text
    with pytest.raises(InvalidRequest, match="finite"):
        load_server_config(None, env={"KVSTORE_READ_TIMEOUT_S": bad}, data_dir=str(tmp_path / "d"))
