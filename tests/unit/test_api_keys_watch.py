"""Key rotation without a restart: the gateway's key file is read again when its content
changes; a file that cannot be read or holds no valid keys leaves the keys in use."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from qlm.gateway.app import GatewaySettings
from qlm.gateway.keys import ApiKeys, ApiKeysWatch

OLD = "sk-qlm-rotate-old-0123456789"
NEW = "sk-qlm-rotate-new-0123456789"
ENV = "sk-qlm-rotate-env-0123456789"


def _watch(tmp_path: Path, **env: str) -> tuple[ApiKeys, ApiKeysWatch, Path]:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({OLD: "team-a"}))
    settings = GatewaySettings(api_keys_file=path, **env)  # type: ignore[arg-type]
    keys = ApiKeys.from_settings(settings)
    return keys, ApiKeysWatch(keys, settings), path


def test_a_rotated_file_is_adopted_and_an_unchanged_one_is_not_read_again(tmp_path: Path) -> None:
    keys, watch, path = _watch(tmp_path)
    assert not watch.check() and watch.reloads == 0  # the content the keys came from
    path.write_text(json.dumps({OLD: "team-a", NEW: "team-a"}))  # the overlap
    assert watch.check() and keys.tenant_for(NEW) == "team-a" and keys.tenant_for(OLD)
    path.write_text(json.dumps({NEW: "team-a"}))  # the old key retired
    assert watch.check() and keys.tenant_for(OLD) is None and keys.tenant_for(NEW) == "team-a"
    assert not watch.check() and watch.reloads == 2


def test_a_bad_file_keeps_the_keys_in_use_and_is_logged_once_without_keys(
    tmp_path: Path,
) -> None:
    keys, watch, path = _watch(tmp_path)
    with capture_logs() as logs:
        path.write_text(json.dumps({NEW: "team-a"})[:-3])  # half written: not JSON
        assert not watch.check() and not watch.check()
        path.write_text(json.dumps({"tiny-k3y": "team-a"}))  # an invalid key
        assert not watch.check()
        path.write_text(json.dumps({}))  # no key at all: every client would be locked out
        assert not watch.check()
        path.unlink()  # gone: the keys in use stay
        assert not watch.check() and not watch.check()
    assert keys.tenant_for(OLD) == "team-a" and keys.tenant_for(NEW) is None
    events = [e["event"] for e in logs]
    assert events == [
        "api_keys_reload_refused",  # once for the half-written content, not per check
        "api_keys_reload_refused",
        "api_keys_reload_refused",
        "api_keys_file_unreadable",  # once
    ]
    assert all(NEW not in str(e) and "tiny-k3y" not in str(e) for e in logs)
    path.write_text(json.dumps({NEW: "team-b"}))  # fixed: adopted
    assert watch.check() and keys.tenant_for(NEW) == "team-b" and keys.tenant_for(OLD) is None


def test_the_variable_s_keys_stay_and_a_conflict_with_them_is_refused(tmp_path: Path) -> None:
    keys, watch, path = _watch(tmp_path, api_keys=json.dumps({ENV: "ops"}))
    assert keys.tenant_for(ENV) == "ops"
    path.write_text(json.dumps({NEW: "team-a"}))
    assert watch.check() and keys.tenant_for(ENV) == "ops" and keys.tenant_for(OLD) is None
    path.write_text(json.dumps({ENV: "someone-else"}))  # one key, two tenants: refused
    assert not watch.check() and keys.tenant_for(NEW) == "team-a"


def test_a_watch_needs_a_file() -> None:
    with pytest.raises(ValueError, match="QLM_GATEWAY_API_KEYS_FILE"):
        ApiKeysWatch(ApiKeys({OLD: "a"}), GatewaySettings())


async def test_the_watch_outlives_a_check_that_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, watch, _ = _watch(tmp_path)
    calls = []

    def broken() -> bool:
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(watch, "check", broken)
    task = asyncio.create_task(watch.run(0.01))
    await asyncio.sleep(0.1)
    assert len(calls) > 1 and not task.done()  # still checking after the first failure
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert keys.tenant_for(OLD) == "team-a"
