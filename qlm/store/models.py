"""ORM models of the state store: the durable record of requests, instances and plans.

All times are wall-clock unix seconds (floats, ``DOUBLE PRECISION``), written by the process
that observed them; the database never supplies a clock, so there is no ``now()`` default that
would behave differently on SQLite and PostgreSQL. Status columns are plain strings validated
in Python against :class:`RequestStatus` / :data:`INSTANCE_STATUSES`: no native PostgreSQL
ENUM type, so migrations stay identical on both databases and adding a status needs no DDL.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class RequestStatus(StrEnum):
    RECEIVED = "received"
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    COMPLETED = "completed"
    FAILED = "failed"
    REJECTED = "rejected"
    REQUEUED = "requeued"
    DEAD_LETTERED = "dead_lettered"
    CANCELLED = "cancelled"


INSTANCE_STATUSES: frozenset[str] = frozenset({"alive", "draining", "lost", "gone"})

# Fixed constraint names so that the migration, the models and a later downgrade agree on them
# on both databases (SQLite otherwise leaves constraints unnamed).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {float: sa.Double(), dict[str, Any]: sa.JSON(), list[str]: sa.JSON()}


class Request(Base):
    """The latest known state of one request (one row per request id)."""

    __tablename__ = "requests"

    request_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    # Nullable: a request rejected as invalid may have no parseable model or sizes.
    model: Mapped[str | None] = mapped_column(sa.String(256))
    slo_class: Mapped[str | None] = mapped_column(sa.String(64))
    tenant: Mapped[str | None] = mapped_column(sa.String(128))
    priority: Mapped[int | None]
    prompt_tokens: Mapped[int | None]
    max_tokens: Mapped[int | None]
    submitted_at: Mapped[float | None]
    queued_at: Mapped[float | None]
    deadline: Mapped[float | None]
    ttft_deadline: Mapped[float | None]
    status: Mapped[str] = mapped_column(sa.String(32), index=True)
    instance_id: Mapped[str | None] = mapped_column(sa.String(128))
    attempts: Mapped[int] = mapped_column(server_default=sa.text("0"))
    started_at: Mapped[float | None]
    first_token_at: Mapped[float | None]
    finished_at: Mapped[float | None]
    output_tokens: Mapped[int | None]
    slo_met: Mapped[bool | None]
    error_code: Mapped[str | None] = mapped_column(sa.String(64))
    updated_at: Mapped[float]


class RequestEvent(Base):
    """One status transition of a request; ordered by ``id`` this is the request's history."""

    __tablename__ = "request_events"

    # 64-bit: at a few thousand events/s a 32-bit id would run out within a week. SQLite only
    # auto-increments an INTEGER PRIMARY KEY (which is 64-bit there), hence the variant.
    id: Mapped[int] = mapped_column(
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True
    )
    request_id: Mapped[str] = mapped_column(
        sa.String(128), sa.ForeignKey("requests.request_id", ondelete="CASCADE"), index=True
    )
    status: Mapped[str] = mapped_column(sa.String(32))
    at: Mapped[float]
    instance_id: Mapped[str | None] = mapped_column(sa.String(128))
    detail: Mapped[dict[str, Any] | None]


class Instance(Base):
    """An engine instance (one vLLM/sim server on one GPU set) as the coordinator last saw it."""

    __tablename__ = "instances"

    instance_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    agent_id: Mapped[str] = mapped_column(sa.String(128))
    engine: Mapped[str] = mapped_column(sa.String(32))
    gpu_type: Mapped[str] = mapped_column(sa.String(64))
    gpu_memory_gb: Mapped[float]
    models: Mapped[list[str]]
    kv_capacity_tokens: Mapped[int]
    max_batch_size: Mapped[int]
    status: Mapped[str] = mapped_column(sa.String(16))
    registered_at: Mapped[float]
    last_seen: Mapped[float]


class Plan(Base):
    """One planner run: which policy, how long it took, and what it decided (summary)."""

    __tablename__ = "plans"

    plan_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    policy: Mapped[str] = mapped_column(sa.String(64))
    created_at: Mapped[float] = mapped_column(index=True)
    duration_s: Mapped[float]
    n_requests: Mapped[int]
    n_instances: Mapped[int]
    summary: Mapped[dict[str, Any]]


