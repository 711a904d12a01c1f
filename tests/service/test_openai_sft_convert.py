"""OpenAI supervised fine-tuning requests as marlaas jobs: the documented `auto`
defaults, the validation file, the method checks, the SFT row check of a file, and the
OpenAI metric names of a supervised job's events and checkpoints."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from marlaas.config.specs import SFTSpec
from marlaas.service.models import Checkpoint, FineTuningJob, JobEvent
from marlaas.service.openai_ft import convert
from marlaas.service.openai_ft.errors import ApiError
from marlaas.service.openai_ft.file_check import check_conversations
from marlaas.service.openai_ft.wire import checkpoint_object, event_object


def request(method: Any = None, **extra: Any) -> convert.CreateJob:
    body: dict[str, Any] = {"model": "base", "training_file": "file-x", "seed": 3, **extra}
    if method is not None:
        body["method"] = method
    return convert.CreateJob.model_validate(body)


def supervised(**hyperparameters: Any) -> dict[str, Any]:
    return {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}


def test_auto_supervised_hyperparameters_pick_the_documented_defaults() -> None:
    auto = {"n_epochs": "auto", "batch_size": "auto", "learning_rate_multiplier": "auto"}
    for body in (request(), request(supervised()), request(supervised(**auto))):
        assert convert.check_request(body) is None  # supervised: no grader
        resolved = convert.resolve(body, None, train_rows=100, validation_rows=None)
        spec = convert.job_spec(body, resolved)
        # 90 rows trained on (10 held out) in batches of 8: 12 steps an epoch, 3 epochs.
        assert isinstance(spec.algorithm, SFTSpec)
        assert (spec.algorithm.batch_size, spec.steps) == (8, 36)
        assert spec.algorithm.learning_rate == pytest.approx(2e-4)
        assert (spec.eval_every, spec.checkpoint_every, spec.eval_episodes) == (12, 12, 10)
        assert spec.task.grader is None and spec.seed == 3  # type: ignore[union-attr]
        assert convert.method_record(resolved) == {
            "type": "supervised",
            "supervised": {
                "hyperparameters": {
                    "batch_size": 8,
                    "learning_rate_multiplier": 1.0,
                    "n_epochs": 3,
                }
            },
        }


def test_a_supervised_validation_file_is_scored_whole() -> None:
    body = request(supervised(n_epochs=1, batch_size=4, learning_rate_multiplier=2))
    body = body.model_copy(update={"validation_file": "file-v"})
    resolved = convert.resolve(body, None, train_rows=10, validation_rows=7)
    spec = convert.job_spec(body, resolved)
    assert spec.task.eval_path == "file-v" and spec.task.eval_fraction == 0.0  # type: ignore[union-attr]
    assert spec.steps == 3 and spec.eval_every == 0 and spec.eval_episodes == 7
    assert spec.algorithm.learning_rate == pytest.approx(4e-4)


@pytest.mark.parametrize(
    ("method", "param", "words"),
    [
        ({"type": "dpo", "dpo": {}}, "method.type", "dpo method is not supported"),
        (
            {"type": "supervised", "reinforcement": {"grader": {}}},
            "method.reinforcement",
            "method.type is supervised",
        ),
    ],
)
def test_methods_marlaas_cannot_run_are_refused(method: Any, param: str, words: str) -> None:
    with pytest.raises(ApiError) as refused:
        convert.check_request(request(method))
    assert refused.value.param == param and words in str(refused.value)


def test_supervised_rows_are_checked_line_by_line(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    rows = [
        good,
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]},
    ]
    path = tmp_path / "f.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problem = check_conversations(path)
    assert problem is not None and problem.startswith("line 2: messages has no assistant")
    path.write_text(json.dumps(good) + "\n")
    assert check_conversations(path) is None


def test_supervised_figures_carry_openais_names() -> None:
    ft = FineTuningJob(job_id="job_1", fine_tuned_model="ft:base:acme::job_1", method=supervised())
    now = datetime.now(UTC)

    def event(data: dict[str, Any]) -> dict[str, Any]:
        return event_object(
            JobEvent(id=5, job_id="job_1", kind="step", data=data, time=now), 1, 4, ft
        )

    step = event({"step": 2, "metrics": {"loss": 0.5, "token_accuracy": 0.75, "lr": 1e-4}})
    assert step["data"] == {
        "step": 2,
        "total_steps": 4,
        "train_loss": 0.5,
        "train_mean_token_accuracy": 0.75,
        "lr": 1e-4,
    }
    ev = event({"step": 4, "metrics": {"eval_loss": 0.25, "eval_accuracy": 0.8}})
    assert ev["message"].startswith("Eval at step 4/4")
    assert ev["data"]["valid_loss"] == ev["data"]["full_valid_loss"] == 0.25
    assert ev["data"]["valid_mean_token_accuracy"] == 0.8
    row = Checkpoint(
        id=3,
        job_id="job_1",
        step=4,
        created_at=now,
        metrics={"loss": 0.5, "token_accuracy": 0.75, "eval_loss": 0.25, "eval_accuracy": 0.8},
    )
    metrics = checkpoint_object(row, ft)["metrics"]
    assert (metrics["train_loss"], metrics["train_mean_token_accuracy"]) == (0.5, 0.75)
    assert (metrics["valid_loss"], metrics["full_valid_mean_token_accuracy"]) == (0.25, 0.8)
