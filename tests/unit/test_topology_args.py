"""The shards' consumer timeout argument: what is declared, and the upgrade path from shards
created without it (the broker side is in tests/broker/test_topology.py)."""

from __future__ import annotations

from typing import Any

import aiormq
import pytest

from qlm.topology import CONSUMER_TIMEOUT_ARG, CONSUMER_TIMEOUT_MS, broker_version, shard_arguments

BASE = {"x-queue-type": "quorum", "x-delivery-limit": 20}


class Broker:
    """Queues by name with the arguments they were created with; like RabbitMQ >= 3.12, a
    redeclaration with different arguments is refused."""

    def __init__(self, existing: dict[str, dict[str, Any]]) -> None:
        self.queues = dict(existing)

    async def declare(self, name: str, arguments: dict[str, Any]) -> None:
        current = self.queues.setdefault(name, dict(arguments))
        for key in sorted(set(current) | set(arguments)):
            if current.get(key) != arguments.get(key):
                raise aiormq.exceptions.ChannelPreconditionFailed(
                    f"PRECONDITION_FAILED - inequivalent arg '{key}' for queue '{name}'"
                )


async def test_a_new_shard_gets_the_consumer_timeout() -> None:
    broker = Broker({})
    args = await shard_arguments(broker.declare, "qlm.global.0", BASE)
    assert args == {**BASE, CONSUMER_TIMEOUT_ARG: CONSUMER_TIMEOUT_MS}
    assert broker.queues["qlm.global.0"] == args
    assert CONSUMER_TIMEOUT_MS == 7 * 24 * 3600 * 1000


async def test_a_shard_created_without_it_is_declared_as_it_is() -> None:
    broker = Broker({"qlm.global.0": dict(BASE)})
    args = await shard_arguments(broker.declare, "qlm.global.0", BASE)
    assert args == BASE  # so the caller's own declaration succeeds
    assert broker.queues["qlm.global.0"] == BASE


async def test_any_other_mismatch_still_fails() -> None:
    """Whichever mismatch the broker names first, declaring the shard as declare_topology does
    (probe, then declare with what the probe chose) fails on the changed delivery limit."""
    broker = Broker({"qlm.global.0": {**BASE, "x-delivery-limit": 5}})
    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed, match="x-delivery-limit"):
        args = await shard_arguments(broker.declare, "qlm.global.0", BASE)
        await broker.declare("qlm.global.0", args)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"3.10.8", (3, 10, 8)),
        ("3.13.7", (3, 13, 7)),
        ("4.1.0+2-g1234", (4, 1, 0)),
        ("3.12", (3, 12, 0)),
        ("unknown", None),
        (None, None),
    ],
)
def test_broker_version(raw: object, expected: tuple[int, ...] | None) -> None:
    assert broker_version({"version": raw} if raw is not None else {}) == expected
