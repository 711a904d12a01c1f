"""The end-of-run overview of a `RunRecorder`, as a JSON-ready dict.

Keys: `started_at` (Unix seconds), `elapsed_s`, `device_utilization` (busy fraction),
`stages` (per stage: span count, busy seconds, busy fraction), `tenants` (per tenant:
last step, status, latest metrics, busy seconds per stage among the spans that name
the tenant) and `events` (count per event name). Every figure covers the recorder's
origin to its `now()`, which stops at `close()`.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from marlaas.obs.memory import RunRecorder


def summarize(recorder: RunRecorder) -> dict[str, object]:
    lo, hi = recorder.origin, recorder.now()
    counts = recorder.span_counts()
    stages = recorder.stages()
    stage_rows = {
        stage: {
            "spans": counts.get(stage, 0),
            "busy_s": recorder.busy_time(stage, lo, hi),
            "busy_fraction": recorder.busy_fraction(stage, lo, hi),
        }
        for stage in stages
    }
    tenant_rows: dict[str, object] = {}
    for tenant in recorder.tenants():
        busy = {stage: recorder.busy_time(stage, lo, hi, tenant=tenant) for stage in stages}
        tenant_rows[tenant] = {
            "step": recorder.last_step(tenant),
            "status": recorder.status(tenant),
            "metrics": recorder.latest_metrics(tenant),
            "busy_s": {stage: seconds for stage, seconds in busy.items() if seconds > 0},
        }
    return {
        "started_at": recorder.wall_origin,
        "elapsed_s": hi - lo,
        "device_utilization": recorder.busy_fraction("device", lo, hi),
        "stages": stage_rows,
        "tenants": tenant_rows,
        "events": dict(Counter(e.name for e in recorder.events())),
    }
