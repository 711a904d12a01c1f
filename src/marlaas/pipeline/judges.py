"""Judges of a run's model graders: who answers the `score_model` and `label_model`
graders inside a job's OpenAI grader.

Whoever runs the pipeline injects a `JudgeFactory` (`PipelineContext.judges`): for each
job whose grader calls a model, the factory is asked once when the job is submitted
(so a job it cannot judge is refused then, with a `ConfigError` naming the grader
field) and once when the tenant is set up (its task is built with that judge). There
is no global judge. `marlaas run` judges with the run's own base (`base_judge`); the
service judges with any model the job's owner may call (`marlaas.service.judges`).

A judge call of a training job is that job's training work, not interactive inference:
its sampling requests are training rows on the job's account of the sampler's fair
share (`RolloutRequest.account`, `marlaas.device.gate`), so a tenant whose grader calls a
judge pays for those tokens out of its own share, at its own priority, and can never
push other tenants' rollouts aside; its judge calls are cancelled with its other
requests when it ends. Tokenizing runs in a worker thread; the call itself only awaits
the device.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from marlaas.config.graders import grader_judges
from marlaas.config.job import DatasetSpec, JobSpec
from marlaas.device.port import BASE, DevicePort
from marlaas.envs.openai_graders import Judge, JudgeError, JudgeReply
from marlaas.errors import ConfigError, MarlaasError
from marlaas.model.chat import chat_prompt
from marlaas.types import RolloutRequest, SamplingParams

#: The judge model a `BaseJudge` serves: the run's base, by its OpenAI name.
BASE_MODEL = "base"

#: The judge of a job's model graders, on the run's device; `ConfigError` (naming the
#: grader field) when it cannot judge the models the job names.
JudgeFactory = Callable[[DevicePort, JobSpec], Judge]


def job_judges(job: JobSpec) -> list[tuple[str, str]]:
    """(field path, model) of every judge model the job's grader calls ([] for a job
    without model graders, and for a built-in task family)."""
    if not isinstance(job.task, DatasetSpec) or job.task.grader is None:
        return []
    return list(grader_judges(job.task.grader, "task.grader"))


class BaseJudge:
    """A `Judge` that samples the plain base on `device`, as training rows of `tenant`
    (see the module docstring). It answers only the model named `base`."""

    def __init__(self, device: DevicePort, tenant: str) -> None:
        self.device = device
        self.tenant = tenant

    async def __call__(
        self,
        model: str,
        messages: Sequence[tuple[str, str]],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
    ) -> JudgeReply:
        if model != BASE_MODEL:
            raise JudgeError(f"judge model {model!r}: this run judges with {BASE_MODEL!r} only")
        prompt, stops = await asyncio.to_thread(chat_prompt, self.device.tokenizer, messages)
        request = RolloutRequest(
            tenant=BASE,
            prompt_ids=tuple(prompt),
            sampling=SamplingParams(
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_tokens,
                stop=stops,
                seed=seed,
            ),
            account=self.tenant,
        )
        try:
            out = await self.device.sample(request)
        except MarlaasError as e:  # the device closed, or the prompt is too long
            raise JudgeError(f"judge model {model!r}: {e}") from e
        return JudgeReply(out.text, len(prompt), len(out.token_ids))


def base_judge(device: DevicePort, job: JobSpec) -> BaseJudge:
    """The `JudgeFactory` of a run without a service (`marlaas run`): the run's base
    judges; any other model is refused, naming the field."""
    for where, model in job_judges(job):
        if model != BASE_MODEL:
            raise ConfigError(
                f"job {job.name!r}: {where} is {model!r}, and a run without the service "
                f"judges with its base model only; set it to {BASE_MODEL!r} (or run the "
                "job on `marlaas serve`, where a judge may be any of your models)"
            )
    return BaseJudge(device, job.name)
