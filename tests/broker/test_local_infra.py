"""Local infrastructure: the private broker/database scripts and the docker deployment files."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import httpx
import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.ext.asyncio import create_async_engine

from qlm.config import Settings
from qlm.tooling import localbroker

REPO = Path(__file__).resolve().parents[2]
RABBITMQ_SCRIPT = REPO / "scripts" / "rabbitmq-local.sh"
POSTGRES_SCRIPT = REPO / "scripts" / "postgres-local.sh"
COMPOSE_FILE = REPO / "docker" / "compose.yaml"
COMPOSE_ENV = {
    "QLM_ERLANG_COOKIE": "cookie" * 4,
    "QLM_RABBITMQ_PASSWORD": "rabbit-secret",
    "QLM_POSTGRES_PASSWORD": "pg-secret",
    "QLM_ADMIN_TOKEN": "admin-secret",
    "QLM_GATEWAY_API_KEYS": '{"key-a": "tenant-a"}',
}


def run(*cmd: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def local_only(url_env: str) -> None:
    if os.environ.get(url_env):
        pytest.skip(f"{url_env} selects an external server; the local script is not in use")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}`` / ``${VAR:?message}`` substitution, enough for our file."""
    return re.sub(r"\$\{([A-Z_]+)(?::\?[^}]*)?\}", lambda m: env[m.group(1)], text)


# --- docker/ ---------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    data = yaml.safe_load(interpolate(COMPOSE_FILE.read_text(), COMPOSE_ENV))
    assert isinstance(data, dict)
    return data


