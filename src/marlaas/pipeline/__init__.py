"""The pipeline: tenant state machines, the event-driven orchestrator, admission, the
environment pool, the synchronous baseline, and `run_jobs`, which runs a `RunSpec` on a
backend its caller opens (`marlaas.backends`). The pipeline reaches model compute only
through the device port (`marlaas.device`)."""

from marlaas.pipeline.baseline import SyncBaseline
from marlaas.pipeline.context import (
    Backend,
    BackendOpener,
    PipelineContext,
    PipelineOptions,
)
from marlaas.pipeline.envpool import EnvCallError, EnvPool, PooledEnv, play_episode
from marlaas.pipeline.orchestrator import Orchestrator
from marlaas.pipeline.runner import RunResult, TenantResult, run_jobs
from marlaas.pipeline.scheduler import AdmissionQueue
from marlaas.pipeline.tenant import (
    JobStatus,
    PipelineError,
    TenantFailure,
    TenantState,
)

__all__ = [
    "AdmissionQueue",
    "Backend",
    "BackendOpener",
    "EnvCallError",
    "EnvPool",
    "JobStatus",
    "Orchestrator",
    "PipelineContext",
    "PipelineError",
    "PipelineOptions",
    "PooledEnv",
    "RunResult",
    "SyncBaseline",
    "TenantFailure",
    "TenantResult",
    "TenantState",
    "play_episode",
    "run_jobs",
]
