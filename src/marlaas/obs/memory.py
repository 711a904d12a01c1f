"""`RunRecorder`: the in-memory `Recorder` of one run, with optional JSONL files.

- One lock guards all state (the device thread and the event loop both report);
  queries copy under the lock and filter outside it; busy-time queries run under it,
  at O(log n) each (see `intervals`).
- Times are `time.perf_counter()` seconds in memory and in queries; the perf counter
  and the wall clock are read once, at construction, and `to_wall` maps one to the
  other with that single offset, so wall times never jump with the system clock.
- Progress records (`obs.progress`) are kept as they came, with their arrival time, and
  answer the typed queries (`steps`, `evals`, `job_status`, `total_steps`); a step's
  and an eval's figures also join the metric series under their `as_dict` names, and
  every other record is also an event named by its `event`.
- With a run directory, each step, eval and metrics call and each event becomes one
  flushed line of `metrics.jsonl` / `events.jsonl` (see `jsonl`). Spans stay in memory (there may be
  many per second); `marlaas.obs.trace.write_trace` exports them.
- A stage's busy time is the length of the union of its spans.
- `close()` stops the recorder's clock, so summaries made later are not diluted.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from marlaas.fileio import atomic_write_text, to_jsonable
from marlaas.obs.intervals import IntervalSet
from marlaas.obs.jsonl import JsonlWriter
from marlaas.obs.progress import (
    EvalDone,
    Progress,
    StepDone,
    StepMetrics,
    TenantQueued,
    status_after,
)
from marlaas.obs.recorder import STAGES
from marlaas.obs.records import Event, MetricPoint, Span, Stamped, UtilizationBin
from marlaas.obs.summary import summarize
from marlaas.status import JobStatus

__all__ = ["Event", "MetricPoint", "RunRecorder", "Span", "Stamped", "UtilizationBin"]

R = TypeVar("R", bound=Progress)

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
SUMMARY_FILE = "summary.json"
#: Refuse timelines with more bins than this (a bin size given in the wrong unit).
MAX_BINS = 100_000


class RunRecorder:
    """Keeps spans, metrics and events of one run in memory and answers queries on them.

    Lifecycle: construct (opening the JSONL files when `run_dir` is given), pass it to
    the pipeline as its `Recorder`, query it at any time, `close()` it (or use it as a
    context manager) to close the files and write `summary.json`.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self.origin = clock()
        self.wall_origin = wall_clock()
        self.run_dir = None if run_dir is None else Path(run_dir)
        self._lock = threading.Lock()
        self._closed_at: float | None = None
        self._spans: list[Span] = []
        self._metrics: list[MetricPoint] = []
        self._events: list[Event] = []
        self._busy: dict[tuple[str, str | None], IntervalSet] = {}
        self._span_counts: Counter[str] = Counter()
        self._tenants: dict[str, None] = {}
        self._series: dict[str, dict[str, dict[int, float]]] = {}
        self._status: dict[str, str] = {}
        self._progress: list[Stamped[Progress]] = []
        self._steps: dict[str, dict[int, StepMetrics]] = {}
        self._evals: dict[str, dict[int, float]] = {}
        self._job_status: dict[str, JobStatus] = {}
        self._total_steps: dict[str, int] = {}
        self._metrics_file: JsonlWriter | None = None
        self._events_file: JsonlWriter | None = None
        if self.run_dir is not None:
            self._metrics_file = JsonlWriter(self.run_dir / METRICS_FILE)
            self._events_file = JsonlWriter(self.run_dir / EVENTS_FILE)

    # -- time -------------------------------------------------------------------

    def to_wall(self, t: float) -> float:
        """Wall-clock (Unix) seconds of perf_counter time `t`."""
        return self.wall_origin + (t - self.origin)

    def now(self) -> float:
        """The current perf_counter time, or the close time once closed."""
        closed = self._closed_at
        return self._clock() if closed is None else closed

    # -- the Recorder protocol --------------------------------------------------------

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
        if not end >= start:  # also catches NaN
            raise ValueError(f"span {stage}/{name}: end {end} is before start {start}")
        record = Span(stage, name, start, end, tenant, dict(args) if args else {})
        with self._lock:
            self._spans.append(record)
            self._span_counts[stage] += 1
            self._busy_set(stage, None).add(start, end)
            if tenant is not None:
                self._tenants.setdefault(tenant, None)
                self._busy_set(stage, tenant).add(start, end)

    def metrics(self, tenant: str, step: int, values: Mapping[str, float]) -> None:
        now = self._clock()
        point = MetricPoint(tenant, int(step), now, {k: float(v) for k, v in values.items()})
        with self._lock:
            self._metrics.append(point)
            self._tenants.setdefault(tenant, None)
            series = self._series.setdefault(tenant, {})
            for key, value in point.values.items():
                series.setdefault(key, {})[point.step] = value
        if self._metrics_file is not None:
            self._metrics_file.write(
                self._line(now, tenant=tenant, step=point.step, values=point.values)
            )

    def event(self, name: str, *, tenant: str | None = None, **fields: object) -> None:
        self._event(name, tenant, fields, status=name)

    def _event(
        self, name: str, tenant: str | None, fields: Mapping[str, object], status: str | None
    ) -> None:
        """Keep and log an event; `status`: the tenant's status word from now on (None:
        unchanged)."""
        now = self._clock()
        with self._lock:
            self._events.append(Event(name, now, tenant, dict(fields)))
            if tenant is not None:
                self._tenants.setdefault(tenant, None)
                if status is not None:
                    self._status[tenant] = status
        if self._events_file is not None:
            self._events_file.write(self._line(now, name=name, tenant=tenant, fields=fields))

    def progress(self, record: Progress) -> None:
        tenant = record.tenant
        with self._lock:
            self._progress.append(Stamped(self._clock(), record))
            self._tenants.setdefault(tenant, None)
            if isinstance(record, StepDone):
                self._steps.setdefault(tenant, {})[record.step] = record.metrics
            elif isinstance(record, EvalDone):
                self._evals.setdefault(tenant, {})[record.version] = record.accuracy
            status = status_after(record, self._job_status.get(tenant))
            if status is not None:
                self._job_status[tenant] = status
            if isinstance(record, TenantQueued):
                self._total_steps[tenant] = record.total_steps
        if isinstance(record, StepDone):
            self.metrics(tenant, record.step, record.metrics.as_dict())
        elif isinstance(record, EvalDone):
            self.metrics(tenant, record.version, record.as_dict())
        else:  # the summary's status is the state's word, not the event's name
            word = None if status is None else str(status)
            self._event(record.event, tenant, record.log_fields(), status=word)

    # -- lifecycle ----------------------------------------------------------------

    def close(self) -> None:
        """Stop the clock, close the JSONL files and write `summary.json`. Idempotent."""
        with self._lock:
            if self._closed_at is not None:
                return
            self._closed_at = self._clock()
        for f in (self._metrics_file, self._events_file):
            if f is not None:
                f.close()  # later writes are dropped by the writer itself
        if self.run_dir is not None:
            text = json.dumps(to_jsonable(self.summary()), indent=2) + "\n"
            atomic_write_text(self.run_dir / SUMMARY_FILE, text)

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- queries ------------------------------------------------------------------

    def spans(self, stage: str | None = None, tenant: str | None = None) -> list[Span]:
        """Recorded spans in arrival order, optionally of one stage and/or one tenant."""
        with self._lock:
            spans = list(self._spans)
        spans = [s for s in spans if stage is None or s.stage == stage]
        return [s for s in spans if tenant is None or s.tenant == tenant]

    def events(self, name: str | None = None, tenant: str | None = None) -> list[Event]:
        """Recorded events in arrival order, optionally of one name and/or one tenant."""
        with self._lock:
            events = list(self._events)
        events = [e for e in events if name is None or e.name == name]
        return [e for e in events if tenant is None or e.tenant == tenant]

    def metric_points(self, tenant: str | None = None) -> list[MetricPoint]:
        """Every `metrics` call in arrival order, optionally of one tenant."""
        with self._lock:
            points = list(self._metrics)
        return [p for p in points if tenant is None or p.tenant == tenant]

    def tenants(self) -> list[str]:
        """Every tenant seen in a span, metric or event, in first-seen order."""
        with self._lock:
            return list(self._tenants)

    def stages(self) -> list[str]:
        """Stages that have spans: those of `STAGES` in that order, then others as seen."""
        with self._lock:
            seen = list(self._span_counts)
        return [s for s in STAGES if s in seen] + [s for s in seen if s not in STAGES]

    def metric_series(self, tenant: str, key: str) -> list[tuple[int, float]]:
        """`(step, value)` of one metric of one tenant, by step; a repeated step keeps
        the last value reported."""
        with self._lock:
            series = dict(self._series.get(tenant, {}).get(key, {}))
        return sorted(series.items())

    def latest_metrics(self, tenant: str) -> dict[str, float]:
        """Each metric's value at the highest step it was reported for."""
        with self._lock:
            series = {k: dict(v) for k, v in self._series.get(tenant, {}).items()}
        return {key: by_step[max(by_step)] for key, by_step in series.items()}

    def last_step(self, tenant: str) -> int | None:
        """The highest step of any metric of `tenant`, None before the first."""
        with self._lock:
            steps = [max(by_step) for by_step in self._series.get(tenant, {}).values()]
        return max(steps) if steps else None

    def status(self, tenant: str) -> str | None:
        """The tenant's status word from its latest state record, else the name of its
        latest free-form event; None before either."""
        with self._lock:
            return self._status.get(tenant)

    def progress_records(
        self, kind: type[R] | tuple[type[R], ...], tenant: str | None = None
    ) -> list[Stamped[R]]:
        """Progress records of `kind` (optionally of one tenant), in arrival order, with
        the time each arrived."""
        with self._lock:
            records = list(self._progress)
        return [
            s  # type: ignore[misc]
            for s in records
            if isinstance(s.record, kind) and (tenant is None or s.record.tenant == tenant)
        ]

    def steps(self, tenant: str) -> list[tuple[int, StepMetrics]]:
        """`(step, figures)` of the tenant's optimizer steps, by step (a repeated step,
        trained again after a restore, keeps its latest figures)."""
        with self._lock:
            steps = dict(self._steps.get(tenant, {}))
        return sorted(steps.items())

    def evals(self, tenant: str) -> list[tuple[int, float]]:
        """`(adapter version, accuracy)` of the tenant's evals, by version."""
        with self._lock:
            evals = dict(self._evals.get(tenant, {}))
        return sorted(evals.items())

    def job_status(self, tenant: str) -> JobStatus | None:
        """The tenant's status from its progress records; None before the first."""
        with self._lock:
            return self._job_status.get(tenant)

    def total_steps(self, tenant: str) -> int | None:
        """The tenant's number of steps, from its `TenantQueued` record."""
        with self._lock:
            return self._total_steps.get(tenant)

    def busy_time(
        self,
        stage: str,
        start: float | None = None,
        end: float | None = None,
        *,
        tenant: str | None = None,
    ) -> float:
        """Seconds inside `[start, end)` (default: construction to now) during which at
        least one span of `stage` (of `tenant`, when given) was running."""
        lo, hi = self._interval(start, end)
        with self._lock:  # O(log n): cheap enough to hold the lock for
            busy = self._busy.get((stage, tenant))
            return 0.0 if busy is None else busy.measure(lo, hi)

    def busy_fraction(
        self,
        stage: str,
        start: float | None = None,
        end: float | None = None,
        *,
        tenant: str | None = None,
    ) -> float:
        """`busy_time` divided by the interval's length (0.0 for an empty interval)."""
        lo, hi = self._interval(start, end)
        if hi <= lo:
            return 0.0
        return self.busy_time(stage, lo, hi, tenant=tenant) / (hi - lo)

    def utilization_timeline(
        self,
        stage: str = "device",
        bin_s: float = 1.0,
        start: float | None = None,
        end: float | None = None,
    ) -> list[UtilizationBin]:
        """The busy fraction of `stage` in consecutive bins of `bin_s` seconds covering
        `[start, end)`; the last bin may be shorter, and its fraction is of its own length."""
        if not bin_s > 0:
            raise ValueError(f"bin_s must be > 0 seconds, got {bin_s}")
        lo, hi = self._interval(start, end)
        if hi <= lo:
            return []
        n = math.ceil((hi - lo) / bin_s)
        if n > MAX_BINS:
            raise ValueError(f"{n} bins of {bin_s} s; use bin_s >= {(hi - lo) / MAX_BINS:.3g}")
        edges = [lo + i * bin_s for i in range(n)] + [hi]
        with self._lock:
            busy = self._busy.get((stage, None))
            busy = IntervalSet() if busy is None else busy
            return [
                UtilizationBin(a, b, busy.measure(a, b) / (b - a))
                for a, b in itertools.pairwise(edges)
                if b > a
            ]

    def span_counts(self) -> dict[str, int]:
        """The number of spans of each stage."""
        with self._lock:
            return dict(self._span_counts)

    def summary(self) -> dict[str, object]:
        """A JSON-ready overview of the run; see `marlaas.obs.summary`."""
        return summarize(self)

    # -- internals ----------------------------------------------------------------

    def _busy_set(self, stage: str, tenant: str | None) -> IntervalSet:
        key = (stage, tenant)
        busy = self._busy.get(key)
        if busy is None:
            busy = self._busy[key] = IntervalSet()
        return busy

    def _interval(self, start: float | None, end: float | None) -> tuple[float, float]:
        return (self.origin if start is None else start, self.now() if end is None else end)

    def _line(self, now: float, **payload: object) -> dict[str, object]:
        return {"time": self.to_wall(now), "elapsed_s": now - self.origin, **payload}
