"""A blocking facade on :class:`qlm.client.QlmClient` for programs without an event loop::

    from qlm.sync_client import SyncQlmClient

    with SyncQlmClient("amqp://guest:guest@127.0.0.1:5672/") as client:
        reply = client.complete("mistral-7b", "Hello", max_tokens=32)

The async client runs on a private event loop in a daemon thread; each method submits a
coroutine to it and waits. The loop (and its connection) belongs to this object alone, so it
works the same inside a program that runs its own loop elsewhere (a notebook, say).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar

from qlm.client import QlmClient, Reply
from qlm.types import RequestMessage

_T = TypeVar("_T")


class SyncQlmClient:
    """Blocking ``connect``/``close``, ``submit`` (a concurrent Future of the reply),
    ``request``, ``complete`` and ``cancel``; arguments as :class:`QlmClient`'s."""

    def __init__(self, amqp_url: str, **client_options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="qlm-sync-client", daemon=True
        )
        self._thread.start()
        # built on the loop's thread: QlmClient creates loop-bound objects in __init__
        self.client: QlmClient = self._call(self._make(amqp_url, client_options))

    @staticmethod
    async def _make(amqp_url: str, options: dict[str, Any]) -> QlmClient:
        return QlmClient(amqp_url, **options)

    def _call(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("SyncQlmClient is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def connect(self) -> None:
        self._call(self.client.connect())

    def close(self) -> None:
        """Close the connection and stop the loop's thread (idempotent)."""
        if not self._thread.is_alive():
            return
        try:
            self._call(self.client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> Self:
        self.connect()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def submit(self, request: RequestMessage) -> concurrent.futures.Future[Reply]:
        """Publish (returns once the broker confirmed it); the future resolves on the reply."""
        reply = self._call(self.client.submit(request))
        return asyncio.run_coroutine_threadsafe(self._wait(reply), self._loop)

    @staticmethod
    async def _wait(reply: asyncio.Future[Reply]) -> Reply:
        # shield: cancelling the concurrent future must not cancel the client's own
        return await asyncio.shield(reply)

    def request(self, request: RequestMessage, timeout: float) -> Reply:
        """Submit and wait for the reply; TimeoutError after ``timeout`` s (the request stays
        outstanding)."""
        return self._call(self.client.request(request, timeout))

    def complete(
        self,
        model: str,
        prompt: str,
        *,
        max_tokens: int = 256,
        e2e_ms: int | None = 60_000,
        timeout: float = 120.0,
        **fields: Any,
    ) -> Reply:
        """``prompt`` to ``model`` with a generated request id; see QlmClient.complete."""
        return self._call(
            self.client.complete(
                model, prompt, max_tokens=max_tokens, e2e_ms=e2e_ms, timeout=timeout, **fields
            )
        )

    def cancel(self, request_id: str, reason: str | None = None) -> None:
        self._call(self.client.cancel(request_id, reason))
