"""`GET /v1/usage/device`: how busy the shared accelerator has been, as a time series,
next to the caller's own training steps over the same bins.

The device figure comes from a `DeviceUsageProvider` (see `marlaas.service.usage`); when
none is attached the answer says so in `device_note` and `device` is empty, while
`steps` (what the service itself knows, from the reported metrics) is always there.
The device is shared, so its busy fraction is the same for every tenant and reveals no
other tenant's jobs; `steps` only counts the caller's own.
"""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import Field
from sqlalchemy import func, select

from marlaas.service.api.deps import AUTH_ERRORS, Context, TenantCaller, tenant_id
from marlaas.service.context import ServiceContext
from marlaas.service.models import Job, Metric, utcnow
from marlaas.service.schemas import Wire
from marlaas.service.usage import BusyBin, provider_of

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/usage", tags=["tenant"])

#: Most bins one answer holds; a longer window needs wider bins.
MAX_BINS = 2000


class DevicePoint(Wire):
    time: datetime = Field(..., description="Start of the bin (UTC).")
    seconds: float = Field(..., description="Length of the bin.")
    busy: float = Field(..., description="Fraction of the bin the device computed, 0..1.")


class StepsPoint(Wire):
    time: datetime = Field(..., description="Start of the bin (UTC).")
    seconds: float = Field(..., description="Length of the bin.")
    steps: int = Field(..., description="Optimizer steps your jobs finished in the bin.")


class DeviceUsageOut(Wire):
    window_s: float
    bin_s: float = Field(
        ...,
        description="The bin width used (wider than asked when the "
        "window would need more than 2000 bins).",
    )
    source: str | None = Field(
        ..., description="What reported the device figures; None: nothing does yet."
    )
    device: list[DevicePoint] = Field(..., description="Device busy fraction, oldest first.")
    device_note: str | None = Field(
        None, description="Why `device` is empty, when it is; None otherwise."
    )
    steps: list[StepsPoint] = Field(
        ..., description="Your jobs' finished optimizer steps per bin, oldest first."
    )


def _device(
    ctx: ServiceContext, window_s: float, bin_s: float
) -> tuple[str | None, list[DevicePoint], str | None]:
    provider = provider_of(ctx.device_usage, ctx.backend)
    if provider is None:
        why = (
            "no job backend is attached"
            if ctx.backend is None
            else f"the job backend ({type(ctx.backend).__name__}) does not report it"
        )
        return None, [], f"device utilization is not available: {why}"
    source = type(provider).__name__
    try:
        bins: list[BusyBin] = list(provider.device_utilization(window_s, bin_s))
    except Exception as e:  # a broken figure must not take the dashboard down
        log.exception("device usage provider %s failed", source)
        return source, [], f"device utilization could not be read: {e}"
    points = [
        DevicePoint(time=b.start, seconds=b.seconds, busy=min(1.0, max(0.0, b.busy)))
        for b in bins
        if math.isfinite(b.busy) and b.seconds > 0
    ]
    note = None if points else "no device work recorded in this window yet"
    return source, points, note


def _steps(ctx: ServiceContext, tenant: str, window_s: float, bin_s: float) -> list[StepsPoint]:
    """Bins aligned to multiples of `bin_s` (so that successive answers line up), the
    last one ending now; a step counts in the bin where its first metric arrived."""
    now = utcnow()
    epoch = now.timestamp()
    first = math.floor((epoch - window_s) / bin_s) * bin_s
    n = max(1, math.ceil((epoch - first) / bin_s))
    since = datetime.fromtimestamp(first, UTC)
    with ctx.db.transaction() as session:
        rows = session.execute(
            select(func.min(Metric.time))
            .join(Job, Job.id == Metric.job_id)
            .where(Job.tenant_id == tenant, Metric.time >= since)
            .group_by(Metric.job_id, Metric.step)
        ).all()
    counts = [0] * n
    for (time,) in rows:
        i = int((time.timestamp() - first) // bin_s)
        counts[min(max(i, 0), n - 1)] += 1
    return [
        StepsPoint(
            time=since + timedelta(seconds=i * bin_s),
            seconds=min(bin_s, epoch - (first + i * bin_s)),
            steps=c,
        )
        for i, c in enumerate(counts)
    ]


@router.get("/device", response_model=DeviceUsageOut, responses=AUTH_ERRORS)
def device_usage(
    ctx: Context,
    caller: TenantCaller,
    window_s: Annotated[
        float, Query(ge=10, le=7 * 86400, description="How far back, in seconds.")
    ] = 600,
    bin_s: Annotated[float, Query(ge=0.5, le=86400, description="Bin width, in seconds.")] = 10,
) -> DeviceUsageOut:
    """The shared device's busy fraction over time (when the backend reports it) and
    your jobs' finished steps over the same bins. A window that would need more than
    2000 bins of `bin_s` gets wider bins (the answer's `bin_s` says which): every
    window and bin width within their ranges is answered."""
    bin_s = max(bin_s, window_s / MAX_BINS)
    source, device, note = _device(ctx, window_s, bin_s)
    return DeviceUsageOut(
        window_s=window_s,
        bin_s=bin_s,
        source=source,
        device=device,
        device_note=note,
        steps=_steps(ctx, tenant_id(caller), window_s, bin_s),
    )
