"""What every request handler needs, built once per app: settings, database, the job
reporter, the metrics registry, and the backend (attached while the app runs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from marlaas.service.admission import JobAdmission
from marlaas.service.auth import PrincipalCache
from marlaas.service.backend import JobBackend
from marlaas.service.db import Database
from marlaas.service.inference import InferenceHub, InferenceProvider
from marlaas.service.metrics import RequestMetrics
from marlaas.service.reporter import JobReporter
from marlaas.service.settings import ServiceSettings
from marlaas.service.usage import DeviceUsageProvider


@dataclass
class ServiceContext:
    settings: ServiceSettings
    db: Database
    reporter: JobReporter
    registry: CollectorRegistry
    request_metrics: RequestMetrics
    admission: JobAdmission
    """The checks of a job's cost before it is created (see `admission`)."""
    principals: PrincipalCache = field(default_factory=lambda: PrincipalCache(ttl_s=0))
    """Recently authenticated keys (see `auth.PrincipalCache`); cleared on revocation."""
    backend: JobBackend | None = field(default=None)
    """Set by the app's lifespan from its backend factory; None: jobs stay queued."""
    device_usage: DeviceUsageProvider | None = field(default=None)
    """Reports the device's busy time (`GET /v1/usage/device`); None: the backend does,
    if it implements `DeviceUsageProvider`, else nothing does."""
    inference: InferenceProvider | None = field(default=None)
    """The shared engine the OpenAI-compatible routes serve from; None: the backend's,
    if it implements `InferenceSource`, else an engine of their own (see `inference`)."""
    _hub: InferenceHub | None = field(default=None, init=False, repr=False)

    def inference_hub(self) -> InferenceHub:
        """The service's serving state (one per context, built on first use): the
        OpenAI routes and the training jobs' judges share its engine and adapters."""
        if self._hub is None:
            self._hub = InferenceHub(self)
        return self._hub
