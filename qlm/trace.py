"""Workload traces: load arrival times and token counts, turn them into protocol requests.

The shipped data (``qlm/data/``, see its README for sources and licences) holds token counts
only, no text, so requests carry ``prompt_token_ids`` of the trace's prompt length and
``max_tokens`` of its output length, with ``ignore_eos`` so a real engine generates exactly that
many tokens.
"""

from __future__ import annotations

import csv
import io
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

import structlog

from qlm.catalog import ModelCatalog
from qlm.types import SLO, RequestMessage, SamplingParams

log = structlog.get_logger(__name__)

AZURE_FILES = {
    "conv": "AzureLLMInferenceTrace_conv.csv",
    "code": "AzureLLMInferenceTrace_code.csv",
}
LENGTH_FILES = {
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
}
_TICKS_PER_S = 10_000_000  # Azure timestamps have 7 fractional digits (100 ns)


@dataclass(frozen=True, slots=True)
class TraceRecord:
    arrival_s: float  # seconds since the start of the trace (or of the loaded window)
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class SLOClassSpec:
    """One SLO class of a synthetic workload: its share of requests and its deadlines."""

    name: str
    weight: float
    e2e_ms: int | None = None
    ttft_ms: int | None = None

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError(f"SLO class {self.name!r}: weight must be positive")
        if self.e2e_ms is None and self.ttft_ms is None:
            raise ValueError(f"SLO class {self.name!r} needs e2e_ms and/or ttft_ms")

    def slo(self) -> SLO:
        return SLO(e2e_ms=self.e2e_ms, ttft_ms=self.ttft_ms, slo_class=self.name)


class Workload(list[tuple[float, RequestMessage]]):
    """``(arrival_s, request)`` pairs in arrival order, plus how many records were clipped."""

    clipped: int = 0


# --- loading ---------------------------------------------------------------------------------


def _azure_ticks(timestamp: str) -> int:
    """``2023-11-16 18:17:03.9799600`` → 100 ns ticks since the epoch, exactly (no float)."""
    whole, _, fraction = timestamp.strip().partition(".")
    if len(fraction) > 7 or (fraction and not fraction.isdigit()):
        raise ValueError(f"bad TIMESTAMP fraction in {timestamp!r}")
    # The trace does not say its zone; only differences matter, so read it as UTC.
    base = datetime.fromisoformat(whole).replace(tzinfo=UTC)
    return int(base.timestamp()) * _TICKS_PER_S + int(fraction.ljust(7, "0") or 0)


def _count(value: str, column: str, line: int) -> int:
    n = int(value)
    if n < 0:
        raise ValueError(f"line {line}: negative {column} {n}")
    return n


def _parse_csv(text: Iterable[str], source: str) -> list[TraceRecord]:
    reader = csv.DictReader(text)
    columns = set(reader.fieldnames or ())
    records: list[TraceRecord] = []
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= columns:
        t0: int | None = None
        for row in reader:
            ticks = _azure_ticks(row["TIMESTAMP"])
            t0 = ticks if t0 is None else t0
            records.append(
                TraceRecord(
                    (ticks - t0) / _TICKS_PER_S,
                    _count(row["ContextTokens"], "ContextTokens", reader.line_num),
                    _count(row["GeneratedTokens"], "GeneratedTokens", reader.line_num),
                )
            )
    elif {"arrival_s", "prompt_tokens", "output_tokens"} <= columns:
        for row in reader:
            arrival = float(row["arrival_s"])
            if not arrival >= 0:  # also rejects NaN
                raise ValueError(f"{source} line {reader.line_num}: bad arrival_s {arrival}")
            records.append(
                TraceRecord(
                    arrival,
                    _count(row["prompt_tokens"], "prompt_tokens", reader.line_num),
                    _count(row["output_tokens"], "output_tokens", reader.line_num),
                )
            )
    else:
        raise ValueError(
            f"{source}: unknown trace columns {sorted(columns)}; expected the Azure schema "
            "(TIMESTAMP,ContextTokens,GeneratedTokens) or arrival_s,prompt_tokens,output_tokens"
        )
    # Replay needs arrival order; a stable sort keeps ties in file order.
    records.sort(key=lambda r: r.arrival_s)
    return records


def load_trace_csv(path: str | Path) -> list[TraceRecord]:
    """Read a trace CSV in the Azure schema or as ``arrival_s,prompt_tokens,output_tokens``.

    Azure arrivals become seconds since the first row; generic arrivals are kept as written.
    """
    with open(path, newline="", encoding="utf-8-sig") as f:
        return _parse_csv(f, str(path))


def _packaged_text(*parts: str) -> str:
    resource = resources.files("qlm").joinpath("data", *parts)
    return resource.read_text(encoding="utf-8-sig")


