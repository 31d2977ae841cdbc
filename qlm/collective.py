"""Collective requests (Tempo): the stages of a request graph share a deadline derived by
matching the program's partial graph against finished programs of the same application.

A collective request - a tree-of-thought search, a RAG pipeline, a multi-agent program - is a
graph of LLM calls with one deadline for the whole (``program_slo_ms``, time to last token of
its final stage). Its calls carry ``stage`` (docs/protocol.md): the program id, its application
type, the stage id, the stages it comes after, and whether it is the last stage. Calls of one
stage run together; a stage starts when its first call arrives, and the stages it comes after
are complete from then on.

Each stage is a *super-node* (Tempo §4.1): its node weight is the output tokens of its calls,
the weight of the edge into it their input tokens. When a stage starts, the program's complete
stages so far (a sequence of N super-nodes, in the order they started) are compared with the
first N stages of every finished program of the same application that had more stages, by

    sim(G, H) = λ · mean_s exp(-(n_G(s) - n_H(s))² / 2σ_n²)
              + (1 - λ) · mean_s exp(-(e_G(s) - e_H(s))² / 2σ_e²)

on log(1 + tokens), λ = 0.5, σ the median absolute deviation of the library's stage weights
(at least 0.25): the digest's reading of what the paper leaves open. With H the most similar,
the new stage N+1 gets

    budget = (program deadline - now) × r_H(N+1) / Σ_{u > N} r_H(u)

where r_H(u) is the share of H's time spent in its stage u; every call of the stage shares
``now + budget`` as its deadline (or its own ``slo.e2e_ms`` if earlier). Without a longer
history graph the stage gets the whole remaining time (the program's deadline): documented
default.

Bad input, and what it gets: a stage that lists itself among the stages it comes after, or
whose ancestry loops back to it (a cycle), is refused with an ``invalid_graph`` error reply; a
stage that comes after a stage never seen is accepted (qlm does not enforce the order, the
producer submits a stage when it is ready); a program whose last stage never comes is
forgotten ``PROGRAM_GRACE_S`` after its deadline (no history is learnt from it) - its calls are
answered like any others, so nothing is ever stuck.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import structlog

from qlm.chains import CallDeadlines
from qlm.types import RequestMessage, StageInfo

log = structlog.get_logger(__name__)

LAMBDA = 0.5  # node vs edge similarity
MIN_SIGMA = 0.25  # in log(1 + tokens)
HISTORY_PER_APP = 1000  # finished programs kept per application type
PROGRAM_GRACE_S = 600.0  # an unfinished program is forgotten this long after its deadline
MAX_PROGRAMS = 100_000  # programs tracked at once (the oldest is forgotten beyond)


class GraphError(ValueError):
    """A stage that would make its program's graph cyclic."""


@dataclass(frozen=True)
class StageGraph:
    """A finished program: per stage in start order, its output tokens (node weight), input
    tokens (edge weight) and time (first arrival to last completion, seconds)."""

    app_type: str
    nodes: tuple[float, ...]
    edges: tuple[float, ...]
    durations: tuple[float, ...]

    @property
    def n_stages(self) -> int:
        return len(self.nodes)

    def ratios(self) -> np.ndarray:
        d = np.maximum(np.asarray(self.durations, dtype=np.float64), 1e-6)
        return d / d.sum()


@dataclass
class _Stage:
    stage_id: str
    after: tuple[str, ...]
    started_at: float
    deadline: float
    open: int = 0  # calls admitted, not finished
    input_tokens: float = 0.0
    output_tokens: float = 0.0
    last_finish: float | None = None


@dataclass
class _Program:
    program_id: str
    app_type: str
    started_at: float
    deadline: float
    stages: dict[str, _Stage] = field(default_factory=dict)  # in start order
    last_stage: str | None = None
    last_activity: float = 0.0


@dataclass(frozen=True)
class StageDeadline:
    deadline: float  # the stage's shared deadline (unix s)
    program_deadline: float
    matched: bool  # from a history graph (False: the whole remaining time)


