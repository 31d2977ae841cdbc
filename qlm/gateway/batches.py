"""The OpenAI Files and Batch APIs on the durable queue (docs/gateway.md, "Batch API").

``POST /v1/files`` keeps a JSONL upload (purpose ``batch``); ``POST /v1/batches`` checks it
line by line and stores one row per line (qlm/store/batches.py); the batch runner
(qlm/gateway/batch_runner.py) puts the lines on the durable queue as qlm requests of the
``batch`` SLO class, each with the deadline ``created_at + completion_window``, for the API
key's tenant, and the replies become the output and error files, in OpenAI's formats, so the
official ``openai`` client works unchanged.

Everything is in the database (and the file body store), nothing only in memory: any
replica on the same database serves any batch, and a restart resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import event as sa_event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.datastructures import UploadFile

from qlm.amqp import username_of
from qlm.client import Reply
from qlm.gateway.app import (
    GatewayError,
    _finish,
    _info,
    _parse,
    _read_body,
    _usage,
    _validation_error,
    error_from_reply,
)
from qlm.gateway.batch_runner import (
    BatchClient,
    BatchRunner,
    error_line,
    line_request_id,
    parse_line_request_id,
)
from qlm.gateway.openai_types import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from qlm.store.batches import (
    ACTIVE,
    BatchStore,
    DatabaseBodies,
    DirectoryBodies,
    FileBodies,
    FileNotFound,
)
from qlm.store.migrations import migrate, prepare_sqlite_path
from qlm.types import SLO, ErrorCode, ErrorMessage, RequestMessage

if TYPE_CHECKING:
    from qlm.gateway.app import _Gateway

log = structlog.get_logger(__name__)

ENDPOINTS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
_WINDOW = re.compile(r"^([1-9][0-9]{0,5})([mhd])$")
_UNITS = {"m": 60.0, "h": 3600.0, "d": 86400.0}
_MAX_CUSTOM_ID = 512
_MAX_METADATA_KEYS, _MAX_METADATA_KEY, _MAX_METADATA_VALUE = 16, 64, 512


class BatchSettings(BaseSettings):
    """``QLM_GATEWAY_*`` settings of the Files and Batch APIs."""

    model_config = SettingsConfigDict(env_prefix="QLM_GATEWAY_", extra="ignore")

    # The Files and Batch APIs on (`qlm gateway`); off: their routes are 404.
    batch_api: bool = True
    # The database of files, batches and lines; every replica must share it. Unset: the
    # shared QLM_DATABASE_URL (the coordinator's).
    database_url: str | None = None
    # Uploaded files' bytes in this directory instead of the database.
    files_dir: Path | None = None
    # OpenAI's limits: 200 MB a file, 50,000 requests a batch.
    files_max_bytes: int = Field(default=200 * 1024 * 1024, ge=1024)
    batch_max_requests: int = Field(default=50_000, ge=1)
    # Unanswered batch lines a tenant may have at once (all its active batches together);
    # batch_quotas (JSON, tenant -> count) sets it per tenant.
    batch_max_queued: int = Field(default=200_000, ge=0)
    batch_quotas: dict[str, int] = Field(default_factory=dict)
    # completion_window bounds: "24h" is OpenAI's only value; shorter and longer ones too.
    batch_min_window_s: float = Field(default=60.0, gt=0)
    batch_max_window_s: float = Field(default=7 * 86400.0, gt=0)
    # The runner: its lease on a batch, how often it looks, lines per publish round.
    batch_lease_s: float = Field(default=15.0, gt=0)
    batch_poll_s: float = Field(default=0.5, gt=0)
    batch_publish_chunk: int = Field(default=500, ge=1)
    # Release of a batch's lines (BatchRunner._allowed): at most batch_max_in_flight on the
    # queue at once, and never behind a straight line to all released at batch_pace of the
    # window; 0: all at once.
    batch_pace: float = Field(default=0.75, ge=0, le=1)
    batch_max_in_flight: int = Field(default=500, ge=1)
    # A line refused as `overloaded` is published again this much later.
    batch_retry_s: float = Field(default=5.0, gt=0)
    # The durable reply queue every replica shares (default: qlm.reply.<broker user>.batches.
    # <hash of the database URL>, the same for every replica on the same database).
    batch_reply_queue: str | None = None

    def quota(self, tenant: str) -> int:
        return self.batch_quotas.get(tenant, self.batch_max_queued)


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str = Field(max_length=256)
    completion_window: str = Field(max_length=16)
    metadata: dict[str, str] | None = None


class _InputLine(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    custom_id: str = Field(min_length=1, max_length=_MAX_CUSTOM_ID)
    method: str
    url: str
    body: dict[str, Any]


class _NoHeaders:
    """A batch line has no HTTP headers: the translation's header fallbacks find none."""

    headers: Mapping[str, str] = {}


