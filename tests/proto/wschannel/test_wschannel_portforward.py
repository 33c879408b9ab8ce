"""WebSocket port-forward channels (k8s-streaming.md 5.6, kubectl-api-surface.md 10)."""

from __future__ import annotations

import pytest

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError
from podgate.proto.wschannel import (
    ChannelConnection,
    ChannelData,
    InvalidPortsError,
    PortChannel,
    PortForwardChannels,
    Role,
    WebSocketError,
    encode_port,
    parse_ports,
)


def test_port_header_is_little_endian() -> None:
    assert encode_port(80) == b"\x50\x00"
    assert encode_port(8080) == b"\x90\x1f"
    assert encode_port(65535) == b"\xff\xff"


def test_server_initial_messages_on_the_wire() -> None:
    channels = PortForwardChannels([80, 8080], Role.SERVER)
    assert channels.initial_messages() == [
        (0, b"\x50\x00"),
        (1, b"\x50\x00"),
        (2, b"\x90\x1f"),
        (3, b"\x90\x1f"),
    ]
    conn = ChannelConnection(Role.SERVER, "v4.channel.k8s.io")
    for channel, payload in channels.initial_messages()[:2]:
        conn.send(channel, payload)
    # Port 80: the messages 00 50 00 and 01 50 00, each one unmasked binary frame.
    assert conn.data_to_send() == b"\x82\x03\x00\x50\x00" + b"\x82\x03\x01\x50\x00"


def test_only_the_server_sends_headers() -> None:
    with pytest.raises(LocalProtocolError):
        PortForwardChannels([80], Role.CLIENT).initial_messages()


def test_channel_mapping() -> None:
    channels = PortForwardChannels([80, 443], Role.SERVER)
    assert channels.lookup(0) == PortChannel(index=0, port=80, is_error=False)
    assert channels.lookup(1) == PortChannel(index=0, port=80, is_error=True)
    assert channels.lookup(2) == PortChannel(index=1, port=443, is_error=False)
    assert channels.lookup(3) == PortChannel(index=1, port=443, is_error=True)
    assert channels.lookup(4) is None
    assert (channels.data_channel(1), channels.error_channel(1)) == (2, 3)


def test_server_drops_client_error_channel_and_unknown_channels() -> None:
    channels = PortForwardChannels([80], Role.SERVER)
    assert channels.receive(0, b"GET / HTTP/1.0\r\n\r\n") == (
        PortChannel(0, 80, False),
        b"GET / HTTP/1.0\r\n\r\n",
    )
    assert channels.receive(1, b"noise") is None
    assert channels.receive(7, b"noise") is None


def test_client_strips_and_checks_the_prefix() -> None:
    channels = PortForwardChannels([80], Role.CLIENT)
    assert channels.receive(0, b"\x50\x00") is None
    assert channels.receive(1, b"\x50\x00") is None
    assert channels.receive(0, b"HTTP/1.0 200 OK") == (
        PortChannel(0, 80, False),
        b"HTTP/1.0 200 OK",
    )
    # After the header, the same two bytes are just data.
    assert channels.receive(0, b"\x50\x00") == (PortChannel(0, 80, False), b"\x50\x00")
    text = b"error forwarding port 80 to pod abc, uid : connection refused"
    assert channels.receive(1, text) == (PortChannel(0, 80, True), text)


def test_client_prefix_split_or_joined() -> None:
    channels = PortForwardChannels([8080], Role.CLIENT)
    assert channels.receive(0, b"\x90") is None
    assert channels.receive(0, b"\x1fhello") == (PortChannel(0, 8080, False), b"hello")
    assert channels.receive(1, b"\x90\x1fboom") == (PortChannel(0, 8080, True), b"boom")


def test_client_rejects_a_wrong_port() -> None:
    channels = PortForwardChannels([80], Role.CLIENT)
    with pytest.raises(WebSocketError):
        channels.receive(0, encode_port(81))


