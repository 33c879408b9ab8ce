"""Fuzz targets: every parser that reads bytes from a peer, fed arbitrary input.

A target splits one input into pieces (the first byte picks the piece size, so incremental
parsing is exercised too), feeds them to a fresh parser and ends with EOF where the parser
has one. Peer bytes may only ever raise the parser's protocol errors (ProtocolError and its
subclasses); anything else is a crash. SEEDS holds one valid exchange per target, so the
mutations start deep inside each protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, CloseConnection

from podgate.proto import attach, datagram, nrimux, upgrade
from podgate.proto import ttrpc as ttrpc_proto
from podgate.proto.errors import ProtocolError
from podgate.proto.spdy import Role as SpdyRole
from podgate.proto.spdy import SpdyConnection
from podgate.proto.wschannel import ChannelConnection, Role, TunnelConnection

# Parser input is bounded per fuzz input: larger inputs only slow the fuzzer down.
MAX_INPUT_BYTES = 64 * 1024

Target = Callable[[bytes], None]


def _pieces(data: bytes) -> Iterator[bytes]:
    if not data:
        return
    step = data[0] % 64 + 1 if data[0] < 192 else len(data)
    body = data[1:MAX_INPUT_BYTES]
    for start in range(0, len(body), step):
        yield body[start : start + step]


def spdy(data: bytes) -> None:
    core = SpdyConnection(SpdyRole.SERVER)
    try:
        for piece in _pieces(data):
            core.receive_data(piece)
            core.buffers_to_send()
        core.receive_eof()
    except ProtocolError:
        pass


def spdy_flow_control(data: bytes) -> None:
    core = SpdyConnection(SpdyRole.CLIENT, flow_control_window=64 * 1024)
    try:
        for piece in _pieces(data):
            core.receive_data(piece)
            core.buffers_to_send()
        core.receive_eof()
    except ProtocolError:
        pass


def _ws(make: Callable[[], ChannelConnection | TunnelConnection]) -> Target:
    def target(data: bytes) -> None:
        core = make()
        try:
            for piece in _pieces(data):
                core.receive_data(piece)
                core.buffers_to_send()
            core.receive_data(None)
        except ProtocolError:
            pass

    return target


ws_channel_v5 = _ws(lambda: ChannelConnection(Role.SERVER, "v5.channel.k8s.io"))
ws_channel_base64 = _ws(lambda: ChannelConnection(Role.SERVER, "base64.channel.k8s.io"))
ws_tunnel = _ws(lambda: TunnelConnection(Role.SERVER))


def upgrade_server(data: bytes) -> None:
    handshake = upgrade.ServerHandshake()
    try:
        for piece in _pieces(data):
            if handshake.receive_data(piece) is not None:
                return
        handshake.receive_eof()
    except ProtocolError:
        pass


def upgrade_client(data: bytes) -> None:
    handshake = upgrade.ClientHandshake(ws_key="dGhlIHNhbXBsZSBub25jZQ==")
    try:
        for piece in _pieces(data):
            if handshake.receive_data(piece) is not None:
                return
        handshake.receive_eof()
    except ProtocolError:
        pass


def ttrpc(data: bytes) -> None:
    core = ttrpc_proto.TtrpcConnection(ttrpc_proto.Role.SERVER)
    try:
        for piece in _pieces(data):
            core.receive_data(piece)
    except ProtocolError:
        pass


def nri_mux(data: bytes) -> None:
    decoder = nrimux.MuxDecoder()
    try:
        for piece in _pieces(data):
            decoder.receive_data(piece)
        decoder.receive_eof()
    except ProtocolError:
        pass


def datagram_framing(data: bytes) -> None:
    decoder = datagram.DatagramDecoder()
    try:
        for piece in _pieces(data):
            decoder.feed(piece)
        decoder.receive_eof()
    except ProtocolError:
        pass


def attach_framing(data: bytes) -> None:
    for role in (attach.Role.CLIENT, attach.Role.SHIM):
        codec = attach.AttachCodec(role)
        try:
            for piece in _pieces(data):
                codec.receive_data(piece)
        except ProtocolError:
            pass


TARGETS: dict[str, Target] = {
    "spdy": spdy,
    "spdy_flow_control": spdy_flow_control,
    "ws_channel_v5": ws_channel_v5,
    "ws_channel_base64": ws_channel_base64,
    "ws_tunnel": ws_tunnel,
    "upgrade_server": upgrade_server,
    "upgrade_client": upgrade_client,
    "ttrpc": ttrpc,
    "nri_mux": nri_mux,
    "datagram": datagram_framing,
    "attach": attach_framing,
}


def _ws_client_bytes(*messages: bytes) -> bytes:
    ws = Connection(ConnectionType.CLIENT)
    out = b"".join(ws.send(BytesMessage(data=m)) for m in messages)
    return out + ws.send(CloseConnection(code=1000))


def _spdy_client_bytes() -> bytes:
    core = SpdyConnection(SpdyRole.CLIENT)
    sid = core.open_stream({"streamtype": "data", "port": "80", "requestid": "0"})
    core.send_data(sid, b"hello")
    core.end_stream(sid)
    core.ping()
    core.goaway()
    return core.data_to_send()


def seeds() -> dict[str, list[bytes]]:
    """One valid input per target (prefixed with the piece-size byte)."""
    spdy_bytes = _spdy_client_bytes()
    request = (
        b"POST /exec/x?command=sh HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\n"
        b"Upgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n"
    )
    response = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
    )
    mux = nrimux.encode_frame(1, b"\x00\x00\x00\x05\x00\x00\x00\x01\x01hello")
    dgram = datagram.encode_datagram(b"ping") + datagram.encode_datagram(b"")
    return {
        "spdy": [b"\xff" + spdy_bytes],
        "spdy_flow_control": [b"\x07" + spdy_bytes],
        "ws_channel_v5": [b"\xff" + _ws_client_bytes(b"\x00stdin", b"\xff\x00")],
        "ws_channel_base64": [b"\xff" + _ws_client_bytes(b"0c3RkaW4=")],
        "ws_tunnel": [b"\xff" + _ws_client_bytes(spdy_bytes)],
        "upgrade_server": [b"\xff" + request],
        "upgrade_client": [b"\xff" + response],
        "ttrpc": [b"\xff" + b"\x00\x00\x00\x02\x00\x00\x00\x01\x01\x00\x0a\x00"],
        "nri_mux": [b"\xff" + mux],
        "datagram": [b"\x03" + dgram],
        "attach": [b"\xff" + b"\x01\x00\x00\x00\x05hello"],
    }
