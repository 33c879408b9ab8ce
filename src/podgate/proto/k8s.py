"""Kubernetes `metav1.Status` JSON: building, encoding as Go does, and decoding exec results.

The same object travels in three places: the body of a refused HTTP request, the v4/v5 error
stream of an exec/attach session, and (as plain `message` text) the v1-v3 error stream.
Encoding follows Go's `encoding/json`: struct field order, compact separators, `<`, `>`, `&`,
U+2028 and U+2029 escaped. Decoding follows client-go's `errorDecoderV4`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from podgate.proto.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "CAUSE_EXIT_CODE",
    "MAX_EXIT_CODE",
    "REASON_BAD_REQUEST",
    "REASON_INTERNAL_ERROR",
    "REASON_NON_ZERO_EXIT_CODE",
    "REASON_NOT_FOUND",
    "STATUS_FAILURE",
    "STATUS_SUCCESS",
    "ErrorStreamProtocolError",
    "ExecResult",
    "Status",
    "StatusError",
    "decode_exec_status",
    "decode_text_error_stream",
    "encode_status",
    "go_quote",
    "http_status_body",
    "status_bad_request",
    "status_exit_code",
    "status_failure",
    "status_internal_error",
    "status_not_found",
    "status_success",
]

Status = dict[str, Any]
"""A `metav1.Status` as plain JSON-ready data (no `kind`/`apiVersion` unless for HTTP)."""

STATUS_SUCCESS: Final = "Success"
STATUS_FAILURE: Final = "Failure"
REASON_NON_ZERO_EXIT_CODE: Final = "NonZeroExitCode"
REASON_INTERNAL_ERROR: Final = "InternalError"
REASON_NOT_FOUND: Final = "NotFound"
REASON_BAD_REQUEST: Final = "BadRequest"
CAUSE_EXIT_CODE: Final = "ExitCode"

# Largest exit code a client can receive: client-go parses the cause as an unsigned 8-bit value.
MAX_EXIT_CODE: Final = 255
# Range of metav1.Status.code and retryAfterSeconds (Go int32); outside it Go's decoder fails.
_INT32_MIN: Final = -(2**31)
_INT32_MAX: Final = 2**31 - 1

# Go struct field order of metav1.Status, StatusDetails and StatusCause; unknown keys go last.
_STATUS_ORDER: Final = (
    "kind",
    "apiVersion",
    "metadata",
    "status",
    "message",
    "reason",
    "details",
    "code",
)
_DETAILS_ORDER: Final = ("name", "group", "kind", "uid", "causes", "retryAfterSeconds")
_CAUSE_ORDER: Final = ("reason", "message", "field")

# Characters Go's encoding/json escapes inside strings even though JSON does not require it.
_GO_EXTRA_ESCAPES: Final = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}
_GO_EXTRA_ESCAPES_RE: Final = re.compile("[<>&\u2028\u2029]")

_GO_SHORT_ESCAPES: Final = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
    "\\": "\\\\",
    '"': '\\"',
}

_ASCII_DIGITS_RE: Final = re.compile(r"[0-9]+")
_SURROGATE_RE: Final = re.compile("[\ud800-\udfff]")


def _clean(text: str) -> str:
    """Replace lone surrogates (from `\\ud800` escapes) with U+FFFD, as Go's decoder does."""
    return _SURROGATE_RE.sub("\ufffd", text)