def load_azure_trace(
    kind: Literal["conv", "code"], *, start_s: float = 0, duration_s: float | None = None
) -> list[TraceRecord]:
    """The shipped Azure LLM inference trace (2023), optionally a window of it.

    Returns the records arriving in ``[start_s, start_s + duration_s)`` seconds after the trace
    starts, with ``arrival_s`` counted from ``start_s`` so a replay begins at once.
    """
    if kind not in AZURE_FILES:
        raise ValueError(f"unknown Azure trace {kind!r}; known: {sorted(AZURE_FILES)}")
    text = _packaged_text("azure-llm-inference-2023", AZURE_FILES[kind])
    records = _parse_csv(io.StringIO(text, newline=""), AZURE_FILES[kind])
    end = float("inf") if duration_s is None else start_s + duration_s
    return [
        TraceRecord(r.arrival_s - start_s, r.prompt_tokens, r.output_tokens)
        for r in records
        if start_s <= r.arrival_s < end
    ]


def load_request_lengths(kind: Literal["sharegpt", "arxiv"]) -> list[tuple[int, int]]:
    """Shipped ``(prompt_tokens, output_tokens)`` samples (Llama-2 tokenizer), no arrivals."""
    if kind not in LENGTH_FILES:
        raise ValueError(f"unknown length set {kind!r}; known: {sorted(LENGTH_FILES)}")
    reader = csv.DictReader(io.StringIO(_packaged_text("request-lengths", LENGTH_FILES[kind])))
    return [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in reader]


def poisson_trace(
    lengths: Sequence[tuple[int, int]], *, rate_rps: float, count: int, seed: int
) -> list[TraceRecord]:
    """``count`` requests with Poisson arrivals at ``rate_rps``, lengths drawn from ``lengths``."""
    if rate_rps <= 0:
        raise ValueError("rate_rps must be positive")
    rng = random.Random(seed)
    t = 0.0
    records = []
    for _ in range(count):
        t += rng.expovariate(rate_rps)
        prompt, output = rng.choice(lengths)
        records.append(TraceRecord(t, prompt, output))
    return records


def load_jsonl_requests(path: str | Path) -> list[RequestMessage]:
    """One RequestMessage JSON per line (blank lines skipped), as ``qlm submit`` reads them."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                requests.append(RequestMessage.model_validate_json(line))
            except ValueError as e:  # pydantic's ValidationError is a ValueError
                raise ValueError(f"{path}:{number}: {e}") from e
    return requests


# --- turning records into requests -----------------------------------------------------------

_ID_VOCAB = 32_000  # Llama-2 vocabulary size; ids stay valid for the tiny test models' ranges
_ID_OFFSETS = 65_536


@cache
def _id_pool(length: int) -> list[int]:
    # One shared pseudo-random sequence; request i takes a slice at its own offset, so prompts
    # differ (no accidental shared prefixes) while costing one list slice each.
    rng = random.Random(0x51A)
    return [rng.randrange(1, _ID_VOCAB) for _ in range(length + _ID_OFFSETS)]


def _pool_length(n: int) -> int:
    return max(4096, 1 << (n - 1).bit_length())  # powers of two keep the cache small


def prompt_token_ids(index: int, n: int) -> list[int]:
    """Cheap deterministic token ids: the same ``(index, n)`` always gives the same prompt."""
    offset = (index * 7919) % _ID_OFFSETS
    return _id_pool(_pool_length(n))[offset : offset + n]


def to_requests(
    records: Sequence[TraceRecord],
    *,
    models: list[str],
    slo_classes: list[SLOClassSpec],
    seed: int,
    catalog: ModelCatalog,
    model_choice: Literal["round_robin", "random"] = "round_robin",
    id_prefix: str = "req",
) -> Workload:
    """Give each record a model and an SLO class, and build its request.

    Lengths are fitted to the model: ``max_tokens`` is capped at ``max_output_tokens`` (and is at
    least 1), then the prompt is cut so prompt + max_tokens fits ``max_context``. The returned
    :class:`Workload` counts the records so changed in ``clipped``.
    """
    if not models:
        raise ValueError("to_requests needs at least one model")
    if not slo_classes:
        raise ValueError("to_requests needs at least one SLO class")
    specs = [catalog.get(m) for m in models]  # unknown models fail here, not at the broker
    # Separate streams, so switching model_choice does not reshuffle the SLO classes.
    model_rng = random.Random(f"{seed}/model")
    slo_rng = random.Random(f"{seed}/slo")
    weights = [c.weight for c in slo_classes]
    slos = [c.slo() for c in slo_classes]
    sampling = SamplingParams(ignore_eos=True)
    out = Workload()
    for i, rec in enumerate(records):
        m = i % len(specs) if model_choice == "round_robin" else model_rng.randrange(len(specs))
        spec = specs[m]
        slo = slo_rng.choices(slos, weights=weights)[0]
        max_tokens = min(max(rec.output_tokens, 1), spec.max_output_tokens, spec.max_context - 1)
        prompt = min(max(rec.prompt_tokens, 1), spec.max_context - max_tokens)
        if (prompt, max_tokens) != (rec.prompt_tokens, rec.output_tokens):
            out.clipped += 1
        request = RequestMessage(
            request_id=f"{id_prefix}-{i}",
            model=spec.name,
            prompt_token_ids=prompt_token_ids(i, prompt),
            max_tokens=max_tokens,
            sampling=sampling,
            slo=slo,
        )
        out.append((rec.arrival_s, request))
    if out.clipped:
        log.info("trace_clipped", clipped=out.clipped, records=len(records))
    return out
