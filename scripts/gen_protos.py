"""Regenerates the Python stubs in client/leasekeeper/v1 from protos/.

Usage: python scripts/gen_protos.py [OUT_DIR]

OUT_DIR defaults to client/ (the stubs land in OUT_DIR/leasekeeper/v1). The
proto freshness test runs this into a temporary folder and diffs the result
with the committed stubs, so the stubs never drift from the protos.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc on every .proto under protos/; returns the files written."""
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = str(resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted(p for p in out_dir.rglob("*_pb2*.py*"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "client"
    for path in generate(target):
        print(path)
