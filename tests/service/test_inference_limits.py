"""Inference is bounded and cancellable: a request larger than the engine's rows or the
tenant's tokens per request answers 400 before anything runs; a tenant's requests in
flight are bounded (429); a client that hangs up has its requests aborted and its slot
freed, whether the answer was streamed or not.

The server runs under uvicorn on a loopback port, over an engine that nobody steps but
the test (`background=False`), so "in flight" and "aborted" are observed exactly, with
no clock. Raw sockets stand in for clients that hang up.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers.live_support import LiveServer
from helpers.service_support import ADMIN, ADMIN_KEY, ScriptedBackend
from marlaas.model.bank import AdapterBank
from marlaas.model.base import default_base_path, load_base
from marlaas.model.lora import LoRAModel
from marlaas.rollout.engine import RolloutEngine
from marlaas.service.app import create_app, open_context
from marlaas.service.inference import EngineProvider
from marlaas.service.settings import ServiceSettings

PROMPT = "Q: 12+7\nA: "


@dataclass
class _SharingBackend(ScriptedBackend):
    """A job backend that shares its engine for inference, as the pipeline's does."""

    provider: EngineProvider | None = None

    def inference_provider(self) -> EngineProvider | None:
        return self.provider


@dataclass
class Stepped:
    url: str
    engine: RolloutEngine
    aborted: list[str]

    def tenant(self, name: str, **quotas: int) -> str:
        r = httpx.post(
            f"{self.url}/v1/admin/tenants", json={"name": name, "quotas": quotas}, headers=ADMIN
        )
        assert r.status_code == 201, r.text
        r = httpx.post(f"{self.url}/v1/admin/tenants/{name}/keys", json={}, headers=ADMIN)
        key: str = r.json()["key"]
        return key


@pytest.fixture(scope="module")
def stepped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stepped]:
    tmp: Path = tmp_path_factory.mktemp("limits")
    settings = ServiceSettings(
        data_dir=tmp / "data",
        db_url=f"sqlite:///{tmp / 'service.db'}",
        admin_key=ADMIN_KEY,
        max_batch_rows=8,
    )
    base, tokenizer = load_base(default_base_path())
    model = LoRAModel(base, max_rank=8)
    engine = RolloutEngine(
        model, AdapterBank(model, num_slots=2), tokenizer, background=False, eos_token_ids=[]
    )
    aborted: list[str] = []
    abort = engine.abort

    def noting_abort(request_id: str) -> None:
        abort(request_id)
        aborted.append(request_id)

    engine.abort = noting_abort  # type: ignore[method-assign]
    backend = _SharingBackend(provider=EngineProvider.of_engine(engine))
    ctx, _ = open_context(settings)
    try:
        with LiveServer(create_app(ctx, backend.attach)) as server:
            yield Stepped(server.url, engine, aborted)
    finally:
        engine.shutdown()


def _body(max_tokens: int, **extra: object) -> dict[str, object]:
    return {"model": "base", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}


def _wait(predicate: object, what: str) -> None:
    for _ in range(3000):  # bounded: ~30 s
        if callable(predicate) and predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _hang_up_later(url: str, key: str, body: dict[str, object]) -> socket.socket:
    """Send a completion request over a raw socket and return it, unread: closing it
    is a client that hangs up."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + data)
    return sock


def _complete(url: str, key: str, body: dict[str, object]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def _step_until_done(engine: RolloutEngine, future: Future[httpx.Response]) -> httpx.Response:
    for _ in range(3000):  # bounded
        if future.done():
            return future.result()
        if engine.has_work():
            engine.step()
        else:
            time.sleep(0.01)
    raise AssertionError("the request did not finish while the engine stepped")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"n": 4, "prompt": [PROMPT] * 3},
            "n",
            "12 completions at once, and this server's engine runs at most 8",
        ),
        (
            {"max_tokens": 5000, "n": 2, "prompt": [PROMPT] * 4},
            "max_tokens",
            "may ask at most 1000",
        ),
    ],
)
def test_a_request_larger_than_the_engine_or_the_quota_answers_400(
    stepped: Stepped, extra: dict[str, object], param: str, words: str
) -> None:
    key = stepped.tenant(f"big-{param}", max_inference_tokens=1000)
    r = _complete(stepped.url, key, {**_body(2), **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert not stepped.engine.has_work()  # refused before anything was queued


def test_requests_in_flight_are_bounded_per_tenant_and_freed_by_a_hang_up(
    stepped: Stepped,
) -> None:
    engine = stepped.engine
    ivy = stepped.tenant("ivy", max_inference_requests=1)
    held = _hang_up_later(stepped.url, ivy, _body(400))
    try:
        _wait(engine.has_work, "the first request to reach the engine")
        r = _complete(stepped.url, ivy, _body(2))
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and "max_inference_requests" in error["message"]
        # another tenant is not held back by ivy's quota
        other = stepped.tenant("jay")
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_complete, stepped.url, other, _body(2))
            # Step only once both wait in the engine: stepped while jay's request was on
            # its way (slow under load), ivy's would run to its length and never be
            # aborted.
            _wait(lambda: engine.queued == 2, "the other tenant's request to reach the engine")
            assert _step_until_done(engine, answer).status_code == 200
    finally:
        held.close()
    _wait(lambda: len(stepped.aborted) > 0, "the hung-up request to be aborted")
    engine.step()
    assert engine.running == 0 and not engine.has_work()
    with ThreadPoolExecutor(1) as pool:  # its slot is free again
        answer = _step_until_done(engine, pool.submit(_complete, stepped.url, ivy, _body(2)))
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_before_its_answer_has_its_rows_aborted(
    stepped: Stepped, stream: bool
) -> None:
    """Not streamed: nothing is sent until the completion exists, so only the
    disconnect tells. Streamed: the response starts with the first token, so the
    request still waits for the engine when the client goes."""
    engine = stepped.engine
    before = len(stepped.aborted)
    kim = stepped.tenant(f"kim-{stream}")
    sock = _hang_up_later(stepped.url, kim, _body(400, n=3, stream=stream))
    # its three rows are submitted one by one: step only once all three wait
    _wait(lambda: engine.queued == 3, "the request's three rows to reach the engine")
    engine.step()  # admitted: its three rows run
    assert engine.running == 3
    sock.close()
    _wait(lambda: len(stepped.aborted) >= before + 3, "its three rows to be aborted")
    engine.step()
    assert engine.running == 0 and not engine.has_work()
