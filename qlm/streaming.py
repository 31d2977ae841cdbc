"""Reassembling a streamed request's output from token chunks (``TokenChunk``) and its result.

Chunks are best effort: an agent publishes them straight to the producer without a confirm,
and after a failover the request runs again elsewhere (from scratch, or after the tokens its
evicted attempt had made), so the same positions can come twice, overlap, arrive out of order,
or never come. Every chunk says where it belongs (``offset``), and the one ResultMessage at the
end carries the whole output, so :class:`Reassembler` hands its consumer each output token
exactly once, in order: a chunk wholly below what was delivered is dropped, one straddling it
yields its new tail, one beyond it waits until the gap fills, and :meth:`Reassembler.finish`
delivers from the result whatever the chunks did not.

Text has no offsets (a token's text need not be a whole character), so it is matched by
prefix: the chunks of one attempt (``attempt``) are contiguous from where that attempt started
(0, or its resume point), and their text so far, less the text delivered from that point, is
the new text of a straddling chunk (a deterministic engine regenerates the same tokens, so
the same text). Where that fails, text stops flowing
(token ids still do) and :meth:`Reassembler.finish` delivers the rest from the result's
``output_text``: the pieces' texts always concatenate to a prefix of the output text.

:func:`encode_token_message` and :func:`decode_token_message` are the two ends of the wire: a
lone chunk travels as a TokenChunk whose request the AMQP correlation id names, several for
one reply queue as one TokenBatch whose chunks each name their own (docs/protocol.md, "Token
streams").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Discriminator, Tag, TypeAdapter

from qlm.logging import LibraryLogger
from qlm.types import BatchedChunk, TokenBatch, TokenChunk

# silent unless the program configures logging: this module runs in users' programs
log = LibraryLogger(__name__)

# Out-of-order chunks held while waiting for a gap to fill; beyond this new ones are dropped
# (the result fills the gap): a misbehaving sender cannot make a consumer hold unbounded data.
MAX_PENDING_CHUNKS = 1024


# A chunk as a stream takes it: either shape carries offset, token_ids, text and attempt.
Chunk = TokenChunk | BatchedChunk


def _shape(message: Any) -> str | None:
    # TokenChunk's ``type`` may be left out; a tagged union then validates one shape, not
    # both in turn (a 50-chunk batch: 120 µs instead of 330)
    if isinstance(message, dict):
        kind = message.get("type", "tokens")
        return kind if isinstance(kind, str) else None
    return getattr(message, "type", None)


_token_message: TypeAdapter[TokenChunk | TokenBatch] = TypeAdapter(
    Annotated[
        Annotated[TokenChunk, Tag("tokens")] | Annotated[TokenBatch, Tag("tokens_batch")],
        Discriminator(_shape),
    ]
)


def encode_token_message(chunks: Sequence[BatchedChunk]) -> tuple[bytes, str | None]:
    """The body and AMQP correlation id of one message carrying ``chunks`` (all for one reply
    queue, at least one): a lone chunk as a TokenChunk, which every consumer reads, its
    correlation id on the message; several as a TokenBatch, each chunk with its own."""
    if len(chunks) == 1:
        c = chunks[0]
        chunk = TokenChunk(
            request_id=c.request_id,
            offset=c.offset,
            token_ids=c.token_ids,
            text=c.text,
            attempt=c.attempt,
        )
        return chunk.model_dump_json().encode(), c.correlation_id
    return TokenBatch(chunks=list(chunks)).model_dump_json().encode(), None


def decode_token_message(body: bytes, correlation_id: str | None) -> list[tuple[str, Chunk]]:
    """The chunks of a token-stream message, each with the correlation id of the stream it
    is for (the request id where its route had none, as for replies). Raises pydantic's
    ValidationError for a body that is neither shape."""
    message = _token_message.validate_json(body)
    if isinstance(message, TokenChunk):
        return [(correlation_id or message.request_id, message)]
    return [(c.correlation_id or c.request_id, c) for c in message.chunks]


@dataclass
class _Attempt:
    start: int  # output offset of its first chunk
    end: int  # output offset after its last chunk so far
    text: list[str]
    contiguous: bool = True


@dataclass(frozen=True)
class TokenPiece:
    """Output tokens delivered to a stream's consumer: ``token_ids`` start at output index
    ``offset``; ``text`` is their text (it may lag behind the ids; see the module docstring)."""

    offset: int
    token_ids: list[int]
    text: str


class Reassembler:
    """The dedupe and reorder logic of one stream (module docstring)."""

    def __init__(self, max_pending: int = MAX_PENDING_CHUNKS) -> None:
        self.received = 0  # output tokens delivered so far
        self.token_ids: list[int] = []  # the tokens delivered, in order
        self._text: list[str] = []
        self._text_len = 0
        # output offset -> length of the text delivered up to it, at piece boundaries; None
        # once the text had a hole (text then waits for the result)
        self._text_at: dict[int, int] | None = {0: 0}
        self._attempts: dict[int, _Attempt] = {}
        self._pending: dict[int, tuple[list[int], str]] = {}  # offset -> chunk, above received
        self._max_pending = max_pending
        self.dropped = 0  # chunks that brought nothing new (duplicates, stale attempts)
        self.finished = False

    @property
    def text(self) -> str:
        return "".join(self._text)

    def add(
        self, offset: int, token_ids: list[int], text: str = "", attempt: int | None = None
    ) -> list[TokenPiece]:
        """A chunk arrived: the pieces it makes deliverable now (none, its new part, and any
        held chunks that now follow on)."""
        if self.finished or offset < 0 or not token_ids:
            self.dropped += 1
            return []
        run = self._follow(attempt, offset, len(token_ids), text)
        if offset > self.received:
            held = self._pending.get(offset)
            if held is None and len(self._pending) >= self._max_pending:
                self.dropped += 1
                return []
            if held is None or len(held[0]) < len(token_ids):
                self._pending[offset] = (list(token_ids), text)
            return []
        pieces: list[TokenPiece] = []
        piece = self._take(offset, token_ids, text, run)
        if piece is None:
            self.dropped += 1
            return []
        pieces.append(piece)
        # held chunks that the delivery reached: deliver the next, drop the stale
        while self._pending:
            ready = [o for o in self._pending if o <= self.received]
            if not ready:
                break
            for o in ready:
                ids, t = self._pending.pop(o)
                piece = self._take(o, ids, t, None)
                if piece is not None:
                    pieces.append(piece)
        return pieces

    def finish(self, output_token_ids: list[int], output_text: str) -> TokenPiece:
        """The result came: what of its output the consumer has not had yet (possibly
        nothing). After this, chunks are ignored."""
        self.finished = True
        self._pending.clear()
        offset = self.received
        if self.token_ids != output_token_ids[:offset]:
            # only a non-deterministic engine resumed from scratch does this: what was
            # streamed cannot be taken back, so say so
            log.warning("stream_diverged_from_result", delivered=offset)
        tail = list(output_token_ids[offset:])
        seen = self.text
        text = output_text[len(seen) :] if output_text.startswith(seen) else ""
        self.token_ids.extend(tail)
        self.received = max(self.received, len(output_token_ids))
        self._text.append(text)
        self._text_len += len(text)
        return TokenPiece(offset, tail, text)

    def _follow(self, attempt: int | None, offset: int, n: int, text: str) -> _Attempt | None:
        """Extend the text of the chunk's attempt (the run of chunks one engine sent)."""
        if attempt is None:
            return None
        run = self._attempts.get(attempt)
        if run is None:
            if len(self._attempts) >= self._max_pending:
                return None
            run = self._attempts[attempt] = _Attempt(offset, offset, [])
        if run.contiguous and offset == run.end:
            run.end += n
            run.text.append(text)
        else:
            run.contiguous = False
        return run if run.contiguous else None

    def _take(
        self, offset: int, token_ids: list[int], text: str, run: _Attempt | None
    ) -> TokenPiece | None:
        end = offset + len(token_ids)
        if end <= self.received:
            return None
        skip = self.received - offset
        new = token_ids[skip:]
        piece_text = self._new_text(end, skip, text, run)
        self.token_ids.extend(new)
        self.received = end
        if piece_text:
            self._text.append(piece_text)
            self._text_len += len(piece_text)
        if self._text_at is not None:
            self._text_at[end] = self._text_len
        return TokenPiece(offset + skip, new, piece_text)

    def _new_text(self, end: int, skip: int, text: str, run: _Attempt | None) -> str:
        """The text of a chunk's undelivered tokens, or "" (and no more text) when it cannot
        be told."""
        known = self._text_at
        if known is None:
            return ""
        if skip == 0:
            return text
        # the chunk ends its attempt's run: the run's text from its start, less what was
        # delivered from there, is this chunk's new text
        start = known.get(run.start) if run is not None and run.end == end else None
        if run is not None and start is not None:
            done = self.text[start:]  # delivered text of the tokens from run.start on
            whole = "".join(run.text)
            if whole.startswith(done):
                return whole[len(done) :]
        self._text_at = None
        return ""
