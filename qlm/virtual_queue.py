"""VirtualQueue: one instance's ordered list of request references (QLM §4).

The broker holds the only copy of each request (an unacked delivery); a virtual queue holds
ids in the order the policy chose. Inserts keep the order by the policy's sort key with
``bisect`` over a parallel key list, so an arrival costs O(log n) comparisons.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Any

# (request id, its key) -> its new key, or None to take it as it is
Restale = Callable[[str, tuple[Any, ...]], tuple[Any, ...] | None]


class QueueTally:
    """How many requests a set of virtual queues holds together, kept by the queues as they
    change: the coordinator asks after every arrival whether a replan is worth running, which
    summing the queues of a hundred instances made O(instances)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class VirtualQueue:
    def __init__(self, instance_id: str, tally: QueueTally | None = None) -> None:
        self.instance_id = instance_id
        self._ids: list[str] = []
        self._keys: list[tuple[Any, ...]] = []
        self._tally = tally if tally is not None else QueueTally()

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._ids))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def insert(self, request_id: str, key: tuple[Any, ...]) -> int:
        """Insert after every entry whose key is <= key (ties keep arrival order)."""
        pos = bisect.bisect_right(self._keys, key)
        self._keys.insert(pos, key)
        self._ids.insert(pos, request_id)
        self._tally.count += 1
        return pos

    def head(self, n: int) -> list[str]:
        """The first ``n`` ids, in order (a copy)."""
        return self._ids[:n]

    def peek(self) -> str | None:
        return self._ids[0] if self._ids else None

    def pop(self, restale: Restale | None = None) -> str:
        """Remove and return the head. With ``restale``, each head is asked first
        (:meth:`qlm.policy.QueuePolicy.stale_key`): a new key moves that request there, at most
        once per call, and the next head is asked."""
        if restale is not None:
            moved: set[str] = set()
            while self._ids[0] not in moved:
                rid, key = self._ids[0], self._keys[0]
                new = restale(rid, key)
                if new is None:
                    break
                moved.add(rid)
                del self._ids[0], self._keys[0]
                self._tally.count -= 1
                self.insert(rid, new)
        self._keys.pop(0)
        self._tally.count -= 1
        return self._ids.pop(0)

    def remove(self, request_id: str) -> bool:
        try:
            pos = self._ids.index(request_id)
        except ValueError:
            return False
        del self._ids[pos]
        del self._keys[pos]
        self._tally.count -= 1
        return True

    def replace(self, ordered: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Adopt a new plan's order (keys given so later inserts stay consistent)."""
        self._tally.count += len(ordered) - len(self._ids)
        self._ids = [rid for rid, _ in ordered]
        self._keys = [k for _, k in ordered]

    def clear(self) -> list[str]:
        ids, self._ids, self._keys = self._ids, [], []
        self._tally.count -= len(ids)
        return ids
