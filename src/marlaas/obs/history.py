"""A bounded history of busy time: how much of each recent second a stage was working.

`RunRecorder` keeps every span of a run, which suits a run that ends; a server runs for
days. `BusyHistory` keeps only the busy seconds per one-second bucket (wall-clock
aligned) for the last `horizon_s` seconds, so its memory is fixed, and answers the
utilization timeline of any recent window. Spans are added as the work ends (the device
thread adds its decode and train spans), so nothing polls.

Thread-safe: one lock guards the buckets (the device thread adds, server threads read).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BusyBucket:
    """Busy fraction of the wall-clock interval `[start, start + seconds)`."""

    start: float
    seconds: float
    busy: float


class BusyHistory:
    """Busy seconds per wall-clock second, for the last `horizon_s` seconds."""

    def __init__(
        self,
        horizon_s: int = 3600,
        *,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if horizon_s < 1:
            raise ValueError(f"horizon_s must be >= 1, got {horizon_s}")
        self.horizon_s = horizon_s
        self._wall_clock = wall_clock
        self._clock = clock
        self._busy = [0.0] * horizon_s  # bucket k holds second s with s % horizon == k
        self._second = [-1] * horizon_s  # which second bucket k currently holds
        self._lock = threading.Lock()
        self.origin = wall_clock()

    def to_wall(self, t: float) -> float:
        """A `clock` reading (e.g. `time.perf_counter()`) as wall-clock seconds."""
        return self._wall_clock() - (self._clock() - t)

    def add(self, start: float, end: float) -> None:
        """Record busy time over `[start, end]`, given as `clock` readings."""
        if end <= start:
            return
        lo, hi = self.to_wall(start), self.to_wall(end)
        with self._lock:
            second = math.floor(lo)
            while second < hi:
                part = min(hi, second + 1) - max(lo, second)
                k = second % self.horizon_s
                if self._second[k] != second:
                    self._second[k], self._busy[k] = second, 0.0
                self._busy[k] += part
                second += 1

    def timeline(self, window_s: float, bin_s: float) -> list[BusyBucket]:
        """Busy fractions in bins of `bin_s` seconds (whole seconds, at least 1) over the
        last `window_s` seconds (at most the horizon), oldest first, aligned to multiples
        of `bin_s` of wall-clock time; the first bin starts no earlier than this
        history's creation and the last one ends now."""
        now = self._wall_clock()
        step = max(1, round(bin_s))
        first = max(math.floor(now - min(window_s, self.horizon_s)), math.floor(self.origin))
        first -= first % step
        out: list[BusyBucket] = []
        with self._lock:
            start = first
            while start < now:
                lo, hi = max(float(start), self.origin), min(float(start + step), now)
                busy = sum(
                    self._busy[s % self.horizon_s]
                    for s in range(start, start + step)
                    if self._second[s % self.horizon_s] == s
                )
                if hi > lo:
                    out.append(
                        BusyBucket(start=lo, seconds=hi - lo, busy=min(busy / (hi - lo), 1.0))
                    )
                start += step
        return out
