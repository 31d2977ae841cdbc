"""The gateway's HTTP layer: OpenAI requests in, qlm requests out, qlm replies back as OpenAI
responses.

One :class:`GatewayClient` (a long-lived ``QlmClient``) per process publishes every call to
``qlm.ingress`` with a publisher confirm and matches the reply by correlation id. The request is
durable once the broker confirmed it; the HTTP call then waits for the one reply, for the
configured timeout, or for the client to go away, whichever comes first.

``stream: true`` asks qlm for a token stream (``RequestMessage.stream``): the agent running
the request sends token chunks to the gateway's reply queue as they are generated, and each
becomes an SSE chunk (qlm/gateway/sse.py); the result, the one durable answer, ends the
stream. A client that disconnects, or a call that times out, cancels its request (a protocol
``cancel`` message): a queued request is dropped, a running one is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qlm.admin import AdminServer, serve_admin
from qlm.catalog import ModelCatalog, ModelSpec, UnknownModelError
from qlm.client import MalformedReply, QlmClient, Reply, StreamError, StreamPiece, TokenStream
from qlm.gateway.keys import ApiKeys, ApiKeysWatch
from qlm.gateway.openai_types import (
    SERVICE_TIER_CLASSES,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    FinishReason,
    ModelCard,
    ModelList,
    QlmInfo,
    UsageOut,
)
from qlm.gateway.rate_limits import TenantRateLimits
from qlm.gateway.served import ServedModelsWatcher
from qlm.gateway.sse import DONE, SseRenderer, error_event, stream_events
from qlm.metrics import GatewayMetrics, gateway_route
from qlm.types import (
    SLO,
    ChatMessage,
    ErrorCode,
    ErrorMessage,
    RequestMessage,
    ResultMessage,
    SamplingParams,
)

if TYPE_CHECKING:  # imports this module: loaded lazily below
    from qlm.gateway.batches import BatchApi, BatchSettings

log = structlog.get_logger(__name__)

_CHALLENGE = 'Bearer realm="qlm-gateway"'
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# How long /v1/models waits for the coordinator's first list of served models (it sends one
# every second once its start grace, a heartbeat timeout, is over).
_SERVED_WAIT_S = 5.0


# --- configuration -----------------------------------------------------------------------------


class GatewaySettings(BaseSettings):
    """``QLM_GATEWAY_*`` environment variables (the broker URL and the model catalog come from
    the shared ``QLM_*`` settings, so the gateway and the coordinator agree on them)."""

    model_config = SettingsConfigDict(env_prefix="QLM_GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # API key -> tenant, as a JSON object; a secret, so never shown in a repr or a log.
    api_keys: SecretStr | None = None
    # A JSON file of the same shape (merged with api_keys; a key in both must agree).
    api_keys_file: Path | None = None
    # How often (seconds) the key file is read again for a change (keys rotated without a
    # restart; SIGHUP reads it at once); 0: only on SIGHUP. A file that does not hold valid
    # keys leaves the keys in use.
    api_keys_reload_s: float = Field(default=5.0, ge=0)
    # SLO of a call that names none (x-qlm-slo-ms / qlm_slo_ms), end to end, in ms.
    default_slo_ms: int = Field(default=60_000, gt=0)
    # Optional TTFT deadline of a call that names no SLO at all.
    default_ttft_ms: int | None = Field(default=None, gt=0)
    # SLO of a `service_tier: "flex"` call that names none: long, so that the batch tier holds
    # it for spare capacity (QLM_BATCH_MIN_SLACK_S, 1 h by default).
    flex_slo_ms: int = Field(default=86_400_000, gt=0, le=7 * 24 * 3_600_000)
    # max_tokens of a chat call that sends none (capped at the model's max_output_tokens).
    default_max_tokens: int = Field(default=256, ge=1)
    # How long one HTTP call waits for its reply before a 504. qlm serves late work anyway.
    timeout_s: float = Field(default=600.0, gt=0)
    # Largest request body read (bytes); larger gets a 413. The coordinator's own limit,
    # QLM_MAX_BODY_BYTES, applies to the translated request as well.
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    # Retry-After (seconds) on a 429 (qlm overloaded) or 503 (broker unreachable).
    retry_after_s: int = Field(default=1, ge=1)
    # Requests per minute each tenant may send through this gateway (a token bucket holding a
    # minute's worth; beyond it a 429 rate_limit_exceeded); unset: no limit.
    rate_limit_rpm: int | None = Field(default=None, ge=1)
    # Per-tenant overrides of rate_limit_rpm, as a JSON object tenant -> requests per minute
    # (keys without a tenant are the tenant ""); a tenant not named gets rate_limit_rpm.
    tenant_rate_limits: dict[str, int] | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @field_validator("tenant_rate_limits")
    @classmethod
    def _rates_positive(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        for tenant, rpm in (value or {}).items():
            if rpm < 1:
                raise ValueError(f"tenant {tenant!r}: a rate limit is >= 1 request per minute")
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> GatewaySettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("QLM_GATEWAY_TLS_CERT and QLM_GATEWAY_TLS_KEY go together: set both")
        return self


# --- the long-lived qlm client ----------------------------------------------------------------


class GatewayClient(QlmClient):
    """The gateway's long-lived ``QlmClient``: it ``forget()``s each request once its HTTP
    call is over (answered, timed out or abandoned), so its books do not grow without bound,
    and a reply that comes for a forgotten request is dropped quietly."""

    def __init__(self, amqp_url: str) -> None:
        super().__init__(amqp_url, app_id="qlm-gateway")

    def connected(self) -> bool:
        """Connected to the broker now (a robust connection that is reconnecting is not)."""
        conn = self._connection
        return conn is not None and not conn.is_closed


# --- errors ----------------------------------------------------------------------------------


class GatewayError(Exception):
    """An error answered as OpenAI's ``{"error": {message, type, param, code}}`` body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(
            error=ErrorDetail(message=message, type=type, param=param, code=code)
        )
        self.headers = dict(headers or {})

    def response(self) -> Response:
        return Response(
            self.body.model_dump_json(),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


class _ClientGone(Exception):
    """The HTTP client disconnected while its request waited for the reply."""


# qlm ErrorMessage code -> (HTTP status, OpenAI error type, OpenAI error code).
_QLM_ERRORS: dict[ErrorCode, tuple[int, str, str]] = {
    ErrorCode.INVALID_JSON: (400, "invalid_request_error", "invalid_json"),
    ErrorCode.INVALID_ENCODING: (400, "invalid_request_error", "invalid_encoding"),
    ErrorCode.INVALID_CONTENT_TYPE: (400, "invalid_request_error", "invalid_content_type"),
    ErrorCode.BODY_TOO_LARGE: (400, "invalid_request_error", "body_too_large"),
    ErrorCode.SCHEMA_VIOLATION: (400, "invalid_request_error", "schema_violation"),
    ErrorCode.MAX_TOKENS_OUT_OF_RANGE: (400, "invalid_request_error", "max_tokens_out_of_range"),
    # OpenAI's code for the same condition, so clients that special-case it keep working.
    ErrorCode.PROMPT_TOO_LONG: (400, "invalid_request_error", "context_length_exceeded"),
    ErrorCode.UNKNOWN_MODEL: (404, "invalid_request_error", "model_not_found"),
    # a catalog model no live agent serves: to the client as absent as an unknown one
    ErrorCode.MODEL_NOT_SERVED: (404, "invalid_request_error", "model_not_found"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error", "overloaded"),
    ErrorCode.ENGINE_ERROR: (500, "server_error", "engine_error"),
    ErrorCode.DELIVERY_LIMIT: (500, "server_error", "delivery_limit"),
    ErrorCode.INTERNAL_ERROR: (500, "server_error", "internal_error"),
}
_QLM_PARAMS: dict[ErrorCode, str] = {
    ErrorCode.MAX_TOKENS_OUT_OF_RANGE: "max_tokens",
    ErrorCode.UNKNOWN_MODEL: "model",
    ErrorCode.MODEL_NOT_SERVED: "model",
}


def error_from_reply(reply: ErrorMessage, retry_after_s: int) -> GatewayError:
    status, type_, code = _QLM_ERRORS.get(reply.code, (500, "server_error", str(reply.code)))
    headers = {"Retry-After": str(retry_after_s)} if status == 429 else None
    return GatewayError(
        status,
        reply.message,
        type=type_,
        code=code,
        param=_QLM_PARAMS.get(reply.code),
        headers=headers,
    )


def _validation_error(exc: ValidationError) -> GatewayError:
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in first["loc"])
    msg = str(first["msg"]).removeprefix("Value error, ")
    return GatewayError(
        400,
        f"{where}: {msg}" if where else msg,
        code="invalid_request",
        param=where or None,
    )


# --- request translation ---------------------------------------------------------------------

_M = TypeVar("_M", bound=BaseModel)


def _parse(model: type[_M], body: bytes) -> _M:
    if not body:
        raise GatewayError(400, "the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":
            raise GatewayError(
                400, "the request body is not valid JSON", code="invalid_json"
            ) from None
        raise _validation_error(exc) from None


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed ``limit``: before reading
    when Content-Length says so, else while reading (chunked uploads)."""
    too_large = GatewayError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
    declared = request.headers.get("content-length")
    # isascii: str.isdigit is also true of "²" and other digits int() refuses; a length of
    # more digits than the limit's is over it (int() would refuse beyond 4300 digits)
    if (
        declared is not None
        and declared.isascii()
        and declared.isdigit()
        and (len(declared.lstrip("0")) > len(str(limit)) or int(declared) > limit)
    ):
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _header_int(request: Request, name: str) -> int | None:
    raw = request.headers.get(name)
    if raw is None:
        return None
    # ASCII digits only (int() also takes "٣", "1_000" and spaces), and at most 18 of them:
    # a 401-digit value is an integer no float holds, and over 4300 int() itself raises
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
        raise GatewayError(
            400, f"header {name} must be an integer of at most 18 digits", param=name
        )
    return int(text)


@dataclass(frozen=True)
class _Call:
    """What one HTTP call needs after its request left for the queue."""

    kind: Literal["completion", "chat"]
    request_id: str
    public_id: str
    model: str
    stream: bool
    include_usage: bool


class _Gateway:
    def __init__(
        self,
        client: GatewayClient,
        keys: ApiKeys,
        catalog: ModelCatalog,
        settings: GatewaySettings,
        served: ServedModelsWatcher | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.catalog = catalog
        self.settings = settings
        self.served = served
        self.rates = TenantRateLimits(settings.rate_limit_rpm, settings.tenant_rate_limits)
        self._background: set[asyncio.Future[None]] = set()

    async def model_cards(self) -> list[ModelCard]:
        """``/v1/models``: what live agents serve, as the coordinator last announced it. A bare
        app without announcements (``served`` None) lists the catalog."""
        if self.served is None:
            return [
                ModelCard(id=name, max_model_len=self.catalog.get(name).max_context)
                for name in self.catalog.names()
            ]
        served = await self.served.wait(_SERVED_WAIT_S)
        if served is None:
            raise GatewayError(
                503,
                "no coordinator has reported the models it serves (none is running, or one "
                "has just started); retry",
                type="server_error",
                code="service_unavailable",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )
        return [ModelCard(id=m.id, max_model_len=m.max_model_len) for m in served.models]

    # ---- auth, model, SLO

    def tenant(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise GatewayError(
                401,
                "no API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": _CHALLENGE},
            )
        tenant = self.keys.tenant_for(presented.strip())
        if tenant is None:
            raise GatewayError(
                401,
                "incorrect API key",
                code="invalid_api_key",
                headers={"WWW-Authenticate": _CHALLENGE},
            )
        return tenant or None  # "" is qlm's default tenant, sent as no tenant at all

    def rate_headers(self, tenant: str | None) -> dict[str, str]:
        """Count one call of ``tenant`` against its rate limit: its ``x-ratelimit-*``
        headers (none without a limit), or a 429 once the limit is spent."""
        decision = self.rates.take(tenant or "")
        if decision is None:
            return {}
        if not decision.allowed:
            raise GatewayError(
                429,
                f"rate limit reached: {decision.limit_rpm} requests per minute for this API "
                f"key's tenant; retry in {decision.retry_after_s:.1f} s",
                type="requests",
                code="rate_limit_exceeded",
                headers=decision.headers(),
            )
        return decision.headers()

    def spec(self, model: str) -> ModelSpec:
        try:
            return self.catalog.get(model)
        except UnknownModelError:
            raise GatewayError(
                404,
                f"the model {model!r} does not exist; GET /v1/models lists the models served",
                code="model_not_found",
                param="model",
            ) from None

    def slo(self, request: Request, body: CompletionRequest | ChatCompletionRequest) -> SLO:
        """Body field, else header, else the configured default. A call that names only a
        TTFT deadline gets only that one: it asked for first-token latency, not a deadline on
        the whole answer."""
        e2e = body.qlm_slo_ms or _header_int(request, "x-qlm-slo-ms")
        ttft = body.qlm_ttft_ms or _header_int(request, "x-qlm-ttft-ms")
        tbt = body.qlm_tbt_ms or _header_int(request, "x-qlm-tbt-ms")
        slo_class = body.qlm_slo_class or request.headers.get("x-qlm-slo-class")
        if slo_class is None and body.service_tier is not None:
            slo_class = SERVICE_TIER_CLASSES[body.service_tier]
        if e2e is None and ttft is None:
            if body.service_tier == "flex":
                e2e = self.settings.flex_slo_ms
            else:
                e2e, ttft = self.settings.default_slo_ms, self.settings.default_ttft_ms
        try:
            return SLO(e2e_ms=e2e, ttft_ms=ttft, tbt_ms=tbt, slo_class=slo_class)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    def priority(self, request: Request, body: CompletionRequest | ChatCompletionRequest) -> int:
        if body.qlm_priority is not None:
            return body.qlm_priority
        if body.priority is not None:
            # vLLM: lower is earlier, default 0; qlm: 0-9, higher is more urgent, default 0.
            # So -priority, clamped: vLLM's urgent negatives rise, its deferrals stay at 0.
            return min(9, max(0, -body.priority))
        p = _header_int(request, "x-qlm-priority")
        if p is not None and not 0 <= p <= 9:
            raise GatewayError(400, "header x-qlm-priority must be 0-9", param="x-qlm-priority")
        return p or 0

    def message(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        tenant: str | None,
        request_id: str,
    ) -> RequestMessage:
        spec = self.spec(body.model)
        sampling = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.qlm_top_k is None else body.qlm_top_k,
            seed=body.seed,
            stop=body.stop_list(),
        )
        fields: dict[str, Any]
        if isinstance(body, CompletionRequest):
            prompt = body.single_prompt()
            fields = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
            max_tokens = body.max_tokens or 16
        else:
            chat = [ChatMessage(role=m.wire_role(), content=m.text()) for m in body.messages]
            fields = {"messages": chat}
            max_tokens = body.requested_max_tokens() or min(
                self.settings.default_max_tokens, spec.max_output_tokens
            )
        try:
            return RequestMessage(
                request_id=request_id,
                model=body.model,
                max_tokens=max_tokens,
                sampling=sampling,
                slo=self.slo(request, body),
                priority=self.priority(request, body),
                tenant=tenant,
                **fields,
            )
        except ValidationError as exc:
            raise _validation_error(exc) from None

    # ---- the round trip

    async def round_trip(self, request: Request, message: RequestMessage) -> ResultMessage:
        """Publish, then wait for the reply, the timeout or the client leaving."""
        rid = message.request_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.timeout_s
        try:
            # Bounded too: a broker under a resource alarm blocks publishers indefinitely.
            fut = await asyncio.wait_for(
                self.client.submit(message, submitted_at=time.time()), self.settings.timeout_s
            )
        except Exception as exc:  # noqa: BLE001 - any publish failure: not confirmed, say so
            self.client.forget(rid)
            log.warning("gateway_publish_failed", request_id=rid, error=type(exc).__name__)
            raise self._unavailable() from None
        gone = asyncio.create_task(_until_disconnect(request.receive))
        waiting: set[asyncio.Future[Any]] = {fut, gone}
        try:
            done, _ = await asyncio.wait(
                waiting,
                timeout=max(0.0, deadline - loop.time()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
        try:
            if fut.cancelled():  # the client closed under us: the process is stopping
                raise GatewayError(
                    503, "the gateway is shutting down", type="server_error", code="shutting_down"
                )
            if fut.done():
                return self._result(fut.result())
            if gone in done:
                log.info("gateway_client_disconnected", request_id=rid)
                await self._cancel(rid, "the HTTP client disconnected")
                raise _ClientGone
            log.warning("gateway_timeout", request_id=rid, timeout_s=self.settings.timeout_s)
            await self._cancel(rid, "the gateway's timeout passed")
            raise GatewayError(
                504,
                f"no reply within {self.settings.timeout_s:g} s; the request was cancelled",
                type="timeout_error",
                code="timeout",
            )
        except MalformedReply:
            log.error("gateway_malformed_reply", request_id=rid)
            raise GatewayError(
                502, "qlm sent a reply that is not valid", type="server_error", code="bad_reply"
            ) from None
        finally:
            self.client.forget(rid)

    async def open_stream(
        self, request: Request, message: RequestMessage
    ) -> tuple[TokenStream, StreamPiece, float]:
        """Publish a streamed request, then wait for its first piece (its first tokens, or
        the result), the timeout or the client leaving: an error until then is an HTTP error
        status. Returns the stream, its first piece and the call's deadline (loop time)."""
        rid = message.request_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.timeout_s
        try:
            stream = await asyncio.wait_for(
                self.client.open_stream(message, submitted_at=time.time()),
                self.settings.timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - any publish failure: not confirmed, say so
            self.client.forget(rid)
            log.warning("gateway_publish_failed", request_id=rid, error=type(exc).__name__)
            raise self._unavailable() from None
        first = asyncio.ensure_future(stream.next())
        gone = asyncio.create_task(_until_disconnect(request.receive))
        try:
            done, _ = await asyncio.wait(
                {first, gone},
                timeout=max(0.0, deadline - loop.time()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
        if first.done() and not first.cancelled():
            try:
                piece = first.result()
            except BaseException as exc:
                stream.close()
                self.client.forget(rid)
                if isinstance(exc, StreamError):
                    log.info("gateway_error_reply", request_id=rid, code=str(exc.error.code))
                    raise error_from_reply(exc.error, self.settings.retry_after_s) from None
                if isinstance(exc, MalformedReply):
                    log.error("gateway_malformed_reply", request_id=rid)
                    raise GatewayError(
                        502,
                        "qlm sent a reply that is not valid",
                        type="server_error",
                        code="bad_reply",
                    ) from None
                raise
            assert piece is not None  # a stream's first next() is a piece or raises
            return stream, piece, deadline
        first.cancel()
        stream.close()
        try:
            if first.done():  # the reply's future was cancelled: the client closed under us
                raise GatewayError(
                    503, "the gateway is shutting down", type="server_error", code="shutting_down"
                )
            if gone in done:
                log.info("gateway_client_disconnected", request_id=rid)
                await self._cancel(rid, "the HTTP client disconnected")
                raise _ClientGone
            log.warning("gateway_timeout", request_id=rid, timeout_s=self.settings.timeout_s)
            await self._cancel(rid, "the gateway's timeout passed")
            raise GatewayError(
                504,
                f"no reply within {self.settings.timeout_s:g} s; the request was cancelled",
                type="timeout_error",
                code="timeout",
            )
        finally:
            self.client.forget(rid)

    def stream_body(
        self,
        call: _Call,
        tenant: str | None,
        stream: TokenStream,
        first: StreamPiece,
        deadline: float,
    ) -> AsyncIterator[bytes]:
        """The SSE events of a call whose stream began (sse.py). A call that ends before its
        result (the client went away, the timeout passed) cancels its request."""
        rid = call.request_id
        loop = asyncio.get_running_loop()

        async def next_piece() -> StreamPiece | None:
            piece = await stream.next(max(0.0, deadline - loop.time()))
            if piece is None or piece.result is not None:
                return piece
            # pieces already here (a message held several chunks of this stream, or the
            # gateway fell behind) go out as one event: the same text no later, and one
            # render, socket write and client parse instead of several
            while (more := stream.next_ready()) is not None:
                piece = StreamPiece(
                    piece.offset, piece.token_ids + more.token_ids, piece.text + more.text
                )
            return piece

        async def events() -> AsyncIterator[bytes]:
            answered = False
            try:
                try:
                    async for event in stream_events(
                        SseRenderer(call.kind, call.public_id, call.model),
                        first,
                        next_piece,
                        include_usage=call.include_usage,
                        finish=lambda r: (_finish(r.finish_reason), _usage(r), _info(r)),
                    ):
                        yield event
                    answered = True
                except StreamError as exc:
                    answered = True
                    err = error_from_reply(exc.error, self.settings.retry_after_s).body.error
                    yield error_event(err.message, err.type, err.code or "error")
                except MalformedReply:
                    answered = True
                    log.error("gateway_malformed_reply", request_id=rid)
                    yield error_event(
                        "qlm sent a reply that is not valid", "server_error", "bad_reply"
                    )
                except TimeoutError:
                    timeout_s = self.settings.timeout_s
                    log.warning("gateway_timeout", request_id=rid, timeout_s=timeout_s)
                    yield error_event(
                        f"no result within {timeout_s:g} s; the request was cancelled",
                        "timeout_error",
                        "timeout",
                    )
                yield DONE
            finally:
                stream.close()
                if not answered:
                    # not awaited here: the generator may be closing under a cancellation
                    self._spawn(self._cancel(rid, "the stream ended early", tenant=tenant))
                self.client.forget(rid)

        return events()

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _unavailable(self) -> GatewayError:
        return GatewayError(
            503,
            "the request could not be queued (message broker unavailable); retry",
            type="server_error",
            code="service_unavailable",
            headers={"Retry-After": str(self.settings.retry_after_s)},
        )

    async def _cancel(self, rid: str, reason: str, *, tenant: str | None = None) -> None:
        """Withdraw the request nobody waits for any more; its late reply is dropped. A cancel
        that cannot be published (broker down) leaves the request to run: logged, not raised."""
        try:
            await asyncio.wait_for(
                self.client.cancel(rid, reason, tenant=tenant), self.settings.timeout_s
            )
            log.info("gateway_request_cancelled", request_id=rid, reason=reason)
        except Exception as exc:  # noqa: BLE001 - best effort: the caller is already gone
            log.warning("gateway_cancel_failed", request_id=rid, error=type(exc).__name__)

    def _result(self, reply: Reply) -> ResultMessage:
        if isinstance(reply, ErrorMessage):
            log.info("gateway_error_reply", request_id=reply.request_id, code=str(reply.code))
            raise error_from_reply(reply, self.settings.retry_after_s)
        return reply


async def _until_disconnect(receive: Receive) -> None:
    # The body has been read, so the next ASGI message the server hands us is the disconnect.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


# --- responses -------------------------------------------------------------------------------


def _finish(reason: str) -> FinishReason:
    # OpenAI has no "abort" (qlm: the engine stopped the request early). The text is cut
    # short, which is what "length" tells a client.
    return "stop" if reason == "stop" else "length"


def _usage(result: ResultMessage) -> UsageOut:
    u = result.usage
    return UsageOut(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
    )


def _info(result: ResultMessage) -> QlmInfo:
    t = result.timestamps
    queue_ms = None if t.started is None else round((t.started - t.submitted) * 1000, 3)
    return QlmInfo(
        request_id=result.request_id,
        instance_id=result.instance_id,
        attempts=result.attempts,
        slo_met=result.slo.met,
        e2e_ms=result.slo.e2e_ms,
        ttft_ms=result.slo.ttft_ms,
        tbt_ms=result.slo.tbt_ms,
        queue_ms=queue_ms,
    )


def _json(model: BaseModel, rid: str) -> Response:
    return Response(
        model.model_dump_json(),
        media_type="application/json",
        headers={"x-qlm-request-id": rid},
    )


def completion_response(call: _Call, result: ResultMessage) -> Response:
    body = CompletionResponse(
        id=call.public_id,
        created=int(time.time()),
        model=call.model,
        choices=[
            CompletionChoice(text=result.output_text, finish_reason=_finish(result.finish_reason))
        ],
        usage=_usage(result),
        qlm=_info(result),
    )
    return _json(body, call.request_id)


def chat_response(call: _Call, result: ResultMessage) -> Response:
    body = ChatCompletionResponse(
        id=call.public_id,
        created=int(time.time()),
        model=call.model,
        choices=[
            ChatChoice(
                message=ChatMessageOut(content=result.output_text),
                finish_reason=_finish(result.finish_reason),
            )
        ],
        usage=_usage(result),
        qlm=_info(result),
    )
    return _json(body, call.request_id)


def _stream(events: AsyncIterator[bytes], rid: str) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={**_SSE_HEADERS, "x-qlm-request-id": rid},
    )


# --- the app ---------------------------------------------------------------------------------


def create_gateway_app(
    client: GatewayClient,
    *,
    keys: ApiKeys,
    catalog: ModelCatalog,
    settings: GatewaySettings | None = None,
    served: ServedModelsWatcher | None = None,
    metrics: GatewayMetrics | None = None,
    batches: BatchApi | None = None,
) -> FastAPI:
    """The gateway's ASGI app. ``client`` must be connected; its lifetime is the caller's
    (one client per process, shared by every call). ``served`` (started) gives ``/v1/models``
    the models live agents serve; without it the catalog is listed."""
    gw = _Gateway(client, keys, catalog, settings or GatewaySettings(), served)
    m = metrics or GatewayMetrics(waiting=client.outstanding)
    app = FastAPI(
        title="qlm gateway",
        summary="OpenAI-compatible front door onto qlm's durable queue",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(_HttpMetrics, metrics=m)
    app.state.metrics = m

    async def handle(
        request: Request,
        kind: Literal["completion", "chat"],
        render: Callable[[_Call, ResultMessage], Response],
    ) -> Response:
        """One call: a whole answer rendered by ``render``, or (``stream``) SSE events as
        the tokens come."""
        started = time.perf_counter()
        tenant = gw.tenant(request)
        rate = gw.rate_headers(tenant)  # before the body is read: a spent limit costs nothing
        raw = await _read_body(request, gw.settings.max_body_bytes)
        body: CompletionRequest | ChatCompletionRequest = (
            _parse(CompletionRequest, raw)
            if kind == "completion"
            else _parse(ChatCompletionRequest, raw)
        )
        rid = f"gw-{uuid.uuid4().hex}"
        message = gw.message(request, body, tenant, rid)
        call = _Call(
            kind=kind,
            request_id=rid,
            public_id=("cmpl-" if kind == "completion" else "chatcmpl-") + rid,
            model=body.model,
            stream=body.stream,
            include_usage=body.include_usage(),
        )
        if call.stream:
            try:
                stream, first, deadline = await gw.open_stream(request, message)
            except _ClientGone:
                return Response(status_code=499)
            m.observe_stream_ttft(body.model, time.perf_counter() - started)
            streamed = _stream(gw.stream_body(call, tenant, stream, first, deadline), rid)
            streamed.headers.update(rate)
            return streamed
        try:
            result = await gw.round_trip(request, message)
        except _ClientGone:
            # Nobody reads this; 499 is the de-facto "client closed request" status in logs.
            return Response(status_code=499)
        log.debug(
            "gateway_reply",
            request_id=rid,
            tenant=tenant,
            model=body.model,
            stream=body.stream,
            ms=round((time.perf_counter() - started) * 1000, 3),
        )
        answer = render(call, result)
        answer.headers.update(rate)
        return answer

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completion", completion_response)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat", chat_response)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        gw.tenant(request)
        cards = await gw.model_cards()
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model:path}")
    async def get_model(request: Request, model: str) -> Response:
        gw.tenant(request)
        gw.spec(model)  # not in the catalog: 404
        card = next((c for c in await gw.model_cards() if c.id == model), None)
        if card is None:
            raise GatewayError(
                404,
                f"the model {model!r} is not served by any live agent now; GET /v1/models "
                "lists the models served",
                code="model_not_found",
                param="model",
            )
        return Response(card.model_dump_json(), media_type="application/json")

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        # Open, like the admin API's: probes carry no key. Says nothing about tenants or keys.
        # Liveness only: a lost broker is reconnected by the client itself.
        return {"status": "ok", "waiting": client.outstanding()}

    @app.get("/readyz")
    async def readyz() -> Response:
        # Readiness: a call can be published now (connected to the broker).
        ready = client.connected()
        return Response(
            json.dumps({"status": "ok" if ready else "not_ready", "broker_connected": ready}),
            status_code=200 if ready else 503,
            media_type="application/json",
        )

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        # Sync: rendering runs in the threadpool (the registry is thread-safe); the waiting
        # gauge reads one dict, a benign race at worst.
        text, content_type = m.render()
        return Response(content=text, media_type=content_type)

    if batches is not None:  # the Files and Batch APIs (qlm/gateway/batches.py)
        from qlm.gateway.batches import install_batch_api

        install_batch_api(app, gw, batches)

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return GatewayError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.error("gateway_internal_error", path=request.url.path, error=type(exc).__name__)
        return GatewayError(
            500, "internal error", type="server_error", code="internal_error"
        ).response()

    return app


class _HttpMetrics:
    """Counts every HTTP call by route and status and times it to its last body byte (a
    stream's last event). Plain ASGI, not BaseHTTPMiddleware: that one wraps ``receive``,
    which the handlers read themselves to notice a client that goes away."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        route = gateway_route(scope.get("path", ""))
        status = [500]  # if the app fails before it answers, the server answers 500
        done = [False]

        def record() -> None:
            if not done[0]:
                done[0] = True
                self.metrics.observe_http(route, status[0], time.perf_counter() - started)

        async def send_and_count(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                record()

        try:
            await self.app(scope, receive, send_and_count)
        finally:
            record()  # a response cut short (client gone, error) is counted with its status


# --- serving ---------------------------------------------------------------------------------


@dataclass
class GatewayServer:
    """A running gateway: its HTTP server and its qlm client."""

    http: AdminServer
    client: GatewayClient
    served: ServedModelsWatcher | None = None
    batches: BatchApi | None = None
    keys_watch: ApiKeysWatch | None = None  # with QLM_GATEWAY_API_KEYS_FILE
    _keys_task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.http.host}:{self.http.port}"

    def watch_keys(self, interval_s: float) -> None:
        """Read the key file again every ``interval_s`` seconds (0: only on reload_keys)."""
        if self.keys_watch is not None and interval_s > 0 and self._keys_task is None:
            self._keys_task = asyncio.create_task(
                self.keys_watch.run(interval_s), name="gateway-api-keys-watch"
            )

    def reload_keys(self) -> bool:
        """Read the key file now (SIGHUP); whether the keys in use changed."""
        return self.keys_watch is not None and self.keys_watch.check()

    async def stop(self) -> None:
        if self._keys_task is not None:
            self._keys_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keys_task
        await self.http.stop()
        await self.client.close()
        if self.served is not None:
            await self.served.close()
        if self.batches is not None:
            await self.batches.close()


async def serve_gateway(
    amqp_url: str,
    *,
    keys: ApiKeys,
    catalog: ModelCatalog,
    settings: GatewaySettings | None = None,
    host: str | None = None,
    port: int | None = None,
    batch_database_url: str | None = None,
    batch_settings: BatchSettings | None = None,
) -> GatewayServer:
    """Connect the qlm client and serve the gateway in the current event loop; return once it
    listens (port 0 picks a free one: ``GatewayServer.url``). ``batch_database_url``: serve
    the Files and Batch APIs (docs/gateway.md, "Batch API") on that database."""
    s = settings or GatewaySettings()
    client = GatewayClient(amqp_url)
    await client.connect()
    served = ServedModelsWatcher(amqp_url)
    batches: BatchApi | None = None
    try:
        await served.start()
        if batch_database_url is not None:
            from qlm.gateway.batches import BatchApi

            batches = await BatchApi.open(amqp_url, batch_database_url, batch_settings)
        api = create_gateway_app(
            client, keys=keys, catalog=catalog, settings=s, served=served, batches=batches
        )
        http = await serve_admin(
            api,
            host or s.host,
            s.port if port is None else port,
            tls_cert=s.tls_cert,
            tls_key=s.tls_key,
        )
    except BaseException:
        await client.close()
        await served.close()
        if batches is not None:
            await batches.close()
        raise
    log.info("gateway_listening", host=http.host, port=http.port, api_keys=len(keys))
    watch = ApiKeysWatch(keys, s) if s.api_keys_file is not None else None
    server = GatewayServer(http, client, served, batches, keys_watch=watch)
    server.watch_keys(s.api_keys_reload_s)
    return server
