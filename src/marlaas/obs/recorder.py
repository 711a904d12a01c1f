"""The one interface every stage reports through.

Stages call a `Recorder`: spans of work, typed progress records (`obs.progress`: a step
with its figures, an eval, a checkpoint, a tenant's state change) and free-form log
events. What happens to the records (kept in memory, appended to
JSONL, exported as a Chrome/Perfetto trace, drawn as plots, shown live) is the
recorder's business. Times are `time.perf_counter()` seconds; a recorder maps them to
wall-clock time itself. Every method must be cheap and thread-safe: the device thread
and the event loop both call it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from marlaas.obs.progress import Progress

#: Stage names used by spans. "device" spans are model compute (busy time).
STAGES = ("device", "rollout", "env", "train", "eval", "checkpoint", "orchestrator")


class Recorder(Protocol):
    def span(
        self,
        stage: str,
        name: str,
        start: float,
        end: float,
        *,
        tenant: str | None = None,
        args: Mapping[str, object] | None = None,
    ) -> None:
        """A piece of work of `stage` that ran from `start` to `end`."""

    def progress(self, record: Progress) -> None:
        """What happened to a tenant (see `marlaas.obs.progress`); subscribers read the
        record's type and fields."""

    def event(self, name: str, *, tenant: str | None = None, **fields: object) -> None:
        """A free-form event for the logs (a retried episode, a run started, ...);
        nothing reads it back to decide anything."""


class NullRecorder:
    """Records nothing."""

    def span(
        self,
        stage: str,
        name: str,
        start: float,
        end: float,
        *,
        tenant: str | None = None,
        args: Mapping[str, object] | None = None,
    ) -> None:
        return None

    def progress(self, record: Progress) -> None:
        return None

    def event(self, name: str, *, tenant: str | None = None, **fields: object) -> None:
        return None
