"""The load a chaos scenario runs under, and what it measures about the replies.

A :class:`ChaosLoad` publishes requests with a producer that keeps a durable reply queue (so
replies wait in the broker across a broker restart, as a durable producer's would), counts each
request's replies (exactly one is correct), and turns the reply times into the recovery time.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from qlm.client import QlmClient, Reply, StreamPiece, TokenStream
from qlm.types import SLO, RequestMessage, ResultMessage, SamplingParams

PUBLISH_CONCURRENCY = 200  # confirms awaited at once; one by one a cluster takes ~1.5 ms each
RATE_WINDOW_S = 1.0
RECOVERED_SHARE = 0.5  # replies flow again at half the rate before the fault


@dataclass
class ChaosLoad:
    """``n`` requests of ``max_tokens`` tokens for ``model``, ids ``<prefix>-<i>``."""

    amqp_url: str
    prefix: str
    n: int
    model: str = "mistral-7b"
    max_tokens: int = 300
    prompt_tokens: int = 64
    slo_s: float = 1800.0
    client: QlmClient | None = None
    futures: list[asyncio.Future[Reply]] = field(default_factory=list)
    published_at: float = 0.0
    publish_failures: int = 0
    # why the client gave up publishing: "ExceptionType: message" -> how many
    publish_errors: Counter[str] = field(default_factory=Counter)
    # stream: true - every request's tokens are read as they come (QlmClient.open_stream)
    stream: bool = False
    pieces: dict[str, list[StreamPiece]] = field(default_factory=dict)
    # greedy decoding to max_tokens (EOS ignored), and a prompt of its own for each request:
    # every answer can be checked against the engine's own greedy answer to its prompt
    greedy: bool = False
    ended: set[str] = field(default_factory=set)  # streams read to their end
    _readers: list[asyncio.Task[None]] = field(default_factory=list)

    async def __aenter__(self) -> ChaosLoad:
        self.client = QlmClient(self.amqp_url, reply_queue=f"qlm.reply.chaos.{self.prefix}")
        await self.client.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._readers:
            task.cancel()
        if self.client is not None:
            await self.client.close()

    def prompt(self, i: int) -> list[int]:
        shift = 13 * i if self.greedy else 0
        return [1 + (j * 7 + shift) % 200 for j in range(self.prompt_tokens)]

    def request(self, i: int) -> RequestMessage:
        return RequestMessage(
            request_id=f"{self.prefix}-{i}",
            model=self.model,
            prompt_token_ids=self.prompt(i),
            max_tokens=self.max_tokens,
            sampling=SamplingParams(temperature=0.0, ignore_eos=True)
            if self.greedy
            else SamplingParams(),
            slo=SLO(e2e_ms=int(self.slo_s * 1000)),
            stream=self.stream,
        )

    def results(self) -> dict[int, ResultMessage]:
        """The answered requests' results, by request index."""
        out: dict[int, ResultMessage] = {}
        for f in self.futures:
            if f.done() and not f.cancelled() and f.exception() is None:
                result = f.result()
                if isinstance(result, ResultMessage):
                    out[int(result.request_id.rsplit("-", 1)[1])] = result
        return out

    async def publish(self) -> None:
        """Publish every request; each returns once the broker confirmed it. A request the
        client gave up publishing (no confirm within its ``republish_within_s``) is counted in
        ``publish_failures`` and never answered (so it counts as lost)."""
        assert self.client is not None
        client = self.client
        sem = asyncio.Semaphore(PUBLISH_CONCURRENCY)

        async def one(i: int) -> asyncio.Future[Reply]:
            async with sem:
                if not self.stream:
                    return await client.submit(self.request(i))
                stream = await client.open_stream(self.request(i))
                self._readers.append(asyncio.create_task(self._read(stream)))
                return stream._reply

        done = await asyncio.gather(*(one(i) for i in range(self.n)), return_exceptions=True)
        self.futures = [f for f in done if isinstance(f, asyncio.Future)]
        self.publish_errors = Counter(
            f"{type(f).__name__}: {str(f)[:80]}" for f in done if isinstance(f, BaseException)
        )
        self.publish_failures = self.n - len(self.futures)
        self.published_at = time.time()

    async def _read(self, stream: TokenStream) -> None:
        got = self.pieces.setdefault(stream.request_id, [])
        try:
            async for piece in stream:
                got.append(piece)
        except Exception:  # noqa: BLE001 - an error reply: counted by errors()
            return
        finally:
            self.ended.add(stream.request_id)

    def streaming(self) -> int:
        """Streams that have delivered tokens and not yet ended."""
        return sum(1 for rid, got in self.pieces.items() if got and rid not in self.ended)

    def broken_streams(self) -> tuple[int, int, int]:
        """(streams whose tokens were not the result's exactly, tokens repeated, tokens
        missing), over the answered streamed requests."""
        broken = repeated = missing = 0
        for f in self.futures:
            if not f.done() or f.cancelled() or f.exception() is not None:
                continue
            result = f.result()
            if not isinstance(result, ResultMessage):
                continue
            got = [t for p in self.pieces.get(result.request_id, []) for t in p.token_ids]
            want = result.output_token_ids
            if got != want:
                broken += 1
                repeated += max(0, len(got) - len(want))
                missing += max(0, len(want) - len(got))
        return broken, repeated, missing

    def answered(self) -> int:
        return sum(f.done() for f in self.futures)

    def outstanding(self) -> int:
        return self.n - self.answered()

    async def wait_answered(self, at_least: int, timeout: float) -> None:  # noqa: ASYNC109
        deadline = time.monotonic() + timeout
        while self.answered() < at_least and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    async def wait_all(self, timeout: float) -> None:  # noqa: ASYNC109
        """Until every request has a reply or ``timeout`` passed; then a moment more, so a
        second reply (a duplicate) that is on its way is counted too."""
        if self.futures:
            await asyncio.wait(self.futures, timeout=timeout)
        await asyncio.sleep(1.0)
        if self._readers:  # the streams hand over their last piece
            await asyncio.wait(self._readers, timeout=10)

    def duplicates(self) -> int:
        assert self.client is not None
        return self.client.duplicate_count()

    def errors(self) -> int:
        return sum(self.error_codes().values())

    def error_codes(self) -> Counter[str]:
        """How many error replies (or client-side failures) there were of each code."""
        counts: Counter[str] = Counter()
        for f in self.futures:
            if not f.done() or f.cancelled():
                continue
            exc = f.exception()
            if exc is not None:
                key = type(exc).__name__
            else:
                reply = f.result()
                if isinstance(reply, ResultMessage):
                    continue
                key = f"{reply.code}: {reply.message[:80]}"
            counts[key] += 1
        return counts

    def reply_times(self) -> list[float]:
        assert self.client is not None
        return sorted(self.client.received_at.values())

    def first_reply_after(self, t: float) -> float | None:
        later = [x for x in self.reply_times() if x > t]
        return later[0] if later else None


def recovery_time(
    reply_times: Sequence[float], fault_at: float, *, before_s: float = 3.0
) -> float | None:
    """Seconds from ``fault_at`` until the end of the first 1-second window after it in which
    replies arrive at >= half the mean rate of the ``before_s`` seconds before the fault.
    ``None`` when the rate never recovers (or there was no rate before the fault)."""
    before = [t for t in reply_times if fault_at - before_s <= t < fault_at]
    if not before:
        return None
    target = RECOVERED_SHARE * len(before) / before_s * RATE_WINDOW_S
    after = [t for t in reply_times if t >= fault_at]
    if not after:
        return None
    start = fault_at
    i = 0
    while start <= after[-1]:
        end = start + RATE_WINDOW_S
        count = 0
        while i < len(after) and after[i] < end:
            count += 1
            i += 1
        if count >= target:
            return end - fault_at
        start = end
    return None
