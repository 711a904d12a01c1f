"""The mapping of OpenAI fine-tuning requests onto marlaas job specs (defaults of
`auto`, the held-out split), and the line-numbered checks of fine-tuning files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from marlaas.envs.base import Example
from marlaas.envs.datasets import split_examples
from marlaas.service.openai_ft import convert
from marlaas.service.openai_ft.file_check import check_chat_file, check_prompts

GRADER = {
    "type": "string_check",
    "name": "s",
    "input": "{{sample.output_text}}",
    "reference": "{{item.a}}",
    "operation": "eq",
}


def request(**hyperparameters: Any) -> convert.CreateJob:
    return convert.CreateJob.model_validate(
        {
            "model": "base",
            "training_file": "file-x",
            "method": {
                "type": "reinforcement",
                "reinforcement": {"grader": GRADER, "hyperparameters": hyperparameters},
            },
            "seed": 3,
        }
    )


@pytest.mark.parametrize("rows", [1, 2, 3, 9, 10, 11, 25, 104])
def test_split_sizes_are_the_datasets_split(rows: int) -> None:
    examples = [Example(id=str(i), prompt="p", reference="r") for i in range(rows)]
    train, held = split_examples(examples, convert.EVAL_FRACTION, seed=0)
    assert convert.split_sizes(rows) == (len(train), len(held))


def test_auto_hyperparameters_pick_the_documented_defaults() -> None:
    for body in (
        request(),
        request(
            n_epochs="auto",
            batch_size="auto",
            learning_rate_multiplier="auto",
            compute_multiplier="auto",
            eval_interval="auto",
            eval_samples="auto",
        ),
    ):
        resolved = convert.resolve(
            body, convert.check_request(body), train_rows=100, validation_rows=None
        )
        spec = convert.job_spec(body, resolved)
        assert resolved.hyperparameters == {
            "n_epochs": 1,
            "batch_size": 4,
            "learning_rate_multiplier": 1.0,
            "compute_multiplier": 1.0,
            "eval_interval": 23,  # no periodic eval: before and after the 23 steps
            "eval_samples": 10,  # the 10 held-out rows, each once
            "reasoning_effort": None,
            "steps": 23,
        }
        assert (spec.steps, spec.eval_every, spec.checkpoint_every, spec.eval_episodes) == (
            23,
            0,
            0,
            10,
        )
        assert (spec.algorithm.group_size, spec.algorithm.prompts_per_step) == (8, 4)
        assert spec.algorithm.learning_rate == pytest.approx(3e-4)
        assert spec.seed == 3 and spec.task.seed == 3  # type: ignore[union-attr]


def test_a_validation_file_is_the_eval_set() -> None:
    body = request(eval_samples=5, compute_multiplier=4.0, batch_size=16)
    body = body.model_copy(update={"validation_file": "file-v"})
    resolved = convert.resolve(body, convert.check_request(body), train_rows=10, validation_rows=3)
    spec = convert.job_spec(body, resolved)
    task = spec.task
    assert task.eval_path == "file-v" and task.eval_fraction == 0.0  # type: ignore[union-attr]
    assert spec.eval_episodes == 3 and spec.steps == 1 and spec.algorithm.group_size == 32


def write(tmp_path: Path, lines: list[str | bytes]) -> Path:
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def ok(content: Any = "hi", role: str = "user") -> str:
    return json.dumps({"messages": [{"role": role, "content": content}], "a": "1"})


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        ([ok(), "", ok()], None),
        ([ok(), "{nope"], "line 2: not valid JSON"),
        ([b"\xff\xfe"], "line 1: not valid UTF-8"),
        (["[1, 2]"], "line 1: a row must be a JSON object, got a JSON list"),
        (['{"prompt": "x"}'], "line 1: missing field 'messages' (fields present: prompt)"),
        ([ok(role="robot")], "line 1: messages[0].role must be one of"),
        (
            [ok(content=[{"type": "image_url", "image_url": "u"}])],
            "line 1: messages[0]: content parts must be text parts",
        ),
        ([ok(content=[{"type": "text", "text": "a"}])], None),
        ([""], "the file has no rows"),
    ],
)
def test_chat_files_are_checked_line_by_line(
    tmp_path: Path, lines: list[str | bytes], problem: str | None
) -> None:
    check = check_chat_file(write(tmp_path, lines))
    if problem is None:
        assert check.problem is None and check.rows == sum(1 for x in lines if x)
    else:
        assert check.problem is not None and check.problem.startswith(problem)


def test_rft_prompts_end_with_the_turn_the_model_answers(tmp_path: Path) -> None:
    assert check_prompts(write(tmp_path, [ok(), ok()])) is None
    for role in ("assistant", "developer"):
        problem = check_prompts(write(tmp_path, [ok(), ok(role=role)]))
        assert problem is not None and problem.startswith(f"line 2: the last message is a {role}")


def test_step_and_eval_events_read_as_openai_events() -> None:
    from datetime import UTC, datetime

    from marlaas.service.models import FineTuningJob, JobEvent
    from marlaas.service.openai_ft.wire import event_object

    ft = FineTuningJob(job_id="job_1", fine_tuned_model="ft:base:acme::job_1", method={})
    now = datetime.now(UTC)

    def event(kind: str, data: dict[str, Any], row: int = 5) -> dict[str, Any]:
        return event_object(
            JobEvent(id=row, job_id="job_1", kind=kind, data=data, time=now), 1, 4, ft
        )

    step = event("step", {"step": 2, "metrics": {"reward_mean": 0.25, "loss": 0.5}})
    assert step["type"] == "metrics" and step["id"] == "ftevent-5"
    assert step["message"] == "Step 2/4: loss=0.5, reward_mean=0.25"
    assert step["data"] == {"step": 2, "total_steps": 4, "reward_mean": 0.25, "loss": 0.5}
    assert (
        event("step", {"step": 2, "metrics": {"eval_accuracy": 0.5}})["message"]
        == "Eval at step 2/4: eval_accuracy=0.5"
    )
    ckpt = event("checkpoint", {"step": 4, "metrics": {}})
    assert ckpt["data"]["fine_tuned_model_checkpoint"] == "ft:base:acme::job_1:ckpt-step-4"
    failed = event("status", {"status": "failed", "reason": "grader broke"})
    assert (failed["level"], failed["message"]) == ("error", "Fine-tuning job failed: grader broke")
    assert event("status", {"status": "queued"}, row=1)["message"].startswith(
        "Created fine-tuning job"
    )
