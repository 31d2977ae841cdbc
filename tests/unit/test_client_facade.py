"""The friendlier client (issue 19): generated request ids, a blocking facade, and a library
that prints nothing into its user's program unless the program configures logging."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qlm.client import new_request
from qlm.sync_client import SyncQlmClient

ROOT = Path(__file__).resolve().parents[2]


def test_new_request_generates_a_fresh_id_and_an_slo() -> None:
    a = new_request("mistral-7b", "hello", max_tokens=8)
    b = new_request("mistral-7b", "hello")
    assert a.request_id.startswith("req-") and a.request_id != b.request_id
    assert a.slo.e2e_ms == 60_000 and a.max_tokens == 8
    c = new_request("m", messages=[{"role": "user", "content": "hi"}], request_id="mine")
    assert c.request_id == "mine" and c.messages is not None and c.prompt is None
    with pytest.raises(ValueError):
        new_request("m")  # no prompt at all: the wire schema's rule still holds


QUIET = """
import asyncio, logging, sys
import qlm.client, qlm.amqp, qlm.streaming, qlm.topology
from qlm.client import QlmClient
qlm.client.log.debug("client_connected", reply_queue="x")
qlm.client.log.warning("reply_duplicate", correlation_id="c")
qlm.amqp.log.error("oops")
async def main():
    try:
        await QlmClient("amqp://guest:guest@127.0.0.1:1/").connect()
    except Exception:
        pass
asyncio.run(main())
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(message)s")
    qlm.client.log.debug("client_connected", reply_queue="x")
"""


def test_the_library_logs_nothing_unless_the_program_configures_logging() -> None:
    out = subprocess.run(
        [sys.executable, "-c", QUIET, "silent"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == "", (out.stdout, out.stderr)
    configured = subprocess.run(
        [sys.executable, "-c", QUIET, "configured"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert "qlm.client client_connected reply_queue='x'" in configured.stdout, configured


def test_sync_client_reports_a_broker_that_is_down_and_closes() -> None:
    client = SyncQlmClient("amqp://guest:guest@127.0.0.1:1/")
    with pytest.raises((ConnectionError, OSError)):
        client.connect()
    client.close()
    client.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        client.connect()
