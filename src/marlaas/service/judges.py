"""Judge models in the service: `ServiceJudge` answers an OpenAI model grader
(`score_model`, `label_model`) with a model marlaas serves to a tenant -- `base`, or one
of the tenant's own (a job id, a checkpoint, an `ft:` name) -- through the service's
inference engine, the grader's messages rendered with the chat template.

Two callers:
- `POST /v1/fine_tuning/alpha/graders/run`: someone waits for the answer, so its
  requests are inference (`interactive`, ahead of training rows, within the engine's
  bounds; `marlaas.device.gate`).
- A training job's grader (`ServiceJudges`, the pipeline's `JudgeFactory` in the
  service): a judge call is that job's training work, so its requests are training rows
  on the job's own account of the fair share (`account=<job id>`, see
  `marlaas.pipeline.judges`): the job pays for its judge's tokens out of its own share and
  at its own priority, and other tenants' work never waits for more than fair sharing
  gives it. The models it may call are its owner's, the same ones the owner may call
  through the API; the job's creation checks them first (`check_job_judges`, and the
  OpenAI route's 400 naming the grader's `model` field), and a model that is gone when
  a call is made fails that job only.

Tokenizing runs in a worker thread and generation only awaits the device, so a judge
call never blocks the event loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from marlaas.envs.openai_graders import Judge, JudgeError
from marlaas.pipeline.judges import ChatJudge, Generate, job_judges
from marlaas.service.errors import InvalidField
from marlaas.service.inference import InferenceHub
from marlaas.service.models import Job
from marlaas.service.models_catalog import ModelNotFound
from marlaas.types import Completion, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from marlaas.config.job import JobSpec
    from marlaas.device.port import DevicePort
    from marlaas.service.context import ServiceContext


class ServiceJudge(ChatJudge):
    """A `Judge` over the service's inference engine, for one tenant's models; with
    `account` (a job id), its calls are that job's training work."""

    def __init__(self, hub: InferenceHub, tenant: str, *, account: str | None = None) -> None:
        self.hub = hub
        self.tenant = tenant
        self.account = account

    async def owner(self) -> str:
        """The tenant whose models the judge may call."""
        return self.tenant

    async def target(self, model: str) -> tuple[PreTrainedTokenizerBase, Generate]:
        server = await self.hub.server()
        served = await server.resolve(await self.owner(), model)

        async def generate(prompt: list[int], sampling: SamplingParams) -> Completion:
            (out,) = await server.generate(served, [prompt], sampling, 1, account=self.account)
            return out

        return server.provider.tokenizer, generate


class _JobJudge(ServiceJudge):
    """The judge of one training job: its owner's models, on the job's account. The
    owner is read from the database at the first call (off the event loop)."""

    def __init__(self, ctx: ServiceContext, job_id: str) -> None:
        super().__init__(ctx.inference_hub(), "", account=job_id)
        self.ctx = ctx
        self.job_id = job_id

    def _read_owner(self) -> str:
        with self.ctx.db.transaction() as session:
            job = session.get(Job, self.job_id)
            if job is None:
                raise JudgeError(f"job {self.job_id!r} is gone; its judge cannot run")
            return job.tenant_id

    async def owner(self) -> str:
        if not self.tenant:
            self.tenant = await asyncio.to_thread(self._read_owner)
        return self.tenant


class ServiceJudges:
    """The pipeline's `JudgeFactory` in the service: a job (a pipeline tenant named by
    its job id) is judged by its owner's models (see the module docstring)."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def __call__(self, device: DevicePort, job: JobSpec) -> Judge:
        # The engine is the hub's, which serves from this same device.
        return _JobJudge(self.ctx, job.name)


async def check_job_judges(hub: InferenceHub, tenant: str, spec: JobSpec) -> None:
    """A native job's judge models, checked before it is created: `InvalidField` (422,
    located at the grader's `model` field) for one the tenant cannot call."""
    for where, model in job_judges(spec):
        try:
            await hub.resolve(tenant, model)
        except ModelNotFound as e:
            raise InvalidField(("body", *where.split(".")), f"{where}: {e}") from None