class EngineProfile(Base):
    """Performance parameters of one model on one GPU type, from one source (measured, table)."""

    __tablename__ = "engine_profiles"
    __table_args__ = (
        sa.UniqueConstraint("gpu_type", "model", "source", name="uq_engine_profiles_key"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    gpu_type: Mapped[str] = mapped_column(sa.String(64))
    model: Mapped[str] = mapped_column(sa.String(256))
    source: Mapped[str] = mapped_column(sa.String(64))
    params: Mapped[dict[str, Any]]
    measured_at: Mapped[float]


class HardwareProfileRun(Base):
    """One ``qlm profile run``: the measured profile of a model on a GPU type through one
    engine backend (the profile JSON the simulator loads, with its USL fit and raw
    measurements). Every run is kept (history); the newest per (gpu_type, model) is the latest.
    ``engine_profiles`` holds only the profile in use per source."""

    __tablename__ = "hardware_profiles"
    __table_args__ = (sa.Index("ix_hardware_profiles_lookup", "gpu_type", "model", "created_at"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    gpu_type: Mapped[str] = mapped_column(sa.String(64))
    model: Mapped[str] = mapped_column(sa.String(256))
    engine: Mapped[str] = mapped_column(sa.String(32))
    created_at: Mapped[float]
    body: Mapped[dict[str, Any]]


class Answer(Base):
    """The one reply a request got, written (committed) *before* the reply is published and
    the request's delivery acked. After any coordinator restart a redelivered copy of the
    request, a producer's re-publish of its id, or a result left in the control queue finds
    this row: the stored reply is sent again under the same ``reply_id`` (which clients drop
    as a copy) instead of running the request and answering a second time."""

    __tablename__ = "answers"

    request_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    reply_id: Mapped[str] = mapped_column(sa.String(64))
    # the tenant it was answered for: a copy from another tenant is never shown this reply
    tenant: Mapped[str | None] = mapped_column(sa.String(128))
    kind: Mapped[str] = mapped_column(sa.String(16))  # "result" | "error"
    body: Mapped[str] = mapped_column(sa.Text())  # the reply message's JSON, as published
    answered_at: Mapped[float] = mapped_column(index=True)


# --- the OpenAI Batch API (qlm/gateway/batches.py, qlm/store/batches.py) ------------------------


class StoredFile(Base):
    """A file of the Files API: an upload (``purpose`` batch; its bytes in a body store,
    qlm/store/batches.py) or a batch's output or error file (``batch_id`` set; its lines are the
    batch's answered lines, rendered from ``batch_lines`` when read)."""

    __tablename__ = "files"
    __table_args__ = (sa.Index("ix_files_tenant_created", "tenant", "created_at"),)

    file_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.String(128))  # "" is the default tenant
    purpose: Mapped[str] = mapped_column(sa.String(32))
    filename: Mapped[str] = mapped_column(sa.String(256))
    bytes: Mapped[int] = mapped_column(sa.BigInteger())
    lines: Mapped[int]
    created_at: Mapped[float]
    # "upload" | "output" | "error": where the content comes from
    kind: Mapped[str] = mapped_column(sa.String(16))
    batch_id: Mapped[str | None] = mapped_column(sa.String(64))


class FileBody(Base):
    """An uploaded file's bytes, for the database body store (the default one)."""

    __tablename__ = "file_bodies"

    file_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    body: Mapped[bytes] = mapped_column(sa.LargeBinary())


class Batch(Base):
    """One batch of the Batch API: OpenAI's batch object, plus the lease of the gateway
    replica whose runner publishes its lines (one at a time per batch, across replicas)."""

    __tablename__ = "batches"
    __table_args__ = (
        sa.Index("ix_batches_tenant_created", "tenant", "created_at"),
        sa.Index("ix_batches_status", "status"),
    )

    batch_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.String(128))
    input_file_id: Mapped[str] = mapped_column(sa.String(64))
    endpoint: Mapped[str] = mapped_column(sa.String(64))
    completion_window: Mapped[str] = mapped_column(sa.String(16))
    window_s: Mapped[float]
    meta: Mapped[dict[str, Any] | None]
    status: Mapped[str] = mapped_column(sa.String(16))
    errors: Mapped[dict[str, Any] | None]
    output_file_id: Mapped[str | None] = mapped_column(sa.String(64))
    error_file_id: Mapped[str | None] = mapped_column(sa.String(64))
    total: Mapped[int]
    created_at: Mapped[float]
    expires_at: Mapped[float]
    in_progress_at: Mapped[float | None]
    finalizing_at: Mapped[float | None]
    completed_at: Mapped[float | None]
    failed_at: Mapped[float | None]
    expired_at: Mapped[float | None]
    cancelling_at: Mapped[float | None]
    cancelled_at: Mapped[float | None]
    lease_owner: Mapped[str | None] = mapped_column(sa.String(128))
    lease_until: Mapped[float | None]


class BatchLine(Base):
    """One line of a batch's input file and what became of it: ``pending`` (to publish),
    ``published`` (on the queue as ``request_id``), then exactly one of ``done`` (its output
    line in ``output``, for the output file), ``failed`` (its line for the error file) or
    ``cancelled`` (never answered: the batch was cancelled first). The primary key and the
    unique ``custom_id`` make each line answered at most once whatever replies come."""

    __tablename__ = "batch_lines"
    __table_args__ = (
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
        sa.Index("ix_batch_lines_state", "batch_id", "state"),
    )

    batch_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    line_no: Mapped[int] = mapped_column(primary_key=True)
    custom_id: Mapped[str | None] = mapped_column(sa.String(512))
    state: Mapped[str] = mapped_column(sa.String(16))
    # a retry after `overloaded` is a new request id (the first id's answer is recorded)
    attempt: Mapped[int] = mapped_column(server_default=sa.text("0"))
    not_before: Mapped[float | None]
    request: Mapped[str | None] = mapped_column(sa.Text())  # the RequestMessage JSON
    output: Mapped[str | None] = mapped_column(sa.Text())  # the output or error file line
    done_at: Mapped[float | None]
