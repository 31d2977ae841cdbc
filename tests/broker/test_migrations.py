"""The Alembic tree in migrations/ against real SQLite files and a real PostgreSQL.

Each PostgreSQL test gets its own freshly created database on the session's cluster
(``postgres_url``), dropped afterwards, so tests do not see each other's tables.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from qlm.store import Base, migrate, migrations_dir
from qlm.store.migrations import alembic_config

TABLES = {"requests", "request_events", "instances", "plans", "engine_profiles"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/qlm.db"
        return
    async with fresh_postgres_database(request.getfixturevalue("postgres_url")) as url:
        yield url


class fresh_postgres_database:  # noqa: N801 - used like a function: `async with fresh_...(url)`
    """CREATE DATABASE qlm_test_<random> on the cluster of ``base_url``; DROP it on exit."""

    def __init__(self, base_url: str) -> None:
        self._base = make_url(base_url)
        self._name = f"qlm_test_{uuid.uuid4().hex[:12]}"

    def _dsn(self, database: str) -> str:
        return self._base.set(drivername="postgresql", database=database).render_as_string(
            hide_password=False
        )

    async def __aenter__(self) -> str:
        conn = await asyncpg.connect(self._dsn(self._base.database or "postgres"))
        try:
            await conn.execute(f'CREATE DATABASE "{self._name}"')
        finally:
            await conn.close()
        return self._base.set(database=self._name).render_as_string(hide_password=False)

    async def __aexit__(self, *exc: object) -> None:
        conn = await asyncpg.connect(self._dsn(self._base.database or "postgres"))
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{self._name}" WITH (FORCE)')
        finally:
            await conn.close()


async def _inspect(url: str) -> dict[str, Any]:
    """Tables and the stamped revision, read through a fresh engine."""
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:

            def read(sync_conn: sa.Connection) -> dict[str, Any]:
                tables = set(sa.inspect(sync_conn).get_table_names())
                revision = MigrationContext.configure(sync_conn).get_current_revision()
                return {"tables": tables, "revision": revision}

            return await conn.run_sync(read)
    finally:
        await engine.dispose()


async def test_upgrade_downgrade_upgrade(db_url: str) -> None:
    head = ScriptDirectory.from_config(alembic_config(db_url)).get_current_head()
    assert head is not None

    await asyncio.to_thread(migrate, db_url)
    state = await _inspect(db_url)
    assert state["tables"] >= TABLES
    assert state["revision"] == head

    await asyncio.to_thread(command.downgrade, alembic_config(db_url), "base")
    state = await _inspect(db_url)
    assert not (TABLES & state["tables"])
    assert state["revision"] is None

    await asyncio.to_thread(migrate, db_url)
    state = await _inspect(db_url)
    assert state["tables"] >= TABLES
    assert state["revision"] == head

    # Idempotent: a second upgrade on an up-to-date database changes nothing.
    await asyncio.to_thread(migrate, db_url)
    assert (await _inspect(db_url))["revision"] == head


async def test_models_match_the_migrations(db_url: str) -> None:
    await asyncio.to_thread(migrate, db_url)
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as conn:
            diff = await conn.run_sync(
                lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata)
            )
    finally:
        await engine.dispose()
    assert diff == []


async def test_migrate_creates_the_sqlite_parent_directory(tmp_path: Path) -> None:
    db = tmp_path / "a" / "b" / "qlm.db"
    await asyncio.to_thread(migrate, f"sqlite+aiosqlite:///{db}")
    assert db.is_file()
    assert (await _inspect(f"sqlite+aiosqlite:///{db}"))["tables"] >= TABLES


def test_migrations_dir_can_be_overridden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # through the qlm/migrations link, as the installed package qlm.migrations
    assert migrations_dir().resolve() == (REPO / "migrations").resolve()
    monkeypatch.setenv("QLM_MIGRATIONS_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="QLM_MIGRATIONS_DIR"):
        migrations_dir()
    monkeypatch.setenv("QLM_MIGRATIONS_DIR", str(REPO / "migrations"))
    assert migrations_dir() == REPO / "migrations"


def test_alembic_cli_takes_the_url_from_qlm_database_url(tmp_path: Path) -> None:
    """The documented command: `alembic -c migrations/alembic.ini upgrade head`, relative URL."""
    env = {**os.environ, "QLM_DATABASE_URL": "sqlite+aiosqlite:///.qlm/qlm.db"}
    alembic = Path(sys.executable).with_name("alembic")
    ini = REPO / "migrations" / "alembic.ini"
    proc = subprocess.run(
        [str(alembic), "-c", str(ini), "upgrade", "head"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Running upgrade  -> 0001" in proc.stderr
    db = tmp_path / ".qlm" / "qlm.db"
    assert db.is_file()
    assert asyncio.run(_inspect(f"sqlite+aiosqlite:///{db}"))["tables"] >= TABLES
