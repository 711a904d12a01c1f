"""The job API over the real pipeline backend, in-process (TestClient, embedded base on
the CPU): a job runs to done with its steps, metrics and checkpoints visible through
the API; `keep_checkpoints` prunes rows and folders; pause, resume and cancel act on
the pipeline; deleting a finished job removes its folder; a restart resumes active
jobs from their checkpoints and keeps paused ones paused."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import delete, select

from helpers.service_support import ADMIN, Tenants
from marlaas.config.job import EngineSpec, PipelineSpec
from marlaas.pipeline.context import PipelineOptions
from marlaas.pipeline.runtime import PipelineRuntime
from marlaas.service.app import create_app, open_context
from marlaas.service.db import Database
from marlaas.service.models import Checkpoint, Job, JobEvent, Metric
from marlaas.service.pipeline_backend import PipelineBackend
from marlaas.service.settings import ServiceSettings
from marlaas.train.checkpoint import list_checkpoints

torch.set_num_threads(1)

SPEC = PipelineSpec(engine=EngineSpec(max_batch_size=32, max_rank=16))
CPU = PipelineOptions(device="cpu")


def tiny_job(name: str, steps: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "task": {"family": "reverse"},
        "steps": steps,
        "checkpoint_every": 1,
        "eval_episodes": 2,
        "lora": {"rank": 4},
        "algorithm": {"group_size": 2, "prompts_per_step": 2, "max_staleness": 1},
        "sampling": {"max_new_tokens": 8},
        **extra,
    }


class Servers:
    """Starts apps with the pipeline backend over the test's database; `stop` is the
    graceful shutdown (the lifespan's end), and every app still up stops at the end."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.up: list[TestClient] = []

    def start(self) -> TestClient:
        ctx, _ = open_context(self.settings)
        factory = PipelineBackend.factory(ctx.db, spec=SPEC, options=CPU)
        client = TestClient(create_app(ctx, factory))
        client.__enter__()
        self.up.append(client)
        return client

    def stop(self, client: TestClient) -> None:
        self.up.remove(client)
        client.__exit__(None, None, None)


@pytest.fixture
def servers(settings: ServiceSettings) -> Iterator[Servers]:
    servers = Servers(settings)
    yield servers
    for client in list(servers.up):
        servers.stop(client)


def runtime_of(client: TestClient) -> PipelineRuntime:
    backend = client.app.state.context.backend  # type: ignore[attr-defined]
    assert isinstance(backend, PipelineBackend)
    return client.portal.call(backend.ready)  # type: ignore[union-attr]


def stored_checkpoint_paths(client: TestClient, job_id: str) -> list[str]:
    db = client.app.state.context.db  # type: ignore[attr-defined]
    with db.transaction() as session:
        rows = session.scalars(
            select(Checkpoint.path).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)
        )
        return list(rows)


def wait_for(
    client: TestClient,
    headers: dict[str, str],
    job_id: str,
    check: Callable[[dict[str, Any]], bool],
) -> dict[str, Any]:
    """Poll the job until `check` holds (bounded: a stuck job fails the test)."""
    for _ in range(1200):
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}", headers=headers).json()
        if check(job):
            return job
        assert job["status"] != "failed", job
        time.sleep(0.1)
    pytest.fail(f"job {job_id} never reached the expected state: {job}")


