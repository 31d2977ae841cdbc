"""The loopback ports tooling hands to child processes (`qlm.tooling.ports`)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from qlm.tooling import ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    handed = [ports.free_loopback_port() for _ in range(50)]
    assert len(set(handed)) == 50
    low = ports._ephemeral_low()
    for port in handed:
        assert port < low  # never one an outgoing connection can be given meanwhile
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        # a range of one port, already taken: the kernel's choice is the fallback
        monkeypatch.setattr(ports, "_LOWEST", taken)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 1001)
        monkeypatch.setattr(ports.random, "randint", lambda a, b: taken)
        port = ports.free_loopback_port()
        assert port != taken


def test_the_kernel_range_is_read_or_defaulted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", f)
    assert ports._ephemeral_low() == 40000
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", tmp_path / "absent")
    assert ports._ephemeral_low() == 32768
