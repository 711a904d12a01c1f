"""OpenAI-compatible fine-tuning on a real `marlaas serve` process (the in-process
pipeline backend, SQLite, a loopback port), driven by the official `openai` client only:
an RFT job trained to the end (events, checkpoints, its `ft:` model answering), a second
job paused, resumed and cancelled, files, and `alpha/graders/run` on every grader type
with the model judges on the pipeline's own engine.

The base is the embedded one with a chat template added (its own plain `Q: ... / A: `
turns, written as a template), since RFT prompts are chat messages."""

from __future__ import annotations

import csv
import io
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai_ft_support import SERVE_ADMIN_KEY as ADMIN_KEY
from openai_ft_support import serve_marlaas

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with serve_marlaas(tmp_path_factory.mktemp("serve")) as served:
        yield served


def sample_grader(kind: str) -> dict[str, Any]:
    judge = [{"role": "user", "content": "Q: {{item.question}}"}]
    return {
        "string_check": {
            "type": "string_check",
            "name": "g",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "eq",
        },
        "text_similarity": {
            "type": "text_similarity",
            "name": "g",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "evaluation_metric": "bleu",
        },
        "python": {
            "type": "python",
            "name": "g",
            "source": "def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])\n",
        },
        "score_model": {
            "type": "score_model",
            "name": "g",
            "model": "base",
            "input": judge,
            "range": [0, 1000],
            "sampling_params": {"temperature": 0, "max_completions_tokens": 6},
        },
        "label_model": {
            "type": "label_model",
            "name": "g",
            "model": "base",
            "input": judge,
            "labels": ["19", "20"],
            "passing_labels": ["19"],
        },
        "multi": {
            "type": "multi",
            "name": "g",
            "graders": {
                "a": {
                    "type": "string_check",
                    "name": "a",
                    "input": "{{sample.output_text}}",
                    "reference": "{{item.answer}}",
                    "operation": "eq",
                }
            },
            "calculate_output": "a",
        },
    }[kind]


@pytest.mark.parametrize(
    "kind", ["string_check", "text_similarity", "python", "score_model", "label_model", "multi"]
)
def test_graders_run_on_a_real_server(client: openai.OpenAI, kind: str) -> None:
    result = client.fine_tuning.alpha.graders.run(
        grader=sample_grader(kind),  # type: ignore[arg-type]
        model_sample="19",
        item={"question": "12+7", "answer": "19"},
    )
    errors = result.metadata.errors
    assert not (errors.api_model_grader_server_error or errors.python_grader_runtime_error)
    if kind in ("score_model", "label_model"):
        # The judge is the base behind /v1/chat/completions: the same messages (with the
        # system message that states the answer's form) give the same greedy answer.
        usage = result.model_grader_token_usage_per_model["base"]
        assert usage["completion_tokens"] > 0  # type: ignore[index]
        form = (
            "Answer with one number from 0 to 1000, the score, and nothing else."
            if kind == "score_model"
            else "Answer with exactly one of these labels and nothing else: 19, 20"
        )
        reply = client.chat.completions.create(
            model="base",
            messages=[{"role": "system", "content": form}, {"role": "user", "content": "Q: 12+7"}],
            temperature=0,
            max_tokens=6,
        )
        text = reply.choices[0].message.content or ""
        found = re.search(r"\d+(?:\.\d+)?", text)
        if kind == "score_model":
            expected = float(found.group()) if found and float(found.group()) <= 1000 else None
        else:
            expected = {"19": 1.0, "20": 0.0}.get(found.group() if found else "")
        if expected is None:
            assert errors.api_model_grader_parse_error and result.reward == 0.0, text
        else:
            assert result.reward == expected and not errors.api_model_grader_parse_error, text
    else:
        assert result.reward == pytest.approx(1.0)