def test_a_job_runs_to_done_through_the_api(servers: Servers, settings: ServiceSettings) -> None:
    client = servers.start()
    acme = Tenants(client).create("acme")
    r = client.post("/v1/jobs", json=tiny_job("rev", steps=3, eval_every=3), headers=acme)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = wait_for(client, acme, job_id, lambda j: j["status"] == "done")
    assert job["steps_done"] == 3 and job["failure_reason"] is None
    assert client.get("/readyz").json()["backend"] == "PipelineBackend"

    points = client.get(f"/v1/jobs/{job_id}/metrics", headers=acme).json()["points"]
    rewards = sorted(p["step"] for p in points if p["name"] == "reward_mean")
    assert rewards == [1, 2, 3]
    assert sorted(p["step"] for p in points if p["name"] == "eval_accuracy") == [0, 3]

    ckpts = client.get(f"/v1/jobs/{job_id}/checkpoints", headers=acme).json()["checkpoints"]
    assert [c["step"] for c in ckpts] == [1, 2, 3]
    assert all("reward_mean" in c["metrics"] for c in ckpts)
    # The database refers to each checkpoint's PEFT adapter, inside the artifact dir.
    for path in stored_checkpoint_paths(client, job_id):
        adapter = settings.artifact_dir / path
        assert (adapter / "adapter_config.json").is_file(), path
        assert (adapter / "adapter_model.safetensors").is_file()
    assert "eval_accuracy" in ckpts[-1]["metrics"]
    # The pipeline tenant is the job id: its final adapter lies under it.
    final = settings.artifact_dir / "pipeline" / "tenants" / job_id / "adapter"
    assert (final / "adapter_config.json").is_file()
    # The dashboard's device figure comes from the pipeline's device executor.
    usage = client.get("/v1/usage/device", params={"window_s": 600, "bin_s": 1}, headers=acme)
    assert usage.status_code == 200, usage.text
    device = usage.json()["device"]
    assert device and any(b["busy"] > 0 for b in device), usage.json()
    # Inference is served by the pipeline's own engine (one base per process): the job's
    # model answers, decoded by the pipeline's device executor.
    runtime = runtime_of(client)
    decoded = runtime.ctx.device.figures().tokens_sampled
    r = client.post(
        "/v1/completions",
        json={"model": job_id, "prompt": "Reverse: abc\n", "max_tokens": 4, "temperature": 0},
        headers=acme,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert runtime.ctx.device.figures().tokens_sampled > decoded
    # Streamed through the pipeline's request gate: the same text, token by token.
    body = {"model": job_id, "prompt": "Reverse: abc\n", "max_tokens": 4, "temperature": 0}
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=acme) as s:
        assert s.status_code == 200
        data = [x.removeprefix("data: ") for x in s.iter_lines() if x.startswith("data: ")]
    assert data[-1] == "[DONE]"
    streamed = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])
    assert streamed == r.json()["choices"][0]["text"]
    # Prometheus: the pipeline's device, stage and per-job figures, labelled by tenant.
    text = client.get("/metrics", headers=ADMIN).text
    assert f'marlaas_job_steps_trained{{job="{job_id}",tenant="acme"}} 3.0' in text, text
    generated = re.search(
        rf'^marlaas_job_tokens_generated_total{{job="{job_id}",tenant="acme"}} ([0-9.e+]+)$',
        text,
        re.M,
    )
    assert generated and float(generated.group(1)) > 0, text
    busy = re.search(r"^marlaas_device_busy_fraction ([0-9.e-]+)$", text, re.M)
    assert busy and 0.0 < float(busy.group(1)) <= 1.0
    assert 'marlaas_stage_busy_seconds_total{stage="train"}' in text
    assert "marlaas_tokens_sampled_total" in text
    # Same job name for another tenant: a different job, no clash in the pipeline.
    other = Tenants(client).create("other")
    r = client.post("/v1/jobs", json=tiny_job("rev", steps=2, keep_checkpoints=1), headers=other)
    assert r.status_code == 201, r.text
    other_id = r.json()["id"]
    wait_for(client, other, other_id, lambda j: j["status"] == "done")
    # Its keep_checkpoints: the older checkpoint's row and folder are gone.
    ckpts = client.get(f"/v1/jobs/{other_id}/checkpoints", headers=other).json()["checkpoints"]
    assert [c["step"] for c in ckpts] == [2]
    folders = settings.artifact_dir / "pipeline" / "tenants" / other_id / "checkpoints"
    assert [p.name for p in list_checkpoints(folders)] == ["ckpt-00000002"]
    # Deleting the done job removes its whole folder (checkpoints, final adapter); it
    # is no model any more; the other tenant's job of the same name is untouched.
    assert client.delete(f"/v1/jobs/{job_id}", headers=acme).status_code == 204
    assert not (settings.artifact_dir / "pipeline" / "tenants" / job_id).exists()
    assert stored_checkpoint_paths(client, job_id) == []
    r = client.post("/v1/completions", json=body, headers=acme)
    assert r.status_code == 404, r.text
    assert [m["id"] for m in client.get("/v1/models", headers=acme).json()["data"]] == ["base"]
    assert client.get(f"/v1/jobs/{other_id}/checkpoints", headers=other).json()["checkpoints"]
    assert (settings.artifact_dir / "pipeline" / "tenants" / other_id / "adapter").is_dir()


