"""RunRecorder: busy time over merged spans, timelines, metric series, JSONL files."""

from __future__ import annotations

import itertools
import json
import math
import random
import threading
from pathlib import Path

import pytest
from obs_support import FakeClock, step_metrics

from marlaas.obs.intervals import IntervalSet
from marlaas.obs.jsonl import read_jsonl
from marlaas.obs.memory import EVENTS_FILE, METRICS_FILE, SUMMARY_FILE, RunRecorder
from marlaas.obs.progress import (
    CheckpointWritten,
    EvalDone,
    StepDone,
    TenantEnded,
    TenantPaused,
    TenantQueued,
    TenantStarted,
    TenantUnpaused,
)
from marlaas.obs.recorder import Recorder
from marlaas.status import JobStatus

P = 10.0 / 6  # the sample run's step period


def test_is_a_recorder(recorder: RunRecorder) -> None:
    as_protocol: Recorder = recorder
    as_protocol.span("device", "x", recorder.origin, recorder.origin + 1)
    assert len(recorder.spans()) == 1


def test_overlapping_spans_of_a_stage_count_once(sample: RunRecorder) -> None:
    t0 = sample.origin
    assert sample.busy_time("device") == pytest.approx(6.0)
    assert sample.busy_fraction("device") == pytest.approx(0.6)
    assert sample.busy_time("env", tenant="alpha") == pytest.approx(6 * 0.75)
    assert sample.busy_time("env", tenant="beta") == 0.0
    assert sample.busy_time("rollout") == pytest.approx(6.0)
    # A window cutting through two steps: 0.1 P of step 0 and 0.5 P of step 1.
    assert sample.busy_time("device", t0 + 0.5 * P, t0 + 1.5 * P) == pytest.approx(0.6 * P)
    assert sample.busy_fraction("device", t0 + 0.5 * P, t0 + 1.5 * P) == pytest.approx(0.6)
    assert sample.busy_time("nonexistent") == 0.0
    assert sample.busy_fraction("device", t0 + 1, t0 + 1) == 0.0


def test_utilization_timeline_bins(sample: RunRecorder) -> None:
    t0 = sample.origin
    per_step = sample.utilization_timeline("device", bin_s=P)
    assert len(per_step) == 6
    assert [b.busy_fraction for b in per_step] == pytest.approx([0.6] * 6)
    fine = sample.utilization_timeline("device", bin_s=P / 5, start=t0, end=t0 + P)
    assert [b.busy_fraction for b in fine] == pytest.approx([1, 1, 1, 0, 0], abs=1e-9)
    coarse = sample.utilization_timeline("device", bin_s=3.0)
    assert [b.start - t0 for b in coarse] == pytest.approx([0, 3, 6, 9])
    assert coarse[-1].end - t0 == pytest.approx(10)
    total = sum(b.busy_fraction * (b.end - b.start) for b in coarse)
    assert total == pytest.approx(6.0)
    with pytest.raises(ValueError, match="bin_s"):
        sample.utilization_timeline("device", bin_s=0)
    with pytest.raises(ValueError, match="bins"):
        sample.utilization_timeline("device", bin_s=1e-9)


def test_metric_series_and_latest(sample: RunRecorder) -> None:
    series = sample.metric_series("alpha", "reward")
    assert [s for s, _ in series] == [1, 2, 3, 4, 5, 6]
    assert series[-1][1] == pytest.approx(0.5)
    assert sample.metric_series("beta", "eval_accuracy") == []
    sample.metrics("beta", 2, {"reward": -1.0})  # a repeated step replaces its value
    sample.metrics("beta", 1, {"loss": 3.0})  # late and out of order
    assert dict(sample.metric_series("beta", "reward"))[2] == -1.0
    assert sample.latest_metrics("beta") == {"reward": pytest.approx(0.45), "loss": 3.0}
    assert sample.last_step("beta") == 6
    assert sample.last_step("nobody") is None
    assert sample.tenants() == ["alpha", "beta"]
    assert sample.status("alpha") == "finished"
    assert sample.status("beta") == "admitted"
    assert sample.stages() == ["device", "rollout", "env"]


def test_bad_spans_are_rejected(recorder: RunRecorder) -> None:
    with pytest.raises(ValueError, match="before start"):
        recorder.span("device", "x", 2.0, 1.0)
    with pytest.raises(ValueError):
        recorder.span("device", "x", 1.0, math.nan)


def test_wall_clock_mapping(recorder: RunRecorder) -> None:
    assert recorder.to_wall(recorder.origin) == 1_700_000_000.0
    assert recorder.to_wall(recorder.origin + 2.5) == pytest.approx(1_700_000_002.5)


def test_summary(sample: RunRecorder) -> None:
    summary = sample.summary()
    assert summary["elapsed_s"] == pytest.approx(10.0)
    assert summary["device_utilization"] == pytest.approx(0.6)
    stages = summary["stages"]
    assert isinstance(stages, dict)
    assert stages["device"] == {"spans": 12, "busy_s": pytest.approx(6.0), "busy_fraction": 0.6}
    tenants = summary["tenants"]
    assert isinstance(tenants, dict)
    assert tenants["alpha"]["step"] == 6
    assert tenants["alpha"]["status"] == "finished"
    assert tenants["alpha"]["busy_s"] == {"env": pytest.approx(4.5)}
    assert tenants["beta"]["metrics"] == {"reward": pytest.approx(0.45)}
    assert summary["events"] == {"admitted": 2, "finished": 1}
    json.dumps(summary)