def _not_found(kind: str, ident: str) -> GatewayError:
    return GatewayError(404, f"No such {kind} object: {ident}", code="not_found", param="id")


def _ts(value: float | None) -> int | None:
    return None if value is None else int(value)


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def default_reply_queue(amqp_url: str, database_url: str) -> str:
    """The replies' queue of every replica on ``database_url``: named after the database, so
    replicas that share it share the queue (any of them records any reply), and a gateway on
    another database never takes (and drops) replies that are not its batches'."""
    where = make_url(database_url).render_as_string(hide_password=True)
    digest = hashlib.sha256(where.encode()).hexdigest()[:12]
    return f"qlm.reply.{username_of(amqp_url)}.batches.{digest}"


def window_seconds(window: str, settings: BatchSettings) -> float:
    """``24h``, ``1h``, ``30m``, ``2d``: the completion window in seconds, within bounds."""
    m = _WINDOW.match(window)
    seconds = int(m.group(1)) * _UNITS[m.group(2)] if m else None
    if seconds is None or not (
        settings.batch_min_window_s <= seconds <= settings.batch_max_window_s
    ):
        raise GatewayError(
            400,
            f"completion_window {window!r} is not supported: send a duration such as '24h' "
            f"or '1h' (minutes 'm', hours 'h', days 'd') between "
            f"{settings.batch_min_window_s:g} s and {settings.batch_max_window_s:g} s",
            code="invalid_completion_window",
            param="completion_window",
        )
    return seconds


