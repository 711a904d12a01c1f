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
"""

from __future__ import annotations

import enum
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
