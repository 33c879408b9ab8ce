"""The backend seam: `open(pod, port, protocol) -> ByteStream`, chosen per pod by its runtime
handler.

A backend never sees SPDY or WebSocket; the base does the choosing, timing and logging so a
backend is only the part that differs. For protocol "udp" the stream carries framed datagrams
(podgate.proto.datagram) to and from a UDP socket connected to 127.0.0.1:port in the pod; a
backend that cannot do UDP raises BackendUnavailableError, so the next one in the chain may.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from podgate.aio.streams import ByteStream
from podgate.model import PodRecord

log = logging.getLogger(__name__)


class BackendError(Exception):
    """The port could not be reached; the message reaches the client verbatim."""


class BackendUnavailableError(BackendError):
    """This backend cannot serve the pod at all (no agent, no shim, no tool in the container),
    as opposed to the port being closed: the next backend in the pod's list may."""


class Backend(Protocol):
    name: str

    async def open(self, pod: PodRecord, port: int, protocol: str = "tcp") -> ByteStream: ...


BackendChain = Backend | Sequence[Backend]


def _chain(value: BackendChain) -> tuple[Backend, ...]:
    chain = tuple(value) if isinstance(value, Sequence) else (value,)
    if not chain:
        raise ValueError("a backend list needs at least one backend")
    return chain


class Backends:
    """Picks backends by the pod's runtime handler ("" = the default) and tries them in order:
    the next one only when the previous is unavailable, never when the port was refused."""

    def __init__(
        self, default: BackendChain, by_handler: Mapping[str, BackendChain] | None = None
    ) -> None:
        self.default = _chain(default)
        self.by_handler = {k: _chain(v) for k, v in (by_handler or {}).items()}

    def chain_for(self, pod: PodRecord) -> tuple[Backend, ...]:
        return self.by_handler.get(pod.runtime_handler, self.default)

    def for_pod(self, pod: PodRecord) -> Backend:
        return self.chain_for(pod)[0]

    async def open(self, pod: PodRecord, port: int, protocol: str = "tcp") -> ByteStream:
        unavailable: list[str] = []
        chain = self.chain_for(pod)
        where = f"{port}/{protocol}"
        for backend in chain:
            start = time.monotonic()
            try:
                stream = await backend.open(pod, port, protocol)
            except BackendUnavailableError as exc:
                log.info(
                    "%s: pod %s port %s unavailable: %s", backend.name, pod.id[:12], where, exc
                )
                unavailable.append(f"{backend.name}: {exc}" if len(chain) > 1 else str(exc))
                continue
            except BackendError as exc:
                log.info("%s: pod %s port %s: %s", backend.name, pod.id[:12], where, exc)
                raise
            log.debug(
                "%s: pod %s port %s open in %.1f ms",
                backend.name,
                pod.id[:12],
                where,
                (time.monotonic() - start) * 1000,
            )
            return stream
        raise BackendUnavailableError("; ".join(unavailable))
