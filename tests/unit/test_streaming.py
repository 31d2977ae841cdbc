"""The dedupe and reorder logic of token streams (qlm/streaming.py): whatever chunks of a token
sequence arrive - reordered, duplicated, overlapping, from several attempts, some never - the
consumer gets the sequence exactly once, in order, and text that is always a prefix of the
output text and equals it at the end."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from qlm.streaming import Reassembler, TokenPiece

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
    pieces.append(r.finish(tokens, text))
    at = 0
    for p in pieces:
        assert p.offset == at
        at += len(p.token_ids)
    assert [x for p in pieces for x in p.token_ids] == tokens
    assert "".join(p.text for p in pieces) == text
    # nothing after the result
    assert r.add(0, tokens, text, 1) == []


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
