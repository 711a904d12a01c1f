"""The bounded busy history behind the live device-utilization figure."""

from __future__ import annotations

import pytest

from marlaas.obs.history import BusyHistory


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def history(horizon: int = 60) -> tuple[BusyHistory, Clock]:
    wall = Clock(1000.0)
    # perf clock == wall clock - 900, so span times below read as wall times + 900
    return BusyHistory(horizon, wall_clock=wall, clock=lambda: wall.t - 900.0), wall


def test_spans_split_across_seconds_and_bins_report_fractions() -> None:
    h, wall = history()
    h.add(100.5, 101.5)  # wall [1000.5, 1001.5]: half of second 1000, half of 1001
    h.add(102.0, 102.25)  # a quarter of second 1002
    wall.t = 1004.0
    bins = h.timeline(window_s=10, bin_s=1)
    assert [(b.start, b.seconds) for b in bins] == [(1000.0 + i, 1.0) for i in range(4)]
    assert [b.busy for b in bins] == pytest.approx([0.5, 0.5, 0.25, 0.0])
    two = h.timeline(window_s=10, bin_s=2)
    assert [b.busy for b in two] == pytest.approx([0.5, 0.125])


def test_memory_is_bounded_and_old_seconds_are_forgotten() -> None:
    h, wall = history(horizon=10)
    h.add(100.0, 101.0)  # second 1000, fully busy
    wall.t = 1015.0
    h.add(114.0, 115.0)  # second 1014 reuses bucket 4 (1014 % 10), not 1000's
    bins = h.timeline(window_s=100, bin_s=1)
    assert len(bins) == 10  # never more than the horizon
    assert bins[0].start == 1005.0
    assert [b.busy for b in bins] == pytest.approx([0.0] * 9 + [1.0])


def test_window_starts_no_earlier_than_creation_and_rejects_bad_horizon() -> None:
    h, wall = history()
    wall.t = 1002.5
    bins = h.timeline(window_s=60, bin_s=1)
    assert [b.start for b in bins] == [1000.0, 1001.0, 1002.0]
    assert bins[-1].seconds == pytest.approx(0.5)
    with pytest.raises(ValueError, match="horizon_s"):
        BusyHistory(0)
