"""The slice of the Kubernetes API kubectl needs for one node: discovery, pod list and GET,
and the exec/attach/port-forward upgrades, served by the streaming handlers.

Pods come from a PodSource: the demo's static pods, or a runtime's real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import unquote

from podgate.aio.errors import StreamError
from podgate.aio.http import linger_close, next_request
from podgate.aio.streams import SocketStream
from podgate.node.listener import Listener, PreAuth, Ticket, listen
from podgate.node.logs import LogSource, LogSourceLost, read_log
from podgate.node.origin import Refusal, RequestOrigins
from podgate.proto import k8s
from podgate.proto.errors import RemoteProtocolError
from podgate.proto.pipeline import HeadScanner
from podgate.proto.upgrade import HandshakeError, ServerHandshake, StreamKind, UpgradeRequest
from podgate.streaming.hooks import SessionHooks
from podgate.streaming.server import StreamRequest, serve_stream
from podgate.streaming.target import PodRef, StreamTarget

log = logging.getLogger(__name__)

JSON = "application/json"
# Streams with no traffic for this long are closed (the kubelet's streamingConnectionIdleTimeout).
DEFAULT_IDLE_TIMEOUT_SECONDS = 4 * 3600.0
TABLE_CONTENT_TYPE = "application/json;as=Table;v=v1;g=meta.k8s.io"
# Anonymous requests answered in a row on one connection before every other connection (an
# authenticated user's handshake among them) gets a turn: a few ms of work at most.
ANONYMOUS_ANSWERS_PER_TURN = 16

_POD_PATH = re.compile(
    r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)(?:/(?P<sub>[a-z]+))?$"
)
_LIST_PATH = re.compile(r"^/api/v1(?:/namespaces/(?P<ns>[^/]+))?/pods$")
_SUBRESOURCES = {
    "exec": StreamKind.EXEC,
    "attach": StreamKind.ATTACH,
    "portforward": StreamKind.PORTFORWARD,
}

API_VERSIONS = {
    "kind": "APIVersions",
    "versions": ["v1"],
    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
}
API_GROUPS = {"kind": "APIGroupList", "apiVersion": "v1", "groups": []}
_SUB_VERBS = ["create", "get"]
API_RESOURCES = {
    "kind": "APIResourceList",
    "groupVersion": "v1",
    "resources": [
        {
            "name": "pods",
            "singularName": "pod",
            "namespaced": True,
            "kind": "Pod",
            "verbs": ["get", "list"],
            "shortNames": ["po"],
            "categories": ["all"],
        },
        {
            "name": "pods/exec",
            "singularName": "",
            "namespaced": True,
            "kind": "PodExecOptions",
            "verbs": _SUB_VERBS,
        },
        {
            "name": "pods/attach",
            "singularName": "",
            "namespaced": True,
            "kind": "PodAttachOptions",
            "verbs": _SUB_VERBS,
        },
        {
            "name": "pods/portforward",
            "singularName": "",
            "namespaced": True,
            "kind": "PodPortForwardOptions",
            "verbs": _SUB_VERBS,
        },
    ],
}


@dataclass(slots=True)
class ContainerView:
    name: str
    id: str = ""
    ports: Sequence[int] = ()
    stdin: bool = False
    tty: bool = False
    ready: bool = True
    image: str = ""


@dataclass(slots=True)
class PodView:
    """A pod as the API shows it."""

    namespace: str
    name: str
    uid: str
    containers: Sequence[ContainerView] = ()
    phase: str = "Running"
    created: datetime = field(default_factory=lambda: datetime.now(UTC))
    ip: str = ""
    node: str = ""
    sandbox_id: str = ""

    @property
    def ref(self) -> PodRef:
        return PodRef(self.namespace, self.name, self.uid, self.sandbox_id)

    def body(self) -> dict[str, Any]:
        containers = []
        for c in self.containers:
            item: dict[str, Any] = {"name": c.name, "stdin": c.stdin, "tty": c.tty}
            if c.ports:
                item["ports"] = [{"containerPort": p, "protocol": "TCP"} for p in c.ports]
            containers.append(item)
        status: dict[str, Any] = {"phase": self.phase}
        if self.ip:
            status["podIP"] = self.ip
            status["podIPs"] = [{"ip": self.ip}]
        status["containerStatuses"] = [
            {
                "name": c.name,
                "ready": c.ready,
                "restartCount": 0,
                "image": c.image,
                "imageID": "",
                "containerID": f"podgate://{c.id}" if c.id else "",
                "started": c.ready,
                "state": {"running": {}} if c.ready else {"waiting": {"reason": "NotRunning"}},
            }
            for c in self.containers
        ]
        return {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
                "creationTimestamp": self.created.strftime("%Y-%m-%dT%H:%M:%SZ"),
            },
            "spec": {"containers": containers, **({"nodeName": self.node} if self.node else {})},
            "status": status,
        }


class PodSource(Protocol):
    """Where the API's pods come from, and what serves their streams."""

    @property
    def target(self) -> StreamTarget: ...

    async def list_pods(self) -> list[PodView]: ...

    def stream_container(self, pod: PodView, name: str | None) -> str | None:
        """What the target calls the container (an id, or the name); None if unknown."""
        ...

    async def logs(self, pod: PodView, container: str) -> LogSource | None:
        """The container's CRI log, or None when this source keeps none."""
        ...