def test_client_outbound_has_no_prefix() -> None:
    channels = PortForwardChannels([80, 81], Role.CLIENT)
    assert channels.outbound(1, b"x") == (2, b"x")
    with pytest.raises(LocalProtocolError):
        channels.outbound(2, b"x")


def test_in_memory_port_forward() -> None:
    srv_conn = ChannelConnection(Role.SERVER, "v4.channel.k8s.io")
    cli_conn = ChannelConnection(Role.CLIENT, "v4.channel.k8s.io")
    srv = PortForwardChannels([80], Role.SERVER)
    cli = PortForwardChannels([80], Role.CLIENT)
    for channel, payload in srv.initial_messages():
        srv_conn.send(channel, payload)
    srv_conn.send(0, b"pong")
    got = []
    for event in cli_conn.receive_data(srv_conn.data_to_send()):
        assert isinstance(event, ChannelData)
        result = cli.receive(event.channel, event.data)
        if result is not None:
            got.append(result)
    assert got == [(PortChannel(0, 80, False), b"pong")]
    cli_conn.send(*cli.outbound(0, b"ping"))
    [event] = srv_conn.receive_data(cli_conn.data_to_send())
    assert isinstance(event, ChannelData)
    assert srv.receive(event.channel, event.data) == (PortChannel(0, 80, False), b"ping")


def test_connection_with_port_channels_strips_headers() -> None:
    srv_conn = ChannelConnection(Role.SERVER, "v4.channel.k8s.io")
    srv = PortForwardChannels([80], Role.SERVER)
    for channel, payload in srv.initial_messages():
        srv_conn.send(channel, payload)
    srv_conn.send(0, b"data")
    srv_conn.send(1, b"error text")
    cli_conn = ChannelConnection(
        Role.CLIENT, "v4.channel.k8s.io", port_channels=PortForwardChannels([80], Role.CLIENT)
    )
    assert cli_conn.receive_data(srv_conn.data_to_send()) == [
        ChannelData(0, b"data"),
        ChannelData(1, b"error text"),
    ]


def test_connection_with_port_channels_closes_on_a_wrong_header() -> None:
    srv_conn = ChannelConnection(Role.SERVER, "v4.channel.k8s.io")
    srv_conn.send(0, encode_port(81))
    cli_conn = ChannelConnection(
        Role.CLIENT, "v4.channel.k8s.io", port_channels=PortForwardChannels([80], Role.CLIENT)
    )
    with pytest.raises(WebSocketError):
        cli_conn.receive_data(srv_conn.data_to_send())
    # A close frame (opcode 8) is queued for the server.
    assert cli_conn.data_to_send()[0] == 0x88


@pytest.mark.parametrize(
    ("query", "ports"),
    [
        ("ports=80", (80,)),
        ("ports=80&ports=8080", (80, 8080)),
        ("ports=80,8080", (80, 8080)),
        ("port=80,8080", (80, 8080)),
        ("ports=80%2C443", (80, 443)),
        ("ports=1&ports=65535", (1, 65535)),
    ],
)
def test_parse_ports(query: str, ports: tuple[int, ...]) -> None:
    assert parse_ports(query) == list(ports)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("", 'query parameter "port" is required'),
        ("ports=", 'query parameter "port" cannot be empty'),
        ("ports=0", 'port "0" must be > 0'),
        ("ports=65536", 'unable to parse "65536" as a port: value out of range'),
        ("ports=http", 'unable to parse "http" as a port'),
        ("ports=-1", 'unable to parse "-1" as a port'),
        ("ports=80,", 'unable to parse "80," as a port'),
    ],
)
def test_parse_ports_errors(query: str, message: str) -> None:
    with pytest.raises(InvalidPortsError) as info:
        parse_ports(query)
    assert isinstance(info.value, RemoteProtocolError)
    assert info.value.status == 400
    assert info.value.message == message


def test_constructor_validates() -> None:
    with pytest.raises(LocalProtocolError):
        PortForwardChannels([], Role.SERVER)
    with pytest.raises(LocalProtocolError):
        PortForwardChannels([0], Role.SERVER)
