"""All of obs around one small asynchronous run: a device thread and event-loop tasks
report at once while the live view logs; then the JSONL files, trace, plots, summary."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from pathlib import Path

import pytest
from obs_support import step_metrics
from rich.console import Console

from marlaas.obs import RunRecorder, write_trace
from marlaas.obs.jsonl import read_jsonl
from marlaas.obs.live import LiveView
from marlaas.obs.memory import EVENTS_FILE, METRICS_FILE, SUMMARY_FILE
from marlaas.obs.plots import write_plots
from marlaas.obs.progress import StepDone, TenantQueued

STEPS = 4


async def _tenant(rec: RunRecorder, tenant: str, work_s: float) -> None:
    rec.progress(TenantQueued(tenant, STEPS))
    for step in range(1, STEPS + 1):
        start = time.perf_counter()
        await asyncio.sleep(work_s)
        rec.span("env", "episode", start, time.perf_counter(), tenant=tenant)
        rec.progress(StepDone(tenant, step, step_metrics(step / STEPS)))
    rec.event("finished", tenant=tenant)


def _device(rec: RunRecorder, stop: threading.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        time.sleep(0.004)
        rec.span("device", "decode", start, time.perf_counter())
        time.sleep(0.002)


async def test_a_run_end_to_end(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    stop = threading.Event()
    with RunRecorder(tmp_path / "run") as rec:
        device = threading.Thread(target=_device, args=(rec, stop))
        device.start()
        async with LiveView(rec, console=console, log_every_s=0.05):
            await asyncio.gather(_tenant(rec, "alpha", 0.02), _tenant(rec, "beta", 0.035))
        stop.set()
        device.join()
    # Closed: the clock has stopped, so exporting takes no share of the utilization.
    trace = write_trace(rec, tmp_path / "run" / "trace.json")
    plots = write_plots(rec, tmp_path / "run")

    assert "alpha 4/4" in out.getvalue().splitlines()[-1]
    assert len(read_jsonl(tmp_path / "run" / METRICS_FILE)) == 2 * STEPS
    assert [e["name"] for e in read_jsonl(tmp_path / "run" / EVENTS_FILE)].count("finished") == 2
    summary = json.loads((tmp_path / "run" / SUMMARY_FILE).read_text())
    device_s = sum(s.duration for s in rec.spans("device"))  # back to back, never overlapping
    assert summary["stages"]["device"]["busy_s"] == pytest.approx(device_s)
    assert 0.0 < summary["device_utilization"] < 1.0
    assert summary["tenants"]["beta"]["step"] == STEPS
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" and e["cat"] == "env" for e in events) == 2 * STEPS
    assert all(p.stat().st_size > 10_000 for p in plots)