def aggregated_discovery_version(accept: str) -> str | None:
    """The aggregated discovery version the client asks for first ("v2", "v2beta1"), if any:
    kubectl 1.30+ prefers v2, 1.27–1.29 offer v2beta1; plain JSON gets legacy discovery."""
    for offer in accept.split(","):
        params = {
            k.strip(): v.strip() for k, _, v in (p.partition("=") for p in offer.split(";")[1:])
        }
        if (
            params.get("g") == "apidiscovery.k8s.io"
            and params.get("as") == "APIGroupDiscoveryList"
            and params.get("v") in ("v2", "v2beta1")
        ):
            return params["v"]
    return None


def aggregated_discovery(version: str, *, core: bool) -> dict[str, Any]:
    """APIGroupDiscoveryList: the core group's pods and subresources (`/api`), or no groups
    (`/apis`). Saves kubectl the `/api/v1` request."""
    items: list[dict[str, Any]] = []
    if core:
        subresources = [
            {
                "subresource": name,
                "responseKind": {"group": "", "version": "v1", "kind": kind},
                "verbs": verbs,
            }
            for name, kind, verbs in (
                ("exec", "PodExecOptions", ["create", "get"]),
                ("attach", "PodAttachOptions", ["create", "get"]),
                ("portforward", "PodPortForwardOptions", ["create", "get"]),
                ("log", "Pod", ["get"]),
            )
        ]
        items.append(
            {
                "metadata": {"creationTimestamp": None},
                "versions": [
                    {
                        "version": "v1",
                        "freshness": "Current",
                        "resources": [
                            {
                                "resource": "pods",
                                "responseKind": {"group": "", "version": "v1", "kind": "Pod"},
                                "scope": "Namespaced",
                                "singularResource": "pod",
                                "shortNames": ["po"],
                                "categories": ["all"],
                                "verbs": ["get", "list"],
                                "subresources": subresources,
                            }
                        ],
                    }
                ],
            }
        )
    return {
        "kind": "APIGroupDiscoveryList",
        "apiVersion": f"apidiscovery.k8s.io/{version}",
        "metadata": {},
        "items": items,
    }


# kubectl prints these columns; priority 1 only with -o wide.
_TABLE_COLUMNS = (
    ("Name", 0),
    ("Ready", 0),
    ("Status", 0),
    ("Restarts", 0),
    ("Age", 0),
    ("IP", 1),
    ("Node", 1),
)


def pod_table(pods: Sequence[PodView]) -> dict[str, Any]:
    """Pods as the meta.k8s.io Table kubectl prints (it shows the cells as they are)."""
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": "1"},
        "columnDefinitions": [
            {
                "name": n,
                "type": "string",
                "format": "name" if n == "Name" else "",
                "description": n,
                "priority": priority,
            }
            for n, priority in _TABLE_COLUMNS
        ],
        "rows": [
            {
                "cells": [
                    p.name,
                    f"{sum(c.ready for c in p.containers)}/{len(p.containers)}",
                    p.phase,
                    "0",
                    _age(p.created),
                    p.ip or "<none>",
                    p.node or "<none>",
                ],
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": p.body()["metadata"],
                },
            }
            for p in pods
        ],
    }


