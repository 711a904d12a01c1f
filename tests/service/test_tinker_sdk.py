"""The pinned, unmodified `tinker` SDK (0.38.0) against a real `marlaas serve` on
127.0.0.1: training clients on the embedded base, sampling and prompt log-probs,
forward_backward with importance sampling and cross-entropy, optim_step, sampler
weights, saved states loaded into new clients, several tenants at once (their passes
shared, their models invisible to each other), and the wire's ordering and resends."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from marlaas.bench.tinker_loop import LoopConfig, run_loop
from marlaas.bench.tinker_server import Served, serving

PROMPT = "Q: reverse hello\nA: "


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # float32: the exact invariants below (chunks add up, prompt log-probs) are its own.
    with serving(tmp_path_factory.mktemp("tinker-serve"), "--dtype", "float32") as served:
        yield served


@pytest.fixture(scope="module")
def base(server: Served) -> str:
    key = server.tenant("probe")
    caps = tinker.RestClient(base_url=server.url, api_key=key).get_server_capabilities().result()
    (model,) = caps.supported_models
    assert model.max_context_length == 256 and model.model_name
    return str(model.model_name)


def _service(server: Served, tenant: str) -> tuple[tinker.ServiceClient, str]:
    """A new tenant's ServiceClient, and its `tml-` key."""
    key = server.tenant(tenant)
    return tinker.ServiceClient(base_url=server.url, api_key=key), key


def _sft(tok: object, text: str, answer: str) -> types.Datum:
    prompt = tok.encode(text)  # type: ignore[attr-defined]
    full = prompt + tok.encode(answer + "\n")  # type: ignore[attr-defined]
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def _logprobs(client: tinker.TrainingClient, data: list[types.Datum]) -> list[float]:
    """The client's log-prob of every target of `data`, datum after datum."""
    out = client.forward(data, "cross_entropy").result()
    return [lp for o in out.loss_fn_outputs for lp in o["logprobs"].tolist()]


def test_the_sdk_trains_samples_saves_and_resumes(server: Served, base: str) -> None:
    service, key = _service(server, "alice")
    client = service.create_lora_training_client(base_model=base, rank=4, seed=1).result()
    assert client.get_info().lora_rank == 4
    tok = client.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode(PROMPT))

    sampler = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=12, stop=["\n"], temperature=1.0, seed=7)
    sampled = sampler.sample(prompt, 4, params).result()
    assert len(sampled.sequences) == 4
    assert len({s.sequence_id for s in sampled.sequences}) == 4
    for s in sampled.sequences:
        assert s.logprobs is not None and len(s.logprobs) == len(s.tokens) > 0
        assert s.stop_reason in ("stop", "length") and all(lp <= 0 for lp in s.logprobs)

    ids = prompt.to_ints()
    seq = sampled.sequences[0]
    n, pad = len(seq.tokens), len(ids) - 1
    full = ids + list(seq.tokens)
    rl = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * pad + list(seq.logprobs or []),
            "advantages": [0.0] * pad + [1.0] * n,
        },
    )
    is_out = client.forward_backward([rl], "importance_sampling").result()
    # On-policy data: the ratio of every sampled token is 1.
    assert is_out.metrics["ratio:sum"] == pytest.approx(n, rel=1e-3)
    assert is_out.metrics["loss:sum"] == pytest.approx(-n, rel=1e-3)
    ce = client.forward_backward([_sft(tok, PROMPT, "olleh")], "cross_entropy").result()
    assert ce.metrics["loss:sum"] > 0
    step = client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert step.metrics is not None and step.metrics["grad_norm"] > 0

    # Sampler weights sample exactly what the training client's weights sample.
    path = client.save_weights_for_sampler("after-1").result().path
    assert path == f"tinker://{client.model_id}/sampler_weights/after-1"
    greedy = types.SamplingParams(max_tokens=12, temperature=0.0, stop=["\n"])
    saved = service.create_sampling_client(model_path=path).result()
    live = client.save_weights_and_get_sampling_client().result()
    assert saved.sample(prompt, 1, greedy).result().sequences[0].tokens == (
        live.sample(prompt, 1, greedy).result().sequences[0].tokens
    )

    # A saved state resumes in a new client: the same weights, and the same next step.
    state = client.save_state("state-1").result().path
    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    assert resumed.model_id != client.model_id
    probe = [_sft(tok, "Q: reverse abc\nA: ", "cba")]
    assert _logprobs(resumed, probe) == _logprobs(client, probe)
    for c in (client, resumed):
        c.forward_backward(probe, "cross_entropy").result()
        c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = _logprobs(client, probe)
    assert _logprobs(resumed, probe) == pytest.approx(after, abs=1e-6)

    rest = tinker.RestClient(base_url=server.url, api_key=key)
    ids_saved = {
        c.checkpoint_id for c in rest.list_checkpoints(client.model_id).result().checkpoints
    }
    assert ids_saved == {"sampler_weights/after-1", "weights/state-1"}
    run = rest.get_training_run(client.model_id).result()
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    service.close("success").result()  # finishes the session: its runs leave the device
    gone = httpx.post(
        f"{server.url}/api/v1/get_info",
        json={"model_id": client.model_id},
        headers={"X-API-Key": key},
    )
    assert gone.status_code == 200  # the run's record stays, off the device


