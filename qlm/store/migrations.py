"""Run the store's Alembic migrations from code, and locate them.

The migration tree lives in ``migrations/`` at the repository root and is installed as the
package ``qlm.migrations`` (in a checkout, ``qlm/migrations`` links to it).
``QLM_MIGRATIONS_DIR`` points elsewhere, e.g. in a container image that copies the tree.
"""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url


def migrations_dir() -> Path:
    override = os.environ.get("QLM_MIGRATIONS_DIR")
    path = Path(override) if override else Path(__file__).resolve().parents[1] / "migrations"
    if not (path / "alembic.ini").is_file():
        raise FileNotFoundError(
            f"no alembic.ini in {path}; set QLM_MIGRATIONS_DIR to the qlm migrations/ directory"
        )
    return path


def alembic_config(url: str) -> Config:
    """An Alembic Config for the packaged migrations, aimed at ``url``, not touching logging."""
    directory = migrations_dir()
    cfg = Config(str(directory / "alembic.ini"))
    cfg.set_main_option("script_location", str(directory))
    # ConfigParser interpolation treats '%' specially; URL-encoded passwords contain it.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg


def prepare_sqlite_path(url: str) -> None:
    """Create the parent directory of a file-backed SQLite database (``.qlm/`` by default)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return
    database = parsed.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def migrate(url: str) -> None:
    """Upgrade the database at ``url`` to the newest schema (``alembic upgrade head``).

    Synchronous: the async env.py runs its own event loop, so call it from async code with
    ``await asyncio.to_thread(migrate, url)``.
    """
    prepare_sqlite_path(url)
    command.upgrade(alembic_config(url), "head")
