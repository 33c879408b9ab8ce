from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
from runtime_e2e_support import Pods, RuntimeDaemon, running_daemon, state_root

from podgate.cri import api_pb2_grpc as pb_grpc


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the runtime creates namespaces")


@pytest.fixture(scope="session")
def runtime_daemon() -> Iterator[RuntimeDaemon]:
    """One `podgate runtime` for the suite; its pods are removed and it is stopped at the end."""
    _require_root()
    with state_root() as root, running_daemon(root) as daemon:
        yield daemon


@pytest.fixture
def fresh_daemon() -> Iterator[RuntimeDaemon]:
    """A daemon of the test's own (nothing else holds its streaming tokens)."""
    _require_root()
    with state_root() as root, running_daemon(root) as daemon:
        yield daemon


@pytest.fixture
async def cri(runtime_daemon: RuntimeDaemon) -> AsyncIterator[pb_grpc.RuntimeServiceStub]:
    """A RuntimeService client on the suite's daemon, bound to this test's event loop."""
    async with runtime_daemon.connect() as stub:
        yield stub


@pytest.fixture
async def pods(cri: pb_grpc.RuntimeServiceStub) -> AsyncIterator[Pods]:
    """Pods made through it are removed (with their containers) when the test ends."""
    made = Pods(cri)
    try:
        yield made
    finally:
        await made.remove_all()
