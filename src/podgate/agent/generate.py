"""Regenerate the agent API modules: `python -m podgate.agent.generate [OUT_ROOT]`.

A build tool, never imported at run time. Needs the test extras (grpcio-tools, mypy-protobuf).
The generated modules are committed; a test regenerates them into a temporary directory and
checks they are unchanged.
"""

from __future__ import annotations

import importlib
import sys
import sysconfig
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# protoc include root: the proto is registered as "podgate/agent/agent.proto".
SOURCE_ROOT = PACKAGE_DIR.parents[1]
PROTOS = (PACKAGE_DIR.relative_to(SOURCE_ROOT) / "agent.proto",)
GENERATED = ("agent_pb2.py", "agent_pb2.pyi")


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under `out_root` (mirroring the package path); return them."""
    protoc = importlib.import_module("grpc_tools.protoc")
    scripts = Path(sysconfig.get_path("scripts"))
    include = Path(importlib.import_module("grpc_tools").__file__ or "").parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    argv = [
        "grpc_tools.protoc",
        f"--proto_path={SOURCE_ROOT}",
        f"--proto_path={include}",
        f"--plugin=protoc-gen-mypy={scripts / 'protoc-gen-mypy'}",
        f"--python_out={out_root}",
        f"--mypy_out=quiet:{out_root}",
        *(str(proto) for proto in PROTOS),
    ]
    status = protoc.main(argv)
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status}")
    return [out_root / PROTOS[0].parent / name for name in GENERATED]


def main() -> None:
    out_root = Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE_ROOT
    for path in generate(out_root):
        print(path)


if __name__ == "__main__":
    main()
