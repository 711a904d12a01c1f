"""The pipeline: tenant state machines, the event-driven orchestrator, the device
executor, fair-share scheduling and admission, the environment pool, the synchronous
baseline, and `run_jobs`, which builds the shared components from a `RunSpec`."""

from marlaas.pipeline.baseline import SyncBaseline
from marlaas.pipeline.context import PipelineContext, PipelineOptions
from marlaas.pipeline.envpool import EnvCallError, EnvPool, PooledEnv, play_episode
from marlaas.pipeline.executor import DeviceExecutor, ExecutorClosed
from marlaas.pipeline.orchestrator import Orchestrator
from marlaas.pipeline.runner import RunResult, TenantResult, build_context, run_jobs
from marlaas.pipeline.scheduler import AdmissionQueue, FairShare, RequestGate
from marlaas.pipeline.tenant import (
    JobStatus,
    PipelineError,
    TenantFailure,
    TenantState,
)

__all__ = [
    "AdmissionQueue",
    "DeviceExecutor",
    "EnvCallError",
    "EnvPool",
    "ExecutorClosed",
    "FairShare",
    "JobStatus",
    "Orchestrator",
    "PipelineContext",
    "PipelineError",
    "PipelineOptions",
    "PooledEnv",
    "RequestGate",
    "RunResult",
    "SyncBaseline",
    "TenantFailure",
    "TenantResult",
    "TenantState",
    "build_context",
    "play_episode",
    "run_jobs",
]
