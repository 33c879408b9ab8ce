from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# e2e_support (kubectl runner, pty sessions, byte exchanges) lives beside these tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from gateway_support import Gateway, running_gateway


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    """One `podgate up` (runtime, sample pods, HTTPS gateway) for the test module."""
    if os.geteuid() != 0:
        pytest.skip("podgate up runs pods in Linux namespaces: needs root")
    with running_gateway() as running:
        yield running
