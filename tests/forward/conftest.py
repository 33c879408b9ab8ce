from __future__ import annotations

import sys
from pathlib import Path

# forward_support beside these tests; e2e_support (pty sessions, byte exchanges) and
# gateway_support (`podgate up` with TLS and kubeconfigs) from their directories.
HERE = Path(__file__).resolve().parent
for directory in (HERE, HERE.parent / "e2e", HERE.parent / "gateway"):
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
