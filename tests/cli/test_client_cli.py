"""The tenant's CLI commands against a real uvicorn server (loopback, free port) with the
scripted test backend: submit (and --wait), jobs, show, logs (-f), pause / resume /
cancel, delete, checkpoints, download; one subprocess run shows a bad key as one error
line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers.live_support import Service, running_service
from marlaas.cli.main import app


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    with running_service(tmp_path / "data") as svc:
        yield svc


@pytest.fixture
def cli(service: Service) -> CliRunner:
    return CliRunner(
        env={"MARLAAS_URL": service.url, "MARLAAS_API_KEY": service.acme, "COLUMNS": "200"}
    )


def _ok(cli: CliRunner, *args: str, input: str | None = None) -> str:
    result = cli.invoke(app, list(args), input=input)
    assert result.exit_code == 0, f"{args}: {result.output}\n{result.exception!r}"
    return result.output


def test_submit_wait_then_inspect_logs_and_download(
    cli: CliRunner, service: Service, tmp_path: Path
) -> None:
    job_file = tmp_path / "jobs.yaml"
    job_file.write_text(
        "jobs:\n"
        "  - {name: alpha, task: {family: arithmetic}, steps: 3, checkpoint_every: 2}\n"
        "  - {name: beta, task: {family: reverse}, steps: 2}\n"
    )
    out = _ok(cli, "submit", str(job_file), "--wait")
    assert "submitted" in out and "finished" in out and out.count("done") >= 2
    listed = json.loads(_ok(cli, "jobs", "--json"))
    assert [(j["name"], j["status"]) for j in listed] == [("beta", "done"), ("alpha", "done")]
    alpha = listed[1]["id"]
    table = _ok(cli, "jobs")
    assert alpha in table and "3/3" in table

    shown = _ok(cli, "show", alpha)
    assert "alpha" in shown and "reward=0.3" in shown and "2, 3" in shown

    logs = _ok(cli, "logs", alpha)
    lines = [line for line in logs.splitlines() if "#" in line]
    assert "status queued" in lines[0] and "status done" in lines[-1]
    assert any("step 2  loss=0.5 reward=0.2" in line for line in lines)
    assert any("checkpoint at step 2" in line for line in lines)
    followed = _ok(cli, "logs", "-f", alpha)
    assert "status done" in followed and "ended: done" in followed

    ckpts = _ok(cli, "checkpoints", alpha)
    assert "reward=0.2" in ckpts and "reward=0.3" in ckpts

    out_dir = tmp_path / "adapter"
    got = _ok(cli, "download", alpha, "--version", "2", "--out", str(out_dir))
    assert "step 2" in got
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    result = cli.invoke(app, ["download", alpha, "--out", str(out_dir)])
    assert result.exit_code != 0 and "already exists" in str(result.exception)


def test_pause_resume_cancel_and_follow_a_running_job(
    cli: CliRunner, service: Service, tmp_path: Path
) -> None:
    service.backend.hold_at = 1
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: held\ntask: {family: arithmetic}\nsteps: 2\n")
    _ok(cli, "submit", str(job_file))
    jid = json.loads(_ok(cli, "jobs", "--json"))[0]["id"]
    assert "paused" in _ok(cli, "pause", jid)
    assert "queued" in _ok(cli, "resume", jid)  # the scripted backend runs the rest
    assert "ended: done" in _ok(cli, "logs", "--follow", jid)

    other = tmp_path / "other.yaml"
    other.write_text("name: other\ntask: {family: arithmetic}\nsteps: 2\n")
    _ok(cli, "submit", str(other))
    oid = json.loads(_ok(cli, "jobs", "--json", "--status", "running"))[0]["id"]
    assert "cancelled" in _ok(cli, "cancel", oid)
    result = cli.invoke(app, ["cancel", oid])
    assert result.exit_code != 0 and "it is cancelled" in str(result.exception)
    assert "no checkpoints yet" in _ok(cli, "checkpoints", oid)


def test_delete_asks_first_and_only_takes_finished_jobs(
    cli: CliRunner, service: Service, tmp_path: Path
) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: old\ntask: {family: arithmetic}\nsteps: 2\n")
    _ok(cli, "submit", str(job_file), "--wait")
    jid = json.loads(_ok(cli, "jobs", "--json"))[0]["id"]
    files = service.app.state.context.settings.artifact_dir / "checkpoints" / jid
    assert files.is_dir()

    result = cli.invoke(app, ["delete", jid], input="n\n")
    said = " ".join(result.output.split())  # the console wraps at the terminal's width
    assert result.exit_code != 0 and "removes its checkpoints" in said
    assert "Delete it?" in result.output and files.is_dir()
    assert "deleted" in _ok(cli, "delete", jid, input="y\n") and not files.exists()
    result = cli.invoke(app, ["show", jid])
    assert result.exit_code != 0 and "no such job" in str(result.exception)
    assert "no jobs" in _ok(cli, "jobs")

    service.backend.hold_at = 1
    _ok(cli, "submit", str(job_file))  # the name is free again
    again = json.loads(_ok(cli, "jobs", "--json"))[0]["id"]
    result = cli.invoke(app, ["delete", again, "--yes"])
    assert result.exit_code != 0 and "cancel it first" in str(result.exception)
    _ok(cli, "cancel", again)
    assert f"job {again} (old) deleted" in _ok(cli, "delete", again, "--yes")


def test_a_bad_key_is_one_clear_error_line(service: Service) -> None:
    env = {**os.environ, "MARLAAS_URL": service.url, "MARLAAS_API_KEY": "mk_nope_nope"}
    proc = subprocess.run(
        [sys.executable, "-m", "marlaas.cli", "jobs"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: invalid API key; send `Authorization: Bearer mk_...` (HTTP 401)"
    ]
    env.pop("MARLAAS_API_KEY")
    proc = subprocess.run(
        [sys.executable, "-m", "marlaas.cli", "show", "job_1", "--url", service.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and "no API key" in proc.stderr and "MARLAAS_API_KEY" in proc.stderr
