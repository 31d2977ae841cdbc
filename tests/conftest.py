"""Shared fixtures: a real RabbitMQ and a real PostgreSQL for the whole session.

``QLM_AMQP_URL`` / ``QLM_POSTGRES_URL`` select external servers; otherwise the private local
ones are started on first use and stopped at the end of the session (unless they were already
running before it). Per-test isolation: ``isolated_amqp_url`` (own vhost) and
``isolated_postgres_url`` (own database). The helpers live in :mod:`qlm.tooling.localbroker`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from qlm.tooling import localbroker


@pytest.fixture(scope="session")
def amqp_url() -> Iterator[str]:
    with localbroker.session_broker() as url:
        yield url


@pytest.fixture
def isolated_amqp_url(amqp_url: str) -> Iterator[str]:
    """AMQP URL of a fresh vhost, deleted (with its queues) after the test."""
    with localbroker.isolated_vhost(amqp_url) as url:
        yield url


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    with localbroker.session_postgres() as url:
        yield url


@pytest.fixture
def isolated_postgres_url(postgres_url: str) -> Iterator[str]:
    """URL of a fresh, empty database, dropped after the test."""
    with localbroker.isolated_database(postgres_url) as url:
        yield url
