"""Progress bars for the long-running commands (``qlm submit``, ``qlm demo``): a rich bar on
stderr, shown only on a terminal (stdout and stderr both TTYs) so that piped output and logs
stay clean."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any


def wanted(enabled: bool = True) -> bool:
    return enabled and sys.stdout.isatty() and sys.stderr.isatty()


@contextlib.asynccontextmanager
async def counting(
    description: str, total: int, count: Callable[[], int], *, enabled: bool = True
) -> AsyncIterator[None]:
    """A bar from 0 to ``total`` that polls ``count()`` (e.g. replies received) a few times a
    second while the body runs: polling, not callbacks, so the code measured stays as it is."""
    if not wanted(enabled) or total <= 0:
        yield
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,  # the table printed after it is what stays on screen
    )
    task = bar.add_task(description, total=total)

    async def poll() -> None:
        while True:
            bar.update(task, completed=min(count(), total))
            await asyncio.sleep(0.2)

    bar.start()
    poller: asyncio.Task[Any] = asyncio.create_task(poll())
    try:
        yield
    finally:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
        bar.stop()
