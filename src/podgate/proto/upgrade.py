"""HTTP/1.1 upgrade handshakes for SPDY/3.1 and WebSocket streaming, sans-IO.

`negotiate` is a pure function of the request head: it decides between SPDY, a WebSocket
channel protocol and the SPDY-in-WebSocket tunnel, and picks the subprotocol the way the
upstream servers do (apimachinery `httpstream.Handshake`, x/net `websocket` plus `wsstream`).
`ServerHandshake` and `ClientHandshake` drive h11 on either side of the connection and hand
over the bytes that follow the head, which belong to the next protocol.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from http import HTTPStatus
from urllib.parse import parse_qsl, unquote

import h11
from wsproto.utilities import generate_accept_token

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError

# --- protocol names, in server preference order where it matters --------------------------

REMOTECOMMAND_SPDY_PROTOCOLS: tuple[str, ...] = (
    "v4.channel.k8s.io",
    "v3.channel.k8s.io",
    "v2.channel.k8s.io",
    "channel.k8s.io",
)
PORTFORWARD_SPDY_PROTOCOLS: tuple[str, ...] = ("portforward.k8s.io",)
REMOTECOMMAND_WS_PROTOCOLS: tuple[str, ...] = (
    "v5.channel.k8s.io",
    "v4.channel.k8s.io",
    "v4.base64.channel.k8s.io",
    "base64.channel.k8s.io",
    "channel.k8s.io",
    "",
)
PORTFORWARD_WS_PROTOCOLS: tuple[str, ...] = (
    "SPDY/3.1+portforward.k8s.io",
    "v4.channel.k8s.io",
    "v4.base64.channel.k8s.io",
    "",
)

# A WebSocket subprotocol with this prefix carries a SPDY byte stream (KEP-4006 tunnel).
TUNNEL_PROTOCOL_PREFIX = "SPDY/3.1+"

# --- limits ---------------------------------------------------------------------------------

# kubectl's upgrade heads are under 2 KiB; 64 KiB leaves room for long exec argv and tokens.
MAX_HEAD_BYTES = 64 * 1024
# Upgrade requests carry no body; plain API requests podgate serves are small JSON.
MAX_REQUEST_BODY_BYTES = 1024 * 1024
# gorilla/websocket reads at most 64 KiB of a failed handshake's body; so do we.
MAX_ERROR_BODY_BYTES = 64 * 1024

Headers = tuple[tuple[bytes, bytes], ...]
HeaderInput = Iterable[tuple[bytes | str, bytes | str]]

_WS_VERSION = "13"
_TEXT_HEADERS: Headers = (
    (b"Content-Type", b"text/plain; charset=utf-8"),
    (b"X-Content-Type-Options", b"nosniff"),
)
_JSON_CONTENT_TYPE = (b"Content-Type", b"application/json")


class StreamKind(Enum):
    EXEC = "exec"
    ATTACH = "attach"
    PORTFORWARD = "portforward"


class Transport(Enum):
    SPDY = "spdy"
    WEBSOCKET = "websocket"
    WEBSOCKET_TUNNEL = "websocket-tunnel"


class HandshakeError(RemoteProtocolError):
    """The peer's HTTP head is unusable. `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class UpgradeFailedError(RemoteProtocolError):
    """The server did not switch protocols. kubectl falls back to SPDY on exactly this."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


# --- header helpers ------------------------------------------------------------------------


def _to_bytes(value: bytes | str) -> bytes:
    return value.encode("latin-1") if isinstance(value, str) else value


def _normalize_headers(headers: HeaderInput) -> Headers:
    return tuple((_to_bytes(name), _to_bytes(value)) for name, value in headers)


def _values(headers: Iterable[tuple[bytes, bytes]], name: str) -> list[str]:
    key = name.lower().encode("latin-1")
    return [v.decode("latin-1") for n, v in headers if n.lower() == key]


def _first(headers: Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    values = _values(headers, name)
    return values[0] if values else None


def _tokens(headers: Iterable[tuple[bytes, bytes]], name: str) -> list[str]:
    """Every comma-separated, stripped, non-empty value over all lines of `name`."""
    return [t.strip() for v in _values(headers, name) for t in v.split(",") if t.strip()]


def _contains(headers: Iterable[tuple[bytes, bytes]], name: str, needle: str) -> bool:
    return any(needle in v.lower() for v in _values(headers, name))


def _go_list(items: Sequence[str]) -> str:
    # Go's %v of a []string, which is what upstream error texts show.
    return "[" + " ".join(items) + "]"


def ws_accept_value(key: str) -> str:
    """RFC 6455 Sec-WebSocket-Accept for a Sec-WebSocket-Key."""
    return generate_accept_token(key.strip().encode("latin-1")).decode("ascii")


# --- Kubernetes Status bodies ---------------------------------------------------------------

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    413: "RequestEntityTooLarge",
    431: "BadRequest",
    500: "InternalError",
    501: "NotImplemented",
    503: "ServiceUnavailable",
}


def status_reason(code: int) -> str:
    """The metav1 StatusReason the API server uses for an HTTP status."""
    return _REASONS.get(code, "Unknown")


def status_body(code: int, reason: str, message: str) -> bytes:
    """A metav1 `Status` failure, as kubectl prints it: "Error from server (reason): message"."""
    doc = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


# --- negotiation ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Accepted:
    """Switch protocols. `response_headers` go into the 101 as they are."""

    transport: Transport
    protocol: str
    response_headers: Headers

    @property
    def inner_protocol(self) -> str:
        """The SPDY protocol inside the tunnel, else the protocol itself."""
        if self.transport is Transport.WEBSOCKET_TUNNEL:
            return self.protocol[len(TUNNEL_PROTOCOL_PREFIX) :]
        return self.protocol


@dataclass(frozen=True, slots=True)
class Rejected:
    """Refuse the upgrade. `headers`/`body` are what upstream sends; `as_status()` is the
    same answer with a metav1 Status body, which kubectl prints cleanly on both attempts."""

    status: int
    reason: str
    message: str
    headers: Headers = ()
    body: bytes = b""

    def as_status(self) -> Rejected:
        kept = tuple((n, v) for n, v in self.headers if n.lower() != b"content-type")
        kept = tuple((n, v) for n, v in kept if n.lower() != b"x-content-type-options")
        return Rejected(
            status=self.status,
            reason=self.reason,
            message=self.message,
            headers=(*kept, _JSON_CONTENT_TYPE),
            body=status_body(self.status, self.reason, self.message),
        )


def _text_rejection(status: int, message: str, extra: Headers = ()) -> Rejected:
    # Shaped like Go's http.Error: text/plain, nosniff, trailing newline.
    return Rejected(
        status=status,
        reason=status_reason(status),
        message=message,
        headers=(*extra, *_TEXT_HEADERS),
        body=(message + "\n").encode("utf-8"),
    )


def _defaults(kind: StreamKind) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if kind is StreamKind.PORTFORWARD:
        return PORTFORWARD_SPDY_PROTOCOLS, PORTFORWARD_WS_PROTOCOLS
    return REMOTECOMMAND_SPDY_PROTOCOLS, REMOTECOMMAND_WS_PROTOCOLS


def is_websocket_request(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    return any(t.lower() == "websocket" for t in _tokens(headers, "upgrade"))


def is_spdy_request(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    return _contains(headers, "upgrade", "spdy/3.1") and _contains(headers, "connection", "upgrade")


def negotiate(
    method: str,
    headers: Sequence[tuple[bytes, bytes]],
    kind: StreamKind,
    *,
    spdy_protocols: Sequence[str] | None = None,
    ws_protocols: Sequence[str] | None = None,
) -> Accepted | Rejected:
    """Decide how to answer an exec/attach/port-forward upgrade request."""
    default_spdy, default_ws = _defaults(kind)
    if is_websocket_request(headers):
        server_ws = default_ws if ws_protocols is None else tuple(ws_protocols)
        return _negotiate_ws(method, headers, server_ws)
    if is_spdy_request(headers):
        server_spdy = default_spdy if spdy_protocols is None else tuple(spdy_protocols)
        return _negotiate_spdy(headers, server_spdy)
    message = "unable to upgrade: missing upgrade headers in request"
    return Rejected(
        status=400,
        reason=status_reason(400),
        message=message,
        headers=(_JSON_CONTENT_TYPE,),
        body=status_body(400, status_reason(400), message),
    )


def _negotiate_spdy(
    headers: Sequence[tuple[bytes, bytes]], server: tuple[str, ...]
) -> Accepted | Rejected:
    client = _tokens(headers, "x-stream-protocol-version")
    if not client:
        return _text_rejection(400, "unable to upgrade: X-Stream-Protocol-Version is required")
    chosen = next((p for p in client if p in server), None)
    if chosen is None:
        message = (
            "unable to upgrade: unable to negotiate protocol: "
            f"client supports {_go_list(client)}, server accepts {_go_list(server)}"
        )
        accepted = tuple((b"X-Accepted-Stream-Protocol-Versions", p.encode()) for p in server)
        return _text_rejection(403, message, accepted)
    return Accepted(
        transport=Transport.SPDY,
        protocol=chosen,
        response_headers=(
            (b"Connection", b"Upgrade"),
            (b"Upgrade", b"SPDY/3.1"),
            (b"X-Stream-Protocol-Version", chosen.encode("latin-1")),
        ),
    )


def _negotiate_ws(
    method: str, headers: Sequence[tuple[bytes, bytes]], server: tuple[str, ...]
) -> Accepted | Rejected:
    # Checks and texts follow golang.org/x/net/websocket's hybi ReadHandshake.
    if method.upper() != "GET":
        return Rejected(405, status_reason(405), "bad method", (), b"bad method")
    if not _contains(headers, "connection", "upgrade"):
        message = "not websocket protocol"
        return Rejected(400, status_reason(400), message, (), message.encode())
    key = (_first(headers, "sec-websocket-key") or "").strip()
    if not key:
        message = "mismatch challenge/response"
        return Rejected(400, status_reason(400), message, (), message.encode())
    if (_first(headers, "sec-websocket-version") or "").strip() != _WS_VERSION:
        message = "missing or bad WebSocket Version"
        version = ((b"Sec-WebSocket-Version", _WS_VERSION.encode()),)
        return Rejected(400, status_reason(400), message, version, message.encode())
    # Only the first line counts; an absent or blank header offers "".
    raw = (_first(headers, "sec-websocket-protocol") or "").strip()
    client = [p.strip() for p in raw.split(",")] if raw else [""]
    chosen = next((p for p in client if p in server), None)
    if chosen is None:
        message = (
            f"requested protocol(s) are not supported: {_go_list(client)}; "
            f"supports {_go_list(server)}"
        )
        return Rejected(403, status_reason(403), message)
    transport = (
        Transport.WEBSOCKET_TUNNEL
        if chosen.startswith(TUNNEL_PROTOCOL_PREFIX)
        else Transport.WEBSOCKET
    )
    return Accepted(
        transport=transport,
        protocol=chosen,
        response_headers=(
            (b"Upgrade", b"websocket"),
            (b"Connection", b"Upgrade"),
            (b"Sec-WebSocket-Accept", ws_accept_value(key).encode("ascii")),
            (b"Sec-WebSocket-Protocol", chosen.encode("latin-1")),
        ),
    )


# --- server side ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UpgradeRequest:
    """One complete request. Header names are lower-case, values raw."""

    method: str
    target: str
    headers: Headers
    body: bytes = b""
    http_version: str = "1.1"

    def header(self, name: str) -> str | None:
        """The first value of `name`, like Go's Header.Get."""
        return _first(self.headers, name)

    def header_values(self, name: str) -> list[str]:
        """Every line of `name`, unsplit."""
        return _values(self.headers, name)

    @property
    def is_upgrade(self) -> bool:
        return bool(_tokens(self.headers, "upgrade"))

    @property
    def path(self) -> str:
        return unquote(self.target.partition("?")[0])

    @property
    def query(self) -> str:
        return self.target.partition("?")[2]

    def query_params(self) -> list[tuple[str, str]]:
        return parse_qsl(self.query, keep_blank_values=True)


