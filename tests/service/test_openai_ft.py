"""OpenAI-compatible fine-tuning driven by the official `openai` client against a real
uvicorn server on a loopback port: the Files API, RFT jobs (created as ordinary marlaas
jobs, followed through their events and checkpoints, their `ft:` models answering chat
completions), pause / resume / cancel, OpenAI's error shape for bad input, and tenant
isolation.

The jobs run on a scripted backend whose checkpoints hold real PEFT adapters (see
`live_support`), so what is tested here is the API and its mapping onto marlaas jobs;
`test_openai_rft_serve.py` drives a real `marlaas serve`.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from openai_ft_support import MULTI, ROWS, Served, jsonl, rft, serving, upload
from sqlalchemy import select

import marlaas.service.openai_ft.files as openai_files
from marlaas.config.graders import OpenAIGraderSpec
from marlaas.config.job import DatasetSpec, JobSpec
from marlaas.service.models import Dataset, File


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("rft")) as s:
        yield s


def test_rft_job_runs_as_a_marlaas_job_and_serves_its_model(served: Served) -> None:
    client = served.acme
    train = upload(client, jsonl(ROWS))
    assert (train.status, train.bytes, train.purpose) == (
        "processed",
        len(jsonl(ROWS)),
        "fine-tune",
    )
    assert client.files.content(train.id).content == jsonl(ROWS)
    served.backend.hold_at = None
    job = client.fine_tuning.jobs.create(
        model="base",
        training_file=train.id,
        method=rft(
            n_epochs=2,
            batch_size=3,
            learning_rate_multiplier=0.5,
            compute_multiplier=0.5,
            eval_interval=2,
        ),  # type: ignore[arg-type]
        seed=7,
        suffix="arith",
        metadata={"team": "math"},
    )
    # The scripted backend ran it while the job was created.
    assert job.status == "succeeded"
    assert job.fine_tuned_model == f"ft:base:acme:arith:{job.id}"
    assert (job.seed, job.training_file, job.metadata) == (7, train.id, {"team": "math"})
    hp = job.method.reinforcement.hyperparameters  # type: ignore[union-attr]
    # 10 rows: 9 train, 1 held out; 2 epochs of 9 rows in batches of 3.
    assert (hp.n_epochs, hp.batch_size, hp.eval_interval, hp.eval_samples) == (2, 3, 2, 1)
    assert job.hyperparameters.n_epochs == 2 and job.trained_tokens is not None

    spec = served.backend.specs[job.id]
    assert isinstance(spec, JobSpec) and isinstance(spec.task, DatasetSpec)
    assert spec.steps == 6 and spec.eval_every == 2 and spec.checkpoint_every == 2
    assert spec.algorithm.prompts_per_step == 3 and spec.algorithm.group_size == 4
    assert spec.algorithm.learning_rate == pytest.approx(1.5e-4)
    assert spec.seed == 7 and Path(spec.task.path).is_file()
    assert isinstance(spec.task.grader, OpenAIGraderSpec)
    assert spec.task.grader.grader.type == "multi"
    # The same job through the native API.
    native = httpx.get(
        f"{served.url}/v1/jobs/{job.id}", headers={"Authorization": f"Bearer {client.api_key}"}
    )
    assert native.status_code == 200 and native.json()["status"] == "done"

    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    assert events[0].message == "The job has successfully completed"
    assert [e.created_at for e in events] == sorted((e.created_at for e in events), reverse=True)
    metrics = [e for e in events if e.type == "metrics"]
    assert sorted(e.data["step"] for e in metrics) == [1, 2, 3, 4, 5, 6]  # type: ignore[index]
    assert all(e.data["total_steps"] == 6 for e in metrics)  # type: ignore[index]
    older = client.fine_tuning.jobs.list_events(job.id, limit=2, after=events[1].id)
    assert [e.id for e in older.data] == [events[2].id, events[3].id]

    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert [c.step_number for c in checkpoints] == [6, 4, 2]
    assert checkpoints[0].fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-6"
    assert checkpoints[0].metrics.step == 6 and checkpoints[0].fine_tuning_job_id == job.id

    question = [{"role": "user", "content": "Q: 3+4"}]
    final = client.chat.completions.create(
        model=job.fine_tuned_model, messages=question, max_tokens=6, temperature=0
    )  # type: ignore[arg-type]
    step2 = client.chat.completions.create(
        model=checkpoints[2].fine_tuned_model_checkpoint,
        messages=question,
        max_tokens=6,
        temperature=0,
    )  # type: ignore[arg-type]
    by_id = client.chat.completions.create(
        model=job.id, messages=question, max_tokens=6, temperature=0
    )  # type: ignore[arg-type]
    assert final.model == job.fine_tuned_model
    assert final.choices[0].message.content == by_id.choices[0].message.content
    assert step2.choices[0].message.content is not None
    text = client.completions.create(model=job.fine_tuned_model, prompt="Q: 3+4\nA: ", max_tokens=4)  # type: ignore[arg-type]
    assert text.model == job.fine_tuned_model

    models = [m.id for m in client.models.list()]
    assert models.index(job.fine_tuned_model) == models.index(job.id) + 1
    assert f"{job.fine_tuned_model}:ckpt-step-2" in models
    assert client.models.retrieve(job.fine_tuned_model).id == job.fine_tuned_model  # type: ignore[arg-type]

    assert client.fine_tuning.jobs.list(limit=1).data[0].id == job.id  # newest first
    listed = client.fine_tuning.jobs.list(metadata={"team": "math"})
    assert job.id in [j.id for j in listed.data]
    assert job.id not in [
        j.id for j in client.fine_tuning.jobs.list(metadata={"team": "other"}).data
    ]


def test_pause_resume_and_cancel_a_second_job(served: Served) -> None:
    client = served.acme
    train = upload(client, jsonl(ROWS))
    served.backend.hold_at = 1
    job = client.fine_tuning.jobs.create(model="base", training_file=train.id, method=rft())  # type: ignore[arg-type]
    assert job.status == "running" and job.fine_tuned_model is None and job.finished_at is None
    assert client.fine_tuning.jobs.pause(job.id).status == "paused"
    with pytest.raises(openai.ConflictError) as conflict:
        client.fine_tuning.jobs.pause(job.id)
    assert "cannot pause" in conflict.value.message
    assert client.fine_tuning.jobs.resume(job.id).status == "running"
    with pytest.raises(openai.ConflictError):  # an active job trains on it
        client.files.delete(train.id)
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id)]
    assert messages[:4] == [
        "Fine-tuning job cancelled",
        "Fine-tuning job started",
        "Fine-tuning job resumed",
        "Fine-tuning job paused",
    ]
    assert [c for c, j in served.backend.calls if j == job.id] == [
        "submit",
        "pause",
        "resume",
        "cancel",
    ]
    deleted = client.files.delete(train.id)
    assert deleted.deleted and deleted.id == train.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(train.id)


def test_errors_answer_in_openais_shape(served: Served) -> None:
    client = served.acme
    bad = upload(
        client, b'{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": 3}\n', "bad.jsonl"
    )
    assert bad.status == "error"
    assert bad.status_details == "line 2: 'messages' must be a non-empty list of chat messages"
    with pytest.raises(openai.BadRequestError) as caught:
        client.fine_tuning.jobs.create(model="base", training_file=bad.id, method=rft())  # type: ignore[arg-type]
    assert caught.value.param == "training_file" and "line 2" in caught.value.message
    assert caught.value.type == "invalid_request_error"
    good = upload(client, jsonl(ROWS))
    answered = upload(
        client,
        jsonl(
            [
                {
                    "messages": [
                        {"role": "user", "content": "a"},
                        {"role": "assistant", "content": "b"},
                    ]
                }
            ]
        ),
    )
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {"method": rft({"type": "exact_match", "name": "x"})},
            "method.reinforcement.grader.type",
            "unknown grader type 'exact_match'",
        ),
        (
            {"method": rft({**MULTI["graders"]["exact"], "reference": "{{item.answer"})},
            "method.reinforcement.grader.reference",
            "unclosed '{{'",
        ),
        (
            {"method": rft({**MULTI["graders"]["exact"], "reference": "{{row.answer}}"})},
            "method.reinforcement.grader.reference",
            "namespace 'row'",
        ),
        ({"model": "gpt-4o-mini-2024-07-18"}, "model", "not available for fine-tuning"),
        (
            {"method": rft(reasoning_effort="high")},
            "method.reinforcement.hyperparameters.reasoning_effort",
            "cannot be honoured",
        ),
        (
            {"method": rft(n_epochs=0)},
            "method.reinforcement.hyperparameters.n_epochs",
            "must be 'auto' or an integer from 1 to 1000, got 0",
        ),
        (
            {"method": {"type": "dpo", "dpo": {}}},
            "method.type",
            "dpo method is not supported",
        ),
        ({"training_file": "file-nope"}, "training_file", "no file 'file-nope'"),
        ({"training_file": answered.id}, "training_file", "must end with the user"),
        ({"suffix": "a:b"}, "suffix", "pattern"),
        (
            {"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]},
            "integrations",
            "not supported",
        ),
        (
            {
                "method": rft(
                    {
                        "type": "score_model",
                        "name": "j",
                        "model": "ft:base:globex::job_0123456789abcdef",
                        "input": [{"role": "user", "content": "x"}],
                    }
                )
            },
            "method.reinforcement.grader.model",
            "does not exist or you do not have access to it",
        ),
    ]
    for change, param, fragment in cases:
        body: dict[str, Any] = {
            "model": "base",
            "training_file": good.id,
            "method": rft(),
            **change,
        }
        with pytest.raises(openai.BadRequestError) as caught:
            client.fine_tuning.jobs.create(**body)
        assert caught.value.param == param, (change, caught.value.message)
        assert fragment in caught.value.message, (change, caught.value.message)
    with pytest.raises(openai.BadRequestError) as unknown:
        client.fine_tuning.jobs.create(
            model="base", training_file=good.id, method=rft(), extra_body={"learning_rate": 1}
        )  # type: ignore[arg-type]
    assert unknown.value.param == "learning_rate" and "never ignores" in unknown.value.message
    with pytest.raises(openai.NotFoundError) as model:
        client.chat.completions.create(
            model="ft:base:acme::job_0123456789abcdef", messages=[{"role": "user", "content": "x"}]
        )
    assert model.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as purpose:
        client.files.create(file=("x.jsonl", io.BytesIO(jsonl(ROWS))), purpose="batch")
    assert purpose.value.param == "purpose"
    http = httpx.post(
        f"{served.url}/v1/fine_tuning/alpha/graders/validate",
        json={"grader": {"type": "nope", "name": "x"}},
        headers={"Authorization": f"Bearer {client.api_key}"},
    )
    assert http.status_code == 400
    assert http.json() == {
        "error": {
            "message": "grader.type: unknown grader type 'nope'; use one of string_check, text_similarity, python, score_model, label_model, multi",
            "type": "invalid_request_error",
            "param": "grader.type",
            "code": None,
        }
    }


def test_rft_needs_a_base_with_a_chat_template(served: Served) -> None:
    """RFT prompts are chat messages: a served base whose tokenizer has no chat template
    (the embedded base's) is refused when the job is created, naming `model`."""
    client = served.acme
    train = upload(client, jsonl(ROWS))
    plain = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None))
    served.ctx.inference = plain  # type: ignore[assignment]
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            client.fine_tuning.jobs.create(model="base", training_file=train.id, method=rft())  # type: ignore[arg-type]
    finally:
        served.ctx.inference = None
    assert caught.value.param == "model" and "no chat template" in caught.value.message


