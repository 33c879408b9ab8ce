"""Kubernetes Status JSON: golden bytes from the reference docs, and client-side decoding."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podgate.proto.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from podgate.proto.k8s import (
    ErrorStreamProtocolError,
    ExecResult,
    StatusError,
    decode_exec_status,
    decode_text_error_stream,
    encode_status,
    go_quote,
    http_status_body,
    status_exit_code,
    status_failure,
    status_internal_error,
    status_not_found,
    status_success,
)

# k8s-streaming.md §4.4 and kubectl-api-surface.md §6.1.
SUCCESS = b'{"metadata":{},"status":"Success"}'
# k8s-streaming.md §4.4: the exit-code template with containerd's runtime text filled in.
CONTAINERD_EXIT_3 = "error executing command [sh -c exit 3], exit code 3"
EXIT_3 = (
    b'{"metadata":{},"status":"Failure","message":"command terminated with non-zero exit code: '
    b"error executing command [sh -c exit 3], exit code 3"
    b'","reason":"NonZeroExitCode","details":{"causes":[{"reason":"ExitCode","message":"3"}]}}'
)
# kubectl-api-surface.md §6.1, the "…" message kept as the literal ellipsis.
EXIT_3_SHORT = (
    '{"metadata":{},"status":"Failure","message":"…","reason":"NonZeroExitCode",'
    '"details":{"causes":[{"reason":"ExitCode","message":"3"}]}}'
).encode()
# k8s-streaming.md §4.4, "…" filled with one concrete error (the cause holds the bare error,
# the message adds "Internal error occurred: ", as apimachinery's NewInternalError does).
NOT_FOUND_ERR = 'error executing command in container: exec: "nope": not found'
INTERNAL = (
    b'{"metadata":{},"status":"Failure","message":"Internal error occurred: '
    b'error executing command in container: exec: \\"nope\\": not found",'
    b'"reason":"InternalError","details":{"causes":[{"message":'
    b'"error executing command in container: exec: \\"nope\\": not found"}]},"code":500}'
)
# kubectl-api-surface.md §4.4 (shown there on several lines; whitespace is not significant).
NOT_FOUND_DOC = """{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
 "message":"pods \\"missing-pod\\" not found","reason":"NotFound","code":404,
 "details":{"name":"missing-pod","kind":"pods"}}"""
# Go's metav1.Status field order (k8s-streaming.md §4.4), with TypeMeta's fields first.
GO_ORDER = ["kind", "apiVersion", "metadata", "status", "message", "reason", "details", "code"]


# --- encoding --------------------------------------------------------------------------------


def test_success_bytes() -> None:
    assert encode_status(status_success()) == SUCCESS


def test_exit_code_bytes() -> None:
    assert encode_status(status_exit_code(3, CONTAINERD_EXIT_3)) == EXIT_3


def test_internal_error_bytes() -> None:
    assert encode_status(status_internal_error(NOT_FOUND_ERR)) == INTERNAL


def test_field_order_is_go_order_whatever_the_dict_order() -> None:
    shuffled = {
        "code": 500,
        "details": {"causes": [{"message": "m", "reason": "r"}], "name": "n"},
        "reason": "InternalError",
        "status": "Failure",
        "message": "x",
        "metadata": {},
    }
    assert encode_status(shuffled) == (
        b'{"metadata":{},"status":"Failure","message":"x","reason":"InternalError",'
        b'"details":{"name":"n","causes":[{"reason":"r","message":"m"}]},"code":500}'
    )


def test_http_body_matches_reference_404() -> None:
    body = http_status_body(
        404, "NotFound", 'pods "missing-pod" not found', {"name": "missing-pod", "kind": "pods"}
    )
    assert body.endswith(b"}\n")
    assert json.loads(body) == json.loads(NOT_FOUND_DOC)
    assert list(json.loads(body)) == GO_ORDER


def test_not_found_helper_matches_reference() -> None:
    status = status_not_found("pods", "missing-pod")
    expected = json.loads(NOT_FOUND_DOC)
    del expected["kind"], expected["apiVersion"]
    assert json.loads(encode_status(status)) == expected


def test_go_html_escaping() -> None:
    # Go's encoding/json escapes <, >, & (and U+2028/2029) inside strings.
    status = status_failure("a<b>&c\u2028", "BadRequest", code=400)
    assert encode_status(status) == (
        b'{"metadata":{},"status":"Failure","message":"a\\u003cb\\u003e\\u0026c\\u2028",'
        b'"reason":"BadRequest","code":400}'
    )


def test_non_ascii_is_raw_utf8() -> None:
    status = status_failure("größe", "BadRequest")
    assert encode_status(status) == (
        '{"metadata":{},"status":"Failure","message":"größe","reason":"BadRequest"}'.encode()
    )


@pytest.mark.parametrize("code", [0, -1, 256, 1000])
def test_exit_code_out_of_range_is_our_bug(code: int) -> None:
    with pytest.raises(LocalProtocolError):
        status_exit_code(code, "x")


def test_status_error_carries_wire_code() -> None:
    err = StatusError("nope", code=403, reason="Forbidden")
    assert isinstance(err, RemoteProtocolError)
    assert err.code == 403
    assert json.loads(err.http_body()) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "nope",
        "reason": "Forbidden",
        "code": 403,
    }


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("missing-pod", '"missing-pod"'),
        ('a"b\\c', '"a\\"b\\\\c"'),
        ("a\nb\tc", '"a\\nb\\tc"'),
        ("\x01\x7f", '"\\x01\\x7f"'),
        ("é", '"é"'),
        ("\u200b", '"\\u200b"'),
    ],
)
def test_go_quote(text: str, quoted: str) -> None:
    assert go_quote(text) == quoted


# --- decoding (client side, client-go errorDecoderV4) ----------------------------------------


@pytest.mark.parametrize(
    ("data", "result"),
    [
        (b"", ExecResult(exit_code=0)),
        (SUCCESS, ExecResult(exit_code=0)),
        (EXIT_3, ExecResult(exit_code=3, error="command terminated with exit code 3")),
        (EXIT_3_SHORT, ExecResult(exit_code=3, error="command terminated with exit code 3")),
        (
            INTERNAL,
            ExecResult(
                exit_code=None,
                error=f"Internal error occurred: {NOT_FOUND_ERR}",
            ),
        ),
        # Go's decoder matches field names case-insensitively.
        (
            b'{"Status":"Failure","Reason":"NonZeroExitCode",'
            b'"Details":{"Causes":[{"Reason":"ExitCode","Message":"7"}]}}',
            ExecResult(exit_code=7, error="command terminated with exit code 7"),
        ),
        # The first cause whose reason is ExitCode wins; others are skipped.
        (
            b'{"status":"Failure","reason":"NonZeroExitCode","details":{"causes":'
            b'[{"message":"x"},{"reason":"ExitCode","message":"255"},'
            b'{"reason":"ExitCode","message":"1"}]}}',
            ExecResult(exit_code=255, error="command terminated with exit code 255"),
        ),
        (b' {"status":"Success"}\n', ExecResult(exit_code=0)),
    ],
)
def test_decode(data: bytes, result: ExecResult) -> None:
    assert decode_exec_status(data) == result


def test_decode_replaces_lone_surrogates_like_go() -> None:
    result = decode_exec_status(b'{"status":"Failure","message":"\\ud800x"}')
    assert result == ExecResult(exit_code=None, error="\ufffdx")


def test_decode_success_flag() -> None:
    assert decode_exec_status(SUCCESS).success
    assert not decode_exec_status(EXIT_3).success


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"status":"Weird"}', "error stream protocol error: unknown error"),
        (b"{}", "error stream protocol error: unknown error"),
        (b"null", "error stream protocol error: unknown error"),
        (
            b'{"status":"Failure","reason":"NonZeroExitCode"}',
            "error stream protocol error: details must be set",
        ),
        (
            b'{"status":"Failure","reason":"NonZeroExitCode","details":{}}',
            "error stream protocol error: no ExitCode cause given",
        ),
        (
            b'{"status":"Failure","reason":"NonZeroExitCode",'
            b'"details":{"causes":[{"reason":"ExitCode","message":"256"}]}}',
            'error stream protocol error: invalid exit code value "256"',
        ),
        (
            b'{"status":"Failure","reason":"NonZeroExitCode",'
            b'"details":{"causes":[{"reason":"ExitCode","message":"-1"}]}}',
            'error stream protocol error: invalid exit code value "-1"',
        ),
        (
            b'{"status":"Failure","reason":"NonZeroExitCode",'
            b'"details":{"causes":[{"reason":"ExitCode","message":"+3"}]}}',
            'error stream protocol error: invalid exit code value "+3"',
        ),
        (
            b'{"status":"Failure","reason":"NonZeroExitCode",'
            b'"details":{"causes":[{"reason":"ExitCode"}]}}',
            'error stream protocol error: invalid exit code value ""',
        ),
    ],
)
def test_decode_protocol_errors(data: bytes, message: str) -> None:
    with pytest.raises(ErrorStreamProtocolError) as info:
        decode_exec_status(data)
    assert info.value.message == message


@pytest.mark.parametrize(
    "data",
    [
        b"garbage",
        b"{",
        b'{"status":"Success"} trailing',
        b"[]",
        b'"Success"',
        b'{"status":5}',
        b'{"status":"Failure","code":"500"}',
        b'{"status":"Failure","code":1.5}',
        b'{"status":"Failure","details":[]}',
        b'{"status":"Failure","details":{"causes":{}}}',
        b'{"status":"Failure","details":{"causes":[5]}}',
        b'{"status":"Failure","metadata":3}',
        b'{"status":NaN}',
        b"\xff\xfe",
    ],
)
def test_decode_invalid_json_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ErrorStreamProtocolError) as info:
        decode_exec_status(data)
    assert info.value.message.startswith("error stream protocol error: ")


def test_decode_v1_text_stream() -> None:
    assert decode_text_error_stream(b"") == ExecResult(exit_code=0)
    assert decode_text_error_stream(b"command terminated with non-zero exit code: x") == (
        ExecResult(
            exit_code=None,
            error="error executing remote command: command terminated with non-zero exit code: x",
        )
    )


@settings(max_examples=200, deadline=None)
@given(code=st.integers(1, 255), text=st.text(max_size=40))
def test_exit_code_round_trip(code: int, text: str) -> None:
    result = decode_exec_status(encode_status(status_exit_code(code, text)))
    assert result == ExecResult(exit_code=code, error=f"command terminated with exit code {code}")


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_failure_message_round_trip(text: str) -> None:
    result = decode_exec_status(encode_status(status_internal_error(text)))
    assert result == ExecResult(exit_code=None, error=f"Internal error occurred: {text}")


def _check_garbage(data: bytes) -> None:
    try:
        result = decode_exec_status(data)
    except ProtocolError as exc:
        assert isinstance(exc, ErrorStreamProtocolError)
        return
    assert isinstance(result, ExecResult)
    # Either a clean exit code or an error message: never neither.
    assert result.exit_code is not None or result.error is not None


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200))
def test_random_bytes_only_raise_protocol_errors(data: bytes) -> None:
    _check_garbage(data)


_KEYS = st.sampled_from(
    ["status", "Status", "reason", "message", "details", "causes", "code", "metadata", "x"]
)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["Success", "Failure", "NonZeroExitCode", "ExitCode", "3", "300"])
)
_JSONISH = st.recursive(
    _SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_KEYS, children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(value=_JSONISH)
def test_random_status_shaped_json_only_raises_protocol_errors(value: object) -> None:
    _check_garbage(json.dumps(value).encode())
