"""The agent's feed budget (PullAdmission.feed_tokens, qlm agent --feed-tokens): a pull is held
at the agent and handed to the engine a few prompt tokens' worth each time the engine wants
work."""

from __future__ import annotations

import pytest

from qlm.admission import PullAdmission, SLOAdmissionGate


class _Engine:
    """A fake engine: it wants up to ``room`` requests while nothing waits in it (as every
    backend's ``wants()`` does), and starts what waits at its next iteration."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.waiting: list[str] = []
        self.started: list[str] = []

    def wants(self) -> int:
        return 0 if self.waiting else self.room

    def submit(self, request: str) -> None:
        self.waiting.append(request)

    def iterate(self) -> list[str]:
        fed, self.waiting = self.waiting, []
        self.started += fed
        return fed


# a request's name is its prompt length: "300" has 300 prompt tokens
def _agent(feed: int | None) -> PullAdmission[str]:
    return PullAdmission(None, need=lambda r, t: 0.0, key=str, feed_tokens=feed, tokens=int)


def _dispatch(agent: PullAdmission[str], engine: _Engine, requests: list[str]) -> None:
    for r in requests:
        agent.on_dispatch(r, engine.submit)


def _rounds(agent: PullAdmission[str], engine: _Engine, n: int) -> list[list[str]]:
    out = []
    for _ in range(n):
        agent.admit(engine.wants, engine.submit, 0.0)
        out.append(engine.iterate())
    return out


def test_without_a_budget_a_dispatch_goes_to_the_engine_at_once() -> None:
    engine, agent = _Engine(8), _agent(None)
    agent.granted(agent.credit_wanted(engine.wants()))
    _dispatch(agent, engine, ["100", "200", "300"])
    assert engine.waiting == ["100", "200", "300"] and not agent.held


def test_each_round_hands_over_what_fits_the_budget_in_dispatch_order() -> None:
    engine, agent = _Engine(8), _agent(512)
    agent.granted(6)
    pulled = ["300", "200", "100", "900", "50", "40"]
    _dispatch(agent, engine, pulled)
    assert not engine.waiting and len(agent.held) == 6  # held until the agent admits
    # 300 + 200 fit; 100 would not; 900 alone is over the budget but a round takes one always
    assert _rounds(agent, engine, 5) == [["300", "200"], ["100"], ["900"], ["50", "40"], []]
    assert engine.started == pulled


def test_a_budget_of_one_token_hands_over_one_request_a_round() -> None:
    engine, agent = _Engine(8), _agent(1)
    agent.granted(3)
    _dispatch(agent, engine, ["10", "20", "30"])
    assert _rounds(agent, engine, 4) == [["10"], ["20"], ["30"], []]


def test_a_round_never_exceeds_what_the_engine_wants() -> None:
    engine, agent = _Engine(2), _agent(10_000)
    agent.granted(2)
    _dispatch(agent, engine, ["10", "20", "30"])
    assert _rounds(agent, engine, 2) == [["10", "20"], ["30"]]


def test_nothing_is_fed_while_the_engine_wants_nothing() -> None:
    engine, agent = _Engine(0), _agent(1)
    agent.granted(3)
    _dispatch(agent, engine, ["10", "20", "30"])
    agent.admit(engine.wants, engine.submit, 0.0)
    assert not engine.waiting and len(agent.held) == 3
    assert agent.credit_wanted(engine.wants()) == 0  # a saturated engine gets no more


def test_credit_asks_for_about_one_more_round_held() -> None:
    engine, agent = _Engine(8), _agent(1_000)
    assert agent.credit_wanted(engine.wants()) == 1  # no prompt seen yet: one
    agent.granted(1)
    _dispatch(agent, engine, ["250"])
    # the budget over the mean prompt: four held would make a round
    assert agent.credit_wanted(engine.wants()) == 4 - 1 - 0
    agent.granted(3)
    assert agent.credit_wanted(engine.wants()) == 0  # owed, not asked again
    _dispatch(agent, engine, ["250", "250", "250"])
    agent.admit(engine.wants, engine.submit, 0.0)  # a round: all four (1,000 tokens) go
    assert engine.waiting == ["250"] * 4 and engine.wants() == 0
    # what the engine wanted before the round counts: a round's worth again
    assert agent.credit_wanted(engine.wants()) == 4
    agent.granted(4)
    assert agent.credit_wanted(engine.wants()) == 0


def test_credit_never_exceeds_what_the_engine_wants() -> None:
    engine, agent = _Engine(2), _agent(10_000)
    agent.granted(1)
    _dispatch(agent, engine, ["10"])
    assert agent.credit_wanted(engine.wants()) == 1  # 2 wanted, 1 held


def test_large_prompts_are_held_one_round_ahead() -> None:
    engine, agent = _Engine(8), _agent(512)
    agent.granted(1)
    _dispatch(agent, engine, ["2000"])
    assert agent.credit_wanted(engine.wants()) == 0  # one held is over a round already
    agent.admit(engine.wants, engine.submit, 0.0)
    assert agent.credit_wanted(engine.wants()) == 1  # nothing held: one


def test_a_held_request_can_be_evicted_before_the_engine_sees_it() -> None:
    engine, agent = _Engine(8), _agent(1)
    agent.granted(2)
    _dispatch(agent, engine, ["10", "20"])
    assert agent.take_held("20") == "20"
    assert _rounds(agent, engine, 2) == [["10"], []]


def test_a_budget_below_one_token_or_with_a_gate_is_refused() -> None:
    with pytest.raises(ValueError, match="feed_tokens"):
        _agent(0)
    with pytest.raises(ValueError, match="gate"):
        PullAdmission(
            SLOAdmissionGate(lambda n: 50.0), need=lambda r, t: 0.0, key=str, feed_tokens=512
        )


def test_a_request_dispatched_while_a_round_is_open_joins_it_if_it_fits() -> None:
    engine, agent = _Engine(8), _agent(512)
    agent.granted(3)
    _dispatch(agent, engine, ["100"])
    agent.admit(engine.wants, engine.submit, 0.0)  # a round opens: 100 goes
    _dispatch(agent, engine, ["300"])  # before the engine starts it: the round takes 300
    agent.admit(engine.wants, engine.submit, 0.0)
    _dispatch(agent, engine, ["200"])  # 200 is over what is left (112): the next round's
    agent.admit(engine.wants, engine.submit, 0.0)
    assert engine.iterate() == ["100", "300"]
    assert _rounds(agent, engine, 2) == [["200"], []]


def test_nothing_is_held_ahead_for_an_engine_left_without_room() -> None:
    """An engine that runs one request at a time: what it is handed fills it, so nothing is
    pulled to wait at the agent (committed to this engine) until it wants work again."""
    engine, agent = _Engine(1), _agent(512)
    agent.granted(agent.credit_wanted(engine.wants()))
    _dispatch(agent, engine, ["100"])
    agent.admit(engine.wants, engine.submit, 0.0)
    assert engine.waiting == ["100"]
    assert agent.credit_wanted(engine.wants()) == 0
    engine.iterate()  # it wants one again: one
    agent.admit(engine.wants, engine.submit, 0.0)
    assert agent.credit_wanted(engine.wants()) == 1
