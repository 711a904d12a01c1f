"""Turns of the interpreter between the device thread and the event loop
(`marlaas.device.turns`): the loop's callbacks wait while the device thread runs Python,
run while it is away (a long native call, an idle wait), never deadlock either side, and
a device that takes turns still computes what it computes without them."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from helpers.pipeline_support import job
from marlaas.config.job import EngineSpec
from marlaas.device import turns as turns_module
from marlaas.device.compute import LocalCompute
from marlaas.device.config import DeviceConfig
from marlaas.device.inprocess import open_inprocess_device
from marlaas.types import RolloutRequest, SamplingParams


def _device_thread(target: object) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


async def test_the_loop_waits_while_the_device_runs_python_and_runs_while_it_is_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(turns_module, "WAIT_S", 10.0)  # no going ahead in this test
    turns = turns_module.install()
    loop = asyncio.get_running_loop()
    log: list[str] = []
    holding, away, release = threading.Event(), threading.Event(), threading.Event()

    def device() -> None:
        turns.device_take()
        holding.set()
        time.sleep(0.05)  # "Python" of the device: the loop's callback must wait
        log.append("device python done")
        with turns.away:  # "a long native call": the loop runs meanwhile
            away.set()
            release.wait(5)
        log.append("device back")
        turns.device_give()

    thread = _device_thread(device)
    holding.wait(5)
    ran = loop.create_future()
    loop.call_soon(lambda: (log.append("callback"), ran.set_result(None)))
    await asyncio.wait_for(ran, 5)
    assert log == ["device python done", "callback"]
    release.set()
    await asyncio.to_thread(thread.join, 5)  # (a callback that blocked would hold the turn)
    assert log[-1] == "device back" and turns.timeouts == 0


async def test_a_side_that_waits_too_long_goes_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device thread holds the turn while it waits for something only a loop
    callback gives: the callback goes ahead after `WAIT_S`, no deadlock."""
    monkeypatch.setattr(turns_module, "WAIT_S", 0.02)
    turns = turns_module.install()
    loop = asyncio.get_running_loop()
    holding, answered = threading.Event(), threading.Event()

    def device() -> None:
        turns.device_take()
        holding.set()
        answered.wait(5)
        turns.device_give()

    thread = _device_thread(device)
    holding.wait(5)
    started = time.monotonic()
    loop.call_soon(answered.set)
    await asyncio.to_thread(thread.join, 5)
    assert answered.is_set() and not thread.is_alive()
    assert time.monotonic() - started >= 0.015 and turns.timeouts == 1


def test_one_device_thread_takes_turns() -> None:
    turns = turns_module.Turns(threading.get_ident())
    claimed: list[bool] = []

    def second() -> None:
        claimed.append(turns.claim())

    assert turns.claim()
    _device_thread(second).join(5)
    turns.unclaim()
    _device_thread(second).join(5)
    assert claimed == [False, True]


def test_install_hooks_callbacks_once_and_uninstall_restores_them() -> None:
    run = asyncio.Handle._run
    turns = turns_module.install()
    assert turns_module.install() is turns and turns_module.installed() is turns
    assert asyncio.Handle._run is not run
    other = turns_module.install(loop_thread=turns.loop_thread + 1)
    assert other is not turns and turns_module.installed() is other
    turns_module.uninstall()
    assert asyncio.Handle._run is run and turns_module.installed() is None
    assert not other.loop_take()  # not its loop's thread: no turn taken


async def test_a_device_takes_turns_and_computes_what_it_does_without(tiny_dir: Path) -> None:
    """The same seeded samples and the same trained version, with the loop and the device
    thread taking turns (the native forwards of a bfloat16 base leave Python) and
    without."""

    async def run(with_turns: bool) -> tuple[tuple[int, ...], ...]:
        if with_turns:
            turns_module.install()
        config = DeviceConfig(
            base_model=str(tiny_dir),
            dtype="bfloat16",
            engine=EngineSpec(max_batch_size=8, max_rank=4),
            torch_device="cpu",
        )
        device = await open_inprocess_device(config)
        try:
            compute = device.compute
            assert isinstance(compute, LocalCompute) and compute.takes_turns
            await device.add_tenant("a", job("a").lora, seed=1)
            sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
            requests = [
                device.sample(
                    RolloutRequest(tenant="a", prompt_ids=(30 + i, 31), sampling=sampling)
                )
                for i in range(12)
            ]
            done = await asyncio.gather(*requests)
            return tuple(c.token_ids for c in done)
        finally:
            await device.close()
            turns_module.uninstall()

    assert await run(with_turns=True) == await run(with_turns=False)
