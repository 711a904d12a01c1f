"""Scheduling: rows join and leave mid-flight, versions pinned at admission, session KV
reuse, per-request failures, adapter-slot capacity."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from rollout_support import SPEC, assert_same_completion, random_adapter
from transformers import PreTrainedTokenizerBase

from marlaas.errors import TenantNotFound
from marlaas.model.bank import AdapterBank
from marlaas.model.lora import LoRAModel
from marlaas.rollout import InvalidRequest, RolloutEngine
from marlaas.types import Completion, RolloutRequest, SamplingParams


def _req(
    tok: PreTrainedTokenizerBase, tenant: str, text: str, n: int, **kw: object
) -> RolloutRequest:
    params = SamplingParams(temperature=0.0, max_new_tokens=n)
    return RolloutRequest(tenant=tenant, prompt_ids=tuple(tok.encode(text)), sampling=params, **kw)  # type: ignore[arg-type]


class Collector:
    def __init__(self) -> None:
        self.done: dict[str, Completion | BaseException] = {}
        self.order: list[str] = []

    def __call__(self, request: RolloutRequest) -> Callable[[Completion | BaseException], None]:
        def deliver(result: Completion | BaseException) -> None:
            self.done[request.request_id] = result
            self.order.append(request.request_id)

        return deliver


def _drain(engine: RolloutEngine, collector: Collector, n: int) -> None:
    while len(collector.done) < n:
        engine.step()


def test_short_request_joins_mid_flight_and_leaves_first(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine()
    got = Collector()
    long = _req(tokenizer, "t0", "a long one", 40)
    short = _req(tokenizer, "t1", "short", 3)
    engine.enqueue(long, got(long))
    for _ in range(5):
        engine.step()
    engine.enqueue(short, got(short))
    steps = 0
    while short.request_id not in got.done:
        assert engine.step() > 0
        steps += 1
    assert steps <= 2  # prefill + first decode give 2 tokens in one iteration, then 1 more
    assert long.request_id not in got.done and engine.running == 1
    _drain(engine, got, 2)
    assert got.order == [short.request_id, long.request_id]
    long_out = got.done[long.request_id]
    assert isinstance(long_out, Completion) and len(long_out.token_ids) == 40
    assert long_out.token_ids == make_engine().generate([long])[0].token_ids


def test_publish_mid_flight_keeps_running_sequences_on_their_version(
    make_engine: Callable[..., RolloutEngine],
    lora_model: LoRAModel,
    bank: AdapterBank,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    engine = make_engine()
    got = Collector()
    old = _req(tokenizer, "t0", "policy", 20)
    engine.enqueue(old, got(old))
    for _ in range(4):
        engine.step()
    engine.publish("t0", 1, random_adapter(lora_model, 77))
    new = _req(tokenizer, "t0", "policy", 20)
    engine.enqueue(new, got(new))
    _drain(engine, got, 2)
    old_out, new_out = got.done[old.request_id], got.done[new.request_id]
    assert isinstance(old_out, Completion) and isinstance(new_out, Completion)
    assert (old_out.version, new_out.version) == (0, 1)
    fresh = make_engine()
    pinned_v0 = fresh.generate([_req(tokenizer, "t0", "policy", 20, version=0)])[0]
    assert old_out.token_ids == pinned_v0.token_ids
    assert new_out.token_ids == fresh.generate([_req(tokenizer, "t0", "policy", 20)])[0].token_ids
    assert new_out.token_ids != old_out.token_ids
    assert not bank._handles  # every pin was released


def test_session_continuation_prefills_only_new_tokens(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine()
    first = _req(tokenizer, "t2", "turn one:", 8, session="ep-1")
    turn1 = engine.generate([first])[0]
    observation = tuple(tokenizer.encode(" obs=42."))
    prompt2 = first.prompt_ids + turn1.token_ids + observation
    second = RolloutRequest(
        tenant="t2", prompt_ids=prompt2, sampling=first.sampling, session="ep-1"
    )
    fresh = _req(tokenizer, "t0", "a fresh request prefilled in the same forward", 8)
    before = engine.stats
    cont, fresh_out = engine.generate([second, fresh])
    after = engine.stats
    reused = len(first.prompt_ids) + len(turn1.token_ids) - 1
    assert after.reused_tokens - before.reused_tokens == reused
    new_tokens = len(prompt2) - reused + len(fresh.prompt_ids)
    assert after.prefill_tokens - before.prefill_tokens == new_tokens
    assert fresh_out.token_ids == make_engine().generate([fresh])[0].token_ids
    scratch_engine = make_engine()
    scratch = scratch_engine.generate(
        [RolloutRequest(tenant="t2", prompt_ids=prompt2, sampling=first.sampling)]
    )[0]
    assert scratch_engine.stats.prefill_tokens == len(prompt2)
    assert_same_completion(cont, scratch)


def test_session_reuses_the_shared_prefix_only_on_the_same_version(
    make_engine: Callable[..., RolloutEngine],
    lora_model: LoRAModel,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    engine = make_engine()
    scratch = make_engine()
    first = _req(tokenizer, "t1", "hi", 5, session="s")
    out = engine.generate([first])[0]
    cached = len(first.prompt_ids) + len(out.token_ids) - 1

    def turn(prompt: tuple[int, ...], session: str = "s", tenant: str = "t1") -> Completion:
        r = RolloutRequest(
            tenant=tenant, prompt_ids=prompt, sampling=first.sampling, session=session
        )
        got = engine.generate([r])[0]
        want = scratch.generate(
            [RolloutRequest(tenant=tenant, prompt_ids=prompt, sampling=first.sampling)]
        )[0]
        assert got.token_ids == want.token_ids
        return got

    # Diverges right after the prompt: only the prompt's KV is reused.
    before = engine.stats.reused_tokens
    turn((*first.prompt_ids, out.token_ids[0] ^ 1, *out.token_ids[1:]))
    assert engine.stats.reused_tokens - before == len(first.prompt_ids)
    # Exactly the cached context: all of it but the last token, which must be re-fed.
    engine.generate([first])
    before = engine.stats.reused_tokens
    turn(first.prompt_ids + out.token_ids[:-1])
    assert engine.stats.reused_tokens - before == cached - 1
    # Another tenant's session of the same name sees nothing and evicts nothing.
    engine.generate([first])
    before = engine.stats.reused_tokens
    turn(first.prompt_ids + out.token_ids, tenant="t2")
    assert engine.stats.reused_tokens == before
    # A new version of the adapter: everything is recomputed.
    engine.publish("t1", 1, random_adapter(lora_model, 5))
    turn(first.prompt_ids + out.token_ids + (65,))
    assert engine.stats.reused_tokens == before


def test_one_bad_request_fails_alone(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine()
    got = Collector()
    good = [_req(tokenizer, "t0", "fine", 5), _req(tokenizer, "t1", "also fine", 5)]
    too_long = _req(tokenizer, "t0", "x" * 80, 5)
    unknown = _req(tokenizer, "nobody", "hi", 5)
    empty = RolloutRequest(tenant="t0", prompt_ids=())
    bad_ids = RolloutRequest(tenant="t0", prompt_ids=(5, 100000))
    for r in [good[0], too_long, unknown, good[1], empty, bad_ids]:
        engine.enqueue(r, got(r))
    _drain(engine, got, 6)
    assert isinstance(got.done[too_long.request_id], InvalidRequest)
    assert "positions" in str(got.done[too_long.request_id])
    assert isinstance(got.done[unknown.request_id], TenantNotFound)
    assert isinstance(got.done[empty.request_id], InvalidRequest)
    assert isinstance(got.done[bad_ids.request_id], InvalidRequest)
    for r in good:
        assert isinstance(got.done[r.request_id], Completion)
    assert engine.stats.failed == 4 and engine.stats.completed == 2


def test_one_token_requests_finish_at_prefill(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine()
    one = _req(tokenizer, "t2", "one", 1, session="s1")
    longer = _req(tokenizer, "t2", "one", 4)
    out, ref = engine.generate([one, longer])
    assert out.finish_reason == "length" and out.token_ids == ref.token_ids[:1]
    follow = RolloutRequest(
        tenant="t2",
        prompt_ids=one.prompt_ids + out.token_ids,
        sampling=longer.sampling,
        session="s1",
    )
    before = engine.stats.reused_tokens
    assert (
        engine.generate([follow])[0].token_ids
        == ref.token_ids[1:]
        + engine.generate(
            [
                RolloutRequest(
                    tenant="t2",
                    prompt_ids=one.prompt_ids + ref.token_ids[:4],
                    sampling=one.sampling,
                )
            ]
        )[0].token_ids
    )
    assert engine.stats.reused_tokens - before == len(one.prompt_ids)


def test_generation_stops_at_the_models_last_position(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    out = make_engine().generate([_req(tokenizer, "t0", "y" * 60, 30)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 60 + 1


def test_more_tenants_than_slots_still_complete(
    lora_model: LoRAModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    bank = AdapterBank(lora_model, num_slots=2)
    for i in range(5):
        bank.register(f"u{i}", SPEC, tensors=random_adapter(lora_model, 40 + i))
    engine = RolloutEngine(lora_model, bank, tokenizer)
    requests = [_req(tokenizer, f"u{i % 5}", f"p{i}", 4 + i) for i in range(8)]
    outs = engine.generate(requests)
    assert engine.stats.max_batch <= 2 * 2  # at most two adapters resident at once
    for request, out in zip(requests, outs, strict=True):
        assert out.token_ids == engine.generate([request])[0].token_ids
    with pytest.raises(TenantNotFound):
        engine.generate([_req(tokenizer, "u9", "x", 2)])


def test_many_sessions_in_flight_all_keep_their_caches(
    make_engine: Callable[..., RolloutEngine], tokenizer: PreTrainedTokenizerBase
) -> None:
    """More sessions waiting on their next turn than the old entry bound (256): every
    second turn continues its session's cache (the token bound is the memory's, and
    300 short sessions stay well within it)."""
    engine = make_engine(background=False)
    firsts = [_req(tokenizer, f"t{i % 3}", f"ep {i}:", 2, session=f"ep-{i}") for i in range(300)]
    outs = engine.generate(firsts)
    seconds = [
        RolloutRequest(
            tenant=first.tenant,
            prompt_ids=first.prompt_ids + out.token_ids + tuple(tokenizer.encode(" ok")),
            sampling=first.sampling,
            session=first.session,
        )
        for first, out in zip(firsts, outs, strict=True)
    ]
    before = engine.stats.reused_tokens
    engine.generate(seconds)
    # Each second turn reuses its first turn's prompt and completion but the last token.
    want = sum(len(f.prompt_ids) + len(o.token_ids) - 1 for f, o in zip(firsts, outs, strict=True))
    assert engine.stats.reused_tokens - before == want