def test_jsonl_lines_are_on_disk_as_they_arrive(clock, out_dir: Path) -> None:
    rec = RunRecorder(out_dir, clock=clock, wall_clock=lambda: 1000.0)
    clock.t += 1.5
    rec.metrics("alpha", 1, {"reward": 0.5, "loss": math.nan})
    rec.event("admitted", tenant="alpha", path=Path("/x"), sizes=(1, 2))
    # Not closed yet: the lines are already readable.
    (metric,) = read_jsonl(out_dir / METRICS_FILE)
    assert metric == {
        "time": 1001.5,
        "elapsed_s": 1.5,
        "tenant": "alpha",
        "step": 1,
        "values": {"reward": 0.5, "loss": None},
    }
    (event,) = read_jsonl(out_dir / EVENTS_FILE)
    assert event["name"] == "admitted"
    assert event["fields"] == {"path": "/x", "sizes": [1, 2]}
    clock.t += 5
    rec.close()
    clock.t += 100
    assert rec.now() == rec.origin + 6.5  # the clock stopped at close
    rec.metrics("alpha", 2, {"reward": 1.0})  # after close: memory only
    assert len(read_jsonl(out_dir / METRICS_FILE)) == 1
    summary = json.loads((out_dir / SUMMARY_FILE).read_text())
    assert summary["tenants"]["alpha"]["step"] == 1
    rec.close()  # idempotent


def test_read_jsonl_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b"')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)


def test_concurrent_reports(tmp_path: Path) -> None:
    rec = RunRecorder(tmp_path)
    t0 = rec.origin

    def device() -> None:
        for i in range(500):
            rec.span("device", "decode", t0 + i, t0 + i + 0.5)

    def loop(tenant: str) -> None:
        for i in range(200):
            rec.metrics(tenant, i, {"reward": i})
            rec.event("step", tenant=tenant, step=i)
            rec.busy_fraction("device")

    threads = [threading.Thread(target=device)]
    threads += [threading.Thread(target=loop, args=(f"t{k}",)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.close()
    assert rec.busy_time("device", t0, t0 + 500) == pytest.approx(250.0)
    assert len(rec.metric_points()) == 600
    assert len(read_jsonl(tmp_path / METRICS_FILE)) == 600
    assert len(read_jsonl(tmp_path / EVENTS_FILE)) == 600


def test_interval_set_matches_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(200):
        busy = IntervalSet()
        spans = []
        for _ in range(rng.randint(0, 12)):
            a = rng.randint(0, 40) / 2
            b = a + rng.randint(0, 10) / 2
            spans.append((a, b))
            busy.add(a, b)
        lo, hi = sorted(rng.randint(-2, 50) / 2 for _ in range(2))
        # Brute force on a half-unit grid, where every endpoint lies.
        cells = sum(
            1 for k in range(-4, 100) if lo <= k / 2 < hi and any(a <= k / 2 < b for a, b in spans)
        )
        assert busy.measure(lo, hi) == pytest.approx(cells / 2)
        assert busy.total() == pytest.approx(busy.measure(-1e9, 1e9))
        merged = busy.intervals()
        assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(merged))


def test_progress_records_answer_typed_queries_and_are_logged(
    clock: FakeClock, tmp_path: Path
) -> None:
    rec = RunRecorder(tmp_path / "run", clock=clock, wall_clock=lambda: 1_700_000_000.0)
    rec.progress(TenantQueued("alpha", 3, priority=2.0))
    rec.progress(TenantStarted("alpha"))
    rec.progress(EvalDone("alpha", 0, 0.25))
    clock.t += 1.0
    rec.progress(StepDone("alpha", 1, step_metrics(0.5, loss=2.0)))
    rec.progress(TenantPaused("alpha", admitted=True))
    assert rec.job_status("alpha") == "paused" and rec.status("alpha") == "paused"
    rec.progress(TenantUnpaused("alpha", admitted=True))
    rec.progress(CheckpointWritten("alpha", 1, tmp_path / "c", tmp_path / "c" / "adapter"))
    rec.progress(TenantEnded("alpha", JobStatus.DONE, None))
    rec.close()
    assert [(s, m.reward_mean) for s, m in rec.steps("alpha")] == [(1, 0.5)]
    assert rec.evals("alpha") == [(0, 0.25)]
    assert rec.total_steps("alpha") == 3 and rec.job_status("alpha") == "done"
    assert rec.status("alpha") == "done"  # a checkpoint is not a status
    (started,) = rec.progress_records(TenantStarted, tenant="alpha")
    (ended,) = rec.progress_records(TenantEnded)
    assert ended.time - started.time == pytest.approx(1.0)
    assert rec.progress_records(TenantStarted, tenant="beta") == []
    # Figures join the metric series and metrics.jsonl under their public names.
    assert rec.metric_series("alpha", "reward_mean") == [(1, 0.5)]
    assert rec.metric_series("alpha", "eval_accuracy") == [(0, 0.25)]
    lines = read_jsonl(tmp_path / "run" / METRICS_FILE)
    assert [(line["step"], line["values"]["loss"]) for line in lines[1:]] == [(1, 2.0)]
    names = [e["name"] for e in read_jsonl(tmp_path / "run" / EVENTS_FILE)]
    assert names == [
        "tenant_queued",
        "tenant_admitted",
        "tenant_paused",
        "tenant_unpaused",
        "checkpoint",
        "tenant_done",
    ]
    assert (
        json.loads((tmp_path / "run" / SUMMARY_FILE).read_text())["tenants"]["alpha"]["status"]
        == "done"
    )
