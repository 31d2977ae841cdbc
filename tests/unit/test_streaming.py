"""The dedupe and reorder logic of token streams (qlm/streaming.py): whatever chunks of a token
sequence arrive - reordered, duplicated, overlapping, from several attempts, some never - the
consumer gets the sequence exactly once, in order, and text that is always a prefix of the
output text and equals it at the end. Also when several requests' chunks share messages
(TokenBatch): each chunk reaches its own request's stream, by its correlation id."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from qlm.streaming import (
    Reassembler,
    TokenPiece,
    decode_token_message,
    encode_token_message,
)
from qlm.types import BatchedChunk, TokenBatch, TokenChunk

Chunk = tuple[int, list[int], str, int | None]


def token_text(token: int, index: int) -> str:
    return f"t{token}" if index == 0 else f" t{token}"


def chunk(tokens: list[int], start: int, end: int, attempt: int | None) -> Chunk:
    text = "".join(token_text(t, i) for i, t in enumerate(tokens[start:end], start))
    return (start, tokens[start:end], text, attempt)


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[list[int], list[Chunk]]:
    """A token sequence and the chunks that arrive for it: each attempt cuts the sequence
    from its start (0, or a resume point) to where it got, at random points; then some
    chunks are lost, some repeated, and the rest arrive in any order."""
    tokens = draw(st.lists(st.integers(0, 31_999), min_size=1, max_size=40))
    n = len(tokens)
    chunks: list[Chunk] = []
    for attempt in range(1, draw(st.integers(1, 3)) + 1):
        start = draw(st.integers(0, n - 1))
        end = draw(st.integers(start + 1, n))
        cuts = sorted(set(draw(st.lists(st.integers(start + 1, end), max_size=8))) | {end})
        at = start
        tagged = draw(st.booleans())
        for cut in cuts:
            if cut > at:
                chunks.append(chunk(tokens, at, cut, attempt if tagged else None))
                at = cut
    kept = [c for c in chunks if draw(st.booleans()) or draw(st.booleans())]
    repeated = kept + draw(st.lists(st.sampled_from(kept), max_size=5)) if kept else []
    return tokens, draw(st.permutations(repeated))


def full_text(tokens: list[int]) -> str:
    return "".join(token_text(t, i) for i, t in enumerate(tokens))


def check_exactly_once(tokens: list[int], r: Reassembler, pieces: list[TokenPiece]) -> None:
    """Finish ``r`` with the result: every token once, in order, text equal to the output's."""
    text = full_text(tokens)
    pieces.append(r.finish(tokens, text))
    at = 0
    for p in pieces:
        assert p.offset == at
        at += len(p.token_ids)
    assert [x for p in pieces for x in p.token_ids] == tokens
    assert "".join(p.text for p in pieces) == text
    # nothing after the result
    assert r.add(0, tokens, text, 1) == []


@settings(max_examples=400, deadline=None)
@given(deliveries())
def test_any_chunks_then_the_result_give_the_sequence_exactly_once(
    case: tuple[list[int], list[Chunk]],
) -> None:
    tokens, chunks = case
    text = full_text(tokens)
    r = Reassembler()
    pieces: list[TokenPiece] = []
    for offset, ids, t, attempt in chunks:
        got = r.add(offset, ids, t, attempt)
        pieces.extend(got)
        # at every moment: what was delivered is a prefix, ids and text alike
        assert r.token_ids == tokens[: r.received]
        assert text.startswith("".join(p.text for p in pieces))
    check_exactly_once(tokens, r, pieces)


# (request id, correlation id of its route or None, its tokens, the chunks sent for it)
Stream = tuple[str, str | None, list[int], list[Chunk]]


@st.composite
def shared_queue(draw: st.DrawFn) -> tuple[list[Stream], list[tuple[bytes, str | None]]]:
    """Several requests streaming to one reply queue, each with the chunks of
    :func:`deliveries`; an agent packs whatever chunks are due at a flush into one message
    (cut into messages at random points, any requests' chunks together); then messages are
    lost, repeated and reordered (a failover: another agent's messages interleave)."""
    n = draw(st.integers(1, 5))
    streams: list[Stream] = []
    for i in range(n):
        tokens, chunks = draw(deliveries())
        # a route without a correlation id is matched by request id, as its reply is
        cid = None if draw(st.integers(0, 4)) == 0 else f"cid-{i}"
        streams.append((f"req-{i}", cid, tokens, chunks))
    # every chunk once, all requests interleaved; each request's own in its drawn order
    order = draw(st.permutations([i for i, s in enumerate(streams) for _ in s[3]]))
    taken = [0] * n
    due: list[BatchedChunk] = []
    for i in order:
        rid, cid, _, chunks = streams[i]
        offset, ids, text, attempt = chunks[taken[i]]
        taken[i] += 1
        due.append(
            BatchedChunk(
                correlation_id=cid,
                request_id=rid,
                offset=offset,
                token_ids=ids,
                text=text,
                attempt=attempt,
            )
        )
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(due) - 1)), max_size=6))))
    bounds = [0, *(c for c in cuts if c < len(due)), len(due)]
    messages = [encode_token_message(due[a:b]) for a, b in pairwise(bounds) if b > a]
    kept = [m for m in messages if draw(st.booleans()) or draw(st.booleans())]
    repeated = kept + draw(st.lists(st.sampled_from(kept), max_size=3)) if kept else []
    return streams, draw(st.permutations(repeated))


