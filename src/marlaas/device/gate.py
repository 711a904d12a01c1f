"""Fair share of the sampler between tenants: the entrance every sampling request of
the device passes (`DevicePort.sample`).

`FairShare` is start-time fair queueing (Goyal et al. 1996) over generated tokens: each
tenant has a virtual clock that advances by `tokens / weight` for the work it is given;
the next request to enter the engine is the head of the backlogged tenant with the
smallest start tag `max(finish[t], V)`, where `V` is the start tag of the last request
dispatched. A request is charged its `max_new_tokens` when dispatched and corrected to
the tokens it really generated when it completes. So when the engine is saturated, a
tenant of weight w gets rows (and tokens) in proportion to w; a tenant that was idle
gets no credit for the time it did not ask (its clock is pulled up to `V`); and every
backlogged tenant is served within a bounded lag of the others (no starvation).

`RequestGate` sits between the tenants and the engine front (`EngineFront`: the
in-process `RolloutEngine`, or the Ray replicas' client): `submit` (event loop) queues a
request in its tenant's queue and returns a future; `fill` (the thread that steps the
engine, before each iteration, or whoever pumps requests to replicas) moves requests
into the engine, in fair order, only while the engine has free rows, so the engine's own
FIFO queue stays (nearly) empty and the order of admission is the gate's. A request
submitted with `on_token` streams its tokens when the front does (`streams_tokens`);
else its caller gets them all with the completion.

Inference rows against training rows (`submit(..., interactive=True)`: the service's
OpenAI endpoints): interactive requests are ordered among themselves by a fair share of
their own and enter the engine before any training request, and while interactive
requests were seen in the last `RESERVE_HOLD_S` seconds, training requests leave
`reserve` rows free, so that a completion never waits for a training row to finish.
Training keeps the rest of the rows, and every row when nobody asks for inference (a
`marlaas run`). The device executor, for its part, gives inference rows windows of a
bounded length (`executor.MAX_INTERACTIVE_S`) in which it neither trains nor admits
training rows (`fill(training=False)`), with a turn for training between two windows, so
training is delayed, never stopped. An interactive request asks for a handful of rows
for a few iterations, and the service bounds how many it may ask (rows and tokens per
request, requests in flight per tenant), so the priority cannot be used to starve
training.

A request is queued, counted and charged under its `RolloutRequest.share`: its tenant,
or the `account` it names. A training job's judge (a model grader calling the base or a
served adapter) is that job's training work, so it is a training request on the job's
account: it takes the job's share, at the job's weight, and is cancelled with the job's
other requests when the job is removed; it never jumps ahead as inference does.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from marlaas.rollout.batch import Deliver, TokenListener
from marlaas.rollout.engine import Withdrawable, on_loop, post, settle
from marlaas.types import Completion, RolloutRequest


class EngineFront(Protocol):
    """What the gate needs of an engine: its load, and a non-blocking way in and out."""

    #: Whether `enqueue` calls a listener with each token as it is sampled.
    streams_tokens: bool

    @property
    def running(self) -> int: ...

    @property
    def queued(self) -> int: ...

    def enqueue(
        self, request: RolloutRequest, deliver: Deliver, listener: TokenListener | None = None
    ) -> None: ...

    def abort(self, request_id: str) -> None: ...


class FairShare:
    """Start-time fair queueing over tenants' generated tokens (not thread-safe).

    The next item is the head of the backlogged tenant of the smallest key
    `(max(finish, V), head's sequence number, tenant)`. As `V` never decreases, a
    tenant whose finish tag is at most `V` keeps the key `(V, ...)` until it is served:
    such tenants wait in one heap by their head's sequence number, the others in one by
    finish tag, so that `pop` costs O(log tenants), not a pass over every tenant (a
    sampling request's admission at 32 tenants: a quarter of the gate's time was that
    pass). A tenant's entry is replaced, never edited: the heaps hold at most one live
    entry per backlogged tenant (`_live`), stale ones are dropped when they surface.
    """

    def __init__(self) -> None:
        self._weights: dict[str, float] = {}
        self._finish: dict[str, float] = {}
        self._queues: dict[str, deque[tuple[int, object, float]]] = {}
        self._vtime = 0.0
        self._seq = itertools.count()
        #: (finish, head's sequence number, tenant, entry) of tenants with finish > V.
        self._ahead: list[tuple[float, int, str, int]] = []
        #: (head's sequence number, tenant, entry) of tenants with finish <= V.
        self._due: list[tuple[int, str, int]] = []
        #: Each backlogged tenant's live entry (entries are numbered by `_seq`).
        self._live: dict[str, int] = {}

    def set_weight(self, tenant: str, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"tenant {tenant!r}: weight must be > 0, got {weight}")
        self._weights[tenant] = float(weight)
        self._finish.setdefault(tenant, self._vtime)
        self._queues.setdefault(tenant, deque())

    def remove(self, tenant: str) -> list[object]:
        """Forget a tenant; returns its waiting items."""
        self._weights.pop(tenant, None)
        self._finish.pop(tenant, None)
        self._live.pop(tenant, None)
        queue = self._queues.pop(tenant, deque())
        return [item for _, item, _ in queue]

    def push(self, tenant: str, item: object, cost: float) -> None:
        if tenant not in self._weights:
            self.set_weight(tenant, 1.0)
        queue = self._queues[tenant]
        queue.append((next(self._seq), item, float(cost)))
        if len(queue) == 1:
            self._enter(tenant)

    def discard(self, tenant: str, item: object) -> bool:
        queue = self._queues.get(tenant)
        if queue is None:
            return False
        for i, entry in enumerate(queue):
            if entry[1] is item:
                del queue[i]
                if i == 0:  # a new head, or none
                    self._enter(tenant)
                return True
        return False

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    def depths(self) -> dict[str, int]:
        """Waiting items per tenant, for tenants with any."""
        return {t: len(q) for t, q in self._queues.items() if q}

    def pop(self) -> tuple[str, object, float] | None:
        """The next (tenant, item, cost) in fair order, or None when nothing waits."""
        ahead, due, live = self._ahead, self._due, self._live
        while ahead and (ahead[0][0] <= self._vtime or live.get(ahead[0][2]) != ahead[0][3]):
            _, seq, tenant, entry = heapq.heappop(ahead)
            if live.get(tenant) == entry:  # due now: V has reached its finish tag
                heapq.heappush(due, (seq, tenant, entry))
        while due and live.get(due[0][1]) != due[0][2]:
            heapq.heappop(due)
        if due:
            _, tenant, _ = heapq.heappop(due)
        elif ahead:
            _, _, tenant, _ = heapq.heappop(ahead)
        else:
            return None
        start = max(self._finish[tenant], self._vtime)
        _, item, cost = self._queues[tenant].popleft()
        self._vtime = start
        self._finish[tenant] = start + cost / self._weights[tenant]
        self._enter(tenant)  # its next head's entry, or none
        return tenant, item, cost

    def charge(self, tenant: str, actual: float, estimate: float) -> None:
        """Correct a dispatched request's estimated cost to what it really used."""
        if tenant in self._finish:
            self._finish[tenant] += (actual - estimate) / self._weights[tenant]
            self._enter(tenant)

    def virtual_finish(self, tenant: str) -> float:
        return self._finish[tenant]

    def _enter(self, tenant: str) -> None:
        """(Re)place a tenant's entry for its current head and finish tag (none when its
        queue is empty); any entry it had goes stale."""
        queue = self._queues[tenant]
        if not queue:
            self._live.pop(tenant, None)
            return
        entry = next(self._seq)
        self._live[tenant] = entry
        head, finish = queue[0][0], self._finish[tenant]
        if finish <= self._vtime:
            heapq.heappush(self._due, (head, tenant, entry))
        else:
            heapq.heappush(self._ahead, (finish, head, tenant, entry))


