"""The long-lived pipeline: jobs submitted while it runs, the serve mode that waits for
more, per-tenant progress records, pause/resume/cancel, a graceful close that
checkpoints, and resuming a closed job in a new runtime."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from helpers.pipeline_support import MemoryRecorder, job
from marlaas.backends import open_backend
from marlaas.config.job import EngineSpec, PipelineSpec
from marlaas.errors import ConfigError
from marlaas.obs.progress import (
    CheckpointWritten,
    EvalDone,
    StepDone,
    TenantEnded,
    TenantRestored,
    TenantStarted,
)
from marlaas.pipeline import PipelineError, PipelineOptions
from marlaas.pipeline.runtime import PipelineRuntime, RuntimeFailed, RuntimeProgress
from marlaas.train.checkpoint import list_checkpoints

CPU = PipelineOptions(device="cpu")


def start_runtime(spec: PipelineSpec, out: Path, **kw: Any) -> Coroutine[Any, Any, PipelineRuntime]:
    """`PipelineRuntime.start` on the backend the spec names (in-process here)."""
    return PipelineRuntime.start(spec, out, backend=open_backend, **kw)


P = TypeVar("P")


def spec(base: Path, **kw: object) -> PipelineSpec:
    return PipelineSpec.model_validate(
        {
            "base_model": str(base),
            "engine": EngineSpec.model_validate({"max_batch_size": 32, "max_rank": 4}),
            "max_staleness": 2,
            **kw,
        }
    )


class Log:
    """Progress records, with an awaitable condition."""

    def __init__(self) -> None:
        self.records: list[RuntimeProgress] = []
        self.changed = asyncio.Event()

    def __call__(self, progress: RuntimeProgress) -> None:
        self.records.append(progress)
        self.changed.set()

    async def until(self, check: Callable[[], bool], timeout: float = 120) -> None:
        async def loop() -> None:
            while not check():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), timeout)

    def of(self, tenant: str, kind: type[P]) -> list[P]:
        return [
            r for r in self.records if isinstance(r, kind) and getattr(r, "tenant", None) == tenant
        ]


async def test_jobs_submitted_while_running_finish_with_progress(
    base_dir: Path, tmp_path: Path
) -> None:
    log = Log()
    recorder = MemoryRecorder()
    rt = await start_runtime(
        spec(base_dir), tmp_path, options=CPU, recorder=recorder, on_progress=log
    )
    try:
        rt.submit(job("a", steps=2, checkpoint_every=1), restore=False)
        with pytest.raises(PipelineError, match="already submitted"):
            rt.submit(job("a", steps=2), restore=False)
        with pytest.raises(ConfigError, match="max_staleness"):
            rt.submit(job("x", staleness=3), restore=False)
        first = await asyncio.wait_for(rt.wait("a"), 120)
        assert first.status == "done" and first.version == 2
        # Idle, the runtime keeps serving: a job submitted later runs too.
        assert rt.running
        rt.submit(
            job("b", "reverse", steps=2, checkpoint_every=1, keep_checkpoints=1), restore=False
        )
        second = await asyncio.wait_for(rt.wait("b"), 120)
        assert second.status == "done" and second.version == 2
        # The job's own keep_checkpoints wins over the runtime's (3).
        kept = list_checkpoints(tmp_path / "tenants" / "b" / "checkpoints")
        assert [p.name for p in kept] == ["ckpt-00000002"]
    finally:
        await rt.close()
    assert not rt.running and rt.failure is None
    with pytest.raises(PipelineError, match="closing"):
        rt.submit(job("c"), restore=False)
    assert log.of("a", TenantStarted) == [TenantStarted("a")]
    assert [r.step for r in log.of("a", StepDone)] == [1, 2]
    assert all("reward_mean" in r.metrics.as_dict() for r in log.of("a", StepDone))
    assert sorted(r.version for r in log.of("a", EvalDone)) == [0, 2]
    ckpts = log.of("a", CheckpointWritten)
    assert [c.version for c in ckpts] == [1, 2]
    for c in ckpts:
        assert isinstance(c, CheckpointWritten)
        assert (c.adapter_path / "adapter_config.json").is_file()
        assert "loss" in c.metrics
    assert log.of("a", TenantEnded) == [TenantEnded("a", "done", None)]
    assert (tmp_path / "tenants" / "a" / "adapter" / "adapter_config.json").is_file()
    # The progress records are the recorder's own records, passed on.
    assert recorder.train_steps("a") == [1, 2]


async def test_pause_resume_cancel_and_a_closing_checkpoint(base_dir: Path, tmp_path: Path) -> None:
    log = Log()
    rt = await start_runtime(
        spec(base_dir, max_active_tenants=2), tmp_path, options=CPU, on_progress=log
    )
    try:
        rt.submit(job("a", steps=30), restore=False)
        rt.submit(job("b", steps=30), restore=False)
        rt.submit(job("q", steps=30), restore=False)  # waits: two tenants at most
        rt.pause("q")  # paused before admission: out of the queue
        await log.until(lambda: len(log.of("a", StepDone)) >= 1)
        rt.pause("a")
        rt.pause("a")  # idempotent
        rt.cancel("b")
        await asyncio.wait_for(rt.wait("b"), 60)
        assert rt.state("b").status == "cancelled"
        # b's place is free, but q is paused: it stays out of the queue.
        assert rt.state("q").status == "queued"
        rt.unpause("q")
        await log.until(lambda: bool(log.of("q", TenantStarted)))
        paused_at = rt.state("a").version
        rt.unpause("a")
        await log.until(lambda: rt.state("a").version >= paused_at + 1)
    finally:
        await rt.close(checkpoint=True)
    for name in ("a", "q"):
        state = rt.state(name)
        assert state.status == "cancelled" and "stopped" in (state.reason or "")
        (ended,) = log.of(name, TenantEnded)
        assert isinstance(ended, TenantEnded) and ended.stopped
        if state.version:  # a checkpoint of the step it had reached
            found = list_checkpoints(tmp_path / "tenants" / name / "checkpoints")
            assert found and found[-1].name == f"ckpt-{state.version:08d}"
    (ended_b,) = log.of("b", TenantEnded)
    assert isinstance(ended_b, TenantEnded) and not ended_b.stopped
    with pytest.raises(PipelineError, match="no job named"):
        rt.pause("nobody")

    # A new runtime continues a's job from its closing checkpoint; a fresh submit of
    # the same name would silently continue it, so it is refused.
    version = rt.state("a").version
    log2 = Log()
    rt2 = await start_runtime(spec(base_dir), tmp_path, options=CPU, on_progress=log2)
    try:
        with pytest.raises(PipelineError, match="already has checkpoints"):
            rt2.submit(job("a", steps=version + 1), restore=False)
        rt2.submit(job("a", steps=version + 1), restore=True)
        final = await asyncio.wait_for(rt2.wait("a"), 120)
    finally:
        await rt2.close()
    assert final.status == "done" and final.version == version + 1
    assert [r.version for r in log2.of("a", TenantRestored)] == [version]
    assert [r.step for r in log2.of("a", StepDone)] == [version + 1]
    # eval_every 0: the eval after the last step only, none where it resumed.
    assert [e.version for e in log2.of("a", EvalDone)] == [version + 1]


async def test_a_device_failure_ends_the_runtime(base_dir: Path, tmp_path: Path) -> None:
    log = Log()
    rt = await start_runtime(spec(base_dir), tmp_path, options=CPU, on_progress=log)

    def broken(batches: object) -> object:
        raise RuntimeError("device lost")

    rt.ctx.device.compute.trainer.forward_backward = broken  # type: ignore[attr-defined]
    try:
        rt.submit(job("a", steps=2), restore=False)
        await log.until(lambda: any(isinstance(r, RuntimeFailed) for r in log.records))
        assert not rt.running
        with pytest.raises(PipelineError, match="device lost"):
            rt.submit(job("b"), restore=False)
    finally:
        await rt.close()
    assert "device lost" in str(rt.failure)
    assert rt.state("a").status in ("cancelled", "failed")
    (failed,) = [r for r in log.records if isinstance(r, RuntimeFailed)]
    assert "device lost" in failed.reason
