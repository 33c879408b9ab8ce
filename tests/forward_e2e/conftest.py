from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The kubectl runner (e2e), the audit log reader (gateway) and the runtime daemon (runtime/e2e)
# live beside these tests.
_TESTS = Path(__file__).resolve().parents[1]
for _where in ("e2e", "gateway", "runtime/e2e"):
    sys.path.insert(0, str(_TESTS / _where))

from forward_e2e_support import Stack, running_stack  # noqa: E402


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """`podgate runtime` plus `podgate node` in front of it, for one test module."""
    if os.geteuid() != 0:
        pytest.skip("the runtime makes Linux namespaces: needs root")
    with running_stack() as running:
        yield running
