"""What an outside tester broke, against real `marlaas serve` processes (the pipeline
on the embedded base, SQLite, a loopback port):

- a job stored by an older server with an unbounded ask (`group_size: 1000000`) is
  failed at the next start, with the field in its reason, and the server serves; it was
  resumed and blocked the event loop, so the server never answered again;
- an abandoned inference request stops using the engine, so other tenants' completions
  are served; it ran on for minutes after its client hung up;
- SIGTERM ends the process within the issue's 10 s while a job trains and a long
  completion is in flight, after checkpointing the job; uvicorn waited for the
  completion (the two share one server, to start fewer).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

ADMIN_KEY = "hardening-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
#: The issue's bound on a shutdown, whatever runs.
SHUTDOWN_S = 10.0


class Serve:
    """One `marlaas serve` process over `data_dir`."""

    def __init__(self, data_dir: Path, log: Path, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if k != "MARLAAS_DB_URL"}
        env.update(MARLAAS_ADMIN_KEY=ADMIN_KEY, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        argv = [sys.executable, "-m", "marlaas.cli", "serve", "--port", str(self.port)]
        argv += ["--data-dir", str(data_dir), "--device", "cpu", "--log-level", "info", *extra]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.until(lambda: httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200)

    def until(self, check: Callable[[], bool], what: str = "the server") -> None:
        for _ in range(1200):  # bounded: ~2 min on a loaded machine
            assert self.proc.poll() is None, f"marlaas serve exited:\n{self.log.read_text()}"
            try:
                if check():
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log.read_text()[-3000:]}")

    def tenant(self, name: str) -> dict[str, str]:
        r = httpx.post(f"{self.url}/v1/admin/tenants", json={"name": name}, headers=ADMIN)
        assert r.status_code == 201, r.text
        key = httpx.post(f"{self.url}/v1/admin/tenants/{name}/keys", json={}, headers=ADMIN)
        return {"Authorization": f"Bearer {key.json()['key']}"}

    def engine_rows(self) -> float:
        text = httpx.get(f"{self.url}/metrics", headers=ADMIN, timeout=10).text
        found = re.search(r"^marlaas_engine_rows (\S+)$", text, re.M)
        return float(found.group(1)) if found else -1.0


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Serve]]:
    started: list[Serve] = []

    def start(*extra: str) -> Serve:
        server = Serve(tmp_path / "data", tmp_path / "serve.log", *extra)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)


def _job(name: str, steps: int = 3, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "task": {"family": "reverse"},
        "steps": steps,
        "eval_episodes": 2,
        "lora": {"rank": 4},
        "algorithm": {"group_size": 2, "prompts_per_step": 2},
        "sampling": {"max_new_tokens": 8},
        **extra,
    }


def test_an_unbounded_job_stored_by_an_older_server_fails_at_start(
    serve: Callable[..., Serve], tmp_path: Path
) -> None:
    first = serve("--no-backend")
    acme = first.tenant("acme")
    big = httpx.post(f"{first.url}/v1/jobs", json=_job("big"), headers=acme).json()["id"]
    ok = httpx.post(f"{first.url}/v1/jobs", json=_job("ok"), headers=acme).json()["id"]
    first.proc.send_signal(signal.SIGTERM)
    first.proc.wait(timeout=30)
    # What an older server accepted, and stored as running.
    with sqlite3.connect(tmp_path / "data" / "marlaas.db") as db:
        (raw,) = db.execute("SELECT spec FROM jobs WHERE id = ?", (big,)).fetchone()
        spec = json.loads(raw)
        spec["algorithm"]["group_size"] = 1_000_000
        db.execute(
            "UPDATE jobs SET spec = ?, status = 'running' WHERE id = ?", (json.dumps(spec), big)
        )
    second = serve()
    second.until(
        lambda: httpx.get(f"{second.url}/v1/jobs/{big}", headers=acme).json()["status"] == "failed",
        "the stored job to fail",
    )
    job = httpx.get(f"{second.url}/v1/jobs/{big}", headers=acme).json()
    assert "group_size" in job["failure_reason"] and str(tmp_path) not in job["failure_reason"]
    assert job["spec"]["algorithm"]["group_size"] == 1_000_000  # shown as stored
    listed = httpx.get(f"{second.url}/v1/jobs", headers=acme)
    assert listed.status_code == 200 and len(listed.json()["jobs"]) == 2
    # The other job trains on the same server.
    second.until(
        lambda: httpx.get(f"{second.url}/v1/jobs/{ok}", headers=acme).json()["steps_done"] >= 1,
        "the other job to train",
    )
    assert httpx.get(f"{second.url}/healthz", timeout=10).status_code == 200


def _hang_up(url: str, headers: dict[str, str], body: dict[str, Any]) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: {headers['Authorization']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + data)
    return sock


def test_abandoned_inference_frees_the_engine_and_sigterm_ends_within_10_s(
    serve: Callable[..., Serve], tmp_path: Path
) -> None:
    """One server: an oversized completion is refused; the largest allowed one, whose
    client hangs up, leaves the engine and another tenant is served; then, with a job
    training and a long completion in flight, SIGTERM ends the process within 10 s
    after checkpointing the job."""
    server = serve()
    acme, globex = server.tenant("acme"), server.tenant("globex")
    prompt = "Q: reverse hello\nA: "
    huge = {"model": "base", "prompt": [prompt] * 2000, "n": 16, "max_tokens": 200}
    r = httpx.post(f"{server.url}/v1/completions", json=huge, headers=acme, timeout=60)
    assert r.status_code == 400 and "engine runs at most 64" in r.json()["error"]["message"]
    # The largest request acme may send: 64 rows x 1024 tokens; then it hangs up.
    big = {"model": "base", "prompt": [prompt] * 4, "n": 16, "max_tokens": 1024}
    sock = _hang_up(server.url, acme, big)
    server.until(lambda: server.engine_rows() >= 32, "the big request to run")
    sock.close()
    server.until(lambda: server.engine_rows() == 0, "the abandoned rows to be aborted")
    small = {"model": "base", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=small, headers=globex, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1

    # The tenant's whole step quota (10,000): still training when SIGTERM comes however
    # fast the trainer gets (200 steps once ran to the end inside this test's window).
    r = httpx.post(
        f"{server.url}/v1/jobs", json=_job("long", steps=10_000, checkpoint_every=50), headers=acme
    )
    jid = r.json()["id"]
    server.until(
        lambda: httpx.get(f"{server.url}/v1/jobs/{jid}", headers=acme).json()["steps_done"] >= 1,
        "the job to train",
    )
    # Twenty-four tenants' largest completions (64 rows each, the engine's 64 rows in
    # all): 24 waves of ~230 decode iterations one after another, ~0.25 s a wave on this
    # CPU at its fastest (eight waves fitted in the window once the decoder layers ran in
    # one native call), so together they outlast the 3 s graceful window and the
    # shutdown must cut at least one of them rather than wait for it.
    answers: list[int] = []

    def complete(headers: dict[str, str]) -> None:
        try:
            r = httpx.post(f"{server.url}/v1/completions", json=big, headers=headers, timeout=120)
            answers.append(r.status_code)
        except httpx.HTTPError:
            answers.append(-1)

    clients = [
        threading.Thread(target=complete, args=(who,), daemon=True)
        for who in (acme, globex, *(server.tenant(f"tenant-{i}") for i in range(22)))
    ]
    for client in clients:
        client.start()
    server.until(lambda: server.engine_rows() >= 32, "the completions to run")
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=60)
    took = time.monotonic() - start
    assert code in (0, -signal.SIGTERM), server.log.read_text()[-3000:]
    assert took <= SHUTDOWN_S, f"SIGTERM took {took:.1f} s:\n{server.log.read_text()[-3000:]}"
    for client in clients:
        client.join(timeout=30)
    assert len(answers) == len(clients) and any(a != 200 for a in answers)  # cut, not waited
    with sqlite3.connect(tmp_path / "data" / "marlaas.db") as db:
        status, done = db.execute(
            "SELECT status, steps_done FROM jobs WHERE id = ?", (jid,)
        ).fetchone()
        steps = [s for (s,) in db.execute("SELECT step FROM checkpoints WHERE job_id = ?", (jid,))]
    assert status == "running" and done >= 1  # left active: the next start resumes it
    assert steps and steps[-1] == done  # a checkpoint of the step it had reached
