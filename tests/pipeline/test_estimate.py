"""The synchronous-baseline estimate: per-tenant times from a slice's records, the
baseline's eval/checkpoint schedule, the linear extrapolation, and one real slice run."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.pipeline_support import job
from marlaas.backends import open_backend
from marlaas.config.job import RunSpec
from marlaas.errors import ConfigError
from marlaas.obs.memory import RunRecorder
from marlaas.obs.progress import Progress, TenantEnded, TenantStarted
from marlaas.obs.records import Span
from marlaas.pipeline.estimate import (
    SliceMeasurement,
    TenantSample,
    checkpoint_count,
    estimate_sync_time,
    eval_count,
    extrapolate,
    measure_slice,
    slice_spec,
    step_times,
)
from marlaas.status import JobStatus


@pytest.mark.parametrize(
    ("steps", "eval_every", "evals"),
    [(1, 0, 2), (16, 0, 2), (10, 3, 5), (9, 3, 4), (4, 1, 5)],
)
def test_eval_count_follows_the_baseline_schedule(steps: int, eval_every: int, evals: int) -> None:
    # before + every `eval_every` strictly before the last step + after the last step
    assert eval_count(job("a", steps=steps, eval_every=eval_every)) == evals


@pytest.mark.parametrize(
    ("steps", "every", "checkpoints"),
    [(1, 0, 1), (16, 0, 1), (8, 4, 2), (9, 4, 3), (3, 1, 3)],
)
def test_checkpoint_count_follows_the_baseline_schedule(
    steps: int, every: int, checkpoints: int
) -> None:
    assert checkpoint_count(job("a", steps=steps, checkpoint_every=every)) == checkpoints


def test_slice_spec_cuts_steps_only() -> None:
    run = RunSpec(jobs=(job("a", steps=5, eval_every=2), job("b", steps=1)))
    cut = slice_spec(run, 2)
    assert [j.steps for j in cut.jobs] == [2, 1]
    assert cut.jobs[0].model_copy(update={"steps": 5}) == run.jobs[0]
    with pytest.raises(ConfigError, match="at least 1 step"):
        slice_spec(run, 0)


def _span(stage: str, start: float, end: float, tenant: str = "a") -> Span:
    return Span(stage, stage, start, end, tenant)


def test_step_times_run_from_first_rollout_to_train_end() -> None:
    rollouts = [_span("rollout", 0.5, 2.0), _span("rollout", 0.0, 1.0)]
    rollouts += [_span("rollout", 3.5, 4.0), _span("rollout", 3.25, 5.0)]
    trains = [_span("train", 5.0, 5.5), _span("train", 2.0, 3.0)]  # order does not matter
    assert step_times(rollouts, trains) == (3.0, 2.25)
    assert step_times([], [_span("train", 1.0, 1.5)]) == (0.5,)  # no rollout: the train span


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _slice_recorder() -> RunRecorder:
    """A synchronous slice of three tenants, 1 step each, with hand-set times:
    a: admitted 10, eval 1.0, step 1.5, eval 1.0, checkpoint 0.25, done 14.5;
    b: admitted 15, eval 0.5, step 2.5 (two groups), eval 0.5, checkpoint 0.5, done 19.5;
    c: admitted 19.75, never done (it failed)."""
    clock = _Clock()
    rec = RunRecorder(clock=clock)

    def event(record: Progress, at: float) -> None:
        clock.t = at
        rec.progress(record)

    event(TenantStarted("a"), 10.0)
    rec.span("eval", "eval", 10.5, 11.5, tenant="a")
    rec.span("rollout", "group", 11.5, 12.5, tenant="a")
    rec.span("train", "step", 12.5, 13.0, tenant="a")
    rec.span("eval", "eval", 13.0, 14.0, tenant="a")
    rec.span("checkpoint", "save", 14.0, 14.25, tenant="a")
    event(TenantEnded("a", JobStatus.DONE, None), 14.5)
    event(TenantStarted("b"), 15.0)
    rec.span("eval", "eval", 15.0, 15.5, tenant="b")
    rec.span("rollout", "group", 15.5, 17.5, tenant="b")
    rec.span("rollout", "group", 16.0, 17.0, tenant="b")
    rec.span("train", "step", 17.5, 18.0, tenant="b")
    rec.span("eval", "eval", 18.0, 18.5, tenant="b")
    rec.span("checkpoint", "save", 18.5, 19.0, tenant="b")
    event(TenantEnded("b", JobStatus.DONE, None), 19.5)
    event(TenantStarted("c"), 19.75)
    event(TenantEnded("c", JobStatus.FAILED, "it failed"), 20.0)
    return rec


def test_measure_slice_splits_each_tenants_time() -> None:
    m = measure_slice(_slice_recorder(), wall_s=20.0)
    assert set(m.tenants) == {"a", "b"}  # c never finished
    a, b = m.tenants["a"], m.tenants["b"]
    assert (a.wall_s, a.step_s, a.eval_s, a.checkpoint_s) == (4.5, (1.5,), (1.0, 1.0), (0.25,))
    assert a.fixed_s == 0.75  # 4.5 - 1.5 - 2.0 - 0.25
    assert (b.wall_s, b.step_s, b.eval_s, b.checkpoint_s) == (4.5, (2.5,), (0.5, 0.5), (0.5,))
    assert b.fixed_s == 0.5
    assert m.between_tenants_s == 11.0  # 20 - 4.5 - 4.5


def test_extrapolate_is_linear_per_tenant_and_sums_tenants() -> None:
    m = measure_slice(_slice_recorder(), wall_s=10.0)  # between tenants: 1.0
    jobs = [
        job("a", steps=8),
        job("b", steps=10, eval_every=4, checkpoint_every=5),
        job("c", steps=3),
    ]
    est = extrapolate(m, jobs, slice_steps=1)
    a, b = est.tenants["a"], est.tenants["b"]
    # a: 0.75 fixed + 8 steps x 1.5 + 2 evals x 1.0 + 1 checkpoint x 0.25
    assert (a.steps, a.evals, a.checkpoints) == (8, 2, 1)
    assert a.total_s == 15.0
    # b: 0.5 + 10 x 2.5 + 4 evals (before, 4, 8, after) x 0.5 + 2 checkpoints (5, 10) x 0.5
    assert (b.steps, b.evals, b.checkpoints) == (10, 4, 2)
    assert b.total_s == 28.5
    assert est.total_s == 44.5  # 1.0 between tenants + 15.0 + 28.5
    assert est.missing == ("c",)
    text = est.explain()
    assert "1 step(s) of each of the 2 tenants" in text
    assert "add up to 44.5 s" in text and "failed in the slice): c" in text
    data = est.to_json()
    assert data["total_s"] == 44.5 and data["tenants"]["b"]["total_s"] == 28.5
    assert data["method"] == text


def test_extrapolate_averages_several_measured_steps() -> None:
    sample = TenantSample("a", wall_s=10.0, step_s=(2.0, 3.0), eval_s=(), checkpoint_s=(1.0,))
    m = SliceMeasurement(wall_s=10.0, tenants={"a": sample})
    est = extrapolate(m, [job("a", steps=6)], slice_steps=2)
    # fixed 10 - 5 - 1 = 4; no evals measured (none in this task), so none are counted
    assert est.tenants["a"].evals == 0
    assert est.total_s == 4.0 + 6 * 2.5 + 1.0


async def test_a_real_slice_measures_the_baselines_schedule(tiny_dir: Path, tmp_path: Path) -> None:
    jobs = (
        job("x", steps=4, eval_every=1, checkpoint_every=1),
        job("y", "reverse", steps=3, max_new_tokens=8),
    )
    run = RunSpec(base_model=str(tiny_dir), jobs=jobs)
    recorder = RunRecorder()
    est, result = await estimate_sync_time(
        run, tmp_path, backend=open_backend, slice_steps=2, recorder=recorder
    )
    assert result.mode == "sync" and all(t.steps_done == 2 for t in result.tenants.values())
    m = measure_slice(recorder, result.wall_s)
    # what the slice did is what the schedule functions say the baseline does
    for spec in slice_spec(run, 2).jobs:
        sample = m.tenants[spec.name]
        assert len(sample.step_s) == 2
        assert len(sample.eval_s) == eval_count(spec)
        assert len(sample.checkpoint_s) == checkpoint_count(spec)
    x = est.tenants["x"]
    assert (x.steps, x.evals, x.checkpoints) == (4, 5, 4)
    assert est.missing == () and est.total_s > 0
