"""Smoke test of `marlaas serve`: a real uvicorn process on a loopback port prints the
generated admin key once, says it runs without a job backend, serves the API, and
stops on SIGTERM. Bad `--backend` / `--ray-spec` input stops it before it starts, with
a message naming what to fix. (`--backend ray` itself runs in tests/distributed.)"""

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
from typer.testing import CliRunner

from helpers.service_support import job_body
from marlaas.cli.main import app
from marlaas.cli.serve_cmd import Backend, resolve_backend
from marlaas.config.ray import RaySpec


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


@pytest.mark.parametrize(
    ("args", "spec_text", "message"),
    [
        (["--backend", "gpu"], None, "'gpu' is not one of"),
        (["--no-backend", "--backend", "ray"], None, "--no-backend contradicts --backend ray"),
        (["--ray-spec", "SPEC"], "{}", "--ray-spec applies to --backend ray only"),
        (["--backend", "ray", "--ray-spec", "MISSING"], None, "cannot read the Ray spec"),
        (["--backend", "ray", "--ray-spec", "SPEC"], "engine_replicas: 0\n", "engine_replicas"),
        (["--backend", "ray", "--ray-spec", "SPEC"], "- 1\n", "expected a mapping"),
        (["--backend", "ray", "--ray-spec", "SPEC"], "spare: 1\n", "spare"),
    ],
)
def test_serve_rejects_bad_backend_options(
    tmp_path: Path, args: list[str], spec_text: str | None, message: str
) -> None:
    spec = tmp_path / "ray.yaml"
    if spec_text is not None:
        spec.write_text(spec_text)
    paths = {"SPEC": str(spec), "MISSING": str(tmp_path / "missing.yaml")}
    args = [paths.get(a, a) for a in args]
    data = tmp_path / "data"
    result = CliRunner().invoke(app, ["serve", "--data-dir", str(data), *args])
    assert result.exit_code != 0
    assert message in " ".join(f"{result.output} {result.exception}".split())
    assert not data.exists()  # stopped before opening the database


def test_serve_backend_ray_without_ray_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = CliRunner().invoke(app, ["serve", "--backend", "ray", "--data-dir", str(tmp_path)])
    assert result.exit_code != 0
    assert "pip install 'marlaas[ray]'" in str(result.exception)


def test_resolve_backend_reads_the_ray_spec(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    spec = tmp_path / "ray.yaml"
    spec.write_text("engine_replicas: 1\nenv_workers: 3\nengine: {num_cpus: 0}\n")
    chosen, ray = resolve_backend(Backend.ray, False, spec)
    assert chosen is Backend.ray and ray is not None
    assert (ray.engine_replicas, ray.env_workers, ray.engine.num_cpus) == (1, 3, 0)
    assert resolve_backend(Backend.ray, False, None) == (Backend.ray, RaySpec())
    assert resolve_backend(None, False, None) == (Backend.inprocess, None)
    assert resolve_backend(None, True, None) == (Backend.none, None)
    assert resolve_backend(Backend.none, True, None) == (Backend.none, None)
