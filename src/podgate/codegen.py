"""protoc for podgate's committed protobuf modules: `python -m podgate.codegen [OUT_ROOT]`.

A build tool, never imported at run time. Needs the test extras (grpcio-tools, mypy-protobuf).
`PROTOS` names every proto; a test regenerates them into a temporary directory and checks the
committed modules are unchanged.
"""

from __future__ import annotations

import importlib
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# protoc include root: protos are registered as "podgate/<package path>/<name>.proto", and the
# generated modules import each other by that dotted path.
SOURCE_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class ProtoModule:
    proto: Path  # relative to SOURCE_ROOT
    grpc: bool = False  # also gRPC stubs (only the CRI is served over gRPC)

    def generated(self) -> list[str]:
        stem = self.proto.stem
        names = [f"{stem}_pb2.py", f"{stem}_pb2.pyi"]
        if self.grpc:
            names += [f"{stem}_pb2_grpc.py", f"{stem}_pb2_grpc.pyi"]
        return names


# Every committed protobuf module, in the order protoc needs them (imports first).
PROTOS: tuple[ProtoModule, ...] = (
    ProtoModule(Path("podgate/cri/api.proto"), grpc=True),
    ProtoModule(Path("podgate/proto/ttrpc/status.proto")),
    ProtoModule(Path("podgate/proto/ttrpc/envelope.proto")),
    ProtoModule(Path("podgate/agent/agent.proto")),
    ProtoModule(Path("podgate/shimapi/shim.proto")),
    ProtoModule(Path("podgate/nri/api.proto")),
)


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


def generate(out_root: Path) -> list[Path]:
    """Write every generated module under `out_root` (mirroring the package paths); return them."""
    written: list[Path] = []
    for module in PROTOS:
        run_protoc([module.proto], out_root, grpc=module.grpc)
        written += [out_root / module.proto.parent / name for name in module.generated()]
    return written


def main() -> None:
    out_root = Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE_ROOT
    for path in generate(out_root):
        print(path)


if __name__ == "__main__":
    main()
