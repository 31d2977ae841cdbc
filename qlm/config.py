"""Settings shared by every qlm process, read from ``QLM_*`` environment variables."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QLM_", extra="ignore")

    amqp_url: str = Field(
        default="amqp://guest:guest@127.0.0.1:5672/",
        description="broker URL (`qlm demo` starts a private one when QLM_AMQP_URL is unset)",
    )
    database_url: str = "sqlite+aiosqlite:///.qlm/qlm.db"
    admin_token: SecretStr | None = None
    admin_host: str = "127.0.0.1"
    admin_port: int = 8080
    shards: int = Field(default=2, ge=1, le=64, description="global queue shards")
    prefetch_per_shard: int = Field(default=65535, ge=1, le=65535)
    delivery_limit: int = Field(default=20, ge=1)
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    policy: str = "qlm"  # the stochastic planner; fcfs, edf, shepherd, ... also registered
    # which of the plan's LSO decisions the coordinator carries out (policies that make them)
    lso_eviction: bool = True
    lso_warm_start: bool = True
    # Overload control: requests the coordinator tracks (queued or running, not yet answered)
    # at most, in all and per tenant (requests without a tenant share the tenant ""); beyond
    # that a new request gets an `overloaded` error reply. None: no limit.
    max_queued: int | None = Field(default=None, ge=1)
    max_queued_per_tenant: int | None = Field(default=None, ge=1)
    # JSON object, tenant -> its own limit, overriding QLM_MAX_QUEUED_PER_TENANT; 0 refuses
    # every request of that tenant
    tenant_limits: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    models_file: str | None = None
    log_level: str = "info"
    log_format: str = Field(default="json", pattern="^(json|console)$")
