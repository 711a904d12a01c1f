"""The records `RayEngineClient` keeps per replica and per request, and its routing rule.

`choose_replica` picks the replica that serves a request: the one that served the
previous turn of its session when that one is healthy (for the session's KV cache),
else the least loaded healthy one (ties to the lowest index). Sessions are remembered
least recently used first, at most `MAX_SESSIONS` of them. Pure bookkeeping: no Ray
calls and no locks (the client calls it under its own lock).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from marlaas.rollout.batch import Deliver
from marlaas.types import RolloutRequest

#: Sessions remembered for replica affinity (least recently used forgotten first).
MAX_SESSIONS = 8192


@dataclass(eq=False)
class ReplicaSlot:
    """One engine replica as the client sees it: its handle, health and load."""

    index: int
    handle: Any
    healthy: bool = True
    dead: bool = False
    inflight: int = 0
    incarnation: str = ""
    node_id: str = ""
    restarts: int = 0


@dataclass(eq=False)
class PendingRequest:
    """A request the client holds until it has delivered its answer."""

    request: RolloutRequest
    deliver: Deliver
    attempts: int = 0
    replica: int | None = None
    ref: Any = None
    aborted: bool = False


def healthy(replicas: Sequence[ReplicaSlot]) -> list[ReplicaSlot]:
    """The replicas that may serve requests now."""
    return [r for r in replicas if r.healthy and not r.dead]


def choose_replica(
    replicas: Sequence[ReplicaSlot],
    sessions: OrderedDict[str, int],
    request: RolloutRequest,
) -> ReplicaSlot | None:
    """The replica to serve `request` (None when none is healthy); updates `sessions`."""
    candidates = healthy(replicas)
    if not candidates:
        return None
    if request.session is not None:
        index = sessions.get(request.session)
        if index is not None and replicas[index] in candidates:
            sessions.move_to_end(request.session)
            return replicas[index]
    best = min(candidates, key=lambda r: (r.inflight, r.index))
    if request.session is not None:
        sessions[request.session] = best.index
        while len(sessions) > MAX_SESSIONS:
            sessions.popitem(last=False)
    return best
