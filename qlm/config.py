"""Settings shared by every qlm process, read from ``QLM_*`` environment variables."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal, Self
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    # hide_input_in_errors: a bad URL or token must not reach an error message or a log
    model_config = SettingsConfigDict(env_prefix="QLM_", extra="ignore", hide_input_in_errors=True)

    amqp_url: str = Field(
        default="amqp://guest:guest@127.0.0.1:5672/",
        description="broker URL (`qlm demo` starts a private one when QLM_AMQP_URL is unset)",
    )
    # the state store (SQLAlchemy URL): SQLite for one host, PostgreSQL for a cluster
    database_url: str = "sqlite+aiosqlite:///.qlm/qlm.db"
    # the admin API's bearer token (required by `qlm coordinator`; `qlm admin` sends it)
    admin_token: SecretStr | None = None
    # optional second token that may only read (GET) the admin API
    admin_read_token: SecretStr | None = None
    # HTTPS for the admin API: a PEM certificate (chain) and its key, both or neither
    admin_tls_cert: str | None = None
    admin_tls_key: str | None = None
    # where the coordinator serves the admin API (and where `qlm admin` looks by default)
    admin_host: str = "127.0.0.1"
    admin_port: int = 8080
    shards: int = Field(default=2, ge=1, le=64, description="global queue shards")
    # unacked deliveries the coordinator holds per shard (its view of the backlog)
    prefetch_per_shard: int = Field(default=65535, ge=1, le=65535)
    # deliveries of one message before the broker dead-letters it (poison messages); a request
    # taken in is refreshed at half of it, so connection losses alone do not wear it out
    delivery_limit: int = Field(default=20, ge=1)
    # largest request body accepted (bytes); larger ones are refused with an error reply
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    # agents send a heartbeat this often; an instance silent for the timeout is lost
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    policy: str = "qlm"  # the stochastic planner; fcfs, edf, shepherd, ... also registered
    # which of the plan's LSO decisions the coordinator carries out (policies that make them);
    # eviction is off by default: it never paid in the ablations (docs/benchmarks.md)
    lso_eviction: bool = False
    lso_warm_start: bool = True
    # the plan's batch caps: agents keep fewer requests in an engine while latency-bound work
    # needs the faster decode of a smaller batch (docs/planner.md, "Batch caps")
    lso_batch_cap: bool = True
    # Overload control: requests the coordinator tracks (queued or running, not yet answered)
    # at most, in all and per tenant (requests without a tenant share the tenant ""); beyond
    # that a new request gets an `overloaded` error reply. None: no limit.
    max_queued: int | None = Field(default=None, ge=1)
    max_queued_per_tenant: int | None = Field(default=None, ge=1)
    # JSON object, tenant -> its own limit, overriding QLM_MAX_QUEUED_PER_TENANT; 0 refuses
    # every request of that tenant
    tenant_limits: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    # more models than the built-ins (docs/engine-model.md, "Adding models"): a models file
    # (JSON list, or one model directory / config.json), and comma-separated NAME=PATH (or
    # PATH) Hugging Face model directories whose config.json describes the model
    models_file: str | None = None
    model_configs: str | None = None
    # a YAML/JSON GPU table over the shipped qlm/data/gpus.yaml (more GPU types, other figures)
    gpu_table: str | None = None
    # a request for a model no live agent serves: answered `model_not_served` at once (0), or
    # held this long first for an agent to come up (scale from zero); docs/protocol.md
    unserved_model_hold_s: float = Field(default=0.0, ge=0)
    # after the coordinator starts, agents need a heartbeat or two to register: requests for
    # models not yet seen wait this long rather than being refused (default: the heartbeat
    # timeout, by which every live agent has been heard from)
    unserved_model_grace_s: float | None = Field(default=None, ge=0)
    # a task-chain call that arrives after its derived deadline: "promote" it (CATO: keep the
    # passed deadline, top priority) or "demote" it to best effort (SABER); qlm/chains.py
    late_task_rule: Literal["promote", "demote"] = "promote"
    # what the qlm planner maximises (docs/planner.md): requests meeting their SLO, or the
    # service gain of those requests (Tempo)
    planner_objective: Literal["attainment", "service-gain"] = "attainment"
    # the qlm planner's batch caps keep at least this share of an instance's full-batch
    # throughput (docs/planner.md, "Batch caps"); 1 never caps
    planner_cap_throughput_min: float = Field(default=0.98, gt=0, le=1)
    # the qlm planner keeps work whose decode takes most of its SLO apart from work with
    # minutes to spare while the fleet is below capacity (docs/planner.md, "Class lanes")
    planner_class_lanes: bool = True
    # the qlm planner improves the group plan (local search, MILP) also where every queued
    # request is of one model; off: 40-75 % less planner time there, at up to 2 points of
    # attainment (docs/planner.md, section 5, "One model")
    planner_improve_one_model: bool = True
    # the batch tier (docs/architecture.md): requests with ≥ batch_min_slack_s to their
    # deadline wait in the durable queue for spare capacity or their promotion time
    batch_tier: bool = True
    batch_min_slack_s: float = Field(default=3600.0, gt=0)
    batch_release_below: float = Field(default=0.6, ge=0, le=1)
    batch_release_two_below: float = Field(default=0.5, ge=0, le=1)
    batch_promote_after: float = Field(default=10.0 / 24.0, ge=0, le=1)
    # the live autoscaler (docs/capacity.md): off unless a policy is named; without a
    # command it runs dry (decisions logged, shown on GET /v1/capacity and in metrics)
    autoscale_policy: Literal["reactive", "cato", "lt-i", "lt-u", "lt-ua"] | None = None
    capacity_spec: Path | None = None  # YAML/JSON: pool, GPU prices, per-model profiles
    autoscale_command: str | None = None  # the operator's program (shell words, no shell)
    autoscale_interval_s: float = Field(default=15.0, gt=0)
    autoscale_timeout_s: float = Field(default=60.0, gt=0)
    # where a request's tenant comes from: the body's `tenant` field, or the broker-verified
    # AMQP user_id (replies then only to direct reply-to or qlm.reply.<tenant>.*); see the
    # threat model in docs/reliability.md
    producer_identity: Literal["body", "broker"] = "body"
    # how long the durable answer record keeps each reply (exactly once across restarts)
    answer_retention_s: float = Field(default=7 * 86400.0, gt=0)
    # structlog level (debug, info, warning, error) and format of every service's logs
    log_level: str = "info"
    log_format: str = Field(default="json", pattern="^(json|console)$")
    # a garbage-collector pass that stops the coordinator or an agent longer than this is
    # logged (gc_pause, a warning); 0 turns it off. Young-generation passes take well under it.
    gc_pause_warn_ms: float = Field(default=50.0, ge=0)
    # the agent's health port: GET /healthz, /readyz and /metrics (docs/metrics.md); 0 turns
    # it off. 0.0.0.0 so that the kubelet's probes and Prometheus reach it in a pod.
    agent_health_port: int = Field(default=9400, ge=0, le=65535)
    # the address the agent's health port binds: every interface by default, since probes and
    # scrapes come from outside the pod
    agent_health_host: str = "0.0.0.0"  # noqa: S104

    @field_validator("amqp_url")
    @classmethod
    def _broker_urls(cls, value: str) -> str:
        from qlm.amqp import split_urls

        for url in split_urls(value):  # ValueError names the bad entry, password masked
            parts = urlsplit(url)
            # RabbitMQ's guest user only logs in over loopback: anywhere else it is either
            # refused or, worse, enabled on purpose. Require real credentials off localhost.
            if unquote(parts.username or "guest") == "guest" and not _is_loopback(
                parts.hostname or ""
            ):
                raise ValueError(
                    f"broker host {parts.hostname!r} is not local: QLM_AMQP_URL must name a "
                    "user other than guest (guest is for local development only)"
                )
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> Self:
        if (self.admin_tls_cert is None) != (self.admin_tls_key is None):
            raise ValueError("QLM_ADMIN_TLS_CERT and QLM_ADMIN_TLS_KEY go together: set both")
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
