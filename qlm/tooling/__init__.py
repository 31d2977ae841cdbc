"""Tooling around the runtime: the cluster simulator, the benches, chaos scenarios, the demo,
the private broker and PostgreSQL helpers and replay reports. The runtime never imports it
(import contracts in pyproject.toml); only ``qlm.cli`` wires the two together."""