#: Seconds after the last interactive request during which training leaves the
#: reserved rows free (a client sending one request after another keeps them).
RESERVE_HOLD_S = 10.0


@dataclass(eq=False)
class _Waiting:
    request: RolloutRequest
    future: asyncio.Future[Completion]
    loop: asyncio.AbstractEventLoop
    cost: float
    listener: TokenListener | None = None
    dispatched: bool = False
    interactive: bool = False


class RequestGate:
    """The fair-ordered entrance to the engine (see the module docstring).

    `capacity` is the engine's `max_batch_size`; `reserve` the rows training leaves
    free while inference is asked for (default: a sixteenth, at least one). `on_submit`
    is called (from the event loop) after each submit, to wake whoever calls `fill`. Per
    tenant it counts the tokens generated (`tokens`) and the training rows in the
    engine now (`rows`); `interactive_rows` counts the inference rows in the engine.
    """

    def __init__(
        self,
        engine: EngineFront,
        capacity: int,
        on_submit: Callable[[], None] | None = None,
        reserve: int | None = None,
    ) -> None:
        self.engine = engine
        self.capacity = capacity
        self.on_submit = on_submit
        self.reserve = max(1, capacity // 16) if reserve is None else reserve
        self._share = FairShare()
        self._interactive = FairShare()
        self._interactive_until = 0.0
        self._lock = threading.Lock()
        self._streams = engine.streams_tokens
        self.tokens: dict[str, int] = {}
        self.rows: dict[str, int] = {}
        self.max_rows: dict[str, int] = {}
        self.interactive_rows = 0

    def set_weight(self, tenant: str, weight: float) -> None:
        with self._lock:
            self._share.set_weight(tenant, weight)

    def remove(self, tenant: str) -> None:
        """Forget a tenant; its waiting requests are cancelled."""
        with self._lock:
            items = self._share.remove(tenant)
        for item in items:
            assert isinstance(item, _Waiting)
            _resolve(item, asyncio.CancelledError(f"tenant {tenant!r} was removed"))

    def waiting(self) -> dict[str, int]:
        """Training requests waiting for the engine, per tenant (the queue depths)."""
        with self._lock:
            return self._share.depths()

    def has_waiting(self) -> bool:
        with self._lock:
            return len(self._share) > 0 or len(self._interactive) > 0

    def _room(self) -> int:
        """Rows the engine can take now."""
        return self.capacity - self.engine.running - self.engine.queued

    def saturated(self) -> bool:
        """Whether requests wait that the engine has no room for now: the sampler, not
        its callers, is what the work waits on."""
        return self._room() <= 0 and self.has_waiting()

    def interactive_active(self) -> bool:
        """Whether inference requests run in the engine or wait for it now."""
        with self._lock:
            return self.interactive_rows > 0 or len(self._interactive) > 0

    def submit(
        self,
        request: RolloutRequest,
        on_token: Callable[[int], None] | None = None,
        *,
        interactive: bool = False,
    ) -> asyncio.Future[Completion]:
        """Queue `request` under its tenant; the future resolves with its `Completion`.

        Cancelling the future withdraws a waiting request or aborts a running one.
        `on_token` is called on this loop with each token as the engine samples it (as
        `RolloutEngine.submit`), when the engine streams. `interactive`: an inference
        request, admitted before training requests (see the module docstring).
        """
        loop = asyncio.get_running_loop()
        future = Withdrawable(loop, lambda: self._withdraw(item))
        listener = on_loop(loop, on_token) if on_token is not None and self._streams else None
        cost = float(request.sampling.max_new_tokens)
        item = _Waiting(request, future, loop, cost, listener, interactive=interactive)
        with self._lock:
            if interactive:
                self._interactive_until = time.monotonic() + RESERVE_HOLD_S
            (self._interactive if interactive else self._share).push(request.share, item, item.cost)
        if self.on_submit is not None:
            self.on_submit()
        return future

    def fill(self, *, training: bool = True) -> int:
        """Move waiting requests into the engine while it has free rows; returns how many
        (`training=False`: inference requests only).

        Call it from the thread that steps the engine, right before `engine.step()`.
        """
        room = self._room()
        moved = 0
        while room > 0:
            with self._lock:
                nxt = self._interactive.pop()
                if nxt is None:
                    if not training:
                        break
                    if room <= self.reserve and time.monotonic() < self._interactive_until:
                        break  # the last rows stay free for inference
                    nxt = self._share.pop()
                if nxt is None:
                    break
                tenant, item, _ = nxt
                assert isinstance(item, _Waiting)
                item.dispatched = True
                if item.interactive:
                    self.interactive_rows += 1
                else:
                    self.rows[tenant] = self.rows.get(tenant, 0) + 1
                    self.max_rows[tenant] = max(self.max_rows.get(tenant, 0), self.rows[tenant])
            self.engine.enqueue(item.request, _Deliver(self, item), item.listener)
            room -= 1
            moved += 1
        return moved

    def _withdraw(self, item: _Waiting) -> None:
        share = self._interactive if item.interactive else self._share
        with self._lock:
            if not item.dispatched and share.discard(item.request.share, item):
                return
        self.engine.abort(item.request.request_id)

    def _done(self, item: _Waiting, result: Completion | BaseException) -> None:
        tenant = item.request.share
        used = len(result.token_ids) if isinstance(result, Completion) else 0
        with self._lock:
            if item.interactive:
                self.interactive_rows -= 1
                self._interactive_until = time.monotonic() + RESERVE_HOLD_S
                self._interactive.charge(tenant, used, item.cost)
            else:
                self.rows[tenant] = self.rows.get(tenant, 1) - 1
                self.tokens[tenant] = self.tokens.get(tenant, 0) + used
                self._share.charge(tenant, used, item.cost)
        _resolve(item, result)


class _Deliver:
    """The engine's callback for one dispatched request (called in the stepping thread)."""

    def __init__(self, gate: RequestGate, item: _Waiting) -> None:
        self.gate = gate
        self.item = item

    def __call__(self, result: Completion | BaseException) -> None:
        self.gate._done(self.item, result)


def _resolve(item: _Waiting, result: Completion | BaseException) -> None:
    post(item.loop, settle, item.future, result)