class BatchApi:
    """The Files and Batch API of one gateway process: its store, its runner and the reply
    handler that writes answers to the store."""

    def __init__(self, store: BatchStore, client: BatchClient, settings: BatchSettings) -> None:
        self.store = store
        self.client = client
        self.settings = settings
        self.runner = BatchRunner(
            store,
            client,
            lease_s=settings.batch_lease_s,
            poll_s=settings.batch_poll_s,
            publish_chunk=settings.batch_publish_chunk,
            pace=settings.batch_pace,
            max_in_flight=settings.batch_max_in_flight,
        )
        self.retry_after_s = 1
        # batch id -> (endpoint kind, tenant): fixed for a batch's life
        self._batch_facts: dict[str, tuple[str, str]] = {}
        client.handler = self.on_reply

    @classmethod
    async def open(
        cls, amqp_url: str, database_url: str, settings: BatchSettings | None = None
    ) -> BatchApi:
        """Migrate the database, connect the shared reply queue, start the runner."""
        s = settings or BatchSettings()
        prepare_sqlite_path(database_url)
        await asyncio.to_thread(migrate, database_url)
        engine = create_async_engine(database_url, pool_pre_ping=True)
        if engine.dialect.name == "sqlite":
            sa_event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        bodies: FileBodies = (
            DirectoryBodies(s.files_dir) if s.files_dir is not None else DatabaseBodies(engine)
        )
        client = BatchClient(
            amqp_url, s.batch_reply_queue or default_reply_queue(amqp_url, database_url)
        )
        api = cls(BatchStore(engine, bodies), client, s)
        try:
            await client.connect()
        except BaseException:
            await engine.dispose()
            raise
        api.runner.start()
        return api

    async def close(self) -> None:
        await self.runner.stop()
        await self.client.close()
        await self.store.engine.dispose()

    # ---- files

    async def upload(self, request: Request, tenant: str) -> dict[str, Any]:
        limit = self.settings.files_max_bytes
        too_large = GatewayError(
            413, f"the file exceeds the {limit} byte limit", code="file_too_large", param="file"
        )
        declared = request.headers.get("content-length", "")
        # the multipart envelope adds a little: refuse only what cannot fit
        if declared.isascii() and declared.isdigit() and int(declared) > limit + 65536:
            raise too_large
        try:
            form = await request.form(max_files=1, max_fields=8)
        except Exception:  # noqa: BLE001 - starlette's parser errors vary by version
            raise GatewayError(
                400, "send the file as multipart/form-data with fields 'file' and 'purpose'"
            ) from None
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise GatewayError(
                    400,
                    f"purpose {purpose!r} is not supported: qlm keeps files for the Batch "
                    "API only (purpose 'batch')",
                    code="invalid_purpose",
                    param="purpose",
                )
            if not isinstance(upload, UploadFile):
                raise GatewayError(400, "no file sent (the 'file' field)", param="file")
            data = await upload.read(limit + 1)
            filename = (upload.filename or "upload.jsonl")[:256]
        finally:
            await form.close()
        if len(data) > limit:
            raise too_large
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise GatewayError(
                400, "the file is not UTF-8 text (JSONL)", code="invalid_file", param="file"
            ) from None
        lines = sum(1 for line in text.split("\n") if line.strip())
        if lines == 0:
            raise GatewayError(400, "the file has no lines", code="invalid_file", param="file")
        if lines > self.settings.batch_max_requests:
            raise GatewayError(
                400,
                f"the file has {lines} requests; a batch holds at most "
                f"{self.settings.batch_max_requests}",
                code="too_many_requests_in_file",
                param="file",
            )
        row = {
            "file_id": f"file-{uuid.uuid4().hex}",
            "tenant": tenant,
            "purpose": "batch",
            "filename": filename,
            "bytes": len(data),
            "lines": lines,
            "created_at": time.time(),
            "kind": "upload",
            "batch_id": None,
        }
        await self.store.create_file(row, data)
        log.info("file_uploaded", file_id=row["file_id"], tenant=tenant, bytes=len(data))
        return file_object(row)

    async def own_file(self, file_id: str, tenant: str) -> dict[str, Any]:
        row = await self.store.get_file(file_id)
        if row is None or row["tenant"] != tenant:  # another tenant's file does not exist
            raise _not_found("File", file_id)
        return row

    async def content(self, row: dict[str, Any]) -> bytes:
        try:
            return await self.store.file_content(row)
        except FileNotFound:
            raise _not_found("File", row["file_id"]) from None

    # ---- batches

    async def create(self, gw: _Gateway, raw: bytes, tenant: str) -> dict[str, Any]:
        body = _parse(CreateBatch, raw)
        kind = ENDPOINTS.get(body.endpoint)
        if kind is None:
            raise GatewayError(
                400,
                f"endpoint {body.endpoint!r} is not supported: send one of {', '.join(ENDPOINTS)}",
                code="invalid_endpoint",
                param="endpoint",
            )
        window_s = window_seconds(body.completion_window, self.settings)
        _check_metadata(body.metadata)
        file = await self.store.get_file(body.input_file_id)
        if file is None or file["tenant"] != tenant:
            raise GatewayError(
                404,
                f"No such File object: {body.input_file_id}",
                code="not_found",
                param="input_file_id",
            )
        if file["kind"] != "upload" or file["purpose"] != "batch":
            raise GatewayError(
                400,
                f"file {body.input_file_id} is not an upload of purpose 'batch'",
                code="invalid_input_file",
                param="input_file_id",
            )
        data = await self.content(file)
        created = time.time()
        batch_id = f"batch_{uuid.uuid4().hex}"
        # a thread: 50,000 lines take about a second to check, which the event loop (serving
        # every other call of this gateway) must not wait for
        lines = await asyncio.to_thread(
            self._lines, gw, batch_id, data, kind, body.endpoint, tenant, created, window_s
        )
        open_now = sum(1 for ln in lines if ln["state"] == "pending")
        quota = self.settings.quota(tenant)
        queued = await self.store.open_lines_of_tenant(tenant)
        if queued + open_now > quota:
            raise GatewayError(
                429,
                f"this batch would put {open_now} requests on the queue, on top of {queued} "
                f"of your batches not answered yet; your limit is {quota} queued batch "
                "requests. Wait for running batches to finish, or split the file",
                type="rate_limit_error",
                code="batch_queue_limit_exceeded",
                param="input_file_id",
            )
        row = {
            "batch_id": batch_id,
            "tenant": tenant,
            "input_file_id": body.input_file_id,
            "endpoint": body.endpoint,
            "completion_window": body.completion_window,
            "window_s": window_s,
            "meta": body.metadata,
            "status": "in_progress",
            "errors": None,
            "total": len(lines),
            "created_at": created,
            "expires_at": created + window_s,
            "in_progress_at": created,
        }
        await self.store.create_batch(row, lines)
        log.info(
            "batch_created",
            batch_id=batch_id,
            tenant=tenant,
            lines=len(lines),
            invalid=len(lines) - open_now,
            window_s=window_s,
        )
        self.runner.wake()
        return await self.batch_object(batch_id)

    def _lines(
        self,
        gw: _Gateway,
        batch_id: str,
        data: bytes,
        kind: str,
        endpoint: str,
        tenant: str,
        created: float,
        window_s: float,
    ) -> list[dict[str, Any]]:
        """One row per input line: ``pending`` with its RequestMessage, or ``failed`` with its
        error-file line (the rest of the batch proceeds). A repeated ``custom_id`` refuses
        the whole batch: its answers could not be told apart."""
        rows: list[dict[str, Any]] = []
        seen: dict[str, int] = {}
        slo = SLO(e2e_ms=int(window_s * 1000), slo_class="batch")
        for line_no, raw_line in enumerate(data.decode("utf-8").split("\n"), start=1):
            if not raw_line.strip():
                continue

            def failed(
                code: str,
                message: str,
                custom_id: str | None = None,
                response: dict[str, Any] | None = None,
                line_no: int = line_no,
            ) -> dict[str, Any]:
                return {
                    "batch_id": batch_id,
                    "line_no": line_no,
                    "custom_id": custom_id,
                    "state": "failed",
                    "request": None,
                    "output": error_line(
                        batch_id, line_no, custom_id, code, f"line {line_no}: {message}", response
                    ),
                    "done_at": created,
                }

            try:
                parsed = json.loads(raw_line)
            except json.JSONDecodeError as exc:
                rows.append(failed("invalid_json_line", f"not valid JSON ({exc.msg})"))
                continue
            custom = parsed.get("custom_id") if isinstance(parsed, dict) else None
            custom_id = custom if isinstance(custom, str) and custom else None
            try:
                line = _InputLine.model_validate(parsed)
            except ValidationError as exc:
                err = _validation_error(exc).body.error
                rows.append(failed("invalid_request_line", err.message, custom_id))
                continue
            if line.custom_id in seen:
                raise GatewayError(
                    400,
                    f"line {line_no}: custom_id {line.custom_id!r} repeats line "
                    f"{seen[line.custom_id]}; every custom_id of a batch must be unique",
                    code="duplicate_custom_id",
                    param="input_file_id",
                )
            seen[line.custom_id] = line_no
            if line.method.upper() != "POST":
                rows.append(failed("invalid_method", "method must be POST", line.custom_id))
                continue
            if line.url != endpoint:
                rows.append(
                    failed(
                        "mismatched_url",
                        f"url {line.url!r} is not the batch's endpoint {endpoint!r}",
                        line.custom_id,
                    )
                )
                continue
            try:
                message = self._request(gw, kind, line.body, tenant, created, slo)
            except GatewayError as exc:
                e = exc.body.error
                response = {
                    "status_code": exc.status,
                    "request_id": None,
                    "body": exc.body.model_dump(),
                }
                rows.append(
                    failed(e.code or "invalid_request", e.message, line.custom_id, response)
                )
                continue
            rows.append(
                {
                    "batch_id": batch_id,
                    "line_no": line_no,
                    "custom_id": line.custom_id,
                    "state": "pending",
                    "request": message.model_dump_json(exclude_none=True),
                    "output": None,
                    "done_at": None,
                }
            )
        return rows

    def _request(
        self,
        gw: _Gateway,
        kind: str,
        body: dict[str, Any],
        tenant: str,
        created: float,
        slo: SLO,
    ) -> RequestMessage:
        """The line's body as a qlm request, translated as the HTTP endpoint translates one,
        then in the batch SLO class with the batch's deadline, counted from its creation (a
        re-publish after a restart keeps it)."""
        raw = json.dumps(body).encode()
        parsed: CompletionRequest | ChatCompletionRequest = (
            _parse(CompletionRequest, raw)
            if kind == "completion"
            else _parse(ChatCompletionRequest, raw)
        )
        if parsed.stream:
            raise GatewayError(400, "a batch request cannot stream", param="stream")
        placeholder = line_request_id("batch_0", 0, 0)
        message = gw.message(cast(Request, _NoHeaders()), parsed, tenant or None, placeholder)
        return message.model_copy(update={"slo": slo, "submitted_at": created})

    async def batch_object(self, batch_id: str) -> dict[str, Any]:
        row = await self.store.get_batch(batch_id)
        assert row is not None
        counts = await self.store.counts(batch_id)
        return batch_object(row, counts.total, counts.completed, counts.failed)

    async def own_batch(self, batch_id: str, tenant: str) -> dict[str, Any]:
        row = await self.store.get_batch(batch_id)
        if row is None or row["tenant"] != tenant:
            raise _not_found("Batch", batch_id)
        return row

    async def cancel(self, batch_id: str, tenant: str) -> dict[str, Any]:
        row = await self.own_batch(batch_id, tenant)
        if row["status"] not in ("cancelling", "cancelled"):
            if row["status"] not in ACTIVE or row["status"] == "finalizing":
                raise GatewayError(
                    409,
                    f"batch {batch_id} is {row['status']}; only a batch in progress can be "
                    "cancelled",
                    code="batch_not_cancellable",
                )
            changed = await self.store.update_batch(
                batch_id,
                {"status": "cancelling", "cancelling_at": time.time()},
                only_if=("validating", "in_progress"),
            )
            if changed:
                log.info("batch_cancelling", batch_id=batch_id, tenant=tenant)
                self.runner.wake()
        return await self.batch_object(batch_id)

    async def list_page(self, tenant: str, after: str | None, limit: int) -> dict[str, Any]:
        cursor = None
        if after is not None:
            cursor = await self.store.get_batch(after)
            if cursor is None or cursor["tenant"] != tenant:
                raise GatewayError(400, f"after: no batch {after}", param="after")
        rows = await self.store.list_batches(tenant, after=cursor, limit=limit + 1)
        page = rows[:limit]
        data = []
        for row in page:
            counts = await self.store.counts(row["batch_id"])
            data.append(batch_object(row, counts.total, counts.completed, counts.failed))
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(rows) > limit,
        }

    # ---- replies

    async def on_reply(self, request_id: str, reply: Reply | None, raw: str) -> None:
        """Record one line's reply (called by BatchClient; acked once this returns)."""
        where = parse_line_request_id(request_id)
        if where is None:
            log.warning("batch_reply_unexpected", request_id=request_id[:128], body=raw[:120])
            return
        batch_id, line_no, attempt = where
        facts = await self._facts(batch_id)
        if facts is None:
            return
        kind, _tenant = facts
        custom_id = await self._custom_id(batch_id, line_no)
        now = time.time()
        if isinstance(reply, ErrorMessage) and reply.code == ErrorCode.CANCELLED:
            await self.store.close_one(batch_id, line_no, attempt, "cancelled", now)
            return
        if isinstance(reply, ErrorMessage) and reply.code == ErrorCode.OVERLOADED:
            retried = await self.store.retry_later(
                batch_id, line_no, attempt, now + self.settings.batch_retry_s
            )
            if retried:
                log.info("batch_line_overloaded", batch_id=batch_id, line_no=line_no)
            return
        state, output = render_reply(batch_id, line_no, custom_id, kind, request_id, reply, now)
        if not await self.store.answer(batch_id, line_no, attempt, state, output, now):
            log.info("batch_reply_duplicate", request_id=request_id)

    async def _facts(self, batch_id: str) -> tuple[str, str] | None:
        facts = self._batch_facts.get(batch_id)
        if facts is None:
            row = await self.store.get_batch(batch_id)
            if row is None:
                log.warning("batch_reply_for_unknown_batch", batch_id=batch_id)
                return None
            facts = (ENDPOINTS[row["endpoint"]], row["tenant"])
            self._batch_facts[batch_id] = facts
        return facts

    async def _custom_id(self, batch_id: str, line_no: int) -> str | None:
        return await self.store.custom_id(batch_id, line_no)