def go_quote(text: str) -> str:
    """Go's `strconv.Quote` (the `%q` verb), used verbatim in Kubernetes error messages."""
    out = ['"']
    for ch in text:
        if ch in _GO_SHORT_ESCAPES:
            out.append(_GO_SHORT_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


# --- building ---------------------------------------------------------------------------------


def status_success() -> Status:
    return {"metadata": {}, "status": STATUS_SUCCESS}


def status_failure(
    message: str,
    reason: str,
    code: int | None = None,
    details: Mapping[str, Any] | None = None,
) -> Status:
    """A Failure Status. Empty values are left out, as Go's `omitempty` does."""
    status: Status = {"metadata": {}, "status": STATUS_FAILURE}
    if message:
        status["message"] = message
    if reason:
        status["reason"] = reason
    if details:
        status["details"] = dict(details)
    if code:
        status["code"] = code
    return status


def status_exit_code(exit_code: int, runtime_text: str) -> Status:
    """The kubelet's NonZeroExitCode Status; `runtime_text` is the runtime's own error text."""
    if not 1 <= exit_code <= MAX_EXIT_CODE:
        raise LocalProtocolError(f"exit code {exit_code} is outside 1..{MAX_EXIT_CODE}")
    return status_failure(
        f"command terminated with non-zero exit code: {runtime_text}",
        REASON_NON_ZERO_EXIT_CODE,
        details={"causes": [{"reason": CAUSE_EXIT_CODE, "message": str(exit_code)}]},
    )


def status_internal_error(message: str) -> Status:
    """apimachinery's `NewInternalError`: HTTP 500, the cause carries the bare message."""
    return status_failure(
        f"Internal error occurred: {message}",
        REASON_INTERNAL_ERROR,
        code=500,
        details={"causes": [{"message": message}]},
    )


def status_not_found(kind: str, name: str) -> Status:
    """apimachinery's `NewNotFound`; `kind` is the plural resource, e.g. `pods`."""
    return status_failure(
        f"{kind} {go_quote(name)} not found",
        REASON_NOT_FOUND,
        code=404,
        details={"name": name, "kind": kind},
    )


def status_bad_request(message: str) -> Status:
    return status_failure(message, REASON_BAD_REQUEST, code=400)


# --- encoding ---------------------------------------------------------------------------------


def _ordered(obj: Mapping[str, Any], order: tuple[str, ...]) -> dict[str, Any]:
    out = {key: obj[key] for key in order if key in obj}
    out.update((key, value) for key, value in obj.items() if key not in out)
    return out


def _go_order(status: Mapping[str, Any]) -> dict[str, Any]:
    out = _ordered(status, _STATUS_ORDER)
    details = out.get("details")
    if isinstance(details, Mapping):
        details = _ordered(details, _DETAILS_ORDER)
        causes = details.get("causes")
        if isinstance(causes, list):
            details["causes"] = [
                _ordered(cause, _CAUSE_ORDER) if isinstance(cause, Mapping) else cause
                for cause in causes
            ]
        out["details"] = details
    return out


def encode_status(status: Mapping[str, Any]) -> bytes:
    """Compact JSON in Go's field order, byte-identical to `json.Marshal(metav1.Status)`."""
    text = json.dumps(_go_order(status), separators=(",", ":"), ensure_ascii=False)
    # Those characters only ever occur inside JSON strings, so a plain substitution is safe.
    text = _GO_EXTRA_ESCAPES_RE.sub(lambda m: _GO_EXTRA_ESCAPES[m.group()], text)
    return _clean(text).encode("utf-8")


def http_status_body(
    code: int, reason: str, message: str, details: Mapping[str, Any] | None = None
) -> bytes:
    """The body of a refused HTTP request, as the API server writes it (with a final newline)."""
    status = {"kind": "Status", "apiVersion": "v1"}
    status.update(status_failure(message, reason, code=code, details=details))
    return encode_status(status) + b"\n"


class StatusError(RemoteProtocolError):
    """The peer's request is refused with an HTTP status and a Kubernetes Status body."""

    def __init__(self, message: str, *, code: int, reason: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason

    def status(self) -> Status:
        return status_failure(self.message, self.reason, code=self.code)

    def http_body(self) -> bytes:
        return http_status_body(self.code, self.reason, self.message)


# --- decoding (client side) -------------------------------------------------------------------


class ErrorStreamProtocolError(RemoteProtocolError):
    """The error stream held something that is not a valid v4 Status."""


@dataclass(frozen=True, slots=True)
class ExecResult:
    """How a remote command ended: `exit_code` 0 on success, or an `error` message.

    A non-zero exit carries both; other failures carry only `error`.
    """

    exit_code: int | None
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.exit_code == 0 and self.error is None


_SUCCESS: Final = ExecResult(exit_code=0)


class _JsonObject:
    """A decoded JSON object that keeps every key/value pair in order, duplicates included."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs


class _TypeMismatch(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid character {name[0]!r} looking for beginning of value")


def _loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_JsonObject, parse_constant=_reject_constant)


def _go_fields(value: Any, names: tuple[str, ...], what: str) -> dict[str, Any] | None:
    """Match object keys to Go struct fields: exact name first, else case-insensitively.

    Returns None for JSON null (Go leaves the struct zero); later keys overwrite earlier ones.
    """
    if value is None:
        return None
    if not isinstance(value, _JsonObject):
        raise _TypeMismatch(f"cannot unmarshal {_json_kind(value)} into Go value of type {what}")
    fields: dict[str, Any] = {}
    folded = {name.lower(): name for name in reversed(names)}
    for key, item in value.pairs:
        name = key if key in names else folded.get(key.lower())
        if name is not None:
            fields[name] = item
    return fields


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _string(fields: Mapping[str, Any], name: str) -> str:
    value = fields.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _TypeMismatch(f"cannot unmarshal {_json_kind(value)} into field {name} of string")
    return value


def _int32(fields: Mapping[str, Any], name: str) -> None:
    value = fields.get(name)
    if value is None:
        return
    if type(value) is not int or not _INT32_MIN <= value <= _INT32_MAX:
        raise _TypeMismatch(f"cannot unmarshal {_json_kind(value)} into field {name} of int32")


@dataclass(frozen=True, slots=True)
class _DecodedStatus:
    status: str
    message: str
    reason: str
    details: dict[str, Any] | None
    causes: list[tuple[str, str]]


def _decode_status(value: Any) -> _DecodedStatus:
    fields = _go_fields(value, _STATUS_ORDER, "v1.Status") or {}
    _string(fields, "kind")
    _string(fields, "apiVersion")
    _go_fields(fields.get("metadata"), ("selfLink", "resourceVersion", "continue"), "ListMeta")
    _int32(fields, "code")
    details = _go_fields(fields.get("details"), _DETAILS_ORDER, "v1.StatusDetails")
    causes: list[tuple[str, str]] = []
    if details is not None:
        for name in ("name", "group", "kind", "uid"):
            _string(details, name)
        _int32(details, "retryAfterSeconds")
        raw_causes = details.get("causes")
        if raw_causes is not None and not isinstance(raw_causes, list):
            kind = _json_kind(raw_causes)
            raise _TypeMismatch(f"cannot unmarshal {kind} into field causes of []StatusCause")
        for raw in raw_causes or ():
            cause = _go_fields(raw, _CAUSE_ORDER, "v1.StatusCause") or {}
            _string(cause, "field")
            causes.append((_string(cause, "reason"), _string(cause, "message")))
    return _DecodedStatus(
        status=_string(fields, "status"),
        message=_string(fields, "message"),
        reason=_string(fields, "reason"),
        details=details,
        causes=causes,
    )


def decode_exec_status(data: bytes) -> ExecResult:
    """Interpret a v4/v5 error stream read to its end, as client-go's `errorDecoderV4` does.

    An empty stream means success. Raises ErrorStreamProtocolError for anything that is not a
    usable Status; a Status that reports a failure is returned, not raised.
    """
    if not data:
        return _SUCCESS
    text = data.decode("utf-8", "replace")
    try:
        status = _decode_status(_loads(text))
    except (ValueError, RecursionError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise ErrorStreamProtocolError(
            f"error stream protocol error: {detail} in {go_quote(_clean(text))}"
        ) from None
    if status.status == STATUS_SUCCESS:
        return _SUCCESS
    if status.status != STATUS_FAILURE:
        raise ErrorStreamProtocolError("error stream protocol error: unknown error")
    if status.reason != REASON_NON_ZERO_EXIT_CODE:
        return ExecResult(exit_code=None, error=_clean(status.message))
    if status.details is None:
        raise ErrorStreamProtocolError("error stream protocol error: details must be set")
    for reason, message in status.causes:
        if reason != CAUSE_EXIT_CODE:
            continue
        if not _ASCII_DIGITS_RE.fullmatch(message) or int(message) > MAX_EXIT_CODE:
            raise ErrorStreamProtocolError(
                "error stream protocol error: invalid exit code value " + go_quote(_clean(message))
            )
        code = int(message)
        return ExecResult(exit_code=code, error=f"command terminated with exit code {code}")
    raise ErrorStreamProtocolError(f"error stream protocol error: no {CAUSE_EXIT_CODE} cause given")


def decode_text_error_stream(data: bytes) -> ExecResult:
    """Interpret a v1-v3 error stream: any content is a failure without an exit code."""
    if not data:
        return _SUCCESS
    text = data.decode("utf-8", "replace")
    return ExecResult(exit_code=None, error=f"error executing remote command: {text}")
