"""The coordinator's admin HTTP API (FastAPI): health, metrics, inspection and control.

``/healthz``, ``/readyz`` and ``/metrics`` are open (probes and Prometheus scrapers carry no
secrets); ``/healthz`` answers 200 while the process serves HTTP at all (liveness), ``/readyz``
503 unless it is connected to the broker and its store keeps up (readiness; a standby
coordinator is ready);
everything under ``/v1`` needs ``Authorization: Bearer <token>``. The admin token may do
everything; the optional read token may only read (GET/HEAD). The coordinator implements
:class:`AdminBackend`; this module knows nothing else about it, so the HTTP layer is tested
against a small in-memory backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import socket
from collections.abc import Generator, Mapping
from enum import StrEnum
from typing import Any, Literal, Protocol

import pydantic_core
import structlog
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from qlm.metrics import CoordinatorMetrics

log = structlog.get_logger(__name__)

MAX_QUEUE_LIMIT = 100_000
DEFAULT_QUEUE_LIMIT = 1_000
# RFC 6750 b64token: what a bearer credential may contain. Tokens are checked against it at
# startup so a configured token can always be sent, and compared as ASCII bytes.
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_CHALLENGE = 'Bearer realm="qlm-admin"'


class AdminBackend(Protocol):
    """What the admin API needs from the coordinator. Dict shapes are the response models."""

    def list_instances(self) -> list[dict[str, Any]]: ...

    def list_queues(self) -> list[dict[str, Any]]: ...

    async def get_request(self, request_id: str) -> dict[str, Any] | None: ...

    async def replan(self) -> dict[str, Any]: ...

    def latest_plan(self) -> dict[str, Any] | None:
        """The last plan's summary: policy, feasibility, scale-up advice, LSO decisions."""
        ...

    async def drain(self, instance_id: str) -> dict[str, Any]:
        """Stop dispatching to the instance and move its queue away; KeyError if unknown."""
        ...

    async def undrain(self, instance_id: str) -> dict[str, Any]:
        """Take a draining instance back into service; KeyError if unknown."""
        ...

    async def cancel(self, request_id: str, reason: str | None = None) -> dict[str, Any]:
        """Cancel a request as its producer would (one ``cancelled`` reply); KeyError if the
        coordinator neither tracks nor answered it."""
        ...

    def capacity_status(self) -> dict[str, Any] | None:
        """The autoscaler's state and its recent decisions; None when none runs."""
        ...

    def health(self) -> dict[str, Any]: ...


class BackendUnavailable(Exception):
    """Raised by a backend that cannot serve the call now (standby coordinator, broker down).

    The API answers 503 with the exception's message.
    """


# ---- response models (the OpenAPI document is generated from these) -------------------------


class _Open(BaseModel):
    # The coordinator may add fields before the models catch up; pass them through.
    model_config = ConfigDict(extra="allow")


class ErrorBody(BaseModel):
    code: str
    message: str
    details: Any | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class HealthResponse(_Open):
    status: Literal["ok", "degraded"]
    broker_connected: bool
    store_ok: bool
    active: bool = Field(description="this coordinator holds the leader role")


class InstanceInfo(_Open):
    instance_id: str
    agent_id: str
    gpu_type: str
    models: list[str]
    status: Literal["alive", "draining", "lost"]
    active_model: str | None
    running: int = Field(description="requests running in the engine")
    waiting: int = Field(description="requests waiting inside the engine")
    queued: int = Field(description="requests in the instance's virtual queue")
    kv_used_tokens: int
    kv_capacity_tokens: int
    last_seen: float = Field(description="unix seconds of the last heartbeat")
    credit: int = Field(
        0, description="dispatches the coordinator may send now (credit the agent pulled)"
    )
    credit_outstanding: int | None = Field(
        None,
        description="credit the agent counts as granted and unused (its last heartbeat); with "
        "`dispatches_in_transit`, what `credit` is reconciled against",
    )
    dispatches_in_transit: int | None = Field(
        None, description="dispatches sent that the agent had not received at its last heartbeat"
    )


