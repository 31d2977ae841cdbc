"""``qlm admin``: calls to the coordinator's admin API (docs/admin-api.md) and their output.

Output formats: ``table`` (rich tables, unix times as ISO-8601 UTC: for people), ``json`` and
``yaml`` (the API's bodies unchanged, unix seconds included: for scripts, which should not
have to parse a time format back). The default is ``table`` on a terminal, ``json`` when
stdout is a pipe or a file, so existing scripts keep reading JSON.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from qlm.tooling.cli_errors import AdminApiError, CliFailure, Failure

# fields that hold unix seconds in the API's bodies (rendered as ISO-8601 in tables)
_TIME_FIELDS = frozenset(
    {"last_seen", "deadline", "created_at", "submitted_at", "started_at", "first_token_at"}
    | {"finished_at", "updated_at", "received_at", "at", "decided_at", "now", "next_deadline"}
)
# a table cell is shown up to this long; json/yaml give the whole value
_CELL_MAX = 60


class OutputFormat(StrEnum):
    table = "table"
    json = "json"
    yaml = "yaml"


def default_format() -> OutputFormat:
    return OutputFormat.table if sys.stdout.isatty() else OutputFormat.json


class AdminClient:
    """One call per method: the CLI is short-lived, so no connection pool is kept."""

    def __init__(self, url: str, token: str | None, ca: str | None = None) -> None:
        if not token:
            raise CliFailure(Failure("no admin token", "pass --token or set QLM_ADMIN_TOKEN"))
        self.url = url.rstrip("/")
        self.token = token
        self.verify: str | bool = ca or True

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        r = httpx.request(
            method,
            self.url + path,
            headers={"Authorization": f"Bearer {self.token}"},
            json=body,
            timeout=30,
            verify=self.verify,
        )
        if r.status_code >= 400:
            code, message = _error_of(r)
            raise AdminApiError(r.status_code, code, message, self.url)
        return r.json()


def _error_of(r: Any) -> tuple[str, str]:
    """The ``{"error": {"code", "message"}}`` body, or the status line when it is not one
    (a proxy in front of the API, a wrong URL pointing at another server)."""
    try:
        err = r.json()["error"]
        return str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        return "http_error", (r.text.strip()[:200] or r.reason_phrase)


def render(data: Any, fmt: OutputFormat, columns: list[str] | None = None) -> str | None:
    """``data`` as text (json, yaml); None for a table, which is printed with rich directly
    (its width follows the terminal)."""
    if fmt is OutputFormat.json:
        return json.dumps(data, indent=2)
    if fmt is OutputFormat.yaml:
        import yaml

        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip()
    from rich.console import Console

    # a pipe or file gets the whole table (rich would squeeze it into 80 columns)
    width = None if sys.stdout.isatty() else 250
    Console(width=width).print(to_table(data, columns))
    return None


def to_table(data: Any, columns: list[str] | None = None) -> Any:
    """A rich Table: a list of objects is one row each (``columns``, else every key seen); an
    object is one row per field."""
    from rich.table import Table

    if isinstance(data, list):
        rows = [r for r in data if isinstance(r, dict)]
        keys = columns or _keys(rows)
        table = Table(show_lines=False)
        for n, key in enumerate(keys):
            table.add_column(key, no_wrap=n == 0)  # the id column is never cut
        for row in rows:
            table.add_row(*(cell(k, row.get(k)) for k in keys))
        return table
    table = Table("field", "value", show_header=False)
    for k, v in (data or {}).items():
        table.add_row(k, cell(k, v))
    return table


def _keys(rows: list[dict[str, Any]]) -> list[str]:
    keys: dict[str, None] = {}
    for row in rows:
        keys.update(dict.fromkeys(row))
    return list(keys)


def cell(key: str, value: Any) -> str:
    """One value for a table: times as ISO-8601, lists and objects as compact JSON."""
    if value is None:
        return "-"
    if key in _TIME_FIELDS and isinstance(value, int | float) and not isinstance(value, bool):
        return iso(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        text = ",".join(value)
    elif isinstance(value, dict | list):
        text = json.dumps(value, separators=(",", ":"))
    elif isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = str(value)
    return text if len(text) <= _CELL_MAX else text[: _CELL_MAX - 1] + "…"


def iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def queue_rows(queues: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``GET /v1/queues`` as one table row per queue: depth and the first requests in line."""
    return [
        {
            "instance_id": q.get("instance_id") or "(unassigned)",
            "draining": q.get("draining"),
            "depth": q.get("depth"),
            "next": [r.get("request_id", "?") for r in q.get("requests", [])[:5]],
            "next_deadline": min(
                (r["deadline"] for r in q.get("requests", []) if r.get("deadline")), default=None
            ),
        }
        for q in queues
    ]
