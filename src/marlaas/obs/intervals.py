"""Busy time as a set of disjoint intervals.

A stage is busy when at least one of its spans is running, so overlapping or touching
spans count once. `IntervalSet` keeps the union of the spans added so far as sorted,
disjoint `[start, end)` intervals plus the running total of their lengths, so that
the busy time inside any window costs two binary searches, O(log n), however long the
run. Spans mostly arrive in time order, so an insertion usually changes only the
tail; an out-of-order one costs O(n - i) to redo the running totals after it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right


class IntervalSet:
    """The union of closed-open intervals; not thread-safe (the recorder locks)."""

    __slots__ = ("_cum", "_ends", "_starts")

    def __init__(self) -> None:
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._cum: list[float] = [0.0]  # _cum[k]: total length of intervals 0..k-1

    def __len__(self) -> int:
        """The number of disjoint intervals the union consists of."""
        return len(self._starts)

    def add(self, start: float, end: float) -> None:
        """Add `[start, end)`; empty intervals are ignored."""
        if end <= start:
            return
        # Intervals i..j-1 overlap or touch the new one: ends >= start and starts <= end.
        i = bisect_left(self._ends, start)
        j = bisect_right(self._starts, end)
        if i < j:
            start = min(start, self._starts[i])
            end = max(end, self._ends[j - 1])
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]
        del self._cum[i + 1 :]
        total = self._cum[i]
        for k in range(i, len(self._starts)):
            total += self._ends[k] - self._starts[k]
            self._cum.append(total)

    def measure(self, start: float, end: float) -> float:
        """Total length of the union inside `[start, end)`."""
        if end <= start:
            return 0.0
        first = bisect_right(self._ends, start)  # the first interval ending after `start`
        stop = bisect_left(self._starts, end)  # intervals before it start before `end`
        if first >= stop:
            return 0.0
        total = self._cum[stop] - self._cum[first]
        total -= max(0.0, start - self._starts[first])  # clip the first interval
        total -= max(0.0, self._ends[stop - 1] - end)  # and the last one
        return max(total, 0.0)

    def total(self) -> float:
        """Total length of the union."""
        return self._cum[-1]

    def intervals(self) -> list[tuple[float, float]]:
        return list(zip(self._starts, self._ends, strict=True))
