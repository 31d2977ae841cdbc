"""structlog configuration: JSON lines (or console) on stderr, with bound context vars.

Every process calls :func:`configure_logging` once; code logs through
``structlog.get_logger(__name__).bind(request_id=..., instance_id=...)``. Prompts and tokens
are never logged.
"""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is when a line is logged, not when logging was set up:
    loggers are cached on first use, and an in-process CLI run (tests, notebooks) swaps
    ``sys.stderr`` for a buffer it closes afterwards."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", fmt: str = "json", component: str | None = None) -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    if component:
        structlog.contextvars.bind_contextvars(component=component)
    # aio-pika/aiormq use stdlib logging; keep their warnings, drop their debug chatter.
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)


# Every request's fate, one JSON line each (``event: request_outcome``) from the coordinator:
# answered | failed | rejected | cancelled. Prompts and outputs are never in it.
REQUEST_OUTCOMES = frozenset({"answered", "failed", "rejected", "cancelled"})
_requests_log = structlog.get_logger("qlm.requests")


def log_request_outcome(
    outcome: str,
    *,
    request_id: str | None,
    tenant: str | None = None,
    model: str | None = None,
    slo_class: str | None = None,
    instance_id: str | None = None,
    latency_s: float | None = None,
    met: bool | None = None,
    code: str | None = None,
    attempts: int | None = None,
) -> None:
    """One line per request outcome, at info (warning for ``failed``): the access log of qlm.
    ``latency_s`` is submission to the answer; ``met`` whether its SLO was met."""
    if outcome not in REQUEST_OUTCOMES:
        raise ValueError(f"unknown request outcome {outcome!r}")
    fields: dict[str, object] = {
        "outcome": outcome,
        "request_id": request_id,
        "tenant": tenant,
        "model": model,
        "slo_class": slo_class,
        "instance_id": instance_id,
        "latency_s": None if latency_s is None else round(max(0.0, latency_s), 6),
        "met": met,
    }
    if code is not None:
        fields["code"] = code
    if attempts is not None:
        fields["attempts"] = attempts
    if outcome == "failed":
        _requests_log.warning("request_outcome", **fields)
    else:
        _requests_log.info("request_outcome", **fields)


_gc_watched = False
# The threshold in force: a later call (an in-process CLI run) changes it, never adds a callback.
_gc_threshold_s = [0.05]


def watch_gc_pauses(threshold_s: float = 0.05) -> None:
    """Log every garbage-collector pass that stops the process longer than ``threshold_s``
    (``QLM_GC_PAUSE_WARN_MS``): a full collection over a large heap pauses the event loop,
    which shows up as a latency tail with no other trace in the logs. Short young-generation
    passes are routine and not logged; a threshold of 0 or less turns the warnings off."""
    import gc
    import time

    global _gc_watched
    _gc_threshold_s[0] = threshold_s
    if _gc_watched or threshold_s <= 0:  # one callback per process, and none when off
        return
    _gc_watched = True
    log = structlog.get_logger("qlm.gc")
    started: list[float] = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        pause = time.perf_counter() - started[0]
        limit = _gc_threshold_s[0]
        if limit > 0 and pause >= limit:
            log.warning(
                "gc_pause",
                generation=info.get("generation"),
                pause_ms=round(pause * 1000, 1),
                collected=info.get("collected"),
                threshold_ms=round(limit * 1000, 1),
            )

    gc.callbacks.append(callback)
