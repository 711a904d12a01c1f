"""Smoke test of `marlaas serve`: a real uvicorn process on a loopback port prints the
generated admin key once, says it runs without a job backend, serves the API, and
stops on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from service_support import job_body


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    for _ in range(300):  # bounded: at most ~30 s
        if proc.poll() is not None:
            pytest.fail(f"marlaas serve exited early:\n{log.read_text()}")
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"marlaas serve did not become healthy:\n{log.read_text()}")


def test_serve_starts_without_backend_and_serves(tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("MARLAAS_ADMIN_KEY", "MARLAAS_DB_URL")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "marlaas.cli",
                "serve",
                "--no-backend",
                "--port",
                str(port),
                "--data-dir",
                str(tmp_path / "data"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc, log)
        text = log.read_text()
        assert "job backend: none" in text
        found = re.search(r"admin key \(shown once.*?\): (mk_\S+)", text)
        assert found, text
        admin = {"Authorization": f"Bearer {found.group(1)}"}
        r = httpx.post(f"{base}/v1/admin/tenants", json={"name": "acme"}, headers=admin)
        assert r.status_code == 201, r.text
        key = httpx.post(f"{base}/v1/admin/tenants/acme/keys", json={}, headers=admin).json()
        r = httpx.post(
            f"{base}/v1/jobs", json=job_body(), headers={"Authorization": f"Bearer {key['key']}"}
        )
        assert r.status_code == 201 and r.json()["status"] == "queued"
        assert httpx.get(f"{base}/readyz").json()["backend"] == "none"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # uvicorn shuts down gracefully, then re-raises SIGTERM as its exit status
    assert proc.returncode in (0, -signal.SIGTERM), log.read_text()
    assert "Application shutdown complete" in log.read_text()
    assert (tmp_path / "data" / "marlaas.db").is_file()
