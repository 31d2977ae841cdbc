"""The ``qlm gateway`` command. ``qlm/cli.py`` calls :func:`register` to add it."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

if TYPE_CHECKING:  # the command imports the app lazily: `qlm --help` stays fast
    from pydantic_settings import BaseSettings

    from qlm.catalog import ModelCatalog
    from qlm.gateway.app import ApiKeys, GatewaySettings
    from qlm.gateway.batches import BatchSettings

_S = TypeVar("_S", bound="BaseSettings")


def _load(cls: type[_S], prefix: str) -> _S:
    """Settings from the environment, or one line per bad variable and exit status 2 (the
    values themselves are not echoed: QLM_GATEWAY_API_KEYS is a secret)."""
    from pydantic import ValidationError

    try:
        return cls()
    except ValidationError as exc:
        for err in exc.errors(include_input=False, include_url=False):
            where = ".".join(str(p) for p in err["loc"])
            msg = str(err["msg"]).removeprefix("Value error, ")
            name = f"{prefix}{where.upper()}" if where else "settings"
            typer.echo(f"qlm: {name}: {msg}", err=True)
        raise typer.Exit(2) from None


def register(app: typer.Typer) -> None:
    """Add the ``gateway`` command to the qlm CLI."""

    @app.command("gateway")
    def gateway(
        host: Annotated[
            str | None, typer.Option(help="listen address (QLM_GATEWAY_HOST, 127.0.0.1)")
        ] = None,
        port: Annotated[
            int | None, typer.Option(help="listen port (QLM_GATEWAY_PORT, 8000)")
        ] = None,
    ) -> None:
        """OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) onto
        the durable queue. API keys: QLM_GATEWAY_API_KEYS or QLM_GATEWAY_API_KEYS_FILE (JSON,
        key -> tenant; the file is read again when it changes, and on SIGHUP). See
        docs/gateway.md."""
        from qlm.config import Settings
        from qlm.gateway.app import ApiKeys, GatewaySettings
        from qlm.gateway.batches import BatchSettings
        from qlm.logging import configure_logging
        from qlm.model_config import ModelConfigError, load_catalog, split_model_configs

        s = _load(Settings, "QLM_")
        gs = _load(GatewaySettings, "QLM_GATEWAY_")
        bs = _load(BatchSettings, "QLM_GATEWAY_")
        configure_logging(s.log_level, s.log_format, "gateway")
        try:
            keys = ApiKeys.from_settings(gs)
        except ValueError as exc:
            typer.echo(f"qlm: {exc}", err=True)
            raise typer.Exit(2) from None
        try:
            # The coordinator's catalog, read the same way (QLM_MODELS_FILE, QLM_MODEL_CONFIGS),
            # so the gateway knows every model the coordinator accepts.
            catalog = load_catalog(s.models_file, split_model_configs(s.model_configs))
        except ModelConfigError as exc:
            typer.echo(f"qlm: {exc}", err=True)
            raise typer.Exit(2) from None
        # the Batch API's database: its own, or the coordinator's (QLM_DATABASE_URL)
        batch_db = (bs.database_url or s.database_url) if bs.batch_api else None
        asyncio.run(_run(s.amqp_url, catalog, keys, gs, host, port, batch_db, bs))


async def _run(
    amqp_url: str,
    catalog: ModelCatalog,
    keys: ApiKeys,
    settings: GatewaySettings,
    host: str | None,
    port: int | None,
    batch_database_url: str | None = None,
    batch_settings: BatchSettings | None = None,
) -> None:
    from qlm.gateway.app import serve_gateway
    from qlm.heap import freeze_startup_heap

    server = await serve_gateway(
        amqp_url,
        keys=keys,
        catalog=catalog,
        settings=settings,
        host=host,
        port=port,
        batch_database_url=batch_database_url,
        batch_settings=batch_settings,
    )
    freeze_startup_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # `kill -HUP`: read QLM_GATEWAY_API_KEYS_FILE now (rotated keys), not at the next check
    loop.add_signal_handler(signal.SIGHUP, server.reload_keys)
    try:
        await stop.wait()
    finally:
        await server.stop()
