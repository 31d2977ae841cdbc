"""SLO-aware pull gate (SABER, Wang et al.; formulas in shared/reference/saber-cato-digest.md).

An agent pulls a request from its virtual queue only if the engine, running one more request,
is still predicted to be fast enough for it and for every request already running:

    f(L + 1) >= reqSpd(candidate)   and   f(L + 1) >= max over running reqSpd(a)

where f(L) is the per-request decode speed (tokens/s) with L requests running and
reqSpd(r, t) = remaining tokens / (deadline - t). A request's reqSpd is frozen when it is
admitted (as SABER does). A request that cannot make its deadline even alone,
reqSpd > f(1), or whose deadline passed, is *best effort*: it waits in a tier of its own, served
only when the high-priority queue is empty, as SABER serves its low-priority queue: nothing
in time is held and the coordinator left credit this agent granted unused (it had nothing
in time to send), and, unless ``strict``, only while it slows no running request below its
frozen speed.

f(L) comes from the engine performance model here; a measured USL fit (``qlm profile``) can
replace it: the gate only needs a callable. :meth:`SLOAdmissionGate.admits_in_time` is
SABER's check exactly, for callers that keep hopeless requests in a separate low-priority
queue (the simulator's ``pull_gate="saber"``).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

GATE_WINDOW = 8  # how far into the dispatched requests it holds back the gate looks
MEAN_TOKENS_WEIGHT = 0.1  # weight of the newest prompt in an agent's moving mean (feed_tokens)
UNBOUNDED_CREDIT = 1 << 30  # credit an agent without a queue manager keeps granted

R = TypeVar("R")


def required_speed(remaining_tokens: int, deadline: float | None, now: float) -> float:
    """Tokens/s a request needs from now on to finish by its deadline (0: no deadline;
    inf: the deadline has passed)."""
    if deadline is None or not math.isfinite(deadline):
        return 0.0
    if deadline <= now:
        return math.inf
    return remaining_tokens / (deadline - now)


# an agent that learns each class's mean output (``OutputBudget.learn``) takes it over the
# class's last LEARN_WINDOW completions, once it has LEARN_MIN of them
LEARN_WINDOW = 512
LEARN_MIN = 32


@dataclass
class OutputBudget:
    """SABER's ``maxTokens``: how many tokens a request is taken to generate. SABER's paper
    allows the request's ``max_tokens`` or "an estimate of the average output length per task
    type". With the caps clients send (``max_tokens`` far above most answers) the first marks
    most short-deadline requests hopeless on arrival (docs/benchmarks.md, ``saber``), so a
    deployment profiles each task's mean output and gives it here. ``expected``: SLO class ->
    mean output tokens; a class not in it (or no class) is taken at its ``max_tokens``.
    ``learn``: each completion seen (:meth:`observe`) updates its class's mean, over the last
    ``LEARN_WINDOW`` of the class once it has ``LEARN_MIN`` (a given mean holds until then)."""

    expected: dict[str, float] = field(default_factory=dict)
    learn: bool = False
    _window: dict[str, deque[int]] = field(default_factory=dict, repr=False)
    _sums: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.expected.items() if not (math.isfinite(v) and v > 0)}
        if bad:
            raise ValueError(f"expected output tokens must be finite and > 0: {bad}")

    def tokens_left(self, max_tokens_left: int, generated: int, slo_class: str | None) -> int:
        """Tokens still to generate: at most what the cap leaves; past its task's mean a
        request is taken to need one more token (its speed was frozen at admission)."""
        expected = None if slo_class is None else self.expected.get(slo_class)
        if expected is None:
            return max_tokens_left
        return max(1, min(max_tokens_left, math.ceil(expected) - generated))

    def observe(self, slo_class: str | None, output_tokens: int) -> None:
        """A completed request of ``slo_class`` generated ``output_tokens`` (learning only)."""
        if not self.learn or slo_class is None or output_tokens < 1:
            return
        window = self._window.setdefault(slo_class, deque(maxlen=LEARN_WINDOW))
        total = self._sums.get(slo_class, 0)
        if len(window) == window.maxlen:
            total -= window[0]
        window.append(output_tokens)
        self._sums[slo_class] = total = total + output_tokens
        if len(window) >= LEARN_MIN:
            self.expected[slo_class] = total / len(window)

    @classmethod
    def parse(cls, text: str) -> OutputBudget:
        """``CLASS=TOKENS,...``, with ``auto`` among them to learn from completions (the
        agent's ``--saber-expected-tokens``)."""
        expected: dict[str, float] = {}
        learn = False
        for item in filter(None, (part.strip() for part in text.split(","))):
            if item == "auto":
                learn = True
                continue
            name, sep, value = item.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"{item!r}: expected CLASS=TOKENS or auto")
            try:
                expected[name.strip()] = float(value)
            except ValueError:
                raise ValueError(f"{item!r}: {value!r} is not a number") from None
        return cls(expected, learn=learn)


