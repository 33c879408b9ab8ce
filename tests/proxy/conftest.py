from __future__ import annotations

import sys
from pathlib import Path

# The private containerd and the kubectl runner live with the e2e tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
