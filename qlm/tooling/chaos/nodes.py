"""Private RabbitMQ nodes the chaos scenarios own, kill and restart.

Each node is ``scripts/rabbitmq-local.sh`` with its own ``QLM_HOME`` (its own Erlang node name,
ports, mnesia and logs); a restarted node keeps its ports, so clients reconnect to the same URL.
A :class:`RabbitCluster` joins three such nodes into one cluster (they share one Erlang cookie),
following the recipe measured in the project's infrastructure notes: node 2 and 3 ``reset`` and
``join_cluster`` node 1, and quorum queues then get all three nodes as members.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import structlog

from qlm.tooling.localbroker import RABBITMQ_SCRIPT, repo_root

log = structlog.get_logger(__name__)

_SCRIPT_TIMEOUT_S = 300.0


class NodeError(RuntimeError):
    """A private broker node failed to start, stop or answer."""


@dataclass
class RabbitNode:
    """One private RabbitMQ node whose state lives under ``home``."""

    home: Path
    url: str = ""
    #: extra environment for the script, e.g. QLM_RABBITMQ_TLS_DIR for an amqps listener
    env: dict[str, str] = field(default_factory=dict)

    def _run(self, *args: str, timeout: float = _SCRIPT_TIMEOUT_S) -> str:
        script = repo_root() / RABBITMQ_SCRIPT
        env = {**os.environ, **self.env, "QLM_HOME": str(self.home)}
        try:
            done = subprocess.run(
                ["bash", str(script), *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise NodeError(f"rabbitmq-local.sh {args[0]} timed out after {timeout} s") from exc
        if done.returncode != 0:
            raise NodeError(
                f"rabbitmq-local.sh {' '.join(args)} failed ({done.returncode}): "
                f"{done.stderr.strip()[-800:]}"
            )
        return done.stdout.strip()

    @property
    def state(self) -> Path:
        return self.home / "rabbitmq"

    def up(self) -> str:
        self.url = self._run("up").splitlines()[-1]
        return self.url

    def tls_url(self) -> str:
        """``amqps://`` URL of the TLS listener (started with QLM_RABBITMQ_TLS_DIR in ``env``)."""
        return self._run("tls-url")

    def kill(self) -> None:
        """SIGKILL: the node vanishes mid-flight, as in a crash."""
        self._run("kill")

    def down(self) -> None:
        self._run("down")

    def clean(self) -> None:
        self._run("clean")

    def nodename(self) -> str:
        return self._run("nodename")

    def ctl(self, *args: str) -> str:
        return self._run("ctl", "-q", *args)

    def management_url(self) -> str:
        return (self.state / "management_url").read_text().strip().rstrip("/") + "/"


@dataclass
class RabbitCluster:
    """Three private nodes joined into one cluster under ``base``."""

    base: Path
    size: int = 3
    nodes: list[RabbitNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.nodes:
            self.nodes = [RabbitNode(self.base / f"n{i + 1}") for i in range(self.size)]

    async def up(self) -> list[str]:
        """Start node 1, then the others with its cookie, and join them to it."""
        first, rest = self.nodes[0], self.nodes[1:]
        await asyncio.to_thread(first.up)
        cookie = first.state / "home" / ".erlang.cookie"
        for node in rest:
            target = node.state / "home" / ".erlang.cookie"
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                target.chmod(0o600)
            shutil.copyfile(cookie, target)
            target.chmod(0o400)
        await asyncio.gather(*(asyncio.to_thread(n.up) for n in rest))
        leader = first.nodename()
        for node in rest:
            if leader in node.ctl("cluster_status", "--formatter", "json"):
                continue  # joined in an earlier run (state kept)
            await asyncio.to_thread(node.ctl, "stop_app")
            await asyncio.to_thread(node.ctl, "reset")
            await asyncio.to_thread(node.ctl, "join_cluster", leader)
            await asyncio.to_thread(node.ctl, "start_app")
        log.info("rabbit_cluster_ready", nodes=[n.url for n in self.nodes])
        return self.urls

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def node_of(self, erlang_node: str) -> RabbitNode:
        for node in self.nodes:
            if node.nodename() == erlang_node:
                return node
        raise NodeError(f"no node of this cluster is {erlang_node!r}")

    async def queue_leaders(self, via: RabbitNode, vhost: str) -> dict[str, str]:
        """Quorum queue name -> the Erlang node leading it (management API of ``via``)."""
        async with httpx.AsyncClient(
            base_url=via.management_url(), auth=("guest", "guest"), timeout=30
        ) as http:
            resp = await http.get(f"api/queues/{quote(vhost, safe='')}")
            resp.raise_for_status()
            rows: list[dict[str, Any]] = resp.json()
        return {
            row["name"]: row.get("leader") or row.get("node", "")
            for row in rows
            if row.get("type") == "quorum"
        }

    async def queue_counts(self, via: RabbitNode, vhost: str) -> dict[str, tuple[int, int]]:
        """Queue name -> (messages ready, messages unacked), from the management API of
        ``via`` (its figures lag by up to the stats interval, 5 s)."""
        async with httpx.AsyncClient(
            base_url=via.management_url(), auth=("guest", "guest"), timeout=30
        ) as http:
            resp = await http.get(f"api/queues/{quote(vhost, safe='')}")
            resp.raise_for_status()
            rows: list[dict[str, Any]] = resp.json()
        return {
            row["name"]: (
                int(row.get("messages_ready") or 0),
                int(row.get("messages_unacknowledged") or 0),
            )
            for row in rows
        }

    def down(self) -> None:
        for node in reversed(self.nodes):
            try:
                node.down()
            except NodeError as exc:
                log.warning("rabbit_node_down_failed", home=str(node.home), error=str(exc))

    def clean(self) -> None:
        for node in reversed(self.nodes):
            try:
                node.clean()
            except NodeError as exc:
                log.warning("rabbit_node_clean_failed", home=str(node.home), error=str(exc))
