"""The device executor's queue of calls, and which of them one turn of the device thread
runs: pure bookkeeping (no torch, no threads), so the ordering rules are tested alone.

Every port call that touches tenants' state is an `Op` on one queue, in call order,
naming the tenants it touches. A turn runs ops in phases: `ADD` (add, restore), then one
`FORWARD_BACKWARD` pass over every taken forward_backward op, one `FORWARD` pass, one
batched `OPTIM` step, then `AFTER` ops (snapshot, export, drop). `take` picks the ops of
one turn:

- a tenant's ops run in the order they were queued: an op is taken only if no earlier
  op that names one of its tenants is still waiting, and only if its phase comes after
  the phase of every op of those tenants already taken this turn (so a tenant's
  forward_backward then optim_step then snapshot, queued together, run in one turn, in
  that order, while a second forward_backward waits for the next pass);
- ops of different tenants never wait for each other, so every tenant's pending
  forward_backward joins the same pass;
- with `passes=False` (the engine must decode first) passes wait, and so does every
  later op of their tenants; other tenants' cheap ops still run.

`PassGathering` decides when a forward_backward pass waits for more tenants to join it:
a pass has a cost of its own besides its rows' (a multi-lane pass of 8 tenants costs
about 9 ms a tenant where one of a single tenant costs 16 in the compute regime's
shapes), and tenants' batches become ready a few at a time, one engine iteration apart.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from marlaas.train.optim import AdamParams
from marlaas.train.records import TrainInput


class Phase(enum.IntEnum):
    """When in a turn an op runs (see the module docstring)."""

    ADD = 0
    FORWARD_BACKWARD = 1
    FORWARD = 2
    OPTIM = 3
    AFTER = 4


PASSES = (Phase.FORWARD_BACKWARD, Phase.FORWARD)


@dataclass(eq=False)
class Op:
    """One queued call. Control ops (`ADD`, `AFTER`) carry `run`; passes their inputs;
    `OPTIM` its tenant's parameters. `future` gets the result or the error."""

    phase: Phase
    tenants: tuple[str, ...]
    future: Future[Any]
    run: Callable[[], Any] | None = None
    inputs: tuple[TrainInput, ...] = ()
    params: AdamParams | None = None


def take(ops: Sequence[Op], *, passes: bool = True) -> tuple[list[Op], list[Op]]:
    """Split `ops` (in queue order) into those one turn runs and those that wait."""
    taken: list[Op] = []
    waiting: list[Op] = []
    blocked: set[str] = set()
    last: dict[str, Phase] = {}
    for op in ops:
        ready = (
            (passes or op.phase not in PASSES)
            and not blocked.intersection(op.tenants)
            and all(last.get(t, -1) < op.phase for t in op.tenants)
        )
        if ready:
            taken.append(op)
            last.update((t, op.phase) for t in op.tenants)
        else:
            waiting.append(op)
            blocked.update(op.tenants)
    return taken, waiting


#: Most tenants a held pass waits for (`PassGathering`).
GATHER_TENANTS = 8
#: Most engine iterations a pass is held for in a row (`PassGathering`).
GATHER_TURNS = 3
#: How far back the tenants that ran passes count as training now (`PassGathering`).
ACTIVE_WINDOW_S = 5.0


class PassGathering:
    """Holds a forward_backward pass back, while the engine has rows to decode, until its
    tenants number `min(GATHER_TENANTS, training // 2)`, where `training` is the number
    of tenants whose passes ran in the last `ACTIVE_WINDOW_S`; at most `GATHER_TURNS`
    engine iterations in a row. A lone tenant (or two) is never held, nor a pass when
    the engine has nothing to decode; forward-only passes are not held."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.held = 0  # engine iterations the current pass has been held for
        self._recent: deque[tuple[float, frozenset[str]]] = deque()

    def hold(self, ops: Sequence[Op], *, rows_waiting: bool) -> bool:
        """Whether this turn's forward_backward ops wait (the caller then decodes)."""
        waiting = {t for op in ops if op.phase == Phase.FORWARD_BACKWARD for t in op.tenants}
        if (
            waiting
            and rows_waiting
            and self.held < GATHER_TURNS
            and len(waiting) < min(GATHER_TENANTS, len(self.training()) // 2)
        ):
            self.held += 1
            return True
        self.held = 0
        return False

    def ran(self, tenants: Sequence[str]) -> None:
        """A forward_backward pass of `tenants` ran."""
        self._recent.append((self.clock(), frozenset(tenants)))

    def training(self) -> set[str]:
        """The tenants whose passes ran in the last `ACTIVE_WINDOW_S`."""
        horizon = self.clock() - ACTIVE_WINDOW_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        return {t for _, tenants in self._recent for t in tenants}
