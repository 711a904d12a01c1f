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
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence

from transformers import PreTrainedTokenizerBase

from marlaas.config.graders import grader_judges
from marlaas.config.job import DatasetSpec, JobSpec
from marlaas.device.port import BASE, DevicePort
from marlaas.envs.openai_graders import Judge, JudgeError, JudgeReply
from marlaas.errors import ConfigError, MarlaasError
from marlaas.model.chat import chat_prompt
from marlaas.types import Completion, RolloutRequest, SamplingParams

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


#: Samples one reply to a prompt (token ids) with the given parameters.
Generate = Callable[[list[int], SamplingParams], Awaitable[Completion]]


class ChatJudge(ABC):
    """A `Judge` that renders the grader's messages with a tokenizer's chat template (off
    the event loop) and samples one reply: the rendering, the sampling parameters and
    the reply are the same wherever the judge runs; `target` says where (which
    tokenizer, which model). Any marlaas error becomes a `JudgeError` naming the model."""

    @abstractmethod
    async def target(self, model: str) -> tuple[PreTrainedTokenizerBase, Generate]:
        """The tokenizer and the sampler of judge `model`; `JudgeError` when it cannot
        judge with that model."""

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
        try:
            tokenizer, generate = await self.target(model)
            prompt, stops = await asyncio.to_thread(chat_prompt, tokenizer, messages)
            sampling = SamplingParams(
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_tokens,
                stop=stops,
                seed=seed,
            )
            out = await generate(prompt, sampling)
        except JudgeError:
            raise
        except MarlaasError as e:  # the device closed, the prompt is too long, ...
            raise JudgeError(f"judge model {model!r}: {e}") from e
        return JudgeReply(out.text, len(prompt), len(out.token_ids))


class BaseJudge(ChatJudge):
    """A `Judge` that samples the plain base on `device`, as training rows of `tenant`
    (see the module docstring). It answers only the model named `base`."""

    def __init__(self, device: DevicePort, tenant: str) -> None:
        self.device = device
        self.tenant = tenant

    async def target(self, model: str) -> tuple[PreTrainedTokenizerBase, Generate]:
        if model != BASE_MODEL:
            raise JudgeError(f"judge model {model!r}: this run judges with {BASE_MODEL!r} only")

        async def generate(prompt: list[int], sampling: SamplingParams) -> Completion:
            request = RolloutRequest(
                tenant=BASE, prompt_ids=tuple(prompt), sampling=sampling, account=self.tenant
            )
            return await self.device.sample(request)

        return self.device.tokenizer, generate


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