class ServerState(Enum):
    RECEIVING = "receiving"  # waiting for (the rest of) a request
    RESPONDING = "responding"  # a request was returned; accept() or respond() next
    SWITCHED = "switched"  # 101 sent; the connection now belongs to another protocol
    MUST_CLOSE = "must-close"  # a response went out that ends the connection
    CLOSED = "closed"  # the peer closed between requests


class ServerHandshake:
    """Server side of HTTP/1.1: requests in, 101 or ordinary responses out, keep-alive."""

    def __init__(
        self,
        *,
        max_head_bytes: int = MAX_HEAD_BYTES,
        max_body_bytes: int = MAX_REQUEST_BODY_BYTES,
    ) -> None:
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self._max_body = max_body_bytes
        self._request: h11.Request | None = None
        self._body = bytearray()
        self._state = ServerState.RECEIVING
        # Set when a HandshakeError was raised: the only way on is an error response.
        self._failed = False

    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def must_close(self) -> bool:
        return self._state in (ServerState.MUST_CLOSE, ServerState.CLOSED)

    def receive_data(self, data: bytes) -> UpgradeRequest | None:
        """Feed bytes; b"" just polls (for a request pipelined behind the last one)."""
        if self._state is ServerState.SWITCHED:
            raise LocalProtocolError("the connection switched protocols; use trailing_data")
        if data:
            if self._state is ServerState.CLOSED:
                raise LocalProtocolError("data after end of stream")
            self._h11.receive_data(data)
        if self._state is not ServerState.RECEIVING:
            return None
        if self._failed:
            raise LocalProtocolError("the request was malformed; respond() and close")
        return self._next_request()

    def receive_eof(self) -> None:
        """The peer closed its side. Raises if it did so in the middle of a request."""
        if self._state is ServerState.SWITCHED:
            raise LocalProtocolError("the connection switched protocols")
        if self._state is ServerState.CLOSED:
            return
        self._h11.receive_data(b"")
        if self._state is ServerState.RECEIVING and not self._failed:
            self._next_request()

    def _next_request(self) -> UpgradeRequest | None:
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                self._failed = True
                raise HandshakeError(str(exc), exc.error_status_hint) from exc
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return None
            if isinstance(event, h11.Request):
                self._request = event
                self._body = bytearray()
            elif isinstance(event, h11.Data):
                self._body += event.data
                if len(self._body) > self._max_body:
                    self._failed = True
                    raise HandshakeError("request body too large", 413)
            elif isinstance(event, h11.EndOfMessage):
                assert self._request is not None
                request = self._request
                self._state = ServerState.RESPONDING
                return UpgradeRequest(
                    method=request.method.decode("ascii"),
                    target=request.target.decode("latin-1"),
                    headers=tuple((bytes(n), bytes(v)) for n, v in request.headers),
                    body=bytes(self._body),
                    http_version=request.http_version.decode("ascii"),
                )
            elif isinstance(event, h11.ConnectionClosed):
                self._state = ServerState.CLOSED
                return None

    def accept(self, accepted: Accepted) -> bytes:
        """The 101 for the current request. Afterwards read `trailing_data`."""
        if self._state is not ServerState.RESPONDING:
            raise LocalProtocolError(f"cannot switch protocols in state {self._state.name}")
        try:
            out = self._h11.send(
                h11.InformationalResponse(
                    status_code=101,
                    headers=list(accepted.response_headers),
                    reason=b"Switching Protocols",
                )
            )
        except h11.LocalProtocolError as exc:
            raise LocalProtocolError(f"cannot switch protocols: {exc}") from exc
        self._state = ServerState.SWITCHED
        assert out is not None
        return out

    def reject(self, rejected: Rejected) -> bytes:
        return self.respond(rejected.status, rejected.headers, rejected.body)

    def respond(self, status: int, headers: HeaderInput = (), body: bytes = b"") -> bytes:
        """A complete response with Content-Length. Also valid after a HandshakeError."""
        if self._state in (ServerState.SWITCHED, ServerState.MUST_CLOSE, ServerState.CLOSED):
            raise LocalProtocolError(f"cannot respond in state {self._state.name}")
        if status < 200:
            raise LocalProtocolError("respond() sends final responses; use accept() for 101")
        items = [(n, v) for n, v in _normalize_headers(headers) if n.lower() != b"content-length"]
        items.append((b"Content-Length", str(len(body)).encode("ascii")))
        if self._failed:
            # Nothing more is read from this connection; tell the client so.
            items = [(n, v) for n, v in items if n.lower() != b"connection"]
            items.append((b"Connection", b"close"))
        head_only = self._request is not None and self._request.method == b"HEAD"
        try:
            phrase = HTTPStatus(status).phrase.encode("ascii")
        except ValueError:
            phrase = b""
        try:
            out = bytearray()
            out += (
                self._h11.send(h11.Response(status_code=status, headers=items, reason=phrase))
                or b""
            )
            if body and not head_only:
                out += self._h11.send(h11.Data(data=body)) or b""
            out += self._h11.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError as exc:
            raise LocalProtocolError(f"cannot send response: {exc}") from exc
        self._request = None
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
            self._state = ServerState.RECEIVING
        else:
            self._state = ServerState.MUST_CLOSE
        return bytes(out)

    def start_response(self, status: int, headers: HeaderInput = ()) -> bytes:
        """The head of a streamed (chunked) response; body via send_body(), then end_response().
        For answers whose length is not known up front, like `kubectl logs -f`."""
        if self._state is not ServerState.RESPONDING:
            raise LocalProtocolError(f"cannot start a response in state {self._state.name}")
        items = [
            (n, v)
            for n, v in _normalize_headers(headers)
            if n.lower() not in (b"content-length", b"transfer-encoding")
        ]
        items.append((b"Transfer-Encoding", b"chunked"))
        try:
            phrase = HTTPStatus(status).phrase.encode("ascii")
        except ValueError:
            phrase = b""
        try:
            return (
                self._h11.send(h11.Response(status_code=status, headers=items, reason=phrase))
                or b""
            )
        except h11.LocalProtocolError as exc:
            raise LocalProtocolError(f"cannot send response: {exc}") from exc

    def send_body(self, data: bytes) -> bytes:
        """One chunk of a streamed response (empty data sends nothing)."""
        if not data:
            return b""
        try:
            return self._h11.send(h11.Data(data=data)) or b""
        except h11.LocalProtocolError as exc:
            raise LocalProtocolError(f"cannot send body: {exc}") from exc

    def end_response(self) -> bytes:
        """The last chunk; the connection is then ready for the next request (or must close)."""
        try:
            out = self._h11.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError as exc:
            raise LocalProtocolError(f"cannot end response: {exc}") from exc
        self._request = None
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
            self._state = ServerState.RECEIVING
        else:
            self._state = ServerState.MUST_CLOSE
        return out

    @property
    def trailing_data(self) -> bytes:
        """Bytes the client sent after the upgrade request: the next protocol's first input."""
        if self._state is not ServerState.SWITCHED:
            raise LocalProtocolError("trailing_data exists only after accept()")
        return bytes(self._h11.trailing_data[0])


