"""`POST /v1/fine_tuning/alpha/graders/validate` and `/run`: OpenAI graders checked and
run by marlaas, with the tenant's API key.

`validate` answers the grader as marlaas reads it (a single multi sub-grader named by
its `name`, string contents as text parts), or a 400 naming the field. `run` scores
`model_sample` for `item` and answers OpenAI's run response: the reward, the multi
sub-rewards, and `metadata` (the error flags, execution time, scores, token usage).
A judge (`score_model`, `label_model`) is a model marlaas serves: `base`, or one of the
caller's (a job id, a checkpoint, an `ft:` name), run by the OpenAI inference engine
with the grader's messages through the chat template (`service.judges`); a judge the
caller cannot use is a 400 naming its `model` field, before anything runs
(`check_judges`, which a job's creation runs too).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, TypeAdapter

from marlaas.config.openai_graders import (
    MultiGrader,
    OpenAIGrader,
    OpenAIGraderError,
    judge_models,
    parse_openai_grader,
)
from marlaas.envs.openai_graders import check_runnable, evaluate
from marlaas.errors import GraderError
from marlaas.service.api.deps import TenantCaller, tenant_id
from marlaas.service.inference import InferenceHub
from marlaas.service.judges import ServiceJudge
from marlaas.service.models_catalog import ModelNotFound
from marlaas.service.openai_api import inference_hub
from marlaas.service.openai_ft.errors import ERRORS, FineTuningRoute, bad_request

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


async def check_judges(
    grader: OpenAIGrader, hub: InferenceHub, tenant: str, where: str = "grader"
) -> None:
    """A 400 naming the `model` field of the first judge the tenant cannot call (a model
    that does not exist, or another tenant's, alike)."""
    for param, model in judge_models(grader, where):
        try:
            await hub.resolve(tenant, model)
        except ModelNotFound as e:
            raise bad_request(f"{param}: {e}", param, "model_not_found") from None


async def _checked(raw: dict[str, Any], hub: InferenceHub, tenant: str) -> OpenAIGrader:
    try:
        grader = parse_openai_grader(raw, "grader")
        check_runnable(grader)
    except OpenAIGraderError as e:
        raise bad_request(str(e), e.param) from None
    except GraderError as e:
        raise bad_request(str(e), "grader") from None
    await check_judges(grader, hub, tenant)
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