def test_files_round_trip_on_a_real_server(client: openai.OpenAI, tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "12+7"}], "answer": "19"}] * 3
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    uploaded = client.files.create(file=("t.jsonl", io.BytesIO(data)), purpose="fine-tune")
    assert uploaded.status == "processed"
    assert client.files.content(uploaded.id).content == data
    assert client.files.delete(uploaded.id).deleted


ROWS = [
    {"messages": [{"role": "user", "content": f"{a}+{b}"}], "answer": str(a + b)}
    for a, b in [(12, 7), (3, 4), (25, 30), (8, 8), (41, 2), (6, 60), (9, 9), (15, 5)]
]
MULTI = {
    "type": "multi",
    "name": "arith",
    "graders": {
        "exact": {
            "type": "string_check",
            "name": "exact",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "eq",
        },
        "contains": {
            "type": "python",
            "name": "contains",
            "source": "def grade(sample, item):\n    return 1.0 if item['answer'] in sample['output_text'] else 0.0\n",
        },
    },
    "calculate_output": "0.5 * exact + 0.5 * contains",
}
TERMINAL = ("succeeded", "failed", "cancelled")


def wait_for(client: openai.OpenAI, job_id: str, statuses: tuple[str, ...]) -> Any:
    """The job once its status is one of `statuses` (bounded: ~5 minutes)."""
    for _ in range(1500):
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        assert job.status not in TERMINAL, (job.status, job.error)
        time.sleep(0.2)
    pytest.fail(f"job {job_id} is still {job.status}")


def method(**hyperparameters: Any) -> Any:
    return {
        "type": "reinforcement",
        "reinforcement": {"grader": MULTI, "hyperparameters": hyperparameters},
    }


def test_an_rft_job_trains_to_the_end_and_answers(client: openai.OpenAI) -> None:
    data = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    training = client.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="base",
        training_file=training.id,
        method=method(n_epochs=1, batch_size=2, compute_multiplier=0.25, eval_interval=2),
        suffix="arith",
        seed=3,
    )
    assert job.status in ("queued", "running")
    # Follow the events as a client would, until the job has finished.
    seen: dict[str, Any] = {}
    for _ in range(1500):  # bounded: ~5 minutes
        for event in client.fine_tuning.jobs.list_events(job.id, limit=100):
            seen.setdefault(event.id, event)
        if any(e.message == "The job has successfully completed" for e in seen.values()):
            break
        failed = [e.message for e in seen.values() if e.level == "error"]
        assert not failed, failed
        time.sleep(0.2)
    done = client.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded" and done.fine_tuned_model == f"ft:base:acme:arith:{job.id}"
    assert done.trained_tokens and done.finished_at is not None
    metrics = sorted(
        (e for e in seen.values() if e.type == "metrics"), key=lambda e: e.data["step"]
    )  # type: ignore[index]
    # 8 rows: 7 trained on in batches of 2 (4 steps), 1 held out for the evals.
    train_steps = [e.data for e in metrics if "reward_mean" in e.data]  # type: ignore[operator]
    assert [d["step"] for d in train_steps] == [1, 2, 3, 4]  # type: ignore[index]
    assert all(0.0 <= d["reward_mean"] <= 1.0 for d in train_steps)  # type: ignore[index]
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [4, 2]
    assert checkpoints[1].fine_tuned_model_checkpoint == f"{done.fine_tuned_model}:ckpt-step-2"
    assert done.fine_tuned_model is not None
    for model in (done.fine_tuned_model, checkpoints[1].fine_tuned_model_checkpoint):
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "12+7"}], max_tokens=6, temperature=0
        )
        assert answer.model == model and answer.choices[0].message.content is not None