def render_reply(
    batch_id: str,
    line_no: int,
    custom_id: str | None,
    kind: str,
    request_id: str,
    reply: Reply | None,
    now: float,
) -> tuple[str, str]:
    """(line state, file line) of a reply: an output-file line for a result, an error-file
    line for an error (with the HTTP status and body the endpoint would have answered)."""
    line_id = f"batch_req_{batch_id.removeprefix('batch_')}_{line_no}"
    if reply is None:
        return "failed", error_line(
            batch_id, line_no, custom_id, "bad_reply", "qlm sent a reply that is not valid"
        )
    if isinstance(reply, ErrorMessage):
        err = error_from_reply(reply, 1)
        e = err.body.error
        response = {
            "status_code": err.status,
            "request_id": request_id,
            "body": err.body.model_dump(),
        }
        return "failed", error_line(
            batch_id, line_no, custom_id, e.code or "error", e.message, response
        )
    created = int(reply.timestamps.finished or now)
    body: BaseModel
    if kind == "completion":
        body = CompletionResponse(
            id=f"cmpl-{request_id}",
            created=created,
            model=reply.model,
            choices=[
                CompletionChoice(text=reply.output_text, finish_reason=_finish(reply.finish_reason))
            ],
            usage=_usage(reply),
            qlm=_info(reply),
        )
    else:
        body = ChatCompletionResponse(
            id=f"chatcmpl-{request_id}",
            created=created,
            model=reply.model,
            choices=[
                ChatChoice(
                    message=ChatMessageOut(content=reply.output_text),
                    finish_reason=_finish(reply.finish_reason),
                )
            ],
            usage=_usage(reply),
            qlm=_info(reply),
        )
    line = {
        "id": line_id,
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": request_id,
            "body": body.model_dump(mode="json"),
        },
        "error": None,
    }
    return "done", _compact(line)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > _MAX_METADATA_KEYS or any(
        len(k) > _MAX_METADATA_KEY or len(v) > _MAX_METADATA_VALUE for k, v in metadata.items()
    ):
        raise GatewayError(
            400,
            f"metadata: at most {_MAX_METADATA_KEYS} keys of at most {_MAX_METADATA_KEY} "
            f"characters, values of at most {_MAX_METADATA_VALUE}",
            param="metadata",
        )


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["file_id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": int(row["created_at"]),
        "expires_at": None,
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
    }


