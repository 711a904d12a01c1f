"""Export a run as Chrome trace-event JSON, for ui.perfetto.dev or chrome://tracing.

Layout of the trace:

- one process per stage (in `STAGES` order), and in it one thread ("lane") per tenant,
  plus one lane named after the stage for spans without a tenant. Complete ("X")
  events on one thread must not partly overlap, so spans that overlap inside a lane
  (concurrent episodes of one tenant, say) are spread over extra lanes "tenant #2",
  "tenant #3", ... chosen first-fit, which uses as many lanes as spans run at once;
- a process "events" with one lane per tenant (and "run") holding lifecycle events as
  instant ("i") events;
- a process "metrics" with one counter ("C") track per tenant and metric, drawn
  against the time each `metrics` call arrived.

Timestamps are microseconds since the recorder's origin (its construction, or the
earliest span if one started before it); the wall-clock time of that origin is in
`otherData`. Metadata ("M") events name and order every process and thread.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

from marlaas.fileio import atomic_write_text, to_jsonable
from marlaas.obs.memory import RunRecorder
from marlaas.obs.records import Span

TraceEvent = dict[str, object]
_US = 1e6


class _Trace:
    """Trace events under construction: metadata first, the rest sorted by time."""

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.meta: list[TraceEvent] = []
        self.body: list[tuple[float, TraceEvent]] = []
        self._pids = 0

    def us(self, t: float) -> float:
        return (t - self.origin) * _US

    def process(self, name: str) -> int:
        self._pids += 1
        pid = self._pids
        self.meta.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        self.meta.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
        )
        return pid

    def thread(self, pid: int, tid: int, name: str) -> None:
        self.meta.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
        )
        self.meta.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )

    def add(self, t: float, event: TraceEvent) -> None:
        ts = self.us(t)
        self.body.append((ts, {**event, "ts": ts}))

    def events(self) -> list[TraceEvent]:
        return self.meta + [event for _, event in sorted(self.body, key=lambda item: item[0])]


def _pack(spans: list[Span]) -> list[list[Span]]:
    """Spread spans over as few lanes as possible so that none overlap within a lane."""
    lanes: list[list[Span]] = []
    lane_ends: list[float] = []
    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        for i, lane_end in enumerate(lane_ends):
            if lane_end <= span.start:
                lanes[i].append(span)
                lane_ends[i] = span.end
                break
        else:
            lanes.append([span])
            lane_ends.append(span.end)
    return lanes


def _add_spans(trace: _Trace, recorder: RunRecorder, spans: list[Span]) -> None:
    by_stage: dict[str, dict[str | None, list[Span]]] = defaultdict(lambda: defaultdict(list))
    for span in spans:
        by_stage[span.stage][span.tenant].append(span)
    order = {tenant: i for i, tenant in enumerate(recorder.tenants())}
    for stage in recorder.stages():
        pid = trace.process(stage)
        lanes = by_stage[stage]
        # The tenant-less lane first, then tenants in first-seen order.
        keys = sorted(lanes, key=lambda t: -1 if t is None else order.get(t, len(order)))
        tid = 0
        for tenant in keys:
            for i, lane in enumerate(_pack(lanes[tenant])):
                tid += 1
                label = stage if tenant is None else tenant
                trace.thread(pid, tid, label if i == 0 else f"{label} #{i + 1}")
                for span in lane:
                    args = dict(span.args)
                    if span.tenant is not None:
                        args.setdefault("tenant", span.tenant)
                    event = {"ph": "X", "name": span.name, "cat": stage, "pid": pid, "tid": tid}
                    trace.add(span.start, {**event, "dur": span.duration * _US, "args": args})


def _add_events(trace: _Trace, recorder: RunRecorder) -> None:
    events = recorder.events()
    if not events:
        return
    pid = trace.process("events")
    tids: dict[str | None, int] = {}
    for event in events:
        if event.tenant not in tids:
            tids[event.tenant] = len(tids) + 1
            trace.thread(pid, tids[event.tenant], event.tenant or "run")
        instant = {"ph": "i", "s": "t", "name": event.name, "cat": "event", "pid": pid}
        args = {**event.fields, "tenant": event.tenant}
        trace.add(event.time, {**instant, "tid": tids[event.tenant], "args": args})


def _add_metrics(trace: _Trace, recorder: RunRecorder) -> None:
    points = recorder.metric_points()
    if not points:
        return
    pid = trace.process("metrics")
    for point in points:
        for key, value in point.values.items():
            if math.isfinite(value):
                counter = {"ph": "C", "name": f"{point.tenant} {key}", "pid": pid}
                trace.add(point.time, {**counter, "args": {key: value}})


def trace_events(recorder: RunRecorder, *, origin: float | None = None) -> list[TraceEvent]:
    """The run's spans, events and metrics as trace events, metadata first.

    `origin` (perf_counter seconds) is time zero of the trace; by default the earlier
    of the recorder's origin and its first span.
    """
    spans = recorder.spans()
    trace = _Trace(_default_origin(recorder, spans) if origin is None else origin)
    _add_spans(trace, recorder, spans)
    _add_events(trace, recorder)
    _add_metrics(trace, recorder)
    return trace.events()


def _default_origin(recorder: RunRecorder, spans: list[Span]) -> float:
    return min([recorder.origin, *(s.start for s in spans)])


def trace_document(recorder: RunRecorder) -> dict[str, object]:
    """The complete trace JSON object: `traceEvents` plus the wall-clock origin."""
    origin = _default_origin(recorder, recorder.spans())
    wall = recorder.to_wall(origin)
    return {
        "traceEvents": trace_events(recorder, origin=origin),
        "displayTimeUnit": "ms",
        "otherData": {
            "origin_unix_s": wall,
            "origin_utc": datetime.fromtimestamp(wall, UTC).isoformat(),
        },
    }


def write_trace(recorder: RunRecorder, path: str | os.PathLike[str]) -> Path:
    """Write the trace JSON to `path` atomically (temporary file, then rename)."""
    text = json.dumps(to_jsonable(trace_document(recorder)), separators=(",", ":"))
    return atomic_write_text(Path(path), text)