def command_of(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


def test_compose_defines_a_three_node_rabbitmq_cluster() -> None:
    data = compose()
    services = data["services"]
    nodes = {name: s for name, s in services.items() if str(s.get("image")).startswith("rabbitmq:")}
    assert len(nodes) == 3
    for node in nodes.values():
        # >= 3.12: the shards' x-consumer-timeout works, so no broker-wide consumer_timeout
        tag = re.match(r"rabbitmq:(\d+)\.(\d+)", node["image"])
        assert tag is not None and (int(tag[1]), int(tag[2])) >= (3, 12), node["image"]
    cookies = {s["environment"]["RABBITMQ_ERLANG_COOKIE"] for s in nodes.values()}
    assert cookies == {COMPOSE_ENV["QLM_ERLANG_COOKIE"]}
    hostnames = {s["hostname"] for s in nodes.values()}
    assert len(hostnames) == 3

    cluster_conf = ""
    for node in nodes.values():
        targets = {c["target"]: c["source"] for c in node["configs"]}
        assert targets["/etc/rabbitmq/enabled_plugins"] == "rabbitmq_plugins"
        cluster_conf = data["configs"][targets["/etc/rabbitmq/conf.d/30-cluster.conf"]]["content"]
        assert data["configs"][targets["/etc/rabbitmq/conf.d/20-qlm.conf"]]["file"] == (
            "./rabbitmq.conf"
        )
    assert "cluster_formation.peer_discovery_backend = classic_config" in cluster_conf
    listed = set(re.findall(r"classic_config\.nodes\.\d+ = rabbit@(\S+)", cluster_conf))
    assert listed == hostnames
    assert data["configs"]["rabbitmq_plugins"]["file"] == "./enabled_plugins"


def test_compose_runs_postgres_two_coordinators_and_two_sim_agents() -> None:
    services = compose()["services"]
    assert str(services["postgres"]["image"]).startswith("postgres:15")
    coordinators = [s for s in services.values() if command_of(s)[:1] == ["coordinator"]]
    agents = [s for s in services.values() if command_of(s)[:1] == ["agent"]]
    assert len(coordinators) == 2
    assert len(agents) == 2
    rabbit_hosts = {s.get("hostname") for s in services.values() if "hostname" in s}
    gateways = [s for s in services.values() if command_of(s)[:1] == ["gateway"]]
    assert len(gateways) == 1
    orders = []
    for svc in coordinators + agents + gateways:
        # every process gets the whole node list, each in another order (qlm/amqp.py)
        urls = svc["environment"]["QLM_AMQP_URL"].split(",")
        assert {urlsplit(u).hostname for u in urls} == rabbit_hosts
        assert Settings(amqp_url=",".join(urls)).amqp_url  # qlm accepts it
        orders.append(tuple(urls))
        for u in urls:
            assert urlsplit(u).password == COMPOSE_ENV["QLM_RABBITMQ_PASSWORD"]
    assert len(set(orders)) >= 3
    for svc in coordinators + agents:
        env = svc["environment"]
        assert env["QLM_DATABASE_URL"].startswith("postgresql+asyncpg://qlm:pg-secret@postgres:")
        assert env["QLM_ADMIN_TOKEN"] == COMPOSE_ENV["QLM_ADMIN_TOKEN"]
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
    for agent in agents:
        cmd = command_of(agent)
        assert cmd[cmd.index("--backend") + 1] == "sim"
        assert cmd[cmd.index("--gpu-type") + 1] == "A100-80GB"
        assert cmd[cmd.index("--models") + 1] == "mistral-7b,vicuna-13b"


def test_compose_runs_the_gateway_and_prometheus_scraping_every_qlm_process() -> None:
    services = compose()["services"]
    (gateway,) = [s for s in services.values() if command_of(s)[:1] == ["gateway"]]
    env = gateway["environment"]
    assert env["QLM_GATEWAY_HOST"] == "0.0.0.0"
    assert env["QLM_GATEWAY_API_KEYS"] == COMPOSE_ENV["QLM_GATEWAY_API_KEYS"]
    assert gateway["ports"] == [f"127.0.0.1:8000:{env['QLM_GATEWAY_PORT']}"]
    prometheus = services["prometheus"]
    assert prometheus["ports"] == ["127.0.0.1:9090:9090"]  # loopback only, like the rest
    scrape = yaml.safe_load((REPO / "docker" / "prometheus.yml").read_text())
    targets = {
        t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    # each coordinator on its admin port, the gateway on its HTTP port, each agent on 9400
    expected = {
        f"{name}:{svc['environment'].get('QLM_ADMIN_PORT', 8080)}"
        for name, svc in services.items()
        if command_of(svc)[:1] == ["coordinator"]
    }
    expected |= {f"{n}:9400" for n, s in services.items() if command_of(s)[:1] == ["agent"]}
    expected.add(f"gateway:{env['QLM_GATEWAY_PORT']}")
    assert targets == expected


def docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    return run("docker", "compose", "version").returncode == 0


@pytest.mark.skipif(not docker_compose_available(), reason="no docker CLI with compose plugin")
def test_docker_compose_accepts_the_file() -> None:
    proc = run("docker", "compose", "-f", COMPOSE_FILE, "config", "--quiet", env=COMPOSE_ENV)
    assert proc.returncode == 0, proc.stderr


def test_required_secrets_are_enforced_by_compose_interpolation() -> None:
    text = COMPOSE_FILE.read_text()
    for var in COMPOSE_ENV:
        assert re.search(r"\$\{" + var + r":\?", text), f"{var} is not required"


def test_broker_config_enables_what_the_topology_needs() -> None:
    plugins = (REPO / "docker" / "enabled_plugins").read_text()
    assert re.fullmatch(r"\[[a-z_,\s]+\]\.\s*", plugins)
    assert {"rabbitmq_management", "rabbitmq_consistent_hash_exchange"} <= set(
        re.findall(r"[a-z_]+", plugins)
    )
    # The shards carry their own consumer timeout (qlm/topology.py): the shared config leaves
    # the broker-wide one alone, and only the fallback for brokers < 3.12 raises it.
    conf = (REPO / "docker" / "rabbitmq.conf").read_text()
    assert re.search(r"^\s*consumer_timeout\b", conf, re.M) is None
    legacy = (REPO / "docker" / "rabbitmq-pre-3.12.conf").read_text()
    timeout = re.search(r"^consumer_timeout\s*=\s*(\d+)", legacy, re.M)
    assert timeout is not None and int(timeout.group(1)) >= 24 * 3600 * 1000


def test_dockerfile_builds_the_qlm_entrypoint() -> None:
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)
    assert 'ENTRYPOINT ["qlm"]' in text
    for path in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (REPO / path).exists(), f"Dockerfile copies missing {path}"


# --- scripts/rabbitmq-local.sh ---------------------------------------------------------------


def test_node_names_are_stable_per_state_dir_and_distinct_across_them(tmp_path: Path) -> None:
    def nodename(home: Path) -> str:
        proc = run(RABBITMQ_SCRIPT, "nodename", env={"QLM_HOME": str(home)})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    a, b = nodename(tmp_path / "a"), nodename(tmp_path / "b")
    assert a != b
    assert nodename(tmp_path / "a") == a
    assert re.fullmatch(r"qlm-[0-9a-f]{10}@localhost", a)


def test_scripts_report_a_stopped_server(tmp_path: Path) -> None:
    env = {"QLM_HOME": str(tmp_path)}
    for script in (RABBITMQ_SCRIPT, POSTGRES_SCRIPT):
        status = run(script, "status", env=env)
        assert status.returncode == 1, status.stderr
        url = run(script, "url", env=env)
        assert url.returncode != 0
        assert url.stdout == ""
        assert run(script, "down", env=env).returncode == 0  # nothing to stop is fine


@pytest.mark.broker
def test_rabbitmq_script_agrees_with_the_live_node(amqp_url: str) -> None:
    local_only(localbroker.AMQP_URL_ENV)
    assert run(RABBITMQ_SCRIPT, "status").returncode == 0
    assert run(RABBITMQ_SCRIPT, "url").stdout.strip() == amqp_url
    again = run(RABBITMQ_SCRIPT, "up")  # idempotent: same node, same URL
    assert again.returncode == 0
    assert again.stdout.strip() == amqp_url

    overview = httpx.get(
        localbroker.management_url(amqp_url) + "api/overview", auth=("guest", "guest")
    ).json()
    listeners = overview["listeners"]
    assert {entry["protocol"] for entry in listeners} >= {"amqp", "http", "clustering"}
    # The HTTP listener is reported as "::" although cowboy binds the configured ip.
    bound = {
        entry["socket_opts"].get("ip", entry["ip_address"])
        if isinstance(entry["socket_opts"], dict)
        else entry["ip_address"]
        for entry in listeners
    }
    assert bound == {"127.0.0.1"}
    amqp_ports = {entry["port"] for entry in listeners if entry["protocol"] == "amqp"}
    assert amqp_ports == {urlsplit(amqp_url).port}

    # Broker-wide consumer timeout only where the per-queue one is ignored (< 3.12).
    version = run(RABBITMQ_SCRIPT, "version").stdout.strip()
    major, minor = (int(part) for part in version.split(".")[:2])
    value = run(RABBITMQ_SCRIPT, "ctl", "eval", "application:get_env(rabbit, consumer_timeout).")
    if (major, minor) < (3, 12):
        expected = re.search(
            r"^consumer_timeout\s*=\s*(\d+)",
            (REPO / "docker/rabbitmq-pre-3.12.conf").read_text(),
            re.M,
        )
        assert expected is not None
        assert value.stdout.strip() == f"{{ok,{expected.group(1)}}}"
    else:
        assert value.stdout.strip() in ("undefined", "{ok,1800000}")


@pytest.mark.broker
async def test_the_broker_url_serves_amqp_with_the_consistent_hash_exchange(
    isolated_amqp_url: str,
) -> None:
    async with await aio_pika.connect(isolated_amqp_url) as conn:
        channel = await conn.channel()
        exchange = await channel.declare_exchange("probe", type="x-consistent-hash")
        queue = await channel.declare_queue("", exclusive=True)
        await queue.bind(exchange, routing_key="1")
        await exchange.publish(aio_pika.Message(b"ping"), routing_key="any-key")
        message = None
        for _ in range(100):
            message = await queue.get(fail=False)
            if message is not None:
                break
            await asyncio.sleep(0.05)
        assert message is not None
        assert message.body == b"ping"
        await message.ack()


# --- scripts/postgres-local.sh ---------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_script_agrees_with_the_live_server(postgres_url: str) -> None:
    local_only(localbroker.POSTGRES_URL_ENV)
    assert run(POSTGRES_SCRIPT, "status").returncode == 0
    assert run(POSTGRES_SCRIPT, "url").stdout.strip() == postgres_url
    assert postgres_url.startswith("postgresql+asyncpg://postgres@127.0.0.1:")
    assert postgres_url.endswith("/qlm")


@pytest.mark.postgres
async def test_postgres_url_works_with_sqlalchemy_and_asyncpg(
    postgres_url: str, isolated_postgres_url: str
) -> None:
    engine = create_async_engine(isolated_postgres_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE probe (id serial PRIMARY KEY, v text)"))
            await conn.execute(sa.text("INSERT INTO probe (v) VALUES ('a'), ('b')"))
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT v FROM probe ORDER BY id"))).all()
            assert [r.v for r in rows] == ["a", "b"]
            if not os.environ.get(localbroker.POSTGRES_URL_ENV):
                # The private cluster trades durability for speed and stays on loopback.
                assert (await conn.execute(sa.text("SHOW fsync"))).scalar() == "off"
                listen = (await conn.execute(sa.text("SHOW listen_addresses"))).scalar()
                assert listen == "127.0.0.1"
    finally:
        await engine.dispose()

    # The isolated database is separate from the session's database.
    main = create_async_engine(postgres_url)
    try:
        async with main.connect() as conn:
            tables = await conn.run_sync(lambda c: sa.inspect(c).get_table_names())
            assert "probe" not in tables
    finally:
        await main.dispose()
