"""Crash recovery of `marlaas serve` with the pipeline backend, as real processes on a
loopback port over SQLite in a temporary data directory.

- SIGKILL in the middle of training three jobs, start again: every job resumes from its
  last checkpoint and completes with all its steps; no job is lost or duplicated, each
  job's checkpoints are strictly increasing without repeats, the final adapter is a
  PEFT directory.
- SIGTERM: the server exits cleanly after writing a checkpoint of the step each running
  job had reached, and leaves the jobs active for the next start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

ADMIN_KEY = "crash-test-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def tiny_job(name: str, family: str, steps: int) -> dict[str, Any]:
    return {
        "name": name,
        "task": {"family": family},
        "steps": steps,
        "checkpoint_every": 1,
        "eval_episodes": 2,
        "lora": {"rank": 4},
        "algorithm": {"group_size": 2, "prompts_per_step": 2, "max_staleness": 1},
        "sampling": {"max_new_tokens": 8},
    }


class Server:
    """One `marlaas serve` process over `data_dir` (its output in `log`)."""

    def __init__(self, data_dir: Path, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self.base = f"http://127.0.0.1:{port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if k != "MARLAAS_DB_URL"}
        env.update(MARLAAS_ADMIN_KEY=ADMIN_KEY, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        argv = [sys.executable, "-m", "marlaas.cli", "serve", "--port", str(port)]
        argv += ["--data-dir", str(data_dir), "--device", "cpu", "--log-level", "info"]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._wait(lambda: httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200)

    def _wait(self, check: Callable[[], bool], limit: int = 600) -> None:
        for _ in range(limit):  # bounded: ~60 s
            if self.proc.poll() is not None:
                pytest.fail(f"marlaas serve exited early:\n{self.log.read_text()}")
            try:
                if check():
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"marlaas serve did not get there:\n{self.log.read_text()}")

    def get(self, path: str, headers: dict[str, str]) -> Any:
        r = httpx.get(f"{self.base}{path}", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        r = httpx.post(f"{self.base}{path}", json=body, headers=headers, timeout=10)
        assert r.status_code == 201, r.text
        return r.json()

    def until(self, check: Callable[[], bool]) -> None:
        self._wait(check, limit=1200)

    def stop(self, sig: signal.Signals) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[[], Server]]:
    """Starts servers on one data directory; any still running is killed at the end."""
    started: list[Server] = []

    def start() -> Server:
        server = Server(tmp_path / "data", tmp_path / "serve.log")
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)


def make_tenant(server: Server) -> dict[str, str]:
    server.post("/v1/admin/tenants", {"name": "acme"}, ADMIN)
    key = server.post("/v1/admin/tenants/acme/keys", {}, ADMIN)["key"]
    return {"Authorization": f"Bearer {key}"}


def stored(data_dir: Path) -> tuple[dict[str, tuple[str, int, int]], dict[str, list[int]]]:
    """From the database: job id -> (status, steps, steps done); job id -> checkpoint
    steps in insertion order."""
    with sqlite3.connect(data_dir / "marlaas.db") as db:
        jobs = {
            i: (s, n, d)
            for i, s, n, d in db.execute("SELECT id, status, steps, steps_done FROM jobs")
        }
        ckpts: dict[str, list[int]] = {i: [] for i in jobs}
        for job_id, step in db.execute("SELECT job_id, step FROM checkpoints ORDER BY id"):
            ckpts[job_id].append(step)
    return jobs, ckpts


def on_disk(data_dir: Path, job_id: str) -> list[int]:
    root = data_dir / "artifacts" / "pipeline" / "tenants" / job_id / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in root.glob("ckpt-*")) if root.is_dir() else []


def test_sigkill_mid_training_then_every_job_resumes_and_completes(
    servers: Callable[[], Server], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    first = servers()
    acme = make_tenant(first)
    # Long enough that the kill lands mid-training (the steps take tens of ms each).
    specs = [("rev", "reverse", 16), ("arith", "arithmetic", 16), ("rev2", "reverse", 20)]
    ids = [first.post("/v1/jobs", tiny_job(n, f, s), acme)["id"] for n, f, s in specs]

    def mid_training() -> bool:
        jobs = [first.get(f"/v1/jobs/{i}", acme) for i in ids]
        some_checkpoint = any(
            first.get(f"/v1/jobs/{i}/checkpoints", acme)["checkpoints"] for i in ids
        )
        return some_checkpoint and any(
            j["status"] == "running" and j["steps_done"] < j["steps"] for j in jobs
        )

    first.until(mid_training)
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    before_jobs, before_ckpts = stored(data)
    assert any(before_ckpts.values())
    assert any(before_jobs[i][2] < before_jobs[i][1] for i in ids)  # killed mid-training

    second = servers()
    second.until(lambda: all(second.get(f"/v1/jobs/{i}", acme)["status"] == "done" for i in ids))
    listed = second.get("/v1/jobs", acme)["jobs"]
    assert sorted(j["id"] for j in listed) == sorted(ids)  # none lost, none duplicated
    after_jobs, after_ckpts = stored(data)
    assert sorted(after_jobs) == sorted(ids)
    for job_id, (_, _, steps) in zip(ids, specs, strict=True):
        status, want, done = after_jobs[job_id]
        assert (status, want, done) == ("done", steps, steps)
        got = after_ckpts[job_id]
        assert got == sorted(set(got)), got  # strictly increasing, no repeats
        assert got[: len(before_ckpts[job_id])] == before_ckpts[job_id]  # nothing rewritten
        assert got[-1] == steps and on_disk(data, job_id)[-1] == steps
        api = second.get(f"/v1/jobs/{job_id}/checkpoints", acme)["checkpoints"]
        assert [c["step"] for c in api] == got
        # Steps trained again after the restart replaced their metrics: one per step.
        points = second.get(f"/v1/jobs/{job_id}/metrics", acme)["points"]
        rewards = [p["step"] for p in points if p["name"] == "reward_mean"]
        assert sorted(rewards) == list(range(1, steps + 1)), rewards
        final = data / "artifacts" / "pipeline" / "tenants" / job_id / "adapter"
        config = json.loads((final / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == 4
        assert (final / "adapter_model.safetensors").stat().st_size > 0
    # Jobs that had a checkpoint were restored from it, not started afresh.
    log = (tmp_path / "serve.log").read_text()
    for job_id in ids:
        if before_ckpts[job_id]:
            assert f"job {job_id} resumed from its checkpoint at step" in log, log


def test_sigterm_checkpoints_running_jobs_and_exits_cleanly(
    servers: Callable[[], Server], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    server = servers()
    acme = make_tenant(server)
    ids = [server.post("/v1/jobs", tiny_job(n, "reverse", 400), acme)["id"] for n in ("a", "b")]
    server.until(lambda: all(server.get(f"/v1/jobs/{i}", acme)["steps_done"] >= 1 for i in ids))
    assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM), server.log.read_text()
    assert "Application shutdown complete" in server.log.read_text()
    jobs, ckpts = stored(data)
    for job_id in ids:
        status, steps, done = jobs[job_id]
        assert status == "running" and 1 <= done < steps  # active: the next start resumes it
        assert ckpts[job_id][-1] == done  # a checkpoint of the step it had reached
        assert on_disk(data, job_id)[-1] == done
