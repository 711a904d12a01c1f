"""OpenAI-compatible supervised fine-tuning on a real `marlaas serve` process, driven by
the official `openai` client only: a chat JSONL uploaded, a `method: supervised` job
followed through its events to `succeeded` (OpenAI's SFT metric names), its
checkpoints, results file and `ft:` model answering; and malformed SFT files refused
with the line and the field."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai_ft_support import serve_marlaas

pytestmark = pytest.mark.slow

ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Add the numbers."},
            {"role": "user", "content": f"{a}+{b}"},
            {"role": "assistant", "content": f"{a + b}"},
        ]
    }
    for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3), (4, 4), (7, 1), (2, 5), (3, 3)]
]
#: A row whose first answer is context only (OpenAI's `weight: 0`).
WEIGHTED = {
    "messages": [
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "11", "weight": 0},
        {"role": "user", "content": "no, add them"},
        {"role": "assistant", "content": "2"},
    ]
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with serve_marlaas(tmp_path_factory.mktemp("serve-sft")) as served:
        yield served


def upload(client: openai.OpenAI, rows: list[Any]) -> Any:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    return client.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune")


def test_a_supervised_job_trains_to_the_end_and_answers(client: openai.OpenAI) -> None:
    training = upload(client, [*ROWS, WEIGHTED])
    hp = {"n_epochs": 2, "batch_size": 3, "learning_rate_multiplier": 10}
    method: Any = {"type": "supervised", "supervised": {"hyperparameters": hp}}
    job = client.fine_tuning.jobs.create(
        model="base",
        training_file=training.id,
        method=method,
        suffix="adder",
        seed=4,
    )
    assert job.method is not None and job.method.type == "supervised"
    assert job.hyperparameters.batch_size == 3 and job.hyperparameters.n_epochs == 2
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
    assert done.status == "succeeded" and done.fine_tuned_model == f"ft:base:acme:adder:{job.id}"
    assert done.trained_tokens
    data = [e.data for e in seen.values() if e.type == "metrics"]
    # 10 rows: 9 trained on in batches of 3 (3 steps an epoch, 2 epochs), 1 held out.
    train = sorted((d for d in data if "train_loss" in d), key=lambda d: d["step"])  # type: ignore[index,operator]
    assert [d["step"] for d in train] == [1, 2, 3, 4, 5, 6]  # type: ignore[index]
    assert all(0.0 <= d["train_mean_token_accuracy"] <= 1.0 for d in train)  # type: ignore[index]
    evals = {d["step"]: d for d in data if "valid_loss" in d}  # type: ignore[index,operator]
    assert sorted(evals) == [0, 3, 6]  # before, after the first epoch, at the end
    assert all(d["full_valid_loss"] == d["valid_loss"] for d in evals.values())  # type: ignore[index]
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [6, 3]
    last = checkpoints[0].metrics
    assert last.train_loss is not None and last.train_mean_token_accuracy is not None
    assert last.valid_loss == evals[6]["valid_loss"]  # type: ignore[index]
    (results,) = done.result_files
    table = list(csv.DictReader(io.StringIO(client.files.content(results).content.decode())))
    assert [float(r["train_loss"]) for r in table if r["train_loss"]] == pytest.approx(
        [d["train_loss"] for d in train]  # type: ignore[index]
    )
    assert done.fine_tuned_model is not None
    for model in (done.fine_tuned_model, checkpoints[1].fine_tuned_model_checkpoint):
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "2+3"}], max_tokens=4, temperature=0
        )
        assert answer.model == model and answer.choices[0].message.content is not None


def test_malformed_supervised_files_name_the_line(client: openai.OpenAI) -> None:
    bad_role = upload(client, [ROWS[0], {"messages": [{"role": "robot", "content": "hi"}]}])
    checked = client.files.retrieve(bad_role.id)
    assert checked.status == "error"
    assert (
        checked.status_details is not None and "line 2: messages[0].role" in checked.status_details
    )
    no_answer = upload(client, [ROWS[0], {"messages": [{"role": "user", "content": "1+2"}]}])
    assert client.files.retrieve(no_answer.id).status == "processed"  # a valid chat file
    with pytest.raises(openai.BadRequestError) as refused:
        client.fine_tuning.jobs.create(
            model="base", training_file=no_answer.id, method={"type": "supervised"}
        )
    assert refused.value.param == "training_file"
    assert "line 2: messages has no assistant message to train on" in refused.value.message
    unknown_hp: Any = {"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}}
    with pytest.raises(openai.BadRequestError) as unknown:
        client.fine_tuning.jobs.create(model="base", training_file=no_answer.id, method=unknown_hp)
    assert unknown.value.param == "method.supervised.hyperparameters.beta"
    assert "unknown field" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as dpo:
        client.fine_tuning.jobs.create(
            model="base", training_file=no_answer.id, method={"type": "dpo"}
        )
    assert dpo.value.param == "method.type" and "dpo method is not supported" in dpo.value.message
