"""Regenerate the committed gRPC stubs from ``kvstore/proto/kvstore.proto``.

Command (from the repository root)::

    .venv/bin/python tools/gen_proto.py            # rewrite kvstore/proto/kvstore_pb2*.py
    .venv/bin/python tools/gen_proto.py --out DIR  # write into DIR instead (the staleness test)

Uses ``grpc_tools.protoc`` (the ``grpcio-tools`` dev dependency). The generated
``kvstore_pb2_grpc.py`` imports ``kvstore_pb2`` as a top-level module; this
script rewrites that one import to ``from kvstore.proto import kvstore_pb2`` so
the stubs work as a package. ``tests/daemon/test_proto.py`` regenerates into a
temporary directory and fails when the committed files differ.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "kvstore" / "proto"
PROTO = "kvstore.proto"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into ``out_dir``; return the written stub paths."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}",
        f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", str(PROTO_DIR / PROTO),
    ])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    grpc_py = out_dir / "kvstore_pb2_grpc.py"
    text = grpc_py.read_text()
    text = re.sub(r"^import kvstore_pb2 as kvstore__pb2$", "from kvstore.proto import kvstore_pb2 as kvstore__pb2",
                  text, flags=re.M)
    grpc_py.write_text(text)
    return [out_dir / "kvstore_pb2.py", grpc_py]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=PROTO_DIR, help="output directory (default: kvstore/proto)")
    args = ap.parse_args(argv)
    for p in generate(args.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
