"""Prefill planning: identical prompts (a GRPO group's samples) are prefilled once and
shared, prompts of very different lengths go to different forwards, and neither changes
what any request gets back."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rollout_support import SPEC, assert_same_completion, random_adapter
from transformers import PreTrainedTokenizerBase

import marlaas.rollout.prefill as prefill
from marlaas.model.bank import AdapterBank
from marlaas.model.lora import LoRAModel
from marlaas.packing import MIN_FILL, pack_cheapest, pack_longest_first
from marlaas.rollout import RolloutEngine
from marlaas.rollout.forward import RowForward
from marlaas.rollout.prefill import FORWARD_TOKENS, plan_prefill
from marlaas.types import Completion, RolloutRequest, SamplingParams


def _sampled(
    tok: PreTrainedTokenizerBase, tenant: str, text: str, seed: int, **kw: Any
) -> RolloutRequest:
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed)
    return RolloutRequest(tenant=tenant, prompt_ids=tuple(tok.encode(text)), sampling=params, **kw)


def _alone(make_engine: Callable[..., RolloutEngine], request: RolloutRequest) -> Completion:
    return make_engine().generate([request])[0]


def test_a_group_with_one_prompt_is_prefilled_once(
    make_engine: Callable[..., RolloutEngine],
    tokenizer: PreTrainedTokenizerBase,
    lora_model: LoRAModel,
    bank: AdapterBank,
) -> None:
    prompt = "what is 12 + 30? answer:"
    group = [_sampled(tokenizer, "t0", prompt, seed=s) for s in (1, 2, 3, 4)]
    other_tenant = _sampled(tokenizer, "t1", prompt, seed=5)
    session = _sampled(tokenizer, "t0", prompt, seed=6, session="ep-shared")
    n = len(group[0].prompt_ids)
    engine = make_engine()
    outs = engine.generate([*group, other_tenant, session])
    # t0's group and its first session turn share one prefill; t1 has its own adapter.
    assert engine.stats.prefill_tokens == 2 * n
    assert engine.stats.shared_prefill_tokens == 4 * n
    for request, out in zip([*group, other_tenant, session], outs, strict=True):
        assert_same_completion(out, _alone(make_engine, request))
    assert len({out.token_ids for out in outs[:4]}) > 1  # each sampled with its own seed
    assert not bank._handles


def test_versions_are_never_shared(
    make_engine: Callable[..., RolloutEngine],
    tokenizer: PreTrainedTokenizerBase,
    lora_model: LoRAModel,
) -> None:
    engine = make_engine()
    engine.publish("t2", 1, random_adapter(lora_model, 99))
    old = _sampled(tokenizer, "t2", "same words", seed=7, version=0)
    new = _sampled(tokenizer, "t2", "same words", seed=7, version=1)
    out_old, out_new = engine.generate([old, new])
    assert engine.stats.shared_prefill_tokens == 0
    assert (out_old.version, out_new.version) == (0, 1)
    assert_same_completion(out_old, _alone(make_engine, old))
    assert_same_completion(out_new, _alone(make_engine, new))


def test_short_and_long_prompts_use_separate_forwards(
    make_engine: Callable[..., RolloutEngine],
    tokenizer: PreTrainedTokenizerBase,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    widths: list[list[int]] = []
    real = RowForward.prefill

    def spy(*args: Any, **kwargs: Any) -> Any:
        widths.append([len(t) for t in args[4]])  # (self, row0, slot_R, past, new_tokens)
        return real(*args, **kwargs)

    monkeypatch.setattr(RowForward, "prefill", spy)
    # Forwards of a small fixed price: the short and long prompts do not pad each other.
    monkeypatch.setattr(prefill, "FORWARD_TOKENS", 4)
    long_text = "a much longer prompt that goes on and on"
    requests = [
        _sampled(tokenizer, "t0", "hi", seed=1),
        _sampled(tokenizer, "t1", long_text, seed=2),
        _sampled(tokenizer, "t2", "yo", seed=3),
        _sampled(tokenizer, "t0", long_text + "!", seed=4),
    ]
    engine = make_engine()
    outs = engine.generate(requests)
    assert len(widths) == 2
    for forward in widths:
        assert min(forward) >= MIN_FILL * max(forward)
    assert sorted(len(r.prompt_ids) for r in requests) == sorted(
        n for forward in widths for n in forward
    )
    monkeypatch.setattr(RowForward, "prefill", real)
    for request, out in zip(requests, outs, strict=True):
        assert_same_completion(out, _alone(make_engine, request))
    # At a price above the padding (2 x 39 tokens), they share one: same completions.
    monkeypatch.setattr(prefill, "FORWARD_TOKENS", 100)
    monkeypatch.setattr(RowForward, "prefill", spy)
    widths.clear()
    together = make_engine().generate(requests)
    assert len(widths) == 1
    for out, want in zip(together, outs, strict=True):
        assert_same_completion(out, want)


def test_a_prompt_prefilled_earlier_comes_from_the_prompt_cache(
    make_engine: Callable[..., RolloutEngine],
    tokenizer: PreTrainedTokenizerBase,
    lora_model: LoRAModel,
    bank: AdapterBank,
) -> None:
    engine = make_engine()
    first = _sampled(tokenizer, "t1", "seven times six is", seed=1)
    later = _sampled(tokenizer, "t1", "seven times six is", seed=2)
    n = len(first.prompt_ids)
    engine.generate([first])
    out = engine.generate([later])[0]
    assert (engine.stats.prefill_tokens, engine.stats.shared_prefill_tokens) == (n, n)
    assert_same_completion(out, _alone(make_engine, later))
    # The same tenant name registered again is another adapter: nothing is reused.
    bank.remove("t1")
    bank.register("t1", SPEC, tensors=random_adapter(lora_model, 55))
    again = engine.generate([later])[0]
    assert engine.stats.shared_prefill_tokens == n
    assert_same_completion(again, _alone(make_engine, later))
    assert again.token_ids != out.token_ids or again.logprobs != out.logprobs
    # Without a prompt cache only requests admitted together share.
    plain = make_engine(max_prompts=0)
    plain.generate([first])
    plain.generate([later])
    assert plain.stats.shared_prefill_tokens == 0


def _fake(tenant: str, version: int, tokens: tuple[int, ...], past: object = None) -> Any:
    handle = SimpleNamespace(adapter_id=hash((tenant, version)))
    return SimpleNamespace(
        row=SimpleNamespace(handle=handle),
        past=past,
        new_tokens=tokens,
        wants_prompt_logprobs=False,
    )


@pytest.mark.parametrize("seed", range(5))
def test_plan_prefill_covers_every_prompt_once_with_bounded_padding(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    admitted = []
    for _ in range(40):
        n = int(torch.randint(1, 300, (1,), generator=gen))
        tenant = f"t{int(torch.randint(0, 3, (1,), generator=gen))}"
        tokens = tuple([int(torch.randint(0, 4, (1,), generator=gen))] * n)
        past = object() if bool(torch.rand(1, generator=gen) < 0.2) else None
        admitted.append(_fake(tenant, 0, tokens, past))
    cached = {j for j in set(range(0, 40, 7)) if admitted[j].past is None}
    source, forwards = plan_prefill(admitted, cached)
    planned = sorted(i for forward in forwards for i in forward)
    assert planned == sorted(set(source) - cached)  # every other distinct prompt once
    for i, j in enumerate(source):
        a, b = admitted[i], admitted[j]
        assert j <= i and a.new_tokens == b.new_tokens
        assert a.row.handle.adapter_id == b.row.handle.adapter_id
        assert j == i or (a.past is None and b.past is None)
    assert not cached & set(planned)
    # Longest first, and no cheaper than the bounded-padding plan or one big forward.
    lengths = [[len(admitted[i].new_tokens) for i in forward] for forward in forwards]
    assert all(f == sorted(f, reverse=True) for f in lengths)
    flat = sorted((n for f in lengths for n in f), reverse=True)
    bounded = [flat[a:b] for a, b in pack_longest_first(flat)]
    assert _cost(lengths) <= min(_cost(bounded), _cost([flat]))


def _cost(forwards: list[list[int]]) -> int:
    return sum(FORWARD_TOKENS + len(f) * max(f) for f in forwards)


@pytest.mark.parametrize("seed", range(20))
def test_the_cheapest_cut_is_the_least_cost_of_all_cuts(seed: int) -> None:
    gen = random.Random(seed)
    top = 200 if seed % 2 else 6  # odd seeds: runs of equal lengths
    lengths = sorted((gen.randint(1, top) for _ in range(gen.randint(1, 9))), reverse=True)
    fixed = gen.choice([0, 16, 64, 500])
    spans = pack_cheapest(lengths, fixed)
    assert [a for a, _ in spans] == [0, *(b for _, b in spans[:-1])]  # a partition, in order
    assert spans[-1][1] == len(lengths)
    got = sum(fixed + (b - a) * lengths[a] for a, b in spans)
    best = min(
        sum(fixed + (b - a) * lengths[a] for a, b in itertools.pairwise((0, *cuts, len(lengths))))
        for k in range(len(lengths))
        for cuts in itertools.combinations(range(1, len(lengths)), k)
    )
    assert got == best


def test_short_prompts_share_one_prefill_forward() -> None:
    """Prompts of 3 to 40 tokens (an iteration's new rows in a multi-turn workload) run
    in one forward: the padding costs less than a forward's fixed price."""
    admitted = [_fake("t0", 0, (k % 5 + 1,) * n, None) for k, n in enumerate((40, 31, 12, 3, 25))]
    _, forwards = plan_prefill(admitted, set())
    assert forwards == [[0, 1, 4, 2, 3]]