class QueuedRequest(_Open):
    request_id: str
    model: str
    slo_class: str | None
    deadline: float | None = Field(description="unix seconds")
    prompt_tokens: int
    max_tokens: int
    position: int = Field(description="0-based position in the virtual queue")


class QueueInfo(_Open):
    instance_id: str | None = Field(description="null for requests not yet assigned")
    draining: bool
    depth: int = Field(description="requests in the queue (before `limit`)")
    truncated: bool = Field(description="`requests` was cut to `limit` entries")
    requests: list[QueuedRequest]


class RequestDetail(_Open):
    """Live state merged with the store's record and history; shape owned by the coordinator."""

    request_id: str


class PlanResponse(_Open):
    plan_id: str
    policy: str
    duration_s: float
    n_requests: int
    n_instances: int


class PlanSummary(_Open):
    plan_id: str
    policy: str
    created_at: float
    n_requests: int
    queues: dict[str, int] = Field(description="virtual queue lengths in the plan")
    feasible: bool | None = Field(default=None, description="every SLO predicted met")
    predicted_attainment: float | None = None
    scale_up: dict[str, Any] | None = Field(
        default=None, description="GPUs to add when no plan meets the SLOs (qlm policy)"
    )
    lso: dict[str, Any] | None = Field(
        default=None, description="per instance: active/warm/cold models, evict or swap"
    )


class CapacityDecisionRecord(_Open):
    decision: dict[str, Any] = Field(
        description="the policy's decision with its inputs (deltas per model/gpu_type/pool, "
        "targets, reasons, the observation, the ILP plan in force)"
    )
    outcome: dict[str, Any] = Field(
        description="what the driver did: applied, dry_run, detail, duration_s, decided_at"
    )


class CapacityStatus(_Open):
    policy: str = Field(description="reactive | cato | lt-i | lt-u | lt-ua")
    driver: str = Field(description="dry-run (the default) or command")
    dry_run: bool
    interval_s: float
    pool: str
    last_observation: dict[str, Any] | None = Field(
        default=None, description="the inputs of the latest decision, changed or not"
    )
    telemetry: dict[str, Any] = Field(default_factory=dict)
    decisions: list[CapacityDecisionRecord] = Field(
        default_factory=list,
        description="the latest decisions that changed something, oldest first",
    )


class DrainResponse(_Open):
    instance_id: str
    moved: int = Field(description="requests moved off the instance's virtual queue")
    status: Literal["draining"]


class UndrainResponse(_Open):
    instance_id: str
    status: Literal["alive", "lost"] = Field(
        description="alive: dispatching again; lost: its agent must re-register first"
    )


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str | None = Field(default=None, max_length=256)


class CancelResponse(_Open):
    request_id: str
    outcome: Literal["cancelled", "stopping", "answered"] = Field(
        description="cancelled: answered `cancelled` now; stopping: running, evicted, answered "
        "`cancelled` unless its result comes first; answered: too late, it has its reply"
    )


# ---- errors ---------------------------------------------------------------------------------


class _ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


def _error(
    status: int,
    code: str,
    message: str,
    headers: Mapping[str, str] | None = None,
    details: Any = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(code=code, message=message, details=details))
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, headers=headers)


_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "missing or malformed bearer token"},
    403: {"model": ErrorResponse, "description": "wrong token, or read token on a write"},
}


# ---- auth -----------------------------------------------------------------------------------


class Scope(StrEnum):
    READ = "read"
    ADMIN = "admin"


