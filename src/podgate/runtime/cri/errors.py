"""Domain errors → gRPC status codes: the one place the CRI service maps them.

Every servicer method is wrapped with `cri_method`. A domain error becomes its status code with
the error's message as details; anything else becomes INTERNAL and is logged with its traceback.
A method podgate does not serve answers UNIMPLEMENTED and is logged once per method name with
the reason (a kubelet retries such calls for ever; one line tells the operator why).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, NoReturn, TypeAlias, TypeVar

import grpc
import grpc.aio

from podgate.images import registry
from podgate.images.pull import ResourceError, UnpackError
from podgate.runtime.api import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)

log = logging.getLogger(__name__)

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

# Checked in order, so a subclass must come before its base.
ERROR_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    # Pulls: the message names the image and the registry (containerd's wording).
    (registry.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (registry.AuthError, grpc.StatusCode.PERMISSION_DENIED),
    (registry.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (registry.VerificationError, grpc.StatusCode.DATA_LOSS),
    (ResourceError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnpackError, grpc.StatusCode.FAILED_PRECONDITION),
    (registry.RegistryError, grpc.StatusCode.UNKNOWN),
)

# Distinct method names logged as unimplemented; a client inventing names cannot grow it further.
MAX_LOGGED_UNIMPLEMENTED: Final = 256

_Servicer = TypeVar("_Servicer")
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The status a failed call answers with: a domain error's own code, else INTERNAL."""
    for error_type, code in ERROR_CODES:
        if isinstance(exc, error_type):
            return code
    return grpc.StatusCode.INTERNAL


def cri_method(
    method: Callable[[_Servicer, _Request, Context], Awaitable[_Response]],
) -> Callable[[_Servicer, _Request, Context], Coroutine[Any, Any, _Response]]:
    """Wrap a servicer method: map its errors to a status and log how the call went."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: _Servicer, request: _Request, context: Context) -> _Response:
        started = time.monotonic()
        try:
            response = await method(self, request, context)
        except grpc.aio.AbortError:
            # The method chose its status itself (UNIMPLEMENTED and the like).
            raise
        except Exception as exc:
            code = status_code(exc)
            details = str(exc) or type(exc).__name__
            elapsed = time.monotonic() - started
            if code is grpc.StatusCode.INTERNAL:
                log.exception("cri %s failed after %.3fs: %s", name, elapsed, details)
            else:
                log.debug("cri %s: %s after %.3fs: %s", name, code.name, elapsed, details)
            await context.abort(code, details)
        log.debug("cri %s ok in %.3fs", name, time.monotonic() - started)
        return response

    return wrapper


class UnimplementedLog:
    """Logs the first UNIMPLEMENTED answer per method name (later ones at debug level)."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def note(self, method: str, reason: str) -> None:
        if method in self._logged or len(self._logged) >= MAX_LOGGED_UNIMPLEMENTED:
            log.debug("cri %s: UNIMPLEMENTED: %s", method, reason)
            return
        self._logged.add(method)
        log.warning("cri %s: UNIMPLEMENTED: %s (logged once per method)", method, reason)

    async def abort(
        self, context: Context, method: str, reason: str, details: str = ""
    ) -> NoReturn:
        """Answer UNIMPLEMENTED with `details` (default: the reason), noting the reason."""
        self.note(method, reason)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, details or reason)


class _Unimplemented(grpc.GenericRpcHandler):
    """Answers every method no servicer registered (asked after the registered ones)."""

    def __init__(self, logged: UnimplementedLog) -> None:
        self._logged = logged

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = str(handler_call_details.method)
        reason = f"method {method} is not served by podgate (outside its CRI v1 subset)"

        async def answer(request: bytes, context: Context) -> bytes:
            await self._logged.abort(context, method, reason)

        return grpc.unary_unary_rpc_method_handler(answer)


def unimplemented_handler(logged: UnimplementedLog) -> grpc.GenericRpcHandler:
    return _Unimplemented(logged)
