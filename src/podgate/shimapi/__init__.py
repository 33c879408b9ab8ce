"""The sandbox shim's ttrpc API (`podgate.shim.v1.Shim`, generated from `shim.proto`) and where
its socket lives: shared by the shim (the server) and the agent backend (its client)."""

from __future__ import annotations

from pathlib import Path
from typing import Final

# The shim's ttrpc socket, in the pod's run directory.
SHIM_SOCKET: Final = "shim.sock"


def shim_socket(run_dir: Path) -> Path:
    return run_dir / SHIM_SOCKET
