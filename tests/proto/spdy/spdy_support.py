"""Shared helpers for the SPDY core tests (imported by module name; keep the name unique)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from podgate.proto.spdy import DataReceived, Event, HeaderCompressor, Role, SpdyConnection
from podgate.proto.spdy.frames import encode_syn_stream


def h(text: str) -> bytes:
    """Hex dump (as printed in the reference, spaces and `|` allowed) to bytes."""
    return bytes.fromhex(text.replace("|", " "))


def pair(**kwargs: int) -> tuple[SpdyConnection, SpdyConnection]:
    return SpdyConnection(Role.CLIENT, **kwargs), SpdyConnection(Role.SERVER, **kwargs)


def deliver(src: SpdyConnection, dst: SpdyConnection) -> list[Event]:
    """Move everything `src` has queued into `dst`; return `dst`'s events."""
    return dst.receive_data(src.data_to_send())


def merge_data(events: Sequence[Event]) -> list[Event]:
    """Join consecutive DataReceived pieces of one stream (a frame split across reads)."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if (
            isinstance(event, DataReceived)
            and isinstance(last, DataReceived)
            and last.stream_id == event.stream_id
            and not last.fin
        ):
            out[-1] = DataReceived(event.stream_id, last.data + event.data, event.fin)
        else:
            out.append(event)
    return out


def feed_in_pieces(conn: SpdyConnection, data: bytes, cuts: Sequence[int]) -> list[Event]:
    events: list[Event] = []
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    for start, end in itertools.pairwise(bounds):
        events += conn.receive_data(data[start:end])
    return events


class FakePeer:
    """Writes raw SYN_STREAM frames with any id/flags, keeping one compression context."""

    def __init__(self) -> None:
        self.compressor = HeaderCompressor()

    def syn_stream(self, stream_id: int, headers: Mapping[str, str], flags: int = 0) -> bytes:
        return encode_syn_stream(stream_id, self.compressor.compress(headers), flags=flags)