@dataclass(frozen=True)
class SLOAdmissionGate:
    speed: Callable[[int], float]  # f(L): per-request tokens/s with L requests running

    def best_effort(self, req_speed: float) -> bool:
        return req_speed > self.speed(1)

    def admits(self, running: int, req_speed: float, floor: float) -> bool:
        """Whether one more request (needing ``req_speed``) may join ``running`` requests whose
        highest frozen required speed is ``floor``."""
        predicted = self.speed(running + 1)
        if predicted < floor:
            return False
        return self.best_effort(req_speed) or predicted >= req_speed

    def admits_in_time(self, running: int, req_speed: float, floor: float) -> bool:
        """SABER's Algorithm 1 check, with no best-effort pass (SABER demotes those requests
        to a low-priority queue instead): f(L + 1) >= reqSpd and f(L + 1) >= ``floor``."""
        predicted = self.speed(running + 1)
        return predicted >= req_speed and predicted >= floor


@dataclass(frozen=True)
class USLSpeedModel:
    """Per-request decode speed under concurrency, the Universal Scalability Law (Gunther):

        X(L) = lam * L / (1 + sigma (L - 1) + kappa L (L - 1))   (tokens/s of the engine)
        f(L) = X(L) / L = lam / (1 + sigma (L - 1) + kappa L (L - 1))

    ``lam`` is the single-request speed, ``sigma`` contention, ``kappa`` coherency. SABER fits
    it to (concurrency, per-request speed) points measured by profiling (``qlm profile``)."""

    lam: float
    sigma: float
    kappa: float
    r_squared: float | None = None  # of the fit, on the points it was fitted to

    def __post_init__(self) -> None:
        values = (self.lam, self.sigma, self.kappa)
        if not all(math.isfinite(v) for v in values) or self.lam <= 0:
            raise ValueError(f"USL parameters must be finite with lam > 0, got {values}")
        if self.sigma < 0 or self.kappa < 0:
            raise ValueError(f"USL sigma and kappa must be >= 0, got {values}")

    def __call__(self, concurrency: int) -> float:
        n = max(1, concurrency)
        return self.lam / (1.0 + self.sigma * (n - 1) + self.kappa * n * (n - 1))

    def throughput(self, concurrency: int) -> float:
        return max(1, concurrency) * self(concurrency)

    def to_dict(self) -> dict[str, float | None]:
        return {
            "lam": self.lam,
            "sigma": self.sigma,
            "kappa": self.kappa,
            "r_squared": self.r_squared,
        }

    @classmethod
    def from_dict(cls, data: dict[str, float | None]) -> USLSpeedModel:
        try:
            lam, sigma, kappa = (float(data[k]) for k in ("lam", "sigma", "kappa"))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a USL model needs numeric lam, sigma, kappa: {exc}") from exc
        r2 = data.get("r_squared")
        return cls(lam, sigma, kappa, None if r2 is None else float(r2))