def test_prompt_logprobs_are_the_trainers_logprobs(server: Served, base: str) -> None:
    service, _ = _service(server, "bob")
    client = service.create_lora_training_client(base_model=base, rank=4, seed=2).result()
    ids = client.get_tokenizer().encode(PROMPT)
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt_lp = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert prompt_lp[0] is None and len(prompt_lp) == len(ids)
    whole = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]}
    )
    assert prompt_lp[1:] == pytest.approx(_logprobs(client, [whole]), abs=1e-4)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(ids), prompt_logprobs_last_n=3)
    assert last.result()[:-3] == [None] * (len(ids) - 3)
    service.close("success").result()


def test_chunks_of_one_batch_add_up_until_the_optimizer_step(server: Served, base: str) -> None:
    service, _ = _service(server, "carol")
    tok = (
        service.create_lora_training_client(base_model=base, rank=4, seed=3)
        .result()
        .get_tokenizer()
    )
    data = [_sft(tok, f"Q: reverse {w}\nA: ", w[::-1]) for w in ("abc", "hello", "zebra", "qq")]
    one, two = (
        service.create_lora_training_client(base_model=base, rank=4, seed=5).result()
        for _ in range(2)
    )
    one.forward_backward(data, "cross_entropy").result()
    two.forward_backward(data[:1], "cross_entropy")
    two.forward_backward(data[1:], "cross_entropy")
    for c in (one, two):
        c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert _logprobs(two, data) == pytest.approx(_logprobs(one, data), abs=1e-5)
    service.close("success").result()


