"""Regenerate the shim API modules: `python -m podgate.runtime.sandbox.generate [OUT_DIR]`.

A build tool, never imported at run time. Needs the test extras (grpcio-tools, mypy-protobuf).
The generated modules are committed; a test regenerates them into a temporary directory and
checks they are unchanged.
"""

from __future__ import annotations

from pathlib import Path

from podgate.codegen import SOURCE_ROOT, main, run_protoc

PACKAGE_DIR = Path(__file__).resolve().parent
PROTOS = (PACKAGE_DIR.relative_to(SOURCE_ROOT) / "shim.proto",)
GENERATED = ("shim_pb2.py", "shim_pb2.pyi")


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under `out_root` (mirroring the package path); return them."""
    run_protoc(PROTOS, out_root)
    return [out_root / PROTOS[0].parent / name for name in GENERATED]


if __name__ == "__main__":
    main(generate)