class _BearerAuth(HTTPBearer):
    """Bearer-token check for every /v1 route; subclassing HTTPBearer documents it in OpenAPI.

    Missing or malformed header -> 401; well-formed but wrong token -> 403; read token on a
    non-read method -> 403. Both tokens are always compared, in constant time.
    """

    def __init__(self, admin_token: bytes | None, read_token: bytes | None) -> None:
        super().__init__(
            auto_error=False,
            scheme_name="bearer",
            description="admin token (everything) or read token (GET only)",
        )
        self._admin = admin_token
        self._read = read_token

    async def __call__(self, request: Request) -> Scope:  # type: ignore[override]
        if self._admin is None:  # allow_no_auth: dev only, warned about at startup
            return Scope.ADMIN
        header = request.headers.get("authorization")
        if not header:
            raise _ApiError(
                401, "unauthenticated", "bearer token required", {"WWW-Authenticate": _CHALLENGE}
            )
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() != "bearer" or not _B64TOKEN.fullmatch(credentials):
            raise _ApiError(
                401,
                "unauthenticated",
                "malformed Authorization header; expected 'Bearer <token>'",
                {"WWW-Authenticate": _CHALLENGE + ', error="invalid_request"'},
            )
        given = credentials.encode("ascii")  # b64token is ASCII, checked above
        is_admin = hmac.compare_digest(given, self._admin)
        is_read = self._read is not None and hmac.compare_digest(given, self._read)
        if is_admin:
            return Scope.ADMIN
        if not is_read:
            raise _ApiError(
                403,
                "forbidden",
                "invalid token",
                {"WWW-Authenticate": _CHALLENGE + ', error="invalid_token"'},
            )
        if request.method not in _READ_METHODS:
            raise _ApiError(
                403,
                "insufficient_scope",
                "the read token may only read; use the admin token",
                {"WWW-Authenticate": _CHALLENGE + ', error="insufficient_scope"'},
            )
        return Scope.READ