def test_bad_inputs_fail_their_request_with_what_to_fix(server: Served, base: str) -> None:
    service, _ = _service(server, "dave")
    client = service.create_lora_training_client(base_model=base, rank=4).result()
    tok = client.get_tokenizer()
    datum = _sft(tok, PROMPT, "olleh")
    with pytest.raises(tinker.RequestFailedError, match="'gspo' is not supported"):
        client.forward_backward([datum], "gspo").result()
    short = types.Datum(model_input=datum.model_input, loss_fn_inputs={"target_tokens": [1, 2, 3]})
    with pytest.raises(tinker.RequestFailedError, match=r"must be \[\d+\]"):
        client.forward_backward([short], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_inputs logprobs"):
        client.forward_backward([datum], "importance_sampling").result()
    # A failed request does not stop the model's later ones.
    assert client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
    sampler = client.save_weights_and_get_sampling_client().result()
    long_prompt = types.ModelInput.from_ints([5] * 300)
    with pytest.raises(tinker.BadRequestError, match="context of 256"):
        sampler.sample(long_prompt, 1, types.SamplingParams(max_tokens=4)).result()
    with pytest.raises(tinker.BadRequestError, match="not served here"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    service.close("success").result()


def test_another_tenants_models_and_paths_are_not_found(server: Served, base: str) -> None:
    owner, _ = _service(server, "erin")
    client = owner.create_lora_training_client(base_model=base, rank=4).result()
    path = client.save_weights_for_sampler("mine").result().path
    state = client.save_state("mine").result().path
    other_key = server.tenant("frank")
    other = tinker.ServiceClient(base_url=server.url, api_key=other_key)
    rest = tinker.RestClient(base_url=server.url, api_key=other_key)
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run(client.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        rest.list_checkpoints(client.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):
        other.create_sampling_client(model_path=path).result()
    with pytest.raises(tinker.NotFoundError):
        other.create_training_client_from_state(state).result()
    headers = {"X-API-Key": other_key}
    for route, body in (
        ("get_info", {"model_id": client.model_id}),
        ("optim_step", {"model_id": client.model_id, "seq_id": 99, "adam_params": {}}),
        ("save_weights", {"model_id": client.model_id, "path": "theirs", "seq_id": 99}),
    ):
        r = httpx.post(f"{server.url}/api/v1/{route}", json=body, headers=headers)
        assert r.status_code == 404, (route, r.text)
    assert rest.list_user_checkpoints().result().checkpoints == []
    openai = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": path, "prompt": PROMPT, "max_tokens": 4},
        headers={"Authorization": f"Bearer {other_key}"},
    )
    assert openai.status_code == 404
    owner.close("success").result()
    other.close("success").result()


def test_four_tenants_at_once_share_training_passes(server: Served, base: str) -> None:
    before = server.metrics()
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def client(name: str) -> None:
        try:
            service, _ = _service(server, name)
            c = service.create_lora_training_client(base_model=base, rank=4).result()
            tok = c.get_tokenizer()
            data = [_sft(tok, f"Q: reverse {w}\nA: ", w[::-1]) for w in ("abc", "hello", "xyz")]
            for _ in range(4):
                barrier.wait(timeout=120)  # the four clients' calls are pending together
                fb = c.forward_backward(data, "cross_entropy")
                step = c.optim_step(types.AdamParams(learning_rate=1e-3))
                fb.result()
                step.result()
            service.close("success").result()
        except BaseException as e:  # surfaced by the test below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=client, args=(f"team{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    after = server.metrics()
    calls = after["marlaas_tinker_forward_backward_calls_total"] - before.get(
        "marlaas_tinker_forward_backward_calls_total", 0.0
    )
    passes = after["marlaas_device_train_passes_total"] - before.get(
        "marlaas_device_train_passes_total", 0.0
    )
    tenants = after["marlaas_device_pass_tenants_total"] - before.get(
        "marlaas_device_pass_tenants_total", 0.0
    )
    assert calls == 16 and tenants == 16  # every call ran in some pass, each with its tenant
    assert after["marlaas_device_pass_tenants_max"] >= 2
    assert passes < calls  # some passes served several tenants' calls
    assert after["marlaas_tinker_requests_total{kind=optim_step,tenant=team0}"] == 4


def _fb_body(model_id: str, seq_id: int, tokens: list[int]) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:]},
                )
            ],
            loss_fn="cross_entropy",
        ),
        model_id=model_id,
        seq_id=seq_id,
    )
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