def test_pause_resume_cancel_act_on_the_pipeline(servers: Servers) -> None:
    client = servers.start()
    acme = Tenants(client).create("acme")
    a = client.post("/v1/jobs", json=tiny_job("a", steps=40), headers=acme).json()["id"]
    b = client.post("/v1/jobs", json=tiny_job("b", steps=40), headers=acme).json()["id"]
    runtime = runtime_of(client)
    wait_for(client, acme, a, lambda j: j["status"] == "running" and j["steps_done"] >= 1)

    r = client.post(f"/v1/jobs/{a}/pause", headers=acme)
    assert r.status_code == 200 and r.json()["status"] == "paused"
    assert runtime.state(a).status == "paused"
    r = client.post(f"/v1/jobs/{a}/resume", headers=acme)
    assert r.status_code == 200
    assert runtime.state(a).status == "running"
    at = client.get(f"/v1/jobs/{a}", headers=acme).json()["steps_done"]
    wait_for(client, acme, a, lambda j: j["status"] == "running" and j["steps_done"] > at)

    r = client.post(f"/v1/jobs/{b}/cancel", headers=acme)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    client.portal.call(runtime.wait, b)  # type: ignore[union-attr]
    assert runtime.state(b).status == "cancelled"
    assert client.get(f"/v1/jobs/{b}", headers=acme).json()["status"] == "cancelled"
    # A running job cannot be deleted; the cancelled one can, with its files.
    assert client.delete(f"/v1/jobs/{a}", headers=acme).status_code == 409
    assert client.delete(f"/v1/jobs/{b}", headers=acme).status_code == 204
    artifacts = client.app.state.context.settings.artifact_dir  # type: ignore[attr-defined]
    assert not (artifacts / "pipeline" / "tenants" / b).exists()
    assert (artifacts / "pipeline" / "tenants" / a).is_dir()
    at = client.get(f"/v1/jobs/{a}", headers=acme).json()["steps_done"]
    wait_for(client, acme, a, lambda j: j["steps_done"] > at)  # a trains on


def test_a_restart_resumes_active_jobs_and_keeps_paused_ones_paused(
    servers: Servers, settings: ServiceSettings, caplog: pytest.LogCaptureFixture
) -> None:
    client = servers.start()
    acme = Tenants(client).create("acme")
    # Long enough not to finish before the stop (its steps take tens of ms each).
    steps_wanted = 20
    run = client.post("/v1/jobs", json=tiny_job("run", steps=steps_wanted), headers=acme).json()[
        "id"
    ]
    held = client.post("/v1/jobs", json=tiny_job("held", steps=2), headers=acme).json()["id"]
    assert client.post(f"/v1/jobs/{held}/pause", headers=acme).status_code == 200
    wait_for(client, acme, run, lambda j: j["steps_done"] >= 1)
    servers.stop(client)  # graceful: checkpoints the step each job reached

    db = Database(settings.database_url)
    try:
        with db.transaction() as session:
            job = session.get(Job, run)
            assert job is not None
            status, done = job.status, job.steps_done
            steps = session.scalars(
                select(Checkpoint.step).where(Checkpoint.job_id == run).order_by(Checkpoint.step)
            ).all()
            # A crash between writing the last checkpoint and recording it and its
            # step's figures: the next start records both from the disk (once) before
            # the job goes on from that step (which it does not train again).
            session.execute(
                delete(Checkpoint).where(Checkpoint.job_id == run, Checkpoint.step == done)
            )
            lost = session.execute(
                delete(Metric).where(Metric.job_id == run, Metric.step == done)
            ).rowcount
            session.execute(
                delete(JobEvent).where(
                    JobEvent.job_id == run,
                    JobEvent.kind == "step",
                    JobEvent.data["step"].as_integer() == done,
                )
            )
    finally:
        db.close()
    assert status == "running"  # stopped by the server, not by the tenant
    assert 1 <= done < steps_wanted and steps[-1] == done  # the step reached is checkpointed

    with caplog.at_level(logging.INFO, logger="marlaas.service.pipeline_backend"):
        client = servers.start()
        job_out = wait_for(client, acme, run, lambda j: j["status"] == "done")
    assert f"job {run} resumed from its checkpoint at step {done}" in caplog.text
    assert job_out["steps_done"] == steps_wanted
    assert lost > 0
    ckpts = client.get(f"/v1/jobs/{run}/checkpoints", headers=acme).json()["checkpoints"]
    assert [c["step"] for c in ckpts] == list(range(1, steps_wanted + 1))
    assert {"reward_mean", "loss"} <= set(ckpts[done - 1]["metrics"])  # as reported at first
    points = client.get(f"/v1/jobs/{run}/metrics", headers=acme).json()["points"]
    for name in ("reward_mean", "loss", "grad_norm"):  # every step's figures, once
        assert sorted(p["step"] for p in points if p["name"] == name) == list(
            range(1, steps_wanted + 1)
        ), name
    assert runtime_of(client).state(held).status == "queued"  # paused before admission
    assert client.get(f"/v1/jobs/{held}", headers=acme).json()["status"] == "paused"
    client.post(f"/v1/jobs/{held}/resume", headers=acme)
    job_out = wait_for(client, acme, held, lambda j: j["status"] == "done")
    assert job_out["steps_done"] == 2
