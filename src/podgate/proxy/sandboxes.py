"""Which sandboxes the proxy answers PortForward for, looked up through the upstream's
PodSandboxStatus and cached until RemovePodSandbox.

A sandbox's runtime handler, annotations and metadata never change over its life, so a cached
answer stays right until the sandbox is removed; the cache is only an optimisation, rebuilt
from the upstream after a restart of the proxy.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Final

import grpc
import grpc.aio

from podgate.cri import api_pb2 as pb
from podgate.proxy.config import Selector
from podgate.streaming.target import PodRef

log = logging.getLogger(__name__)

# Sandboxes remembered at once; the oldest lookup is forgotten first (a node runs ~110 pods).
MAX_CACHED_SANDBOXES: Final = 4096
# One PodSandboxStatus lookup, seconds, when the caller gave no deadline.
LOOKUP_TIMEOUT_SECONDS: Final = 10.0
_STATUS_METHOD: Final = "/runtime.v1.RuntimeService/PodSandboxStatus"


@dataclass(frozen=True, slots=True)
class Sandbox:
    pod: PodRef
    runtime_handler: str
    selected: bool


class SandboxCache:
    def __init__(self, channel: grpc.aio.Channel, selector: Selector) -> None:
        self.selector = selector
        self._status = channel.unary_unary(
            _STATUS_METHOD,
            request_serializer=pb.PodSandboxStatusRequest.SerializeToString,
            response_deserializer=pb.PodSandboxStatusResponse.FromString,
        )
        self._cache: collections.OrderedDict[str, Sandbox] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._cache)

    async def lookup(self, sandbox_id: str, timeout: float | None = None) -> Sandbox | None:
        """The sandbox, or None when the upstream cannot say (it then answers the call itself,
        with its own error)."""
        cached = self._cache.get(sandbox_id)
        if cached is not None:
            return cached
        try:
            response = await self._status(
                pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id),
                timeout=timeout if timeout is not None else LOOKUP_TIMEOUT_SECONDS,
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("PodSandboxStatus %s: %s %s", sandbox_id, exc.code().name, exc.details())
            return None
        status = response.status
        meta = status.metadata
        sandbox = Sandbox(
            pod=PodRef(meta.namespace, meta.name, meta.uid, status.id or sandbox_id),
            runtime_handler=status.runtime_handler,
            selected=self.selector.selects(status.runtime_handler, status.annotations),
        )
        self._cache[sandbox_id] = sandbox
        while len(self._cache) > MAX_CACHED_SANDBOXES:
            self._cache.popitem(last=False)
        return sandbox

    def forget(self, sandbox_id: str) -> None:
        self._cache.pop(sandbox_id, None)
