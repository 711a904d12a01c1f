"""The Python SDK of the marlaas service: `Client` mirrors the HTTP job API (submit,
list, inspect, act on jobs; metrics, checkpoints, event streams; adapter downloads as
PEFT directories). Errors are `ClientError`s (see `errors`) carrying the server's
message."""

from marlaas.client.client import Client, Downloaded, WaitTimeout
from marlaas.client.errors import (
    ApiError,
    AuthError,
    ClientError,
    ConflictError,
    ConnectionFailed,
    NotFoundError,
    PayloadTooLarge,
    QuotaExceeded,
    RequestInvalid,
    ServerError,
)
from marlaas.client.specs import load_job_specs
from marlaas.client.types import Checkpoint, Job, JobEvent, MetricPoint

__all__ = [
    "ApiError",
    "AuthError",
    "Checkpoint",
    "Client",
    "ClientError",
    "ConflictError",
    "ConnectionFailed",
    "Downloaded",
    "Job",
    "JobEvent",
    "MetricPoint",
    "NotFoundError",
    "PayloadTooLarge",
    "QuotaExceeded",
    "RequestInvalid",
    "ServerError",
    "WaitTimeout",
    "load_job_specs",
]
