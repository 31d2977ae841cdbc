"""VirtualQueue's shared tally: whatever changes a set of queues, their tally is the number of
requests they hold together (the coordinator reads it after every arrival)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qlm.virtual_queue import QueueTally, VirtualQueue

# (operation, queue index, request number, key)
_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "pop", "pop_restale", "remove", "replace", "clear"]),
        st.integers(0, 2),
        st.integers(0, 30),
        st.integers(0, 5),
    ),
    max_size=60,
)


@given(_ops)
def test_the_tally_counts_what_the_queues_hold(ops: list[tuple[str, int, int, int]]) -> None:
    tally = QueueTally()
    queues = [VirtualQueue(f"i{k}", tally) for k in range(3)]
    for op, q, n, key in ops:
        vq = queues[q]
        if op == "insert":
            vq.insert(f"r{n}", (key, n))
        elif op == "pop" and len(vq):
            vq.pop()
        elif op == "pop_restale" and len(vq):
            # every head moves once to the back: the queue is walked, not shortened
            vq.pop(lambda rid, k: (99, *k))
        elif op == "remove":
            vq.remove(f"r{n}")
        elif op == "replace":
            vq.replace([(f"r{m}", (m,)) for m in range(key)])
        elif op == "clear":
            vq.clear()
        assert tally.count == sum(len(v) for v in queues)
