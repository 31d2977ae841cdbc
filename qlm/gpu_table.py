"""The GPU table: GPU types and their data-sheet figures, as data (``qlm/data/gpus.yaml``).

A user file of the same shape (``QLM_GPU_TABLE`` or ``--gpu-table``) extends it or replaces
entries; :func:`load_gpu_table` validates one and names the file, the entry and the field of
every problem. :mod:`qlm.catalog` holds the merged result.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

SHIPPED_TABLE = "gpus.yaml"  # under qlm/data/, package data of the wheel


class GPUTableError(ValueError):
    """A GPU table that cannot be used; the message names the file and what is wrong."""


class _Entry(BaseModel):
    # extra="forbid": a misspelt field (mem_bw instead of mem_bw_gbs) is an error, not a default
    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_gb: float = Field(gt=0, le=10_000)
    mem_bw_gbs: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0)
    pcie_gbs: float = Field(gt=0)
    interconnect_gbs: float | None = Field(default=None, gt=0)
    aliases: list[str] = Field(default_factory=list)
    source: str | None = None


@dataclass(frozen=True)
class GPUTable:
    """GPU name -> its figures (as ``GPUSpec`` keyword arguments), and alias -> GPU name."""

    entries: dict[str, dict[str, Any]]
    aliases: dict[str, str]


def parse_gpu_table(data: object, where: str) -> GPUTable:
    """Validate a table already read from YAML/JSON; ``where`` names it in errors."""
    if not isinstance(data, dict) or not data:
        raise GPUTableError(f"{where}: expected a mapping of GPU name -> figures")
    entries: dict[str, dict[str, Any]] = {}
    aliases: dict[str, str] = {}
    for name, raw in data.items():
        if not isinstance(name, str) or not name.strip():
            raise GPUTableError(f"{where}: GPU names must be non-empty strings, got {name!r}")
        try:
            entry = _Entry.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'entry'}: {e['msg']}"
                for e in exc.errors(include_url=False, include_input=False)
            )
            raise GPUTableError(f"{where}: GPU {name!r}: {problems}") from None
        entries[name] = entry.model_dump(exclude={"aliases", "source"})
        for alias in entry.aliases:
            if alias in aliases and aliases[alias] != name:
                raise GPUTableError(
                    f"{where}: alias {alias!r} names both {aliases[alias]!r} and {name!r}"
                )
            aliases[alias] = name
    clash = sorted(set(aliases) & set(entries))
    if clash:
        raise GPUTableError(f"{where}: {clash} are GPU names and aliases at once")
    return GPUTable(entries, aliases)


def load_gpu_table(path: str | Path) -> GPUTable:
    """A user GPU table (YAML, or JSON: YAML reads both)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise GPUTableError(f"GPU table {p}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        raise GPUTableError(f"GPU table {p}: not YAML or JSON{at}") from None
    return parse_gpu_table(data, f"GPU table {p}")


def shipped_gpu_table() -> GPUTable:
    text = resources.files("qlm").joinpath("data", SHIPPED_TABLE).read_text()
    return parse_gpu_table(yaml.safe_load(text), f"qlm/data/{SHIPPED_TABLE}")


def merge(base: GPUTable, extra: GPUTable, where: str) -> GPUTable:
    """``extra`` on top of ``base``: its entries replace same-named ones; an alias of ``extra``
    may not name a different GPU than ``base`` says, nor shadow a GPU name."""
    entries = {**base.entries, **extra.entries}
    aliases = dict(base.aliases)
    for alias, name in extra.aliases.items():
        if aliases.get(alias, name) != name:
            raise GPUTableError(f"{where}: alias {alias!r} already names {aliases[alias]!r}")
        aliases[alias] = name
    clash = sorted(set(aliases) & set(entries))
    if clash:
        raise GPUTableError(f"{where}: {clash} are GPU names and aliases at once")
    return GPUTable(entries, aliases)
