"""The Tinker API's bookkeeping without a device: futures and their long poll, the
per-model `seq_id` order with resends answered once, and sessions with heartbeats."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from marlaas.service.errors import NotFound
from marlaas.service.tinker.errors import Gone, UserError
from marlaas.service.tinker.futures import Failure, FutureStore, JsonReply, Pending
from marlaas.service.tinker.sequence import ModelSequence
from marlaas.service.tinker.sessions import Sessions


async def test_a_retrieval_waits_for_the_result_and_says_try_again_meanwhile() -> None:
    store = FutureStore(poll_s=0.05)
    rid = store.create("ten_a")
    assert await store.retrieve(rid, "ten_a") == Pending(rid)
    assert Pending(rid).json()["type"] == "try_again"

    async def later() -> None:
        await asyncio.sleep(0.01)
        store.resolve(rid, JsonReply({"model_id": "m"}))

    waiter = asyncio.ensure_future(store.retrieve(rid, "ten_a", timeout=5))
    await later()
    outcome = await waiter
    assert isinstance(outcome, JsonReply) and outcome.json() == {"model_id": "m"}
    assert outcome.protobuf() is None
    store.fail(rid, "too late")  # a future resolves once
    assert await store.retrieve(rid, "ten_a") == outcome  # and can be read again


async def test_failures_and_foreign_or_unknown_ids() -> None:
    store = FutureStore(poll_s=0.01)
    rid = store.create("ten_a")
    store.fail(rid, "loss_fn 'x' is not supported", "user")
    outcome = await store.retrieve(rid, "ten_a")
    assert isinstance(outcome, Failure)
    assert outcome.json() == {"error": "loss_fn 'x' is not supported", "category": "user"}
    with pytest.raises(NotFound):
        await store.retrieve(rid, "ten_b")  # another tenant's: as if missing
    with pytest.raises(NotFound):
        await store.retrieve("req_nothing", "ten_a")


async def test_finished_futures_expire_after_their_ttl() -> None:
    now = [0.0]
    store = FutureStore(poll_s=0.01, ttl_s=10, clock=lambda: now[0])
    old = store.create("ten_a")
    store.resolve(old, JsonReply({}))
    running = store.create("ten_a")
    now[0] = 11.0
    store.create("ten_a")  # creating sweeps what expired
    with pytest.raises(NotFound):
        await store.retrieve(old, "ten_a")
    assert await store.retrieve(running, "ten_a") == Pending(running)  # pending ones stay


async def test_requests_run_in_seq_order_whatever_order_they_arrive_in() -> None:
    seq = ModelSequence("m", next_seq=1)
    ran: list[int] = []
    gate = asyncio.Event()

    def step(n: int) -> Callable[[], Awaitable[None]]:
        async def start() -> None:
            if n == 2:
                await gate.wait()  # its ordered part takes a while
            ran.append(n)

        return start

    for n in (3, 2, 4):  # the SDK sends a batch's first chunk last
        seq.put(n, f"r{n}", step(n))
    await asyncio.sleep(0.01)
    assert ran == [] and seq.waiting == 3  # all wait for number 1
    seq.put(1, "r1", step(1))
    await asyncio.sleep(0.01)
    assert ran == [1]  # 3 and 4 wait behind 2
    gate.set()
    await asyncio.sleep(0.01)
    assert ran == [1, 2, 3, 4] and seq.next_seq == 5
    assert seq.known(3) == "r3"  # a resend finds its request id
    with pytest.raises(UserError, match="already used"):
        seq.put(3, "again", step(3))
    seq.put(6, "r6", step(6))
    assert seq.close("session finished") == ["r6"]  # waiting ones are failed by the caller
    with pytest.raises(UserError, match="closed: session finished"):
        seq.put(5, "r5", step(5))


async def test_a_failing_step_does_not_stop_the_sequence() -> None:
    seq = ModelSequence("m", next_seq=0)
    ran: list[int] = []

    async def boom() -> None:
        raise RuntimeError("a bug in one call")

    async def fine() -> None:
        ran.append(1)

    seq.put(0, "a", boom)
    seq.put(1, "b", fine)
    await asyncio.sleep(0.01)
    assert ran == [1]
    with pytest.raises(UserError, match="comes after 1 requests"):
        ModelSequence("n", next_seq=2).put(1, "x", fine)


def test_sessions_live_by_heartbeats_and_belong_to_one_tenant() -> None:
    now = [0.0]
    sessions = Sessions(timeout_s=60, clock=lambda: now[0])
    a = sessions.create("ten_a", {"who": "alice"})
    b = sessions.create("ten_a", None)
    with pytest.raises(NotFound):
        sessions.get("ten_b", a.id)
    now[0] = 50.0
    sessions.heartbeat("ten_a", a.id)
    now[0] = 100.0
    assert [s.id for s in sessions.expire()] == [b.id]  # silent for 100 s > 60 s
    with pytest.raises(Gone):
        sessions.heartbeat("ten_a", b.id)  # the SDK stops its heartbeats on 410
    with pytest.raises(UserError, match="has finished"):
        sessions.get("ten_a", b.id)
    assert sessions.finish("ten_a", a.id, "success") is a
    assert sessions.finish("ten_a", a.id, "errored") is None  # the first reason wins
    assert a.finished == "success"
