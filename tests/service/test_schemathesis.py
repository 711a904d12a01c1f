"""Schemathesis against a real `marlaas serve` (the API alone, SQLite, a loopback
port): every check (no 5xx, status codes, content types, headers and bodies as the
schema says, schema-valid requests accepted, invalid ones refused, `Allow` on 405s),
over the examples, coverage and fuzzing phases, bounded in examples per operation and
seeded, so that a run is reproducible and takes about a minute.

A tenant's key drives the tenant and OpenAI routes, the admin key the admin routes and
`/metrics`. Three operations validate beyond what a JSON schema can state, and there
answer schema-valid requests with the documented error (this is configured, per
operation, nowhere else):
- `POST /v1/jobs`: 422 for a family that does not exist, a dataset not uploaded, a job
  the served model and engine cannot run (see `service.admission`);
- `PUT /v1/datasets/{name}`: 422 for a body that is not JSONL;
- the completions: 400 for options that are not supported (tools, best_of != n, ...);
- the OpenAI fine-tuning routes: 400 in OpenAI's error shape, as OpenAI's API answers,
  for what their schema leaves open (a grader's fields by its type, a file's JSONL, a
  multipart upload's parts), and for a job 422 of the job checks as `POST /v1/jobs`;
  the checkpoint permissions routes answer every request 400 (not supported);
- the Tinker-compatible routes (`/api/v1/...`): 400 for what the SDK's bodies carry
  beyond their schema (a `tinker://` path's or a model id's form, a run's state), and
  410 for a heartbeat of a session that has finished or never was (the SDK stops on it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ADMIN_KEY = "schemathesis-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
#: Test cases per operation and phase, and the seed: the run's bounds.
MAX_EXAMPLES = 10
SEED = 18

CONFIG = """
# Any body may exceed the body limit: a schema-violating one too is refused with 413.
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]

[[operations]]
include-name = "POST /v1/jobs"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422", "429"]

[[operations]]
include-name = "PUT /v1/datasets/{name}"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "413", "422", "429"]

[[operations]]
include-name = ["POST /v1/completions", "POST /v1/chat/completions"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429", "503"]

[[operations]]
include-name = ["POST /v1/files", "POST /v1/fine_tuning/alpha/graders/run", "POST /v1/fine_tuning/alpha/graders/validate"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "413", "429"]

[[operations]]
include-name = "POST /v1/fine_tuning/jobs"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "422", "429"]

[[operations]]
include-path-regex = "^/v1/fine_tuning/checkpoints/"
checks.positive_data_acceptance.expected-statuses = ["400", "401", "403"]

[[operations]]
include-path-regex = "^/api/v1/"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "410", "413", "429"]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _schemathesis(
    config: Path, url: str, key: str, *filters: str
) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).parent / "schemathesis"
    argv = [str(binary), "--config-file", str(config), "run", f"{url}/openapi.json"]
    argv += ["-H", f"Authorization: Bearer {key}", "--checks", "all", "--workers", "1"]
    argv += ["--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--request-timeout", "60"]
    argv += ["--phases", "examples,coverage,fuzzing", *filters]
    # In the test's folder: schemathesis writes its cache where it runs.
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=config.parent)


def test_the_api_keeps_its_schema_under_schemathesis(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "MARLAAS_DB_URL"}
    env.update(MARLAAS_ADMIN_KEY=ADMIN_KEY, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "marlaas.cli", "serve", "--no-backend", "--port", str(port)]
    argv += ["--data-dir", str(tmp_path / "data"), "--log-level", "warning"]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(600):  # bounded: ~60 s
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        # Generous quotas, so that fuzzing reaches the checks behind them; a small
        # inference budget, so that generated completions stay short.
        quotas = {"max_concurrent_jobs": 10_000, "max_total_steps": 10**11}
        quotas["max_inference_tokens"] = 256
        r = httpx.post(
            f"{url}/v1/admin/tenants", json={"name": "fuzz", "quotas": quotas}, headers=ADMIN
        )
        assert r.status_code == 201, r.text
        key = httpx.post(f"{url}/v1/admin/tenants/fuzz/keys", json={}, headers=ADMIN).json()["key"]
        config = tmp_path / "schemathesis.toml"
        config.write_text(CONFIG)
        for who, filters in (
            (key, ("--exclude-path-regex", "^/(v1/admin|metrics)")),
            (ADMIN_KEY, ("--include-path-regex", "^/(v1/admin|metrics)")),
        ):
            run = _schemathesis(config, url, who, *filters)
            summary = run.stdout[run.stdout.find("SUMMARY") :]
            assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
            assert "Tested:" in summary and "failures" not in summary, summary
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    served = log.read_text()
    assert "Traceback" not in served, served[-4000:]
