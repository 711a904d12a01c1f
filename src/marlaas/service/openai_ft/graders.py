"""`POST /v1/fine_tuning/alpha/graders/validate` and `/run`: OpenAI graders checked and
run by marlaas, with the tenant's API key.

`validate` answers the grader as marlaas reads it (a single multi sub-grader named by
its `name`, string contents as text parts), or a 400 naming the field. `run` scores
`model_sample` for `item` and answers OpenAI's run response: the reward, the multi
sub-rewards, and `metadata` (the error flags, execution time, scores, token usage).
A judge (`score_model`, `label_model`) is a model marlaas serves: `base`, or one of the
caller's (a job id, a checkpoint, an `ft:` name), run by the OpenAI inference engine
with the grader's messages through the chat template; a judge the caller cannot use is
a 400 naming its `model` field, before anything runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, TypeAdapter

from marlaas.config.openai_graders import (
    LabelModelGrader,
    MultiGrader,
    OpenAIGrader,
    OpenAIGraderError,
    ScoreModelGrader,
    parse_openai_grader,
)
from marlaas.envs.openai_graders import JudgeError, JudgeReply, check_runnable, evaluate
from marlaas.errors import GraderError
from marlaas.service.api.deps import TenantCaller, tenant_id
from marlaas.service.errors import ServiceError
from marlaas.service.inference import InferenceHub
from marlaas.service.models_catalog import ModelNotFound
from marlaas.service.openai_api import chat_prompt, inference_hub
from marlaas.service.openai_ft.errors import ERRORS, FineTuningRoute, bad_request
from marlaas.types import SamplingParams

router = APIRouter(
    prefix="/v1/fine_tuning/alpha/graders",
    tags=["openai fine-tuning"],
    route_class=FineTuningRoute,
    responses=ERRORS,
)
_GRADER = TypeAdapter(OpenAIGrader)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ValidateBody(_Wire):
    grader: dict[str, Any]


class RunBody(_Wire):
    grader: dict[str, Any]
    model_sample: str
    item: dict[str, Any] | None = None


class ServiceJudge:
    """A `Judge` over the service's inference engine, for one tenant's models."""

    def __init__(self, hub: InferenceHub, tenant: str) -> None:
        self.hub = hub
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
        try:
            server = await self.hub.server()
            served = await server.resolve(self.tenant, model)
            prompt, stops = chat_prompt(server.provider.tokenizer, messages)
            sampling = SamplingParams(
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_tokens,
                stop=stops,
                seed=seed,
            )
            (out,) = await server.generate(served, [prompt], sampling, 1)
        except ServiceError as e:
            raise JudgeError(f"judge model {model!r}: {e}") from e
        return JudgeReply(out.text, len(prompt), len(out.token_ids))


def _judges(grader: OpenAIGrader, where: str = "grader") -> Iterator[tuple[str, str]]:
    """(field path, model) of every judge the grader calls."""
    if isinstance(grader, MultiGrader):
        for name, sub in grader.graders.items():
            yield from _judges(sub, f"{where}.graders.{name}")
    elif isinstance(grader, ScoreModelGrader | LabelModelGrader):
        yield f"{where}.model", grader.model


async def _checked(raw: dict[str, Any], hub: InferenceHub, tenant: str) -> OpenAIGrader:
    try:
        grader = parse_openai_grader(raw, "grader")
        check_runnable(grader)
    except OpenAIGraderError as e:
        raise bad_request(str(e), e.param) from None
    except GraderError as e:
        raise bad_request(str(e), "grader") from None
    for param, model in _judges(grader):
        try:
            await hub.resolve(tenant, model)
        except ModelNotFound as e:
            raise bad_request(f"{param}: {e}", param, "model_not_found") from None
    return grader


@router.post("/validate")
async def validate_grader(
    body: ValidateBody, request: Request, caller: TenantCaller
) -> dict[str, Any]:
    grader = await _checked(body.grader, inference_hub(request), tenant_id(caller))
    return {"grader": _GRADER.dump_python(grader, mode="json")}


@router.post("/run")
async def run_grader(body: RunBody, request: Request, caller: TenantCaller) -> dict[str, Any]:
    hub, tenant = inference_hub(request), tenant_id(caller)
    grader = await _checked(body.grader, hub, tenant)
    started = time.perf_counter()
    result = await evaluate(
        grader, body.model_sample, body.item or {}, judge=ServiceJudge(hub, tenant)
    )
    tokens = sum(u["total_tokens"] for u in result.token_usage.values())
    multi = isinstance(grader, MultiGrader)
    return {
        "reward": result.reward,
        "sub_rewards": dict(result.scores) if multi else {},
        "metadata": {
            "errors": result.error_flags(),
            "execution_time": time.perf_counter() - started,
            "name": grader.name,
            "sampled_model_name": None,
            "scores": dict(result.scores) if multi else {grader.name: result.reward},
            "token_usage": tokens if result.token_usage else None,
            "type": grader.type,
        },
        "model_grader_token_usage_per_model": result.token_usage,
    }