def test_requests_run_in_seq_order_and_a_resend_is_answered_once(server: Served, base: str) -> None:
    key = server.tenant("grace")
    http = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": key}, timeout=60)
    session = http.post("/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()
    created = http.post(
        "/create_model",
        json={
            "session_id": session["session_id"],
            "model_seq_id": 0,
            "base_model": base,
            "lora_config": {"rank": 2},
        },
    ).json()
    model = created["model_id"]
    assert http.post("/retrieve_future", json={"request_id": created["request_id"]}).json() == {
        "model_id": model,
        "type": "create_model",
    }
    proto = {"Content-Type": "application/x-protobuf"}
    # The step (seq 2) arrives before the gradient (seq 1) it must follow.
    step = http.post(
        "/optim_step",
        json={"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 0.01}},
    ).json()
    first = http.post(
        "/forward_backward", content=_fb_body(model, 1, [5, 6, 7, 8]), headers=proto
    ).json()
    again = http.post(
        "/forward_backward", content=_fb_body(model, 1, [5, 6, 7, 8]), headers=proto
    ).json()
    assert again["request_id"] == first["request_id"]  # answered once
    done = http.post("/retrieve_future", json={"request_id": step["request_id"]}).json()
    assert done["metrics"]["grad_norm"] > 0  # the step saw the gradient of seq 1
    assert done["metrics"]["adapter_version"] == 1.0
    reply = http.post(
        "/retrieve_future",
        json={"request_id": first["request_id"]},
        headers={"Accept": "application/json"},
    ).json()
    assert reply["metrics"]["tokens:sum"] == 3.0 and len(reply["loss_fn_outputs"]) == 1
    late = http.post("/forward_backward", content=_fb_body(model, 1, [9, 9]), headers=proto).json()
    assert late["request_id"] == first["request_id"]
    assert http.post(f"/sessions/{session['session_id']}/finish", json={}).status_code == 200
    http.close()


def test_archives_of_saved_weights_load_with_peft(
    server: Served, base: str, tmp_path: Path
) -> None:
    import tarfile

    from peft import PeftConfig

    service, key = _service(server, "heidi")
    client = service.create_lora_training_client(base_model=base, rank=4).result()
    path = client.save_weights_for_sampler("export").result().path
    checkpoint = path.split("/", 3)[3]
    r = httpx.get(
        f"{server.url}/api/v1/training_runs/{client.model_id}/checkpoints/{checkpoint}/archive",
        headers={"X-API-Key": key},
    )
    assert r.status_code == 200, r.text
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(r.content)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    config = PeftConfig.from_pretrained(str(folder))
    assert config.r == 4  # type: ignore[attr-defined]
    served = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": path, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert served.status_code == 200, served.text
    assert served.json()["model"] == path
    service.close("success").result()


@pytest.mark.slow
def test_an_rl_loop_written_against_the_sdk_raises_the_reward(server: Served, base: str) -> None:
    """`bench.tinker_loop` (the SDK alone) on the reverse task: greedy held-out accuracy
    went 0.57 -> 0.67 in 20 steps when measured; the bar is about half of that gain."""
    service, _ = _service(server, "ivan")
    result = run_loop(service, base, LoopConfig())
    print(f"accuracy {result.accuracy_before:.3f} -> {result.accuracy_after:.3f}")
    assert result.accuracy_after >= result.accuracy_before + 0.06, result
    assert len(result.rewards) == 20 and result.tokens_trained > 0
    service.close("success").result()


def test_custom_losses_and_loads_into_an_existing_client(server: Served, base: str) -> None:
    """`forward_backward_custom` (the SDK's forward, then a weighted cross-entropy) takes
    the step cross-entropy takes; the deprecated `load_state` puts saved weights back."""
    import torch

    service, _ = _service(server, "judy")
    tok = service.create_lora_training_client(base_model=base, rank=4).result().get_tokenizer()
    data = [_sft(tok, f"Q: reverse {w}\nA: ", w[::-1]) for w in ("abc", "hello")]
    plain, custom = (
        service.create_lora_training_client(base_model=base, rank=4, seed=9).result()
        for _ in range(2)
    )

    def nll(
        batch: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum(
            -(lp * d.loss_fn_inputs["weights"].to_torch()).sum()
            for d, lp in zip(batch, logprobs, strict=True)
        )
        assert isinstance(loss, torch.Tensor)
        return loss, {"custom:sum": float(loss.detach())}

    expected = plain.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    got = custom.forward_backward_custom(data, nll).result()
    assert got.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    for c in (plain, custom):
        c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert _logprobs(custom, data) == pytest.approx(_logprobs(plain, data), abs=1e-5)

    saved = plain.save_state("before-more").result().path
    reference = _logprobs(plain, data)
    plain.forward_backward(data, "cross_entropy").result()
    plain.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert _logprobs(plain, data) != reference
    with pytest.warns(FutureWarning):
        plain.load_state(saved).result()
    assert _logprobs(plain, data) == reference
    service.close("success").result()
