"""A minimal AMQP 0-9-1 publisher that sends property bytes exactly as given.

aio-pika (pamqp) encodes properties strictly as UTF-8, so it cannot send what an attacker
can: :class:`RawPublisher` speaks just enough of the protocol over a socket (one channel,
publisher confirms) and builds the content header frame by hand. Used by ``qlm chaos``'s
hostile-properties scenario and the hostile-input tests; never by the runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any
from urllib.parse import unquote, urlsplit

import pamqp.encode
import pamqp.frame
from pamqp import commands

from qlm.topology import INGRESS_EXCHANGE

_PROPERTY_FLAGS = {  # AMQP 0-9-1 basic properties, in wire order
    "content_type": 0x8000,
    "content_encoding": 0x4000,
    "headers": 0x2000,
    "delivery_mode": 0x1000,
    "priority": 0x0800,
    "correlation_id": 0x0400,
    "reply_to": 0x0200,
    "expiration": 0x0100,
    "message_id": 0x0080,
    "timestamp": 0x0040,
    "type": 0x0020,
    "user_id": 0x0010,
    "app_id": 0x0008,
}


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _short_str(value: str | bytes) -> bytes:
    raw = _bytes(value)
    if len(raw) > 255:
        raise ValueError(f"a short string holds at most 255 bytes, not {len(raw)}")
    return bytes([len(raw)]) + raw


def _table_value(value: Any) -> bytes:
    if isinstance(value, bytes):  # a long string with arbitrary bytes
        return b"S" + struct.pack(">I", len(value)) + value
    if isinstance(value, dict):
        return b"F" + raw_table(value)
    if isinstance(value, list):
        items = b"".join(_table_value(v) for v in value)
        return b"A" + struct.pack(">I", len(items)) + items
    if isinstance(value, float):  # a double (pamqp would write a 32-bit float)
        return b"d" + struct.pack(">d", value)
    return pamqp.encode.encode_table_value(value)


def raw_table(items: dict[str | bytes, Any]) -> bytes:
    """A field table whose keys (and long-string values) may be any bytes."""
    body = b"".join(_short_str(k) + _table_value(v) for k, v in items.items())
    return struct.pack(">I", len(body)) + body


def content_header_frame(channel: int, body_size: int, props: dict[str, Any]) -> bytes:
    flags, parts = 0, []
    for name, bit in _PROPERTY_FLAGS.items():
        if name not in props:
            continue
        value = props[name]
        flags |= bit
        if name == "headers":
            parts.append(raw_table(value))
        elif name in ("delivery_mode", "priority"):
            parts.append(bytes([value]))
        elif name == "timestamp":
            parts.append(struct.pack(">Q", value))
        else:
            parts.append(_short_str(value))
    payload = struct.pack(">HHQH", 60, 0, body_size, flags) + b"".join(parts)
    return struct.pack(">BHI", 2, channel, len(payload)) + payload + b"\xce"


class RawPublisher:
    """A minimal AMQP 0-9-1 publisher (one channel, publisher confirms) that sends property
    bytes exactly as given."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.frame_max = 131072

    async def __aenter__(self) -> RawPublisher:
        u = urlsplit(self.url)
        self._r, self._w = await asyncio.open_connection(u.hostname, u.port or 5672)
        self._w.write(b"AMQP\x00\x00\x09\x01")
        await self._expect(commands.Connection.Start)
        login = f"\0{unquote(u.username or 'guest')}\0{unquote(u.password or 'guest')}"
        self._send(0, commands.Connection.StartOk(client_properties={}, response=login))
        tune = await self._expect(commands.Connection.Tune)
        self.frame_max = tune.frame_max or self.frame_max
        self._send(0, commands.Connection.TuneOk(channel_max=1, frame_max=self.frame_max))
        self._send(0, commands.Connection.Open(virtual_host=unquote(u.path[1:]) or "/"))
        await self._expect(commands.Connection.OpenOk)
        self._send(1, commands.Channel.Open())
        await self._expect(commands.Channel.OpenOk)
        self._send(1, commands.Confirm.Select())
        await self._expect(commands.Confirm.SelectOk)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._w.close()
        with contextlib.suppress(Exception):
            await self._w.wait_closed()

    def _send(self, channel: int, frame: Any) -> None:
        self._w.write(pamqp.frame.marshal(frame, channel))

    async def _expect(self, kinds: Any) -> Any:
        while True:
            head = await self._r.readexactly(7)
            rest = await self._r.readexactly(struct.unpack(">I", head[3:7])[0] + 1)
            frame = pamqp.frame.unmarshal(head + rest)[2]
            if isinstance(frame, kinds):
                return frame
            if isinstance(frame, commands.Connection.Close | commands.Channel.Close):
                raise ConnectionError(f"broker closed: {frame.reply_code} {frame.reply_text}")

    async def publish(
        self,
        body: bytes,
        props: dict[str, Any],
        *,
        routing_key: str | bytes,
        exchange: str = INGRESS_EXCHANGE,
    ) -> None:
        """Publish and wait for the broker's confirm; ``routing_key`` and every string
        property may be arbitrary bytes."""
        method = struct.pack(">HHH", 60, 40, 0) + _short_str(exchange)
        method += _short_str(routing_key) + b"\x00"  # mandatory, immediate: off
        self._w.write(struct.pack(">BHI", 1, 1, len(method)) + method + b"\xce")
        self._w.write(content_header_frame(1, len(body), props))
        step = self.frame_max - 8
        for i in range(0, len(body), step):
            chunk = body[i : i + step]
            self._w.write(struct.pack(">BHI", 3, 1, len(chunk)) + chunk + b"\xce")
        ack = await self._expect(commands.Basic.Ack | commands.Basic.Nack)
        if not isinstance(ack, commands.Basic.Ack):
            raise ConnectionError(f"the broker refused the publish: {ack!r}")
