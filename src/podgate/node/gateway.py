"""`podgate node`: the kubelet's streaming role plus the API slice kubectl needs, for one node,
in front of any CRI runtime — authenticated, authorised, audited, limited.

Every request is authenticated (x509 client certificate, else bearer token) and authorised
as the verb it performs (a WebSocket GET to /exec is an exec). Streams are terminated here
and re-opened towards the runtime's one-time streaming URLs as a SPDY client, so the runtime's
unauthenticated streaming server never faces a client, and every port-forward stream's port is
known to policy and audit.
"""

from __future__ import annotations

import collections
import logging
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from podgate.aio.spdy import MAX_STREAMS_PER_SESSION, ControlBudget
from podgate.aio.streams import SocketStream
from podgate.node.audit import DEFAULT_AUDIT_KEEP, DEFAULT_AUDIT_MAX_BYTES, AuditLog
from podgate.node.auth import Authenticator, TokenFile, UserInfo
from podgate.node.kubeapi import PodView
from podgate.node.listener import DEFAULT_AUTH_TIMEOUT_SECONDS, DEFAULT_MAX_UNAUTHENTICATED
from podgate.node.policy import Policy
from podgate.proto.upgrade import UpgradeRequest
from podgate.streaming.hooks import ForwardRecord, SessionHooks
from podgate.streaming.server import PAIRS_IN_FLIGHT

log = logging.getLogger(__name__)

# Concurrent streams one user, and one pod, may have open (0 = no cap).
DEFAULT_MAX_STREAMS_PER_USER = 64
DEFAULT_MAX_STREAMS_PER_POD = 128
# Streams one user may hold on one pod: a quarter of the pod's cap, so two (or three) users
# with sessions left open cannot take a pod away from everyone else.
DEFAULT_MAX_STREAMS_PER_USER_PER_POD = DEFAULT_MAX_STREAMS_PER_POD // 4
# Seconds a session may carry no data before it is closed: Kubernetes' streaming idle timeout.
# Pings do not count (kubectl pings every 5-10 s), so a session left open is reaped.
DEFAULT_IDLE_TIMEOUT_SECONDS = 4 * 3600.0
# Forwarded connections one port-forward session (one kubectl port-forward) may carry at once:
# what a SPDY session allows by default. Upstream, the gateway opens as many sessions to the
# runtime as these need.
DEFAULT_MAX_FORWARDS_PER_SESSION = MAX_STREAMS_PER_SESSION // 2 - PAIRS_IN_FLIGHT
# After one of a user's sessions was ended for a control-frame flood, that user's upgrades are
# refused (429) for this long: a flooder who reconnects costs a refusal, not a session with a
# fresh burst of frames to parse. All of a user's sessions share one control-frame budget.
DEFAULT_FLOOD_COOLDOWN_SECONDS = 30.0


@dataclass(slots=True)
class Limits:
    max_streams_per_user: int = DEFAULT_MAX_STREAMS_PER_USER
    max_streams_per_pod: int = DEFAULT_MAX_STREAMS_PER_POD
    max_bytes_per_sec: float | None = None  # per stream, each way; None = unlimited
    max_streams_per_user_per_pod: int = DEFAULT_MAX_STREAMS_PER_USER_PER_POD
    max_forwards_per_session: int = DEFAULT_MAX_FORWARDS_PER_SESSION
    flood_cooldown_seconds: float = DEFAULT_FLOOD_COOLDOWN_SECONDS


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated user and where the request came from."""

    user: UserInfo
    address: str


class Metrics:
    """Prometheus metrics in a registry of their own, served on a separate loopback port."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.active = Gauge("podgate_active_streams", "Open streams", ["verb"], registry=r)
        self.streams = Counter("podgate_streams", "Streams started", ["verb"], registry=r)
        self.bytes = Counter(
            "podgate_stream_bytes", "Bytes carried", ["verb", "direction"], registry=r
        )
        self.duration = Histogram(
            "podgate_stream_duration_seconds",
            "Stream durations",
            ["verb"],
            registry=r,
            buckets=(0.01, 0.1, 1, 10, 60, 600, 3600, 14400),
        )
        self.denials = Counter("podgate_denials", "Requests denied", ["verb"], registry=r)
        self.upstream_errors = Counter(
            "podgate_upstream_errors", "Failures reaching the runtime", ["verb"], registry=r
        )
        # The streams above count port-forward sessions; this counts what runs inside them.
        self.forwards = Counter(
            "podgate_portforward_forwards",
            "Forwarded TCP connections and UDP flows, by outcome",
            ["protocol", "outcome"],
            registry=r,
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)


