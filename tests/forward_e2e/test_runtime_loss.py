"""The runtime dies (SIGKILL) under an active `kubectl port-forward` connection and a `kubectl
logs -f` (issue: streams under abuse, "restart the runtime under active forwards and logs -f:
every client sees an error, not a clean end").

`podgate node` runs in front of a separate `podgate runtime`; the runtime is killed as a
crash would kill it, then started again on the same state. The forwarded connection is an
echo in full flow (never half-closed by the client, so no end of it is a clean one for the
echo server); kubectl must say the forward failed. `kubectl logs -f` of a container printing
a line every 0.2 s must not end with status 0 as if the container had exited.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest
from e2e_support import Forwarder
from forward_e2e_support import (
    ECHO_PORT,
    EVENT_SECONDS,
    READ_BYTES,
    Stack,
    free_port,
    kubectl_forward,
    stop_pid,
    tail,
)
from runtime_e2e_support import RuntimeDaemon

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

LOGGER = "trap 'exit 0' TERM; i=0; while true; do i=$((i+1)); echo \"tick $i\"; sleep 0.2; done"
# Lines `kubectl logs -f` shows before the kill: the follow is under way.
LINES_BEFORE_KILL = 3
# Echo chunk size; each one is read back before the next is sent.
ECHO_CHUNK_BYTES = 64 * 1024
# Echoed before the kill: the connection is in full flow.
ECHO_BEFORE_KILL_BYTES = 4 * 1024 * 1024
# How long a client may take to notice the runtime is gone.
NOTICE_SECONDS = 30.0


class Echoer:
    """Echo ECHO_CHUNK_BYTES at a time through the forward until the connection ends or
    `stop()`; `outcome` says how it ended and `echoed` counts the bytes that came back."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=NOTICE_SECONDS)
        self.echoed = 0
        self.outcome = ""
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        chunk = os.urandom(ECHO_CHUNK_BYTES)
        try:
            while not self._stop.is_set():
                self.sock.sendall(chunk)
                got = bytearray()
                while len(got) < len(chunk):
                    data = self.sock.recv(READ_BYTES)
                    if not data:
                        self.outcome = "eof"
                        return
                    got += data
                assert got == chunk, "the echo came back changed"
                self.echoed += len(got)
            self.outcome = "stopped"
        except OSError as exc:
            self.outcome = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()

    def wait_echoed(self, count: int) -> None:
        deadline = time.monotonic() + EVENT_SECONDS
        while self.echoed < count:
            assert not self.done.is_set(), f"the echo ended early: {self.outcome}"
            assert time.monotonic() < deadline, f"only {self.echoed} bytes echoed"
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(EVENT_SECONDS)
        self.sock.close()


def _wait_for(forwarder: Forwarder, needle: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while needle not in forwarder.stdout:
        if time.monotonic() > deadline or forwarder.proc.poll() is not None:
            return needle in forwarder.stdout
        time.sleep(0.05)
    return True


def test_runtime_killed_under_forward_and_logs_follow(stack: Stack) -> None:
    namespace = stack.namespace()
    pod = stack.pods.run_pod(namespace, "svc")
    stack.pods.server(pod, "first")
    stack.pods.start(pod, "log", ["sh", "-c", LOGGER], b"tick 1")
    kubectl = stack.kubectl()
    local = free_port()
    logs_argv = kubectl.argv(["logs", "-f", "-n", namespace, "svc", "-c", "log"])
    with kubectl_forward(kubectl, namespace, "svc", local, ECHO_PORT) as forward:
        logs = Forwarder(
            subprocess.Popen(
                logs_argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=kubectl.environ(),
            ),
            0,
            0,
        )
        echo = Echoer(local)
        try:
            assert _wait_for(logs, f"tick {LINES_BEFORE_KILL}\n", EVENT_SECONDS), logs.stderr
            echo.wait_echoed(ECHO_BEFORE_KILL_BYTES)

            stack.runtime.kill()
            assert echo.done.wait(NOTICE_SECONDS), "the forwarded connection is still open"
            try:
                logs_rc: int | None = logs.wait_exit(NOTICE_SECONDS)
            except subprocess.TimeoutExpired:
                logs_rc = None
            # Started again on the same state, as a supervisor would: what the clients saw
            # at the loss stays what it was.
            stack.runtime = RuntimeDaemon.start(stack.runtime.state_dir, stack.runtime.output)
            time.sleep(1.0)
            forward_stderr = forward.stderr
            record = (
                f"forwarded connection ended with {echo.outcome} after {echo.echoed} bytes; "
                f"kubectl port-forward stderr:\n{tail(forward_stderr)}\n"
                f"kubectl logs -f: status {logs_rc}, last lines "
                f"{logs.stdout.splitlines()[-2:]}, stderr:\n{tail(logs.stderr)}\n"
                f"gateway log:\n{tail(stack.node.log_text(), 30)}"
            )
            print(record)
        finally:
            echo.close()
            stop_pid(logs.proc)
            logs.join_readers()
            for pipe in (logs.proc.stdout, logs.proc.stderr):
                if pipe is not None:
                    pipe.close()
    # The forwarded connection: reset, or kubectl reporting the failed forward.
    assert (
        echo.outcome.startswith("ConnectionResetError")
        or "an error occurred forwarding" in forward_stderr
    ), record
    # logs -f: it ends, with an error, never a silent clean end.
    assert logs_rc is not None and logs_rc != 0, record
    assert "error" in logs.stderr.lower(), record
