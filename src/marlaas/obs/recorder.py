"""The one interface every stage reports through.

Stages call a `Recorder`; what happens to the records (kept in memory, appended to
JSONL, exported as a Chrome/Perfetto trace, drawn as plots, shown live) is the
recorder's business. Times are `time.perf_counter()` seconds; a recorder maps them to
wall-clock time itself. Every method must be cheap and thread-safe: the device thread
and the event loop both call it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

#: Stage names used by spans. "device" spans are model compute (busy time).
STAGES = ("device", "rollout", "env", "train", "eval", "checkpoint", "orchestrator")

#: Metric keys the plots and the live view look for in `Recorder.metrics` values.
METRIC_REWARD = "reward"
METRIC_EVAL_ACCURACY = "eval_accuracy"


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

    def metrics(self, tenant: str, step: int, values: Mapping[str, float]) -> None:
        """Per-tenant figures at optimizer step `step` (reward, loss, eval accuracy, ...)."""

    def event(self, name: str, *, tenant: str | None = None, **fields: object) -> None:
        """A lifecycle event (job admitted, failed, checkpoint written, ...)."""


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

    def metrics(self, tenant: str, step: int, values: Mapping[str, float]) -> None:
        return None

    def event(self, name: str, *, tenant: str | None = None, **fields: object) -> None:
        return None
