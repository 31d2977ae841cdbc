"""Turning a raw broker delivery into a RequestMessage, or into a stable error code.

Every way a message can be bad maps to one :class:`~qlm.types.ErrorCode`; the service layer
turns an :class:`InvalidRequest` into an error reply plus a dead-letter copy with a reason header.
Every failure of parsing is such an error, raised on the first delivery: nothing a producer can
put in a message makes the handler raise (which would redeliver it up to the delivery limit).

Hostile AMQP properties (bytes that are not UTF-8, decoded tolerantly by :mod:`qlm.amqp`) are
recognised by :func:`check_properties`; :func:`reply_route` and :func:`dead_letter_properties`
give what may safely be published again.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pamqp.encode
from pydantic import ValidationError

from qlm.amqp import escape_raw, has_raw_bytes
from qlm.catalog import ModelCatalog
from qlm.types import CONTENT_TYPE, CancelMessage, ErrorCode, RequestMessage

_ID_RE = re.compile(r'"request_id"\s*:\s*"([A-Za-z0-9._:@/+=-]{1,128})"')
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
# A \uD800-\uDFFF escape in the text: json.loads joins a valid pair into one character, so
# only a lone surrogate survives it (and it cannot be encoded as UTF-8 again, later).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")

# How far ahead of the coordinator's clock a producer's submitted_at may be (clock skew):
# beyond it the request is refused (submitted_in_future), so that no measured e2e_ms is
# negative, and no producer moves its own deadline later than it asked for.
MAX_CLOCK_SKEW_S = 60.0

# The AMQP properties that are short strings on the wire and that qlm reads or copies.
STRING_PROPERTIES = (
    "message_id",
    "correlation_id",
    "reply_to",
    "content_type",
    "content_encoding",
    "type",
    "app_id",
    "user_id",
)
# Header names RabbitMQ or qlm set: a producer's own copy is ignored on the request path and
# not carried onto the dead-letter copy (it would read like the broker's or qlm's word).
RESERVED_HEADER_PREFIXES = (
    "x-qlm-",
    "x-death",
    "x-delivery-count",
    "x-first-death-",
    "x-last-death-",
)
# On a dead-letter copy: the escaped raw values of what could not be published again.
RAW_PROPERTIES_HEADER = "x-qlm-raw-properties"
_MAX_HEADER_KEY_BYTES = 128  # pamqp truncates longer keys when encoding


class InvalidRequest(Exception):
    def __init__(
        self,
        code: ErrorCode,
        message: str,
        request_id: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.details = details


def _clean(value: Any) -> str | None:
    """A string property, or None when absent, empty or not UTF-8 on the wire."""
    return value if isinstance(value, str) and value and not has_raw_bytes(value) else None


def _raw_header_keys(headers: Any) -> list[str]:
    """Escaped paths (``outer.inner``) of the header keys, at any depth, that are not UTF-8."""
    found: list[str] = []
    stack: list[tuple[str, Any]] = [("", headers)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                here = f"{path}.{escape_raw(key)}" if path else escape_raw(key)
                if isinstance(key, str) and has_raw_bytes(key):
                    found.append(here)
                stack.append((here, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return sorted(found)


def raw_properties(message: Any) -> dict[str, Any]:
    """The properties of a delivery whose bytes are not UTF-8: property name -> its value
    escaped (``\\xNN`` for each bad byte), plus ``header_keys``: the escaped header keys."""
    found: dict[str, Any] = {}
    for name in STRING_PROPERTIES:
        value = getattr(message, name, None)
        if isinstance(value, str) and has_raw_bytes(value):
            found[name] = escape_raw(value)
    keys = _raw_header_keys(getattr(message, "headers", None) or {})
    if keys:
        found["header_keys"] = keys
    return found


def check_properties(message: Any) -> None:
    """Refuse (``invalid_property``) a delivery with an AMQP property or a header key that is
    not valid UTF-8: nothing about it can be trusted or published again as it is."""
    bad = raw_properties(message)
    if not bad:
        return
    names = [("header keys" if n == "header_keys" else n) for n in bad]
    mid = _clean(getattr(message, "message_id", None))
    rid = mid if mid and _REQUEST_ID_RE.fullmatch(mid) else None
    raise InvalidRequest(
        ErrorCode.INVALID_PROPERTY,
        f"AMQP properties are not valid UTF-8: {', '.join(names)} (escaped in details)",
        rid or _salvage_request_id(bytes(getattr(message, "body", b"") or b"")),
        {"properties": bad},
    )


def reply_route(message: Any) -> tuple[str | None, str | None]:
    """``(reply_to, correlation_id)`` of a delivery, each None when absent or not UTF-8 on the
    wire: a reply is published only to a route that is itself valid."""
    return _clean(getattr(message, "reply_to", None)), _clean(
        getattr(message, "correlation_id", None)
    )


def clean_message_id(message: Any) -> str | None:
    """The delivery's ``message_id``, or None when absent or not UTF-8 on the wire."""
    return _clean(getattr(message, "message_id", None))