def _token_bytes(name: str, token: str | SecretStr | None) -> bytes | None:
    if token is None:
        return None
    value = token.get_secret_value() if isinstance(token, SecretStr) else token
    if not _B64TOKEN.fullmatch(value):
        # The message names the setting, never the value.
        raise ValueError(
            f"{name} must be non-empty and use only A-Z a-z 0-9 - . _ ~ + / (then '=' padding),"
            " e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    if len(value) < 16:
        log.warning("admin_token_short", setting=name, length=len(value))
    return value.encode("ascii")


# ---- the app --------------------------------------------------------------------------------


def create_admin_app(
    backend: AdminBackend,
    *,
    token: str | SecretStr | None,
    read_token: str | SecretStr | None = None,
    metrics: CoordinatorMetrics,
    allow_no_auth: bool = False,
) -> FastAPI:
    """Build the admin app. ``token=None`` is refused unless ``allow_no_auth`` (dev only)."""
    admin_bytes = _token_bytes("admin token (QLM_ADMIN_TOKEN)", token)
    read_bytes = _token_bytes("read token", read_token)
    if admin_bytes is None:
        if not allow_no_auth:
            raise ValueError("the admin API needs a token: set QLM_ADMIN_TOKEN")
        if read_bytes is not None:
            raise ValueError("a read token without an admin token would be ignored")
        log.warning("admin_api_unauthenticated", reason="allow_no_auth=True; dev only")
    elif read_bytes is not None and hmac.compare_digest(admin_bytes, read_bytes):
        raise ValueError("the read token must differ from the admin token")

    app = FastAPI(
        title="qlm coordinator admin API",
        version="1",
        description="Inspect and control a qlm coordinator. See docs/admin-api.md.",
    )
    _install_error_handlers(app)
    # Routes that touch the backend are ``async def`` so they run on the event loop thread:
    # the coordinator's in-memory state is not thread-safe.

    @app.get(
        "/healthz",
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": "degraded"}},
        tags=["ops"],
    )
    async def healthz() -> JSONResponse:
        # Liveness: 200 whatever the broker does. A coordinator that lost the broker
        # reconnects by itself; restarting it (what a failed liveness probe does) would not help.
        health = HealthResponse.model_validate(backend.health())
        return JSONResponse(health.model_dump(mode="json"))

    @app.get(
        "/readyz",
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": "not ready"}},
        tags=["ops"],
    )
    async def readyz() -> JSONResponse:
        # Readiness: connected to the broker and the store keeps up. A standby (connected,
        # waiting for the single-active-consumer role) is ready: otherwise a rolling update
        # of two replicas could never replace the active one.
        health = HealthResponse.model_validate(backend.health())
        return JSONResponse(
            health.model_dump(mode="json"), status_code=200 if health.status == "ok" else 503
        )

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
        tags=["ops"],
    )
    def prometheus_metrics() -> Response:
        # Sync on purpose: rendering runs in the threadpool (the registry is thread-safe).
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    v1 = APIRouter(
        prefix="/v1",
        dependencies=[Depends(_BearerAuth(admin_bytes, read_bytes))],
        responses=_ERROR_RESPONSES,
    )

    @v1.get("/instances", response_model=list[InstanceInfo], tags=["inspect"])
    async def list_instances() -> list[dict[str, Any]]:
        return backend.list_instances()

    @v1.get("/queues", response_model=list[QueueInfo], tags=["inspect"])
    async def list_queues(
        limit: int = Query(
            DEFAULT_QUEUE_LIMIT, ge=0, le=MAX_QUEUE_LIMIT, description="requests shown per queue"
        ),
    ) -> Response:
        out = []
        for queue in backend.list_queues():
            requests = queue.get("requests", [])
            out.append(
                {
                    **queue,
                    "depth": len(requests),
                    "truncated": len(requests) > limit,
                    "requests": requests[:limit],
                }
            )
        # Serialized directly, without FastAPI's per-item response validation: that costs
        # ~5 us per request on the coordinator's event loop (0.5 s at limit=100000); this
        # costs ~1 us. The response model above still documents the shape.
        return Response(pydantic_core.to_json(out), media_type="application/json")

    @v1.get(
        "/requests/{request_id}",
        response_model=RequestDetail,
        responses={404: {"model": ErrorResponse, "description": "unknown request"}},
        tags=["inspect"],
    )
    async def get_request(
        request_id: str = Path(min_length=1, max_length=256),
    ) -> dict[str, Any]:
        record = await backend.get_request(request_id)
        if record is None:
            raise _ApiError(404, "request_not_found", f"no request {request_id!r}")
        return record

    @v1.post(
        "/replan",
        response_model=PlanResponse,
        responses={503: {"model": ErrorResponse, "description": "coordinator not active"}},
        tags=["control"],
    )
    async def replan() -> dict[str, Any]:
        plan = await backend.replan()
        log.info("admin_replan", plan_id=plan.get("plan_id"))
        return plan

    @v1.get(
        "/plan",
        response_model=PlanSummary,
        responses={404: {"model": ErrorResponse, "description": "no plan made yet"}},
        tags=["inspect"],
    )
    async def latest_plan() -> dict[str, Any]:
        plan = backend.latest_plan()
        if plan is None:
            raise _ApiError(404, "no_plan", "no replan has run yet")
        return plan

    @v1.get(
        "/capacity",
        response_model=CapacityStatus,
        responses={404: {"model": ErrorResponse, "description": "no autoscaler runs"}},
        tags=["inspect"],
    )
    async def capacity_status() -> dict[str, Any]:
        status = backend.capacity_status()
        if status is None:
            raise _ApiError(404, "autoscaling_off", "no autoscaler runs (set QLM_AUTOSCALE_POLICY)")
        return status

    @v1.post(
        "/instances/{instance_id}/drain",
        response_model=DrainResponse,
        responses={
            404: {"model": ErrorResponse, "description": "unknown instance"},
            503: {"model": ErrorResponse, "description": "coordinator not active"},
        },
        tags=["control"],
    )
    async def drain(instance_id: str = Path(min_length=1, max_length=256)) -> dict[str, Any]:
        try:
            result = await backend.drain(instance_id)
        except KeyError:
            raise _ApiError(404, "instance_not_found", f"no instance {instance_id!r}") from None
        log.info("admin_drain", instance_id=instance_id, moved=result.get("moved"))
        return result

    @v1.post(
        "/instances/{instance_id}/undrain",
        response_model=UndrainResponse,
        responses={
            404: {"model": ErrorResponse, "description": "unknown instance"},
            503: {"model": ErrorResponse, "description": "coordinator not active"},
        },
        tags=["control"],
    )
    async def undrain(instance_id: str = Path(min_length=1, max_length=256)) -> dict[str, Any]:
        try:
            result = await backend.undrain(instance_id)
        except KeyError:
            raise _ApiError(404, "instance_not_found", f"no instance {instance_id!r}") from None
        log.info("admin_undrain", instance_id=instance_id, status=result.get("status"))
        return result

    @v1.post(
        "/requests/{request_id}/cancel",
        response_model=CancelResponse,
        responses={
            400: {"model": ErrorResponse, "description": "the body is not JSON"},
            404: {"model": ErrorResponse, "description": "unknown request"},
            503: {"model": ErrorResponse, "description": "coordinator not active"},
        },
        tags=["control"],
    )
    async def cancel(
        request_id: str = Path(min_length=1, max_length=256),
        body: CancelRequest | None = None,
    ) -> dict[str, Any]:
        try:
            result = await backend.cancel(request_id, body.reason if body else None)
        except KeyError:
            raise _ApiError(404, "request_not_found", f"no request {request_id!r}") from None
        log.info("admin_cancel", request_id=request_id, outcome=result.get("outcome"))
        return result

    app.include_router(v1)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error, ours or FastAPI's, has the body ``{"error": {"code", "message"}}``."""

    @app.exception_handler(_ApiError)
    async def _api_error(_: Request, exc: _ApiError) -> JSONResponse:
        return _error(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(BackendUnavailable)
    async def _unavailable(_: Request, exc: BackendUnavailable) -> JSONResponse:
        return _error(503, "unavailable", str(exc) or "coordinator unavailable")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = jsonable_encoder(exc.errors(), exclude={"input", "ctx", "url"})
        return _error(422, "invalid_request", "request parameters are invalid", details=details)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response so the server still logs the traceback.
        log.error("admin_internal_error", path=request.url.path, error=type(exc).__name__)
        return _error(500, "internal_error", "internal error")


# ---- serving inside the coordinator's event loop --------------------------------------------


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handling: the coordinator owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


class AdminServer:
    """A uvicorn server running as a task in the current event loop."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], sock: socket.socket):
        self.server = server
        self.task = task
        self._sock = sock
        self.host, self.port = sock.getsockname()[:2]

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let in-flight responses finish (up to ``timeout_s``), then return."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        except TimeoutError:
            self.server.force_exit = True
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        finally:
            self._sock.close()


def _bind(host: str, port: int) -> socket.socket:
    family, type_, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
    )[0]
    # proto must be IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets whose
    # listener says so; without it small responses wait ~40 ms for a delayed ACK.
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_admin(
    app: FastAPI,
    host: str,
    port: int,
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> AdminServer:
    """Start serving ``app`` on ``host:port`` (0 = any free port) and return once listening;
    over HTTPS when ``tls_cert`` and ``tls_key`` (PEM files) are given.

    The socket is bound here, so a busy port raises ``OSError`` to the caller instead of
    uvicorn's ``sys.exit``. The bound port is ``AdminServer.port``.
    """
    sock = _bind(host, port)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        lifespan="off",
        access_log=False,
        # the faster parser; like h11 it drops the whitespace around a header value (RFC 9110
        # section 5.5), so "Bearer <token> " on the wire is the token itself
        http="httptools",
        timeout_graceful_shutdown=5,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
    )
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="qlm-admin-http")
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # re-raise the startup error
            raise RuntimeError("admin server exited before it started")
        await asyncio.sleep(0.005)
    admin = AdminServer(server, task, sock)
    log.info("admin_api_listening", host=admin.host, port=admin.port)
    return admin
