"""OpenAI fine-tuning beyond the job itself, with the official `openai` client against a
real uvicorn server on a loopback port (the scripted backend of `openai_ft_support`):
whose models may judge a job's model graders, the results file of a succeeded job, and
checkpoint permissions, which marlaas refuses."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai_ft_support import MULTI, ROWS, Served, jsonl, rft, serving, upload


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("rft-more")) as s:
        yield s


def test_judges_are_models_of_the_jobs_owner(served: Served) -> None:
    """A job's score_model judge may be the base or the owner's model; another tenant's
    is refused before the job exists, in the OpenAI route (400) and the native one (422)."""
    acme, globex = served.acme, served.globex
    served.backend.hold_at = None
    mine = acme.fine_tuning.jobs.create(
        model="base", training_file=upload(acme, jsonl(ROWS)).id, method=rft()
    )  # type: ignore[arg-type]
    assert mine.status == "succeeded" and mine.fine_tuned_model is not None

    def judged(model: str) -> dict[str, Any]:
        judge = {
            "type": "score_model",
            "name": "judge",
            "model": model,
            "input": [{"role": "user", "content": "Is {{sample.output_text}} {{item.answer}}?"}],
            "range": [0, 1],
        }
        return {**MULTI, "graders": {**MULTI["graders"], "judge": judge}}  # type: ignore[dict-item]

    theirs = upload(globex, jsonl(ROWS))
    before = len(globex.fine_tuning.jobs.list().data)
    with pytest.raises(openai.BadRequestError) as refused:
        globex.fine_tuning.jobs.create(
            model="base", training_file=theirs.id, method=rft(judged(mine.fine_tuned_model))
        )  # type: ignore[arg-type]
    assert refused.value.param == "method.reinforcement.grader.graders.judge.model"
    assert "does not exist or you do not have access" in refused.value.message
    native = {
        "name": "judged",
        "steps": 1,
        "task": {
            "type": "dataset",
            "path": theirs.id,
            "format": "chat",
            "reference_field": None,
            "grader": {"type": "openai", "grader": judged(mine.fine_tuned_model)},
        },
    }
    auth = {"Authorization": f"Bearer {globex.api_key}"}
    r = httpx.post(f"{served.url}/v1/jobs", json=native, headers=auth)
    assert r.status_code == 422, r.text
    (problem,) = r.json()["detail"]
    assert problem["loc"] == ["body", "task", "grader", "grader", "graders", "judge", "model"]
    assert len(globex.fine_tuning.jobs.list().data) == before
    # The owner may judge with its own model, and anyone with the base.
    ok = acme.fine_tuning.jobs.create(
        model="base",
        training_file=upload(acme, jsonl(ROWS)).id,
        method=rft(judged(mine.fine_tuned_model)),
    )  # type: ignore[arg-type]
    assert ok.status == "succeeded"
    native["task"]["grader"]["grader"] = judged("base")  # type: ignore[index]
    r = httpx.post(f"{served.url}/v1/jobs", json=native, headers=auth)
    assert r.status_code == 201, r.text


def test_a_succeeded_job_has_a_results_file(served: Served) -> None:
    """The results CSV (per-step metrics) is one of the tenant's files, listed in the
    job's `result_files`; a job that did not succeed has none; others cannot read it."""
    client = served.acme
    served.backend.hold_at = None
    train = upload(client, jsonl(ROWS))
    job = client.fine_tuning.jobs.create(
        model="base", training_file=train.id, method=rft(batch_size=3)
    )  # type: ignore[arg-type]
    assert job.status == "succeeded" and len(job.result_files) == 1
    (file_id,) = job.result_files
    assert client.fine_tuning.jobs.retrieve(job.id).result_files == [file_id]
    info = client.files.retrieve(file_id)
    assert (info.purpose, info.status, info.filename) == (
        "fine-tune-results",
        "processed",
        "step_metrics.csv",
    )
    assert file_id in [f.id for f in client.files.list(purpose="fine-tune-results")]
    content = client.files.content(file_id).content
    assert info.bytes == len(content)
    rows = list(csv.DictReader(io.StringIO(content.decode())))
    # The scripted backend's metrics: 3 steps (9 rows in batches of 3), reward step/10.
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert [float(r["reward"]) for r in rows] == [0.1, 0.2, 0.3]
    assert [float(r["loss"]) for r in rows] == [1.0, 0.5, 1 / 3]
    events = client.fine_tuning.jobs.list_events(job.id, limit=100)
    by_step = {e.data["step"]: e.data["reward"] for e in events if e.type == "metrics"}  # type: ignore[index]
    assert by_step == {int(r["step"]): float(r["reward"]) for r in rows}
    with pytest.raises(openai.NotFoundError):
        served.globex.files.content(file_id)
    served.backend.hold_at = 1
    held = client.fine_tuning.jobs.create(model="base", training_file=train.id, method=rft())  # type: ignore[arg-type]
    assert client.fine_tuning.jobs.cancel(held.id).result_files == []


@pytest.mark.filterwarnings("ignore:Retrieve is deprecated:DeprecationWarning")  # the SDK's
def test_checkpoint_permissions_are_refused_saying_why(served: Served) -> None:
    client = served.acme
    served.backend.hold_at = None
    job = client.fine_tuning.jobs.create(
        model="base", training_file=upload(client, jsonl(ROWS)).id, method=rft(batch_size=9)
    )  # type: ignore[arg-type]
    (ckpt,) = client.fine_tuning.jobs.checkpoints.list(job.id).data
    name = ckpt.fine_tuned_model_checkpoint
    permissions = client.fine_tuning.checkpoints.permissions
    calls = [
        lambda: permissions.create(name, project_ids=["proj_globex"]),
        lambda: permissions.retrieve(name),
        lambda: permissions.list(name),
        lambda: permissions.delete("cp_1", fine_tuned_model_checkpoint=name),
        # Another tenant's checkpoint answers alike: nothing about it is told.
        lambda: served.globex.fine_tuning.checkpoints.permissions.list(name),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == "fine_tuned_model_checkpoint"
        assert refused.value.code == "unsupported_feature"
        assert "checkpoint permissions are not supported" in refused.value.message
        assert "PEFT adapter" in refused.value.message
    stranger = openai.OpenAI(base_url=f"{served.url}/v1", api_key="mk_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.fine_tuning.checkpoints.permissions.list(name)
