"""OpenAI-compatible inference, driven by the official `openai` client against a real
uvicorn server on a loopback port: listing models, completions and chat (plain and
streamed), checkpoint adapters that really change outputs, the LRU bound on serving
adapters, tenant isolation (another tenant's model is a 404 like a missing one), and
OpenAI-shaped errors for bad requests.

One server per database kind serves every test of this module (the engine and its
base load once); the tests only read, so their order does not matter.
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import httpx
import openai
import psycopg
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletionMessageParam
from pg_server import PgServer
from transformers import PreTrainedTokenizerBase

from helpers.service_support import ADMIN, ADMIN_KEY, ScriptedBackend, Tenants, job_body
from marlaas.config.specs import LoRASpec
from marlaas.errors import EngineClosed
from marlaas.model import peft_io
from marlaas.model.bank import AdapterBank
from marlaas.model.base import default_base_path, load_base
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.model.peft_io import save_peft
from marlaas.model.tokenizer import build_tokenizer
from marlaas.rollout.engine import RolloutEngine
from marlaas.service.app import create_app, open_context
from marlaas.service.context import ServiceContext
from marlaas.service.inference import EngineProvider, InferenceHub
from marlaas.service.models_catalog import ServedModel
from marlaas.service.openai_api import chat_prompt, encode
from marlaas.service.serving_adapters import AdapterCache
from marlaas.service.settings import ServiceSettings
from marlaas.service.streaming import IncrementalText, text_pieces
from marlaas.types import Completion, RolloutRequest, SamplingParams

PROMPT = "Q: 12+7\nA: "
SPEC = LoRASpec(rank=4, alpha=32.0, target_modules=("q_proj", "v_proj", "down_proj"))


@dataclass
class Served:
    url: str
    app: FastAPI
    alice: openai.OpenAI
    bob: openai.OpenAI
    alice_key: str
    alice_job: str
    bob_job: str
    model: LoRAModel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_url(server: PgServer) -> str:
    schema = f"openai_{int(time.time() * 1000) % 10**9}"
    with psycopg.connect(
        host="127.0.0.1", port=server.port, user=server.user, dbname="postgres", autocommit=True
    ) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    return f"{server.url('postgres')}?options=-csearch_path%3D{schema}"


def _adapter(model: LoRAModel, seed: int) -> AdapterTensors:
    """An adapter whose B is far from zero, so it changes what the model writes."""
    tensors = model.init_adapter(SPEC, seed)
    gen = torch.Generator().manual_seed(seed)
    return {p: (A, torch.randn(B.shape, generator=gen) * 0.5) for p, (A, B) in tensors.items()}


def _checkpoints(ctx: ServiceContext, job_id: str, steps: list[int], model: LoRAModel) -> None:
    root = ctx.settings.artifact_dir / "tenants" / job_id
    for step in steps:
        # Step 1: a bare PEFT directory; later steps: the pipeline's checkpoint layout.
        where = root / f"ckpt-{step:08d}"
        save_peft(where if step == 1 else where / "adapter", SPEC, _adapter(model, seed=step))
        asyncio.run(ctx.reporter.checkpoint(job_id, step, where, {"reward": 0.1 * step}))


def _tenant(http: httpx.Client, name: str) -> str:
    r = http.post("/v1/admin/tenants", json={"name": name, "quotas": {}}, headers=ADMIN)
    assert r.status_code == 201, r.text
    r = http.post(f"/v1/admin/tenants/{name}/keys", json={}, headers=ADMIN)
    assert r.status_code == 201, r.text
    key: str = r.json()["key"]
    return key


def _job(http: httpx.Client, key: str, name: str) -> str:
    r = http.post("/v1/jobs", json=job_body(name), headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 201, r.text
    job_id: str = r.json()["id"]
    return job_id


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("openai")
    if request.param == "sqlite":
        db_url = f"sqlite:///{tmp / 'service.db'}"
    else:
        db_url = _pg_url(request.getfixturevalue("pg_server"))
    settings = ServiceSettings(
        data_dir=tmp / "data", db_url=db_url, admin_key=ADMIN_KEY, max_serving_adapters=2
    )
    ctx, _ = open_context(settings)
    app = create_app(ctx)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn-openai", daemon=True)
    thread.start()
    for _ in range(300):  # bounded: at most ~30 s
        if server.started or not thread.is_alive():
            break
        time.sleep(0.1)
    assert server.started, "uvicorn did not start"
    url = f"http://127.0.0.1:{port}"
    try:
        base, _tok = load_base(default_base_path())
        model = LoRAModel(base, max_rank=SPEC.rank, target_modules=SPEC.target_modules)
        with httpx.Client(base_url=url, timeout=30) as http:
            alice_key, bob_key = _tenant(http, "alice"), _tenant(http, "bob")
            alice_job, bob_job = _job(http, alice_key, "a1"), _job(http, bob_key, "b1")
        _checkpoints(ctx, alice_job, [1, 2, 3], model)
        _checkpoints(ctx, bob_job, [1], model)

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)

        yield Served(
            url, app, client(alice_key), client(bob_key), alice_key, alice_job, bob_job, model
        )
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _greedy(client: openai.OpenAI, model: str, max_tokens: int = 12) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text


def test_models_lists_only_the_callers_models(served: Served) -> None:
    job = served.alice_job
    ids = [m.id for m in served.alice.models.list().data]
    assert ids == ["base", job, f"{job}:ckpt-1", f"{job}:ckpt-2", f"{job}:ckpt-3"]
    assert served.bob_job not in " ".join(ids)
    bob_ids = [m.id for m in served.bob.models.list().data]
    assert bob_ids == ["base", served.bob_job, f"{served.bob_job}:ckpt-1"]
    card = served.alice.models.retrieve(f"{job}:ckpt-2")
    assert card.id == f"{job}:ckpt-2" and card.owned_by == "alice" and card.created > 0


def test_completion_usage_seed_and_n(served: Served) -> None:
    out = served.alice.completions.create(model="base", prompt=PROMPT, max_tokens=5, temperature=0)
    assert out.object == "text_completion" and out.model == "base"
    (choice,) = out.choices
    assert choice.finish_reason in ("stop", "length")
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(PROMPT.encode())  # the embedded base: one token a byte
    assert 1 <= out.usage.completion_tokens <= 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    if choice.finish_reason == "length":
        assert out.usage.completion_tokens == 5

    def sample(seed: int) -> list[str]:
        r = served.alice.completions.create(
            model="base", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed, n=3
        )
        assert [c.index for c in r.choices] == [0, 1, 2]
        return [c.text for c in r.choices]

    first = sample(7)
    assert sample(7) == first  # seeded: reproducible
    assert len(set(first + sample(8))) > 1

    batch = served.alice.completions.create(
        model="base", prompt=[PROMPT, "Q: 3+4\nA: "], max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy: n copies agree


def test_stop_sequence_cuts_the_text(served: Served) -> None:
    full = _greedy(served.alice, "base", max_tokens=16)
    if len(full) < 2:
        pytest.skip("the base wrote too little to test a stop sequence")
    stop = full[1]
    out = served.alice.completions.create(
        model="base", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_chat_completion(served: Served) -> None:
    out = served.alice.chat.completions.create(
        model=served.alice_job,
        messages=[
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "12+7"},
        ],
        max_tokens=20,
        temperature=0,
    )
    assert out.object == "chat.completion"
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and "\n" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # The plain chat format: the system line, "Q: <user>", then "A: " for the reply.
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(b"Answer with a number.\nQ: 12+7\nA: ")


def test_streaming_matches_the_plain_answer(served: Served) -> None:
    model = f"{served.alice_job}:ckpt-2"
    plain = _greedy(served.alice, model, max_tokens=16)
    stream = served.alice.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1

    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "12+7"}]
    chat_plain = served.alice.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    chat_chunks = list(
        served.alice.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0, stream=True
        )
    )
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat_chunks)
    assert streamed == chat_plain.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == chat_plain.choices[0].finish_reason


def test_checkpoint_adapters_change_outputs(served: Served) -> None:
    job = served.alice_job
    base = _greedy(served.alice, "base")
    latest = _greedy(served.alice, job)
    assert latest == _greedy(served.alice, f"{job}:ckpt-3")  # the job is its newest checkpoint
    others = {_greedy(served.alice, f"{job}:ckpt-{s}") for s in (1, 2)}
    assert base != latest and base not in others
    assert len(others | {latest}) > 1  # different checkpoints, different adapters

    hub: InferenceHub = served.app.state.inference_hub
    assert hub.current is not None
    registered = hub.current.adapters.registered
    assert len(registered) == 2  # max_serving_adapters: the least recently used went
    assert registered[-1] == f"serve:{job}:2"
    bank = hub.current.provider.bank
    assert {t for t in bank.tenants() if t != "serve:base"} == set(registered)


def test_another_tenants_model_is_not_found(served: Served) -> None:
    theirs = served.bob_job
    with pytest.raises(openai.NotFoundError) as caught:
        served.alice.completions.create(model=theirs, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as missing:
        served.alice.completions.create(model="job_0000000000000000", prompt=PROMPT, max_tokens=2)
    for name in (f"{theirs}:ckpt-1", f"{served.alice_job}:ckpt-99", "no such model"):
        with pytest.raises(openai.NotFoundError):
            served.alice.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}]
            )
    with pytest.raises(openai.NotFoundError):
        served.alice.models.retrieve(theirs)

    # The same answer for another tenant's model as for one that never existed.
    def body(name: str) -> dict[str, object]:
        r = httpx.post(
            f"{served.url}/v1/completions",
            json={"model": name, "prompt": "x"},
            headers={"Authorization": f"Bearer {served.alice_key}"},
        )
        assert r.status_code == 404
        error: dict[str, object] = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        error["message"] = str(error["message"]).replace(name, "NAME")
        return error

    assert body(theirs) == body("job_0000000000000000")
    assert caught.value.status_code == missing.value.status_code == 404


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 5},
        {"n": 0},
        {"max_tokens": 0},
        {"top_p": 0},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"logprobs": 2},
        {"echo": True},
        {"presence_penalty": 1.0},
        {"prompt": ""},
        {"prompt": "x" * 300},  # longer than the base's 256 positions
        {"prompt": [[5, 99999]]},  # token id beyond the vocabulary
    ],
)
def test_bad_completion_requests_answer_400(served: Served, params: dict[str, object]) -> None:
    kwargs: dict[str, object] = {"model": "base", "prompt": PROMPT, "max_tokens": 2, **params}
    with pytest.raises(openai.BadRequestError) as caught:
        served.alice.completions.create(**kwargs)  # type: ignore[call-overload]
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error" and body["message"]


def test_bad_chat_requests_and_auth(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served.alice.chat.completions.create(model="base", messages=[])
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        served.alice.chat.completions.create(
            model="base",
            messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}],
        )
    anon = openai.OpenAI(base_url=f"{served.url}/v1", api_key="mk_nope_nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as denied:
        anon.models.list()
    assert isinstance(denied.value.body, dict) and denied.value.body["code"] == "invalid_api_key"


def test_concurrent_requests_over_more_adapters_than_kept(served: Served) -> None:
    """More adapters in flight at once than `max_serving_adapters`: every answer is the
    one the model gives alone, and the cache trims back to its bound afterwards."""
    job = served.alice_job
    models = ["base", f"{job}:ckpt-1", f"{job}:ckpt-2", f"{job}:ckpt-3"] * 2
    alone = {m: _greedy(served.alice, m) for m in models}
    with ThreadPoolExecutor(max_workers=len(models)) as pool:
        together = list(pool.map(lambda m: _greedy(served.alice, m), models))
    assert together == [alone[m] for m in models]
    hub: InferenceHub = served.app.state.inference_hub
    assert hub.current is not None and len(hub.current.adapters.registered) <= 2


def test_chat_prompt_formats() -> None:
    tok = build_tokenizer()
    ids, stops = chat_prompt(tok, [("system", "Be brief."), ("user", "hi"), ("assistant", "yo")])
    assert tok.decode(ids) == "Be brief.\nQ: hi\nA: yo\nA: " and stops == ("\n",)
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    ids, stops = chat_prompt(tok, [("user", "hi")])
    assert tok.decode(ids) == "<user>hi\n<assistant>" and stops == ()


def _decoder() -> tuple[PreTrainedTokenizerBase, Callable[[list[int]], str]]:
    tok = build_tokenizer()

    def decode(t: list[int]) -> str:
        return str(tok.decode(t, skip_special_tokens=True))

    return tok, decode


def test_stream_pieces_keep_characters_whole() -> None:
    tok, decode = _decoder()
    ids = (*encode(tok, "aé€!"), int(tok.eos_token_id))

    for text, stops in (("aé€!", ()), ("aé", ("€!",))):  # whole, and cut before a stop
        done = Completion("r", "t", 0, 1, ids, (0.0,) * len(ids), text, "stop")
        pieces = text_pieces(decode, done, stops)
        assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
        assert len(pieces) == len(text)  # one piece per character here


def test_streamed_text_holds_back_what_may_start_a_stop_string() -> None:
    """Token by token, nothing at or after a stop string is ever released, and a
    held-back prefix of a stop string goes out once it turns out not to be one."""
    tok, decode = _decoder()
    stops = ("STOP", "\n\n")
    text = "ab STO cd é STOP tail"
    ids = encode(tok, text)
    stream = IncrementalText(decode, stops)
    released = []
    for token in ids:
        released.append(stream.push(token))
        assert "STOP" not in "".join(released)
    final = text[: text.index("STOP")]
    assert "".join(released) == final[: len("".join(released))]
    assert "ab STO cd" in "".join(released)  # "STO" was held, then let go
    done = Completion("r", "t", 0, 1, tuple(ids), (0.0,) * len(ids), final, "stop")
    assert "".join(released + stream.finish(done)) == final


def test_a_job_training_in_the_engine_serves_its_live_adapter(served: Served) -> None:
    """While the shared engine trains a job (a bank tenant named by the job id), the
    job's name serves that live adapter; its checkpoints stay reachable by name."""
    job = served.alice_job
    first, last = _greedy(served.alice, f"{job}:ckpt-1"), _greedy(served.alice, f"{job}:ckpt-3")
    assert first != last
    hub: InferenceHub = served.app.state.inference_hub
    assert hub.current is not None
    bank = hub.current.provider.bank
    bank.register(job, SPEC, _adapter(served.model, seed=1))  # as the trainer would
    try:
        assert _greedy(served.alice, job) == first
        assert _greedy(served.alice, f"{job}:ckpt-3") == last
        assert job in [m.id for m in served.alice.models.list().data]
        with pytest.raises(openai.NotFoundError):
            served.bob.completions.create(model=job, prompt=PROMPT, max_tokens=2)
    finally:
        bank.remove(job)
    assert _greedy(served.alice, job) == last


