"""The tenant state machine: transitions, the launch bound, staleness-checked batches."""

from __future__ import annotations

import pytest

from helpers.pipeline_support import job
from marlaas.pipeline.tenant import PipelineError, TenantState, describe_failure
from marlaas.status import JobStatus
from marlaas.train.batch import TenantStepResult, TrainBatch
from marlaas.types import Trajectory


def traj(tenant: str, version: int, reward: float = 0.0, n: int = 0) -> Trajectory:
    return Trajectory(
        tenant=tenant,
        example_id=f"ex-{n}",
        prompt_ids=(5, 6),
        token_ids=(7, 8),
        loss_mask_T=(1, 1),
        logprobs_T=(-1.0, -1.0),
        reward=reward,
        min_version=version,
        max_version=version,
        turns=1,
        finish_reason="stop",
    )


def group(tenant: str, version: int, G: int = 2) -> list[Trajectory]:
    return [traj(tenant, version, reward=float(i % 2), n=i) for i in range(G)]


def result_for(batch: TrainBatch) -> TenantStepResult:
    sums: dict[str, float] = {}
    sums["tokens"] = 4.0
    return TenantStepResult.from_sums(
        batch, batch.step + 1, sums, 0.0, 1e-3, False, len(batch.trajectories)
    )


def running(**kw: object) -> TenantState:
    state = TenantState(job("t", P=2, G=2, **kw))  # type: ignore[arg-type]
    state.transition(JobStatus.RUNNING)
    return state


def test_transitions_are_checked() -> None:
    state = TenantState(job("t"))
    with pytest.raises(PipelineError):
        state.transition(JobStatus.DONE)  # queued -> done skips running
    state.transition(JobStatus.RUNNING)
    state.transition(JobStatus.PAUSED)
    state.transition(JobStatus.RUNNING)
    state.transition(JobStatus.FAILED, "boom")
    assert state.status.terminal and state.reason == "boom"
    with pytest.raises(PipelineError):
        state.transition(JobStatus.RUNNING)


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_launch_bound_is_staleness_plus_one_steps(staleness: int) -> None:
    state = running(staleness=staleness, steps=100)
    launched = 0
    while state.can_launch():
        assert state.launch() == launched  # data indices in order
        launched += 1
    assert launched == (staleness + 1) * 2
    state.transition(JobStatus.PAUSED)
    assert not state.can_launch() and not state.can_train()


def test_launch_stops_at_the_last_step() -> None:
    state = running(staleness=5, steps=2)
    while state.can_launch():
        state.launch()
    assert state.in_flight == 4  # steps * P, not (s + 1) * P


def test_on_policy_tenant_trains_only_fresh_groups() -> None:
    state = running(staleness=0, steps=5)
    for _ in range(2):
        state.launch()
    assert not state.can_launch()  # groups in flight fill the bound
    state.group_done(group("t", 0))
    assert state.take_batch() is None  # one group of two
    state.group_done(group("t", 0))
    batch = state.take_batch()
    assert batch is not None and batch.step == 0 and batch.staleness() == (0, 0, 0, 0)
    assert not state.can_launch()  # the groups in training still count
    state.on_trained(batch, result_for(batch))
    assert state.version == 1 and state.can_launch()
    # A group sampled at version 0 arriving now is stale for step 1: dropped, re-sampled.
    state.launch()
    state.launch()
    state.group_done(group("t", 0))
    state.group_done(group("t", 1))
    assert state.take_batch() is None
    assert state.stats.groups_dropped_stale == 1
    assert state.can_launch()
    state.launch()
    state.group_done(group("t", 1))
    batch = state.take_batch()
    assert batch is not None and max(batch.staleness()) == 0
    assert state.stats.staleness_violations == 0


def test_batches_never_exceed_max_staleness_and_prefer_oldest() -> None:
    state = running(staleness=2, steps=10)
    state.version = 3
    for _ in range(4):
        state.launch()
    for version in (3, 0, 1, 2):  # version 0 is stale at step 3 (3 - 2 = 1)
        state.group_done(group("t", version))
    batch = state.take_batch()
    assert batch is not None
    assert sorted({t.min_version for t in batch.trajectories}) == [1, 2]
    assert max(batch.staleness()) == 2
    assert state.stats.groups_dropped_stale == 1
    assert [g[0].min_version for g in state.buffer] == [3]


def test_version_goes_up_by_exactly_one() -> None:
    state = running(staleness=0, steps=5)
    state.launch()
    state.launch()
    state.group_done(group("t", 0))
    state.group_done(group("t", 0))
    batch = state.take_batch()
    assert batch is not None
    wrong = TenantStepResult.from_sums(batch, 2, {}, 0.0, 1e-3, False, 0)
    with pytest.raises(PipelineError, match="exactly one"):
        state.on_trained(batch, wrong)
    state.on_trained(batch, result_for(batch))
    assert state.version == 1 and state.stats.steps_this_run == 1


def test_a_foreign_trajectory_is_refused() -> None:
    state = running()
    state.launch()
    with pytest.raises(PipelineError):
        state.group_done(group("other", 0))


def test_restore_continues_version_and_cursor() -> None:
    state = TenantState(job("t", P=2, G=2, steps=4))
    state.restore(version=2, cursor=5)
    state.transition(JobStatus.RUNNING)
    assert state.launch() == 5
    launched = 1
    while state.can_launch():
        state.launch()
        launched += 1
    assert launched == 4  # (s + 1) * P with s = 1; all within the 2 remaining steps


def test_describe_failure_names_the_cause() -> None:
    try:
        try:
            raise ValueError("grader exploded")
        except ValueError as inner:
            raise RuntimeError("episode failed") from inner
    except RuntimeError as exc:
        text = describe_failure(exc)
    assert "episode failed" in text and "grader exploded" in text
