"""podgate: exec, attach and port-forward for every kind of pod sandbox."""

__version__ = "0.1.0"

import os as _os

# podgate forks helpers (pod holders, shims, exec) while gRPC threads run. gRPC's fork
# handlers only matter for a child that itself uses gRPC, which ours never do.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