class _FakeBank:
    def __init__(self) -> None:
        self.tenants: dict[str, object] = {}

    def __contains__(self, tenant: object) -> bool:
        return tenant in self.tenants

    def register(self, tenant: str, spec: object, tensors: object = None) -> None:
        assert tenant not in self.tenants
        self.tenants[tenant] = spec

    def remove(self, tenant: str) -> None:
        del self.tenants[tenant]


async def test_adapter_cache_never_unloads_an_adapter_in_use(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Capacity 1 with three adapters in use at once: all stay registered while used,
    each loads once however many requests wait for it, and the cache trims back to the
    most recently used one when they are released."""
    loads: list[Path] = []

    def fake_load(directory: Path, model: object) -> tuple[str, dict[str, object]]:
        loads.append(directory)
        time.sleep(0.01)
        return "spec", {}

    monkeypatch.setattr(peft_io, "load_peft", fake_load)
    bank = _FakeBank()
    provider = EngineProvider(None, bank, None, None)  # type: ignore[arg-type]
    cache = AdapterCache(provider, capacity=1)
    models = [ServedModel(f"j:ckpt-{s}", None, "j", s, tmp_path / str(s)) for s in (1, 2, 3)]

    async def hold(model: ServedModel, release: asyncio.Event) -> str:
        async with cache.use(model) as key:
            assert key in bank
            await release.wait()
            return key

    release = asyncio.Event()
    tasks = [asyncio.create_task(hold(m, release)) for m in [*models, models[0]]]
    while len(cache.registered) < 3:
        await asyncio.sleep(0.01)
    assert sorted(bank.tenants) == ["serve:j:1", "serve:j:2", "serve:j:3"]
    release.set()
    assert await asyncio.gather(*tasks) == [m.key for m in [*models, models[0]]]
    assert len(loads) == 3  # the second request for ckpt-1 waited for the first load
    assert len(cache.registered) == 1 and list(bank.tenants) == cache.registered


@dataclass
class _SharingBackend(ScriptedBackend):
    """A job backend that shares its engine for inference, as the pipeline's does."""

    provider: EngineProvider | None = None

    def inference_provider(self) -> EngineProvider | None:
        return self.provider


def test_a_backend_engine_serves_instead_of_one_of_its_own(settings: ServiceSettings) -> None:
    base, tokenizer = load_base(default_base_path())
    model = LoRAModel(base, max_rank=8)
    engine = RolloutEngine(model, AdapterBank(model, num_slots=2), tokenizer)
    backend = _SharingBackend(provider=EngineProvider.of_engine(engine))
    ctx, _ = open_context(settings)
    try:
        with TestClient(create_app(ctx, backend.attach)) as client:
            headers = Tenants(client).create("carol")
            body = {"model": "base", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
            r = client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
            assert engine.stats.completed == 1  # served by the backend's engine
            hub: InferenceHub = client.app.state.inference_hub  # type: ignore[attr-defined]
            assert hub.current is not None and hub.current.provider.bank is engine.bank
    finally:
        engine.shutdown()


def test_a_malformed_union_field_gets_one_clear_message(served: Served) -> None:
    r = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": "base", "prompt": 5},
        headers={"Authorization": f"Bearer {served.alice_key}"},
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["type"] == "invalid_request_error"
    assert "must be a string, a list of strings" in error["message"]


# -- true streaming, against an engine the test steps itself ---------------------------


@dataclass
class Stepped:
    url: str
    key: str
    engine: RolloutEngine


def _serve(app: FastAPI) -> tuple[str, uvicorn.Server, threading.Thread]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn-stepped", daemon=True)
    thread.start()
    for _ in range(300):  # bounded: at most ~30 s
        if server.started or not thread.is_alive():
            break
        time.sleep(0.1)
    assert server.started, "uvicorn did not start"
    return f"http://127.0.0.1:{port}", server, thread


@pytest.fixture(scope="module")
def stepped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stepped]:
    """A server whose engine nobody drives but the test (`background=False`): a token
    exists only after the test's `engine.step()`. EOS never ends a row here."""
    tmp = tmp_path_factory.mktemp("stepped")
    settings = ServiceSettings(
        data_dir=tmp / "data", db_url=f"sqlite:///{tmp / 'service.db'}", admin_key=ADMIN_KEY
    )
    base, tokenizer = load_base(default_base_path())
    model = LoRAModel(base, max_rank=8)
    engine = RolloutEngine(
        model, AdapterBank(model, num_slots=2), tokenizer, background=False, eos_token_ids=[]
    )
    backend = _SharingBackend(provider=EngineProvider.of_engine(engine))
    ctx, _ = open_context(settings)
    url, server, thread = _serve(create_app(ctx, backend.attach))
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            key = _tenant(http, "dora")
        yield Stepped(url, key, engine)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()


def _read_stream(
    stepped: Stepped, body: dict[str, object], out: queue.Queue[str | None], first_only: bool
) -> None:
    """POST a streaming completion and put each event's data on `out` (None at the
    end); with `first_only`, hang up after the first text chunk."""
    headers = {"Authorization": f"Bearer {stepped.key}"}
    try:
        with (
            httpx.Client(base_url=stepped.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body, headers=headers) as r,
        ):
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.put(line.removeprefix("data: "))
                    if first_only:
                        return
    finally:
        out.put(None)


def _step_until_a_chunk(engine: RolloutEngine, out: queue.Queue[str | None]) -> str | None:
    """Step once the request waits in the engine, then once more per quiet spell, until
    the stream yields something. Returns it."""
    for _ in range(3000):  # bounded: the request reaches the engine within ~30 s
        if engine.has_work():
            break
        time.sleep(0.01)
    for _ in range(8):  # ASCII answers: a chunk follows the first token or two
        engine.step()
        try:
            return out.get(timeout=10)
        except queue.Empty:
            continue
    raise AssertionError("no chunk came while the engine stepped")


def test_chunks_leave_as_tokens_are_sampled(stepped: Stepped) -> None:
    """The first chunk arrives while the request still runs in the engine (nothing
    steps it but this test); the chunks then join to the greedy non-streamed answer."""
    engine = stepped.engine
    body = {"model": "base", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
    out: queue.Queue[str | None] = queue.Queue()
    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(_read_stream, stepped, body, out, False)
        first = _step_until_a_chunk(engine, out)
        assert first is not None and first != "[DONE]"
        assert engine.running == 1  # streamed before the completion exists
        assert engine.stats.completed == 0
        while engine.has_work():
            engine.step()
        reader.result(timeout=60)
    events = [first]
    while (item := out.get(timeout=10)) is not None:
        events.append(item)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert sum(1 for t in texts if t) > 1  # token by token, not one piece at the end
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    tok = engine.tokenizer
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    request = RolloutRequest("serve:base", tuple(encode(tok, PROMPT)), greedy)
    assert "".join(texts) == engine.generate([request])[0].text


def test_a_client_that_hangs_up_aborts_its_request(
    stepped: Stepped, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = stepped.engine
    aborted = threading.Event()
    abort = engine.abort

    def noting_abort(request_id: str) -> None:
        abort(request_id)
        aborted.set()

    monkeypatch.setattr(engine, "abort", noting_abort)
    before = engine.stats.aborted
    body = {"model": "base", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    out: queue.Queue[str | None] = queue.Queue()
    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(_read_stream, stepped, body, out, True)
        assert _step_until_a_chunk(engine, out) is not None
        reader.result(timeout=60)  # the client hung up after its first chunk
        assert aborted.wait(timeout=30), "the server did not abort the request"
    engine.step()
    assert engine.stats.aborted == before + 1
    assert engine.running == 0 and not engine.has_work()


def test_an_error_after_the_stream_started_ends_it_with_an_error_event(
    settings: ServiceSettings,
) -> None:
    """Admitted, two tokens streamed, then the engine fails: the chunks already sent
    stay, an OpenAI-shaped error event ends the stream, and no `[DONE]` follows."""
    tok = build_tokenizer()

    async def submit(
        request: RolloutRequest, on_token: Callable[[int], None] | None = None
    ) -> Completion:
        assert on_token is not None
        for token in encode(tok, "hi"):
            on_token(token)
        for _ in range(20):  # let the route see the stream started (loop turns, no clock)
            await asyncio.sleep(0)
        raise EngineClosed("the engine stopped")

    model = cast(LoRAModel, SimpleNamespace(target_modules=("q_proj",)))
    provider = EngineProvider(model, cast(AdapterBank, _FakeBank()), tok, submit)
    ctx, _ = open_context(settings)
    with TestClient(create_app(ctx, _SharingBackend(provider=provider).attach)) as client:
        headers = Tenants(client).create("erin")
        body = {"model": "base", "prompt": PROMPT, "max_tokens": 8, "stream": True}
        with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            data = [x.removeprefix("data: ") for x in r.iter_lines() if x.startswith("data: ")]
    events = [json.loads(d) for d in data]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "hi"
    error = events[-1]["error"]
    assert error["type"] == "server_error" and "cannot serve now" in error["message"]
