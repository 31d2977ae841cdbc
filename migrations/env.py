"""Alembic environment for the qlm state store (async engines: aiosqlite and asyncpg).

Where the database URL comes from, first match wins:
1. ``config.attributes["connection"]``: a sync Connection handed over by a caller that already
   holds one (``AsyncConnection.run_sync``); then no engine is created here.
2. ``sqlalchemy.url`` set programmatically (``qlm.store.migrate(url)`` does this).
3. ``QLM_DATABASE_URL`` (via ``qlm.config.Settings``, which also supplies the default
   ``sqlite+aiosqlite:///.qlm/qlm.db``).
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from qlm.config import Settings
from qlm.store.migrations import prepare_sqlite_path
from qlm.store.models import Base

config = context.config

# Only the alembic CLI configures logging from the ini file; a process that migrates
# programmatically (the coordinator) keeps its own structlog/stdlib setup untouched.
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    return url if url else Settings().database_url


def run_migrations_offline() -> None:
    """Emit SQL to stdout (``alembic upgrade head --sql``) instead of running it."""
    url = database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def do_run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_async_migrations() -> None:
    url = database_url()
    prepare_sqlite_path(url)
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    shared = config.attributes.get("connection")
    if shared is not None:
        do_run_migrations(shared)
    else:
        asyncio.run(run_async_migrations())


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
