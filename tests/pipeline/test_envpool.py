"""The environment pool: bounded concurrency, timeouts, errors, episode retries."""

from __future__ import annotations

import asyncio

import pytest

from marlaas.envs.base import Env, Example, Segment, Split, StepResult, TaskFamily
from marlaas.model.tokenizer import build_tokenizer
from marlaas.pipeline.envpool import EnvCallError, EnvPool, play_episode
from marlaas.pipeline.tenant import TenantFailure
from marlaas.types import Completion, RolloutRequest, SamplingParams

TOKENIZER = build_tokenizer()


async def fake_submit(request: RolloutRequest) -> Completion:
    await asyncio.sleep(0)
    return Completion(
        request_id=request.request_id,
        tenant=request.tenant,
        version=0,
        prompt_len=len(request.prompt_ids),
        token_ids=(20, 21),
        logprobs=(-0.5, -0.5),
        text="42",
        finish_reason="stop",
    )


class FlakyEnv(Env):
    def __init__(self, family: FlakyFamily) -> None:
        self.family = family

    async def initial_observation(self) -> str:
        return "Q: 6*7\nA: "

    async def step(self, action: str) -> StepResult:
        self.family.attempts += 1
        if self.family.attempts <= self.family.failures:
            if self.family.mode == "hang":
                await asyncio.sleep(3600)
            raise ValueError("transient tool error")
        return StepResult(done=True, reward=1.0 if action == "42" else 0.0)


class FlakyFamily(TaskFamily):
    name = "flaky"

    def __init__(self, failures: int, mode: str = "raise") -> None:
        self.failures = failures
        self.mode = mode
        self.attempts = 0

    def examples(self, split: Split, n: int, seed: int = 0) -> list[Example]:
        return [Example(id=f"{split}-{i}", prompt="Q: 6*7\nA: ", reference="42") for i in range(n)]

    def make_env(self, example: Example) -> Env:
        return FlakyEnv(self)

    def demonstration(self, example: Example) -> list[Segment]:
        return []


async def test_calls_are_bounded_in_concurrency() -> None:
    pool = EnvPool(max_concurrency=3, timeout_s=5.0)
    running = 0
    peak = 0

    async def work() -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return 1

    results = await asyncio.gather(*[pool.call(work, tenant="t", what="step") for _ in range(12)])
    assert results == [1] * 12
    assert peak == 3 and pool.stats.max_concurrent == 3 and pool.stats.calls == 12


async def test_a_hung_call_times_out_and_frees_its_slot() -> None:
    pool = EnvPool(max_concurrency=1, timeout_s=0.05)

    async def hang() -> None:
        await asyncio.sleep(3600)

    async def quick() -> str:
        return "ok"

    with pytest.raises(EnvCallError, match="timed out"):
        await pool.call(hang, tenant="t", what="step")
    assert await pool.call(quick, tenant="u", what="step") == "ok"
    assert pool.stats.timeouts == 1


async def test_each_call_times_out_at_its_own_deadline() -> None:
    """One timer serves the pool: a call started later is not cut short by an earlier
    call's deadline, and every hung call of a crowd times out."""
    pool, loop = EnvPool(max_concurrency=8, timeout_s=0.2), asyncio.get_running_loop()
    ended: dict[str, float] = {}

    async def hang() -> None:
        await asyncio.sleep(3600)

    async def quick() -> str:
        return "ok"

    async def timed(name: str, delay: float) -> tuple[str, float]:
        await asyncio.sleep(delay)
        start = loop.time()
        with pytest.raises(EnvCallError, match="timed out") as info:
            await pool.call(hang, tenant=name, what="step")
        assert isinstance(info.value.__cause__, TimeoutError)
        ended[name] = loop.time()
        return name, start

    assert await pool.call(quick, tenant="q", what="step") == "ok"  # arms and leaves
    starts = dict(await asyncio.gather(*(timed(f"t{i}", 0.03 * i) for i in range(6))))
    for name, start in starts.items():
        assert ended[name] >= start + pool.timeout_s, name
    assert pool.stats.timeouts == 6 and pool.active == 0


async def test_a_call_cancelled_from_outside_is_not_a_timeout() -> None:
    pool = EnvPool(max_concurrency=1, timeout_s=0.05)
    started = asyncio.Event()

    async def hang() -> None:
        started.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(pool.call(hang, tenant="t", what="step"))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.stats.timeouts == 0 and pool.active == 0
    await asyncio.sleep(0.1)  # past the cancelled call's deadline: the timer finds nothing

    async def quick() -> str:
        return "ok"

    assert await pool.call(quick, tenant="u", what="step") == "ok"  # its slot was freed


async def test_calls_finished_behind_a_long_one_are_not_kept() -> None:
    """The pool's one timer keeps the deadlines in order; calls that finish while an
    older one still runs are dropped from it (memory stays bounded by the live calls),
    and the long call still times out at its own deadline."""
    pool = EnvPool(max_concurrency=4, timeout_s=0.3)
    started = asyncio.Event()

    async def hang() -> None:
        started.set()
        await asyncio.sleep(3600)

    async def quick() -> str:
        return "ok"

    long = asyncio.create_task(pool.call(hang, tenant="t", what="step"))
    await started.wait()
    for _ in range(2_000):
        assert await pool.call(quick, tenant="u", what="step") == "ok"
    assert len(pool._deadlines._queue) <= 2 * pool.active + 64
    with pytest.raises(EnvCallError, match="timed out"):
        await long
    assert pool.stats.timeouts == 1 and pool.active == 0


async def test_a_call_that_swallows_the_timeout_returns_its_value() -> None:
    """As with `asyncio.timeout`: a call that catches the cancellation and returns is
    not a timeout, and its task is not left cancelled."""
    pool = EnvPool(max_concurrency=1, timeout_s=0.05)

    async def stubborn() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return "kept"
        return "slept"

    assert await pool.call(stubborn, tenant="t", what="step") == "kept"
    assert pool.stats.timeouts == 0
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    await asyncio.sleep(0.01)  # no cancellation is pending on this task


async def test_an_error_is_wrapped_with_its_cause() -> None:
    pool = EnvPool()

    async def boom() -> None:
        raise KeyError("tool")

    with pytest.raises(EnvCallError) as info:
        await pool.call(boom, tenant="t", what="step")
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("mode", ["raise", "hang"])
async def test_episode_is_retried_then_succeeds(mode: str) -> None:
    family = FlakyFamily(failures=2, mode=mode)
    retried: list[EnvCallError] = []
    traj = await play_episode(
        submit=fake_submit,
        tokenizer=TOKENIZER,
        family=family,
        example=family.examples("train", 1)[0],
        pool=EnvPool(timeout_s=0.05),
        tenant="t",
        sampling=SamplingParams(seed=7),
        retries=2,
        on_retry=retried.append,
    )
    assert traj.reward == 1.0 and family.attempts == 3 and len(retried) == 2


async def test_a_persistent_failure_is_the_tenants() -> None:
    family = FlakyFamily(failures=100)
    with pytest.raises(TenantFailure, match=r"failed 2 times.*transient tool error"):
        await play_episode(
            submit=fake_submit,
            tokenizer=TOKENIZER,
            family=family,
            example=family.examples("train", 1)[0],
            pool=EnvPool(),
            tenant="t",
            sampling=SamplingParams(),
            retries=1,
        )
    assert family.attempts == 2
