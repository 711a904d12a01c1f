"""Where the service learns how busy the accelerator is: a small provider interface.

The service itself never touches the device; whatever runs the jobs knows. A backend
fills the figure in one of two ways, both read by `GET /v1/usage/device`:

- the backend object itself implements `DeviceUsageProvider` (the simplest: one more
  method next to `submit`/`cancel`), or
- whoever builds the app sets `ServiceContext.device_usage` to a provider, which wins
  over the backend; `RecorderDeviceUsage` turns the pipeline's `RunRecorder` into one.

Neither: the endpoint answers with no device figures and says why; the dashboard shows
"no data".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from marlaas.obs.memory import RunRecorder


@dataclass(frozen=True)
class BusyBin:
    """The device's busy fraction over `[start, start + seconds)`."""

    start: datetime
    """Wall-clock start of the bin, timezone-aware (UTC)."""
    seconds: float
    """The bin's length; the newest bin may be shorter than the others."""
    busy: float
    """Fraction of the bin the device spent on model compute, in [0, 1]."""


@runtime_checkable
class DeviceUsageProvider(Protocol):
    def device_utilization(self, window_s: float, bin_s: float) -> Sequence[BusyBin]:
        """The device's busy fraction in consecutive bins of `bin_s` seconds covering
        (at most) the last `window_s` seconds, oldest first; empty when nothing ran yet.

        Called from a worker thread while the event loop keeps serving, so it must be
        thread-safe, must not block on the device, and should take milliseconds.
        """
        ...


def provider_of(
    explicit: DeviceUsageProvider | None, backend: object
) -> DeviceUsageProvider | None:
    """The provider to read: the explicit one, else the backend if it is one."""
    if explicit is not None:
        return explicit
    if isinstance(backend, DeviceUsageProvider):
        return backend
    return None


class RecorderDeviceUsage:
    """A `DeviceUsageProvider` over a `RunRecorder`: the busy fraction of its "device"
    spans (model compute), in bins aligned to multiples of `bin_s` of wall-clock time,
    so that successive answers line up; the first bin is clipped to the recorder's start
    and the last one ends now."""

    def __init__(self, recorder: RunRecorder) -> None:
        self._recorder = recorder

    def device_utilization(self, window_s: float, bin_s: float) -> list[BusyBin]:
        rec = self._recorder
        end = rec.now()
        wall_end = rec.to_wall(end)
        wall_start = math.floor((wall_end - window_s) / bin_s) * bin_s
        start = max(rec.origin, end - (wall_end - wall_start))
        return [
            BusyBin(
                start=datetime.fromtimestamp(rec.to_wall(b.start), UTC),
                seconds=b.end - b.start,
                busy=b.busy_fraction,
            )
            for b in rec.utilization_timeline("device", bin_s, start, end)
        ]
