"""Sampling calls of the Tinker-compatible API: sampling sessions, samplers, `asample`.

An `asample` of `num_samples` is that many engine requests of one prompt (choice `j`
of a seeded request samples with seed `seed + j`), sent to the device's shared
continuous batch, where every tenant's requests run together; the samples of one
prompt share its prefill. Its answer at once carries one `sample_sequence_ids` entry
per sample (the SDK asserts it), in the order of the sequences of the result.

Prompt log-probs (`prompt_logprobs`, `compute_logprobs`) come from the engine's own
prefill of the prompt (`SamplingParams.prompt_logprobs`): entry 0 has none (no
context), and with `prompt_logprobs_last_n` only the last `n` entries are given.

Not supported, and refused by name: top-k log-probs of the prompt or the samples,
target or alternative prompt tokens, stability records (StableReinforce).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from marlaas.config.specs import LoRASpec
from marlaas.errors import EngineClosed
from marlaas.model.lora import AdapterTensors
from marlaas.service.tinker import convert, state_io, wire
from marlaas.service.tinker.errors import UserError, category_of
from marlaas.service.tinker.hub import LiveRun, TinkerHub
from marlaas.service.tinker.paths import TinkerPath, new_sampler_id
from marlaas.service.tinker.samplers import Loader, Sampler
from marlaas.types import Completion, RolloutRequest, SamplingParams

#: Answers of `asample` remembered for resends.
_REMEMBERED = 65_536


@dataclass(frozen=True)
class SampledSequence:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    stop_reason: str  # "stop" or "length"


@dataclass(frozen=True)
class SampleReply:
    """A `SampleResponse`: the sequences, and the prompt's log-probs when asked."""

    sequences: Sequence[SampledSequence]
    prompt_logprobs: Sequence[float | None] | None

    def json(self) -> dict[str, Any]:
        return {
            "type": "sample",
            "sequences": [
                {
                    "tokens": list(s.tokens),
                    "logprobs": list(s.logprobs),
                    "stop_reason": s.stop_reason,
                }
                for s in self.sequences
            ],
            "prompt_logprobs": None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        }

    def protobuf(self) -> bytes:
        from marlaas.service.tinker.protobuf import encode_sample

        return encode_sample(
            [(s.tokens, s.logprobs, s.stop_reason) for s in self.sequences], self.prompt_logprobs
        )


# -- samplers -------------------------------------------------------------------------


def _register(hub: TinkerHub, sampler: Sampler, seq: int | None) -> Sampler:
    hub.samplers[sampler.id] = sampler
    if seq is not None:
        hub.sessions.get(sampler.owner, sampler.session_id).samplers[seq] = sampler.id
    return sampler


async def ephemeral_sampler(
    hub: TinkerHub, owner: str, session_id: str, seq: int, run: LiveRun, tensors: AdapterTensors
) -> Sampler:
    """The sampler of `save_weights_and_get_sampling_client`: the weights a run just
    exported, kept in memory only. A run keeps its newest `ephemeral_samplers` of them
    (an RL loop makes one per step); older ones are forgotten (404 from then on)."""
    known = hub.sessions.get(owner, session_id).samplers.get(seq)
    if known is not None:
        return hub.sampler(owner, known)
    sampler_id = new_sampler_id(session_id)
    lora: LoRASpec = run.lora

    async def load() -> tuple[LoRASpec, AdapterTensors]:
        return lora, tensors

    sampler = Sampler(
        sampler_id, owner, session_id, run.base_model, None, f"memory:{sampler_id}", load
    )
    kept = hub.ephemeral.setdefault(run.id, deque())
    kept.append(sampler_id)
    while len(kept) > hub.settings.ephemeral_samplers:
        await hub.forget_sampler(kept.popleft())
    return _register(hub, sampler, seq)


