"""Records and errors that cross the boundary between the backend's clients and its
actors. Light on purpose (no torch): environment workers import only this and the
task families they run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayTaskError

from marlaas.config.specs import LoRASpec
from marlaas.errors import MarlaasError

#: Consecutive failed calls after which an actor being waited for counts as gone.
DEAD_AFTER_FAILURES = 25
#: Episodes an environment worker keeps at most (abandoned ones are dropped oldest first).
MAX_EPISODES = 4096


class ReplicaStale(MarlaasError, RuntimeError):
    """The replica lacks a tenant or version the client expected (it restarted)."""


class EpisodeLost(MarlaasError, RuntimeError):
    """The environment worker no longer holds this episode (it restarted)."""


@dataclass(frozen=True)
class ActorInfo:
    """Where an actor runs, and which incarnation of it answered."""

    node_id: str
    pid: int
    incarnation: str


@dataclass(frozen=True)
class ReplicaStats:
    busy_s: float
    decode_steps: int
    tokens: int
    prefill_tokens: int = 0
    shared_prefill_tokens: int = 0


@dataclass(frozen=True)
class TenantAdapters:
    """What a replica needs to serve a tenant: its LoRA spec and its kept versions,
    oldest first, each as a (version, object ref of the tensors) pair."""

    tenant: str
    lora: LoRASpec
    versions: tuple[tuple[int, Any], ...]


@dataclass(frozen=True)
class Rejected:
    """A trainer step refused one tenant's batch (a `TrainBatchError`, whose own
    pickling loses its tenant): the caller raises it again locally."""

    tenant: str
    message: str


def actor_info(incarnation: str) -> ActorInfo:
    """The calling actor's node, process and `incarnation`."""
    return ActorInfo(ray.get_runtime_context().get_node_id(), os.getpid(), incarnation)


@dataclass
class ClientStats:
    """Counters over the client's life (tests and the run summary read them)."""

    delivered: int = 0
    retries: int = 0
    duplicates_dropped: int = 0
    replica_failures: int = 0
    recoveries: int = 0
    publishes: int = 0


def unwrap(exc: BaseException) -> BaseException:
    """The error an actor raised, without Ray's wrapper."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    return exc