# --- client side ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UpgradeResponse:
    """The server's answer. `error` is None exactly when the upgrade succeeded."""

    status: int
    reason: str
    headers: Headers
    body: bytes
    protocol: str | None
    error: str | None = None

    @property
    def upgraded(self) -> bool:
        return self.error is None

    def header(self, name: str) -> str | None:
        return _first(self.headers, name)

    def raise_for_error(self) -> None:
        if self.error is not None:
            raise UpgradeFailedError(self.error, self.status)


def _status_message(body: bytes) -> str | None:
    """client-go's rendering of a metav1 Status body, or None if the body is not one."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("kind") != "Status":
        return None
    message = str(doc.get("message", ""))
    reason = str(doc.get("reason", "") or "")
    if reason:
        return f"Error from server ({reason}): {message}"
    return f"Error from server: {message}"


class ClientHandshake:
    """Client side: build one upgrade request, then parse the answer.

    Build the request with `spdy_request`/`ws_request`, or elsewhere (`build_*_request`) and
    then say what was sent: `ws_key` for a WebSocket request (none means SPDY) and, if the
    subprotocol should be checked here, the offered `protocols`.
    """

    def __init__(
        self,
        *,
        ws_key: str | None = None,
        protocols: Sequence[str] | None = None,
        max_head_bytes: int = MAX_HEAD_BYTES,
    ) -> None:
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_head_bytes)
        self._transport: Transport | None = None
        # None: the request was built elsewhere and the caller checks the protocol itself.
        self._offered: tuple[str, ...] | None = None if protocols is None else tuple(protocols)
        self._key: str | None = ws_key
        self._response: h11.Response | h11.InformationalResponse | None = None
        self._body = bytearray()
        self._result: UpgradeResponse | None = None

    def spdy_request(
        self,
        method: str,
        target: str,
        host: str,
        protocols: Sequence[str],
        extra_headers: HeaderInput = (),
    ) -> bytes:
        """The request kubectl sends: Content-Length 0, one X-Stream-Protocol-Version a line."""
        if not protocols:
            raise LocalProtocolError("SPDY upgrade needs at least one protocol")
        headers: list[tuple[bytes, bytes]] = [(b"Host", host.encode("ascii"))]
        if method.upper() != "GET":
            headers.append((b"Content-Length", b"0"))
        headers += [(b"Connection", b"Upgrade"), (b"Upgrade", b"SPDY/3.1")]
        headers += [(b"X-Stream-Protocol-Version", p.encode("latin-1")) for p in protocols]
        headers += _normalize_headers(extra_headers)
        self._transport = Transport.SPDY
        self._offered = tuple(protocols)
        return self._send_request(method, target, headers)

    def ws_request(
        self,
        target: str,
        host: str,
        subprotocols: Sequence[str],
        key: str,
        extra_headers: HeaderInput = (),
    ) -> bytes:
        """A WebSocket GET. `key` is base64 of 16 random bytes (wsproto's generate_nonce)."""
        try:
            if len(base64.b64decode(key, validate=True)) != 16:
                raise LocalProtocolError("Sec-WebSocket-Key must encode 16 bytes")
        except binascii.Error as exc:
            raise LocalProtocolError(f"Sec-WebSocket-Key is not base64: {exc}") from exc
        headers: list[tuple[bytes, bytes]] = [
            (b"Host", host.encode("ascii")),
            (b"Connection", b"Upgrade"),
            (b"Upgrade", b"websocket"),
            (b"Sec-WebSocket-Key", key.encode("ascii")),
            (b"Sec-WebSocket-Version", _WS_VERSION.encode()),
        ]
        if subprotocols:
            headers.append((b"Sec-WebSocket-Protocol", ",".join(subprotocols).encode("latin-1")))
        headers += _normalize_headers(extra_headers)
        self._transport = Transport.WEBSOCKET
        self._offered = tuple(subprotocols)
        self._key = key
        return self._send_request("GET", target, headers)

    def _send_request(self, method: str, target: str, headers: list[tuple[bytes, bytes]]) -> bytes:
        if self._h11.our_state is not h11.IDLE:
            raise LocalProtocolError("one ClientHandshake sends one request")
        try:
            head = self._h11.send(
                h11.Request(method=method.upper(), target=target, headers=headers)
            )
            self._h11.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            raise LocalProtocolError(f"cannot build request: {exc}") from exc
        assert head is not None
        return head

    def _assume_request_sent(self) -> None:
        # h11 reads a response only after a request; replay a stand-in for the one sent.
        self._transport = Transport.SPDY if self._key is None else Transport.WEBSOCKET
        upgrade = b"SPDY/3.1" if self._key is None else b"websocket"
        headers = [(b"Host", b"localhost"), (b"Connection", b"Upgrade"), (b"Upgrade", upgrade)]
        self._h11.send(h11.Request(method=b"GET", target=b"/", headers=headers))
        self._h11.send(h11.EndOfMessage())

    def receive_data(self, data: bytes) -> UpgradeResponse | None:
        """Feed bytes; returns the answer once complete (a 101 head, or a head plus body)."""
        if self._transport is None:
            self._assume_request_sent()
        if self._result is not None:
            raise LocalProtocolError("the response is complete; use trailing_data")
        if data:
            self._h11.receive_data(data)
        return self._advance()

    def receive_eof(self) -> UpgradeResponse | None:
        """The server closed. Completes a close-delimited body, otherwise raises."""
        if self._result is not None:
            return None
        if self._transport is None:
            self._assume_request_sent()
        self._h11.receive_data(b"")
        try:
            result = self._advance()
        except RemoteProtocolError as exc:
            # kubectl does not fall back on this: it is not an UpgradeFailedError.
            raise RemoteProtocolError("unexpected EOF before the upgrade response") from exc
        if result is None:
            raise RemoteProtocolError("unexpected EOF before the upgrade response")
        return result

    def _advance(self) -> UpgradeResponse | None:
        while self._result is None:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise RemoteProtocolError(f"malformed upgrade response: {exc}") from exc
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return None
            if isinstance(event, h11.InformationalResponse):
                if event.status_code == 101:
                    self._response = event
                    self._result = self._finish_101(event)
            elif isinstance(event, h11.Response):
                self._response = event
            elif isinstance(event, h11.Data):
                room = MAX_ERROR_BODY_BYTES - len(self._body)
                self._body += event.data[:room]
                if len(self._body) >= MAX_ERROR_BODY_BYTES:
                    self._result = self._finish_failure()
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                if self._response is None:
                    raise RemoteProtocolError("unexpected EOF before the upgrade response")
                self._result = self._finish_failure()
        return self._result

    def _finish_101(self, event: h11.InformationalResponse) -> UpgradeResponse:
        headers = tuple((bytes(n), bytes(v)) for n, v in event.headers)
        error: str | None = None
        protocol: str | None
        if self._transport is Transport.SPDY:
            protocol = _first(headers, "x-stream-protocol-version")
            if not (
                _contains(headers, "connection", "upgrade")
                and _contains(headers, "upgrade", "spdy/3.1")
            ):
                error = "unable to upgrade connection: missing upgrade headers in response"
            elif (
                protocol is not None and self._offered is not None and protocol not in self._offered
            ):
                error = (
                    f"unable to negotiate protocol: client supports {_go_list(self._offered)}, "
                    f'server returned "{protocol}"'
                )
        else:
            protocol = _first(headers, "sec-websocket-protocol")
            assert self._key is not None
            if not (
                any(t.lower() == "websocket" for t in _tokens(headers, "upgrade"))
                and _contains(headers, "connection", "upgrade")
            ):
                error = "unable to upgrade connection: missing upgrade headers in response"
            elif _first(headers, "sec-websocket-accept") != ws_accept_value(self._key):
                error = "unable to upgrade connection: bad Sec-WebSocket-Accept"
            elif self._offered is not None and (protocol or "") not in (self._offered or ("",)):
                error = (
                    f"invalid protocol, expected one of {_go_list(self._offered)}, "
                    f'got "{protocol or ""}"'
                )
        return UpgradeResponse(
            status=101,
            reason=event.reason.decode("latin-1"),
            headers=headers,
            body=b"",
            protocol=protocol,
            error=error,
        )

    def _finish_failure(self) -> UpgradeResponse:
        assert self._response is not None
        response = self._response
        body = bytes(self._body)
        headers = tuple((bytes(n), bytes(v)) for n, v in response.headers)
        message = _status_message(body)
        if message is None:
            text = body.decode("utf-8", "replace").strip()
            detail = text or f"{response.status_code} {response.reason.decode('latin-1')}"
            message = f"unable to upgrade connection: {detail}"
        return UpgradeResponse(
            status=response.status_code,
            reason=response.reason.decode("latin-1"),
            headers=headers,
            body=body,
            protocol=None,
            error=message,
        )

    @property
    def trailing_data(self) -> bytes:
        """Bytes after the 101 head: the first input for the upgraded protocol."""
        if self._result is None or self._result.status != 101:
            raise LocalProtocolError("trailing_data exists only after a 101")
        return bytes(self._h11.trailing_data[0])


def build_spdy_request(
    method: str,
    target: str,
    host: str,
    protocols: Sequence[str],
    extra_headers: HeaderInput = (),
) -> bytes:
    return ClientHandshake().spdy_request(method, target, host, protocols, extra_headers)


def build_ws_request(
    target: str,
    host: str,
    subprotocols: Sequence[str],
    key: str,
    extra_headers: HeaderInput = (),
) -> bytes:
    return ClientHandshake().ws_request(target, host, subprotocols, key, extra_headers)
