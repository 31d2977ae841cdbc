"""Private local infrastructure for the demo, the tests and CI.

Thin wrappers around ``scripts/rabbitmq-local.sh`` and ``scripts/postgres-local.sh``, which
start a RabbitMQ node and a PostgreSQL cluster owned by this checkout (state under
``$QLM_HOME``, default ``<repo>/.qlm``), plus helpers that give each test its own RabbitMQ
vhost or PostgreSQL database so tests never see each other's queues or tables.

An externally managed broker or database always wins: ``QLM_AMQP_URL`` / ``QLM_POSTGRES_URL``
are returned unchanged and nothing local is started or stopped.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urlsplit

import httpx
import structlog

log = structlog.get_logger(__name__)

AMQP_URL_ENV = "QLM_AMQP_URL"
POSTGRES_URL_ENV = "QLM_POSTGRES_URL"
MANAGEMENT_URL_ENV = "QLM_MANAGEMENT_URL"
REPO_ROOT_ENV = "QLM_REPO_ROOT"

RABBITMQ_SCRIPT = "scripts/rabbitmq-local.sh"
POSTGRES_SCRIPT = "scripts/postgres-local.sh"

# `up` may have to apt-get install the server first on a fresh machine.
_UP_TIMEOUT_S = 900.0
_DOWN_TIMEOUT_S = 120.0
_STATUS_TIMEOUT_S = 30.0

T = TypeVar("T")


class LocalInfraError(RuntimeError):
    """A local broker/database could not be located, started or configured."""


def repo_root() -> Path:
    """The checkout holding ``scripts/``: ``$QLM_REPO_ROOT``, else the one this package is
    installed (editable) from."""
    candidates = []
    if env := os.environ.get(REPO_ROOT_ENV):
        candidates.append(Path(env))
    candidates.append(Path(__file__).resolve().parents[2])
    for root in candidates:
        if (root / RABBITMQ_SCRIPT).is_file():
            return root.resolve()
    raise LocalInfraError(
        f"cannot find {RABBITMQ_SCRIPT} (looked in {', '.join(map(str, candidates))}); "
        f"set {REPO_ROOT_ENV} to a qlm checkout, or {AMQP_URL_ENV} to an existing broker"
    )


def qlm_home() -> Path:
    """Where the local state lives (same rule as the scripts)."""
    if env := os.environ.get("QLM_HOME"):
        return Path(env).resolve()
    return repo_root() / ".qlm"


def _run_script(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # stderr is inherited so that progress and errors of the scripts stay visible.
    return subprocess.run(
        [str(repo_root() / script), *args],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=timeout,
        check=False,
    )


def _script_url(script: str, *args: str, timeout: float) -> str:
    proc = _run_script(script, *args, timeout=timeout)
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise LocalInfraError(f"{script} {' '.join(args)} failed with exit code {proc.returncode}")
    return lines[-1]


# --- RabbitMQ -------------------------------------------------------------------------------


def local_broker_running() -> bool:
    return _run_script(RABBITMQ_SCRIPT, "status", timeout=_STATUS_TIMEOUT_S).returncode == 0


def ensure_broker() -> str:
    """``$QLM_AMQP_URL`` if set, else the URL of the private local node (started if needed)."""
    if url := os.environ.get(AMQP_URL_ENV):
        return url
    url = _script_url(RABBITMQ_SCRIPT, "up", timeout=_UP_TIMEOUT_S)
    log.info("local_broker.ready", url=url)
    return url


def stop_local_broker() -> None:
    proc = _run_script(RABBITMQ_SCRIPT, "down", timeout=_DOWN_TIMEOUT_S)
    if proc.returncode != 0:
        raise LocalInfraError(f"{RABBITMQ_SCRIPT} down failed with exit code {proc.returncode}")
    log.info("local_broker.stopped")


@contextmanager
def session_broker() -> Iterator[str]:
    """Yield a broker URL; stop the local node afterwards only if this call started it."""
    if url := os.environ.get(AMQP_URL_ENV):
        yield url
        return
    was_running = local_broker_running()
    url = ensure_broker()
    try:
        yield url
    finally:
        if not was_running:
            stop_local_broker()


def management_url(amqp_url: str) -> str:
    """Base URL (``http://host:port/``) of the management HTTP API serving ``amqp_url``:
    ``$QLM_MANAGEMENT_URL``, else the local node's when ``amqp_url`` points at it, else the
    standard port 15672 on the broker's host."""
    if env := os.environ.get(MANAGEMENT_URL_ENV):
        return env.rstrip("/") + "/"
    parts = urlsplit(amqp_url)
    state = qlm_home() / "rabbitmq"
    try:
        local = urlsplit((state / "url").read_text().strip())
        if (local.hostname, local.port) == (parts.hostname, parts.port):
            return (state / "management_url").read_text().strip().rstrip("/") + "/"
    except (OSError, LocalInfraError):
        pass
    return f"http://{parts.hostname or '127.0.0.1'}:15672/"


def _credentials(amqp_url: str) -> tuple[str, str]:
    parts = urlsplit(amqp_url)
    return unquote(parts.username or "guest"), unquote(parts.password or "guest")


def vhost_url(amqp_url: str, vhost: str) -> str:
    """``amqp_url`` pointing at ``vhost`` instead of its own vhost."""
    from qlm.amqp import with_vhost

    return with_vhost(amqp_url, vhost)


def create_vhost(amqp_url: str, vhost: str) -> str:
    """Create ``vhost`` with full permissions for ``amqp_url``'s user; return its URL."""
    user, password = _credentials(amqp_url)
    name = quote(vhost, safe="")
    with httpx.Client(base_url=management_url(amqp_url), auth=(user, password)) as http:
        http.put(f"api/vhosts/{name}").raise_for_status()
        http.put(
            f"api/permissions/{name}/{quote(user, safe='')}",
            json={"configure": ".*", "write": ".*", "read": ".*"},
        ).raise_for_status()
    return vhost_url(amqp_url, vhost)


def delete_vhost(amqp_url: str, vhost: str) -> None:
    """Delete ``vhost`` with all its queues and exchanges (absent is fine)."""
    user, password = _credentials(amqp_url)
    with httpx.Client(
        base_url=management_url(amqp_url), auth=(user, password), timeout=60.0
    ) as http:
        resp = http.delete(f"api/vhosts/{quote(vhost, safe='')}")
        if resp.status_code != 404:
            resp.raise_for_status()


@contextmanager
def isolated_vhost(amqp_url: str, prefix: str = "qlm-test") -> Iterator[str]:
    """A fresh vhost for the duration of the block; yields its AMQP URL."""
    vhost = f"{prefix}-{secrets.token_hex(4)}"
    url = create_vhost(amqp_url, vhost)
    try:
        yield url
    finally:
        delete_vhost(amqp_url, vhost)


@asynccontextmanager
async def temporary_vhost(amqp_url: str, prefix: str = "qlm-tmp") -> AsyncIterator[str]:
    """Async form of :func:`isolated_vhost` (the HTTP calls run in a worker thread)."""
    vhost = f"{prefix}-{secrets.token_hex(4)}"
    url = await asyncio.to_thread(create_vhost, amqp_url, vhost)
    try:
        yield url
    finally:
        await asyncio.to_thread(delete_vhost, amqp_url, vhost)


# --- PostgreSQL -----------------------------------------------------------------------------


def local_postgres_running() -> bool:
    return _run_script(POSTGRES_SCRIPT, "status", timeout=_STATUS_TIMEOUT_S).returncode == 0


def ensure_postgres() -> str:
    """``$QLM_POSTGRES_URL`` if set, else the URL (``postgresql+asyncpg://...``) of the
    private local cluster (started if needed)."""
    if url := os.environ.get(POSTGRES_URL_ENV):
        return url
    url = _script_url(POSTGRES_SCRIPT, "up", timeout=_UP_TIMEOUT_S)
    log.info("local_postgres.ready", url=url)
    return url


def stop_local_postgres() -> None:
    proc = _run_script(POSTGRES_SCRIPT, "down", timeout=_DOWN_TIMEOUT_S)
    if proc.returncode != 0:
        raise LocalInfraError(f"{POSTGRES_SCRIPT} down failed with exit code {proc.returncode}")
    log.info("local_postgres.stopped")


@contextmanager
def session_postgres() -> Iterator[str]:
    """Yield a PostgreSQL URL; stop the local cluster afterwards only if this call started it."""
    if url := os.environ.get(POSTGRES_URL_ENV):
        yield url
        return
    was_running = local_postgres_running()
    url = ensure_postgres()
    try:
        yield url
    finally:
        if not was_running:
            stop_local_postgres()


def _run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    # Works whether or not the caller already runs an event loop (sync fixtures may be set up
    # from inside pytest-asyncio's loop): the coroutine gets its own loop in its own thread.
    result: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro))
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target, name="qlm-localbroker")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def database_url(postgres_url: str, database: str) -> str:
    """``postgres_url`` pointing at ``database`` instead of its own database."""
    return urlsplit(postgres_url)._replace(path="/" + database).geturl()


async def _admin(postgres_url: str, statement: str) -> None:
    import asyncpg  # only the PostgreSQL helpers need it

    parts = urlsplit(postgres_url)
    conn = await asyncpg.connect(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 5432,
        user=unquote(parts.username or "postgres"),
        password=unquote(parts.password) if parts.password else None,
        database=parts.path.lstrip("/") or "postgres",
    )
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@contextmanager
def isolated_database(postgres_url: str, prefix: str = "qlm_test") -> Iterator[str]:
    """A fresh, empty database for the duration of the block; yields its URL."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    _run_coroutine(_admin(postgres_url, f'CREATE DATABASE "{name}"'))
    try:
        yield database_url(postgres_url, name)
    finally:
        _run_coroutine(_admin(postgres_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
