"""structlog configuration: JSON lines (or console) on stderr, with bound context vars.

Every process calls :func:`configure_logging` once; code logs through
``structlog.get_logger(__name__).bind(request_id=..., instance_id=...)``. Prompts and tokens
are never logged.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is when a line is logged, not when logging was set up:
    loggers are cached on first use, and an in-process CLI run (tests, notebooks) swaps
    ``sys.stderr`` for a buffer it closes afterwards."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class LibraryLogger:
    """The logger of the modules a user's program imports (the client and what it uses).

    structlog's defaults, before anyone configures it, print every line (debug included) to
    stdout: a library must not write into its user's program. So until structlog is configured
    (every qlm process does it in its CLI entry point) lines go to the stdlib logger of the
    same name instead, which is silent unless the program configures logging (the ``qlm``
    logger has a NullHandler). Same call style as structlog: ``log.debug("event", key=value)``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._std = logging.getLogger(name)

    def _emit(self, level: int, event: str, kw: dict[str, object]) -> None:
        if structlog.is_configured():
            structlog.get_logger(self.name).log(level, event, **kw)
        elif self._std.isEnabledFor(level):
            exc_info = bool(kw.pop("exc_info", False))
            detail = " ".join(f"{k}={v!r}" for k, v in kw.items())
            self._std.log(level, "%s %s", event, detail, exc_info=exc_info)

    def debug(self, event: str, **kw: object) -> None:
        self._emit(logging.DEBUG, event, kw)

    def info(self, event: str, **kw: object) -> None:
        self._emit(logging.INFO, event, kw)

    def warning(self, event: str, **kw: object) -> None:
        self._emit(logging.WARNING, event, kw)

    def error(self, event: str, **kw: object) -> None:
        self._emit(logging.ERROR, event, kw)

    def exception(self, event: str, **kw: object) -> None:
        kw.setdefault("exc_info", True)
        self._emit(logging.ERROR, event, kw)


# the library convention: no output through stdlib logging unless the program sets it up
logging.getLogger("qlm").addHandler(logging.NullHandler())


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
    # aio-pika/aiormq (and Python warnings, e.g. cvxpy's) use stdlib logging: keep their
    # warnings, drop their debug chatter, and render them as the same JSON lines.
    handler = logging.StreamHandler(_CurrentStderr())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
            ],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_qlm", False)]:
        root.removeHandler(old)  # configured again (in-process CLI runs): one handler
    handler._qlm = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(max(lvl, logging.WARNING))
    logging.captureWarnings(True)
    quiet_connect_failures()


class _DropConnectFailures(logging.Filter):
    """aiormq logs an ERROR for every failed connection attempt, and the failure then reaches
    its caller anyway: the CLI prints it as one line, services log ``amqp_connection_lost``.
    The duplicate (an unformatted stdlib line amid JSON logs) is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("error when creating transport")


def quiet_connect_failures() -> None:
    target = logging.getLogger("aiormq.connection")
    if not any(isinstance(f, _DropConnectFailures) for f in target.filters):
        target.addFilter(_DropConnectFailures())


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


_highs_lock = threading.Lock()
_highs_done = False


def absorb_highs_banner() -> None:
    """Make the HiGHS solver print its banner now, into a structured log line.

    HiGHS (under cvxpy, for the planner's MILP and the capacity ILP) writes ``Running HiGHS
    ... Copyright ...`` straight to file descriptor 1 from C++ the first time a solver object
    is made in a process, whatever ``verbose``/``output_flag`` say, breaking the JSON-lines
    stream. Called before a solve: the first call makes one solver object with fd 1 pointed at
    a temporary file and logs what it wrote (``third_party_output``, source ``highs``); later
    calls return at once. A no-op without highspy."""
    global _highs_done
    if _highs_done:
        return
    with _highs_lock:
        if _highs_done:
            return
        _highs_done = True
        try:
            import highspy
        except ImportError:
            return
        text = _capture_fd1(highspy.Highs)
        if text.strip():
            structlog.get_logger("qlm.solver").info(
                "third_party_output", source="highs", text=text.strip()[:2000]
            )


def _capture_fd1(make: object) -> str:
    """Run ``make()`` with file descriptor 1 redirected; return what was written to it."""
    assert callable(make)
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        try:
            os.dup2(tmp.fileno(), 1)
            make()
        finally:
            sys.stdout.flush()
            _flush_c_stdio()  # C's stdout is block-buffered when fd 1 is not a terminal
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode(errors="replace")


def _flush_c_stdio() -> None:
    import contextlib
    import ctypes

    # no C library to flush (not POSIX): nothing was buffered there
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)