class StageGraphLibrary:
    """Finished programs per application type, and the Gaussian-kernel matching."""

    def __init__(self, per_app: int = HISTORY_PER_APP) -> None:
        self.per_app = per_app
        self._graphs: dict[str, deque[StageGraph]] = {}

    def add(self, graph: StageGraph) -> None:
        if graph.n_stages:
            self._graphs.setdefault(graph.app_type, deque(maxlen=self.per_app)).append(graph)

    def graphs(self, app_type: str) -> list[StageGraph]:
        return list(self._graphs.get(app_type, ()))

    def _sigmas(self, graphs: Iterable[StageGraph]) -> tuple[float, float]:
        nodes = np.log1p([n for g in graphs for n in g.nodes])
        edges = np.log1p([e for g in graphs for e in g.edges])

        def mad(x: np.ndarray) -> float:
            if x.size == 0:
                return MIN_SIGMA
            return max(MIN_SIGMA, float(np.median(np.abs(x - np.median(x)))))

        return mad(nodes), mad(edges)

    def match(
        self, app_type: str, nodes: list[float], edges: list[float]
    ) -> tuple[StageGraph, float] | None:
        """The most similar finished program with more stages than the partial graph, and its
        similarity; None when there is none."""
        n = len(nodes)
        longer = [g for g in self.graphs(app_type) if g.n_stages > n]
        if not longer:
            return None
        if n == 0:
            return longer[-1], 1.0  # nothing to compare yet: the latest longer program
        sn, se = self._sigmas(self.graphs(app_type))
        gn, ge = np.log1p(nodes), np.log1p(edges)
        best: tuple[StageGraph, float] | None = None
        for h in longer:
            hn, he = np.log1p(h.nodes[:n]), np.log1p(h.edges[:n])
            node_sim = float(np.mean(np.exp(-((gn - hn) ** 2) / (2 * sn**2))))
            edge_sim = float(np.mean(np.exp(-((ge - he) ** 2) / (2 * se**2))))
            sim = LAMBDA * node_sim + (1 - LAMBDA) * edge_sim
            if best is None or sim > best[1]:
                best = (h, sim)
        return best


