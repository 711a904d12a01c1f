"""The boundary between the service and whatever runs the jobs.

Lifecycle: at startup the app calls a `BackendFactory` with a `JobReporter` and gets a
ready `JobBackend`; the API then calls `submit` once per new job, and `cancel`,
`pause`, `unpause` (the API's "resume") after it has recorded the tenant's action in the database (the
database is the source of truth: the API has already answered the tenant by then). At
shutdown the app calls `close`, which stops the backend's work (a real backend
checkpoints running jobs first). The backend reports what really happens -- started,
progress, checkpoints, done, failed -- through the reporter, never by writing the
database itself.

All methods are coroutines and run on the server's event loop: a backend must not
block it (heavy work goes to its own tasks or threads). A method that raises makes the
API mark the job failed with the error as its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from marlaas.config.job import JobSpec
from marlaas.service.reporter import JobReporter


class JobBackend(Protocol):
    async def submit(self, job_id: str, spec: JobSpec) -> None:
        """Take a new (queued) job; run it when there is room. Returns at once."""
        ...

    async def cancel(self, job_id: str) -> None:
        """Stop the job for good; no report about it is expected afterwards."""
        ...

    async def pause(self, job_id: str) -> None:
        """Stop scheduling the job's work, keeping its state to go on from."""
        ...

    async def unpause(self, job_id: str) -> None:
        """Schedule a paused job again (the database says queued now); report
        `running` once it runs."""
        ...

    async def close(self) -> None:
        """Stop all work (checkpointing running jobs first); called once, at shutdown."""
        ...


BackendFactory = Callable[[JobReporter], JobBackend]
