"""Observability: metrics, per-stage spans (trace export), plots and the live view.

Stages report through the `Recorder` protocol (`recorder`), a tenant's progress as the
typed records of `progress`; `RunRecorder` (`memory`) keeps a run in memory and answers
queries; `trace` exports Chrome/Perfetto JSON; `plots` (needs matplotlib, imported only
there) draws PNGs; `live` shows the run in the terminal with rich.
"""

from marlaas.obs.memory import RunRecorder
from marlaas.obs.recorder import STAGES, NullRecorder, Recorder
from marlaas.obs.trace import write_trace

__all__ = [
    "STAGES",
    "NullRecorder",
    "Recorder",
    "RunRecorder",
    "write_trace",
]
