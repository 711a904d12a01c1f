"""Fair share (start-time fair queueing), the request gate in front of a saturated
engine, and admission order."""

from __future__ import annotations

import asyncio
import gc
import random
import weakref
from pathlib import Path

import pytest

from marlaas.config.specs import LoRASpec
from marlaas.device.gate import EngineFront, FairShare, RequestGate
from marlaas.model.bank import AdapterBank
from marlaas.model.base import load_base
from marlaas.model.lora import LoRAModel
from marlaas.pipeline.scheduler import AdmissionQueue
from marlaas.rollout.batch import Deliver, TokenListener
from marlaas.rollout.engine import RolloutEngine
from marlaas.types import Completion, RolloutRequest, SamplingParams


def test_fair_share_dispatches_in_proportion_to_weight() -> None:
    share = FairShare()
    share.set_weight("hi", 3.0)
    share.set_weight("lo", 1.0)
    for i in range(100):
        share.push("hi", ("hi", i), cost=10)
        share.push("lo", ("lo", i), cost=10)
    first = [share.pop() for _ in range(40)]
    counts = {t: sum(1 for x in first if x is not None and x[0] == t) for t in ("hi", "lo")}
    assert counts == {"hi": 30, "lo": 10}
    # FIFO within a tenant.
    his = [x[1] for x in first if x is not None and x[0] == "hi"]
    assert his == [("hi", i) for i in range(30)]


def test_fair_share_gives_no_credit_for_idle_time() -> None:
    share = FairShare()
    share.set_weight("a", 1.0)
    share.set_weight("b", 1.0)
    for i in range(50):
        share.push("a", i, cost=1)
    for _ in range(50):
        share.pop()  # only `a` asked; b's clock must not lag behind
    for i in range(10):
        share.push("a", 100 + i, cost=1)
        share.push("b", i, cost=1)
    order = [share.pop() for _ in range(10)]
    assert sum(1 for x in order if x is not None and x[0] == "b") == 5


def test_fair_share_charges_actual_tokens() -> None:
    share = FairShare()
    share.set_weight("a", 1.0)
    share.set_weight("b", 1.0)
    for i in range(20):
        share.push("a", i, cost=10)
        share.push("b", i, cost=10)
    served = {"a": 0, "b": 0}
    for _ in range(12):
        nxt = share.pop()
        assert nxt is not None
        tenant, _, cost = nxt
        served[tenant] += 1
        share.charge(tenant, actual=1 if tenant == "a" else 10, estimate=cost)
    assert served["a"] > 2 * served["b"]  # a's requests turned out cheap: it gets more
    assert served["b"] >= 1  # and b is not starved


class _ScanShare:
    """Start-time fair queueing as its definition reads, a pass over every tenant per
    pop: the reference `FairShare`'s heaps must agree with, item for item."""

    def __init__(self) -> None:
        self.weights: dict[str, float] = {}
        self.finish: dict[str, float] = {}
        self.queues: dict[str, list[tuple[int, object, float]]] = {}
        self.vtime = 0.0
        self.seq = 0

    def set_weight(self, tenant: str, weight: float) -> None:
        self.weights[tenant] = weight
        self.finish.setdefault(tenant, self.vtime)
        self.queues.setdefault(tenant, [])

    def push(self, tenant: str, item: object, cost: float) -> None:
        if tenant not in self.weights:
            self.set_weight(tenant, 1.0)
        self.seq += 1
        self.queues[tenant].append((self.seq, item, cost))

    def pop(self) -> tuple[str, object, float] | None:
        keys = [(max(self.finish[t], self.vtime), q[0][0], t) for t, q in self.queues.items() if q]
        if not keys:
            return None
        start, _, tenant = min(keys)
        _, item, cost = self.queues[tenant].pop(0)
        self.vtime = start
        self.finish[tenant] = start + cost / self.weights[tenant]
        return tenant, item, cost

    def charge(self, tenant: str, actual: float, estimate: float) -> None:
        if tenant in self.finish:
            self.finish[tenant] += (actual - estimate) / self.weights[tenant]

    def discard(self, tenant: str, item: object) -> bool:
        queue = self.queues.get(tenant, [])
        for i, entry in enumerate(queue):
            if entry[1] is item:
                del queue[i]
                return True
        return False

    def remove(self, tenant: str) -> list[object]:
        self.weights.pop(tenant, None)
        self.finish.pop(tenant, None)
        return [item for _, item, _ in self.queues.pop(tenant, [])]