async def _path_loader(hub: TinkerHub, owner: str, where: str) -> tuple[str, Loader, str]:
    """The key, loader and base model of the weights at a `tinker://` path the owner
    has (404 otherwise)."""
    path = TinkerPath.parse(where)
    record = await asyncio.to_thread(hub.store.checkpoint, owner, path)
    run = await asyncio.to_thread(hub.store.run, owner, path.run_id)
    model = (await hub.device()).port.model

    async def load() -> tuple[LoRASpec, AdapterTensors]:
        return await asyncio.to_thread(state_io.read_adapter, record.directory, model)

    return f"path:{path}", load, run.base_model


async def create_sampling_session(
    hub: TinkerHub, owner: str, body: wire.CreateSamplingSessionRequest
) -> wire.CreateSamplingSessionResponse:
    session = hub.sessions.get(owner, body.session_id)
    known = session.samplers.get(body.sampling_session_seq_id)
    if known is None:
        sampler = await _new_sampler(hub, owner, session.id, body.base_model, body.model_path)
        known = _register(hub, sampler, body.sampling_session_seq_id).id
    return wire.CreateSamplingSessionResponse(sampling_session_id=known)


async def _new_sampler(
    hub: TinkerHub, owner: str, session_id: str, base_model: str | None, model_path: str | None
) -> Sampler:
    if model_path is None:
        if base_model is None:
            raise UserError("a sampling client needs a model_path or a base_model")
        base = await hub.base_model(base_model)
        return Sampler(new_sampler_id(session_id), owner, session_id, base, None, None, None)
    key, load, base = await _path_loader(hub, owner, model_path)
    if base_model is not None:
        await hub.base_model(base_model)  # a wrong base name is still refused
    return Sampler(new_sampler_id(session_id), owner, session_id, base, model_path, key, load)


def get_sampler(hub: TinkerHub, owner: str, sampler_id: str) -> wire.GetSamplerResponse:
    sampler = hub.sampler(owner, sampler_id)
    return wire.GetSamplerResponse(
        sampler_id=sampler.id, base_model=sampler.base_model, model_path=sampler.model_path
    )


# -- asample --------------------------------------------------------------------------


def _refuse_unsupported(body: wire.SampleRequest) -> None:
    asked = [
        name
        for name, on in (
            ("topk_prompt_logprobs", body.topk_prompt_logprobs > 0),
            ("topk_sample_logprobs", body.topk_sample_logprobs > 0),
            ("target_prompt_logprobs", body.target_prompt_logprobs is not None),
            ("prompt_alt_tokens_k", body.prompt_alt_tokens_k > 0),
            ("record_stability_info", bool(body.record_stability_info)),
        )
        if on
    ]
    if asked:
        raise UserError(
            f"{', '.join(asked)}: not supported by this server; it returns the sampled "
            "tokens' log-probs and, with prompt_logprobs, the prompt's"
        )


async def asample(hub: TinkerHub, owner: str, body: wire.SampleRequest) -> wire.UntypedFuture:
    if body.sampling_session_id is not None:
        sampler = hub.sampler(owner, body.sampling_session_id)
        key = (sampler.id, body.seq_id) if body.seq_id is not None else None
        if key is not None and key in hub.sample_calls:
            return hub.sample_calls[key]
    else:
        sampler = await _new_sampler(hub, owner, "direct", body.base_model, body.model_path)
        key = None
    _refuse_unsupported(body)
    limits = await hub.limits()
    prompt = convert.prompt_tokens(body.prompt)
    convert.check_prompt(prompt, limits)
    if not 1 <= body.num_samples <= hub.settings.max_num_samples:
        raise UserError(
            f"num_samples must be 1 to {hub.settings.max_num_samples}, got {body.num_samples}"
        )
    want_prompt = bool(body.prompt_logprobs)
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and not (want_prompt and 1 <= last_n <= len(prompt) - 1):
        raise UserError(
            f"prompt_logprobs_last_n must be 1 to {len(prompt) - 1} (the prompt's length - 1), "
            "with prompt_logprobs set"
        )
    sampling = convert.sampling(body.sampling_params, len(prompt), limits)
    request_id = hub.futures.create(owner)
    answer = wire.UntypedFuture(
        request_id=request_id,
        sample_sequence_ids=[f"{request_id}:{j}" for j in range(body.num_samples)],
    )
    if key is not None:
        hub.sample_calls[key] = answer
        while len(hub.sample_calls) > _REMEMBERED:
            hub.sample_calls.popitem(last=False)
    task = hub.spawn(
        _serve(
            hub, owner, request_id, sampler, prompt, body.num_samples, sampling, want_prompt, last_n
        ),
        f"tinker-sample-{request_id}",
    )
    hub.sample_tasks[request_id] = task
    task.add_done_callback(lambda _: hub.sample_tasks.pop(request_id, None))
    hub.counters.count(owner, "sample")
    return answer