class CollectiveTracker:
    """The coordinator's view of the collective programs in flight."""

    def __init__(self, library: StageGraphLibrary | None = None) -> None:
        self.library = library or StageGraphLibrary()
        self.programs: dict[str, _Program] = {}
        self.finished_programs = 0
        self.matched_stages = 0

    def check(self, request: RequestMessage) -> None:
        """Refuse a stage that makes its program's graph cyclic (:class:`GraphError`)."""
        info = request.stage
        if info is None:
            return
        if info.stage_id in info.after:
            raise GraphError(f"stage {info.stage_id!r} comes after itself")
        prog = self.programs.get(info.program_id)
        if prog is None:
            return
        known = prog.stages.get(info.stage_id)
        if known is not None:
            if set(info.after) != set(known.after):
                raise GraphError(
                    f"stage {info.stage_id!r} of program {info.program_id!r} was declared "
                    f"after {sorted(known.after)}, now after {sorted(info.after)}"
                )
            return
        # a cycle: one of the stages it comes after descends from it (already started stages
        # cannot, a stage starts once; so look for it among their ancestors)
        seen: set[str] = set()
        todo = list(info.after)
        while todo:
            sid = todo.pop()
            if sid == info.stage_id:
                raise GraphError(
                    f"stage {info.stage_id!r} of program {info.program_id!r} closes a cycle"
                )
            if sid in seen:
                continue
            seen.add(sid)
            parent = prog.stages.get(sid)
            if parent is not None:
                todo.extend(parent.after)

    def admit(self, request: RequestMessage, submitted: float, now: float) -> StageDeadline:
        """The shared deadline of the call's stage (computed when the stage starts)."""
        assert request.stage is not None
        e2e_s = request.slo.e2e_ms / 1000 if request.slo.e2e_ms else None
        return self.admit_stage(request.stage, request.prompt_tokens(), e2e_s, submitted, now)

    def admit_stage(
        self,
        info: StageInfo,
        prompt_tokens: int,
        e2e_s: float | None,
        submitted: float,
        now: float,
    ) -> StageDeadline:
        """:meth:`admit` on the call's parts (the simulator's entry; times on one clock, with
        ``info.program_started_at`` on it too when given)."""
        prog = self.programs.get(info.program_id)
        if prog is None:
            started = info.program_started_at if info.program_started_at is not None else submitted
            slo_s = info.program_slo_ms / 1000 if info.program_slo_ms else (e2e_s or 0.0)
            deadline = started + slo_s if slo_s > 0 else math.inf
            prog = _Program(info.program_id, info.app_type, started, deadline)
            self.programs[info.program_id] = prog
            if len(self.programs) > MAX_PROGRAMS:
                oldest = next(iter(self.programs))
                log.warning("collective_program_dropped", program_id=oldest, reason="capacity")
                del self.programs[oldest]
        prog.last_activity = now
        stage = prog.stages.get(info.stage_id)
        matched = False
        if stage is None:
            deadline, matched = self._stage_deadline(prog, now)
            stage = _Stage(info.stage_id, tuple(info.after), now, deadline)
            prog.stages[info.stage_id] = stage
        if info.last_stage:
            prog.last_stage = info.stage_id
        stage.open += 1
        stage.input_tokens += prompt_tokens
        return StageDeadline(stage.deadline, prog.deadline, matched)

    def _stage_deadline(self, prog: _Program, now: float) -> tuple[float, bool]:
        if not math.isfinite(prog.deadline):
            return math.inf, False
        remaining = prog.deadline - now
        if remaining <= 0:
            return prog.deadline, False  # late: the program's (passed) deadline
        done = list(prog.stages.values())
        hit = self.library.match(
            prog.app_type, [s.output_tokens for s in done], [s.input_tokens for s in done]
        )
        if hit is None:
            return prog.deadline, False
        graph, _ = hit
        r = graph.ratios()
        n = len(done)
        share = float(r[n] / r[n:].sum()) if r[n:].sum() > 0 else 1.0
        self.matched_stages += 1
        return now + remaining * share, True

    def finished(self, request: RequestMessage, output_tokens: int, now: float) -> bool | None:
        """A call was answered. Returns whether its program met its deadline when this call
        ended the program (its last stage has no open call left), else None."""
        if request.stage is None:
            return None
        return self.finished_stage(request.stage, output_tokens, now)

    def finished_stage(self, info: StageInfo, output_tokens: int, now: float) -> bool | None:
        """:meth:`finished` on the call's stage."""
        prog = self.programs.get(info.program_id)
        stage = None if prog is None else prog.stages.get(info.stage_id)
        if prog is None or stage is None:
            return None  # forgotten (expired) meanwhile
        stage.open = max(0, stage.open - 1)
        stage.output_tokens += output_tokens
        stage.last_finish = now
        prog.last_activity = now
        if prog.last_stage is None or any(s.open for s in prog.stages.values()):
            return None
        graph = StageGraph(
            prog.app_type,
            tuple(s.output_tokens for s in prog.stages.values()),
            tuple(s.input_tokens for s in prog.stages.values()),
            tuple(
                max(0.0, (s.last_finish or s.started_at) - s.started_at)
                for s in prog.stages.values()
            ),
        )
        self.library.add(graph)
        del self.programs[prog.program_id]
        self.finished_programs += 1
        return now <= prog.deadline

    def expire(self, now: float) -> list[str]:
        """Forget programs past their deadline + grace with nothing running (their last stage
        never came, or never finished)."""
        gone = [
            pid
            for pid, p in self.programs.items()
            if now
            > max(p.deadline if math.isfinite(p.deadline) else 0.0, p.last_activity)
            + PROGRAM_GRACE_S
            and not any(s.open for s in p.stages.values())
        ]
        for pid in gone:
            log.info("collective_program_expired", program_id=pid)
            del self.programs[pid]
        return gone


def stage_call_deadlines(sd: StageDeadline, own: CallDeadlines, now: float) -> CallDeadlines:
    """A call of a collective program: its stage's shared deadline (or its own, if earlier),
    judged against that; the program's deadline is its task deadline."""
    stage = sd.deadline if math.isfinite(sd.deadline) else None
    program = sd.program_deadline if math.isfinite(sd.program_deadline) else None
    candidates = [d for d in (own.deadline, stage) if d is not None]
    deadline = min(candidates) if candidates else None
    late = deadline is not None and deadline <= now
    return CallDeadlines(deadline, own.ttft_deadline, own.priority, program, late, deadline)
