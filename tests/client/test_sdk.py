"""The Python SDK against a real uvicorn server (loopback, free port) with the scripted
test backend: typed calls for the whole job API, live event streams that resume after a
cut, downloads PEFT loads, and errors that carry the server's message."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.live_support import Service, running_service
from marlaas.client import (
    AuthError,
    Client,
    ClientError,
    ConflictError,
    ConnectionFailed,
    JobEvent,
    NotFoundError,
    RequestInvalid,
)
from marlaas.config.job import JobSpec
from marlaas.errors import MarlaasError


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    with running_service(tmp_path / "data") as svc:
        yield svc


@pytest.fixture
def acme(service: Service) -> Iterator[Client]:
    with Client(service.url, service.acme) as client:
        yield client


def _label(event: JobEvent) -> str:
    if event.kind == "status":
        return f"status:{event.data['status']}"
    return f"{event.kind}:{event.data['step']}"


def test_submit_from_yaml_wait_inspect_and_download(acme: Client, tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: math\ntask: {family: arithmetic}\nsteps: 3\ncheckpoint_every: 2\n")
    job = acme.submit(job_file)
    assert job.name == "math" and job.job_spec.steps == 3
    seen: list[JobEvent] = []
    final = acme.wait(job.id, progress=seen.append)
    assert final.status == "done" and final.steps_done == 3 and final.terminal
    assert [_label(e) for e in seen][-1] == "status:done"
    assert [e.id for e in seen] == sorted({e.id for e in seen})

    assert [j.id for j in acme.jobs()] == [job.id]
    assert acme.jobs(status="running") == []
    assert acme.job(job.id) == final
    rewards = acme.metrics(job.id, names=["reward"])
    assert [(p.step, p.value) for p in rewards] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [c.step for c in acme.checkpoints(job.id)] == [2, 3]

    got = acme.download(job.id, tmp_path / "adapter-2", version=2)
    assert got.step == 2
    latest = acme.download(job.id, tmp_path / "adapter", fmt="zip")
    assert latest.step == 3
    assert sorted(p.name for p in latest.path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    from peft import PeftModel

    from marlaas.model.base import default_base_path, load_base

    base, _ = load_base(default_base_path())
    model = PeftModel.from_pretrained(base, str(latest.path))
    assert model.peft_config["default"].peft_type == "LORA"
    with pytest.raises(ClientError, match="already exists"):
        acme.download(job.id, latest.path)
    assert acme.download(job.id, latest.path, version=2, overwrite=True).step == 2


def test_events_follow_a_live_job_woken_by_notification(service: Service, acme: Client) -> None:
    service.notifier.poll_s = service.notifier.keepalive_s = 3600.0  # no polling
    service.backend.hold_at = 2
    job = acme.submit(JobSpec(name="live", task={"family": "arithmetic"}, steps=4))  # type: ignore[arg-type]
    stream = acme.events(job.id)
    history = [_label(next(stream)) for _ in range(4)]
    assert history == ["status:queued", "status:running", "step:1", "step:2"]
    # The stream now waits on the server; act from another connection.
    assert acme.pause(job.id).status == "paused"
    assert acme.resume(job.id).status == "queued"  # the backend then runs the rest
    rest = [_label(e) for e in stream]
    assert rest == [
        "status:paused",
        "status:queued",
        "status:running",
        "step:3",
        "step:4",
        "checkpoint:4",
        "status:done",
    ]


def test_a_cut_stream_resumes_after_the_last_event(service: Service, acme: Client) -> None:
    service.notifier.max_stream_s = 0.0  # every stream ends after what exists now
    service.backend.hold_at = 1
    job = acme.submit({"name": "cut", "task": {"family": "arithmetic"}, "steps": 2})
    stream = acme.events(job.id)
    assert [_label(next(stream)) for _ in range(3)] == [
        "status:queued",
        "status:running",
        "step:1",
    ]
    acme.pause(job.id)
    acme.resume(job.id)
    labels = [_label(e) for e in stream]
    assert labels == [
        "status:paused",
        "status:queued",
        "status:running",
        "step:2",
        "checkpoint:2",
        "status:done",
    ]
    assert [_label(e) for e in acme.events(job.id, follow=False)][-1] == "status:done"


def test_closing_a_stream_unsubscribes_it_on_the_server(service: Service, acme: Client) -> None:
    service.backend.hold_at = 1
    job = acme.submit({"name": "watched", "task": {"family": "arithmetic"}, "steps": 2})
    stream = acme.events(job.id)
    assert [_label(next(stream)) for _ in range(3)][-1] == "step:1"
    assert service.notifier.listeners(job.id) == 1
    stream.close()
    for _ in range(600):  # bounded: the server notices the disconnect
        if service.notifier.listeners(job.id) == 0:
            break
        time.sleep(0.05)
    assert service.notifier.listeners(job.id) == 0


def test_errors_carry_the_servers_message(service: Service, acme: Client) -> None:
    job = acme.submit({"name": "mine", "task": {"family": "arithmetic"}, "steps": 1})
    with Client(service.url, "mk_bad_key") as bad, pytest.raises(AuthError) as auth:
        bad.jobs()
    assert "invalid API key" in str(auth.value) and auth.value.status_code == 401
    assert isinstance(auth.value, MarlaasError)

    with Client(service.url, service.globex) as globex:
        with pytest.raises(NotFoundError, match="no such job"):
            globex.job(job.id)
        with pytest.raises(NotFoundError, match="no such job"):
            next(globex.events(job.id))
        with pytest.raises(NotFoundError, match="no such job"):
            globex.download(job.id, service_dir(service) / "stolen")
    with pytest.raises(ConflictError, match="it is done"):
        acme.cancel(job.id)
    with pytest.raises(RequestInvalid, match="steps") as invalid:
        acme.submit({"name": "bad", "task": {"family": "arithmetic"}, "steps": 0})
    assert invalid.value.status_code == 422
    with pytest.raises(ClientError, match="not a job id"):
        acme.job("../admin/tenants")


def test_delete_a_finished_job(service: Service, acme: Client) -> None:
    service.backend.hold_at = 1
    job = acme.submit(
        {"name": "old", "task": {"family": "arithmetic"}, "steps": 2, "checkpoint_every": 1}
    )
    with pytest.raises(ConflictError, match="it is running; cancel it first"):
        acme.delete_job(job.id)
    with (
        Client(service.url, service.globex) as globex,
        pytest.raises(NotFoundError, match="no such job"),
    ):
        globex.delete_job(job.id)
    acme.cancel(job.id)
    files = service_dir(service) / "artifacts" / "checkpoints" / job.id
    assert files.is_dir()
    assert acme.delete_job(job.id) is None
    assert not files.exists()
    with pytest.raises(NotFoundError, match="no such job"):
        acme.job(job.id)
    with pytest.raises(NotFoundError, match="no such job"):
        acme.delete_job(job.id)
    assert acme.jobs() == []
    with pytest.raises(ClientError, match="not a job id"):
        acme.delete_job("../admin/tenants")


def service_dir(service: Service) -> Path:
    return Path(service.app.state.context.settings.data_dir)


def test_configuration_errors_are_clear(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MARLAAS_API_KEY", raising=False)
    with pytest.raises(ClientError, match="no API key"):
        Client("http://127.0.0.1:1")
    with pytest.raises(ClientError, match="http://"):
        Client("127.0.0.1:8321", "mk_x_y")
    with (
        Client("http://127.0.0.1:1", "mk_x_y", timeout=2) as nowhere,
        pytest.raises(ConnectionFailed, match="cannot reach the marlaas server"),
    ):
        nowhere.jobs()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntask: {family: arithmetic}\nsteps: -1\n")
    with (
        Client("http://127.0.0.1:1", "mk_x_y") as client,
        pytest.raises(MarlaasError, match=r"bad.yaml: invalid job: steps"),
    ):
        client.submit(bad)
