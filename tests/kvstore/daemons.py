"""Fixtures for the tests that run a daemon (imported by ``tests.kvstore.conftest``): in-process daemons, subprocess daemons, certificates.

Everything listens on 127.0.0.1 with port 0 (a free port), fsync is off unless a
test is about durability, and every daemon is stopped at teardown.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.server import Daemon, load_server_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """``make_daemon(**overrides)`` starts an in-process daemon on a fresh data dir."""
    started: list[Daemon] = []

    def make(name: str = "d", store=None, **over) -> Daemon:
        over.setdefault("port", 0)
        over.setdefault("gc_interval_s", 0)
        over.setdefault("fsync", False)
        over.setdefault("data_dir", str(tmp_path / f"{name}{len(started)}"))
        scfg, stcfg = load_server_config(None, env={}, **over)
        d = Daemon(scfg, stcfg, store=store).start()
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop(grace_s=1)


def health_ok(address: str, timeout: float = 1.0) -> bool:
    host = address.split("://", 1)[1]
    with grpc.insecure_channel(host) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


class Proc:
    """A ``kvstore serve`` subprocess; ``address`` parsed from its first stdout line."""

    def __init__(self, data_dir: Path, *args: str, port: int = 0, cwd: Path | None = None, env=None):
        cmd = [sys.executable, "-m", "kvstore.server.cli", "serve", "--data-dir", str(data_dir),
               "--port", str(port), *args]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=cwd or ROOT, env=env)
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"daemon did not start: {self.p.stderr.read()[-3000:]}")
        m = re.search(r"(grpcs?://\S+)", line)
        assert m, line
        self.address = m.group(1)
        self.port = int(self.address.rsplit(":", 1)[1])
        self.line = line

    def kill(self) -> None:
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(10)

    def term(self, timeout: float = 30) -> int:
        self.p.send_signal(signal.SIGTERM)
        return self.p.wait(timeout)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)
        for f in (self.p.stdout, self.p.stderr):
            f.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    procs: list[Proc] = []

    def start(*a, **kw) -> Proc:
        p = Proc(*a, **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.close()


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = tmp_path_factory.mktemp("certs")
    now = datetime.datetime.now(datetime.timezone.utc)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem, k, cert):
        (d / f"{stem}.key").write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
        (d / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def build(subject, issuer, pub, signer, *, ca=False, san=None, usage=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer)).public_key(pub)
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key = key()
    ca = build("kvstack test CA", "kvstack test CA", ca_key.public_key(), ca_key, ca=True)
    write("ca", ca_key, ca)
    sk = key()
    write("server", sk, build("localhost", "kvstack test CA", sk.public_key(), ca_key,
                              san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
                              usage=ExtendedKeyUsageOID.SERVER_AUTH))
    ck = key()
    write("client", ck, build("client-1", "kvstack test CA", ck.public_key(), ca_key,
                              usage=ExtendedKeyUsageOID.CLIENT_AUTH))
    other_key = key()
    other_ca = build("other CA", "other CA", other_key.public_key(), other_key, ca=True)
    write("other_ca", other_key, other_ca)
    return {n: str(d / f"{n}.pem") for n in ("ca", "server", "client", "other_ca")} | {
        f"{n}_key": str(d / f"{n}.key") for n in ("server", "client")}


def wait_until(pred: Callable[[], bool], timeout: float = 15.0, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(extra)
    return env
