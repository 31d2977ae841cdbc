"""A chaos scenario that leaves requests unanswered says where they wait and the pull
protocol's state of those instances (admin API, served here by a fake transport)."""

from __future__ import annotations

import httpx

from qlm.tooling.chaos.scenarios import _credit_of


def _admin(rows: list[dict[str, object]]) -> httpx.AsyncClient:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/instances"
        return httpx.Response(200, json=rows)

    return httpx.AsyncClient(base_url="http://admin", transport=httpx.MockTransport(answer))


async def test_the_note_names_the_credit_of_the_instances_waited_on() -> None:
    rows: list[dict[str, object]] = [
        {
            "instance_id": "c0-gpu0",
            "credit": 0,
            "credit_outstanding": 8,
            "dispatches_in_transit": 8,
        },
        {
            "instance_id": "c1-gpu0",
            "credit": 3,
            "credit_outstanding": 3,
            "dispatches_in_transit": 0,
        },
    ]
    async with _admin(rows) as http:
        note = await _credit_of(http, {"c0-gpu0"})
        assert note == "credit of those instances: c0-gpu0 held 0 / agent owed 8 / in transit 8"
        assert await _credit_of(http, set()) is None
        assert await _credit_of(http, {"gone"}) is None
