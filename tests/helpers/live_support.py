"""Helpers of the event, download, SDK and CLI tests: a scripted backend whose
checkpoints hold real PEFT adapters for the embedded base, a real uvicorn server on a
free loopback port in a thread, and SSE parsing of a whole answer."""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn
from fastapi import FastAPI

from helpers.service_support import ADMIN, ADMIN_KEY, ScriptedBackend
from marlaas.client import sse
from marlaas.config.specs import LoRASpec
from marlaas.model.base import default_base_path, load_base
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.model.peft_io import save_peft
from marlaas.service.app import create_app, open_context
from marlaas.service.lifecycle import JobStatus
from marlaas.service.reporter import JobReporter
from marlaas.service.settings import QuotaSpec, ServiceSettings

ADAPTER_SPEC = LoRASpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


@functools.cache
def _adapter_shapes() -> dict[str, tuple[torch.Size, torch.Size]]:
    base, _ = load_base(default_base_path())
    model = LoRAModel(base, max_rank=8)
    return {p: (a.shape, b.shape) for p, (a, b) in model.init_adapter(ADAPTER_SPEC, 0).items()}


def adapter_at(step: int) -> AdapterTensors:
    """The adapter the test backend writes at `step`: random A and B (so it changes the
    model's output), deterministic in `step`."""
    g = torch.Generator().manual_seed(step)
    return {
        p: (torch.randn(a, generator=g) * 0.1, torch.randn(b, generator=g) * 0.1)
        for p, (a, b) in sorted(_adapter_shapes().items())
    }


class _AdapterWritingReporter:
    """The app's reporter, except that a checkpoint first gets an `adapter/` in PEFT
    format inside it (the layout of `marlaas.train.checkpoint`)."""

    def __init__(self, inner: JobReporter) -> None:
        self._inner = inner
        self.artifact_dir = inner.artifact_dir

    async def status(self, job_id: str, status: JobStatus, reason: str | None = None) -> bool:
        return await self._inner.status(job_id, status, reason)

    async def step(self, job_id: str, step: int, metrics: Mapping[str, float | None]) -> None:
        await self._inner.step(job_id, step, metrics)

    async def checkpoint(
        self, job_id: str, step: int, path: Path, metrics: Mapping[str, float | None]
    ) -> None:
        save_peft(path / "adapter", ADAPTER_SPEC, adapter_at(step), str(default_base_path()))
        await self._inner.checkpoint(job_id, step, path, metrics)


class AdapterBackend(ScriptedBackend):
    """`ScriptedBackend` whose checkpoints hold real adapters (see `adapter_at`)."""

    def attach(self, reporter: JobReporter) -> AdapterBackend:
        self.reporter = _AdapterWritingReporter(reporter)  # type: ignore[assignment]
        return self


def events_of(text: str) -> list[sse.Message]:
    """The messages of a whole SSE answer (comments dropped)."""
    return [m for m in sse.parse(text.splitlines()) if m.event is not None]


class LiveServer:
    """`app` under a real uvicorn server on 127.0.0.1 and a free port, in a thread."""

    def __init__(self, app: FastAPI) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> LiveServer:
        self._thread.start()
        for _ in range(600):  # bounded: at most ~30 s
            if self._server.started:
                return self
            if not self._thread.is_alive():
                break
            time.sleep(0.05)
        raise RuntimeError("the test server did not start")

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()


@dataclass
class Service:
    """A running test service: its URL, two tenants' keys, the backend, the app."""

    url: str
    acme: str
    globex: str
    backend: AdapterBackend
    app: FastAPI

    @property
    def notifier(self) -> Any:
        return self.app.state.context.reporter.notifier


def make_tenant_key(url: str, name: str) -> str:
    r = httpx.post(f"{url}/v1/admin/tenants", json={"name": name}, headers=ADMIN)
    assert r.status_code == 201, r.text
    r = httpx.post(f"{url}/v1/admin/tenants/{name}/keys", json={}, headers=ADMIN)
    assert r.status_code == 201, r.text
    key: str = r.json()["key"]
    return key


@contextmanager
def running_service(data_dir: Path, db_url: str | None = None) -> Iterator[Service]:
    """A service with an `AdapterBackend` on SQLite in `data_dir` (or `db_url`) served
    by uvicorn, with tenants acme and globex."""
    settings = ServiceSettings(
        data_dir=data_dir,
        db_url=db_url,
        admin_key=ADMIN_KEY,
        default_quotas=QuotaSpec(max_concurrent_jobs=5, max_total_steps=200),
    )
    ctx, _ = open_context(settings)
    backend = AdapterBackend()
    app = create_app(ctx, backend.attach)
    with LiveServer(app) as server:
        yield Service(
            url=server.url,
            acme=make_tenant_key(server.url, "acme"),
            globex=make_tenant_key(server.url, "globex"),
            backend=backend,
            app=app,
        )
