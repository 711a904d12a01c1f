"""The device port in-process: coalesced passes, per-tenant call order, tenants from
snapshots at their version in one publish, kept and frozen adapters, the base, restore,
atomic calls."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from test_executor import TRAINING, batch, local

from marlaas.config.job import EngineSpec
from marlaas.config.specs import LoRASpec
from marlaas.device import BASE
from marlaas.device.config import DeviceConfig
from marlaas.device.device import ExecutorDevice
from marlaas.device.inprocess import open_inprocess_device
from marlaas.device.ops import Op, Phase
from marlaas.errors import TenantNotFound
from marlaas.model.lora import AdapterTensors
from marlaas.train.batch import TrainBatchError
from marlaas.train.records import TrainInput
from marlaas.types import RolloutRequest, SamplingParams

LORA = LoRASpec(rank=4, alpha=8.0)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest_asyncio.fixture
async def device(tiny_dir: Path) -> AsyncIterator[ExecutorDevice]:
    config = DeviceConfig(
        base_model=str(tiny_dir),
        engine=EngineSpec(max_batch_size=8, max_rank=4),
        versions_kept=3,
        torch_device="cpu",
    )
    opened = await open_inprocess_device(config)
    try:
        yield opened
    finally:
        await opened.close()


def inp(tenant: str, step: int, *, version: int | None = None) -> TrainInput:
    made = TRAINING.train_input(batch(tenant, step))
    return TrainInput(tenant, made.data, made.loss, made.temperature, version)


def same(a: AdapterTensors, b: AdapterTensors) -> bool:
    return all(torch.equal(a[p][0], b[p][0]) and torch.equal(a[p][1], b[p][1]) for p in a)


async def greedy(
    device: ExecutorDevice, tenant: str, version: int | None = None
) -> tuple[int, ...]:
    request = RolloutRequest(tenant, (30, 31, 32), GREEDY, version=version)
    return (await device.sample(request)).token_ids


async def test_pending_passes_of_different_tenants_run_as_one(device: ExecutorDevice) -> None:
    for name in ("a", "b", "c"):
        await device.add_tenant(name, LORA, seed=1)
    entered, hold = threading.Event(), threading.Event()

    def busy() -> None:
        entered.set()
        hold.wait(30)

    held = device.executor.submit(Op(Phase.AFTER, ("probe",), Future(), run=busy))
    assert await asyncio.to_thread(entered.wait, 30)  # the device thread is busy now
    calls = [device.forward_backward([inp(name, 0)]) for name in ("a", "b", "c")]
    hold.set()  # all three were pending at once when it came back
    await held
    outputs = await asyncio.gather(*calls)
    assert [set(o) for o in outputs] == [{"a"}, {"b"}, {"c"}]
    figures = device.figures()
    assert (figures.train_passes, figures.max_pass_tenants, figures.mean_pass_tenants) == (1, 3, 3)
    assert local(device).trainer.stats.max_microbatch_lanes == 3


async def test_a_tenants_queued_calls_run_in_the_order_they_were_made(
    device: ExecutorDevice,
) -> None:
    await device.add_tenant("a", LORA, seed=1)
    await device.add_tenant("ref", LORA, seed=1)
    # Everything queued at once, nothing awaited in between.
    fb1 = device.forward_backward([inp("a", 0)])
    st1 = device.optim_step("a", TRAINING.adam)
    fb2 = device.forward_backward([inp("a", 1)])
    st2 = device.optim_step("a", TRAINING.adam)
    snap = device.snapshot("a")
    assert [(await fb1)["a"].version, (await st1).version] == [0, 1]
    assert [(await fb2)["a"].version, (await st2).version] == [1, 2]
    assert (await snap).version == 2 == device.version("a")
    # The same calls awaited one by one give the same adapter.
    for step in (0, 1):
        await device.forward_backward([inp("ref", step)])
        await device.optim_step("ref", TRAINING.adam)
    assert same(await device.export("a"), await device.export("ref"))


async def test_a_tenant_from_a_snapshot_starts_at_its_version_in_one_publish(
    device: ExecutorDevice,
) -> None:
    await device.add_tenant("a", LORA, seed=1)
    for step in range(3):
        await device.forward_backward([inp("a", step)])
        await device.optim_step("a", TRAINING.adam)
    snapshot = await device.snapshot("a")
    assert await device.add_tenant("b", LORA, snapshot=snapshot) == 3 == device.version("b")
    assert local(device).bank.kept_versions("b") == [3]  # not 0, 1, 2 first
    assert await greedy(device, "b") == await greedy(device, "a")
    assert same(await device.export("b"), snapshot.tensors)


async def test_a_dropped_tenants_adapter_stays_sampleable_when_asked(
    device: ExecutorDevice,
) -> None:
    await device.add_tenant("a", LORA, seed=1)
    await device.forward_backward([inp("a", 0)])
    await device.optim_step("a", TRAINING.adam)
    before = await greedy(device, "a")
    await device.drop_tenant("a", keep_adapter=True)
    assert device.has_adapter("a") and device.version("a") == 1
    assert await greedy(device, "a") == before
    with pytest.raises(TenantNotFound):
        await device.forward_backward([inp("a", 1)])
    await device.drop_adapter("a")
    assert not device.has_adapter("a")
    with pytest.raises(TenantNotFound):
        await greedy(device, "a")
    # A frozen adapter (a checkpoint's, for serving) samples like the tenant it came from.
    await device.add_tenant("c", LORA, seed=2)
    await device.add_adapter("serve:c", LORA, await device.export("c"))
    assert await greedy(device, "serve:c") == await greedy(device, "c")


async def test_the_base_samples_like_an_adapter_that_changes_nothing(
    device: ExecutorDevice,
) -> None:
    await device.add_tenant("fresh", LORA, seed=3)  # PEFT init: B = 0, the base's outputs
    assert device.has_adapter(BASE)
    assert await greedy(device, BASE) == await greedy(device, "fresh")


async def test_restore_puts_a_tenant_back_at_a_snapshot(device: ExecutorDevice) -> None:
    await device.add_tenant("a", LORA, seed=1)
    for step in range(2):
        await device.forward_backward([inp("a", step)])
        await device.optim_step("a", TRAINING.adam)
    snapshot = await device.snapshot("a")
    at_two = await greedy(device, "a")
    await device.forward_backward([inp("a", 2)])
    await device.optim_step("a", TRAINING.adam)
    assert await device.restore(snapshot) == 2 == device.version("a")
    assert same(await device.export("a"), snapshot.tensors)
    assert await greedy(device, "a") == at_two
    assert (await device.snapshot("a")).adam is not None


async def test_a_call_with_one_bad_input_changes_nothing(device: ExecutorDevice) -> None:
    await device.add_tenant("a", LORA, seed=1)
    await device.add_tenant("b", LORA, seed=2)
    with pytest.raises(TrainBatchError, match="'b'"):
        await device.forward_backward([inp("a", 0), inp("b", 0, version=5)])
    step = await device.optim_step("a", TRAINING.adam)
    assert step.grad_norm == 0.0  # a's half of the refused call left no gradient
    with pytest.raises(TenantNotFound):
        await device.optim_step("nobody", TRAINING.adam)
    assert not device.failure.done()
