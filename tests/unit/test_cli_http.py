"""`qlm agent --backend http --server MODEL=URL`: the wiring, without a vLLM server (the
backend against a real one: tests/vllm/test_http_backend.py); what the backend reads from a
server's model card, from a small real HTTP server that answers ``GET /v1/models`` alone."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from qlm import cli
from qlm.agents.http import HttpEngine, HttpSettings, make_http_engines, parse_servers
from qlm.engine_scheduler import WANTS_AT_MOST
from tests.models_server import models_server


def _make(servers: list[str], backend: str = "http", pull_at_most: int | None = None) -> list[Any]:
    return cli._make_engines(
        backend,
        1,
        "A10",
        ["tiny-llama"] if backend == "sim" else ["ignored"],
        time_scale=1.0,
        seed=0,
        model_paths={},
        vllm_options={},
        servers=servers,
        pull_at_most=pull_at_most,
    )


def test_one_engine_per_server() -> None:
    engines = _make(["llama=http://10.0.0.5:8000/", "mistral=https://gpu2:8001"])
    assert all(isinstance(e, HttpEngine) for e in engines)
    assert [(e.models, e.url) for e in engines] == [
        (["llama"], "http://10.0.0.5:8000"),
        (["mistral"], "https://gpu2:8001"),
    ]


@pytest.mark.parametrize(
    ("servers", "says"),
    [
        ([], "at least one --server"),
        (["llama"], "MODEL=URL"),
        (["=http://a:1"], "MODEL=URL"),
        (["llama=10.0.0.5:8000"], "http://"),
        (["a=http://h:1", "b=http://h:1/"], "named twice"),
    ],
)
def test_bad_servers_are_refused(servers: list[str], says: str) -> None:
    with pytest.raises(typer.BadParameter, match=says):
        _make(servers)
    with pytest.raises(ValueError, match=says):
        make_http_engines(servers)


def test_server_is_only_for_the_http_backend() -> None:
    with pytest.raises(typer.BadParameter, match="--backend http"):
        _make(["llama=http://h:1"], backend="sim")


def test_parse_keeps_the_order() -> None:
    assert parse_servers(["b=http://h:2", "a=http://h:1"]) == [
        ("b", "http://h:2"),
        ("a", "http://h:1"),
    ]


def test_the_pull_size_reaches_every_backend_it_is_given_to() -> None:
    (http,) = _make(["llama=http://h:1"], pull_at_most=2)
    assert http.settings.pull_at_most == 2
    (default,) = _make(["llama=http://h:1"])
    assert default.settings.pull_at_most == WANTS_AT_MOST
    (sim,) = _make([], backend="sim", pull_at_most=1)
    assert sim._engine.pull_at_most == 1


def test_the_request_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    (default,) = _make(["llama=http://h:1"])
    assert default.settings.request_timeout_s == 30.0
    monkeypatch.setenv("QLM_HTTP_REQUEST_TIMEOUT_S", "5")
    (http,) = _make(["llama=http://h:1"])
    assert http.settings.request_timeout_s == 5.0
    for bad in ("soon", "0"):
        monkeypatch.setenv("QLM_HTTP_REQUEST_TIMEOUT_S", bad)
        with pytest.raises(typer.BadParameter, match="QLM_HTTP_REQUEST_TIMEOUT_S|request_timeout"):
            _make(["llama=http://h:1"])


def test_every_backend_refuses_a_pull_size_below_one() -> None:
    from qlm.agents.sim import SimEngine
    from qlm.agents.vllm import VllmSettings

    for make in (
        lambda: HttpSettings(pull_at_most=0),
        lambda: VllmSettings(pull_at_most=0),
        lambda: SimEngine("A10", ["tiny-llama"], pull_at_most=0),
    ):
        with pytest.raises(ValueError, match="pull_at_most"):
            make()


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        HttpSettings(kv_threshold=0)
    with pytest.raises(ValueError):
        HttpSettings(sleep_level_warm=3)


async def test_a_dead_url_fails_start_in_one_line() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    eng = HttpEngine("llama", f"http://127.0.0.1:{port}", HttpSettings(start_timeout_s=0.2))

    async def ignore(_: Any) -> None:
        return None

    with pytest.raises(RuntimeError) as err:
        await eng.start(ignore)
    message = str(err.value)
    assert f"http://127.0.0.1:{port}" in message and "does not answer" in message
    assert "\n" not in message
    assert eng.wants() == 0


def test_agent_help_names_the_http_backend() -> None:
    result = CliRunner().invoke(cli.app, ["agent", "--help"])
    assert result.exit_code == 0
    assert "http" in result.output and "--server" in result.output


@pytest.mark.parametrize(
    ("card", "expected"),
    [
        ({"max_model_len": 1024}, {"llama": 1024}),  # vLLM's field: the server's context
        ({}, {}),  # a server that does not say: nothing reported, the catalog's limit stands
    ],
)
async def test_start_reads_the_context_from_the_servers_model_card(
    card: dict[str, Any], expected: dict[str, int]
) -> None:
    cards = [{"id": "other", "object": "model", "max_model_len": 99}]
    cards.append({"id": "llama", "object": "model", **card})
    with models_server(cards) as url:
        eng = HttpEngine("llama", url, HttpSettings(start_timeout_s=5, metrics_interval_s=0.1))
        assert eng.max_model_len == {}  # not started: unknown

        async def ignore(_: Any) -> None:
            return None

        await eng.start(ignore)
        try:
            assert dict(eng.max_model_len) == expected  # its own card's, not another model's
            # the rest of the server is not there: said, not fatal
            notes = " ".join(eng.capabilities().notes)
            assert "GET /metrics failed" in notes and "dev endpoints are off" in notes
        finally:
            await eng.stop()


async def test_a_server_that_comes_back_is_read_again_before_it_gets_work() -> None:
    """A `vllm serve` restarted with another --max-model-len: the new context is taken once
    it answers again; restarted serving another model: no work goes to it (not serving, wants
    nothing) until it serves the declared one again."""
    cards: list[dict[str, Any]] = [{"id": "llama", "object": "model", "max_model_len": 1000}]
    state = {"down": False}
    with models_server(cards, metrics=True, state=state) as url:
        eng = HttpEngine("llama", url, HttpSettings(start_timeout_s=5, metrics_interval_s=0.02))

        async def ignore(_: Any) -> None:
            return None

        async def until(predicate: Any) -> None:
            for _ in range(250):
                if predicate():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("not reached")

        await eng.start(ignore)
        try:
            assert dict(eng.max_model_len) == {"llama": 1000} and eng.stats().serving
            state["down"] = True  # stopped ...
            await until(lambda: not eng.stats().serving)
            cards[0] = {"id": "llama", "object": "model", "max_model_len": 4000}
            state["down"] = False  # ... and back with a longer context
            await until(lambda: eng.stats().serving)
            assert dict(eng.max_model_len) == {"llama": 4000} and eng.wants() > 0
            state["down"] = True
            await until(lambda: not eng.stats().serving)
            cards[0] = {"id": "mistral", "object": "model", "max_model_len": 4000}
            state["down"] = False  # back serving another model: refused
            await asyncio.sleep(0.3)
            assert not eng.stats().serving and eng.wants() == 0
            cards[0] = {"id": "llama", "object": "model", "max_model_len": 2000}
            await until(lambda: eng.stats().serving)  # the declared model again
            assert dict(eng.max_model_len) == {"llama": 2000}
        finally:
            await eng.stop()
