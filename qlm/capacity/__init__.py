"""Capacity that follows demand, the runtime half: what the coordinator measures for an
autoscaler (:mod:`.telemetry`), the next-hour demand forecast (:mod:`.forecast`) and the drivers
that carry a decision out (:mod:`.drivers`). The policies that decide live in
``qlm.planner.capacity``; the simulator's autoscaling loop in ``qlm.tooling.capacity``. The whole
feature is described in docs/capacity.md."""