def fit_usl(points: Sequence[tuple[int, float]]) -> USLSpeedModel:
    """Least-squares fit of f(L) to (concurrency, per-request tokens/s) points, as SABER does
    (bounded: sigma, kappa in [0, 1]). Needs at least three distinct concurrency levels."""
    pts = [(int(n), float(v)) for n, v in points]
    if any(n < 1 or not math.isfinite(v) or v <= 0 for n, v in pts):
        raise ValueError("USL points need concurrency >= 1 and a finite speed > 0")
    if len({n for n, _ in pts}) < 3:
        raise ValueError("fitting the USL needs points at >= 3 distinct concurrency levels")
    import numpy as np
    from scipy.optimize import curve_fit

    n = np.array([p[0] for p in pts], dtype=float)
    v = np.array([p[1] for p in pts], dtype=float)

    def f(x: Any, lam: float, sigma: float, kappa: float) -> Any:
        return lam / (1.0 + sigma * (x - 1.0) + kappa * x * (x - 1.0))

    p0 = [float(v.max()), 1e-2, 1e-4]
    params, _ = curve_fit(
        f, n, v, p0=p0, bounds=([1e-9, 0.0, 0.0], [np.inf, 1.0, 1.0]), maxfev=20_000
    )
    residual = float(((v - f(n, *params)) ** 2).sum())
    total = float(((v - v.mean()) ** 2).sum())
    r2 = 1.0 - residual / total if total > 0 else 1.0
    return USLSpeedModel(float(params[0]), float(params[1]), float(params[2]), r2)


