"""The async face: submit/await, the background driver, manual stepping, cancel, close."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from rollout_support import random_adapter
from transformers import PreTrainedTokenizerBase

from marlaas.model.bank import AdapterBank
from marlaas.model.lora import LoRAModel
from marlaas.rollout import EngineClosed, RolloutEngine
from marlaas.types import Completion, RolloutRequest, SamplingParams


def _req(tok: PreTrainedTokenizerBase, tenant: str, text: str, n: int) -> RolloutRequest:
    params = SamplingParams(temperature=0.0, max_new_tokens=n)
    return RolloutRequest(tenant=tenant, prompt_ids=tuple(tok.encode(text)), sampling=params)


async def test_background_driver_serves_concurrent_submits(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine()
    requests = [
        _req(tokenizer, t, f"prompt {i}", 5 + i) for i, t in enumerate(["t0", "t1", "t2", "base"])
    ]
    outs = await asyncio.gather(*(engine.submit(r) for r in requests))
    reference = make_engine(background=False).generate(requests)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    # Idle now: the driver waits on its event; a later submit wakes it.
    await asyncio.sleep(0.01)
    again = await engine.submit(requests[0])
    assert again.token_ids == outs[0].token_ids
    await engine.close()


async def test_short_request_completes_before_a_long_one(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine()
    long = engine.submit(_req(tokenizer, "t0", "long", 50))
    short = engine.submit(_req(tokenizer, "t1", "short", 3))
    done, _ = await asyncio.wait([long, short], return_when=asyncio.FIRST_COMPLETED)
    assert short in done and not long.done()
    assert len((await long).token_ids) == 50
    await engine.close()


async def test_manual_stepping_without_a_driver(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine(background=False)
    future = engine.submit(_req(tokenizer, "t2", "manual", 6))
    steps = 0
    while not future.done():
        steps += engine.step() > 0
        await asyncio.sleep(0)  # let the loop run the future's callbacks
    assert len(future.result().token_ids) == 6 and steps == 5
    assert engine.step() == 0


async def test_cancelling_a_future_aborts_its_row(
    make_engine: Callable[..., RolloutEngine], bank: AdapterBank, tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine(background=False)
    future = engine.submit(_req(tokenizer, "t0", "cancel me", 50))
    engine.step()
    assert engine.running == 1
    future.cancel()
    await asyncio.sleep(0)
    engine.step()
    assert engine.running == 0 and engine.stats.aborted == 1
    assert not bank._handles


async def test_cancelling_the_awaiting_task_aborts_its_row(
    make_engine: Callable[..., RolloutEngine], bank: AdapterBank, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The task's cancellation reaches the request's future (`Withdrawable.cancel`),
    which asks the engine to abort the row."""
    engine = make_engine(background=False)
    future = engine.submit(_req(tokenizer, "t0", "cancel me", 50))

    async def wait() -> None:
        await future

    waiter = asyncio.create_task(wait())
    await asyncio.sleep(0)  # the task now awaits the request's future
    engine.step()
    assert engine.running == 1
    waiter.cancel()
    await asyncio.sleep(0)  # the task takes the cancellation
    assert waiter.cancelled()
    engine.step()
    assert engine.running == 0 and engine.stats.aborted == 1
    assert not bank._handles


async def test_close_fails_pending_requests_and_refuses_new_ones(
    make_engine: Callable[..., RolloutEngine], bank: AdapterBank, tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine(background=False)
    running = engine.submit(_req(tokenizer, "t0", "running", 50))
    engine.step()
    queued = engine.submit(_req(tokenizer, "t1", "queued", 5))
    await engine.close()
    for future in (running, queued):
        with pytest.raises(EngineClosed, match="closed before this request completed"):
            await future
    with pytest.raises(EngineClosed):
        engine.submit(_req(tokenizer, "t1", "late", 5))
    assert not bank._handles and engine.step() == 0


async def test_close_stops_a_busy_background_driver(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine()
    futures = [engine.submit(_req(tokenizer, "t0", f"busy {i}", 60)) for i in range(3)]
    await asyncio.sleep(0.02)
    await engine.close()
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert all(isinstance(r, EngineClosed) or hasattr(r, "token_ids") for r in results)
    assert engine._task is not None and engine._task.done()


async def test_publish_from_another_thread_while_the_driver_runs(
    make_engine: Callable[..., RolloutEngine],
    lora_model: LoRAModel,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    engine = make_engine()
    old = engine.submit(_req(tokenizer, "t1", "same prompt", 40))
    while engine.stats.sampled_tokens < 3:
        await asyncio.sleep(0.001)
    await asyncio.to_thread(engine.publish, "t1", 1, random_adapter(lora_model, 8))
    new = engine.submit(_req(tokenizer, "t1", "same prompt", 40))
    old_out, new_out = await old, await new
    assert (old_out.version, new_out.version) == (0, 1)
    assert old_out.token_ids != new_out.token_ids
    await engine.close()


async def test_on_token_streams_every_token_before_the_completion(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    """Tokens reach the submitting loop one iteration at a time, in order, all before
    the future resolves, and they are exactly the completion's tokens."""
    engine = make_engine(background=False)
    seen: list[tuple[int, bool]] = []  # (token, was the future done already?)
    future = engine.submit(
        _req(tokenizer, "t1", "stream me", 8),
        on_token=lambda token: seen.append((token, future.done())),
    )
    counts = []
    while not future.done():
        engine.step()
        await asyncio.sleep(0)  # run the hops the engine scheduled on this loop
        counts.append(len(seen))
    completion = future.result()
    assert [t for t, _ in seen] == list(completion.token_ids)
    assert not any(done for _, done in seen)
    # The first iteration prefills (one token) and decodes (one more); then one a step.
    assert counts == [2, 3, 4, 5, 6, 7, 8]


def test_a_failing_listener_loses_its_stream_not_its_row(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine(background=False)
    requests = [_req(tokenizer, "t0", "first", 6), _req(tokenizer, "t2", "second", 6)]
    reference = make_engine(background=False).generate(requests)
    calls: list[int] = []
    good: list[int] = []
    results: dict[int, Completion | BaseException] = {}

    def bad(token: int) -> None:
        calls.append(token)
        raise RuntimeError("a consumer that broke")

    engine.enqueue(requests[0], lambda r: results.__setitem__(0, r), bad)
    engine.enqueue(requests[1], lambda r: results.__setitem__(1, r), good.append)
    while len(results) < 2:
        engine.step()
    outs = [results[i] for i in (0, 1)]
    assert [o.token_ids if isinstance(o, Completion) else o for o in outs] == [
        r.token_ids for r in reference
    ]
    assert len(calls) == 1  # dropped after it raised
    assert good == list(reference[1].token_ids)