def test_a_bad_key_is_an_authentication_error(served: Served) -> None:
    stranger = openai.OpenAI(base_url=f"{served.url}/v1", api_key="mk_wrong", max_retries=0)
    for call in (stranger.files.list, stranger.fine_tuning.jobs.list):
        with pytest.raises(openai.AuthenticationError) as caught:
            call()
        assert caught.value.code == "invalid_api_key"


def test_another_tenants_files_jobs_and_models_are_not_found(served: Served) -> None:
    acme, globex = served.acme, served.globex
    train = upload(acme, jsonl(ROWS))
    served.backend.hold_at = None
    job = acme.fine_tuning.jobs.create(
        model="base", training_file=train.id, method=rft(), suffix="iso"
    )  # type: ignore[arg-type]
    assert job.fine_tuned_model is not None
    for call in (
        lambda: globex.files.retrieve(train.id),
        lambda: globex.files.content(train.id),
        lambda: globex.files.delete(train.id),
        lambda: globex.fine_tuning.jobs.retrieve(job.id),
        lambda: globex.fine_tuning.jobs.cancel(job.id),
        lambda: globex.fine_tuning.jobs.list_events(job.id),
        lambda: globex.fine_tuning.jobs.checkpoints.list(job.id),
        lambda: globex.chat.completions.create(
            model=job.fine_tuned_model, messages=[{"role": "user", "content": "x"}]
        ),  # type: ignore[arg-type]
        lambda: globex.models.retrieve(job.fine_tuned_model),  # type: ignore[arg-type]
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    # The tenant's own name with another tenant spelled in it is not found either.
    spoofed = job.fine_tuned_model.replace(":acme:", ":globex:")
    with pytest.raises(openai.NotFoundError):
        acme.chat.completions.create(model=spoofed, messages=[{"role": "user", "content": "x"}])
    assert train.id not in [f.id for f in globex.files.list()]
    assert job.id not in [j.id for j in globex.fine_tuning.jobs.list()]
    with pytest.raises(openai.BadRequestError) as caught:
        globex.fine_tuning.jobs.create(model="base", training_file=train.id, method=rft())  # type: ignore[arg-type]
    assert caught.value.param == "training_file"


def test_a_file_expires_its_lifetime_after_its_creation(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`expires_after` is anchored at the file's `created_at`, whatever time passes while
    the upload arrives: a clock that moves 0.7 s between any two readings (a second's
    boundary crossed between them) still gives created_at + seconds exactly."""
    # Days ago (the file has expired by the next request, so it lists before none of
    # the module's other files), half a second past a whole one.
    start = (datetime.now(UTC) - timedelta(days=2)).replace(microsecond=500_000)
    readings = iter(range(10_000))
    monkeypatch.setattr(
        openai_files, "utcnow", lambda: start + timedelta(seconds=0.7 * next(readings))
    )
    made = served.globex.files.create(
        file=("life.jsonl", io.BytesIO(jsonl(ROWS[:2]))),
        purpose="fine-tune",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert made.expires_at == made.created_at + 3600


def test_files_list_pages_and_expire(served: Served) -> None:
    client = served.globex
    ids = [upload(client, jsonl(ROWS[:2]), f"f{i}.jsonl").id for i in range(3)]
    newest_first = [f.id for f in client.files.list(purpose="fine-tune")]
    assert newest_first[:3] == ids[::-1]
    page = client.files.list(limit=1, after=ids[2])
    assert [f.id for f in page.data] == [ids[1]] and page.has_more
    oldest_first = [f.id for f in client.files.list(order="asc")]
    assert oldest_first.index(ids[0]) < oldest_first.index(ids[2])
    expiring = client.files.create(
        file=("e.jsonl", io.BytesIO(jsonl(ROWS[:2]))),
        purpose="fine-tune",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert expiring.expires_at == expiring.created_at + 3600
    with served.db.transaction() as session:  # an hour later
        row = session.get(File, expiring.id)
        assert row is not None
        row.expires_at = datetime.now(UTC) - timedelta(seconds=1)
        stored = session.scalars(select(Dataset.path).where(Dataset.name == expiring.id)).one()
    assert (served.data_dir / "artifacts" / stored).is_file()
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(expiring.id)
    assert expiring.id not in [f.id for f in client.files.list()]  # and its bytes are gone
    with served.db.transaction() as session:
        assert session.get(File, expiring.id) is None
        assert session.scalars(select(Dataset).where(Dataset.name == expiring.id)).all() == []
    assert not (served.data_dir / "artifacts" / stored).exists()
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(
            file=("e.jsonl", io.BytesIO(b"{}")),
            purpose="fine-tune",
            expires_after={"anchor": "created_at", "seconds": 5},
        )
    assert caught.value.param == "expires_after.seconds"


def test_a_validation_file_is_the_jobs_eval_set(served: Served) -> None:
    client = served.acme
    train, held = upload(client, jsonl(ROWS)), upload(client, jsonl(ROWS[:3]), "valid.jsonl")
    served.backend.hold_at = 1
    job = client.fine_tuning.jobs.create(
        model="base",
        training_file=train.id,
        validation_file=held.id,
        method=rft(eval_samples=50),  # type: ignore[arg-type]
    )
    assert job.validation_file == held.id
    assert job.method.reinforcement.hyperparameters.eval_samples == 3  # type: ignore[union-attr]
    task = served.backend.specs[job.id].task
    assert isinstance(task, DatasetSpec) and task.eval_fraction == 0.0
    assert task.eval_path is not None and Path(task.eval_path).read_bytes() == jsonl(ROWS[:3])
    with pytest.raises(openai.ConflictError):  # the active job evaluates on it
        client.files.delete(held.id)
    client.fine_tuning.jobs.cancel(job.id)
    assert client.files.delete(held.id).deleted
    # Iterating a page of one follows the cursor through every job, newest first (this
    # test's two at least, whatever other tests of the module made).
    newest = client.fine_tuning.jobs.create(model="base", training_file=train.id, method=rft())  # type: ignore[arg-type]
    client.fine_tuning.jobs.cancel(newest.id)
    everything = [j.id for j in client.fine_tuning.jobs.list(limit=100).data]
    assert len(everything) >= 2 and everything[:2] == [newest.id, job.id]
    assert [j.id for j in client.fine_tuning.jobs.list(limit=1)] == everything