@settings(max_examples=300, deadline=None)
@given(shared_queue())
def test_requests_sharing_messages_each_get_their_sequence_exactly_once(
    case: tuple[list[Stream], list[tuple[bytes, str | None]]],
) -> None:
    streams, messages = case
    by_cid = {cid or rid: (rid, Reassembler(), []) for rid, cid, _, _ in streams}
    routed = 0
    for body, amqp_cid in messages:
        shape = json.loads(body)["type"]
        # a lone chunk is the single-chunk message every consumer reads, named by the AMQP
        # correlation id; several go in one batch, each naming its own
        chunks = decode_token_message(body, amqp_cid)
        assert shape == ("tokens" if len(chunks) == 1 else "tokens_batch")
        if shape == "tokens_batch":
            assert amqp_cid is None
        for cid, chunk in chunks:
            rid, r, pieces = by_cid[cid]
            assert chunk.request_id == rid  # routed to its own request's stream
            routed += 1
            pieces.extend(r.add(chunk.offset, chunk.token_ids, chunk.text, chunk.attempt))
            assert r.token_ids == next(s[2] for s in streams if s[0] == rid)[: r.received]
    assert routed >= len(messages)
    for rid, cid, tokens, _ in streams:
        _, r, pieces = by_cid[cid or rid]
        check_exactly_once(tokens, r, pieces)


def test_a_batch_is_decoded_in_order_and_a_single_chunk_as_before() -> None:
    a = BatchedChunk(correlation_id="c-a", request_id="a", offset=0, token_ids=[1], attempt=1)
    b = BatchedChunk(correlation_id=None, request_id="b", offset=4, token_ids=[2, 3], text="x")
    a2 = a.model_copy(update={"offset": 1, "token_ids": [9]})
    body, cid = encode_token_message([a, b, a2])
    assert cid is None and TokenBatch.model_validate_json(body).chunks == [a, b, a2]
    assert decode_token_message(body, "ignored") == [("c-a", a), ("b", b), ("c-a", a2)]
    # what agents before TokenBatch sent, and still send for a lone chunk
    old = TokenChunk(request_id="a", offset=0, token_ids=[1], attempt=1)
    assert encode_token_message([a]) == (old.model_dump_json().encode(), "c-a")
    assert decode_token_message(old.model_dump_json().encode(), "c-a") == [("c-a", old)]
    # its type field may be left out; a message of neither shape is refused
    untyped = b'{"request_id": "a", "offset": 0, "token_ids": [1]}'
    assert decode_token_message(untyped, None)[0][0] == "a"
    for bad in (
        b'{"type": "tokens_batch", "chunks": []}',
        b'{"type": "tokens", "request_id": "a", "offset": 0, "token_ids": [1], "x": 1}',
        b'{"type": "tokens_batch", "chunks": [{"request_id": "a", "offset": 0, "token_ids": []}]}',
        b"[]",
    ):
        with pytest.raises(ValidationError):
            decode_token_message(bad, "c")


def test_in_order_chunks_are_passed_through_with_their_text() -> None:
    tokens = [5, 6, 7, 8]
    r = Reassembler()
    assert r.add(*chunk(tokens, 0, 2, 1)) == [TokenPiece(0, [5, 6], "t5 t6")]
    assert r.add(*chunk(tokens, 2, 4, 1)) == [TokenPiece(2, [7, 8], " t7 t8")]
    assert r.finish(tokens, full_text(tokens)) == TokenPiece(4, [], "")


def test_a_gap_holds_later_chunks_until_it_fills() -> None:
    tokens = list(range(10, 20))
    r = Reassembler()
    assert r.add(*chunk(tokens, 5, 8, 1)) == []  # ahead: held
    assert r.add(*chunk(tokens, 0, 3, 1)) == [TokenPiece(0, [10, 11, 12], "t10 t11 t12")]
    got = r.add(*chunk(tokens, 3, 5, 1))
    assert got == [
        TokenPiece(3, [13, 14], " t13 t14"),
        TokenPiece(5, [15, 16, 17], " t15 t16 t17"),
    ]
    assert r.finish(tokens, full_text(tokens)) == TokenPiece(8, [18, 19], " t18 t19")


def test_a_resumed_attempt_yields_only_what_is_new_with_its_text() -> None:
    tokens = list(range(8))
    r = Reassembler()
    r.add(*chunk(tokens, 0, 3, 1))
    r.add(*chunk(tokens, 3, 5, 1))
    # the agent died; the request runs again from scratch, cut at other points
    assert r.add(*chunk(tokens, 0, 4, 2)) == []  # wholly below: a duplicate
    assert r.dropped == 1
    assert r.add(*chunk(tokens, 4, 7, 2)) == [TokenPiece(5, [5, 6], " t5 t6")]
    assert r.finish(tokens, full_text(tokens)) == TokenPiece(7, [7], " t7")


def test_untagged_straddling_chunk_keeps_its_ids_and_leaves_text_to_the_result() -> None:
    tokens = list(range(6))
    r = Reassembler()
    r.add(*chunk(tokens, 0, 3, None))
    assert r.add(*chunk(tokens, 1, 5, None)) == [TokenPiece(3, [3, 4], "")]
    assert r.finish(tokens, full_text(tokens)) == TokenPiece(5, [5], " t3 t4 t5")


def test_empty_and_negative_chunks_are_dropped() -> None:
    r = Reassembler()
    assert r.add(0, [], "", 1) == []
    assert r.add(-1, [1], "x", 1) == []
    assert r.dropped == 2
