"""A small Kubernetes API for one host: the requests kubectl makes around exec, attach and
port-forward (discovery, pod list and GET), with the upgrades served by the streaming handlers.

`podgate demo` runs it with a LocalTarget; the protocol tests point real kubectl and the real
Python client at it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

from podgate.aio.http import next_request
from podgate.aio.streams import SocketStream, start_server
from podgate.proto import k8s
from podgate.proto.errors import RemoteProtocolError
from podgate.proto.upgrade import HandshakeError, ServerHandshake, StreamKind, UpgradeRequest
from podgate.streaming.server import StreamRequest, serve_stream
from podgate.streaming.target import PodRef, StreamTarget

log = logging.getLogger(__name__)

JSON = "application/json"
TABLE_CONTENT_TYPE = "application/json;as=Table;v=v1;g=meta.k8s.io"

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
class DemoPod:
    namespace: str
    name: str
    containers: Sequence[str] = ("main",)
    ports: Sequence[int] = ()
    phase: str = "Running"
    created: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def uid(self) -> str:
        return f"demo-{self.namespace}-{self.name}"

    def body(self) -> dict[str, Any]:
        containers = []
        for i, name in enumerate(self.containers):
            c: dict[str, Any] = {"name": name, "stdin": True, "tty": True}
            if i == 0 and self.ports:
                c["ports"] = [{"containerPort": p, "protocol": "TCP"} for p in self.ports]
            containers.append(c)
        return {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
                "creationTimestamp": self.created.strftime("%Y-%m-%dT%H:%M:%SZ"),
            },
            "spec": {"containers": containers},
            "status": {"phase": self.phase},
        }


def _age(created: datetime) -> str:
    seconds = int((datetime.now(UTC) - created).total_seconds())
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


class DemoApi:
    """Serves the API requests kubectl makes for pods and their streams."""

    def __init__(self, target: StreamTarget, pods: Sequence[DemoPod]) -> None:
        self.target = target
        self.pods = {(p.namespace, p.name): p for p in pods}

    async def serve(
        self, host: str = "127.0.0.1", port: int = 0, *, ssl_context: ssl.SSLContext | None = None
    ) -> asyncio.Server:
        return await start_server(self.handle, host, port, ssl_context=ssl_context)

    async def handle(self, conn: SocketStream) -> None:
        handshake = ServerHandshake()
        while True:
            try:
                request = await next_request(conn, handshake)
            except HandshakeError as exc:
                await self._send_status(conn, handshake, exc.status, "BadRequest", exc.message)
                return
            except RemoteProtocolError:
                return
            if request is None:
                return
            if await self._route(conn, handshake, request):
                return  # the connection was upgraded and is finished

    async def _route(
        self, conn: SocketStream, handshake: ServerHandshake, request: UpgradeRequest
    ) -> bool:
        path = request.path
        if path == "/api":
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
            pod = self.pods.get((unquote(m["ns"]), unquote(m["name"])))
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
            elif sub is None:
                await self._send_json(conn, handshake, pod.body())
            elif sub in _SUBRESOURCES:
                what = StreamRequest(_SUBRESOURCES[sub], PodRef(pod.namespace, pod.name, pod.uid))
                await serve_stream(conn, handshake, request, what, self.target)
                return True
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

    async def _list(
        self,
        conn: SocketStream,
        handshake: ServerHandshake,
        request: UpgradeRequest,
        namespace: str | None,
    ) -> None:
        pods = [p for p in self.pods.values() if namespace is None or p.namespace == namespace]
        if "as=Table" in (request.header("accept") or ""):
            body: dict[str, Any] = {
                "kind": "Table",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": {"resourceVersion": "1"},
                "columnDefinitions": [
                    {
                        "name": n,
                        "type": "string",
                        "format": "name" if n == "Name" else "",
                        "description": n,
                        "priority": 0,
                    }
                    for n in ("Name", "Ready", "Status", "Restarts", "Age")
                ],
                "rows": [
                    {
                        "cells": [
                            p.name,
                            f"{len(p.containers)}/{len(p.containers)}",
                            p.phase,
                            "0",
                            _age(p.created),
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
            await self._send_json(conn, handshake, body, TABLE_CONTENT_TYPE)
        else:
            body = {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": "1"},
                "items": [p.body() for p in pods],
            }
            await self._send_json(conn, handshake, body)

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
