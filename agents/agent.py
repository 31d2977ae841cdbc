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
import structlog
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from pydantic import ValidationError

from agents.engine import EngineBackend, EngineOutput, EngineRequest
from qlm.control import (
    Completion,
    Dispatch,
    Failure,
    Goodbye,
    Heartbeat,
    InstanceInfo,
    InstanceStatus,
    Pull,
)
from qlm.topology import (
    CONTROL_EXCHANGE,
    COORDINATOR_ROUTING_KEY,
    LIVE_ROUTING_KEY,
    declare_agent_queue,
)
from qlm.types import CONTENT_TYPE

log = structlog.get_logger(__name__)


@dataclass
class HostedInstance:
    info: InstanceInfo
    engine: EngineBackend
    owed: int = 0  # credit granted to the coordinator and not yet used by a dispatch
    dispatches: dict[str, Dispatch] = field(default_factory=dict)  # request_id -> dispatch


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
    ) -> None:
        self.amqp_url = amqp_url
        self.agent_id = agent_id or f"agent-{uuid.uuid4().hex[:8]}"
        self.heartbeat_interval_s = heartbeat_interval_s
        self.pull_interval_s = pull_interval_s
        self.instances: dict[str, HostedInstance] = {}
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
            )
            self.instances[iid] = HostedInstance(info=info, engine=engine)
        self.log = log.bind(agent_id=self.agent_id)
        self._conn: AbstractRobustConnection | None = None
        self._pub: AbstractChannel | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self.completed = 0

    async def start(self) -> None:
        self._conn = await aio_pika.connect_robust(
            self.amqp_url, client_properties={"connection_name": f"qlm-{self.agent_id}"}
        )
        self._pub = await self._conn.channel(publisher_confirms=True)
        sub = await self._conn.channel()
        await sub.set_qos(prefetch_count=1000)
        queue = await declare_agent_queue(sub, self.agent_id)
        await queue.consume(self._on_dispatch, no_ack=False)
        for inst in self.instances.values():
            inst.engine.set_capacity_listener(self._wake.set)
            await inst.engine.start(self._make_output_handler(inst))
        await self._send_heartbeat()
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._pull_loop()),
        ]
        self.log.info("agent_started", instances=list(self.instances))

    async def stop(self, *, graceful: bool = True) -> None:
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
        if self._conn is not None:
            await self._conn.close()
        self.log.info("agent_stopped", completed=self.completed)

    async def _publish(self, body: str, *, persistent: bool = False, live: bool = False) -> None:
        """Completions and goodbyes go to the durable control queue (persistent); heartbeats
        and pulls (``live``) to the transient one."""
        assert self._pub is not None
        exchange = await self._pub.get_exchange(CONTROL_EXCHANGE, ensure=False)
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

    # ------------------------------------------------------------------ dispatches
    async def _on_dispatch(self, message: AbstractIncomingMessage) -> None:
        async with message.process(requeue=False, ignore_processed=True):
            try:
                d = Dispatch.model_validate_json(message.body)
            except ValidationError as exc:
                self.log.warning("bad_dispatch", error=str(exc)[:300])
                return
            inst = self.instances.get(d.instance_id)
            if inst is None:
                self.log.warning("dispatch_for_unknown_instance", instance_id=d.instance_id)
                return
            inst.owed = max(0, inst.owed - 1)
            req = d.request
            inst.dispatches[req.request_id] = d
            prompt_ids = req.prompt_token_ids
            inst.engine.submit(
                EngineRequest(
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
                )
            )
            self._wake.set()

    def _make_output_handler(self, inst: HostedInstance) -> Any:
        async def on_output(out: EngineOutput) -> None:
            d = inst.dispatches.pop(out.request_id, None)
            self._wake.set()
            if d is None:
                self.log.warning("output_without_dispatch", request_id=out.request_id)
                return
            if out.error is not None:
                msg: Completion | Failure = Failure(
                    agent_id=self.agent_id,
                    instance_id=inst.info.instance_id,
                    dispatch_id=d.dispatch_id,
                    request_id=out.request_id,
                    message=out.error,
                )
            else:
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

        return on_output

    async def _report(self, msg: Completion | Failure) -> None:
        """Publish with a confirm; keep trying across reconnects: a result is never dropped."""
        body = msg.model_dump_json()
        delay = 0.1
        while True:
            try:
                await self._publish(body, persistent=True)
                self.completed += 1
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.log.warning("report_retry", request_id=msg.request_id, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    # ------------------------------------------------------------------ credit and heartbeats
    async def _pull_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.pull_interval_s)
            self._wake.clear()
            for inst in self.instances.values():
                want = inst.engine.wants() - inst.owed
                if want > 0:
                    inst.owed += want
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
                        inst.owed -= want
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
            statuses.append(
                InstanceStatus(
                    info=inst.info,
                    active_model=s.active_model,
                    running=s.running,
                    waiting=s.waiting,
                    kv_used_tokens=s.kv_used_tokens,
                    tokens_per_s=s.tokens_per_s,
                    in_flight=s.in_flight,
                    credit_outstanding=inst.owed,
                )
            )
        hb = Heartbeat(agent_id=self.agent_id, sent_at=time.time(), instances=statuses)
        await self._publish(hb.model_dump_json(), live=True)
