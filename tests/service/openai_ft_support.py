"""Helpers of the OpenAI fine-tuning tests: a live service whose scripted backend can
hold jobs (so they can be paused, resumed and cancelled), two tenants' `openai`
clients, and RFT files, graders and methods."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers.live_support import AdapterBackend, LiveServer, make_tenant_key
from helpers.service_support import ADMIN_KEY
from marlaas.model.base import default_base_path
from marlaas.service.app import create_app, open_context
from marlaas.service.context import ServiceContext
from marlaas.service.db import Database
from marlaas.service.lifecycle import JobStatus
from marlaas.service.settings import QuotaSpec, ServiceSettings

ROWS = [
    {"messages": [{"role": "user", "content": f"Q: {a}+{b}"}], "answer": str(a + b)}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1), (4, 4), (6, 3), (8, 1), (5, 5)]
]
PYTHON_SOURCE = (
    "def grade(sample, item):\n    return 1.0 if item['answer'] in sample['output_text'] else 0.0\n"
)
MULTI = {
    "type": "multi",
    "name": "arith",
    "graders": {
        "exact": {
            "type": "string_check",
            "name": "exact",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "eq",
        },
        "contains": {"type": "python", "name": "contains", "source": PYTHON_SOURCE},
    },
    "calculate_output": "0.5 * exact + 0.5 * contains",
}


class HoldingBackend(AdapterBackend):
    """The scripted backend; `hold_at` holds new jobs at that step, and a resumed job
    runs again without finishing, so a job can be paused, resumed and cancelled."""

    async def unpause(self, job_id: str) -> None:
        self.calls.append(("resume", job_id))
        await self._reporter.status(job_id, JobStatus.RUNNING)


@dataclass
class Served:
    url: str
    acme: openai.OpenAI
    globex: openai.OpenAI
    backend: HoldingBackend
    db: Database
    data_dir: Path
    ctx: ServiceContext


#: The embedded base's prompt format as a chat template: system text as it is, user
#: turns `Q: ...`, assistant turns `A: ...`, one line each.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}Q: {% elif m['role'] == 'assistant' %}A: {% endif %}"
    "{{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)


def chat_base(where: Path) -> Path:
    """A copy of the embedded base whose tokenizer has `CHAT_TEMPLATE`."""
    shutil.copytree(default_base_path(), where)
    config = where / "tokenizer_config.json"
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "chat_template": CHAT_TEMPLATE})
    )
    return where


@contextmanager
def serving(data_dir: Path) -> Iterator[Served]:
    """The service on `data_dir` (the embedded base with a chat template, which the job
    checks read) with tenants acme and globex."""
    settings = ServiceSettings(
        data_dir=data_dir,
        serve_base_model=chat_base(data_dir / "chat-base"),
        admin_key=ADMIN_KEY,
        default_quotas=QuotaSpec(max_concurrent_jobs=8, max_total_steps=1000),
    )
    ctx, _ = open_context(settings)
    backend = HoldingBackend()
    with LiveServer(create_app(ctx, backend.attach)) as server:

        def client(name: str) -> openai.OpenAI:
            key = make_tenant_key(server.url, name)
            return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)

        yield Served(server.url, client("acme"), client("globex"), backend, ctx.db, data_dir, ctx)


def jsonl(rows: list[Any]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def upload(client: openai.OpenAI, data: bytes, name: str = "train.jsonl") -> Any:
    return client.files.create(file=(name, io.BytesIO(data)), purpose="fine-tune")


def rft(grader: dict[str, Any] = MULTI, **hyperparameters: Any) -> dict[str, Any]:
    return {
        "type": "reinforcement",
        "reinforcement": {"grader": grader, "hyperparameters": hyperparameters},
    }


SERVE_ADMIN_KEY = "rft-serve-admin-key-0123456789"


@contextmanager
def serve_marlaas(root: Path) -> Iterator[openai.OpenAI]:
    """A real `marlaas serve` process on a loopback port (the in-process pipeline
    backend, SQLite under `root`, the embedded base with `CHAT_TEMPLATE`), and the
    `openai` client of its tenant `acme`."""
    base_model = chat_base(root / "base")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "MARLAAS_DB_URL"}
    env.update(MARLAAS_ADMIN_KEY=SERVE_ADMIN_KEY, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    argv = [sys.executable, "-m", "marlaas.cli", "serve", "--port", str(port)]
    argv += ["--data-dir", str(root / "data"), "--device", "cpu"]
    argv += ["--base-model", str(base_model)]
    log = root / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(600):  # bounded: ~60 s
            if proc.poll() is not None:
                pytest.fail(f"marlaas serve exited early:\n{log.read_text()}")
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail(f"marlaas serve did not become ready:\n{log.read_text()}")
        admin = {"Authorization": f"Bearer {SERVE_ADMIN_KEY}"}
        r = httpx.post(f"{base}/v1/admin/tenants", json={"name": "acme"}, headers=admin)
        assert r.status_code == 201, r.text
        key = httpx.post(f"{base}/v1/admin/tenants/acme/keys", json={}, headers=admin).json()
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=key["key"], max_retries=0, timeout=120)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
