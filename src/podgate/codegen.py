"""protoc for podgate's committed protobuf modules (CRI, ttrpc envelope, agent, sandbox shim).

A build tool, never imported at run time. Needs the test extras (grpcio-tools, mypy-protobuf).
Each package's `generate` module names its protos; tests regenerate into a temporary directory
and check the committed modules are unchanged.
"""

from __future__ import annotations

import importlib
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

# protoc include root: protos are registered as "podgate/<package path>/<name>.proto", and the
# generated modules import each other by that dotted path.
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def run_protoc(protos: Sequence[Path], out_root: Path, *, grpc: bool = False) -> None:
    """Generate `*_pb2.py` and typed `.pyi` (and gRPC stubs with `grpc`) under `out_root`."""
    protoc = importlib.import_module("grpc_tools.protoc")
    scripts = Path(sysconfig.get_path("scripts"))
    include = Path(importlib.import_module("grpc_tools").__file__ or "").parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    argv = [
        "grpc_tools.protoc",
        f"--proto_path={SOURCE_ROOT}",
        f"--proto_path={include}",
        f"--plugin=protoc-gen-mypy={scripts / 'protoc-gen-mypy'}",
    ]
    if grpc:
        argv.append(f"--plugin=protoc-gen-mypy_grpc={scripts / 'protoc-gen-mypy_grpc'}")
    argv += [f"--python_out={out_root}"]
    if grpc:
        argv.append(f"--grpc_python_out={out_root}")
    argv.append(f"--mypy_out=quiet:{out_root}")
    if grpc:
        argv.append(f"--mypy_grpc_out=quiet:{out_root}")
    argv += [str(proto) for proto in protos]
    status = protoc.main(argv)
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status}")


def main(generate: Callable[[Path], list[Path]]) -> None:
    """`python -m <package>.generate [OUT_ROOT]`: regenerate (in place by default)."""
    out_root = Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE_ROOT
    for path in generate(out_root):
        print(path)