def batch_object(row: dict[str, Any], total: int, completed: int, failed: int) -> dict[str, Any]:
    return {
        "id": row["batch_id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": row["errors"],
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": int(row["created_at"]),
        "in_progress_at": _ts(row["in_progress_at"]),
        "expires_at": _ts(row["expires_at"]),
        "finalizing_at": _ts(row["finalizing_at"]),
        "completed_at": _ts(row["completed_at"]),
        "failed_at": _ts(row["failed_at"]),
        "expired_at": _ts(row["expired_at"]),
        "cancelling_at": _ts(row["cancelling_at"]),
        "cancelled_at": _ts(row["cancelled_at"]),
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "metadata": row["meta"],
    }


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_compact(obj), status_code=status, media_type="application/json")


def install_batch_api(app: FastAPI, gw: _Gateway, api: BatchApi) -> None:
    """Add the Files and Batch API routes to the gateway's app."""

    def tenant(request: Request) -> str:
        return gw.tenant(request) or ""

    @app.post("/v1/files")
    async def create_file(request: Request) -> Response:
        return _json(await api.upload(request, tenant(request)))

    @app.get("/v1/files")
    async def list_files(request: Request, limit: int = 100) -> Response:
        rows = await api.store.list_files(tenant(request), max(1, min(limit, 10_000)))
        return _json({"object": "list", "data": [file_object(r) for r in rows], "has_more": False})

    @app.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str) -> Response:
        return _json(file_object(await api.own_file(file_id, tenant(request))))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        row = await api.own_file(file_id, tenant(request))
        return Response(await api.content(row), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> Response:
        row = await api.own_file(file_id, tenant(request))
        await api.store.delete_file(row["file_id"])
        return _json({"id": row["file_id"], "object": "file", "deleted": True})

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        who = tenant(request)
        raw = await _read_body(request, gw.settings.max_body_bytes)
        return _json(await api.create(gw, raw, who))

    @app.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> Response:
        if not 1 <= limit <= 100:
            raise GatewayError(400, "limit must be 1-100", param="limit")
        return _json(await api.list_page(tenant(request), after, limit))

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> Response:
        row = await api.own_batch(batch_id, tenant(request))
        return _json(await api.batch_object(row["batch_id"]))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        return _json(await api.cancel(batch_id, tenant(request)))


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # as the coordinator's store: WAL so reads run beside the writes, and a busy wait rather
    # than "database is locked" when replicas (or the coordinator) write at once
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()
