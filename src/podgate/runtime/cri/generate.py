"""Regenerate the CRI stubs from api.proto: `python -m podgate.runtime.cri.generate [OUT_DIR]`.

Needs the test extras (grpcio-tools, mypy-protobuf). The generated modules are committed; a test
regenerates them into a temporary directory and checks they are unchanged.
"""

from __future__ import annotations

from pathlib import Path

from podgate.codegen import SOURCE_ROOT, main, run_protoc

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO = PACKAGE_DIR.relative_to(SOURCE_ROOT) / "api.proto"
GENERATED = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py", "api_pb2_grpc.pyi")


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under `out_root` (mirroring the package path); return them."""
    run_protoc([PROTO], out_root, grpc=True)
    return [out_root / PROTO.parent / name for name in GENERATED]


if __name__ == "__main__":
    main(generate)
