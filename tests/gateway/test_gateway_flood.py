"""A user who floods a SPDY session with PINGs, through `podgate up` over real TLS: the
gateway ends the session (GOAWAY) and then turns that user's upgrades away (429) for its
cool-down, so a flooder who reconnects costs a refusal and not a fresh session with a fresh
burst of frames to parse. Another user is not affected."""

from __future__ import annotations

import secrets
import socket
import ssl
import time

import pytest
from gateway_support import Gateway, RawConnection, bearer, spdy_headers

from podgate.proto.spdy import Role, SpdyConnection
from podgate.proto.spdy.events import GoAwayReceived
from podgate.proto.spdy.frames import GoAwayStatus, encode_ping

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

PF_PATH = "/api/v1/namespaces/default/pods/data/portforward"
PODS_PATH = "/api/v1/namespaces/default/pods"
# PINGs per write, and the writes a flood may take before the gateway must have ended it
# (the session's burst is 2,000 frames: 100 writes are 25 times that).
PING_BATCH = 512
FLOOD_WRITES = 100
# How long the token file may take to be re-read.
RELOAD_SECONDS = 20.0


def _wait_authenticated(gateway: Gateway, token: str) -> None:
    deadline = time.monotonic() + RELOAD_SECONDS
    while True:
        with gateway.connect() as conn:
            answer = conn.exchange("GET", PODS_PATH, bearer(token))
        if answer is not None and answer.status == 200:
            return
        assert time.monotonic() < deadline, answer
        time.sleep(0.2)


def _upgrade(conn: RawConnection, token: str) -> int:
    """The status the gateway answers a port-forward upgrade with."""
    answer = conn.exchange("POST", PF_PATH, [*spdy_headers(["portforward.k8s.io"]), *bearer(token)])
    assert answer is not None
    return answer.status


def _flood(conn: RawConnection) -> list[GoAwayStatus]:
    """PINGs until the gateway stops taking them; the GOAWAY statuses it sent."""
    pings = b"".join(encode_ping(2 * i + 1) for i in range(PING_BATCH))
    try:
        for _ in range(FLOOD_WRITES):
            conn.sock.sendall(pings)
    except OSError:
        pass  # the gateway closed the connection: the flood was refused
    core = SpdyConnection(Role.CLIENT)
    statuses = []
    try:
        while data := conn.sock.recv(1 << 16):
            statuses += [e.status for e in core.receive_data(data) if isinstance(e, GoAwayReceived)]
    except (OSError, ssl.SSLError):
        pass  # reset: the close met our unread flood
    return statuses


def test_a_flooder_is_refused_for_the_cool_down_and_others_are_not(gateway: Gateway) -> None:
    flooder, bystander = secrets.token_hex(16), secrets.token_hex(16)
    gateway.add_token(flooder, "flood-user", ["system:masters"])
    gateway.add_token(bystander, "other-user", ["system:masters"])
    _wait_authenticated(gateway, flooder)
    _wait_authenticated(gateway, bystander)

    with gateway.connect() as conn:
        assert _upgrade(conn, flooder) == 101
        conn.sock.settimeout(20)
        statuses = _flood(conn)
    # GOAWAY(PROTOCOL_ERROR) unless the close overtook it (a reset on our unread flood).
    assert set(statuses) <= {GoAwayStatus.PROTOCOL_ERROR}, statuses

    # The same user, reconnecting (the gateway ended the session before our read saw EOF):
    # refused before any session exists.
    with gateway.connect() as conn:
        answer = conn.exchange(
            "POST", PF_PATH, [*spdy_headers(["portforward.k8s.io"]), *bearer(flooder)]
        )
    assert answer is not None and answer.status == 429, answer
    assert b"flooded a session with control frames" in answer.body
    assert "user 'flood-user' flooded a session" in gateway.log_text()
    # Another user is served as before.
    with gateway.connect() as conn:
        assert _upgrade(conn, bystander) == 101
        conn.sock.shutdown(socket.SHUT_RDWR)
