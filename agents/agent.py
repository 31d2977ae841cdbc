"""The agent: one process per GPU host, one engine instance per GPU.

It registers its instances through heartbeats (which also carry live engine stats), grants the
coordinator credit (``Pull``) whenever an engine has spare capacity, runs what it is dispatched,
and reports each finished request as a ``Completion`` published with a confirm. It never talks
to producers: the coordinator alone replies, which is what keeps replies exactly-once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from pydantic import ValidationError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from qlm.admission import OutputBudget, PullAdmission, SLOAdmissionGate, required_speed
from qlm.agents.engine import (
    EngineBackend,
    EngineOutput,
    EngineRequest,
    TokenCallback,
    TokenDelta,
)
from qlm.agents.token_streams import TokenStreams
from qlm.amqp import connect
from qlm.control import (
    BatchCap,
    Completion,
    Dispatch,
    Evict,
    Evicted,
    Failure,
    Goodbye,
    Heartbeat,
    InstanceInfo,
    InstanceStatus,
    ModelPlan,
    Pull,
    StreamResync,
    to_agent_adapter,
)
from qlm.topology import (
    CONTROL_EXCHANGE,
    COORDINATOR_ROUTING_KEY,
    LIVE_ROUTING_KEY,
    declare_agent_queue,
)
from qlm.types import CONTENT_TYPE

log = structlog.get_logger(__name__)

# A failed publish of a result or goodbye is tried again after 0.1 s, doubling up to 2 s: fast
# through a blip, and no busy loop while the broker is away for minutes.
PUBLISH_BACKOFF = wait_exponential(multiplier=0.1, max=2.0)


def _failure(state: RetryCallState) -> BaseException | None:
    """The exception of the attempt that just failed (for the retry's log line)."""
    return state.outcome.exception() if state.outcome is not None else None


@dataclass
class HostedInstance:
    info: InstanceInfo
    engine: EngineBackend
    # credit, dispatches received and the SLO gate's held requests: the pull rules the
    # simulator's agents share (qlm/admission.py)
    admission: PullAdmission[EngineRequest]
    dispatches: dict[str, Dispatch] = field(default_factory=dict)  # request_id -> dispatch
    model_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def in_engine(self) -> int:
        """Requests handed to the engine and not yet reported (running or waiting there): what
        a batch cap counts. Dispatches the gate holds back are not in it yet."""
        held = len(self.admission.held) + len(self.admission.best_effort)
        return max(0, len(self.dispatches) - held)


class Agent:
    def __init__(
        self,
        amqp_url: str,
        engines: list[EngineBackend],
        *,
        agent_id: str | None = None,
        engine_name: str = "sim",
        gpu_type: str = "A100-80GB",
        gpu_memory_gb: float = 80.0,
        heartbeat_interval_s: float = 0.5,
        pull_interval_s: float = 0.02,
        admission_gate: SLOAdmissionGate | None = None,
        cpu_memory_gb: float | None = None,
        output_budget: OutputBudget | None = None,
        feed_tokens: int | None = None,
        stream_fence_after_s: float | None = None,
    ) -> None:
        """``admission_gate``: SABER's SLO-aware admission in front of each engine (None: a
        dispatched request goes to the engine at once; the engine's own limits apply).
        ``feed_tokens``: the prompt tokens handed to an engine each time it wants work (about
        once an iteration; at least one request), the rest of a pull held here (None: a whole
        pull at once).
        ``output_budget``: the tokens the gate takes a request to need (default: its
        ``max_tokens``); one that learns is fed every completion.
        ``stream_fence_after_s``: silent this long between heartbeats, the agent stops the
        token streams of what it runs (the coordinator may have moved it;
        qlm/agents/token_streams.py); None: never."""
        self.amqp_url = amqp_url
        self.agent_id = agent_id or f"agent-{uuid.uuid4().hex[:8]}"
        self.incarnation = uuid.uuid4().hex  # this process (see Heartbeat.incarnation)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.pull_interval_s = pull_interval_s
        self.instances: dict[str, HostedInstance] = {}
        self.output_budget = output_budget or OutputBudget()
        need = _Need(self.output_budget)
        for i, engine in enumerate(engines):
            iid = f"{self.agent_id}-gpu{i}"
            info = InstanceInfo(
                instance_id=iid,
                agent_id=self.agent_id,
                engine=engine_name,
                gpu_type=gpu_type,
                gpu_memory_gb=gpu_memory_gb,
                models=list(engine.models),
                kv_capacity_tokens=engine.kv_capacity_tokens,
                max_batch_size=engine.max_batch_size,
                cpu_memory_gb=cpu_memory_gb,
            )
            admission = PullAdmission(
                admission_gate,
                need=need,
                key=_request_id,
                feed_tokens=feed_tokens,
                tokens=_prefill_tokens,
            )
            self.instances[iid] = HostedInstance(info=info, engine=engine, admission=admission)
        self.log = log.bind(agent_id=self.agent_id)
        self._conn: AbstractRobustConnection | None = None
        self._pub: AbstractChannel | None = None
        self._pub_lock = asyncio.Lock()
        # Strong references: a robust connection holds its channels only weakly and restores
        # after a reconnect only those still alive (with the queues declared through them).
        self._sub: AbstractChannel | None = None
        self._dispatch_queue: Any = None
        self.reconnects = 0
        self.goodbye_within_s = 60.0  # how long a reconnect's goodbye is tried
        self._tasks: list[asyncio.Task[None]] = []
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self.completed = 0
        self.evicted = 0
        # for the health port's /metrics (qlm/agents/health.py), read at scrape time
        self.started = False  # connected and every engine started: /readyz
        self.reports: dict[str, int] = {"completion": 0, "failure": 0, "evicted": 0}
        self.report_retries = 0
        self.evictions: dict[str, int] = {}
        self.admission_gate = admission_gate
        # token chunks of streamed requests, published straight to their producers
        self.token_streams = TokenStreams(fence_after_s=stream_fence_after_s, log_context=self.log)

    async def start(self) -> None:
        self._conn = await connect(self.amqp_url, name=f"qlm-{self.agent_id}")
        self._pub = await self._conn.channel(publisher_confirms=True)
        self._sub = await self._conn.channel()
        await self._sub.set_qos(prefetch_count=1000)
        self._dispatch_queue = await declare_agent_queue(self._sub, self.agent_id)
        await self._dispatch_queue.consume(self._on_dispatch, no_ack=False)
        self._conn.reconnect_callbacks.add(self._on_reconnected)
        await self.token_streams.start(self._conn)
        for inst in self.instances.values():
            inst.engine.set_capacity_listener(self._wake.set)
            inst.engine.set_token_listener(self._make_token_listener(inst))
            await inst.engine.start(self._make_output_handler(inst))
            caps = inst.engine.capabilities()
            inst.info = inst.info.model_copy(
                update={
                    # known only once the engine runs (vLLM sizes its KV cache at start)
                    "kv_capacity_tokens": inst.engine.kv_capacity_tokens,
                    "max_batch_size": inst.engine.max_batch_size,
                    "max_model_len": {
                        m: n for m, n in inst.engine.max_model_len.items() if m in inst.info.models
                    },
                    "capabilities": {
                        "exact_resume": caps.exact_resume,
                        "prefix_caching": caps.prefix_caching,
                        "kv_offload": caps.kv_offload,
                        "sleep_mode": caps.sleep_mode,
                        "token_streaming": caps.token_streaming,
                    },
                    "capability_notes": list(caps.notes),
                }
            )
            for note in caps.notes:
                self.log.info("engine_capability_off", instance_id=inst.info.instance_id, note=note)
        await self._send_heartbeat()
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._pull_loop()),
        ]
        self.started = True
        self.log.info("agent_started", instances=list(self.instances))

    def ready(self) -> bool:
        """Started (connected, engines running) and the broker connection is up now."""
        return self.started and self._conn is not None and not self._conn.is_closed

    async def stop(self, *, graceful: bool = True) -> None:
        self.started = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if graceful and self._pub is not None:
            with contextlib.suppress(Exception):
                await self._publish(Goodbye(agent_id=self.agent_id).model_dump_json())
        for inst in self.instances.values():
            await inst.engine.stop()
        await self.token_streams.stop()
        if self._conn is not None:
            await self._conn.close()
        self.log.info("agent_stopped", completed=self.completed)

    async def _publish(self, body: str, *, persistent: bool = False, live: bool = False) -> None:
        """Completions and goodbyes go to the durable control queue (persistent); heartbeats
        and pulls (``live``) to the transient one. A nack renews the publishing channel (see
        :meth:`_renew_publisher`) before it is raised to the caller, who publishes again."""
        channel = self._pub
        assert channel is not None
        exchange = await channel.get_exchange(CONTROL_EXCHANGE, ensure=False)
        try:
            await exchange.publish(
                aio_pika.Message(
                    body.encode(),
                    content_type=CONTENT_TYPE,
                    delivery_mode=(
                        aio_pika.DeliveryMode.PERSISTENT
                        if persistent
                        else aio_pika.DeliveryMode.NOT_PERSISTENT
                    ),
                ),
                routing_key=LIVE_ROUTING_KEY if live else COORDINATOR_ROUTING_KEY,
            )
        except aiormq.exceptions.PublishError:
            raise
        except aiormq.exceptions.DeliveryError:
            await self._renew_publisher(channel)
            raise

    async def _renew_publisher(self, broken: AbstractChannel) -> None:
        """Replace the publishing channel after the broker nacked a publish on it.

        RabbitMQ 3.10 (``rabbit_fifo_client:enqueue/3``): a channel's first publish to a quorum
        queue registers the channel with the queue, after a ``rpc:call`` to the node at the
        head of the member list the channel took from the queue's record - the leader when the
        channel first routed to it. If that node is down, the publish is rejected (a nack) and
        the channel's state is left as it was, so every later publish on that channel asks the
        same dead node again and is nacked too, for as long as the channel lives. That happens
        to a channel restored right after its node died, while the queue's record still names
        the dead leader: the agent's completions were nacked for 10 minutes while its
        heartbeats (a classic queue) went through, so it was never declared lost. Only a new
        channel (a new channel process on the broker) recovers, once a new leader is
        recorded; until then the new one may be nacked too and is replaced again."""
        async with self._pub_lock:
            if self._pub is not broken or self._conn is None:
                return  # another publisher renewed it already
            try:
                fresh = await self._conn.channel(publisher_confirms=True)
            except Exception as exc:  # e.g. reconnecting: the next nack tries again
                self.log.warning("publish_channel_renew_failed", error=repr(exc))
                return
            self._pub = fresh
            self.log.warning("publish_channel_renewed", reason="nacked")
        with contextlib.suppress(Exception):
            await broken.close()

    def _on_reconnected(self, *_: Any) -> None:
        """The connection came back (on this node or another): the exclusive dispatch queue
        died with the old one, and any dispatch still in it with it. The coordinator learns
        this from the broker's event exchange when it can, but that is best effort: its own
        event connection may have died with the same node (a cluster node killed), and a
        reconnect within the heartbeat timeout hides the gap from liveness checks. So the
        agent says it itself: a goodbye (the coordinator moves this agent's queued and
        running work elsewhere, as for a lost agent), then its heartbeats register it again.
        Results of work it was still running are accepted once, whichever arrives first;
        its token streams stop at once (the work they belong to runs elsewhere now, resumed
        after what was streamed: their chunks would contradict it)."""
        self.reconnects += 1
        self.token_streams.fence("reconnected")
        task = asyncio.create_task(self._announce_new_session())
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _announce_new_session(self) -> None:
        """Publish the goodbye, trying again for up to ``goodbye_within_s`` (then log it)."""
        body = Goodbye(agent_id=self.agent_id).model_dump_json()

        def retrying(state: RetryCallState) -> None:
            self.log.warning("reconnect_goodbye_retry", error=repr(_failure(state)))

        try:
            await AsyncRetrying(
                retry=retry_if_exception_type(Exception),  # never CancelledError: stop at once
                wait=PUBLISH_BACKOFF,
                stop=stop_after_delay(self.goodbye_within_s),
                before_sleep=retrying,
                reraise=True,
            )(self._publish, body, persistent=True)
        except Exception as exc:
            self.log.error("reconnect_goodbye_failed", error=repr(exc))
            return
        self.log.warning("agent_reconnected", reconnects=self.reconnects)

    # ------------------------------------------------------------------ orders
    async def _on_dispatch(self, message: AbstractIncomingMessage) -> None:
        """Every coordinator order arrives here; a malformed one is logged and dropped (the
        coordinator recovers a lost dispatch through the agent's heartbeats)."""
        async with message.process(requeue=False, ignore_processed=True):
            try:
                order = to_agent_adapter.validate_json(message.body)
            except ValidationError as exc:
                self.log.warning("bad_order", error=str(exc)[:300])
                return
            inst = self.instances.get(order.instance_id)
            if inst is None:
                self.log.warning("order_for_unknown_instance", instance_id=order.instance_id)
                return
            if isinstance(order, Dispatch):
                self._start_dispatch(inst, order)
            elif isinstance(order, Evict):
                await self._evict(inst, order)
            elif isinstance(order, ModelPlan):
                task = asyncio.create_task(self._apply_model_plan(inst, order))
                self._side_tasks.add(task)
                task.add_done_callback(self._side_tasks.discard)
            elif isinstance(order, BatchCap):
                # fewer requests in the engine from now on (none is stopped); the heartbeat
                # reports the cap, so the planner prices the instance at it
                inst.admission.cap = order.max_in_engine
                self.log.info("batch_cap", instance_id=order.instance_id, cap=order.max_in_engine)
                self._wake.set()
            elif isinstance(order, StreamResync):
                # a coordinator took over: tell its stream tap what these producers have
                await self.token_streams.resync(order.request_ids)

    def _start_dispatch(self, inst: HostedInstance, d: Dispatch) -> None:
        req = d.request
        inst.dispatches[req.request_id] = d
        self.token_streams.open(d)
        prompt_ids = req.prompt_token_ids
        request = EngineRequest(
            request_id=req.request_id,
            model=req.model,
            prompt_token_ids=list(prompt_ids) if prompt_ids is not None else None,
            prompt_tokens=req.prompt_tokens(),
            prompt_text=req.prompt,
            max_tokens=req.max_tokens,
            temperature=req.sampling.temperature,
            seed=req.sampling.seed,
            ignore_eos=req.sampling.ignore_eos,
            priority=req.priority,
            resume_token_ids=list(d.resume_token_ids),
            deadline=d.deadline,
            slo_class=req.slo.slo_class,
            stream=req.stream and bool(d.reply_routes),
        )
        inst.admission.on_dispatch(request, inst.engine.submit)
        self._admit(inst)
        self._wake.set()

    def _admit(self, inst: HostedInstance) -> None:
        """The SLO gate hands held requests to the engine (qlm/admission.py; nothing to do
        without a gate)."""
        inst.admission.admit(inst.engine.wants, inst.engine.submit, time.time())

    async def _evict(self, inst: HostedInstance, order: Evict) -> None:
        """Stop the attempt and hand its output so far back for an exact resume elsewhere or
        later. A request that already finished (its completion is on its way) is left alone."""
        d = inst.dispatches.get(order.request_id)
        if d is None or d.dispatch_id != order.dispatch_id:
            return
        held = inst.admission.take_held(order.request_id)
        if held is not None:
            ids = list(held.resume_token_ids)
        else:
            ids = await inst.engine.abort(order.request_id)
            ids = ids or list(d.resume_token_ids)
        if inst.dispatches.pop(order.request_id, None) is None:
            return  # the completion won the race while the engine aborted
        self.token_streams.close(order.request_id)
        # not its end: the request goes on elsewhere, after these tokens
        self.token_streams.release(order.request_id, final=False)
        inst.admission.forget(order.request_id)
        self.evicted += 1
        self.evictions[order.mode] = self.evictions.get(order.mode, 0) + 1
        self.log.info(
            "request_evicted",
            request_id=order.request_id,
            instance_id=inst.info.instance_id,
            mode=order.mode,
            generated=len(ids),
        )
        await self._report(
            Evicted(
                agent_id=self.agent_id,
                instance_id=inst.info.instance_id,
                dispatch_id=d.dispatch_id,
                request_id=order.request_id,
                output_token_ids=ids,
                reason=f"{order.mode}:{order.reason}",
            )
        )
        self._wake.set()

    async def _apply_model_plan(self, inst: HostedInstance, plan: ModelPlan) -> None:
        states = {m: s for m, s in plan.states.items() if m in inst.engine.models}
        async with inst.model_lock:
            try:
                await inst.engine.set_model_states(states)
                self.log.info(
                    "model_plan_applied", instance_id=inst.info.instance_id, states=states
                )
            except Exception as exc:
                self.log.warning(
                    "model_plan_failed", instance_id=inst.info.instance_id, error=repr(exc)
                )

    def _make_token_listener(self, inst: HostedInstance) -> TokenCallback:
        def on_tokens(delta: TokenDelta) -> None:
            # only the attempt this instance runs (a stale engine report is not streamed)
            if delta.request_id in inst.dispatches:
                self.token_streams.on_delta(delta)

        return on_tokens

    def _make_output_handler(self, inst: HostedInstance) -> Any:
        async def on_output(out: EngineOutput) -> None:
            d = inst.dispatches.pop(out.request_id, None)
            if d is not None:
                self.token_streams.close(out.request_id)
            inst.admission.forget(out.request_id)
            self._admit(inst)
            self._wake.set()
            if d is None:
                self.log.warning("output_without_dispatch", request_id=out.request_id)
                return
            msg: Completion | Failure | Evicted
            if out.error is not None and out.retryable:
                # the engine failed, not the request: requeue it to resume after its output
                msg = Evicted(
                    agent_id=self.agent_id,
                    instance_id=inst.info.instance_id,
                    dispatch_id=d.dispatch_id,
                    request_id=out.request_id,
                    output_token_ids=out.output_token_ids or list(d.resume_token_ids),
                    reason="engine_failed",
                )
            elif out.error is not None:
                msg = Failure(
                    agent_id=self.agent_id,
                    instance_id=inst.info.instance_id,
                    dispatch_id=d.dispatch_id,
                    request_id=out.request_id,
                    message=out.error,
                )
            else:
                self.output_budget.observe(d.request.slo.slo_class, len(out.output_token_ids))
                msg = Completion(
                    agent_id=self.agent_id,
                    instance_id=inst.info.instance_id,
                    dispatch_id=d.dispatch_id,
                    request_id=out.request_id,
                    output_token_ids=out.output_token_ids,
                    output_text=out.output_text,
                    finish_reason=out.finish_reason,  # type: ignore[arg-type]
                    prompt_tokens=out.prompt_tokens,
                    started_at=out.started_at,
                    first_token_at=out.first_token_at,
                    finished_at=out.finished_at,
                    preemptions=out.preemptions,
                )
            await self._report(msg)
            # the stream's end only once its result is safe (qlm/agents/token_streams.py)
            self.token_streams.release(out.request_id, final=isinstance(msg, Completion))

        return on_output

    async def _report(self, msg: Completion | Failure | Evicted) -> None:
        """Publish with a confirm; keep trying across reconnects: a result is never dropped."""
        body = msg.model_dump_json()

        def retrying(state: RetryCallState) -> None:
            self.report_retries += 1
            self.log.warning("report_retry", request_id=msg.request_id, error=repr(_failure(state)))

        await AsyncRetrying(
            retry=retry_if_exception_type(Exception),  # never CancelledError: stop at once
            wait=PUBLISH_BACKOFF,
            before_sleep=retrying,
        )(self._publish, body, persistent=True)
        self.completed += 1
        self.reports[msg.type] = self.reports.get(msg.type, 0) + 1

    # ------------------------------------------------------------------ credit and heartbeats
    async def _pull_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.pull_interval_s)
            self._wake.clear()
            for inst in self.instances.values():
                self._admit(inst)
                want = inst.admission.credit_wanted(inst.engine.wants(), inst.in_engine())
                if want > 0:
                    inst.admission.granted(want)
                    try:
                        await self._publish(
                            Pull(
                                agent_id=self.agent_id,
                                instance_id=inst.info.instance_id,
                                credit=want,
                            ).model_dump_json(),
                            live=True,
                        )
                    except Exception as exc:
                        inst.admission.grant_failed(want)
                        self.log.warning("pull_failed", error=repr(exc))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                await self._send_heartbeat()
            except Exception as exc:
                self.log.warning("heartbeat_failed", error=repr(exc))

    async def _send_heartbeat(self) -> None:
        statuses = []
        for inst in self.instances.values():
            s = inst.engine.stats()
            # an engine's context can change while it runs (an http agent's server restarted
            # with another --max-model-len): the coordinator places by the one it reports now
            context = {m: n for m, n in inst.engine.max_model_len.items() if m in inst.info.models}
            if context != inst.info.max_model_len:
                inst.info = inst.info.model_copy(update={"max_model_len": context})
            statuses.append(
                InstanceStatus(
                    info=inst.info,
                    active_model=s.active_model,
                    running=s.running,
                    waiting=s.waiting,
                    kv_used_tokens=s.kv_used_tokens,
                    tokens_per_s=s.tokens_per_s,
                    in_flight=s.in_flight + inst.admission.held_ids(),
                    credit_outstanding=inst.admission.owed,
                    dispatches_received=inst.admission.received,
                    warm_models=s.warm_models,
                    max_in_engine=inst.admission.cap,
                    engine_ok=s.serving,
                )
            )
        hb = Heartbeat(
            agent_id=self.agent_id,
            sent_at=time.time(),
            instances=statuses,
            incarnation=self.incarnation,
        )
        await self._publish(hb.model_dump_json(), live=True)
        self.token_streams.heartbeat_sent()


@dataclass(frozen=True)
class _Need:
    """SABER's reqSpd: tokens still to generate (``budget``'s reading) over the time left to
    the deadline."""

    budget: OutputBudget

    def __call__(self, request: EngineRequest, now: float) -> float:
        generated = len(request.resume_token_ids)
        left = self.budget.tokens_left(request.max_tokens - generated, generated, request.slo_class)
        return required_speed(left, request.deadline, now)


def _request_id(request: EngineRequest) -> str:
    return request.request_id


def _prefill_tokens(request: EngineRequest) -> int:
    """What the engine prefills to start it: the prompt and any output it resumes after."""
    return request.prompt_tokens + len(request.resume_token_ids)
