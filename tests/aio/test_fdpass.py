"""Passing a connected socket between ends of a unix socket (SCM_RIGHTS): the receiver gets the
very connection (bytes both ways, sha256) with the sender's unread bytes first, and a channel
that carries no socket is an error, not a connection."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket

import pytest

from podgate.aio import fdpass

TIMEOUT_SECONDS = 30.0
# More than one unix socket buffer: the bytes after the descriptor take several sends.
PENDING_BYTES = 3 * 1024 * 1024 + 7
TRANSFER_BYTES = 8 * 1024 * 1024


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        outer = socket.create_connection(listener.getsockname())
        inner, _ = listener.accept()
    for sock in (outer, inner):
        sock.setblocking(False)
    return outer, inner


def _channel() -> tuple[socket.socket, socket.socket]:
    sender, receiver = socket.socketpair()
    sender.setblocking(False)
    receiver.setblocking(False)
    return sender, receiver


async def _echo_both_ways(peer: socket.socket, passed: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    up, down = os.urandom(TRANSFER_BYTES), os.urandom(TRANSFER_BYTES)

    async def receive(sock: socket.socket) -> bytes:
        parts = []
        while chunk := await loop.sock_recv(sock, 1 << 20):
            parts.append(chunk)
        return b"".join(parts)

    async def send(sock: socket.socket, data: bytes) -> None:
        await loop.sock_sendall(sock, data)
        sock.shutdown(socket.SHUT_WR)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(send(peer, up))
        tg.create_task(send(passed, down))
        at_passed = tg.create_task(receive(passed))
        at_peer = tg.create_task(receive(peer))
    assert hashlib.sha256(at_passed.result()).digest() == hashlib.sha256(up).digest()
    assert hashlib.sha256(at_peer.result()).digest() == hashlib.sha256(down).digest()


async def test_the_passed_socket_is_the_connection_and_pending_bytes_come_first() -> None:
    peer, inner = _tcp_pair()
    sender, receiver = _channel()
    pending = os.urandom(PENDING_BYTES)
    try:
        async with asyncio.timeout(TIMEOUT_SECONDS):
            receiving = asyncio.create_task(fdpass.receive_socket(receiver))
            await fdpass.send_socket(sender, inner, pending)
            inner.close()  # the sender's descriptor: the connection lives on in the receiver's
            sender.close()
            passed, got = await receiving
            with passed:
                assert passed.getblocking() is False
                assert passed.get_inheritable() is False
                assert hashlib.sha256(got).digest() == hashlib.sha256(pending).digest()
                await _echo_both_ways(peer, passed)
    finally:
        for sock in (peer, inner, sender, receiver):
            sock.close()


@pytest.mark.parametrize("sent", [b"", b"not a hand-over"])
async def test_a_channel_without_a_socket_is_an_error(sent: bytes) -> None:
    sender, receiver = _channel()
    try:
        sender.sendall(sent)
        sender.close()
        async with asyncio.timeout(TIMEOUT_SECONDS):
            with pytest.raises(fdpass.HandOverError, match="no connection passed"):
                await fdpass.receive_socket(receiver)
    finally:
        sender.close()
        receiver.close()


async def test_a_descriptor_without_the_marker_is_refused_and_closed() -> None:
    sender, receiver = _channel()
    peer, inner = _tcp_pair()
    try:
        socket.send_fds(sender, [b"x"], [inner.fileno()])
        sender.close()
        inner.close()
        async with asyncio.timeout(TIMEOUT_SECONDS):
            with pytest.raises(fdpass.HandOverError, match="no connection passed"):
                await fdpass.receive_socket(receiver)
            # The receiver closed the descriptor it got: the peer reads EOF.
            assert await asyncio.get_running_loop().sock_recv(peer, 10) == b""
    finally:
        for sock in (sender, receiver, peer, inner):
            sock.close()
