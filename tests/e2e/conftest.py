from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_support import UpgradeLog

import podgate.node.kubeapi as demo_api
from podgate.streaming.server import serve_stream
from servers import RunningServers


@pytest.fixture(scope="module")
def upgrades(demo: RunningServers) -> Iterator[UpgradeLog]:
    """Every upgrade request the demo API serves while the module runs (which wire, which URL,
    how it ended). Depends on `demo` so sessions can finish before the servers stop."""
    log = UpgradeLog()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo_api, "serve_stream", log.wrap(serve_stream))
        yield log
        log.settle()
