"""The coordinator's stream tap handler (``Coordinator._on_stream_tap``) on messages as the
broker delivers them: chunks extend what the core follows of each stream, the end header
marks streams whose last tokens were sent, and anything else is counted and dropped."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qlm.coordinator.service import Coordinator
from qlm.planner import create_policy
from qlm.store import Store
from qlm.streaming import encode_token_message
from qlm.topology import STREAM_END_HEADER
from qlm.types import BatchedChunk
from tests.builders import heartbeat, make_request


@dataclass
class TapMessage:
    """What the handler reads of an incoming message."""

    body: bytes
    correlation_id: str | None = None
    type: str | None = "tokens"
    message_id: str | None = None
    headers: dict[str, Any] = field(default_factory=dict)


def chunk(rid: str, offset: int, ids: list[int]) -> BatchedChunk:
    return BatchedChunk(correlation_id=rid, request_id=rid, offset=offset, token_ids=ids, attempt=1)


async def test_chunks_and_the_end_header_reach_the_core(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    try:
        coord = Coordinator(amqp_url="amqp://unused", policy=create_policy("edf"), store=store)
        core = coord.core
        core.on_heartbeat(heartbeat("a", 1), now=0.0)
        tracked = {}
        for rid in ("s1", "s2"):
            req = make_request(request_id=rid, max_tokens=10, stream=True)
            tracked[rid], _ = core.admit(
                req, object(), reply_to="r", correlation_id=rid, received_at=0.0
            )
        body, cid = encode_token_message([chunk("s1", 0, [1, 2]), chunk("s2", 0, [5])])
        # the end header names the requests whose last tokens this message carries (bytes,
        # as a broker may deliver a header's strings)
        await coord._on_stream_tap(
            TapMessage(body, cid, headers={STREAM_END_HEADER: [b"s2", "nobody"]})
        )
        s1, s2 = tracked["s1"], tracked["s2"]
        assert s1.streamed is not None and s1.streamed.token_ids == [1, 2]
        assert s2.streamed is not None and s2.streamed.token_ids == [5]
        assert (s1.stream_ended, s2.stream_ended) == (False, True)
        # not a token message: counted and dropped, nothing changes
        await coord._on_stream_tap(TapMessage(b'{"type": "result"}'))
        await coord._on_stream_tap(TapMessage(b"x" * (coord.max_body_bytes + 1)))
        assert (coord.tap_messages, coord.tap_rejected) == (3, 2)
        assert s1.streamed.token_ids == [1, 2]
    finally:
        await store.close()
