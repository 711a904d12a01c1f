"""Fixtures for the obs tests: a recorder on a hand-driven clock and a small sample run,
reported with free-form metrics and events (`sample`) or, as the pipeline reports, with
typed progress records (`progress_sample`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from obs_support import FakeClock, step_metrics

from marlaas.obs.memory import RunRecorder
from marlaas.obs.progress import EvalDone, StepDone, TenantEnded, TenantQueued, TenantStarted
from marlaas.status import JobStatus


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def recorder(clock: FakeClock) -> RunRecorder:
    return RunRecorder(clock=clock, wall_clock=lambda: 1_700_000_000.0)


def fill_sample_run(
    rec: RunRecorder, clock: FakeClock, steps: int = 6, *, typed: bool = False
) -> None:
    """Two tenants training for `steps` steps over 10 s: device busy 60%, some overlap.
    Alpha's reward at step i + 1 is 0.1 i and its eval accuracy 0.3 + 0.05 i; beta's
    reward 0.2 + 0.05 i; alpha ends, beta still runs."""
    t0 = rec.origin
    if typed:
        for tenant in ("alpha", "beta"):
            rec.progress(TenantQueued(tenant, steps))
            rec.progress(TenantStarted(tenant))
    else:
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
        if typed:
            rec.progress(StepDone("alpha", i + 1, step_metrics(0.1 * i)))
            rec.progress(EvalDone("alpha", i + 1, 0.3 + 0.05 * i))
            rec.progress(StepDone("beta", i + 1, step_metrics(0.2 + 0.05 * i)))
        else:
            rec.metrics("alpha", i + 1, {"reward": 0.1 * i, "eval_accuracy": 0.3 + 0.05 * i})
            rec.metrics("beta", i + 1, {"reward": 0.2 + 0.05 * i})
    clock.t = t0 + 10.0
    if typed:
        rec.progress(TenantEnded("alpha", JobStatus.DONE, None))
    else:
        rec.event("finished", tenant="alpha")


@pytest.fixture
def sample(recorder: RunRecorder, clock: FakeClock) -> RunRecorder:
    fill_sample_run(recorder, clock)
    return recorder


@pytest.fixture
def progress_sample(recorder: RunRecorder, clock: FakeClock) -> RunRecorder:
    fill_sample_run(recorder, clock, typed=True)
    return recorder


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
