"""Regenerate the committed gRPC stubs from ``kvstore/proto/kvstore.proto`` and
``entrypoint/proto/serving.proto``.

Command (from the repository root)::

    .venv/bin/python tools/gen_proto.py                       # rewrite every <package>/proto/*_pb2*.py
    .venv/bin/python tools/gen_proto.py --package entrypoint  # one of them
    .venv/bin/python tools/gen_proto.py --package kvstore --out DIR  # into DIR (the staleness tests)

Uses ``grpc_tools.protoc`` (the ``grpcio-tools`` dev dependency). The generated
``*_pb2_grpc.py`` imports its ``*_pb2`` as a top-level module; this script
rewrites that one import to ``from <package>.proto import ...`` so the stubs
work as a package. ``tests/kvstore/server/test_proto.py`` and
``tests/entrypoint/test_proto.py`` regenerate into a temporary directory and
fail when the committed files differ.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "kvstore" / "proto"
PROTO = "kvstore.proto"

# package -> its .proto under <package>/proto/ (a registry: add a row for another service)
PROTOS: dict[str, str] = {"kvstore": "kvstore.proto", "entrypoint": "serving.proto"}


def generate(out_dir: Path, package: str = "kvstore") -> list[Path]:
    """Run protoc for ``package``'s proto into ``out_dir``; return the written stub paths."""
    import grpc_tools
    from grpc_tools import protoc

    proto = PROTOS[package]
    proto_dir = ROOT / package / "proto"
    stem = proto.removesuffix(".proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}",
        f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", str(proto_dir / proto),
    ])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    grpc_py = out_dir / f"{stem}_pb2_grpc.py"
    text = grpc_py.read_text()
    # protoc writes a top-level import; the stubs live in a package.
    text = re.sub(rf"^import {stem}_pb2 as {stem}__pb2$", f"from {package}.proto import {stem}_pb2 as {stem}__pb2",
                  text, flags=re.M)
    grpc_py.write_text(text)
    return [out_dir / f"{stem}_pb2.py", grpc_py]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", choices=sorted(PROTOS), default=None, help="one package (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: <package>/proto)")
    args = ap.parse_args(argv)
    for pkg in [args.package] if args.package else sorted(PROTOS):
        for p in generate(args.out or ROOT / pkg / "proto", pkg):
            print(p)
    return 0


if __name__ == "__main__":
    from tools.cli_args import run_main

    run_main(main)
