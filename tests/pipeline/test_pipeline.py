"""End-to-end mechanics of `run_jobs` on a tiny base: several tenants at once in async
mode, the sync baseline, staleness, versions, outputs, failure isolation, admission,
fair share and resume."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from helpers.pipeline_support import MemoryRecorder, job
from marlaas.backends import open_backend
from marlaas.config.job import EngineSpec, JobSpec, RunSpec
from marlaas.envs.base import Env, Example, Segment, Split, StepResult, TaskFamily
from marlaas.envs.tasks import get_family
from marlaas.obs.recorder import NullRecorder
from marlaas.pipeline import Orchestrator, PipelineContext, PipelineOptions, RunResult, run_jobs
from marlaas.pipeline.runner import Mode

CPU = PipelineOptions(device="cpu")


def run_jobs_on(run: RunSpec, out: Path, **kw: Any) -> Coroutine[Any, Any, RunResult]:
    """`run_jobs` on the backend the run names (in-process here)."""
    return run_jobs(run, out, backend=open_backend, **kw)


def run_spec(base: Path, *jobs: JobSpec, **kw: Any) -> RunSpec:
    kw.setdefault("engine", EngineSpec.model_validate({"max_batch_size": 32, "max_rank": 4}))
    return RunSpec(base_model=str(base), jobs=jobs, **kw)


def mixed_jobs(steps: int = 4) -> tuple[JobSpec, ...]:
    common = {"steps": steps, "eval_every": 2, "checkpoint_every": 2}
    return (
        job("onpolicy", "arithmetic", staleness=0, **common),
        job("reverse", "reverse", staleness=1, **common),
        job("tools", "calculator", staleness=2, **common),
        job("urgent", "arithmetic", staleness=1, priority=2.0, seed=5, **common),
    )


def check_outputs(result: RunResult, out: Path, recorder: MemoryRecorder, steps: int) -> None:
    assert json.loads((out / "run.json").read_text())["jobs"]
    assert json.loads((out / "result.json").read_text())["mode"] == result.mode
    for name, r in result.tenants.items():
        assert r.status == "done", (name, r.failure_reason)
        assert r.steps_done == steps and r.failure_reason is None
        assert recorder.train_steps(name) == list(range(1, steps + 1))  # +1 per step, in order
        assert r.staleness_violations == 0
        assert sorted(r.eval_accuracy) == [0, 2, 4] == sorted(recorder.evals(name))
        assert r.eval_before is not None and r.eval_after is not None
        assert r.tokens_generated > 0 and r.tokens_trained > 0
        tenant = out / "tenants" / name
        assert (tenant / "adapter" / "adapter_config.json").is_file()
        ckpts = sorted(p.name for p in (tenant / "checkpoints").iterdir())
        assert ckpts == ["ckpt-00000002", "ckpt-00000004"]
    assert 0.0 < result.device_busy_fraction <= 1.0
    assert result.staleness_violations == 0
    # Every step samples groups of one prompt: all but the first of a group share its prefill.
    assert result.prefill_tokens and result.shared_prefill_tokens


async def test_async_tenants_respect_staleness_and_finish(base_dir: Path, tmp_path: Path) -> None:
    recorder = MemoryRecorder()
    jobs = mixed_jobs()
    result = await run_jobs_on(run_spec(base_dir, *jobs), tmp_path, recorder=recorder, options=CPU)
    check_outputs(result, tmp_path, recorder, steps=4)
    for spec in jobs:
        bound = spec.algorithm.max_staleness
        per_step = [int(m["staleness_max"]) for m in recorder.train_metrics(spec.name)]
        assert max(per_step) <= bound
        assert result.tenants[spec.name].staleness_max <= bound
    assert set(int(m["staleness_max"]) for m in recorder.train_metrics("onpolicy")) == {0}
    # The device interleaved work of several tenants: decode spans and train spans.
    assert {n for s, n, *_ in recorder.spans if s == "device"} == {"decode", "train"}


async def test_sync_baseline_runs_the_same_jobs(base_dir: Path, tmp_path: Path) -> None:
    recorder = MemoryRecorder()
    result = await run_jobs_on(
        run_spec(base_dir, *mixed_jobs()), tmp_path, mode="sync", recorder=recorder, options=CPU
    )
    check_outputs(result, tmp_path, recorder, steps=4)
    assert result.staleness_max == 0 and result.max_tenants_per_train_step == 1
    # One tenant at a time, highest priority first.
    lifecycle = [(n, t) for n, t, _ in recorder.events if n in ("tenant_admitted", "tenant_done")]
    names = [t for _, t in lifecycle]
    assert names[:2] == ["urgent", "urgent"]
    assert all(names[i] == names[i + 1] for i in range(0, len(names), 2))


class HangingFamily(TaskFamily):
    """Arithmetic prompts whose verifier never answers."""

    name = "hanging"

    def __init__(self) -> None:
        self.inner = get_family("arithmetic")

    def examples(self, split: Split, n: int, seed: int = 0) -> list[Example]:
        return self.inner.examples(split, n, seed)

    def make_env(self, example: Example) -> Env:
        return HangingEnv(example)

    def demonstration(self, example: Example) -> list[Segment]:
        return []


class HangingEnv(Env):
    def __init__(self, example: Example) -> None:
        self.example = example

    async def initial_observation(self) -> str:
        return self.example.prompt

    async def step(self, action: str) -> StepResult:
        await asyncio.Event().wait()  # a hung tool
        raise AssertionError("unreachable")


def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"Q: {i}+1\nA: ", "reference": str(i + 1)} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_failures_stay_with_their_tenant(base_dir: Path, tmp_path: Path, mode: Mode) -> None:
    data = dataset(tmp_path)
    raising = {"type": "python", "code": "def grade(c, r, row):\n    raise ValueError('boom')\n"}
    jobs = (
        job("healthy1", steps=3),
        job("bad_grader", task={"type": "dataset", "path": str(data), "grader": raising}),
        job("hung", steps=3),
        job(
            "bad_data",
            task={
                "type": "dataset",
                "path": str(tmp_path / "missing.jsonl"),
                "grader": {"type": "exact"},
            },
        ),
        job("healthy2", "reverse", steps=3, staleness=0),
    )
    recorder = MemoryRecorder()
    options = PipelineOptions(device="cpu", env_timeout_s=2.0, episode_retries=1)
    result = await run_jobs_on(
        run_spec(base_dir, *jobs),
        tmp_path / "out",
        mode=mode,
        recorder=recorder,
        options=options,
        tasks={"hung": HangingFamily()},
    )
    t = result.tenants
    for name in ("healthy1", "healthy2"):
        assert t[name].status == "done" and t[name].steps_done == 3
        assert recorder.train_steps(name) == [1, 2, 3]
    assert t["bad_grader"].status == "failed"
    assert "boom" in (t["bad_grader"].failure_reason or "")
    assert t["hung"].status == "failed"
    assert "timed out" in (t["hung"].failure_reason or "")
    assert t["bad_data"].status == "failed"
    assert "missing.jsonl" in (t["bad_data"].failure_reason or "")
    assert t["bad_grader"].episode_retries >= 1
    assert sorted(map(str, recorder.event_names("tenant_failed"))) == [
        "bad_data",
        "bad_grader",
        "hung",
    ]
    assert not (tmp_path / "out" / "tenants" / "hung" / "adapter").exists()


async def test_admission_caps_active_tenants_by_priority(base_dir: Path, tmp_path: Path) -> None:
    jobs = (
        job("a", steps=2),
        job("b", steps=2),
        job("c", steps=2, priority=3.0),
        job("d", steps=2, priority=2.0),
    )
    recorder = MemoryRecorder()
    result = await run_jobs_on(
        run_spec(base_dir, *jobs, max_active_tenants=2), tmp_path, recorder=recorder, options=CPU
    )
    assert all(r.status == "done" and r.steps_done == 2 for r in result.tenants.values())
    assert recorder.event_names("tenant_admitted") == ["c", "d", "a", "b"]
    active = peak = 0
    for name, _, _ in recorder.events:
        active += {"tenant_admitted": 1, "tenant_done": -1}.get(name, 0)
        peak = max(peak, active)
    assert peak == 2


async def test_priority_gets_more_of_a_saturated_engine(base_dir: Path, tmp_path: Path) -> None:
    # Same task, seed and data: only the priority differs. The engine has 4 rows; each
    # tenant's staleness bound lets it ask for all its groups at once (64 episodes), so
    # both are backlogged from their start to their end, and nothing but the gate's share
    # decides whose rows run. One tenant may start before the other (set-up order, a
    # loaded machine): the share is counted where both ran, from the later first group
    # to the earlier last one.
    steps = 8
    common: dict[str, Any] = {
        "steps": steps,
        "staleness": steps,
        "P": 4,
        "G": 8,
        "eval_episodes": 1,
        "sampling": {"max_new_tokens": 32, "temperature": 5.0},
    }
    jobs = (job("low", priority=1.0, **common), job("high", priority=2.0, **common))
    recorder = MemoryRecorder()
    result = await run_jobs_on(
        run_spec(
            base_dir, *jobs, engine=EngineSpec.model_validate({"max_batch_size": 4, "max_rank": 4})
        ),
        tmp_path,
        recorder=recorder,
        options=CPU,
    )
    assert all(r.status == "done" and r.steps_done == steps for r in result.tenants.values())
    groups = recorder.spans_of("rollout")
    start = max(min(t0 for t0, _ in groups[name]) for name in ("low", "high"))
    end = min(max(t1 for _, t1 in groups[name]) for name in ("low", "high"))
    done = {n: sum(start <= t1 <= end for _, t1 in groups[n]) for n in ("low", "high")}
    # Expected 2:1 (the weights); both progress (no starvation).
    assert done["low"] >= 1 and done["high"] >= 1.5 * done["low"], done


async def test_resume_continues_from_the_checkpoint(base_dir: Path, tmp_path: Path) -> None:
    def jobs(steps: int) -> RunSpec:
        return run_spec(
            base_dir,
            job("a", steps=steps, checkpoint_every=1, eval_every=2),
            job("b", "reverse", steps=steps, checkpoint_every=1, staleness=0),
        )

    first = MemoryRecorder()
    r1 = await run_jobs_on(jobs(2), tmp_path, recorder=first, options=CPU)
    assert all(r.steps_done == 2 for r in r1.tenants.values())
    ckpt2 = json.loads((tmp_path / "tenants/a/checkpoints/ckpt-00000002/state.json").read_text())
    second = MemoryRecorder()
    r2 = await run_jobs_on(jobs(4), tmp_path, recorder=second, options=CPU, restore=True)
    for name in ("a", "b"):
        assert r2.tenants[name].status == "done", r2.tenants[name].failure_reason
        assert first.train_steps(name) == [1, 2]
        assert second.train_steps(name) == [3, 4]  # nothing lost, nothing repeated
        assert r2.tenants[name].status == "done" and r2.tenants[name].steps_done == 4
        assert second.event_names("tenant_restored").count(name) == 1
    ckpt4 = json.loads((tmp_path / "tenants/a/checkpoints/ckpt-00000004/state.json").read_text())
    assert ckpt4["optimizer_step"] == 4 and ckpt4["version"] == 4
    assert ckpt4["extra"]["cursor"] > ckpt2["extra"]["cursor"]
    # The eval history survives the resume; version 2 was evaluated in the first run.
    assert sorted(r2.tenants["a"].eval_accuracy) == [0, 2, 4]
    assert sorted(second.evals("a")) == [4]
    # b evaluates only before and after (eval_every 0): no extra eval where it resumed
    # (version 2 was the first run's last).
    assert sorted(second.evals("b")) == [4]


async def test_cancel_and_pause(base_dir: Path, tmp_path: Path) -> None:
    recorder = MemoryRecorder()
    run = run_spec(
        base_dir, job("a", steps=3), job("b", steps=3), job("c", steps=3), max_active_tenants=2
    )
    ctx = await PipelineContext.open(
        run, tmp_path, backend=open_backend, recorder=recorder, options=CPU
    )
    orch = Orchestrator(ctx, run.jobs)
    try:
        orch.cancel("c")  # still queued
        task = asyncio.create_task(orch.run())
        first_step = asyncio.Event()
        recorder.on_metrics = lambda tenant, step: first_step.set() if tenant == "a" else None
        await asyncio.wait_for(first_step.wait(), 60)
        orch.pause("b")
        orch.cancel("a")
        steps_b = len(recorder.train_steps("b"))
        await asyncio.sleep(0.2)
        assert len(recorder.train_steps("b")) <= steps_b + 1  # at most the step in flight
        orch.unpause("b")
        states = await asyncio.wait_for(task, 60)
    finally:
        await ctx.backend.close()
    assert states["c"].status == "cancelled" and states["c"].version == 0
    assert states["a"].status == "cancelled" and states["a"].version < 3
    assert states["b"].status == "done" and states["b"].version == 3


async def test_a_device_failure_stops_the_run(base_dir: Path, tmp_path: Path) -> None:
    run = run_spec(base_dir, job("a", steps=3), job("b", "reverse", steps=3))
    ctx = await PipelineContext.open(
        run, tmp_path, backend=open_backend, recorder=NullRecorder(), options=CPU
    )

    def broken(inputs: object) -> object:
        raise RuntimeError("device lost")

    ctx.device.compute.trainer.forward_backward = broken  # type: ignore[attr-defined]
    orch = Orchestrator(ctx, run.jobs)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            await asyncio.wait_for(orch.run(), 60)
    finally:
        await ctx.backend.close()
    assert {s.status for s in orch.states.values()} <= {"cancelled", "failed"}


async def test_a_teardown_error_is_logged_and_the_tenant_keeps_its_status(
    base_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = run_spec(base_dir, job("a", steps=1))
    ctx = await PipelineContext.open(
        run, tmp_path, backend=open_backend, recorder=NullRecorder(), options=CPU
    )

    async def broken(name: str, *, keep_adapter: bool = False) -> None:
        raise RuntimeError("the slot table is corrupt")

    ctx.device.drop_tenant = broken  # type: ignore[method-assign]
    try:
        states = await asyncio.wait_for(Orchestrator(ctx, run.jobs).run(), 120)
    finally:
        await ctx.backend.close()
    assert states["a"].status == "done"
    assert "tenant 'a': freeing its training state failed" in caplog.text
    assert "the slot table is corrupt" in caplog.text
