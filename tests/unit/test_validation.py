"""parse_request: every kind of bad input maps to one stable error code (no broker needed;
the same cases are replayed through the real broker in test_e2e_hostile.py)."""

from __future__ import annotations

import json

import pytest

from qlm.catalog import ModelCatalog
from qlm.coordinator.validation import InvalidRequest, parse_request
from qlm.types import CancelMessage, ErrorCode

CAT = ModelCatalog()
GOOD = {
    "request_id": "r-1",
    "model": "mistral-7b",
    "prompt": "hello",
    "max_tokens": 8,
    "slo": {"e2e_ms": 1000},
}


def body(**over: object) -> bytes:
    d = dict(GOOD)
    d.update(over)
    return json.dumps({k: v for k, v in d.items() if v is not None}).encode()


def code(raw: bytes, content_type: str | None = "application/json") -> ErrorCode:
    with pytest.raises(InvalidRequest) as exc:
        parse_request(raw, content_type, CAT, max_body_bytes=1_048_576)
    return exc.value.code


def test_good_request_parses() -> None:
    req = parse_request(body(), "application/json", CAT, max_body_bytes=1_048_576)
    assert req.request_id == "r-1" and req.prompt_tokens() == 2


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"{not json", ErrorCode.INVALID_JSON),
        (b"\xff\xfe\x00garbage", ErrorCode.INVALID_ENCODING),
        (body(model=None), ErrorCode.SCHEMA_VIOLATION),
        (body(max_tokens="many"), ErrorCode.SCHEMA_VIOLATION),
        (body(max_tokens=0), ErrorCode.SCHEMA_VIOLATION),
        (body(slo={}), ErrorCode.SCHEMA_VIOLATION),
        (body(prompt_token_ids=[1, 2]), ErrorCode.SCHEMA_VIOLATION),  # two prompts
        (body(surprise=1), ErrorCode.SCHEMA_VIOLATION),
        (b"[1, 2, 3]", ErrorCode.SCHEMA_VIOLATION),
        (body(model="gpt-17"), ErrorCode.UNKNOWN_MODEL),
        (body(max_tokens=5000), ErrorCode.MAX_TOKENS_OUT_OF_RANGE),
        (body(prompt="x" * 40_000), ErrorCode.PROMPT_TOO_LONG),
        (b"{" + b" " * 2_000_000 + b"}", ErrorCode.BODY_TOO_LARGE),
    ],
)
def test_bad_input_codes(raw: bytes, expected: ErrorCode) -> None:
    assert code(raw) == expected


def test_wrong_content_type() -> None:
    assert code(body(), "text/plain") == ErrorCode.INVALID_CONTENT_TYPE


def test_request_id_is_salvaged_for_the_error_reply() -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_request(body(model="gpt-17"), None, CAT, max_body_bytes=1_048_576)
    assert exc.value.request_id == "r-1"
    with pytest.raises(InvalidRequest) as exc:
        parse_request(b'{"request_id": "r-9", "model": ', None, CAT, max_body_bytes=1_048_576)
    assert exc.value.request_id == "r-9"


def test_a_cancel_parses_and_a_malformed_one_is_a_schema_violation() -> None:
    raw = json.dumps({"type": "cancel", "request_id": "r-1", "reason": "gone"}).encode()
    cancel = parse_request(raw, "application/json", CAT, max_body_bytes=1_048_576)
    assert isinstance(cancel, CancelMessage) and cancel.request_id == "r-1"
    assert code(json.dumps({"type": "cancel"}).encode()) == ErrorCode.SCHEMA_VIOLATION
    bad = {"type": "cancel", "request_id": "r-1", "model": "mistral-7b"}  # a request's field
    assert code(json.dumps(bad).encode()) == ErrorCode.SCHEMA_VIOLATION
    with pytest.raises(InvalidRequest) as exc:
        parse_request(
            json.dumps({"type": "cancel", "request_id": "r-7", "reason": 1}).encode(),
            None,
            CAT,
            max_body_bytes=1_048_576,
        )
    assert exc.value.request_id == "r-7"  # the error names the request it was about
