"""What a `RunRecorder` keeps and returns: one frozen record per kind of report.

All times are `time.perf_counter()` seconds, like the `Recorder` protocol's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Span:
    """A piece of work of `stage` from `start` to `end`."""

    stage: str
    name: str
    start: float
    end: float
    tenant: str | None = None
    args: Mapping[str, object] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class MetricPoint:
    """The values of one `metrics` call; `time` is when it arrived."""

    tenant: str
    step: int
    time: float
    values: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Event:
    """A lifecycle event; `time` is when it arrived."""

    name: str
    time: float
    tenant: str | None
    fields: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class UtilizationBin:
    """The busy fraction of a stage inside `[start, end)`."""

    start: float
    end: float
    busy_fraction: float


@dataclass(frozen=True, slots=True)
class Stamped(Generic[T]):
    """A progress record and the time it arrived."""

    time: float
    record: T
