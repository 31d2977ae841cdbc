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
