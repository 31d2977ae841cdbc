"""One line per failure for the ``qlm`` command line: what failed and what to check.

A stopped broker, a wrong URL, a refused token or a bad option used to print hundreds of
lines of traceback. :func:`describe` maps the exceptions a command meets in ordinary use to a
sentence and a hint; ``qlm.cli.main`` prints them and exits with status 2 (status 1 stays for
"the command ran and its check failed"). ``--debug`` shows the traceback as well.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

USAGE_EXIT = 2
# what a connection refused/reset/timed out looks like below aiormq, asyncpg and httpx
_NETWORK_ERRORS = (ConnectionError, TimeoutError, socket.gaierror)


@dataclass(frozen=True)
class Failure:
    message: str
    hint: str | None = None
    exit_code: int = USAGE_EXIT

    def line(self) -> str:
        return f"qlm: error: {self.message}" + (f" ({self.hint})" if self.hint else "")


class CliFailure(Exception):
    """A failure a command found itself and describes in full (e.g. no admin token)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class AdminApiError(Exception):
    """The admin API answered with an error: ``status`` and its ``{"error": ...}`` body."""

    def __init__(self, status: int, code: str, message: str, url: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.url = status, code, message, url


def describe(exc: BaseException) -> Failure | None:
    """The failure ``exc`` stands for, or None for one nobody anticipated (a bug: the caller
    shows the traceback's last line and points at --debug)."""
    exc = _leaf(exc)
    for candidate in _chain(exc):
        failure = _known(candidate)
        if failure is not None:
            return failure
    return None


def _leaf(exc: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: a TaskGroup wraps the real one."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` then its causes: aiormq raises AMQPConnectionError *from* the OSError."""
    out: list[BaseException] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _known(exc: BaseException) -> Failure | None:
    if isinstance(exc, CliFailure):
        return exc.failure
    if isinstance(exc, AdminApiError):
        return _admin_error(exc)
    http = _httpx_failure(exc)
    if http is not None:
        return http
    amqp = _amqp_failure(exc)
    if amqp is not None:
        return amqp
    if _is_usage_error(exc):
        ctx = getattr(exc, "ctx", None)
        command = getattr(ctx, "command_path", None) or "qlm"
        return Failure(exc.format_message(), f"see `{command} --help`")  # type: ignore[attr-defined]
    validation = _validation_failure(exc)
    if validation is not None:
        return validation
    if isinstance(exc, socket.gaierror):
        return Failure(f"unknown host: {exc.strerror or exc}", "check the URL's host name")
    if isinstance(exc, _NETWORK_ERRORS):
        return Failure(
            f"cannot connect: {_reason(exc)}",
            "is the server running? check the URL and port",
        )
    return None


def _admin_error(exc: AdminApiError) -> Failure:
    if exc.status == 401:
        return Failure(
            f"the admin API at {exc.url} wants a token: {exc.message}",
            "pass --token or set QLM_ADMIN_TOKEN",
        )
    if exc.status == 403:
        return Failure(
            f"the admin API at {exc.url} refused the token ({exc.code}): {exc.message}",
            "check --token / QLM_ADMIN_TOKEN; a read token may only read",
        )
    # the call reached the coordinator and was refused on its merits (unknown id, standby)
    return Failure(f"{exc.status} {exc.code}: {exc.message}", None, exit_code=1)


def _httpx_failure(exc: BaseException) -> Failure | None:
    try:
        import httpx
    except ImportError:  # pragma: no cover - a base dependency
        return None
    if isinstance(exc, httpx.InvalidURL | httpx.UnsupportedProtocol):
        return Failure(f"bad URL: {exc}", "give --url as http(s)://HOST:PORT")
    if not isinstance(exc, httpx.TransportError):
        return None
    try:
        url = str(exc.request.url.copy_with(path="/", query=None))
    except RuntimeError:  # no request attached
        url = "the admin API"
    if isinstance(exc, httpx.TimeoutException):
        return Failure(f"{url} did not answer in time", "is the coordinator overloaded?")
    return Failure(
        f"cannot reach {url}: {_reason(exc)}",
        "is the coordinator running? check --url / QLM_ADMIN_URL",
    )


def _amqp_failure(exc: BaseException) -> Failure | None:
    try:
        from aiormq import exceptions as amqp_exc
    except ImportError:  # pragma: no cover - a base dependency
        return None
    url = _broker_url()
    if isinstance(exc, amqp_exc.ProbableAuthenticationError):
        return Failure(
            f"the broker at {url} refused the login",
            "check the user and password in QLM_AMQP_URL",
        )
    if isinstance(exc, amqp_exc.AMQPConnectionError):
        return Failure(
            f"cannot connect to the broker at {url}: {_reason(exc)}",
            "is RabbitMQ running? check QLM_AMQP_URL; `qlm demo` starts a private broker",
        )
    if isinstance(exc, amqp_exc.ChannelAccessRefused):
        return Failure(
            f"the broker at {url} refused access: {_reason(exc)}",
            "check the user's permissions on the vhost",
        )
    return None


def _validation_failure(exc: BaseException) -> Failure | None:
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return None
    errors = exc.errors(include_input=False, include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    where = ".".join(str(p) for p in first["loc"]) or exc.title
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    msg = str(first["msg"]).removeprefix("Value error, ")
    return Failure(f"invalid {exc.title} {where}: {msg}{more}", None)


def _is_usage_error(exc: BaseException) -> bool:
    # typer >= 0.26 vendors click (typer._click); duck typing covers both it and click itself
    return hasattr(exc, "format_message") and getattr(exc, "exit_code", None) == USAGE_EXIT


def _reason(exc: BaseException) -> str:
    """The OS's words for a network failure, else the exception's message."""
    for cur in _chain(exc):
        if isinstance(cur, socket.gaierror):  # its errno is resolver's, not the OS's
            return f"unknown host ({cur.strerror})"
        if isinstance(cur, OSError) and isinstance(cur.errno, int) and cur.errno > 0:
            return os.strerror(cur.errno)
        if isinstance(cur, OSError) and cur.strerror:
            return cur.strerror
        match cur.args:  # aiormq's AMQPConnectionError(errno, text) of the OSError it caught
            case (int(code), str(text)):
                return os.strerror(code) if code > 0 else text
    text = str(exc).strip()
    return text or type(exc).__name__


def _broker_url() -> str:
    from qlm.amqp import mask_password

    url = os.environ.get("QLM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    try:
        return mask_password(url)
    except ValueError:
        return "QLM_AMQP_URL"