@dataclass(eq=False)
class PullAdmission(Generic[R]):
    """One engine's side of the pull protocol, as its agent runs it: the credit granted to the
    coordinator and not yet used (``owed``), the dispatches received, and - with an SLO gate -
    the dispatched requests held back until the gate admits them (in dispatch order, which is
    the virtual queue's), those that can no longer meet their deadline (best effort, served
    only when nothing in time is held and the coordinator leaves granted credit unused) and
    the frozen required speed of each request in the engine. The live agent
    (:mod:`qlm.agents.agent`) and the simulator's agents both keep one per engine, so the pull
    and admission rules exist once.

    ``need(r, now)`` is r's required speed (:func:`required_speed` of what it has left);
    ``key(r)`` its request id. ``strict`` with an ``rng`` is SABER's Algorithm 1 as the paper
    states it: a random pick inside the window, :meth:`SLOAdmissionGate.admits_in_time`, and
    best-effort requests handed over unchecked when the high-priority queue is empty."""

    gate: SLOAdmissionGate | None
    need: Callable[[R, float], float]
    key: Callable[[R], str]
    window: int = GATE_WINDOW
    strict: bool = False
    rng: random.Random | None = None
    # no queue manager (the ``vllm`` baseline): credit for anything the coordinator holds,
    # whatever the engine wants, so every request reaches the engine at once
    unbounded: bool = False
    # the plan's batch cap (InstanceLSO.max_in_engine): at most this many requests in the
    # engine, running or waiting there; None: what the engine takes
    cap: int | None = None
    # Without a gate: each admission round (one starts whenever the engine wants work again,
    # its waiting queue emptied: about once an iteration) hands the engine held requests in
    # dispatch order while their prompt tokens (``tokens(r)``) stay within this budget, the
    # first one always. Credit keeps about one more round's worth held (the budget over the
    # mean prompt seen, at least one request, within the room the engine had left after the
    # round), so the next round does not wait for a broker round trip and little is committed
    # to this engine early.
    # None: every dispatch goes to the engine at once. A small budget keeps prompts from
    # filling an iteration with compute-bound prefill chunks that every running request waits
    # through (docs/benchmarks.md, "Pull size").
    feed_tokens: int | None = None
    tokens: Callable[[R], int] = field(default=lambda r: 1)
    owed: int = 0  # credit granted to the coordinator and not yet used by a dispatch
    received: int = 0  # dispatches received, ever (heartbeats report it)
    demoted: int = 0  # held requests moved to the best-effort tier, ever
    held: deque[R] = field(default_factory=deque)
    best_effort: deque[R] = field(default_factory=deque)
    frozen: dict[str, float] = field(default_factory=dict)
    # max-heap of (-frozen speed, request id); entries no longer in ``frozen`` are skipped
    _floor: list[tuple[float, str]] = field(default_factory=list)
    _room: int = 0  # the most the engine wanted at a feed since the last credit (feed_tokens)
    _fed: int = 0  # requests handed to the engine since the last credit (feed_tokens)
    _mean_tokens: float = 0.0  # moving mean of the dispatched prompts (feed_tokens)
    # the open feed round: prompt tokens and requests it may still take, requests it took
    _round_tokens: int = 0
    _round_slots: int = 0
    _round_fed: int = 0

    def __post_init__(self) -> None:
        if self.feed_tokens is not None and self.feed_tokens < 1:
            raise ValueError(f"feed_tokens must be >= 1, got {self.feed_tokens}")
        if self.feed_tokens is not None and self.gate is not None:
            raise ValueError("feed_tokens paces an agent without a gate (a gate admits itself)")

    def credit_wanted(self, engine_wants: int, in_engine: int = 0) -> int:
        """Credit to grant now, given how many requests the engine wants: what it wants less
        what is owed; under a batch cap, no more than leaves ``in_engine`` (the requests the
        engine holds, running or waiting) plus those held and owed within it; with a gate,
        only enough to keep ``window`` requests held for it to choose from. Demoted requests
        do not stop it: the requests in time behind them are SABER's high-priority queue, and
        the demoted wait until it is empty."""
        if self.unbounded:
            return max(0, UNBOUNDED_CREDIT - self.owed)
        want = engine_wants - self.owed
        if self.feed_tokens is not None:
            # the engine's room as the last feed saw it (a feed fills its waiting queue, so it
            # wants nothing right after), less what that feed handed over; within it, what is
            # held and owed tops up to about one round ahead. An engine left without room (one
            # that runs a request at a time) gets nothing held for it: held, a request would be
            # committed to it for a whole request's time
            room = max(engine_wants, self._room - self._fed)
            self._room = self._fed = 0
            want = min(room, len(self.held) + self._round_ahead()) - len(self.held) - self.owed
        if self.cap is not None:
            want = min(want, self.cap - in_engine - len(self.held) - self.owed)
        if self.gate is not None:
            want = min(want, self.window - len(self.held))
        return max(0, want)

    def granted(self, credit: int) -> None:
        self.owed += credit

    def grant_failed(self, credit: int) -> None:
        self.owed -= credit

    def on_dispatch(self, request: R, submit: Callable[[R], None]) -> None:
        """A dispatch arrived: it uses one credit, and goes to the engine at once (no gate)
        or is held for the gate (the caller runs :meth:`admit` next)."""
        self.owed = max(0, self.owed - 1)
        self.received += 1
        if self.feed_tokens is not None:
            size = self.tokens(request)
            mean = self._mean_tokens
            self._mean_tokens = size if mean == 0 else mean + MEAN_TOKENS_WEIGHT * (size - mean)
        if self.gate is None and self.feed_tokens is None:
            submit(request)
        else:
            self.held.append(request)

    def floor(self) -> float:
        """The highest frozen required speed of the requests in the engine."""
        heap, frozen = self._floor, self.frozen
        while heap:
            speed, rid = heap[0]
            if frozen.get(rid) == -speed:
                return -speed
            heapq.heappop(heap)
        return 0.0

    def _freeze(self, rid: str, speed: float) -> None:
        self.frozen[rid] = speed
        if speed > 0:
            heapq.heappush(self._floor, (-speed, rid))

    def admit(self, wants: Callable[[], int], submit: Callable[[R], None], now: float) -> None:
        """SABER's admission (shared/reference/saber-cato-digest.md, A2): while the engine
        wants work, hand it a held request only if the predicted per-request speed with one
        more running still meets that request's required speed and every running request's
        frozen one. Requests that cannot make their deadline even alone move to the best-effort
        tier, served only when the high-priority queue is empty (:meth:`in_time_queue_empty`)
        and, unless ``strict``, only while they slow no running request below its need."""
        gate = self.gate
        if gate is None:
            self._feed(wants, submit)
            return
        need = self.need
        for r in [r for r in self.held if gate.best_effort(need(r, now))]:
            self.held.remove(r)
            self.best_effort.append(r)
            self.demoted += 1
        floor = self.floor()
        # what the engine wants now, admitted in one go: it counts a submitted request as
        # waiting until its next iteration, so asking again after each would admit one per
        # iteration
        budget = wants()
        while budget > 0:
            budget -= 1
            running = len(self.frozen)
            chosen = self._choose(gate, running, floor, now)
            if (
                chosen is None
                and self.best_effort
                and self.in_time_queue_empty()
                and (self.strict or gate.speed(running + 1) >= floor)
            ):
                chosen = self.best_effort.popleft()
            if chosen is None:
                return
            speed = need(chosen, now)
            self._freeze(self.key(chosen), 0.0 if gate.best_effort(speed) else speed)
            floor = max(floor, self.frozen[self.key(chosen)])
            submit(chosen)

    def _round_ahead(self) -> int:
        """Requests to ask for so that one feed round's prompt tokens are held: the budget
        not yet covered, over the mean prompt; at least one while nothing is held."""
        assert self.feed_tokens is not None
        short = self.feed_tokens - sum(self.tokens(r) for r in self.held)
        if short <= 0:
            return 0
        if self._mean_tokens <= 0:
            return 1
        return max(1 if not self.held else 0, math.floor(short / self._mean_tokens))

    def _feed(self, wants: Callable[[], int], submit: Callable[[R], None]) -> None:
        """Without a gate: held requests in dispatch order, as many as the engine wanted when
        the round opened and as fit ``feed_tokens`` (the round's first always); what the
        engine wanted is remembered for the next credit."""
        if self.feed_tokens is None:
            return
        room = wants()
        self._room = max(self._room, room)  # the next credit's: what the engine wanted
        if room > 0:  # the engine wants work: a new round
            self._round_tokens, self._round_slots, self._round_fed = self.feed_tokens, room, 0
        # else the round fed last stays open until the engine starts it: a request dispatched
        # meanwhile joins it while it fits (dispatches arrive one by one)
        held = self.held
        while self._round_slots > 0 and held:
            size = self.tokens(held[0])
            if self._round_fed > 0 and size > self._round_tokens:
                return  # the round is full: the rest waits for the next
            self._round_tokens -= size
            self._round_slots -= 1
            self._round_fed += 1
            self._fed += 1
            submit(held.popleft())

    def in_time_queue_empty(self) -> bool:
        """SABER's high-priority queue is empty: no request in time is held here, and the
        coordinator left credit this agent granted unused, so it has none in time to send.
        An empty held window alone is not enough: the virtual queue behind it may hold many
        requests in time, and best-effort ones admitted meanwhile would slow them below their
        speed (they then miss too, are demoted in turn, and the gate stops protecting anyone)."""
        return not self.held and self.owed > 0

    def _choose(self, gate: SLOAdmissionGate, running: int, floor: float, now: float) -> R | None:
        window = list(self.held)[: self.window]
        if self.rng is not None:
            self.rng.shuffle(window)
        check = gate.admits_in_time if self.strict else gate.admits
        for r in window:
            if check(running, self.need(r, now), floor):
                self.held.remove(r)
                return r
        return None

    def forget(self, request_id: str) -> None:
        """The request left the engine (finished, evicted): its speed no longer binds."""
        self.frozen.pop(request_id, None)

    def take_held(self, request_id: str) -> R | None:
        """Take a request the engine has not seen yet out of the held tiers (an eviction)."""
        for tier in (self.held, self.best_effort):
            for r in tier:
                if self.key(r) == request_id:
                    tier.remove(r)
                    return r
        return None

    def held_ids(self) -> list[str]:
        return [self.key(r) for r in self.held] + [self.key(r) for r in self.best_effort]