def _encodable(value: Any) -> Any:
    """A header value as pamqp encodes it: bytes (a long string that was not UTF-8) become a
    byte array, keys that were not UTF-8 their escaped form."""
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, dict):
        return {_header_key(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    return value


def _header_key(key: Any) -> str:
    text = escape_raw(key) if isinstance(key, str) else str(key)
    return text.encode()[:_MAX_HEADER_KEY_BYTES].decode("utf-8", "ignore")


def dead_letter_properties(message: Any) -> dict[str, Any]:
    """Keyword arguments for the dead-letter copy of a refused delivery (``aio_pika.Message``):
    its properties and headers less what cannot be published again. A property that is not
    UTF-8 is left out; a header key that is not UTF-8 is escaped; reserved headers
    (:data:`RESERVED_HEADER_PREFIXES`) are dropped; a header pamqp cannot encode again is
    dropped. What was changed is kept, escaped, in the header ``x-qlm-raw-properties``."""
    raw = raw_properties(message)
    headers: dict[str, Any] = {}
    unencodable: list[str] = []
    for key, value in (getattr(message, "headers", None) or {}).items():
        if isinstance(key, str) and key.lower().startswith(RESERVED_HEADER_PREFIXES):
            continue
        name, item = _header_key(key), _encodable(value)
        try:
            pamqp.encode.encode_table_value(item)
        except Exception:  # noqa: BLE001 - any value pamqp cannot write back: drop it
            unencodable.append(name)
            continue
        headers[name] = item
    if unencodable:
        raw["unencodable_headers"] = unencodable
    if raw:
        headers[RAW_PROPERTIES_HEADER] = raw
    return {
        "headers": headers,
        "content_type": _clean(getattr(message, "content_type", None)),
        "content_encoding": _clean(getattr(message, "content_encoding", None)),
        "correlation_id": _clean(getattr(message, "correlation_id", None)),
        "message_id": _clean(getattr(message, "message_id", None)),
        "reply_to": _clean(getattr(message, "reply_to", None)),
    }


def _lone_surrogate_at(data: Any) -> str | None:
    """Where (a dotted path) a string or key in parsed JSON holds a lone surrogate. Iterative:
    the document may be nested as deep as the parser allows."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                here = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return (path or "body") + " (a key)"
                stack.append((here, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(value))
    return None


def _salvage_request_id(body: bytes) -> str | None:
    """Best effort: find the request id in a body we could not parse, for the error reply."""
    m = _ID_RE.search(body[:4096].decode("utf-8", errors="replace"))
    return m.group(1) if m else None


def parse_request(
    body: bytes,
    content_type: str | None,
    catalog: ModelCatalog,
    *,
    max_body_bytes: int,
    message_id: str | None = None,
    now: float | None = None,
    max_clock_skew_s: float = MAX_CLOCK_SKEW_S,
) -> RequestMessage | CancelMessage:
    """A request, or a cancel (``"type": "cancel"``), or an :class:`InvalidRequest`. ``now``:
    the coordinator's clock, against which ``submitted_at`` is checked (default: time.time())."""
    fallback_id = message_id
    if len(body) > max_body_bytes:
        raise InvalidRequest(
            ErrorCode.BODY_TOO_LARGE,
            f"body is {len(body)} bytes; the limit is {max_body_bytes}",
            fallback_id,
        )
    if content_type is not None and content_type.split(";")[0].strip().lower() != CONTENT_TYPE:
        raise InvalidRequest(
            ErrorCode.INVALID_CONTENT_TYPE,
            f"content_type must be {CONTENT_TYPE!r}, got {content_type!r}",
            fallback_id or _salvage_request_id(body),
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            ErrorCode.INVALID_ENCODING, f"body is not UTF-8: {exc.reason}", fallback_id
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            ErrorCode.INVALID_JSON,
            f"body is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            fallback_id or _salvage_request_id(body),
        ) from None
    except RecursionError:
        raise InvalidRequest(
            ErrorCode.INVALID_JSON,
            "body is not JSON qlm reads: nested too deeply",
            fallback_id or _salvage_request_id(body),
        ) from None
    except ValueError as exc:  # an integer literal beyond Python's int-str limit (4300 digits)
        raise InvalidRequest(
            ErrorCode.INVALID_JSON,
            f"body is not JSON qlm reads: {str(exc).split(';')[0][:200]}",
            fallback_id or _salvage_request_id(body),
        ) from None
    if _SURROGATE_ESCAPE.search(text):
        where = _lone_surrogate_at(data)
        if where is not None:
            raise InvalidRequest(
                ErrorCode.INVALID_JSON,
                f"body is not JSON qlm reads: {where} holds a lone UTF-16 surrogate "
                "(\\ud800-\\udfff without its pair), which is not Unicode text",
                fallback_id or _salvage_request_id(body),
            )
    rid = data.get("request_id") if isinstance(data, dict) else None
    rid = rid if isinstance(rid, str) and _ID_RE.fullmatch(f'"request_id":"{rid}"') else fallback_id
    is_cancel = isinstance(data, dict) and data.get("type") == "cancel"
    try:
        if is_cancel:
            return CancelMessage.model_validate(data)
        req = RequestMessage.model_validate(data)
    except RecursionError:
        raise InvalidRequest(
            ErrorCode.SCHEMA_VIOLATION, "body: nested too deeply", rid, {"errors": []}
        ) from None
    except ValidationError as exc:
        errors = [
            {"loc": ".".join(str(p) for p in e["loc"]), "msg": e["msg"]}
            for e in exc.errors(include_url=False, include_input=False)
        ][:20]
        first = errors[0] if errors else {"loc": "", "msg": "invalid"}
        raise InvalidRequest(
            ErrorCode.SCHEMA_VIOLATION,
            f"{first['loc'] or 'body'}: {first['msg']}",
            rid,
            {"errors": errors},
        ) from None
    now = time.time() if now is None else now
    if req.submitted_at is not None and req.submitted_at > now + max_clock_skew_s:
        raise InvalidRequest(
            ErrorCode.SUBMITTED_IN_FUTURE,
            f"submitted_at is {req.submitted_at - now:.0f} s ahead of the coordinator's clock "
            f"(at most {max_clock_skew_s:.0f} s of clock skew is accepted); check the "
            "producer's clock (NTP)",
            req.request_id,
            {"submitted_at": req.submitted_at, "coordinator_time": now},
        )
    if req.model not in catalog:
        raise InvalidRequest(
            ErrorCode.UNKNOWN_MODEL,
            f"unknown model {req.model!r}; known: {', '.join(catalog.names())}",
            req.request_id,
        )
    spec = catalog.get(req.model)
    if req.max_tokens > spec.max_output_tokens:
        raise InvalidRequest(
            ErrorCode.MAX_TOKENS_OUT_OF_RANGE,
            f"max_tokens {req.max_tokens} exceeds {spec.max_output_tokens} for {req.model}",
            req.request_id,
        )
    prompt_tokens = req.prompt_tokens()
    if prompt_tokens + req.max_tokens > spec.max_context:
        raise InvalidRequest(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt ({prompt_tokens} tokens) + max_tokens ({req.max_tokens}) exceeds the "
            f"context of {req.model} ({spec.max_context})",
            req.request_id,
        )
    return req
