"""`alpha/graders/validate` and `/run` driven by the official `openai` client against a
real uvicorn server on a loopback port: every grader type, multi sub-rewards, and model
judges on the served base (the service's own engine)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from collections.abc import Iterator
from typing import Any, cast

import openai
import pytest
from openai_ft_support import MULTI, ROWS, Served, jsonl, rft, serving

from marlaas.config.job import JobSpec
from marlaas.service.judges import ServiceJudge, ServiceJudges
from marlaas.service.models import Job
from marlaas.types import Completion, RolloutRequest


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("graders")) as s:
        yield s


def run(client: openai.OpenAI, grader: dict[str, Any], sample: str, item: dict[str, Any]) -> Any:
    return client.fine_tuning.alpha.graders.run(grader=grader, model_sample=sample, item=item)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("grader", "sample", "reward"),
    [
        (
            {
                "type": "string_check",
                "name": "s",
                "input": "{{sample.output_text}}",
                "reference": "{{item.answer}}",
                "operation": "ilike",
            },
            "It is PARIS",
            1.0,
        ),
        (
            {
                "type": "text_similarity",
                "name": "t",
                "input": "{{sample.output_text}}",
                "reference": "{{item.answer}}",
                "evaluation_metric": "rouge_1",
            },
            "paris",
            1.0,
        ),
        (
            {
                "type": "text_similarity",
                "name": "t",
                "input": "{{sample.output_text}}",
                "reference": "{{item.answer}}",
                "evaluation_metric": "fuzzy_match",
            },
            "Paris!",
            1.0,
        ),
        (
            {
                "type": "python",
                "name": "p",
                "source": "def grade(sample, item):\n    return len(item['answer']) / 10\n",
            },
            "x",
            0.5,
        ),
        (
            {
                "type": "string_check",
                "name": "j",
                "input": "{{sample.output_json.city}}",
                "reference": "{{item.answer}}",
                "operation": "eq",
            },
            '{"city": "Paris"}',
            1.0,
        ),
    ],
)
def test_graders_run_the_simple_types(
    served: Served, grader: dict[str, Any], sample: str, reward: float
) -> None:
    result = run(served.acme, grader, sample, {"answer": "Paris"})
    assert result.reward == pytest.approx(reward)
    assert result.metadata.type == grader["type"] and result.metadata.name == grader["name"]
    assert not any(v for k, v in result.metadata.errors.model_dump().items() if isinstance(v, bool))
    assert (
        served.acme.fine_tuning.alpha.graders.validate(grader=grader).grader.type == grader["type"]
    )  # type: ignore[arg-type,union-attr]


def test_graders_run_multi_with_sub_rewards(served: Served) -> None:
    result = run(served.acme, MULTI, "the sum is 19", {"answer": "19"})
    assert result.reward == 0.5 and result.sub_rewards == {"exact": 0.0, "contains": 1.0}
    assert result.metadata.scores == {"exact": 0.0, "contains": 1.0}


def test_graders_run_model_judges_on_the_base(served: Served) -> None:
    judge_input = [{"role": "user", "content": "Q: 2+2\nIs {{sample.output_text}} right?"}]
    score = run(
        served.acme,
        {
            "type": "score_model",
            "name": "judge",
            "model": "base",
            "input": judge_input,
            "range": [0, 100],
            "sampling_params": {"temperature": 0, "max_completions_tokens": 8},
        },
        "4",
        {},
    )
    # The embedded base answers arithmetic with a number: a score or a parse error, both
    # reported, with the judge's token usage.
    usage = score.model_grader_token_usage_per_model["base"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0  # type: ignore[index]
    errors = score.metadata.errors
    assert errors.api_model_grader_parse_error or 0.0 <= score.reward <= 100.0
    assert not errors.api_model_grader_server_error
    label = run(
        served.acme,
        {
            "type": "label_model",
            "name": "lab",
            "model": "base",
            "input": judge_input,
            "labels": ["4", "5"],
            "passing_labels": ["4"],
        },
        "4",
        {},
    )
    assert label.reward in (0.0, 1.0) and label.metadata.token_usage
    with pytest.raises(openai.BadRequestError) as missing:
        run(
            served.acme,
            {"type": "score_model", "name": "judge", "model": "nope", "input": judge_input},
            "4",
            {},
        )
    assert missing.value.param == "grader.model" and missing.value.code == "model_not_found"


class _Recording:
    """An `InferenceProvider` that answers every request with "7" at once, keeping how
    each was queued (its adapter, its account, whether it was interactive)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.base_adapter = ":base"
        self.queued: list[tuple[str, str | None, bool]] = []

    @property
    def model(self) -> Any:
        raise AssertionError("the base is served without reading adapter shapes")

    def sample(
        self, request: RolloutRequest, on_token: Any = None, *, interactive: bool = True
    ) -> asyncio.Future[Completion]:
        self.queued.append((request.tenant, request.account, interactive))
        done: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        done.set_result(
            Completion(
                request.request_id,
                request.tenant,
                0,
                len(request.prompt_ids),
                (7,),
                (0.0,),
                "7",
                "stop",
            )
        )
        return done

    def has_adapter(self, name: str) -> bool:
        return False

    async def add_adapter(self, name: str, lora: Any, tensors: Any) -> None:
        raise AssertionError("no adapter is loaded for the base")

    async def drop_adapter(self, name: str) -> None:
        return None


def test_a_training_jobs_judge_queues_training_rows_on_the_jobs_account(served: Served) -> None:
    """The judge of a training job samples as that job's training work (its account, not
    interactive); the alpha/graders/run judge as the caller's inference."""
    from transformers import AutoTokenizer

    served.backend.hold_at = 1  # the job stays running, as a judged job would
    train = served.acme.files.create(file=("t.jsonl", io.BytesIO(jsonl(ROWS))), purpose="fine-tune")
    job = served.acme.fine_tuning.jobs.create(model="base", training_file=train.id, method=rft())  # type: ignore[arg-type]
    recording = _Recording(AutoTokenizer.from_pretrained(served.data_dir / "chat-base"))
    ctx = dataclasses.replace(served.ctx, inference=recording)  # type: ignore[arg-type]
    spec = JobSpec.model_validate({**served.backend.specs[job.id].model_dump(), "name": job.id})
    judge = ServiceJudges(ctx)(cast(Any, None), spec)
    kw: dict[str, Any] = {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "seed": None}
    reply = asyncio.run(judge("base", [("user", "Q: 2+2")], **kw))
    assert (reply.text, reply.completion_tokens) == ("7", 1) and reply.prompt_tokens > 0
    with ctx.db.transaction() as session:
        owner = session.get(Job, job.id).tenant_id  # type: ignore[union-attr]
    asyncio.run(ServiceJudge(ctx.inference_hub(), owner)("base", [("user", "Q: 2+2")], **kw))
    assert recording.queued == [(":base", job.id, False), (":base", None, True)]
    served.acme.fine_tuning.jobs.cancel(job.id)
