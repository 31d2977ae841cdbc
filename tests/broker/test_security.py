"""TLS for AMQP (amqps) and the admin API (HTTPS) with a self-signed CA, and the settings'
refusals: guest credentials off localhost, half a TLS key pair, malformed broker URLs."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import aio_pika
import httpx
import pytest
import trustme
from pydantic import ValidationError

from qlm import amqp as qlm_amqp
from qlm.admin import create_admin_app, serve_admin
from qlm.config import Settings
from qlm.metrics import CoordinatorMetrics
from qlm.tooling.chaos.nodes import RabbitNode
from tests.unit.test_admin_api import MemoryBackend


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA and a server certificate for localhost/127.0.0.1, as PEM files."""
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(d / "cert.pem"), append=True)
    return d


# ---------------------------------------------------------------------------- AMQP over TLS


@pytest.fixture(scope="module")
def tls_node(tls_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> object:
    node = RabbitNode(
        tmp_path_factory.mktemp("tls-node"), env={"QLM_RABBITMQ_TLS_DIR": str(tls_dir)}
    )
    node.up()
    try:
        yield node
    finally:
        node.clean()


@pytest.mark.broker
@pytest.mark.slow
async def test_amqps_round_trip_verifies_the_server_against_the_ca(
    tls_node: RabbitNode, tls_dir: Path
) -> None:
    url = tls_node.tls_url() + f"?cafile={tls_dir / 'ca.pem'}"
    conn = await qlm_amqp.connect(url, name="qlm-test-tls", timeout=10)
    try:
        ch = await conn.channel(publisher_confirms=True)
        q = await ch.declare_queue(exclusive=True)
        await ch.default_exchange.publish(aio_pika.Message(b"over tls"), routing_key=q.name)
        msg = await q.get(timeout=5)
        assert msg is not None and msg.body == b"over tls"
        await msg.ack()
    finally:
        await conn.close()


@pytest.mark.broker
@pytest.mark.slow
async def test_amqps_without_the_ca_is_refused(tls_node: RabbitNode) -> None:
    # The system trust store does not know our self-signed CA: verification must fail rather
    # than silently connect.
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        await aio_pika.connect(tls_node.tls_url(), timeout=10)


# ---------------------------------------------------------------------------- HTTPS admin API


async def test_admin_api_over_https_with_a_self_signed_certificate(tls_dir: Path) -> None:
    app = create_admin_app(MemoryBackend(), token="s3cret", metrics=CoordinatorMetrics())
    server = await serve_admin(
        app,
        "127.0.0.1",
        0,
        tls_cert=str(tls_dir / "cert.pem"),
        tls_key=str(tls_dir / "key.pem"),
    )
    try:
        base = f"https://localhost:{server.port}"
        trust = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
        async with httpx.AsyncClient(verify=trust) as http:
            r = await http.get(base + "/v1/instances", headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200
            r = await http.get(base + "/v1/instances")
            assert r.status_code == 401
        async with httpx.AsyncClient(verify=True) as http:  # CA unknown: refused
            with pytest.raises(httpx.ConnectError):
                await http.get(base + "/healthz")
        async with httpx.AsyncClient() as http:  # plain HTTP on the TLS port: no answer
            with pytest.raises(httpx.HTTPError):
                await http.get(f"http://127.0.0.1:{server.port}/healthz")
    finally:
        await server.stop()


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "url",
    [
        "amqp://guest:guest@127.0.0.1:5672/",
        "amqp://localhost/",  # no user: the client logs in as guest
        "amqps://guest:guest@[::1]:5671/",
        "amqp://qlm:pw@rabbit.example.com:5672/",
        "amqp://qlm:pw@n1:5672/,amqp://qlm:pw@n2:5672/",
    ],
)
def test_broker_urls_accepted(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QLM_AMQP_URL", url)
    assert Settings().amqp_url == url


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("amqp://guest:guest@rabbit.example.com:5672/", "guest"),
        ("amqp://rabbit.example.com/", "guest"),  # implied guest
        ("amqp://qlm:pw@n1:5672/,amqp://guest:guest@n2:5672/", "'n2'"),
        ("http://qlm:hunter2@n1:5672/", "amqp"),
        ("", "empty"),
    ],
)
def test_broker_urls_refused(url: str, needle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QLM_AMQP_URL", url)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert needle in str(info.value)
    assert "hunter2" not in str(info.value)  # a password never reaches an error message


def test_half_a_tls_pair_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QLM_ADMIN_TLS_CERT", "/tmp/cert.pem")
    with pytest.raises(ValidationError, match="go together"):
        Settings()


def test_cli_reports_bad_settings_in_one_line_and_exits_2() -> None:
    env = {"QLM_AMQP_URL": "amqp://guest:guest@rabbit.example.com/", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        # a command that reads the settings (`qlm admin` talks HTTP and needs no broker URL)
        [sys.executable, "-m", "qlm.cli", "coordinator"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith("qlm: QLM_AMQP_URL: ")
    assert "Traceback" not in done.stderr


def test_mask_password_and_split_urls() -> None:
    url = "amqp://u:secret@h1:5672/,amqps://u:other@h2:5671/v"
    assert qlm_amqp.mask_password(url) == "amqp://u:***@h1:5672/,amqps://u:***@h2:5671/v"
    assert qlm_amqp.split_urls(url + ", ") == url.split(",")
    assert qlm_amqp.vhost_of("amqp://u:p@h/%2Fa") == "/a"
    assert qlm_amqp.vhost_of("amqp://u:p@h/") == "/"
    assert (
        qlm_amqp.with_vhost(url, "/") == "amqp://u:secret@h1:5672/%2F,amqps://u:other@h2:5671/%2F"
    )
