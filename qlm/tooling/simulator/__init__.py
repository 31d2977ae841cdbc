"""Discrete-event cluster simulator: qlm's policies on simulated vLLM-like engines.

``scenario`` (validated scenario files), ``workload`` (requests of a scenario), ``instance``
(one engine), ``cluster`` (the coordinator rules and the event loop), ``presets`` (the named
scenarios reproducing the QLM paper's evaluation), ``runner`` (every policy on a scenario, the
summary) and ``report`` (JSON, Markdown, plots). See docs/simulator.md.
"""