def _age(created: datetime) -> str:
    seconds = int((datetime.now(UTC) - created).total_seconds())
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


class SourceUnavailable(Exception):
    """The pod source (the runtime) could not be asked; answered 503."""


class StreamGuard(Protocol):
    """One admitted stream: its hooks, and the call that closes its audit record."""

    @property
    def hooks(self) -> SessionHooks: ...

    @property
    def tenant(self) -> str:
        """Who the stream is for (upstream sessions are kept apart per tenant)."""
        ...

    def finish(self, outcome: str, detail: str = "") -> None: ...


class Guard(Protocol):
    """Authentication, authorization, audit and limits (the gateway); None = open access."""

    def identify(self, conn: SocketStream, request: UpgradeRequest) -> object | None:
        """Who sent the request; None answers 401."""
        ...

    def check(
        self, who: object, verb: str, namespace: str, pod: str, request: UpgradeRequest
    ) -> str | None:
        """None if allowed, else the reason (denials are audited here)."""
        ...

    def admit(
        self, who: object, verb: str, pod: PodView, container: str | None, request: UpgradeRequest
    ) -> StreamGuard | str:
        """Start a stream (limits, audit), or the reason it is refused (429)."""
        ...

    def refused(self, address: str, verb: str, path: str, status: int, reason: str) -> None:
        """A request or connection turned away before authentication (audited, aggregated)."""
        ...


# The verb each pod subresource is authorised as, whatever the HTTP method: a WebSocket GET
# to /exec is an exec, never a "get".
_SUBRESOURCE_VERBS = {
    "exec": "exec",
    "attach": "attach",
    "portforward": "portforward",
    "log": "log",
}


