"""`podgate port-forward` keeps forwarding through what ends `kubectl port-forward`: the
target server crashing and coming back, the gateway restarting, the pod being recreated.
And it ends with a distinct exit status when it cannot go on: 4 when access is denied, 3
when the pod is gone for longer than --gone-timeout.

Every scenario runs against the real stack (`podgate runtime` + `podgate node`) and real
pods; for the crash, kubectl 1.33 runs side by side and what it does is asserted and printed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
from forward_e2e_support import (
    ECHO_PORT,
    EVENT_SECONDS,
    HOLD_PORT,
    IDENT_PORT,
    PodgateForward,
    Pusher,
    Stack,
    echo_roundtrip,
    free_port,
    ident,
    kubectl_forward,
    podgate_forward,
    tail,
)
from gateway_support import matching

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

# Bytes an active connection writes before its server is killed: well inside the session
# (many frames, queued in the pod where nobody reads them), and less than the buffers along
# the way hold, so the writer never blocks.
PUSH_BEFORE_KILL_BYTES = 1024 * 1024
# Echoed through the forward after each recovery; random, so only a real echo matches.
ECHO_BYTES = 4 * 1024 * 1024 + 7
# How long kubectl may take to exit once a connection was refused in the pod.
KUBECTL_EXIT_SECONDS = 20.0
# How long `podgate port-forward` may take to give up (4: denied at once; 3: --gone-timeout 1
# plus the pod lookups around it).
GIVE_UP_SECONDS = 30.0
# Generous, so the forward never gives up on a pod while it is being recreated.
GONE_TIMEOUT = "120"
# After the pod is recreated, how long new connections may keep failing before one reaches
# the new pod (the forward notices the new uid, then opens a new session).
FOLLOW_SECONDS = 30.0
# Pause between those tries.
FOLLOW_POLL_SECONDS = 0.2


def _peer(sock: socket.socket) -> str:
    """A local client's own address, as the forward's events name it ("peer")."""
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def _is(kind: str, **fields: Any) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("event") == kind and all(e.get(k) == v for k, v in fields.items())


def _failed(peer: str) -> Callable[[dict[str, Any]], bool]:
    """connection_error, or connection_closed carrying an error, for the client at `peer`."""

    def check(e: dict[str, Any]) -> bool:
        kind = e.get("event")
        return e.get("peer") == peer and (
            kind == "connection_error" or (kind == "connection_closed" and bool(e.get("error")))
        )

    return check


def _read_refused(port: int) -> tuple[str, bytes]:
    """Connect through a forward while nothing listens in the pod: the client's address and
    what it reads (nothing: the forward closes or resets the local connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=EVENT_SECONDS) as sock:
        try:
            return _peer(sock), sock.recv(100)
        except ConnectionResetError:
            return _peer(sock), b""


def _echo_works(forward: PodgateForward) -> None:
    data = os.urandom(ECHO_BYTES)
    got = echo_roundtrip(forward.local_port(ECHO_PORT), data)
    assert got == hashlib.sha256(data).hexdigest(), forward.describe()


