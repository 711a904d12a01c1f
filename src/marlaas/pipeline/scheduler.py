"""Admission of tenants to a run: jobs beyond `max_active_tenants` wait in an
`AdmissionQueue`, higher priority first, FIFO within a priority. (The fair share of the
sampler between admitted tenants is the device's: `marlaas.device.gate`.)
"""

from __future__ import annotations

import heapq
import itertools


class AdmissionQueue:
    """Jobs waiting for a place: highest priority first, FIFO within a priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()

    def push(self, name: str, priority: float) -> None:
        heapq.heappush(self._heap, (-priority, next(self._seq), name))

    def pop(self) -> str:
        return heapq.heappop(self._heap)[2]

    def remove(self, name: str) -> bool:
        kept = [e for e in self._heap if e[2] != name]
        found = len(kept) != len(self._heap)
        self._heap = kept
        heapq.heapify(self._heap)
        return found

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, name: object) -> bool:
        return any(e[2] == name for e in self._heap)