def test_a_second_job_pauses_resumes_and_cancels(client: openai.OpenAI) -> None:
    data = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    training = client.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="base",
        training_file=training.id,
        method=method(n_epochs=100, batch_size=2, compute_multiplier=0.25),
    )
    wait_for(client, job.id, ("running",))
    assert client.fine_tuning.jobs.pause(job.id).status == "paused"
    resumed = client.fine_tuning.jobs.resume(job.id)
    assert resumed.status in ("queued", "running")
    wait_for(client, job.id, ("running",))
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.fine_tuned_model is None
    messages = [
        e.message
        for e in client.fine_tuning.jobs.list_events(job.id, limit=100)
        if e.type == "message"
    ]
    assert messages[0] == "Fine-tuning job cancelled"
    assert "Fine-tuning job paused" in messages and "Fine-tuning job resumed" in messages


@pytest.fixture(scope="module")
def globex(client: openai.OpenAI) -> openai.OpenAI:
    """A second tenant's client on the same server."""
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(f"{base}/v1/admin/tenants", json={"name": "globex"}, headers=admin)
    assert r.status_code == 201, r.text
    key = httpx.post(f"{base}/v1/admin/tenants/globex/keys", json={}, headers=admin).json()
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key["key"], max_retries=0, timeout=120)


def judged(model: str) -> dict[str, Any]:
    """A multi grader whose `judge` sub-grader asks `model` for a score (short answers)."""
    return {
        "type": "multi",
        "name": "judged",
        "graders": {
            "exact": MULTI["graders"]["exact"],  # type: ignore[index]
            "judge": {
                "type": "score_model",
                "name": "judge",
                "model": model,
                "input": [
                    {
                        "role": "user",
                        "content": "Is {{sample.output_text}} equal to {{item.answer}}?",
                    }
                ],
                "range": [0, 10],
                "sampling_params": {"temperature": 0, "max_completions_tokens": 4},
            },
        },
        "calculate_output": "0.5 * exact + 0.05 * judge",
    }


def test_an_rft_job_with_a_judge_trains_and_judges_are_the_owners(
    client: openai.OpenAI, globex: openai.OpenAI
) -> None:
    data = "".join(json.dumps(r) + "\n" for r in ROWS[:5]).encode()
    training = client.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune")
    hp = {"n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.25}
    grader = judged("base")
    job = client.fine_tuning.jobs.create(
        model="base",
        training_file=training.id,
        method={
            "type": "reinforcement",
            "reinforcement": {"grader": grader, "hyperparameters": hp},
        },  # type: ignore[typeddict-item]
        suffix="judged",
        seed=5,
    )
    done = wait_for(client, job.id, ("succeeded",))
    assert done.fine_tuned_model == f"ft:base:acme:judged:{job.id}"
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    rewards = [
        e.data["reward_mean"] for e in events if e.type == "metrics" and "reward_mean" in e.data
    ]  # type: ignore[index,operator]
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    # The results file holds the same per-step rewards.
    (results,) = done.result_files
    assert client.files.retrieve(results).purpose == "fine-tune-results"
    table = list(csv.DictReader(io.StringIO(client.files.content(results).content.decode())))
    train = [float(r["reward_mean"]) for r in table if r["reward_mean"]]
    assert sorted(train) == sorted(rewards)
    # Another tenant cannot judge with acme's model: 400 naming the field, no job made.
    theirs = globex.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as refused:
        globex.fine_tuning.jobs.create(
            model="base",
            training_file=theirs.id,
            method={
                "type": "reinforcement",
                "reinforcement": {"grader": judged(done.fine_tuned_model)},
            },  # type: ignore[typeddict-item,arg-type]
        )
    assert refused.value.param == "method.reinforcement.grader.graders.judge.model"
    assert refused.value.code == "model_not_found"
    assert "does not exist or you do not have access" in refused.value.message
    assert globex.fine_tuning.jobs.list().data == []
    # Its owner can: the job is created (and cancelled here).
    own = client.fine_tuning.jobs.create(
        model="base",
        training_file=training.id,
        method={
            "type": "reinforcement",
            "reinforcement": {"grader": judged(done.fine_tuned_model)},
        },  # type: ignore[typeddict-item,arg-type]
    )
    assert own.status in ("queued", "running")
    assert client.fine_tuning.jobs.cancel(own.id).status == "cancelled"
