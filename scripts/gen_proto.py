"""Generate modeld/v1 (protobuf messages, type stubs, gRPC stubs) from proto/modeld/v1.

Usage: ``python scripts/gen_proto.py [OUT_DIR]`` (default: the repository root, which writes
``modeld/v1/*``). The drift test runs it into a temporary directory and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = Path("modeld/v1/modeld.proto")
GENERATED = ("modeld_pb2.py", "modeld_pb2.pyi", "modeld_pb2_grpc.py")


def googleapis_include() -> Path:
    import google.rpc

    return Path(next(iter(google.rpc.__path__))).parent.parent


def generate(out: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(next(iter(grpc_tools.__path__))) / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{ROOT / 'proto'}",
        f"-I{well_known}",
        f"-I{googleapis_include()}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(ROOT / "proto" / PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return [out / "modeld" / "v1" / name for name in GENERATED]


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(target):
        print(path.relative_to(target))
