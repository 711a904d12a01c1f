"""The device executor: decode and train on one thread, publication before results,
per-tenant batch errors, busy accounting, fatal errors, shutdown."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from helpers.pipeline_support import MemoryRecorder, job
from marlaas.config.job import EngineSpec
from marlaas.device import executor as executor_module
from marlaas.device.compute import LocalCompute
from marlaas.device.config import DeviceConfig
from marlaas.device.device import ExecutorDevice
from marlaas.device.executor import ExecutorClosed
from marlaas.device.inprocess import open_inprocess_device
from marlaas.device.ops import PASSES, Op, Phase
from marlaas.train.batch import TenantStepResult, TrainBatch, TrainBatchError
from marlaas.train.grpo import GRPOTraining
from marlaas.types import RolloutRequest, SamplingParams, Trajectory


@pytest_asyncio.fixture
async def device(tiny_dir: Path) -> AsyncIterator[ExecutorDevice]:
    config = DeviceConfig(
        base_model=str(tiny_dir),
        engine=EngineSpec(max_batch_size=8, max_rank=4),
        versions_kept=3,
        torch_device="cpu",
    )
    opened = await open_inprocess_device(config, recorder=MemoryRecorder())
    try:
        yield opened
    finally:
        await opened.close()


def local(device: ExecutorDevice) -> LocalCompute:
    assert isinstance(device.compute, LocalCompute)
    return device.compute


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


TRAINING = GRPOTraining(job("a").algorithm)


async def register(device: ExecutorDevice, name: str) -> None:
    await device.add_tenant(name, job(name).lora, seed=1)


async def train(device: ExecutorDevice, b: TrainBatch) -> TenantStepResult:
    """The pipeline's train step: forward_backward, then optim_step."""
    outputs = await device.forward_backward([TRAINING.train_input(b)])
    step = await device.optim_step(b.tenant, TRAINING.adam)
    return TRAINING.result(b, outputs[b.tenant], step)


async def _queued_pass(device: ExecutorDevice) -> None:
    """Until a forward_backward waits in the executor's queue (one loop turn is not always
    enough on a loaded machine: the test then saw two decode iterations before it)."""
    for _ in range(10_000):
        if any(op.phase in PASSES for op in list(device.executor._ops)):
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the forward_backward never reached the executor's queue")


def on_device(device: ExecutorDevice, fn: Any) -> asyncio.Future[Any]:
    """Run `fn` as a control op on the device thread (a test's window into it)."""
    return device.executor.submit(Op(Phase.AFTER, ("probe",), Future(), run=fn))


async def test_train_publishes_before_the_result_and_isolates_bad_batches(
    device: ExecutorDevice,
) -> None:
    recorder = device.recorder
    assert isinstance(recorder, MemoryRecorder)
    thread = await on_device(device, threading.current_thread)
    assert thread.name == "marlaas-device"
    await register(device, "a")
    await register(device, "b")
    good = asyncio.ensure_future(train(device, batch("a", 0)))
    bad = asyncio.ensure_future(train(device, batch("b", 3)))  # b is at version 0: rejected
    result = await good
    assert result.version == 1 and local(device).bank.latest_version("a") == 1
    with pytest.raises(TrainBatchError, match="'b'"):
        await bad
    assert local(device).bank.latest_version("b") == 0
    # The engine is driven by the device thread too: a request completes.
    sampling = SamplingParams(max_new_tokens=4, seed=3)
    done = await device.sample(RolloutRequest(tenant="a", prompt_ids=(30, 31), sampling=sampling))
    assert done.version == 1 and len(done.token_ids) >= 1
    await device.close()
    names = {(stage, name) for stage, name, *_ in recorder.spans}
    assert {("device", "train"), ("device", "decode")} <= names
    ex = device.figures()
    assert ex.train_passes == 1 and ex.decode_steps >= 1
    assert 0.0 < ex.busy_fraction <= 1.0
    assert ex.busy_s + ex.idle_s <= ex.elapsed_s + 1e-3
    with pytest.raises(ExecutorClosed):
        device.forward_backward([TRAINING.train_input(batch("a", 1))])


async def test_a_device_failure_is_fatal_and_surfaced(device: ExecutorDevice) -> None:
    def broken(inputs: object) -> object:
        raise RuntimeError("device lost")

    local(device).trainer.forward_backward = broken  # type: ignore[method-assign, assignment]
    await register(device, "a")
    with pytest.raises(RuntimeError, match="device lost"):
        await train(device, batch("a", 0))
    failure = await asyncio.wait_for(device.failure, 5)
    assert "device lost" in str(failure)


async def test_a_failing_call_is_the_callers_error_only(device: ExecutorDevice) -> None:
    with pytest.raises(KeyError):
        await device.snapshot("nobody")
    assert await on_device(device, lambda: 7) == 7
    assert not device.failure.done()


async def test_the_executor_leaves_the_process_switch_interval_alone(
    tiny_dir: Path,
) -> None:
    """The switch interval is the process's; its entry points set it
    (`marlaas.cli.process`), a device never changes it."""
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        config = DeviceConfig(base_model=str(tiny_dir), engine=EngineSpec(max_rank=4))
        device = await open_inprocess_device(config)
        try:
            assert sys.getswitchinterval() == pytest.approx(0.005)
        finally:
            await device.close()
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("window_s", [60.0, 0.0])
async def test_a_waiting_pass_gives_way_to_an_inference_window(
    device: ExecutorDevice, monkeypatch: pytest.MonkeyPatch, window_s: float
) -> None:
    """An inference request and a train step arrive together (the device thread is
    held until both are queued). With an inference window longer than the completion,
    every decode iteration of it runs before the pass; with none, the pass runs after at
    most the one iteration of the turn that held the thread (the completion takes 12)."""
    monkeypatch.setattr(executor_module, "MAX_INTERACTIVE_S", window_s)
    recorder = device.recorder
    assert isinstance(recorder, MemoryRecorder)
    await register(device, "a")
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait()

    held = on_device(device, hold)
    try:
        # The device thread is inside `hold` before either arrives (on a loaded machine
        # it may not have started it yet, and would then take the pass first).
        while not entered.is_set():
            await asyncio.sleep(0.001)
        sampling = SamplingParams(max_new_tokens=12, seed=5)
        request = RolloutRequest(tenant="a", prompt_ids=(30, 31), sampling=sampling)
        completion = device.sample(request, interactive=True)
        trained = asyncio.ensure_future(train(device, batch("a", 0)))
        await _queued_pass(device)  # its forward_backward waits beside the completion
    finally:
        release.set()  # never leave the device thread held: closing would wait forever
    await held
    done, result = await completion, await trained
    assert result.version == 1 and len(done.token_ids) >= 1
    spans = [name for stage, name, *_ in recorder.spans if stage == "device"]
    first_train = spans.index("train")
    if window_s:
        assert first_train >= 1 and "decode" not in spans[first_train:]
    else:
        assert first_train <= 1 and spans.count("decode") > 1
