"""What the engine returns: equal to Hugging Face on the merged adapter, batch-invariant,
exact behaviour log-probs, stop strings, EOS, seeded sampling."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from rollout_support import SPEC, assert_same_completion, merged
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from marlaas.model.bank import AdapterBank
from marlaas.rollout import RolloutEngine
from marlaas.types import Completion, RolloutRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
PROMPTS = ["hello world", "a", "the quick brown fox", "12+7=", "xyz", "multi-tenant RL!"]


def _req(tok: PreTrainedTokenizerBase, tenant: str, text: str, **kw: object) -> RolloutRequest:
    return RolloutRequest(tenant=tenant, prompt_ids=tuple(tok.encode(text)), **kw)  # type: ignore[arg-type]


def _reference(
    fresh_base: Callable[[], PreTrainedModel], bank: AdapterBank, request: RolloutRequest, n: int
) -> list[int]:
    """Greedy Hugging Face `generate` on a copy of the base with the adapter merged."""
    model = fresh_base()
    if request.tenant != "base":
        merged(model, bank.tensors(request.tenant), SPEC)
    ids = torch.tensor([request.prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
    )
    return out[0, ids.shape[1] :].tolist()


def test_greedy_equals_hf_generate_with_the_adapter_merged(
    make_engine: Callable[..., RolloutEngine],
    bank: AdapterBank,
    tokenizer: PreTrainedTokenizerBase,
    fresh_base: Callable[[], PreTrainedModel],
) -> None:
    engine = make_engine()
    requests = [
        _req(tokenizer, tenant, text, sampling=GREEDY)
        for tenant, text in [
            ("t0", PROMPTS[0]),
            ("t1", PROMPTS[0]),
            ("t2", PROMPTS[2]),
            ("base", PROMPTS[0]),
        ]
    ]
    outs = engine.generate(requests)
    for request, out in zip(requests, outs, strict=True):
        assert list(out.token_ids) == _reference(fresh_base, bank, request, 12)
        assert out.version == 0 and out.prompt_len == len(request.prompt_ids)
    # The adapters matter: the same prompt gives different outputs per tenant.
    assert len({outs[0].token_ids, outs[1].token_ids, outs[3].token_ids}) == 3


def test_logprobs_equal_a_full_forward(
    make_engine: Callable[..., RolloutEngine],
    bank: AdapterBank,
    tokenizer: PreTrainedTokenizerBase,
    fresh_base: Callable[[], PreTrainedModel],
) -> None:
    engine = make_engine()
    sampled = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=10, seed=3)
    requests = [
        _req(tokenizer, "t1", PROMPTS[2], sampling=GREEDY),
        _req(tokenizer, "t2", PROMPTS[3], sampling=sampled),
    ]
    for request, out in zip(requests, engine.generate(requests), strict=True):
        model = merged(fresh_base(), bank.tensors(request.tenant), SPEC)
        full = torch.tensor([request.prompt_ids + out.token_ids])
        with torch.no_grad():
            logits = model(full).logits[0, len(request.prompt_ids) - 1 : -1]
        T = request.sampling.logprob_temperature
        want = torch.log_softmax(logits / T, -1).gather(-1, torch.tensor(out.token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(out.logprobs), want.squeeze(-1), atol=1e-4, rtol=0)


def _solo(engine: RolloutEngine, request: RolloutRequest) -> Completion:
    return engine.generate([request])[0]


def test_mixed_tenant_batches_with_staggered_arrival_equal_solo_runs(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    tenants = ["t0", "t1", "t2", "base", "t1", "t0"]
    requests = [
        _req(
            tokenizer,
            tenant,
            text,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=6 + 3 * i),
        )
        for i, (tenant, text) in enumerate(zip(tenants, PROMPTS, strict=True))
    ]
    engine = make_engine()
    results: dict[str, Completion | BaseException] = {}
    for i, request in enumerate(requests):  # one new request every two iterations
        engine.enqueue(request, lambda r, rid=request.request_id: results.__setitem__(rid, r))
        if i < len(requests) - 1:
            engine.step()
            engine.step()
    while len(results) < len(requests):
        engine.step()
    assert engine.stats.max_batch >= 4
    solo_engine = make_engine()
    for request in requests:
        got = results[request.request_id]
        assert isinstance(got, Completion)
        want = _solo(solo_engine, request)
        assert_same_completion(got, want)


def test_stop_string_cuts_text_and_keeps_the_completing_token(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine()
    plain = _solo(
        engine,
        _req(tokenizer, "t0", "the", sampling=SamplingParams(temperature=0.0, max_new_tokens=24)),
    )
    text = plain.text
    # A two-character stop string from the middle of the output (no replacement chars).
    start = next(i for i in range(3, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop=("@@never@@", stop))
    out = _solo(engine, _req(tokenizer, "t0", "the", sampling=params))
    # Expected by definition: the shortest prefix of new tokens whose text contains the stop.
    n = next(n for n in range(1, 25) if stop in tokenizer.decode(plain.token_ids[:n]))
    assert out.finish_reason == "stop"
    assert out.token_ids == plain.token_ids[:n]
    assert len(out.logprobs) == n
    full = tokenizer.decode(plain.token_ids[:n])
    assert out.text == full[: full.find(stop)]
    assert stop not in out.text


def test_the_stop_check_of_new_tokens_only_finds_every_stop_of_a_batch(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    """Rows of one batch, each with its own stop strings (from its own output: ending in
    a letter, a space, a digit, a newline where there is one); only rows whose new token
    holds a stop's last character are decoded, and each row still ends exactly where
    the definition says."""
    sampled = [
        _req(tokenizer, "t0", f"row {i}", sampling=SamplingParams(temperature=1.0,
             max_new_tokens=24, seed=100 + i))
        for i in range(12)
    ]  # fmt: skip
    engine = make_engine()
    plains = engine.generate(sampled)
    requests = []
    for i, (request, plain) in enumerate(zip(sampled, plains, strict=True)):
        text = plain.text
        ok = [j for j in range(2, len(text) - 1) if "\ufffd" not in text[j - 1 : j + 1]]
        stops = ("@@never@@",)
        if ok:
            j = ok[(7 * i) % len(ok)]
            stops += (text[j - 1 : j + 1],)
        if "\n" in text:
            stops += ("\n",)
        requests.append(RolloutRequest(
            tenant="t0", prompt_ids=request.prompt_ids,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=24, seed=100 + i, stop=stops),
        ))  # fmt: skip
    outs = make_engine().generate(requests)

    def text_of(ids: tuple[int, ...]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    stopped = 0
    for request, plain, out in zip(requests, plains, outs, strict=True):
        stops = request.sampling.stop
        ends = [
            n for n in range(1, len(plain.token_ids) + 1)
            if any(s in text_of(plain.token_ids[:n]) for s in stops)
        ]  # fmt: skip
        if not ends:
            assert out.token_ids == plain.token_ids and out.finish_reason == plain.finish_reason
            continue
        n, stopped = ends[0], stopped + 1
        full = text_of(plain.token_ids[:n])
        assert out.finish_reason == "stop" and out.token_ids == plain.token_ids[:n]
        assert out.text == full[: min(full.find(s) for s in stops if s in full)]
    assert stopped >= 6


def test_eos_finishes_and_is_kept_in_tokens_not_text(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    request = _req(
        tokenizer, "t1", "hello world", sampling=SamplingParams(temperature=0.0, max_new_tokens=12)
    )
    plain = _solo(make_engine(eos_token_ids=[]), request)
    eos = plain.token_ids[4]
    out = _solo(make_engine(eos_token_ids=[eos]), request)
    k = plain.token_ids.index(eos)
    assert out.finish_reason == "eos"
    assert out.token_ids == plain.token_ids[: k + 1]
    assert out.text == tokenizer.decode(plain.token_ids[:k])
    assert plain.finish_reason == "length" and len(plain.token_ids) == 12


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=1234),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.9, max_new_tokens=16, seed=99),
    ],
)
def test_seeded_sampling_is_reproducible_whatever_the_batch(
    make_engine: Callable[..., RolloutEngine],
    tokenizer: PreTrainedTokenizerBase,
    params: SamplingParams,
) -> None:
    engine = make_engine()
    request = _req(tokenizer, "t2", "seed me", sampling=params)
    alone = _solo(engine, request)
    others = [
        _req(tokenizer, t, p, sampling=SamplingParams(temperature=1.0, max_new_tokens=20))
        for t, p in [("t0", "noise"), ("t1", "more noise here"), ("base", "n")]
    ]
    engine.enqueue(others[0], lambda r: None)
    engine.step()
    engine.step()
    outs = engine.generate([others[1], request, others[2]])
    assert_same_completion(outs[1], alone)
    reseeded = _solo(
        engine,
        _req(
            tokenizer,
            "t2",
            "seed me",
            sampling=SamplingParams(
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                max_new_tokens=16,
                seed=params.seed + 1,
            ),
        ),
    )  # type: ignore[operator]
    assert reseeded.token_ids != alone.token_ids


def test_prompt_logprobs_equal_a_full_forward_cached_shared_or_not(
    make_engine: Callable[..., RolloutEngine],
    bank: AdapterBank,
    tokenizer: PreTrainedTokenizerBase,
    fresh_base: Callable[[], PreTrainedModel],
) -> None:
    engine = make_engine()
    text, tenant = PROMPTS[5], "t1"
    plain = SamplingParams(temperature=1.0, max_new_tokens=4, seed=5)
    asking = SamplingParams(temperature=1.0, max_new_tokens=4, seed=5, prompt_logprobs=True)
    first = _solo(engine, _req(tokenizer, tenant, text, sampling=plain))  # fills the cache
    assert first.prompt_logprobs is None
    # A cached prompt still answers, and so does one that shares a prefill this iteration.
    together = engine.generate(
        [
            _req(tokenizer, tenant, text, sampling=asking),
            _req(tokenizer, tenant, text, sampling=plain),
            _req(tokenizer, "t0", PROMPTS[2], sampling=asking),
        ]
    )
    assert together[1].prompt_logprobs is None
    assert_same_completion(together[0], first)  # asking changes nothing else
    for tenant_, text_, out in [(tenant, text, together[0]), ("t0", PROMPTS[2], together[2])]:
        prompt = tokenizer.encode(text_)
        model = merged(fresh_base(), bank.tensors(tenant_), SPEC)
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None])
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] == 0.0
        torch.testing.assert_close(
            torch.tensor(out.prompt_logprobs[1:]), want.squeeze(-1), atol=1e-4, rtol=0
        )
