"""The chaos scenarios of the outside attack (issue 20), over real processes: the lone
coordinator SIGKILLed and restarted with no standby, and hostile AMQP messages under load.
Both must lose nothing and answer nothing twice (the full runs: `qlm chaos`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qlm.tooling.chaos import ChaosSettings, run_chaos, select
from qlm.tooling.chaos.security import hostile_messages


def test_the_hostile_set_covers_every_property_and_parser_bomb() -> None:
    kinds = hostile_messages("p")
    refused = [key for _, _, key, refuse in kinds if refuse]
    assert len(refused) == len(set(refused)) == len(kinds) - 1  # one valid, forged headers
    names = {key.decode().removeprefix("p-") for key in refused}
    for prop in ("message_id", "correlation_id", "content_type", "type", "app_id", "reply_to"):
        assert f"prop-{prop}" in names
    for bomb in ("deep", "bigint", "surrogate", "nan", "inf", "future", "huge-slo"):
        assert f"body-{bomb}" in names


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.parametrize("name", ["coordinator-restart", "hostile-properties"])
async def test_attack_scenario_loses_nothing_and_answers_once(
    name: str, tmp_path: Path, amqp_url: str
) -> None:
    settings = ChaosSettings(workdir=tmp_path)
    [result] = await run_chaos(select([name]), settings, amqp_url)
    assert result.error is None, result
    assert result.sent == settings.requests and result.in_flight_at_fault >= 1000, result
    assert result.lost == 0 and result.duplicates == 0 and result.errors == 0, result
    if result.target_recovery_s is not None:
        assert result.recovery_s is not None and result.recovery_s <= result.target_recovery_s
