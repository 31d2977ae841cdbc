"""Turning a raw broker delivery into a RequestMessage, or into a stable error code.

Every way a message can be bad maps to one :class:`~qlm.types.ErrorCode`; the service layer
turns an :class:`InvalidRequest` into an error reply plus a dead-letter copy with a reason header.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from qlm.catalog import ModelCatalog
from qlm.types import CONTENT_TYPE, CancelMessage, ErrorCode, RequestMessage

_ID_RE = re.compile(r'"request_id"\s*:\s*"([A-Za-z0-9._:@/+=-]{1,128})"')


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
) -> RequestMessage | CancelMessage:
    """A request, or a cancel (``"type": "cancel"``), or an :class:`InvalidRequest`."""
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
    rid = data.get("request_id") if isinstance(data, dict) else None
    rid = rid if isinstance(rid, str) and _ID_RE.fullmatch(f'"request_id":"{rid}"') else fallback_id
    is_cancel = isinstance(data, dict) and data.get("type") == "cancel"
    try:
        if is_cancel:
            return CancelMessage.model_validate(data)
        req = RequestMessage.model_validate(data)
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
