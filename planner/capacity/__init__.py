"""Capacity policies (SageServe's ILP, LT-I / LT-U / LT-UA, reactive and CATO baselines) in
:mod:`.policies`, and the live autoscaler loop that runs one in the coordinator in
:mod:`.live_loop`. Runtime parts: ``qlm.capacity``; simulation: ``qlm.tooling.capacity``."""
