"""docs/configuration.md from the settings classes themselves: every ``QLM_*`` variable, its
type, default and meaning, so the page cannot drift from the code (a test regenerates it).

The meaning is the field's ``description`` when it has one, else the comment written above
the field (or after it on the same line) in the class's source: the settings are documented
where they are defined, once.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

HEADER = """# Configuration

Every qlm process reads its settings from `QLM_*` environment variables. This page is
generated from the settings classes (`qlm config docs --write docs/configuration.md`; a test
checks it is current), so it lists every variable there is. Variables of the shared
settings apply to every command; the gateway adds its own `QLM_GATEWAY_*` ones. The admin CLI
(`qlm admin`) also reads `QLM_ADMIN_URL` and `QLM_ADMIN_CA` (the CA of an HTTPS admin API),
and every command reads `QLM_DEBUG` (1: tracebacks with errors, as `--debug`).
"""


def settings_classes() -> list[tuple[str, type[Any]]]:
    from qlm.config import Settings
    from qlm.gateway.app import GatewaySettings

    return [
        ("Shared settings (`qlm.config.Settings`)", Settings),
        (
            "Gateway (`qlm.gateway.app.GatewaySettings`)",
            GatewaySettings,
        ),
    ]


def configuration_markdown() -> str:
    parts = [HEADER]
    for title, cls in settings_classes():
        prefix = cls.model_config.get("env_prefix", "")
        comments = _field_comments(cls)
        parts.append(f"\n## {title}\n\n| Variable | Type | Default | Meaning |\n|---|---|---|---|")
        for name, field in cls.model_fields.items():
            meaning = field.description or comments.get(name, "")
            parts.append(
                f"| `{prefix}{name.upper()}` | {_type(field)} | {_default(field)} | "
                f"{_cell(meaning)} |"
            )
    return "\n".join(parts) + "\n"


def write(path: Path) -> bool:
    """Write the page; True when it changed."""
    text = configuration_markdown()
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


def _field_comments(cls: type[Any]) -> dict[str, str]:
    """Field name -> the comment block right above it or at the end of its line."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    out: dict[str, str] = {}
    previous: ast.AnnAssign | None = None
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        # a field with no comment of its own, right below a related one (admin_tls_cert,
        # admin_tls_key), shares its comment
        follows = (
            isinstance(previous, ast.AnnAssign)
            and isinstance(previous.target, ast.Name)
            and previous.end_lineno == stmt.lineno - 1
            and previous.target.id.split("_")[0] == stmt.target.id.split("_")[0]
        )
        previous = stmt
        above: list[str] = []
        row = stmt.lineno - 2  # 0-based index of the line above
        while row >= 0 and lines[row].strip().startswith("#"):
            above.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        inline = lines[stmt.lineno - 1].partition("  # ")[2].strip()
        if inline.startswith(("noqa", "type:")):  # a linter's pragma, not a meaning
            inline = ""
        text = " ".join([*above, inline]).strip()
        out[stmt.target.id] = text or ("(see the variable above)" if follows else "")
    return out


def _type(field: FieldInfo) -> str:
    return f"`{_type_name(field.annotation)}`".replace("|", "\\|")


def _type_name(tp: Any) -> str:
    """``int | None``, ``dict[str, int]``, ``'a' | 'b'``: the annotation as a reader writes
    it (pydantic's constraints are left out: the validation error names them)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(_type_name(a) for a in args)}]"
    if tp is type(None):
        return "None"
    return str(getattr(tp, "__name__", tp))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    return f"`{value}`".replace("|", "\\|")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
