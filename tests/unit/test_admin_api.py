"""The admin HTTP API against an in-memory backend with real state.

The backend below implements :class:`qlm.admin.AdminBackend` the simple way (lists of request
dicts per instance), so each test can check what a call really changed, and that a refused
call changed nothing.
"""

from __future__ import annotations

import copy
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import structlog
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import qlm.admin
from qlm.admin import BackendUnavailable, create_admin_app, serve_admin
from qlm.metrics import CoordinatorMetrics

ADMIN = "adm-Tok3n_with.all-b64~chars+/x"
READ = "read-only-token-0123456789"
NOW = 1_700_000_000.0


def _req(rid: str, deadline: float, slo_class: str = "interactive") -> dict[str, Any]:
    return {
        "request_id": rid,
        "model": "llama-8b",
        "slo_class": slo_class,
        "deadline": deadline,
        "prompt_tokens": 100,
        "max_tokens": 50,
    }


class MemoryBackend:
    """Virtual queues as lists; drain moves a queue to the least-loaded other live instance."""

    def __init__(self) -> None:
        self.instances: dict[str, dict[str, Any]] = {
            iid: {
                "instance_id": iid,
                "agent_id": "host-1",
                "gpu_type": "A100-80GB",
                "models": ["llama-8b"],
                "status": "alive",
                "active_model": "llama-8b",
                "running": 2,
                "waiting": 0,
                "kv_used_tokens": 1000,
                "kv_capacity_tokens": 100_000,
                "last_seen": NOW,
            }
            for iid in ("gpu-a", "gpu-b")
        }
        self.queues: dict[str | None, list[dict[str, Any]]] = {
            "gpu-a": [_req("r1", NOW + 30), _req("r2", NOW + 10), _req("r3", NOW + 20)],
            "gpu-b": [_req("r4", NOW + 5, "batch")],
            None: [_req("r5", NOW + 1)],
        }
        self.plans: list[dict[str, Any]] = []
        self.broker_connected = True
        self.active = True
        self.fail_with: Exception | None = None
        self.cancelled: list[tuple[str, str | None]] = []

    def state(self) -> dict[str, Any]:
        return copy.deepcopy(
            {"instances": self.instances, "queues": self.queues, "plans": self.plans}
        )

    def list_instances(self) -> list[dict[str, Any]]:
        return [
            {**i, "queued": len(self.queues[i["instance_id"]])} for i in self.instances.values()
        ]

    def list_queues(self) -> list[dict[str, Any]]:
        return [
            {
                "instance_id": iid,
                "draining": iid is not None and self.instances[iid]["status"] == "draining",
                "requests": [{**r, "position": n} for n, r in enumerate(reqs)],
            }
            for iid, reqs in self.queues.items()
        ]

    async def get_request(self, request_id: str) -> dict[str, Any] | None:
        for iid, reqs in self.queues.items():
            for r in reqs:
                if r["request_id"] == request_id:
                    return {**r, "state": "queued", "instance_id": iid, "history": ["received"]}
        return None

    async def replan(self) -> dict[str, Any]:
        if self.fail_with is not None:
            raise self.fail_with
        if not self.active:
            raise BackendUnavailable("standby coordinator")
        start = time.perf_counter()
        for reqs in self.queues.values():
            reqs.sort(key=lambda r: r["deadline"])  # EDF
        plan = {
            "plan_id": uuid.uuid4().hex,
            "policy": "edf",
            "duration_s": time.perf_counter() - start,
            "n_requests": sum(len(q) for q in self.queues.values()),
            "n_instances": len(self.instances),
        }
        self.plans.append(plan)
        return plan

    def capacity_status(self) -> dict[str, Any] | None:
        return None

    def latest_plan(self) -> dict[str, Any] | None:
        if not self.plans:
            return None
        last = self.plans[-1]
        return {
            "plan_id": last["plan_id"],
            "policy": last["policy"],
            "created_at": 0.0,
            "n_requests": last["n_requests"],
            "queues": {iid: len(q) for iid, q in self.queues.items() if iid is not None},
        }

    async def drain(self, instance_id: str) -> dict[str, Any]:
        inst = self.instances[instance_id]  # KeyError for an unknown instance
        inst["status"] = "draining"
        others = [i for i, x in self.instances.items() if x["status"] == "alive"]
        target = min(others, key=lambda i: len(self.queues[i])) if others else None
        moved = self.queues[instance_id]
        self.queues[instance_id] = []
        self.queues[target].extend(moved)
        return {"instance_id": instance_id, "moved": len(moved), "status": "draining"}

    async def undrain(self, instance_id: str) -> dict[str, Any]:
        inst = self.instances[instance_id]
        if inst["status"] == "draining":
            inst["status"] = "alive"
        return {"instance_id": instance_id, "status": inst["status"]}

    async def cancel(self, request_id: str, reason: str | None = None) -> dict[str, Any]:
        for reqs in self.queues.values():
            for r in reqs:
                if r["request_id"] == request_id:
                    reqs.remove(r)
                    self.cancelled.append((request_id, reason))
                    return {"request_id": request_id, "outcome": "cancelled"}
        raise KeyError(request_id)

    def health(self) -> dict[str, Any]:
        ok = self.broker_connected and self.active
        return {
            "status": "ok" if ok else "degraded",
            "broker_connected": self.broker_connected,
            "store_ok": True,
            "active": self.active,
        }