@pytest.mark.parametrize("seed", range(6))
def test_fair_share_serves_in_the_order_of_its_definition(seed: int) -> None:
    """Random pushes, pops, charges (cheaper and dearer than estimated), withdrawals,
    removals and weights over eight tenants: the same items in the same order as the
    scan over every tenant."""
    rng = random.Random(seed)
    share, scan = FairShare(), _ScanShare()
    tenants = [f"t{i}" for i in range(8)]
    items: list[tuple[str, object]] = []
    served = 0
    for step in range(3000):
        op = rng.random()
        tenant = rng.choice(tenants)
        if op < 0.4:
            item = object()
            cost = float(rng.choice([1, 4, 16, 64]))
            share.push(tenant, item, cost)
            scan.push(tenant, item, cost)
            items.append((tenant, item))
        elif op < 0.8:
            got, want = share.pop(), scan.pop()
            assert got == want, step
            if got is not None:
                served += 1
                if rng.random() < 0.5:
                    used = got[2] * rng.choice([0.0, 0.25, 1.0, 1.5])
                    share.charge(got[0], used, got[2])
                    scan.charge(got[0], used, got[2])
        elif op < 0.9 and items:
            owner, item = items.pop(rng.randrange(len(items)))
            assert share.discard(owner, item) == scan.discard(owner, item)
        elif op < 0.95:
            weight = rng.choice([0.5, 1.0, 3.0])
            share.set_weight(tenant, weight)
            scan.set_weight(tenant, weight)
        elif op < 0.97:
            assert share.remove(tenant) == scan.remove(tenant)
        assert len(share) == sum(len(q) for q in scan.queues.values())
    while (got := share.pop()) is not None:
        assert got == scan.pop()
    assert scan.pop() is None and served > 500


def test_admission_is_priority_first_then_fifo() -> None:
    queue = AdmissionQueue()
    for name, prio in [("a", 1.0), ("b", 2.0), ("c", 1.0), ("d", 2.0), ("e", 5.0)]:
        queue.push(name, prio)
    assert queue.remove("c") and "c" not in queue
    assert [queue.pop() for _ in range(len(queue))] == ["e", "b", "d", "a"]


@pytest.fixture(scope="module")
def saturated(tiny_dir: Path) -> tuple[RolloutEngine, AdapterBank]:
    base, tokenizer = load_base(tiny_dir)
    model = LoRAModel(base, max_rank=4)
    bank = AdapterBank(model, num_slots=4)
    spec = LoRASpec.model_validate({"rank": 4})
    for tenant in ("p1", "p2", "p3"):
        bank.register(tenant, spec, seed=1)
    # eos_token_ids=[]: every request runs to max_new_tokens, so costs are equal.
    engine = RolloutEngine(
        model, bank, tokenizer, max_batch_size=6, background=False, eos_token_ids=[]
    )
    return engine, bank


async def test_gate_gives_a_saturated_engine_to_tenants_by_priority(
    saturated: tuple[RolloutEngine, AdapterBank],
) -> None:
    engine, _ = saturated
    gate = RequestGate(engine, capacity=6)
    gate.set_weight("p1", 1.0)
    gate.set_weight("p2", 2.0)
    gate.set_weight("p3", 1.0)
    sampling = SamplingParams(max_new_tokens=6, seed=0)
    futures: list[asyncio.Future[Completion]] = [
        gate.submit(RolloutRequest(tenant=t, prompt_ids=(10, 11, 12), sampling=sampling))
        for _ in range(40)
        for t in ("p1", "p2", "p3")
    ]
    assert engine.queued == 0  # everything waits in the gate, in fair order
    for _ in range(60):  # always saturated: 120 requests x 6 tokens >> 60 x 6 rows
        gate.fill()
        assert engine.running + engine.queued <= 6
        engine.step()
    await asyncio.sleep(0)  # deliveries are scheduled on the loop
    tokens = gate.tokens
    assert tokens["p2"] >= 1.6 * tokens["p1"]
    assert tokens["p2"] >= 1.6 * tokens["p3"]
    assert min(tokens["p1"], tokens["p3"]) > 0  # no starvation
    assert gate.max_rows["p2"] > gate.max_rows["p1"]
    for f in futures:
        f.cancel()
    await asyncio.sleep(0)  # cancellation callbacks withdraw / abort the requests
    for _ in range(3):
        gate.fill()
        engine.step()
    assert not engine.has_work() and not gate.has_waiting()


