"""Fixtures for the obs tests: a recorder on a hand-driven clock and a small sample run."""

from __future__ import annotations

from pathlib import Path

import pytest

from marlaas.obs.memory import RunRecorder


class FakeClock:
    """A perf_counter stand-in that only moves when told to."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def recorder(clock: FakeClock) -> RunRecorder:
    return RunRecorder(clock=clock, wall_clock=lambda: 1_700_000_000.0)


def fill_sample_run(rec: RunRecorder, clock: FakeClock, steps: int = 6) -> None:
    """Two tenants training for `steps` steps over 10 s: device busy 60%, some overlap."""
    t0 = rec.origin
    rec.event("admitted", tenant="alpha", total_steps=steps)
    rec.event("admitted", tenant="beta", total_steps=steps)
    for i in range(steps):
        base = t0 + i * (10.0 / steps)
        clock.t = base
        rec.span("device", "decode", base, base + 0.4 * 10.0 / steps)
        rec.span("device", "train", base + 0.2 * 10.0 / steps, base + 0.6 * 10.0 / steps)
        rec.span("env", "verify", base, base + 0.5, tenant="alpha")
        rec.span("env", "verify", base + 0.25, base + 0.75, tenant="alpha")
        rec.span("rollout", "episode", base, base + 1.0, tenant="beta", args={"version": i})
        rec.metrics("alpha", i + 1, {"reward": 0.1 * i, "eval_accuracy": 0.3 + 0.05 * i})
        rec.metrics("beta", i + 1, {"reward": 0.2 + 0.05 * i})
    clock.t = t0 + 10.0
    rec.event("finished", tenant="alpha")


@pytest.fixture
def sample(recorder: RunRecorder, clock: FakeClock) -> RunRecorder:
    fill_sample_run(recorder, clock)
    return recorder


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
