from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from streaming_support import Api, start_api, stop_api


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    """The demo API (pod default/demo) and its port-forward targets, in the test's loop.

    Fails the test at teardown if a server connection handler raised or never finished, or if
    a connection into the pod outlived its client."""
    running = await start_api()
    yield running.api
    stuck = await stop_api(running)
    assert not running.api.errors, f"server handlers raised: {running.api.errors!r}"
    assert not stuck, f"{len(stuck)} server handler(s) still running after their client left"
    await running.api.pod_connections_closed()