@pytest.fixture
def backend() -> MemoryBackend:
    return MemoryBackend()


@pytest.fixture
def metrics() -> CoordinatorMetrics:
    return CoordinatorMetrics()


@pytest.fixture
async def client(
    backend: MemoryBackend, metrics: CoordinatorMetrics
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_admin_app(backend, token=ADMIN, read_token=READ, metrics=metrics)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as c:
        yield c


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


PROTECTED = [
    ("GET", "/v1/instances"),
    ("GET", "/v1/queues"),
    ("GET", "/v1/requests/r1"),
    ("POST", "/v1/replan"),
    ("POST", "/v1/instances/gpu-a/drain"),
    ("POST", "/v1/instances/gpu-a/undrain"),
    ("POST", "/v1/requests/r1/cancel"),
]
WRITES = [(m, p) for m, p in PROTECTED if m == "POST"]


def assert_error(resp: httpx.Response, status: int, code: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert isinstance(body["error"]["message"], str)
    if code is not None:
        assert body["error"]["code"] == code


# ---- auth -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), PROTECTED)
async def test_missing_token_is_401_and_changes_nothing(
    client: httpx.AsyncClient, backend: MemoryBackend, method: str, path: str
) -> None:
    before = backend.state()
    resp = await client.request(method, path)
    assert_error(resp, 401, "unauthenticated")
    assert resp.headers["www-authenticate"].startswith("Bearer")
    assert backend.state() == before


@pytest.mark.parametrize(
    "header",
    [
        "Basic YWRtaW46YWRtaW4=",
        f"Token {ADMIN}",
        "Bearer",
        "Bearer ",
        ADMIN,
        f"Bearer  {ADMIN}",
        f"Bearer {ADMIN} ",
        f"Bearer\t{ADMIN}",
        f"Bearer {ADMIN},x",
    ],
)
@pytest.mark.parametrize(("method", "path"), WRITES)
async def test_malformed_header_is_401_and_changes_nothing(
    client: httpx.AsyncClient, backend: MemoryBackend, method: str, path: str, header: str
) -> None:
    before = backend.state()
    resp = await client.request(method, path, headers={"Authorization": header})
    assert_error(resp, 401)
    assert resp.headers["www-authenticate"].startswith("Bearer")
    assert backend.state() == before


@pytest.mark.parametrize(("method", "path"), PROTECTED)
async def test_wrong_token_is_403_and_changes_nothing(
    client: httpx.AsyncClient, backend: MemoryBackend, method: str, path: str
) -> None:
    before = backend.state()
    for token in (ADMIN + "x", ADMIN[:-1], ADMIN.upper(), "nope"):
        resp = await client.request(method, path, headers=bearer(token))
        assert_error(resp, 403, "forbidden")
    assert backend.state() == before


async def test_read_token_may_read_but_not_write(
    client: httpx.AsyncClient, backend: MemoryBackend
) -> None:
    for method, path in PROTECTED:
        if method == "GET":
            resp = await client.get(path, headers=bearer(READ))
            assert resp.status_code == 200, (path, resp.text)
    before = backend.state()
    for method, path in WRITES:
        resp = await client.request(method, path, headers=bearer(READ))
        assert_error(resp, 403, "insufficient_scope")
        assert 'error="insufficient_scope"' in resp.headers["www-authenticate"]
    assert backend.state() == before


async def test_scheme_is_case_insensitive(client: httpx.AsyncClient) -> None:
    resp = await client.get("/v1/instances", headers={"Authorization": f"bEaReR {ADMIN}"})
    assert resp.status_code == 200


async def test_auth_is_checked_before_parameters(client: httpx.AsyncClient) -> None:
    # an unauthenticated caller learns nothing from validation errors
    assert (await client.get("/v1/queues?limit=-5")).status_code == 401


def test_app_refuses_to_start_without_a_token(
    backend: MemoryBackend, metrics: CoordinatorMetrics
) -> None:
    with pytest.raises(ValueError, match="QLM_ADMIN_TOKEN"):
        create_admin_app(backend, token=None, metrics=metrics)
    with pytest.raises(ValueError):
        create_admin_app(backend, token="", metrics=metrics)
    with pytest.raises(ValueError, match="differ"):
        create_admin_app(backend, token=ADMIN, read_token=ADMIN, metrics=metrics)
    bad = "has spaces and secret"
    with pytest.raises(ValueError) as info:
        create_admin_app(backend, token=bad, metrics=metrics)
    assert bad not in str(info.value)


async def test_allow_no_auth_opens_v1(backend: MemoryBackend, metrics: CoordinatorMetrics) -> None:
    app = create_admin_app(backend, token=None, metrics=metrics, allow_no_auth=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        assert (await c.get("/v1/instances")).status_code == 200
        assert (await c.post("/v1/replan")).status_code == 200
    assert len(backend.plans) == 1


async def test_tokens_are_never_logged(
    backend: MemoryBackend, metrics: CoordinatorMetrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an earlier test in the session may have configured logging (a CLI run filters below
    # warning): start from structlog's defaults, and give the configuration back afterwards
    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        await _log_admin_calls(backend, metrics, monkeypatch)
    finally:
        structlog.configure(**saved)


async def _log_admin_calls(
    backend: MemoryBackend, metrics: CoordinatorMetrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    with structlog.testing.capture_logs() as logs:
        # a fresh logger: the module's one may be cached from an earlier configure_logging()
        monkeypatch.setattr(qlm.admin, "log", structlog.get_logger("qlm.admin"))
        app = create_admin_app(backend, token=ADMIN, read_token=READ, metrics=metrics)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://a") as c:
            await c.post("/v1/replan", headers=bearer(ADMIN))
            await c.post("/v1/instances/gpu-a/drain", headers=bearer(ADMIN))
            await c.post("/v1/replan", headers=bearer(READ))
            await c.get("/v1/instances", headers=bearer("wrong-token"))
        create_admin_app(backend, token="Qz9sEcr", metrics=metrics)  # warns: short
    assert any(e["event"] == "admin_replan" for e in logs)
    text = repr(logs)
    for secret in (ADMIN, READ, "wrong-token", "Qz9sEcr"):
        assert secret not in text


_LATIN1 = st.characters(min_codepoint=0, max_codepoint=255)
_NEAR_MISSES = st.builds(
    lambda scheme, sep, cred, tail: scheme + sep + cred + tail,
    st.sampled_from(["Bearer", "bearer", "BEARER", " Bearer", "Basic", "Token", ""])
    | st.text(_LATIN1, max_size=8),
    st.sampled_from([" ", " ", "  ", "\t", "", ":"]),
    st.sampled_from([ADMIN, READ, ADMIN + "=", ADMIN[:-1], ADMIN.lower(), READ.upper(), ""])
    | st.text(_LATIN1, max_size=40),
    st.sampled_from(["", "", " ", "\t", "\x00", "x", "="]),
)
_HEADERS = st.one_of(_NEAR_MISSES, _NEAR_MISSES, st.text(_LATIN1, max_size=80))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=_HEADERS, write=st.booleans())
@example(header=f"Bearer {ADMIN} ", write=True)
@example(header=f"Bearer  {ADMIN}", write=True)
@example(header=f"Bearer\t{ADMIN}", write=True)
@example(header=f" Bearer {ADMIN}", write=False)
@example(header=f"bearer {READ}", write=False)
@example(header=f"Bearer {READ}", write=True)
async def test_only_exact_bearer_tokens_pass(header: str, write: bool) -> None:
    backend = MemoryBackend()
    app = create_admin_app(backend, token=ADMIN, read_token=READ, metrics=CoordinatorMetrics())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        # bytes: the header reaches the app exactly as generated
        headers = [(b"authorization", header.encode("latin-1"))]
        if write:
            resp = await c.post("/v1/replan", headers=headers)
        else:
            resp = await c.get("/v1/queues", headers=headers)
    allowed = [ADMIN] if write else [ADMIN, READ]
    exact = any(re.fullmatch("(?i:bearer) " + re.escape(t), header) for t in allowed)
    if exact:
        assert resp.status_code == 200
    else:
        assert resp.status_code in (401, 403), (header, resp.status_code)
        assert backend.plans == []
        if resp.status_code == 401:
            assert resp.headers["www-authenticate"].startswith("Bearer")


# ---- endpoints ------------------------------------------------------------------------------


async def test_healthz_and_readyz_need_no_auth_and_readyz_reports_degraded_as_503(
    client: httpx.AsyncClient, backend: MemoryBackend
) -> None:
    for path in ("/healthz", "/readyz"):
        resp = await client.get(path)
        assert resp.status_code == 200
        assert resp.json() == {
            "status": "ok",
            "broker_connected": True,
            "store_ok": True,
            "active": True,
        }
    backend.broker_connected = False
    resp = await client.get("/readyz")
    assert resp.status_code == 503
    assert resp.json()["status"] == "degraded"
    assert resp.json()["broker_connected"] is False
    # liveness: the process is alive and reconnects by itself; a restart would not help
    resp = await client.get("/healthz")
    assert resp.status_code == 200
    assert resp.json()["status"] == "degraded"


async def test_instances_and_queues(client: httpx.AsyncClient) -> None:
    instances = (await client.get("/v1/instances", headers=bearer(ADMIN))).json()
    assert {i["instance_id"]: i["queued"] for i in instances} == {"gpu-a": 3, "gpu-b": 1}
    queues = (await client.get("/v1/queues", headers=bearer(ADMIN))).json()
    by_id = {q["instance_id"]: q for q in queues}
    assert set(by_id) == {"gpu-a", "gpu-b", None}
    assert [r["request_id"] for r in by_id["gpu-a"]["requests"]] == ["r1", "r2", "r3"]
    assert by_id["gpu-a"]["depth"] == 3
    assert by_id["gpu-a"]["truncated"] is False


async def test_queue_limit_truncates_and_is_validated(client: httpx.AsyncClient) -> None:
    queues = (await client.get("/v1/queues?limit=1", headers=bearer(ADMIN))).json()
    a = next(q for q in queues if q["instance_id"] == "gpu-a")
    assert [r["request_id"] for r in a["requests"]] == ["r1"]
    assert (a["depth"], a["truncated"]) == (3, True)
    for bad in ("-1", "100001", "abc"):
        resp = await client.get(f"/v1/queues?limit={bad}", headers=bearer(ADMIN))
        assert_error(resp, 422, "invalid_request")
    resp = await client.get("/v1/queues?limit=100000", headers=bearer(ADMIN))
    assert resp.status_code == 200


async def test_get_request_known_and_unknown(client: httpx.AsyncClient) -> None:
    resp = await client.get("/v1/requests/r4", headers=bearer(READ))
    assert resp.status_code == 200
    body = resp.json()
    # fields beyond the documented ones (history, state) pass through
    assert (body["request_id"], body["instance_id"], body["history"]) == (
        "r4",
        "gpu-b",
        ["received"],
    )
    resp = await client.get("/v1/requests/does-not-exist", headers=bearer(READ))
    assert_error(resp, 404, "request_not_found")


async def test_replan_returns_a_new_plan_and_reorders(
    client: httpx.AsyncClient, backend: MemoryBackend
) -> None:
    first = await client.post("/v1/replan", headers=bearer(ADMIN))
    second = await client.post("/v1/replan", headers=bearer(ADMIN))
    assert first.status_code == second.status_code == 200
    p1, p2 = first.json(), second.json()
    assert p1["plan_id"] and p1["plan_id"] != p2["plan_id"]
    assert (p1["policy"], p1["n_requests"], p1["n_instances"]) == ("edf", 5, 2)
    assert [p["plan_id"] for p in backend.plans] == [p1["plan_id"], p2["plan_id"]]
    queues = (await client.get("/v1/queues", headers=bearer(ADMIN))).json()
    a = next(q for q in queues if q["instance_id"] == "gpu-a")
    assert [r["request_id"] for r in a["requests"]] == ["r2", "r3", "r1"]


async def test_drain_moves_the_queue(client: httpx.AsyncClient, backend: MemoryBackend) -> None:
    resp = await client.post("/v1/instances/gpu-a/drain", headers=bearer(ADMIN))
    assert resp.status_code == 200
    assert resp.json() == {"instance_id": "gpu-a", "moved": 3, "status": "draining"}
    assert backend.queues["gpu-a"] == []
    assert [r["request_id"] for r in backend.queues["gpu-b"]] == ["r4", "r1", "r2", "r3"]
    instances = (await client.get("/v1/instances", headers=bearer(READ))).json()
    assert {i["instance_id"]: i["status"] for i in instances} == {
        "gpu-a": "draining",
        "gpu-b": "alive",
    }
    queues = (await client.get("/v1/queues", headers=bearer(READ))).json()
    assert next(q for q in queues if q["instance_id"] == "gpu-a")["draining"] is True


async def test_drain_unknown_instance_is_404(
    client: httpx.AsyncClient, backend: MemoryBackend
) -> None:
    before = backend.state()
    resp = await client.post("/v1/instances/gpu-zzz/drain", headers=bearer(ADMIN))
    assert_error(resp, 404, "instance_not_found")
    assert backend.state() == before


async def test_undrain_takes_a_draining_instance_back(
    client: httpx.AsyncClient, backend: MemoryBackend
) -> None:
    await client.post("/v1/instances/gpu-a/drain", headers=bearer(ADMIN))
    resp = await client.post("/v1/instances/gpu-a/undrain", headers=bearer(ADMIN))
    assert resp.status_code == 200
    assert resp.json() == {"instance_id": "gpu-a", "status": "alive"}
    assert backend.instances["gpu-a"]["status"] == "alive"
    assert_error(
        await client.post("/v1/instances/gpu-zzz/undrain", headers=bearer(ADMIN)),
        404,
        "instance_not_found",
    )
    assert_error(
        await client.post("/v1/instances/gpu-a/undrain", headers=bearer(READ)),
        403,
        "insufficient_scope",
    )


async def test_cancel_a_request(client: httpx.AsyncClient, backend: MemoryBackend) -> None:
    resp = await client.post(
        "/v1/requests/r2/cancel", headers=bearer(ADMIN), json={"reason": "stuck"}
    )
    assert resp.status_code == 200
    assert resp.json() == {"request_id": "r2", "outcome": "cancelled"}
    resp = await client.post("/v1/requests/r3/cancel", headers=bearer(ADMIN))  # no body
    assert resp.status_code == 200
    assert backend.cancelled == [("r2", "stuck"), ("r3", None)]
    assert_error(
        await client.post("/v1/requests/nope/cancel", headers=bearer(ADMIN)),
        404,
        "request_not_found",
    )
    resp = await client.post(
        "/v1/requests/r1/cancel", headers=bearer(ADMIN), json={"reason": "x" * 300}
    )
    assert_error(resp, 422, "invalid_request")


async def test_unknown_paths_and_wrong_methods(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing", headers=bearer(ADMIN)), 404, "not_found")
    resp = await client.get("/v1/replan", headers=bearer(ADMIN))
    assert_error(resp, 405, "method_not_allowed")
    assert resp.headers["allow"] == "POST"
    assert (await client.delete("/v1/instances", headers=bearer(ADMIN))).status_code == 405


async def test_standby_backend_is_503(client: httpx.AsyncClient, backend: MemoryBackend) -> None:
    backend.active = False
    resp = await client.post("/v1/replan", headers=bearer(ADMIN))
    assert_error(resp, 503, "unavailable")
    assert backend.plans == []


async def test_backend_crash_is_a_500_envelope(
    backend: MemoryBackend, metrics: CoordinatorMetrics
) -> None:
    backend.fail_with = RuntimeError("boom")
    app = create_admin_app(backend, token=ADMIN, metrics=metrics)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://a") as c:
        resp = await c.post("/v1/replan", headers=bearer(ADMIN))
    assert_error(resp, 500, "internal_error")
    assert "boom" not in resp.text


async def test_metrics_endpoint_exposes_observations(
    client: httpx.AsyncClient, metrics: CoordinatorMetrics
) -> None:
    metrics.set_queue_depth("gpu-a", 3)
    metrics.observe_slo("interactive", True)
    metrics.observe_slo("interactive", False)
    metrics.observe_dispatch_latency(0.003)
    metrics.observe_plan(0.02)
    metrics.set_unacked(5)
    resp = await client.get("/metrics")  # no auth: scrapers carry no token
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert 'qlm_virtual_queue_depth{instance_id="gpu-a"} 3.0' in text
    assert 'qlm_slo_total{met="false",slo_class="interactive"} 1.0' in text
    assert "qlm_dispatch_latency_seconds_count 1.0" in text
    assert "qlm_replans_total 1.0" in text
    assert "qlm_unacked_deliveries 5.0" in text
    for name in ("qlm_requests_total", "qlm_ingest_latency_seconds", "qlm_instances_alive"):
        assert name in text


async def test_openapi_documents_paths_models_and_security(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    assert set(doc["paths"]) == {
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/instances",
        "/v1/queues",
        "/v1/requests/{request_id}",
        "/v1/replan",
        "/v1/plan",
        "/v1/capacity",
        "/v1/instances/{instance_id}/drain",
        "/v1/instances/{instance_id}/undrain",
        "/v1/requests/{request_id}/cancel",
    }
    schemas = doc["components"]["schemas"]
    for model in (
        "InstanceInfo",
        "QueueInfo",
        "PlanResponse",
        "DrainResponse",
        "UndrainResponse",
        "CancelResponse",
        "ErrorResponse",
        "CapacityStatus",
    ):
        assert model in schemas
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/replan"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/healthz"]["get"]
    assert "security" not in doc["paths"]["/readyz"]["get"]


# ---- real HTTP ------------------------------------------------------------------------------


async def test_serve_admin_on_port_zero_over_real_http(
    backend: MemoryBackend, metrics: CoordinatorMetrics
) -> None:
    app = create_admin_app(backend, token=ADMIN, metrics=metrics)
    server = await serve_admin(app, "127.0.0.1", 0)
    try:
        assert server.port > 0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as c:
            resp = await c.get("/healthz")
            assert resp.status_code == 200
            assert resp.json()["status"] == "ok"
            resp = await c.post("/v1/instances/gpu-b/drain", headers=bearer(ADMIN))
            assert resp.json()["moved"] == 1
            # Small responses must not wait for a delayed ACK (~40 ms, Nagle): the listening
            # socket has to be IPPROTO_TCP for asyncio to set TCP_NODELAY. Typical: ~1 ms.
            times = []
            for _ in range(7):
                start = time.perf_counter()
                await c.get("/healthz")
                times.append(time.perf_counter() - start)
            assert sorted(times)[3] < 0.025, times
            # the same port cannot be bound twice: the caller gets OSError, not sys.exit
            with pytest.raises(OSError):
                await serve_admin(app, "127.0.0.1", server.port)
    finally:
        await server.stop()
    assert server.task.done()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as c:
            await c.get(f"http://127.0.0.1:{server.port}/healthz")


async def test_latest_plan_is_404_before_a_replan_and_summarised_after(
    client: httpx.AsyncClient,
) -> None:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    r = await client.get("/v1/plan", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_plan"
    plan_id = (await client.post("/v1/replan", headers=headers)).json()["plan_id"]
    r = await client.get("/v1/plan", headers=headers)
    assert r.status_code == 200 and r.json()["plan_id"] == plan_id
    assert (await client.get("/v1/plan")).status_code == 401


async def test_capacity_is_404_when_no_autoscaler_runs(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/capacity", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "autoscaling_off"
    assert (await client.get("/v1/capacity")).status_code == 401