class KubeApi:
    """Serves the API requests kubectl makes for pods and their streams."""

    def __init__(
        self,
        source: PodSource,
        *,
        guard: Guard | None = None,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT_SECONDS,
        origins: RequestOrigins | None = None,
        preauth: PreAuth | None = None,
    ) -> None:
        self.source = source
        self.guard = guard
        self.idle_timeout = idle_timeout
        # Without explicit names (an in-process API for tests) any Host goes; every server the
        # CLI starts passes the names it serves.
        self.origins = origins or RequestOrigins(check_host=False)
        self.preauth = preauth or PreAuth()

    async def _pods(self) -> list[PodView]:
        try:
            return await self.source.list_pods()
        except Exception as exc:
            log.warning("listing pods failed: %s", exc)
            raise SourceUnavailable(str(exc)) from exc

    async def find(self, namespace: str, name: str) -> PodView | None:
        for pod in await self._pods():
            if pod.namespace == namespace and pod.name == name:
                return pod
        return None

    async def serve(
        self, host: str = "127.0.0.1", port: int = 0, *, ssl_context: ssl.SSLContext | None = None
    ) -> Listener:
        """Listen; `host` joins the names a request's Host may carry."""
        self.origins.add_hosts([host])
        return await listen(
            self.handle,
            host,
            port,
            ssl_context=ssl_context,
            preauth=self.preauth,
            on_refused=self._refused_connection,
        )

    def _refused_connection(self, peer: object, reason: str) -> None:
        if self.guard is not None:
            self.guard.refused(_peer_address(peer), "CONNECT", "", 0, reason)

    async def handle(self, conn: SocketStream, ticket: Ticket | None = None) -> None:
        handshake = ServerHandshake()
        rest = b""
        if ticket is not None and self.guard is not None:
            try:
                async with asyncio.timeout_at(ticket.deadline):
                    found = await self._answer_anonymous(conn)
            except TimeoutError:
                self.preauth.timed_out += 1
                return
            if found is None:
                return
            rest = found
        while True:
            try:
                request, rest = (handshake.receive_data(rest) if rest else None), b""
                if request is None:
                    request = await self._next_request(conn, handshake, ticket)
            except TimeoutError:
                self.preauth.timed_out += 1
                return
            except HandshakeError as exc:
                await self._send_status(conn, handshake, exc.status, "BadRequest", exc.message)
                await linger_close(conn)
                return
            except RemoteProtocolError:
                return
            if request is None:
                return
            try:
                if await self._route(conn, handshake, request, ticket):
                    return  # the connection was upgraded and is finished
            except SourceUnavailable as exc:
                await self._send_status(
                    conn,
                    handshake,
                    503,
                    "ServiceUnavailable",
                    f"the container runtime is unavailable: {exc}",
                )

    @staticmethod
    async def _next_request(
        conn: SocketStream, handshake: ServerHandshake, ticket: Ticket | None
    ) -> UpgradeRequest | None:
        if ticket is not None and not ticket.released:
            # Not authenticated yet: the whole connection has until its deadline.
            async with asyncio.timeout_at(ticket.deadline):
                return await next_request(conn, handshake)
        return await next_request(conn, handshake)

    async def _answer_anonymous(self, conn: SocketStream) -> bytes | None:
        """Answer 401 to plain requests without credentials as they come, without the HTTP
        state machine: the cheapest a request from anyone can be. Returns the bytes from the
        first request that needs more (credentials, a refused origin, a body, an upgrade), or
        None once the client is gone."""
        assert self.guard is not None
        scanner = HeadScanner()
        answers: list[bytes] = []
        while True:
            while (request := scanner.next_request()) is not None:
                if (
                    self.origins.check(request) is not None
                    or self.guard.identify(conn, request) is not None
                ):
                    break
                answers.append(_UNAUTHORIZED_RESPONSE)
                if len(answers) >= ANONYMOUS_ANSWERS_PER_TURN:
                    conn.writelines(answers)
                    answers.clear()
                    await conn.drain()
                    await asyncio.sleep(0)  # every other connection's turn
            else:
                if not scanner.stopped:
                    if answers:
                        conn.writelines(answers)
                        answers.clear()
                        await conn.drain()
                    data = await conn.receive()
                    if not data:
                        return None
                    scanner.receive_data(data)
                    continue
                request = None
            # The full parser reads it (again, for one that is not anonymous) and what follows.
            if answers:
                conn.writelines(answers)
                await conn.drain()
            return scanner.take_rest(with_last=request is not None)

    async def _route(
        self,
        conn: SocketStream,
        handshake: ServerHandshake,
        request: UpgradeRequest,
        ticket: Ticket | None = None,
    ) -> bool:
        refusal = self.origins.check(request)
        if refusal is not None:
            return await self._refuse(conn, handshake, request, refusal)
        who: object = None
        if self.guard is not None:
            who = self.guard.identify(conn, request)
            if who is None:
                await self._send_status(conn, handshake, 401, "Unauthorized", "Unauthorized")
                # Pipelined requests are parsed without waiting: give every other connection
                # (an authenticated user's among them) its turn before the next anonymous one.
                await asyncio.sleep(0)
                return handshake.must_close
        if ticket is not None:
            ticket.release()
        path = request.path
        if self.guard is not None:
            denied = self._authorize(who, request, path)
            if denied is not None:
                await self._send_status(conn, handshake, 403, "Forbidden", denied)
                return handshake.must_close
        aggregated = aggregated_discovery_version(request.header("accept") or "")
        if path in ("/api", "/apis") and aggregated is not None:
            body = aggregated_discovery(aggregated, core=path == "/api")
            content_type = (
                f"application/json;g=apidiscovery.k8s.io;v={aggregated};as=APIGroupDiscoveryList"
            )
            await self._send_json(conn, handshake, body, content_type)
        elif path == "/api":
            await self._send_json(conn, handshake, API_VERSIONS)
        elif path == "/apis":
            await self._send_json(conn, handshake, API_GROUPS)
        elif path == "/api/v1":
            await self._send_json(conn, handshake, API_RESOURCES)
        elif path == "/version":
            await self._send_json(
                conn, handshake, {"major": "1", "minor": "33", "gitVersion": "v1.33.0-podgate"}
            )
        elif m := _LIST_PATH.match(path):
            await self._list(conn, handshake, request, m["ns"] and unquote(m["ns"]))
        elif m := _POD_PATH.match(path):
            pod = await self.find(unquote(m["ns"]), unquote(m["name"]))
            sub = m["sub"]
            if pod is None:
                await self._send_status(
                    conn,
                    handshake,
                    404,
                    "NotFound",
                    f'pods "{unquote(m["name"])}" not found',
                    details={"name": unquote(m["name"]), "kind": "pods"},
                )
            elif sub is None and "as=Table" in (request.header("accept") or ""):
                await self._send_json(conn, handshake, pod_table([pod]), TABLE_CONTENT_TYPE)
            elif sub is None:
                await self._send_json(conn, handshake, pod.body())
            elif sub == "log" and request.method in ("GET", "HEAD"):
                await self._logs(conn, handshake, request, pod)
            elif sub in _SUBRESOURCES:
                return await self._stream(conn, handshake, request, pod, _SUBRESOURCES[sub], who)
            else:
                await self._send_status(
                    conn,
                    handshake,
                    404,
                    "NotFound",
                    "the server could not find the requested resource",
                )
        else:
            await self._send_status(
                conn, handshake, 404, "NotFound", "the server could not find the requested resource"
            )
        return handshake.must_close

    async def _refuse(
        self,
        conn: SocketStream,
        handshake: ServerHandshake,
        request: UpgradeRequest,
        refusal: Refusal,
    ) -> bool:
        """Answer a cross-origin or misdirected request and close: nothing else is read."""
        if self.guard is not None:
            self.guard.refused(
                _peer_address(conn.peername),
                request.method,
                request.path,
                refusal.status,
                refusal.message,
            )
        await conn.send(
            handshake.respond(
                refusal.status,
                [(b"Content-Type", b"application/json"), (b"Connection", b"close")],
                refusal.body(),
            )
        )
        return True

    def _authorize(self, who: object, request: UpgradeRequest, path: str) -> str | None:
        assert self.guard is not None
        if path in ("/api", "/apis", "/api/v1", "/version"):
            return None  # discovery: any authenticated user
        if m := _LIST_PATH.match(path):
            namespace = unquote(m["ns"]) if m["ns"] else "*"
            return self.guard.check(who, "list", namespace, "*", request)
        if m := _POD_PATH.match(path):
            verb = _SUBRESOURCE_VERBS.get(m["sub"] or "", "get")
            return self.guard.check(who, verb, unquote(m["ns"]), unquote(m["name"]), request)
        return None  # not found follows

    async def _list(
        self,
        conn: SocketStream,
        handshake: ServerHandshake,
        request: UpgradeRequest,
        namespace: str | None,
    ) -> None:
        pods = [p for p in await self._pods() if namespace is None or p.namespace == namespace]
        if "as=Table" in (request.header("accept") or ""):
            await self._send_json(conn, handshake, pod_table(pods), TABLE_CONTENT_TYPE)
            return
        body = {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": "1"},
            "items": [p.body() for p in pods],
        }
        await self._send_json(conn, handshake, body)

    async def _stream(
        self,
        conn: SocketStream,
        handshake: ServerHandshake,
        request: UpgradeRequest,
        pod: PodView,
        kind: StreamKind,
        who: object = None,
    ) -> bool:
        """Serve an upgrade; True once the connection is used up."""
        container: str | None = None
        if kind is not StreamKind.PORTFORWARD:
            wanted = dict(request.query_params()).get("container") or None
            container = self.source.stream_container(pod, wanted)
            if container is None:
                await self._send_status(
                    conn,
                    handshake,
                    400,
                    "BadRequest",
                    f"container {wanted} is not valid for pod {pod.name}",
                )
                return handshake.must_close
        if self.guard is None:
            what = StreamRequest(kind, pod.ref, container=container)
            await serve_stream(
                conn, handshake, request, what, self.source.target, idle_timeout=self.idle_timeout
            )
            return True
        name = next((c.name for c in pod.containers if c.id == container), container)
        admitted = self.guard.admit(who, kind.name.lower(), pod, name, request)
        if isinstance(admitted, str):
            await self._send_status(conn, handshake, 429, "TooManyRequests", admitted)
            return handshake.must_close
        # The caller is the tenant: its port-forwards get upstream sessions of their own.
        ref = dataclasses.replace(pod.ref, tenant=admitted.tenant)
        what = StreamRequest(kind, ref, container=container, hooks=admitted.hooks)
        outcome, detail = "error", ""
        try:
            code = await serve_stream(
                conn, handshake, request, what, self.source.target, idle_timeout=self.idle_timeout
            )
            outcome = "completed"
            detail = "" if code is None else f"exit code {code}"
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            admitted.finish(outcome, detail)
        return True

    async def _logs(
        self, conn: SocketStream, handshake: ServerHandshake, request: UpgradeRequest, pod: PodView
    ) -> None:
        params = dict(request.query_params())
        names = [c.name for c in pod.containers]
        container = params.get("container") or (names[0] if names else "")
        if container not in names:
            await self._send_status(
                conn,
                handshake,
                400,
                "BadRequest",
                f"container {container} is not valid for pod {pod.name}",
            )
            return
        try:
            tail = int(params["tailLines"]) if "tailLines" in params else None
        except ValueError:
            await self._send_status(
                conn, handshake, 400, "BadRequest", "tailLines must be a number"
            )
            return
        if params.get("previous", "false").lower() not in ("", "0", "false"):
            await self._send_status(
                conn,
                handshake,
                400,
                "BadRequest",
                f'previous terminated container "{container}" in pod "{pod.name}" not found',
            )
            return
        source = await self.source.logs(pod, container)
        if source is None:
            await self._send_status(
                conn,
                handshake,
                400,
                "BadRequest",
                f'container "{container}" in pod "{pod.name}" keeps no logs',
            )
            return
        follow = params.get("follow", "false").lower() not in ("", "0", "false")
        timestamps = params.get("timestamps", "false").lower() not in ("", "0", "false")
        lines = read_log(
            source.path,
            tail_lines=tail,
            timestamps=timestamps,
            follow=follow,
            still_running=source.still_running,
        )
        if not follow:
            body = b"".join([chunk async for chunk in lines])
            await conn.send(handshake.respond(200, [(b"Content-Type", b"text/plain")], body))
            return
        await conn.send(handshake.start_response(200, [(b"Content-Type", b"text/plain")]))
        try:
            async for chunk in lines:
                await conn.send(handshake.send_body(chunk))
            await conn.send(handshake.end_response())
        except StreamError:
            pass  # the client stopped following (Ctrl-C): not an error
        except LogSourceLost as exc:
            # The status line is long gone: say why in the body (as the kubelet writes its
            # error there), then cut the response short, so the client fails with an
            # unexpected EOF instead of reading a complete log.
            log.warning("logs %s/%s: follow ended: %s", pod.namespace, pod.name, exc)
            with contextlib.suppress(StreamError):
                await conn.send(handshake.send_body(f"error: {exc}\n".encode()))
            conn.abort()
        finally:
            await lines.aclose()

    async def _send_json(
        self,
        conn: SocketStream,
        handshake: ServerHandshake,
        body: dict[str, Any],
        content_type: str = JSON,
    ) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        await conn.send(handshake.respond(200, [(b"Content-Type", content_type.encode())], data))

    async def _send_status(
        self,
        conn: SocketStream,
        handshake: ServerHandshake,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
    ) -> None:
        body = k8s.http_status_body(code, reason, message, details)
        await conn.send(handshake.respond(code, [(b"Content-Type", b"application/json")], body))


def _render_unauthorized() -> bytes:
    """The 401 exactly as the full path answers it, rendered once."""
    handshake = ServerHandshake()
    handshake.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    body = k8s.http_status_body(401, "Unauthorized", "Unauthorized")
    return handshake.respond(401, [(b"Content-Type", b"application/json")], body)


_UNAUTHORIZED_RESPONSE = _render_unauthorized()


def _peer_address(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return str(peer or "")
