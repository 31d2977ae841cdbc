"""Loopback ports for the child processes tooling and tests start (coordinator, agents,
gateway, ``vllm serve``).

The port is chosen here and bound by the child seconds later, so something else may take it
in between. Binding port 0 to pick it is the usual trick and the wrong one: the kernel answers
from the *ephemeral* range, the same range every outgoing connection (AMQP, HTTP, PostgreSQL)
takes its local port from, and one such connection on the chosen port made a coordinator exit
with ``Address already in use`` in a full test run. Ports below the ephemeral range are never
handed to outgoing connections; the ones chosen are also remembered, so one process never
hands the same port out twice.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # above the well-known and most registered service ports
_handed_out: set[int] = set()
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_loopback_port() -> int:
    """A loopback port nothing listens on, outside the ephemeral range and not handed out
    before by this process (falls back to a kernel-chosen one where that range is empty)."""
    high = _ephemeral_low() - 1
    with _lock:
        if high - _LOWEST >= 1000:
            for _ in range(200):
                port = random.randint(_LOWEST, high)  # noqa: S311 - not a secret
                if port not in _handed_out and _bindable(port):
                    _handed_out.add(port)
                    return port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port
