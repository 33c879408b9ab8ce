from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from servers import RunningServers, demo_servers


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServers]:
    """The demo API (pod default/demo) with echo and sink targets, in a background thread."""
    with demo_servers(str(tmp_path_factory.mktemp("demo"))) as servers:
        yield servers