async def test_cancelled_requests_leave_the_gate(
    saturated: tuple[RolloutEngine, AdapterBank],
) -> None:
    engine, _ = saturated
    gate = RequestGate(engine, capacity=6)
    woken: list[int] = []
    gate.on_submit = lambda: woken.append(1)
    sampling = SamplingParams(max_new_tokens=3, seed=0)
    futures = [
        gate.submit(RolloutRequest(tenant="p1", prompt_ids=(10, 11), sampling=sampling))
        for _ in range(8)
    ]
    assert len(woken) == 8
    gate.fill()  # 6 go to the engine, 2 wait
    futures[-1].cancel()  # waiting: withdrawn from the gate
    futures[0].cancel()  # in the engine: aborted there
    await asyncio.sleep(0)
    while engine.has_work() or gate.has_waiting():
        gate.fill()
        engine.step()
    await asyncio.sleep(0)
    done = [f for f in futures if not f.cancelled()]
    assert len(done) == 6 and all(len(f.result().token_ids) == 3 for f in done)
    assert gate.rows["p1"] == 0


async def test_a_settled_request_is_freed_without_the_garbage_collector(
    saturated: tuple[RolloutEngine, AdapterBank],
) -> None:
    """A request's future, its waiting item and its completion form no reference cycle
    once settled (delivered or cancelled): they go as their last reference does, not at
    the collector's next pass (`Withdrawable`)."""
    engine, _ = saturated
    gate = RequestGate(engine, capacity=6)
    sampling = SamplingParams(max_new_tokens=2, seed=0)
    gc.collect()
    gc.disable()
    try:
        delivered = gate.submit(RolloutRequest(tenant="p1", prompt_ids=(10, 11), sampling=sampling))
        withdrawn = gate.submit(RolloutRequest(tenant="p1", prompt_ids=(12,), sampling=sampling))
        withdrawn.cancel()
        while not delivered.done():
            gate.fill()
            engine.step()
            await asyncio.sleep(0)
        completion = delivered.result()
        assert len(completion.token_ids) == 2
        refs = [weakref.ref(x) for x in (delivered, withdrawn)]
        del delivered, withdrawn
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()
    assert not gate.has_waiting() and not engine.has_work()


class _Unstreaming:
    """An engine front end that cannot stream (like the Ray client): `streams_tokens` is
    False and it takes no listener."""

    streams_tokens = False

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    @property
    def running(self) -> int:
        return self.engine.running

    @property
    def queued(self) -> int:
        return self.engine.queued

    def enqueue(
        self, request: RolloutRequest, deliver: Deliver, listener: TokenListener | None = None
    ) -> None:
        assert listener is None, "a front that does not stream gets no listener"
        self.engine.enqueue(request, deliver)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


async def test_the_gate_streams_tokens_when_its_engine_can(
    saturated: tuple[RolloutEngine, AdapterBank],
) -> None:
    engine, _ = saturated
    sampling = SamplingParams(max_new_tokens=4, seed=0)
    fronts: list[tuple[EngineFront, bool]] = [(engine, True), (_Unstreaming(engine), False)]
    for front, streams in fronts:
        gate = RequestGate(front, capacity=6)
        seen: list[int] = []
        request = RolloutRequest(tenant="p1", prompt_ids=(10, 11), sampling=sampling)
        future = gate.submit(request, on_token=seen.append)
        while not future.done():
            gate.fill()
            engine.step()
            await asyncio.sleep(0)
        tokens = list(future.result().token_ids)
        assert len(tokens) == 4 and seen == (tokens if streams else [])