class Gate:
    """The gateway's Guard: authentication, authorisation, audit, metrics and limits."""

    def __init__(
        self,
        authenticator: Authenticator,
        policy: Policy,
        audit: AuditLog,
        metrics: Metrics | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.authenticator = authenticator
        self.policy = policy
        self.audit = audit
        self.metrics = metrics or Metrics()
        self.limits = limits or Limits()
        self._per_user: collections.Counter[str] = collections.Counter()
        self._per_pod: collections.Counter[str] = collections.Counter()
        self._per_user_pod: collections.Counter[tuple[str, str]] = collections.Counter()
        # Per user with a session open: the control-frame budget all its sessions share.
        self._control_budgets: dict[str, ControlBudget] = {}
        # Users whose session was ended for a flood, and until when they are refused.
        self._flooded_until: dict[str, float] = {}

    # -- Guard
    def identify(self, conn: SocketStream, request: UpgradeRequest) -> object | None:
        ssl_object = conn.transport.get_extra_info("ssl_object")
        peercert = ssl_object.getpeercert() if isinstance(ssl_object, ssl.SSLObject) else None
        address = _address(conn)
        user = self.authenticator.authenticate(request.headers, peercert)
        if user is None:
            # Anyone can send these: written within a budget per source, the rest counted.
            self.audit.denied(
                user=None,
                address=address,
                verb=request.method,
                path=request.path,
                outcome="denied",
                reason="unauthenticated",
            )
            return None
        return Caller(user, address)

    def refused(self, address: str, verb: str, path: str, status: int, reason: str) -> None:
        self.metrics.denials.labels("unauthenticated").inc()
        self.audit.denied(
            user=None,
            address=address,
            verb=verb,
            path=path,
            outcome="denied",
            reason=reason,
            **({"status": status} if status else {}),
        )

    def check(
        self, who: object, verb: str, namespace: str, pod: str, request: UpgradeRequest
    ) -> str | None:
        assert isinstance(who, Caller)
        decision = self.policy.authorize(who.user, verb, namespace, pod)
        if decision.allowed:
            if verb in ("get", "list", "log"):
                # Streams are audited when they start and end; reads are audited here.
                self.audit.write(
                    **_who(who),
                    verb=verb,
                    namespace=namespace,
                    pod=pod,
                    path=request.path,
                    outcome="allowed",
                    reason=decision.reason,
                )
            return None
        self.metrics.denials.labels(verb).inc()
        self.audit.write(
            **_who(who),
            verb=verb,
            namespace=namespace,
            pod=pod,
            path=request.path,
            outcome="denied",
            reason=decision.reason,
        )
        return decision.reason

    def admit(
        self, who: object, verb: str, pod: PodView, container: str | None, request: UpgradeRequest
    ) -> GateStream | str:
        assert isinstance(who, Caller)
        pod_key = f"{pod.namespace}/{pod.name}"
        limits = self.limits
        if self._cooling_down(who.user.name):
            reason = (
                f"user {who.user.name!r} flooded a session with control frames: streams refused"
                f" for {limits.flood_cooldown_seconds:g} s"
            )
        elif (
            limits.max_streams_per_user
            and self._per_user[who.user.name] >= limits.max_streams_per_user
        ):
            reason = f"user {who.user.name!r} has {limits.max_streams_per_user} streams open"
        elif (
            limits.max_streams_per_user_per_pod
            and self._per_user_pod[who.user.name, pod_key] >= limits.max_streams_per_user_per_pod
        ):
            reason = (
                f"user {who.user.name!r} has {limits.max_streams_per_user_per_pod} streams open"
                f" on pod {pod_key}"
            )
        elif limits.max_streams_per_pod and self._per_pod[pod_key] >= limits.max_streams_per_pod:
            reason = f"pod {pod_key} has {limits.max_streams_per_pod} streams open"
        else:
            return GateStream(self, who, verb, pod, container, request)
        self.metrics.denials.labels(verb).inc()
        self.audit.write(
            **_who(who),
            verb=verb,
            namespace=pod.namespace,
            pod=pod.name,
            outcome="denied",
            reason=reason,
        )
        return reason

    def _cooling_down(self, user: str) -> bool:
        until = self._flooded_until.get(user)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._flooded_until[user]
        return False

    def flooded(self, user: str) -> None:
        """One of `user`'s sessions was ended for a control-frame flood."""
        log.warning(
            "user %r flooded a session with control frames: refused for %g s",
            user,
            self.limits.flood_cooldown_seconds,
        )
        self._flooded_until[user] = time.monotonic() + self.limits.flood_cooldown_seconds

    def control_budget(self, user: str) -> ControlBudget:
        """The budget shared by `user`'s sessions (dropped with its last stream)."""
        budget = self._control_budgets.get(user)
        if budget is None:
            budget = self._control_budgets[user] = ControlBudget()
        return budget

    @contextmanager
    def _counted(self, user: str, pod: str) -> Iterator[None]:
        self._per_user[user] += 1
        self._per_pod[pod] += 1
        self._per_user_pod[user, pod] += 1
        try:
            yield
        finally:
            self._per_user[user] -= 1
            if not self._per_user[user]:
                del self._per_user[user]
                self._control_budgets.pop(user, None)
            self._per_pod[pod] -= 1
            self._per_user_pod[user, pod] -= 1
            if not self._per_user_pod[user, pod]:
                del self._per_user_pod[user, pod]


class GateStream(SessionHooks):
    """One admitted exec/attach/port-forward session and its forwarded connections."""

    def __init__(
        self,
        gate: Gate,
        who: Caller,
        verb: str,
        pod: PodView,
        container: str | None,
        request: UpgradeRequest,
    ) -> None:
        self.gate = gate
        self.who = who
        self.verb = verb
        self.pod = pod
        self.container = container
        self.request = request
        self.started = time.monotonic()
        self.max_bytes_per_sec = gate.limits.max_bytes_per_sec
        self.max_forwards = gate.limits.max_forwards_per_session
        self._count = gate._counted(who.user.name, f"{pod.namespace}/{pod.name}")
        self._count.__enter__()
        self.control_budget = gate.control_budget(who.user.name)
        gate.metrics.active.labels(verb).inc()
        gate.metrics.streams.labels(verb).inc()
        command = [v for k, v in request.query_params() if k == "command"]
        self._base: dict[str, Any] = {
            **_who(who),
            "verb": verb,
            "namespace": pod.namespace,
            "pod": pod.name,
            "container": container,
            "transport": _transport(request),
        }
        if command:
            self._base["command"] = command

    @property
    def tenant(self) -> str:
        """The user the stream is for: upstream sessions are kept apart per tenant."""
        return self.who.user.name

    def negotiated(self, transport: str, protocol: str) -> None:
        kind = "websocket" if transport.startswith("websocket") else transport
        self._base["transport"] = f"{kind}:{protocol}" if protocol else kind
        if self.verb != "portforward":
            self.gate.audit.write(**self._base, outcome="allowed", stage="started")

    @property
    def hooks(self) -> SessionHooks:
        return self

    def flooded(self) -> None:
        self.gate.flooded(self.who.user.name)

    # -- port-forward hooks
    def check_port(self, port: int, protocol: str = "tcp") -> str | None:
        decision = self.gate.policy.authorize(
            self.who.user, "portforward", self.pod.namespace, self.pod.name, port, protocol
        )
        return None if decision.allowed else decision.reason

    def forward_started(self, record: ForwardRecord) -> None:
        self.gate.metrics.active.labels("portforward-connection").inc()

    def forward_finished(self, record: ForwardRecord) -> None:
        metrics = self.gate.metrics
        metrics.active.labels("portforward-connection").dec()
        metrics.bytes.labels(self.verb, "in").inc(record.bytes_in)
        metrics.bytes.labels(self.verb, "out").inc(record.bytes_out)
        metrics.forwards.labels(record.protocol, record.outcome).inc()
        if record.outcome == "denied":
            metrics.denials.labels("portforward").inc()
        elif record.outcome == "error":
            metrics.upstream_errors.labels("portforward").inc()
        self.gate.audit.write(
            **self._base,
            port=record.port,
            protocol=record.protocol,
            outcome=record.outcome,
            reason=record.reason,
            duration=round(record.duration, 6),
            bytes_in=record.bytes_in,
            bytes_out=record.bytes_out,
        )

    # -- StreamGuard
    def finish(self, outcome: str, detail: str = "") -> None:
        duration = time.monotonic() - self.started
        self._count.__exit__(None, None, None)
        metrics = self.gate.metrics
        metrics.active.labels(self.verb).dec()
        metrics.duration.labels(self.verb).observe(duration)
        if outcome == "error":
            metrics.upstream_errors.labels(self.verb).inc()
        self.gate.audit.write(
            **self._base,
            outcome=outcome,
            reason=detail,
            stage="finished",
            duration=round(duration, 6),
        )


def _who(who: Caller) -> dict[str, Any]:
    return {
        "user": who.user.name,
        "groups": list(who.user.groups),
        "auth": who.user.method,
        "address": who.address,
    }


def _address(conn: SocketStream) -> str:
    peer = conn.peername
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return str(peer or "")


def _transport(request: UpgradeRequest) -> str:
    """What the client asked for; replaced by what was negotiated once the upgrade succeeds."""
    upgrade = (request.header("upgrade") or "").lower()
    if "websocket" in upgrade:
        return "websocket"
    if "spdy" in upgrade:
        return "spdy"
    return "http"


@dataclass(slots=True)
class GatewayConfig:
    state_dir: str
    cri_socket: str
    host: str = "127.0.0.1"
    port: int = 6443
    token_file: str = ""
    policy_file: str = ""
    audit_log: str = ""
    metrics_port: int = 0  # 0 = no metrics endpoint
    limits: Limits = field(default_factory=Limits)
    plain_http: bool = False  # loopback only; a token is still required
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_SECONDS  # seconds without data before closing
    audit_max_bytes: int = DEFAULT_AUDIT_MAX_BYTES
    audit_keep: int = DEFAULT_AUDIT_KEEP
    max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED
    auth_timeout: float = DEFAULT_AUTH_TIMEOUT_SECONDS
    allowed_origins: tuple[str, ...] = ()  # browser Origins allowed; kubectl sends none
    sans: tuple[str, ...] = ()  # extra names (DNS or IP) for the certificate and Host checks
    tls_cert: str = ""  # operator's server certificate and key (else generated)
    tls_key: str = ""
    client_ca: str = ""  # operator's CA for client certificates (else the generated CA)


def load_guard(config: GatewayConfig, metrics: Metrics | None = None) -> Gate:
    tokens = TokenFile.load(config.token_file) if config.token_file else None
    policy = Policy.load(config.policy_file) if config.policy_file else Policy.allow_all()
    audit = AuditLog(
        config.audit_log or str(Path(config.state_dir) / "audit.log"),
        max_bytes=config.audit_max_bytes,
        keep=config.audit_keep,
    )
    return Gate(Authenticator(tokens), policy, audit, metrics, config.limits)