def test_target_server_crash_and_restart(stack: Stack) -> None:
    """The server in the pod dies under an active connection, a client connects while it is
    down, then it comes back. podgate: both connections fail, with events saying so, the
    process stays, and new connections reach the restarted server. kubectl 1.33 on the same
    pod survives the crash but exits on the refused connection, so its port is gone."""
    namespace = stack.namespace()
    pod = stack.pods.run_pod(namespace, "svc")
    first = stack.pods.server(pod, "first")
    kubectl_port = free_port()
    ports = [f"0:{HOLD_PORT}", f"0:{ECHO_PORT}", f"0:{IDENT_PORT}"]
    with (
        podgate_forward(stack, "pod/svc", ports, namespace=namespace) as forward,
        kubectl_forward(stack.kubectl(), namespace, "svc", kubectl_port, HOLD_PORT) as kubectl,
    ):
        hold = forward.local_port(HOLD_PORT)
        assert ident(forward.local_port(IDENT_PORT)).split()[0] == "first"

        # One active connection through each tool, data piling up in the pod.
        mark = forward.mark()
        ours = Pusher(hold, PUSH_BEFORE_KILL_BYTES)
        theirs = Pusher(kubectl_port, PUSH_BEFORE_KILL_BYTES)
        try:
            ours.wait_sent()
            theirs.wait_sent()
            peer = ours.peer
            forward.wait_event(_is("connection_opened", peer=peer, remote=HOLD_PORT), mark=mark)
            # Both connections reached the server in the pod before it dies.
            stack.pods.wait_log(first, b"held 2")
            stack.pods.kill(first)
            ours_end, theirs_end = ours.wait_end(), theirs.wait_end()
        finally:
            ours.close()
            theirs.close()
        failed = forward.wait_event(_failed(peer), mark=mark)
        assert (failed["remote"], failed["protocol"]) == (HOLD_PORT, "tcp"), failed
        assert failed["bytes_out"] > 0 and failed["bytes_in"] == 0, failed
        kubectl_after_crash = kubectl.proc.poll()

        # While the server is down, one connection through each tool: refused in the pod.
        mark = forward.mark()
        peer, got = _read_refused(hold)
        assert got == b""
        refused = forward.wait_event(_failed(peer), mark=mark)
        assert refused["remote"] == HOLD_PORT, refused
        if kubectl_after_crash is None:
            with contextlib.suppress(ConnectionRefusedError):  # unless it is exiting just now
                assert _read_refused(kubectl_port)[1] == b""
        try:
            kubectl_rc: int | None = kubectl.wait_exit(KUBECTL_EXIT_SECONDS)
        except subprocess.TimeoutExpired:  # still running: recorded, and asserted below
            kubectl_rc = None
        record = (
            f"kubectl 1.33: exit status right after the crash {kubectl_after_crash} (its "
            f"connection ended with: {theirs_end}); after the refused connection {kubectl_rc}; "
            f"stderr:\n{tail(kubectl.stderr)}"
        )
        print(record)
        print(f"podgate: connection ended with {ours_end}; events {failed} and {refused}")

        # The server comes back: a new container in the same pod.
        stack.pods.remove_container(first)
        stack.pods.server(pod, "second", attempt=1)
        assert forward.proc.poll() is None, forward.describe()
        _echo_works(forward)
        assert ident(forward.local_port(IDENT_PORT)).split()[0] == "second"
        assert forward.proc.poll() is None, forward.describe()

        assert kubectl_after_crash is None, record
        assert kubectl_rc == 1, record
        assert "error: lost connection to pod" in kubectl.stderr, record
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", kubectl_port), timeout=EVENT_SECONDS).close()
        assert forward.interrupt() == 0, forward.describe()
    assert forward.wait_event(_is("stopped")), forward.describe()


def test_gateway_restart(stack: Stack) -> None:
    """The gateway is stopped and started again (same port, same state) while a forward has
    an active connection: the forward says session_lost, then reconnected, and new
    connections work without restarting it."""
    namespace = stack.namespace()
    pod = stack.pods.run_pod(namespace, "svc")
    stack.pods.server(pod, "steady")
    ports = [f"0:{ECHO_PORT}", f"0:{IDENT_PORT}", f"0:{HOLD_PORT}"]
    with podgate_forward(stack, "pod/svc", ports, namespace=namespace) as forward:
        _echo_works(forward)
        pid = forward.proc.pid
        mark = forward.mark()
        active = Pusher(forward.local_port(HOLD_PORT), PUSH_BEFORE_KILL_BYTES)
        try:
            active.wait_sent()
            assert stack.node.stop() == 0, tail(stack.node.log_text())
            lost = forward.wait_event(_is("session_lost"), mark=mark)
            ended = active.wait_end()
        finally:
            active.close()
        stack.node.start()
        back = forward.wait_event(_is("reconnected"), mark=mark)
        events = [e["event"] for e in forward.since(mark)]
        assert events.index("session_lost") < events.index("reconnected"), events
        assert lost["target"] == back["target"] == f"{namespace}/svc", (lost, back)
        print(f"active connection through the restart ended with: {ended}; events: {events}")

        assert forward.proc.poll() is None and forward.proc.pid == pid, forward.describe()
        _echo_works(forward)
        assert ident(forward.local_port(IDENT_PORT)).split()[0] == "steady"
        assert forward.interrupt() == 0, forward.describe()


