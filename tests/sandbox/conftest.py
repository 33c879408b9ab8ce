from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

# The runtime suite's helpers (runtime_e2e_support) are reused by module name.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "e2e"))

from runtime_e2e_support import Pods, RuntimeDaemon
from sandbox_support import sandbox_daemon

from podgate.cri import api_pb2_grpc as pb_grpc


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: sandboxes are made of namespaces")


@pytest.fixture(scope="session")
def sandbox_runtime() -> Iterator[RuntimeDaemon]:
    """One `podgate runtime` with the default backends (sandboxed pods: agent, then exec)."""
    _require_root()
    with sandbox_daemon() as daemon:
        yield daemon


@pytest.fixture
async def cri(sandbox_runtime: RuntimeDaemon) -> AsyncIterator[pb_grpc.RuntimeServiceStub]:
    async with sandbox_runtime.connect() as stub:
        yield stub


@pytest.fixture
async def pods(cri: pb_grpc.RuntimeServiceStub) -> AsyncIterator[Pods]:
    made = Pods(cri)
    try:
        yield made
    finally:
        await made.remove_all()
