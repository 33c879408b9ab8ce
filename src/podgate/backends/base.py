"""The backend seam: `open(pod, port) -> ByteStream`, chosen per pod by its runtime handler.

A backend never sees SPDY or WebSocket; the base does the choosing, timing and logging so a
backend is only the part that differs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Protocol

from podgate.aio.streams import ByteStream
from podgate.runtime.model import PodRecord

log = logging.getLogger(__name__)


class BackendError(Exception):
    """The port could not be reached; the message reaches the client verbatim."""


class Backend(Protocol):
    name: str

    async def open(self, pod: PodRecord, port: int) -> ByteStream: ...


class Backends:
    """Picks a backend by the pod's runtime handler ("" = the default)."""

    def __init__(self, default: Backend, by_handler: Mapping[str, Backend] | None = None) -> None:
        self.default = default
        self.by_handler = dict(by_handler or {})

    def for_pod(self, pod: PodRecord) -> Backend:
        return self.by_handler.get(pod.runtime_handler, self.default)

    async def open(self, pod: PodRecord, port: int) -> ByteStream:
        backend = self.for_pod(pod)
        start = time.monotonic()
        try:
            stream = await backend.open(pod, port)
        except BackendError as exc:
            log.info("%s: pod %s port %d: %s", backend.name, pod.id[:12], port, exc)
            raise
        log.debug(
            "%s: pod %s port %d open in %.1f ms",
            backend.name,
            pod.id[:12],
            port,
            (time.monotonic() - start) * 1000,
        )
        return stream
