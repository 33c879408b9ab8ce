"""Regenerate the NRI wire modules: `python -m podgate.nri.generate [OUT_DIR]`.

A build tool, never imported at run time (needs the test extras). The generated modules are
committed; a test regenerates them into a temporary directory and checks they are unchanged.
"""

from __future__ import annotations

from pathlib import Path

from podgate.codegen import SOURCE_ROOT, main, run_protoc

PACKAGE_DIR = Path(__file__).resolve().parent
PROTOS = (PACKAGE_DIR.relative_to(SOURCE_ROOT) / "api.proto",)
GENERATED = ("api_pb2.py", "api_pb2.pyi")


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under `out_root` (mirroring the package path); return them."""
    run_protoc(PROTOS, out_root)
    return [out_root / PROTOS[0].parent / name for name in GENERATED]


if __name__ == "__main__":
    main(generate)
