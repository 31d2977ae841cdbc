"""docs/configuration.md is generated from the settings classes: regenerating it changes
nothing, and it names every variable there is."""

from __future__ import annotations

from pathlib import Path

from qlm.config import Settings
from qlm.gateway.app import GatewaySettings
from qlm.tooling.config_docs import configuration_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_page_is_current() -> None:
    assert PAGE.read_text() == configuration_markdown(), (
        "docs/configuration.md is stale: run `qlm config docs --write docs/configuration.md`"
    )


def test_every_setting_has_a_row() -> None:
    text = configuration_markdown()
    for name in Settings.model_fields:
        assert f"| `QLM_{name.upper()}` |" in text
    for name in GatewaySettings.model_fields:
        assert f"| `QLM_GATEWAY_{name.upper()}` |" in text
    assert "| `QLM_ADMIN_PORT` | `int` | `8080` |" in text
    assert "| `QLM_TENANT_LIMITS` | `dict[str, int]` |" in text
