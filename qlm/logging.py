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
    # aio-pika/aiormq use stdlib logging; keep their warnings, drop their debug chatter.
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)
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


_gc_watched = False


def watch_gc_pauses(threshold_s: float = 0.01) -> None:
    """Log every garbage-collector pass that stops the process longer than ``threshold_s``:
    a full collection over a large heap pauses the event loop, which shows up as a latency
    tail with no other trace in the logs."""
    import gc
    import time

    global _gc_watched
    if _gc_watched:  # one callback per process (in-process CLI runs call this repeatedly)
        return
    _gc_watched = True
    log = structlog.get_logger("qlm.gc")
    started: list[float] = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        pause = time.perf_counter() - started[0]
        if pause >= threshold_s:
            log.warning(
                "gc_pause",
                generation=info.get("generation"),
                pause_ms=round(pause * 1000, 1),
                collected=info.get("collected"),
            )

    gc.callbacks.append(callback)
