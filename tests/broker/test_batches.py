"""The Files and Batch APIs end to end: the official ``openai`` client against the gateway,
which puts each batch line on a real broker, served by a real coordinator and a sim agent.

One cluster and one gateway (with the Batch API on a SQLite file) serve the module; the
restart test runs its own gateway processes (``qlm gateway``) on the same cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from qlm.catalog import ModelCatalog
from qlm.gateway.app import ApiKeys, GatewayServer, GatewaySettings, serve_gateway
from qlm.gateway.batches import BatchSettings
from qlm.tooling import localbroker
from qlm.tooling.demo import LocalCluster
from qlm.tooling.ports import free_loopback_port
from tests.e2e import running_cluster

KEY = "sk-qlm-test-alpha-0123456789"
OTHER_KEY = "sk-qlm-test-other-0123456789"
SMALL_KEY = "sk-qlm-test-small-0123456789"
TENANT, OTHER, SMALL = "alpha", "other", "small"
MODEL = "mistral-7b"
AGENT = {"agent_id": "bt", "models": [MODEL], "time_scale": 5.0}
KEYS = {KEY: TENANT, OTHER_KEY: OTHER, SMALL_KEY: SMALL}
MAX_FILE = 64 * 1024


@dataclass
class Stack:
    cluster: LocalCluster
    gateway: GatewayServer
    amqp_url: str
    database_url: str

    def openai(self, key: str = KEY) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=self.gateway.url + "/v1", api_key=key, max_retries=0)


def _settings(**kw: Any) -> BatchSettings:
    base: dict[str, Any] = {
        "files_max_bytes": MAX_FILE,
        "batch_quotas": {SMALL: 5},
        "batch_poll_s": 0.2,
        "batch_lease_s": 3.0,
    }
    return BatchSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def module_amqp_url(amqp_url: str) -> Iterator[str]:
    with localbroker.isolated_vhost(amqp_url) as url:
        yield url


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(
    module_amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    work = tmp_path_factory.mktemp("batches")
    database_url = f"sqlite+aiosqlite:///{work}/batches.db"
    async with running_cluster(module_amqp_url, work, [AGENT]) as cluster:
        gateway = await serve_gateway(
            module_amqp_url,
            keys=ApiKeys(KEYS),
            catalog=ModelCatalog(),
            settings=GatewaySettings(timeout_s=60),
            host="127.0.0.1",
            port=0,
            batch_database_url=database_url,
            batch_settings=_settings(),
        )
        try:
            yield Stack(cluster, gateway, module_amqp_url, database_url)
        finally:
            await gateway.stop()


def chat_line(custom_id: str, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"say {custom_id}"}],
            "max_tokens": max_tokens,
            **body,
        },
    }


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


async def run_batch(
    api: AsyncOpenAI,
    lines: list[Any],
    *,
    endpoint: str = "/v1/chat/completions",
    window: str = "1h",
    metadata: dict[str, str] | None = None,
) -> Any:
    uploaded = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return await api.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window=window,  # type: ignore[arg-type]
        metadata=metadata,
    )


async def wait_done(api: AsyncOpenAI, batch_id: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = await api.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.2)


async def file_lines(api: AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await api.files.content(file_id)
    return [json.loads(x) for x in content.text.splitlines() if x]


# --- the happy path ---------------------------------------------------------------------------


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_chat_batch_completes_with_output_and_error_files(stack: Stack) -> None:
    lines: list[Any] = [chat_line(f"req-{i}") for i in range(20)]
    lines.insert(3, "{not json")  # line 4: malformed; the rest proceeds
    lines.insert(7, chat_line("unknown-model", model="gpt-17"))
    lines.insert(9, {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"})
    lines.append(chat_line("wrong-url") | {"url": "/v1/completions"})
    async with stack.openai() as api:
        created = await run_batch(api, lines, metadata={"job": "nightly"})
        assert created.status == "in_progress" and created.object == "batch"
        assert created.request_counts is not None and created.request_counts.total == 24
        assert created.metadata == {"job": "nightly"}
        assert created.expires_at - created.created_at == 3600
        batch = await wait_done(api, created.id)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (20, 4)
        assert batch.completed_at is not None and batch.output_file_id and batch.error_file_id
        out = await file_lines(api, batch.output_file_id)
        err = await file_lines(api, batch.error_file_id)
        meta = await api.files.retrieve(batch.output_file_id)
        assert meta.purpose == "batch_output" and meta.bytes > 0

    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(20))
    first = out[0]
    assert first["id"].startswith("batch_req_") and first["error"] is None
    assert first["response"]["status_code"] == 200
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["usage"]["completion_tokens"] == 4
    assert first["response"]["request_id"].startswith("batch-")

    by_line = {e["error"]["line"]: e for e in err}
    assert sorted(by_line) == [4, 8, 10, 24]
    assert by_line[4]["custom_id"] is None and by_line[4]["error"]["code"] == "invalid_json_line"
    assert by_line[4]["error"]["message"].startswith("line 4: ")
    unknown = by_line[8]
    assert unknown["custom_id"] == "unknown-model"
    assert unknown["response"]["status_code"] in (400, 404)
    assert by_line[10]["error"]["code"] == "invalid_request_line"
    assert by_line[24]["error"]["code"] == "mismatched_url"


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_completions_batch_and_the_deadline_reaches_the_coordinator(stack: Stack) -> None:
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "Once upon", "max_tokens": 3},
        }
        for i in range(5)
    ]
    async with stack.openai() as api:
        created = await run_batch(api, lines, endpoint="/v1/completions", window="2h")
        batch = await wait_done(api, created.id)
        out = await file_lines(api, batch.output_file_id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert {o["response"]["body"]["object"] for o in out} == {"text_completion"}
    rid = out[0]["response"]["request_id"]
    from tests.e2e import store_record

    record = await store_record(stack.cluster.database_url, rid)
    assert record["tenant"] == TENANT and record["slo_class"] == "batch"
    # the deadline is the batch's: its creation time plus the window
    assert record["deadline"] == pytest.approx(created.created_at + 7200, abs=1.0)


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_files_and_listing_and_tenant_isolation(stack: Stack) -> None:
    async with stack.openai() as api, stack.openai(OTHER_KEY) as other:
        f = await api.files.create(file=("a.jsonl", jsonl([chat_line("x")])), purpose="batch")
        assert f.object == "file" and f.filename == "a.jsonl" and f.status == "processed"
        assert (await api.files.retrieve(f.id)).bytes == f.bytes
        assert (await api.files.content(f.id)).content == jsonl([chat_line("x")])
        with pytest.raises(openai.NotFoundError):
            await other.files.retrieve(f.id)
        with pytest.raises(openai.NotFoundError) as err:  # a batch of another tenant's file
            await other.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert err.value.param == "input_file_id"
        ids = []
        for _ in range(3):
            b = await api.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            ids.append(b.id)
        with pytest.raises(openai.NotFoundError):
            await other.batches.retrieve(ids[0])
        page = await api.batches.list(limit=2)
        assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
        listed = [b.id async for b in api.batches.list(limit=2)]
        assert listed[:3] == ids[::-1]
        assert ids[0] not in [b.id async for b in other.batches.list()]
        deleted = await api.files.delete(f.id)
        assert deleted.deleted
        with pytest.raises(openai.NotFoundError):
            await api.files.retrieve(f.id)
        for b_id in ids:  # a deleted input file does not stop a batch made of it
            assert (await wait_done(api, b_id)).status == "completed"


# --- cancel -----------------------------------------------------------------------------------


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_cancel_withdraws_queued_lines(stack: Stack) -> None:
    # long requests: most are still queued when the cancel comes
    lines = [chat_line(f"long-{i}", max_tokens=1024) for i in range(100)]
    async with stack.openai() as api:
        created = await run_batch(api, lines)
        await asyncio.sleep(0.5)
        cancelling = await api.batches.cancel(created.id)
        assert cancelling.status in ("cancelling", "cancelled")
        batch = await wait_done(api, created.id, timeout=60)
        assert batch.status == "cancelled" and batch.cancelled_at is not None
        assert batch.request_counts is not None
        assert batch.request_counts.completed < 100  # not run to the end
        out = await file_lines(api, batch.output_file_id)
        assert len(out) == batch.request_counts.completed
        # cancelling again is a no-op; a finished batch cannot be cancelled
        assert (await api.batches.cancel(batch.id)).status == "cancelled"
        small = await wait_done(api, (await run_batch(api, [chat_line("q")])).id)
        with pytest.raises(openai.ConflictError) as err:
            await api.batches.cancel(small.id)
        assert err.value.code == "batch_not_cancellable"


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_bad_input_is_refused_with_openai_errors(stack: Stack) -> None:
    async with stack.openai() as api:
        dup = await api.files.create(
            file=("d.jsonl", jsonl([chat_line("a"), chat_line("b"), chat_line("a")])),
            purpose="batch",
        )
        with pytest.raises(openai.BadRequestError) as err:
            await api.batches.create(
                input_file_id=dup.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert err.value.code == "duplicate_custom_id" and "line 3" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            await api.batches.create(
                input_file_id=dup.id,
                endpoint="/v1/embeddings",
                completion_window="24h",
            )
        assert err.value.code == "invalid_endpoint" and err.value.param == "endpoint"
        with pytest.raises(openai.BadRequestError) as err:
            await api.batches.create(
                input_file_id=dup.id,
                endpoint="/v1/chat/completions",
                completion_window="soon",  # type: ignore[arg-type]
            )
        assert err.value.code == "invalid_completion_window"
        with pytest.raises(openai.NotFoundError):
            await api.batches.create(
                input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
            )
        big = b"x" * (MAX_FILE + 1)
        with pytest.raises(openai.APIStatusError) as status_err:
            await api.files.create(file=("big.jsonl", big), purpose="batch")
        assert status_err.value.status_code == 413
        assert status_err.value.code == "file_too_large"  # type: ignore[attr-defined]
        with pytest.raises(openai.BadRequestError) as err:
            await api.files.create(file=("f.jsonl", jsonl([chat_line("a")])), purpose="fine-tune")
        assert err.value.code == "invalid_purpose"
    async with httpx.AsyncClient(base_url=stack.gateway.url) as http:
        r = await http.get("/v1/batches", headers={"Authorization": "Bearer wrong-key-xxxxxxxx"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.broker
@pytest.mark.asyncio(loop_scope="module")
async def test_per_tenant_quota_of_queued_batch_requests(stack: Stack) -> None:
    async with stack.openai(SMALL_KEY) as api:
        f = await api.files.create(
            file=("q.jsonl", jsonl([chat_line(f"q{i}", max_tokens=512) for i in range(4)])),
            purpose="batch",
        )
        first = await api.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h"
        )
        with pytest.raises(openai.RateLimitError) as err:  # 4 queued + 4 more > 5
            await api.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h"
            )
        assert err.value.code == "batch_queue_limit_exceeded"
        assert "limit is 5" in err.value.message
        await wait_done(api, first.id)
        # answered: the quota is free again
        second = await api.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h"
        )
        assert (await wait_done(api, second.id)).status == "completed"


# --- restarts ---------------------------------------------------------------------------------


class GatewayProcess:
    """``qlm gateway`` as a child process (so it can be SIGKILLed)."""

    def __init__(self, amqp_url: str, database_url: str, workdir: Path) -> None:
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "QLM_AMQP_URL": amqp_url,
            "QLM_GATEWAY_API_KEYS": json.dumps(KEYS),
            "QLM_GATEWAY_DATABASE_URL": database_url,
            "QLM_GATEWAY_PORT": str(self.port),
            "QLM_GATEWAY_BATCH_LEASE_S": "2",
            "QLM_GATEWAY_BATCH_POLL_S": "0.2",
            "QLM_GATEWAY_BATCH_PUBLISH_CHUNK": "100",
            "QLM_LOG_LEVEL": "info",
        }
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def spawn(self) -> None:
        self.starts += 1
        log = open(self.workdir / f"gateway-{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qlm.cli", "gateway"], env=self.env, stdout=log, stderr=log
        )

    async def start(self) -> None:
        self.spawn()
        assert self.proc is not None
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient() as http:
            while True:
                try:
                    if (await http.get(self.url + "/healthz")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                assert self.proc.poll() is None, self.logs()
                assert time.monotonic() < deadline, self.logs()
                await asyncio.sleep(0.2)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace")[-3000:] for p in self.workdir.glob("*.log"))


async def _answered(api: AsyncOpenAI, batch_id: str) -> int:
    b = await api.batches.retrieve(batch_id)
    assert b.request_counts is not None
    return b.request_counts.completed + b.request_counts.failed


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_killed_gateway_batch_completes_each_line_exactly_once(
    stack: Stack, tmp_path: Path
) -> None:
    n = 600
    gw = GatewayProcess(stack.amqp_url, f"sqlite+aiosqlite:///{tmp_path}/gw.db", tmp_path)
    await gw.start()
    try:
        api = AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=3)
        created = await run_batch(api, [chat_line(f"k{i}", max_tokens=16) for i in range(n)])
        kills = 0
        while kills < 2:  # killed twice mid-batch, restarted each time
            await asyncio.sleep(1.5)
            if await _answered(api, created.id) >= n:
                break
            gw.kill()
            kills += 1
            await asyncio.sleep(1.0)  # replies pile up in the durable reply queue meanwhile
            await gw.start()
        batch = await wait_done(api, created.id, timeout=180)
        out = await file_lines(api, batch.output_file_id)
        await api.close()
    except BaseException:
        print(gw.logs())
        raise
    finally:
        gw.stop()
    assert kills >= 1, "the batch finished before the gateway could be killed"
    assert batch.status == "completed"
    counted = Counter(o["custom_id"] for o in out)
    assert len(counted) == n and set(counted.values()) == {1}
    assert batch.request_counts is not None and batch.request_counts.completed == n


@pytest.mark.broker
@pytest.mark.slow
async def test_chaos_gateway_coordinator_and_agent_killed_mid_batch(
    isolated_amqp_url: str, tmp_path: Path
) -> None:
    """The issue's chaos run: a 2,000-line batch; the gateway, the coordinator and an agent are
    SIGKILLed mid-batch and restarted. The batch completes; every line is in the output once."""
    n = 2000
    agents = [
        {"agent_id": "c1", "models": [MODEL], "time_scale": 10.0},
        {"agent_id": "c2", "models": [MODEL], "time_scale": 10.0},
    ]
    async with running_cluster(isolated_amqp_url, tmp_path / "cluster", agents) as cluster:
        gw = GatewayProcess(isolated_amqp_url, f"sqlite+aiosqlite:///{tmp_path}/gw.db", tmp_path)
        await gw.start()
        try:
            api = AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=3)
            lines = [chat_line(f"x{i}", max_tokens=32) for i in range(n)]
            created = await run_batch(api, lines)
            await asyncio.sleep(2.0)
            assert await _answered(api, created.id) < n, "finished before the chaos began"
            gw.kill()  # the gateway ...
            assert cluster.coordinator is not None
            cluster.coordinator.send_signal(signal.SIGKILL)  # ... the coordinator ...
            cluster.coordinator.wait(timeout=10)
            cluster.kill_agent("c1")  # ... and an agent, at once
            await asyncio.sleep(1.0)
            cluster.coordinator = cluster._spawn("coordinator-2", ["coordinator"])
            await gw.start()
            # The agent comes back at once, under the same instance id, while the new
            # coordinator may still hold the dead process's last heartbeat: its incarnation
            # tells the two apart (without it, one run in three stalled on dispatches the new
            # coordinator counted in transit to the dead process).
            cluster.start_agent(agents[0])
            batch = await wait_done(api, created.id, timeout=300)
            out = await file_lines(api, batch.output_file_id)
            err = await file_lines(api, batch.error_file_id)
            await api.close()
        except BaseException:
            print(gw.logs())
            raise
        finally:
            gw.stop()
    assert batch.status == "completed", batch
    counted = Counter(o["custom_id"] for o in out)
    assert err == [] and len(counted) == n and set(counted.values()) == {1}