def _with_prompt_logprobs(params: SamplingParams) -> SamplingParams:
    try:  # the engine's prompt log-probs (`SamplingParams.prompt_logprobs`)
        options: dict[str, Any] = {"prompt_logprobs": True}
        return dataclasses.replace(params, **options)
    except TypeError as e:
        raise UserError("this server's engine cannot compute prompt log-probs") from e


async def _serve(
    hub: TinkerHub,
    owner: str,
    request_id: str,
    sampler: Sampler,
    prompt: list[int],
    n: int,
    sampling: convert.Sampling,
    want_prompt: bool,
    last_n: int | None,
) -> None:
    try:
        device = (await hub.device()).port
        adapters = await hub.adapters()
        async with adapters.use(sampler) as name:
            params = sampling.params
            requests = [
                RolloutRequest(
                    tenant=name,
                    prompt_ids=tuple(prompt),
                    sampling=_params_of(params, j, want_prompt and j == 0),
                )
                for j in range(n)
            ]
            futures = [asyncio.ensure_future(device.sample(r)) for r in requests]
            try:
                completions = await asyncio.gather(*futures)
            finally:
                for f in futures:
                    f.cancel()
        reply = _reply(completions, sampling.stop_tokens, want_prompt, last_n)
        hub.counters.add(
            hub.counters.sampled_tokens, owner, sum(len(s.tokens) for s in reply.sequences)
        )
        hub.futures.resolve(request_id, reply)
    except asyncio.CancelledError:
        hub.futures.fail(request_id, "the sample was cancelled", "user")
        raise
    except Exception as e:
        message = str(e) or type(e).__name__
        if isinstance(e, EngineClosed):
            message = f"the server is shutting down: {message}"
        hub.futures.fail(request_id, message, category_of(e))


def _params_of(params: SamplingParams, j: int, prompt_logprobs: bool) -> SamplingParams:
    seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + j)
    return _with_prompt_logprobs(seeded) if prompt_logprobs else seeded


def _reply(
    completions: Sequence[Completion],
    stop_tokens: frozenset[int],
    want_prompt: bool,
    last_n: int | None,
) -> SampleReply:
    sequences = []
    for c in completions:
        if c.finish_reason == "aborted":
            raise EngineClosed("a sample was aborted by the engine")
        tokens, logprobs = c.token_ids, c.logprobs
        cut = convert.cut_at_stop(tokens, stop_tokens) if stop_tokens else None
        stopped = c.finish_reason in ("stop", "eos")
        if cut is not None:
            tokens, logprobs, stopped = tokens[:cut], logprobs[:cut], True
        sequences.append(
            SampledSequence(tuple(tokens), tuple(logprobs), "stop" if stopped else "length")
        )
    prompt_lp: list[float | None] | None = None
    if want_prompt:
        given = getattr(completions[0], "prompt_logprobs", None)
        if given is None:
            raise UserError("this server's engine did not return the prompt's log-probs")
        prompt_lp = [None, *(float(v) for v in given[1:])]
        if last_n is not None:
            keep = len(prompt_lp) - last_n
            blank: list[float | None] = [None] * keep
            prompt_lp = blank + prompt_lp[keep:]
    return SampleReply(sequences, prompt_lp)
