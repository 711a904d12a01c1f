"""The device executor: decode and train on one thread, publication before results,
per-tenant batch errors, busy accounting, fatal errors, shutdown."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from pipeline_support import MemoryRecorder, job

from marlaas.config.job import RunSpec
from marlaas.pipeline import executor as executor_module
from marlaas.pipeline.context import PipelineContext, PipelineOptions
from marlaas.pipeline.executor import ExecutorClosed
from marlaas.pipeline.runner import build_context
from marlaas.train.batch import TrainBatch, TrainBatchError
from marlaas.types import RolloutRequest, SamplingParams, Trajectory


def make_ctx(tiny_dir: Path, tmp_path: Path, recorder: MemoryRecorder) -> PipelineContext:
    run = RunSpec.model_validate(
        {
            "base_model": str(tiny_dir),
            "jobs": [job("a"), job("b")],
            "engine": {"max_batch_size": 8, "max_rank": 4},
        }
    )
    return build_context(run, tmp_path, recorder=recorder, options=PipelineOptions(device="cpu"))


def batch(tenant: str, step: int) -> TrainBatch:
    groups = [
        [
            Trajectory(
                tenant=tenant,
                example_id=f"ex-{g}",
                prompt_ids=(30, 31, 32),
                token_ids=(40 + i, 41, 12),
                loss_mask_T=(1, 1, 1),
                logprobs_T=(-2.0, -2.0, -2.0),
                reward=float(i % 2),
                min_version=step,
                max_version=step,
                turns=1,
                finish_reason="stop",
            )
            for i in range(4)
        ]
        for g in range(2)
    ]
    return TrainBatch.from_groups(tenant, step, groups, scale_rewards=True)


async def register(ctx: PipelineContext, name: str) -> None:
    spec = job(name)

    def install() -> None:
        ctx.trainer.register(name, spec.lora, spec.algorithm, seed=1)
        ctx.bank.register(name, spec.lora, tensors=ctx.trainer.adapter(name))

    await ctx.executor.call(install)
    ctx.gate.set_weight(name, 1.0)


async def test_train_publishes_before_the_result_and_isolates_bad_batches(
    tiny_dir: Path, tmp_path: Path
) -> None:
    recorder = MemoryRecorder()
    ctx = make_ctx(tiny_dir, tmp_path, recorder)
    ctx.executor.start()
    try:
        thread = await ctx.executor.call(threading.current_thread)
        assert thread.name == "marlaas-device"
        await register(ctx, "a")
        await register(ctx, "b")
        good = ctx.executor.train(batch("a", 0))
        bad = ctx.executor.train(batch("b", 3))  # b is at version 0: rejected
        result = await good
        assert result.version == 1 and ctx.bank.latest_version("a") == 1
        with pytest.raises(TrainBatchError, match="'b'"):
            await bad
        assert ctx.bank.latest_version("b") == 0
        # The engine is driven by the executor too: a request completes.
        sampling = SamplingParams(max_new_tokens=4, seed=3)
        done = await ctx.gate.submit(
            RolloutRequest(tenant="a", prompt_ids=(30, 31), sampling=sampling)
        )
        assert done.version == 1 and len(done.token_ids) >= 1
    finally:
        await ctx.executor.stop()
        ctx.engine.shutdown()
    names = {(stage, name) for stage, name, *_ in recorder.spans}
    assert {("device", "train"), ("device", "decode")} <= names
    ex = ctx.executor
    assert ex.train_steps == 1 and ex.decode_steps >= 1
    assert 0.0 < ex.busy_fraction <= 1.0
    assert ex.busy_s + ex.idle_s <= ex.elapsed_s + 1e-3
    with pytest.raises(ExecutorClosed):
        ctx.executor.train(batch("a", 1))


async def test_a_device_failure_is_fatal_and_surfaced(tiny_dir: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tiny_dir, tmp_path, MemoryRecorder())

    def broken(batches: object) -> object:
        raise RuntimeError("device lost")

    ctx.trainer.step = broken  # type: ignore[method-assign, assignment]
    ctx.executor.start()
    try:
        await register(ctx, "a")
        with pytest.raises(RuntimeError, match="device lost"):
            await ctx.executor.train(batch("a", 0))
        failure = await asyncio.wait_for(ctx.executor.failure, 5)
        assert "device lost" in str(failure)
    finally:
        await ctx.executor.stop()
        ctx.engine.shutdown()


async def test_a_failing_call_is_the_callers_error_only(tiny_dir: Path, tmp_path: Path) -> None:
    ctx = make_ctx(tiny_dir, tmp_path, MemoryRecorder())
    ctx.executor.start()
    try:
        with pytest.raises(KeyError):
            await ctx.executor.call(ctx.trainer.snapshot, "nobody")
        assert await ctx.executor.call(lambda: 7) == 7
        assert not ctx.executor.failure.done()
    finally:
        await ctx.executor.stop()
        ctx.engine.shutdown()


async def test_the_gil_switch_interval_is_lowered_while_running_and_restored(
    tiny_dir: Path, tmp_path: Path
) -> None:
    import sys

    from marlaas.pipeline.executor import GIL_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    ctx = make_ctx(tiny_dir, tmp_path, MemoryRecorder())
    ctx.executor.start()
    try:
        assert sys.getswitchinterval() == pytest.approx(min(before, GIL_SWITCH_INTERVAL_S))
    finally:
        await ctx.executor.stop()
        ctx.engine.shutdown()
    assert sys.getswitchinterval() == pytest.approx(before)


@pytest.mark.parametrize("defer_s", [60.0, 0.0])
async def test_a_ready_batch_waits_for_an_inference_window(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, defer_s: float
) -> None:
    """An inference request and a train batch arrive together (the device thread is
    held until both are queued). With an inference window longer than the completion,
    every decode iteration of it runs before the train step; with none, the batch
    trains first."""
    monkeypatch.setattr(executor_module, "MAX_INTERACTIVE_S", defer_s)
    recorder = MemoryRecorder()
    ctx = make_ctx(tiny_dir, tmp_path, recorder)
    ctx.executor.start()
    try:
        await register(ctx, "a")
        release = threading.Event()
        held = ctx.executor.call(release.wait)
        sampling = SamplingParams(max_new_tokens=12, seed=5)
        completion = ctx.gate.submit_interactive(
            RolloutRequest(tenant="a", prompt_ids=(30, 31), sampling=sampling)
        )
        trained = ctx.executor.train(batch("a", 0))
        release.set()
        await held
        done, result = await completion, await trained
    finally:
        await ctx.executor.stop()
        ctx.engine.shutdown()
    assert result.version == 1 and len(done.token_ids) >= 1
    device = [name for stage, name, *_ in recorder.spans if stage == "device"]
    decodes_first = device.index("train")
    if defer_s:
        assert decodes_first >= 1 and "decode" not in device[decodes_first:]
    else:
        assert decodes_first == 0
