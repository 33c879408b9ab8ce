"""UDP port-forward: datagrams on a byte stream, and the protocol extension that carries them.

Kubernetes port-forward only knows TCP. podgate adds UDP as an extra protocol version, so
kubectl (and every other client that does not ask for it) keeps the exact upstream behaviour.

Negotiation
    The upgrade offers `udp.portforward.podgate.io` before `portforward.k8s.io` in
    `X-Stream-Protocol-Version` (SPDY) or, inside the WebSocket tunnel, as
    `SPDY/3.1+udp.portforward.podgate.io` before `SPDY/3.1+portforward.k8s.io`. The server picks
    the first offer it knows (client order wins), so kubectl, which offers only
    `portforward.k8s.io`, never sees the extension; a server without it picks
    `portforward.k8s.io` and the client knows UDP is unavailable. The plain WebSocket v4 channel
    protocol has no per-connection headers and stays TCP-only.

Stream pairs
    Under the extension a pair's SYN_STREAM headers may carry `protocol: udp` (the data
    stream's header counts, as for `port`). Absent or `tcp` is TCP exactly as before; any other
    value fails that pair alone: one message on its error stream, then both streams are reset.
    Under plain `portforward.k8s.io` the header is ignored, as every upstream server does.

    A UDP pair is one flow: one local peer on the client, one connected UDP socket to
    127.0.0.1:port in the pod. The error stream works as for TCP. The data stream carries
    datagrams both ways, each as a uint16 big-endian length and then that many payload bytes
    (a zero-length datagram is `00 00`). Frames may be split or merged anywhere by the layers
    below, so the receiver reassembles them with `DatagramDecoder`. Either side ends the flow
    with FIN as usual; UDP has no half-close, so the pod side closes its socket when the
    client's FIN arrives. ICMP port-unreachable in the pod only drops that datagram.

Flow control
    Only podgate offers or accepts the extension, so negotiating it also tells each end that
    the other is podgate, and the SPDY session then uses SPDY/3.1 per-stream flow control
    (TCP and UDP pairs alike). Every stream starts with a window of `STREAM_WINDOW_BYTES`
    (podgate.proto.spdy) in each direction; the value is implied by the extension, so no
    SETTINGS frame is sent and an INITIAL_WINDOW_SIZE setting from the peer is ignored. DATA
    payload uses up the sender's window; the receiver returns it with WINDOW_UPDATE (stream
    id, delta) as its application reads. A sender never exceeds the window; DATA beyond it,
    or a WINDOW_UPDATE that takes a window past 2^31-1, resets that stream alone with
    RST_STREAM FLOW_CONTROL_ERROR (7). There is no connection-level window: a WINDOW_UPDATE
    for stream 0 is ignored. Under plain `portforward.k8s.io` nothing changes: no
    WINDOW_UPDATE is sent and the window is unlimited, as spdystream requires
    (k8s-streaming.md §1.8).

This module is sans-IO: it frames and unframes bytes and nothing else.
"""

from __future__ import annotations

from typing import Final

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "LENGTH_PREFIX_BYTES",
    "MAX_DATAGRAM_BYTES",
    "MAX_FRAME_BYTES",
    "DatagramDecoder",
    "TruncatedDatagramError",
    "encode_datagram",
    "encode_datagrams",
]

# The length prefix is a uint16, so no datagram may be longer than this (IPv4's own limit,
# 65507 bytes of payload, is lower still; the socket refuses those).
MAX_DATAGRAM_BYTES: Final = 0xFFFF
# Bytes of the big-endian length before each payload.
LENGTH_PREFIX_BYTES: Final = 2
# Largest frame on the stream: the most a decoder ever holds between two feeds.
MAX_FRAME_BYTES: Final = LENGTH_PREFIX_BYTES + MAX_DATAGRAM_BYTES


class TruncatedDatagramError(RemoteProtocolError):
    """The byte stream ended in the middle of a frame."""


def encode_datagram(payload: bytes | bytearray | memoryview) -> bytes:
    """One datagram as a frame: uint16 big-endian length, then the payload."""
    size = len(payload)
    if size > MAX_DATAGRAM_BYTES:
        raise LocalProtocolError(
            f"a datagram of {size} bytes does not fit the {MAX_DATAGRAM_BYTES}-byte frame limit"
        )
    return size.to_bytes(LENGTH_PREFIX_BYTES, "big") + bytes(payload)


def encode_datagrams(payloads: list[bytes]) -> bytes:
    """Several frames back to back (one write instead of one per datagram)."""
    return b"".join(encode_datagram(p) for p in payloads)


class DatagramDecoder:
    """Splits a byte stream back into datagrams, whatever the chunking.

    Every complete frame is returned by the `feed` that completes it, so between calls the
    decoder holds at most one partial frame (`MAX_FRAME_BYTES`): the buffer is bounded by the
    format itself, and no length value can be an error.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """The datagrams completed by `data`, in order."""
        buffer = self._buffer
        buffer += data
        out: list[bytes] = []
        start = 0
        end = len(buffer)
        while end - start >= LENGTH_PREFIX_BYTES:
            size = (buffer[start] << 8) | buffer[start + 1]
            stop = start + LENGTH_PREFIX_BYTES + size
            if stop > end:
                break
            out.append(bytes(buffer[start + LENGTH_PREFIX_BYTES : stop]))
            start = stop
        if start:
            del buffer[:start]
        return out

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buffer)

    def receive_eof(self) -> None:
        """The stream ended; raises TruncatedDatagramError if it cut a frame short."""
        if self._buffer:
            held = len(self._buffer)
            self._buffer.clear()
            raise TruncatedDatagramError(f"the stream ended {held} bytes into a datagram frame")
