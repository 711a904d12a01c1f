"""Trace export: valid Chrome trace JSON whose events match the recorded spans."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from marlaas.obs.memory import RunRecorder
from marlaas.obs.trace import trace_events, write_trace


def _load(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict)
    return doc


def _events(recorder: RunRecorder) -> list[dict[str, Any]]:
    """The trace events as JSON would give them back."""
    events: list[dict[str, Any]] = json.loads(json.dumps(trace_events(recorder)))
    return events


def test_complete_events_match_spans(sample: RunRecorder, tmp_path: Path) -> None:
    path = write_trace(sample, tmp_path / "out" / "trace.json")
    assert path == tmp_path / "out" / "trace.json"
    assert [p.name for p in path.parent.iterdir()] == ["trace.json"]  # no temp file left
    doc = _load(path)
    assert doc["otherData"]["origin_unix_s"] == 1_700_000_000.0
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    spans = sample.spans()
    assert len(complete) == len(spans)
    got = sorted((e["cat"], e["name"], e["ts"], e["dur"]) for e in complete)
    want = sorted(
        (s.stage, s.name, (s.start - sample.origin) * 1e6, s.duration * 1e6) for s in spans
    )
    for g, w in zip(got, want, strict=True):
        assert g[:2] == w[:2]
        assert g[2:] == pytest.approx(w[2:])
    episode = next(e for e in complete if e["name"] == "episode")
    assert episode["args"] == {"version": 0, "tenant": "beta"}


def test_metadata_names_every_process_and_lane(sample: RunRecorder) -> None:
    events = _events(sample)
    process_names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert sorted(process_names.values()) == sorted(
        ["device", "rollout", "env", "events", "metrics"]
    )
    thread_names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    for e in events:
        if e["ph"] in ("X", "i"):
            assert (e["pid"], e["tid"]) in thread_names
    by_process = defaultdict(set)
    for (pid, _), name in thread_names.items():
        by_process[process_names[pid]].add(name)
    assert by_process["device"] == {"device", "device #2"}  # decode and train overlap
    assert by_process["env"] == {"alpha", "alpha #2"}
    assert by_process["rollout"] == {"beta"}
    assert by_process["events"] == {"alpha", "beta"}
    assert all(e["ph"] == "M" for e in events[: len(process_names) * 2])


def test_lanes_never_overlap(sample: RunRecorder) -> None:
    lanes = defaultdict(list)
    for e in _events(sample):
        if e["ph"] == "X":
            lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for intervals in lanes.values():
        intervals.sort()
        assert all(b[0] >= a[1] - 1e-6 for a, b in itertools.pairwise(intervals))


def test_instant_and_counter_events(sample: RunRecorder) -> None:
    events = _events(sample)
    instants = [e for e in events if e["ph"] == "i"]
    assert [e["name"] for e in instants] == ["admitted", "admitted", "finished"]
    assert instants[0]["args"] == {"total_steps": 6, "tenant": "alpha"}
    assert instants[-1]["ts"] == pytest.approx(10e6)
    counters = [e for e in events if e["ph"] == "C" and e["name"] == "alpha reward"]
    assert len(counters) == 6
    body = [e["ts"] for e in events if e["ph"] != "M"]
    assert body == sorted(body)


def test_spans_before_the_origin_shift_time_zero(recorder: RunRecorder, tmp_path: Path) -> None:
    recorder.span("device", "early", recorder.origin - 2.0, recorder.origin - 1.0)
    recorder.event("nan", value=float("nan"), obj=object())
    doc = _load(write_trace(recorder, tmp_path / "t.json"))
    (span,) = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert span["ts"] == 0.0
    assert doc["otherData"]["origin_unix_s"] == 1_700_000_000.0 - 2.0
    (event,) = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert event["ts"] == pytest.approx(2e6)
    assert event["args"]["value"] is None