def test_queue_depths_count_waiting_items_per_tenant() -> None:
    share = FairShare()
    for tenant, n in (("a", 3), ("b", 1)):
        share.set_weight(tenant, 1.0)
        for i in range(n):
            share.push(tenant, (tenant, i), cost=1)
    assert share.depths() == {"a": 3, "b": 1}
    share.pop()
    share.pop()
    assert sum(share.depths().values()) == 2 and all(share.depths().values())
    share.pop()
    share.pop()
    assert share.depths() == {}


async def test_inference_rows_go_first_and_training_leaves_rows_for_them(
    saturated: tuple[RolloutEngine, AdapterBank],
) -> None:
    """Twenty training requests wait; an inference request enters the engine first, and
    while inference is asked for, training fills all but `reserve` rows, so a second
    inference request enters at once although training requests still wait."""
    engine, _ = saturated
    gate = RequestGate(engine, capacity=6, reserve=2)
    sampling = SamplingParams(max_new_tokens=6, seed=0)

    def request(tenant: str) -> RolloutRequest:
        return RolloutRequest(tenant=tenant, prompt_ids=(10, 11, 12), sampling=sampling)

    training = [gate.submit(request("p1")) for _ in range(20)]
    gate.fill()
    assert engine.running + engine.queued == 6  # nobody asked for inference: every row
    first = gate.submit(request("p2"), interactive=True)
    while not first.done():  # it enters when a row frees, ahead of 14 training requests
        gate.fill()
        engine.step()
        await asyncio.sleep(0)
    assert gate.interactive_rows == 0 and gate.waiting()["p1"] > 0
    for _ in range(8):  # the finished rows are refilled, but only up to 6 - 2
        gate.fill()
        engine.step()
    gate.fill()
    assert engine.running + engine.queued <= 4 and gate.waiting()["p1"] > 0
    second = gate.submit(request("p3"), interactive=True)
    rows = engine.running + engine.queued
    assert gate.fill(training=False) == 1  # an inference window: inference only
    assert engine.running + engine.queued == rows + 1 and gate.waiting()["p1"] > 0
    assert gate.interactive_rows == 1  # in the engine at once, in a reserved row
    for f in training:
        f.cancel()
    await asyncio.sleep(0)
    while not second.done():
        gate.fill()
        engine.step()
        await asyncio.sleep(0)
    assert len(second.result().token_ids) == 6
    while engine.has_work() or gate.has_waiting():
        gate.fill()
        engine.step()
    assert gate.interactive_rows == 0 and not gate.interactive_active()


async def test_a_request_on_an_account_uses_that_tenants_share(
    saturated: tuple[RolloutEngine, AdapterBank],
) -> None:
    """A judge call of job p1 samples another adapter (p3 here) on p1's account: it
    waits in p1's queue, at p1's weight, is counted to p1, and leaves with p1."""
    engine, _ = saturated
    gate = RequestGate(engine, capacity=6)
    gate.set_weight("p1", 1.0)
    gate.set_weight("p2", 1.0)
    sampling = SamplingParams(max_new_tokens=6, seed=0)

    def request(tenant: str, account: str | None = None) -> RolloutRequest:
        return RolloutRequest(
            tenant=tenant, prompt_ids=(10, 11, 12), sampling=sampling, account=account
        )

    own, judged = [], []
    for _ in range(20):
        own.append(gate.submit(request("p1")))
        judged.append(gate.submit(request("p3", account="p1")))
    other = [gate.submit(request("p2")) for _ in range(40)]
    assert gate.waiting() == {"p1": 40, "p2": 40}  # no queue of p3's own
    for _ in range(30):
        gate.fill()
        engine.step()
    await asyncio.sleep(0)
    # p1's own rows and its judge's share one tenant's half of the engine.
    assert gate.tokens.keys() == {"p1", "p2"}
    assert 0.8 <= gate.tokens["p1"] / gate.tokens["p2"] <= 1.25
    done = [f for f in judged if f.done() and not f.cancelled()]
    assert done and all(f.result().tenant == "p3" for f in done)  # sampled with p3
    gate.remove("p1")  # the job ends: its judge calls still waiting end with it
    await asyncio.sleep(0)
    assert all(f.done() for f in own + judged) and gate.waiting().keys() == {"p2"}
    for f in other:
        f.cancel()
    await asyncio.sleep(0)
    while engine.has_work() or gate.has_waiting():
        gate.fill()
        engine.step()
