"""The admin API's instance view shows the pull protocol's state (credit held, the agent's
outstanding credit, dispatches in transit): what tells an operator an instance is stalled."""

from __future__ import annotations

from pathlib import Path

from qlm.coordinator.service import Coordinator
from qlm.planner import create_policy
from qlm.store import Store
from tests.builders import heartbeat, make_request


async def test_the_instance_view_shows_credit_and_dispatches_in_transit(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/qlm.db")
    try:
        coord = Coordinator(amqp_url="amqp://unused", policy=create_policy("edf"), store=store)
        core = coord.core
        hb = heartbeat("a")
        hb.instances[0].credit_outstanding, hb.instances[0].dispatches_received = 0, 0
        core.on_heartbeat(hb, now=0.0)
        [view] = coord.list_instances()
        assert (view["credit"], view["credit_outstanding"], view["dispatches_in_transit"]) == (
            0,
            0,
            0,
        )
        for k in range(3):
            req = make_request(request_id=f"r{k}")
            core.admit(req, object(), reply_to="r", correlation_id=req.request_id, received_at=0)
        core.on_pull("a-gpu0", 5)
        assert len(core.next_dispatches(0.1)) == 3
        [view] = coord.list_instances()
        # 2 of the 5 pulled left; 3 sent, none received as of the last heartbeat
        assert (view["credit"], view["dispatches_in_transit"]) == (2, 3)
        assert view["max_model_len"] == {}  # the engine says nothing: the catalog's
        core.on_heartbeat(heartbeat("b", max_model_len={"mistral-7b": 3000}), now=0.2)
        by_id = {v["instance_id"]: v for v in coord.list_instances()}
        assert by_id["b-gpu0"]["max_model_len"] == {"mistral-7b": 3000}
    finally:
        await store.close()
