"""The OpenAI routes answer only with the model the service was started for: while the
job pipeline is still starting they answer 503 with a retry hint, after it failed to
start 503 with the reason, and never fall back to an engine of their own (the embedded
base); with no job backend (`--backend none`) they serve `serve_base_model`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from helpers.service_support import ScriptedBackend, Tenants
from marlaas.config.job import PipelineSpec
from marlaas.model.bank import AdapterBank
from marlaas.model.base import default_base_path, load_base
from marlaas.model.lora import LoRAModel
from marlaas.pipeline.context import PipelineOptions
from marlaas.rollout.engine import RolloutEngine
from marlaas.service.app import create_app, open_context
from marlaas.service.inference import EngineProvider, InferenceHub
from marlaas.service.pipeline_backend import PipelineBackend
from marlaas.service.settings import ServiceSettings

torch.set_num_threads(1)

BODY = {"model": "base", "prompt": "Q: 12+7\nA: ", "max_tokens": 2, "temperature": 0}


@dataclass
class _Starting(ScriptedBackend):
    """A backend that shares an engine once it has one, and may have failed to start."""

    engine: RolloutEngine | None = None
    failure: BaseException | None = None

    def inference_provider(self) -> EngineProvider | None:
        return None if self.engine is None else EngineProvider.of_engine(self.engine)

    def start_failure(self) -> BaseException | None:
        return self.failure


def _hub(client: TestClient) -> InferenceHub:
    return client.app.state.inference_hub  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # no database at stake
def test_a_starting_pipeline_answers_503_with_retry_after(settings: ServiceSettings) -> None:
    backend = _Starting()
    ctx, _ = open_context(settings)
    with TestClient(create_app(ctx, backend.attach)) as client:
        headers = Tenants(client).create("carol")
        r = client.post("/v1/completions", json=BODY, headers=headers)
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "5"
        assert "still starting" in r.json()["error"]["message"]
        assert _hub(client).current is None  # no engine of its own was started
        chat = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
        r = client.post("/v1/chat/completions", json=chat, headers=headers)
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        backend.failure = RuntimeError("the base model cannot be loaded")
        r = client.post("/v1/completions", json=BODY, headers=headers)
        assert r.status_code == 503 and "Retry-After" not in r.headers
        assert "failed to start" in r.json()["error"]["message"]
        assert "cannot be loaded" in r.json()["error"]["message"]
        assert _hub(client).current is None
        # Once the backend's engine is up, it answers.
        base, tokenizer = load_base(default_base_path())
        model = LoRAModel(base, max_rank=4)
        backend.failure, backend.engine = (
            None,
            RolloutEngine(model, AdapterBank(model, num_slots=2), tokenizer),
        )
        try:
            r = client.post("/v1/completions", json=BODY, headers=headers)
            assert r.status_code == 200, r.text
            assert backend.engine.stats.completed == 1
        finally:
            backend.engine.shutdown()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # no database at stake
def test_a_pipeline_that_failed_to_start_serves_nothing(
    settings: ServiceSettings, tmp_path: Path
) -> None:
    spec = PipelineSpec(base_model=str(tmp_path / "no-such-model"))
    ctx, _ = open_context(settings)
    factory = PipelineBackend.factory(
        ctx.db, spec=spec, options=PipelineOptions(device="cpu"), recover=False
    )
    with TestClient(create_app(ctx, factory)) as client:
        headers = Tenants(client).create("dave")
        backend = ctx.backend
        assert isinstance(backend, PipelineBackend)
        for _ in range(200):  # bounded: the start fails at once (no such directory)
            if backend.start_failure() is not None:
                break
            time.sleep(0.05)
        r = client.post("/v1/completions", json=BODY, headers=headers)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "failed to start" in message and "no-such-model" in message
        assert _hub(client).current is None


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_without_a_backend_it_serves_serve_base_model(settings: ServiceSettings) -> None:
    """`--backend none` serves the base `serve` was given (here: a copy of the embedded
    base in another directory), not the embedded base."""
    moved = settings.data_dir.parent / "copy-of-base"
    base, tokenizer = load_base(default_base_path())
    base.save_pretrained(moved)
    tokenizer.save_pretrained(moved)
    ctx, _ = open_context(settings.model_copy(update={"serve_base_model": moved}))
    with TestClient(create_app(ctx)) as client:
        headers = Tenants(client).create("erin")
        r = client.post("/v1/completions", json=BODY, headers=headers)
        assert r.status_code == 200, r.text
        served = _hub(client).current
        assert served is not None
        assert served.provider.model.base.name_or_path == str(moved)