def test_pod_recreated(stack: Stack) -> None:
    """The pod is deleted and created again under the same namespace and name (a new
    sandbox, a new uid, another hostname and server token): new connections reach the new
    pod, with the same forward."""
    namespace = stack.namespace()
    old = stack.pods.run_pod(namespace, "mover", hostname="mover-old")
    stack.pods.server(old, "old-token")
    extra = ["--gone-timeout", GONE_TIMEOUT]
    ports = [f"0:{IDENT_PORT}", f"0:{ECHO_PORT}"]
    with podgate_forward(stack, "mover", ports, namespace=namespace, extra=extra) as forward:
        port = forward.local_port(IDENT_PORT)
        assert ident(port) == "old-token mover-old"
        mark = forward.mark()
        stack.pods.remove_pod(old)
        new = stack.pods.run_pod(namespace, "mover", hostname="mover-new")
        assert new.uid != old.uid and new.id != old.id
        stack.pods.server(new, "new-token")
        answers = []
        deadline = time.monotonic() + FOLLOW_SECONDS
        while time.monotonic() < deadline:
            try:
                answer = ident(port)
            except OSError as exc:
                answer = f"{type(exc).__name__}"
            answers.append(answer)
            if answer == "new-token mover-new":
                break
            assert forward.proc.poll() is None, forward.describe()
            time.sleep(FOLLOW_POLL_SECONDS)
        assert answers[-1] == "new-token mover-new", (answers[-5:], forward.describe())
        assert "old-token mover-old" not in answers, answers
        _echo_works(forward)
        assert forward.proc.poll() is None, forward.describe()
        kinds = [e["event"] for e in forward.since(mark)]
        print(f"{len(answers)} tries until the new pod answered; events: {kinds}")
        assert forward.interrupt() == 0, forward.describe()


def test_denied_user_exits_4(stack: Stack) -> None:
    """A user the policy gives nothing: exit status 4, and the gateway's audit log shows
    the denial."""
    namespace = stack.namespace()
    pod = stack.pods.run_pod(namespace, "svc")
    stack.pods.server(pod, "private")
    kubeconfig = stack.node.add_user("eve")
    audit = stack.node.audit
    mark = audit.mark()
    with podgate_forward(
        stack,
        "pod/svc",
        [f"0:{ECHO_PORT}"],
        namespace=namespace,
        kubeconfig=kubeconfig,
        wait_ready=False,
    ) as forward:
        assert forward.wait_exit(GIVE_UP_SECONDS) == 4, forward.describe()
        denied = forward.wait_event(_is("target_denied"))
        assert denied["target"] == f"{namespace}/svc", denied
    audit.wait_for(mark, matching(user="eve", namespace=namespace, pod="svc", outcome="denied"))


def test_missing_pod_exits_3(stack: Stack) -> None:
    """No such pod, --gone-timeout 1: exit status 3, no sooner than a second after the
    forward started looking."""
    namespace = stack.namespace()
    with podgate_forward(
        stack,
        "pod/nosuch",
        [f"0:{ECHO_PORT}"],
        namespace=namespace,
        extra=["--gone-timeout", "1"],
        wait_ready=False,
    ) as forward:
        assert forward.wait_exit(GIVE_UP_SECONDS) == 3, forward.describe()
        gone = forward.wait_event(_is("target_gone"))
        assert gone["target"] == f"{namespace}/nosuch", gone
        started = forward.events[0]
    assert gone["time"] - started["time"] >= 1.0, (started, gone)
