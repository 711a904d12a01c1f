"""Explicit conversion from the Tinker wire shapes (`wire`) to marlaas's records: LoRA
specs, training data (`Datum` rows and their objective), AdamW parameters and sampling
parameters. Every refusal is a `UserError` that names the field and the fix.

Tinker's data layout is marlaas's: position `t` of a datum's `model_input` is scored
on `target_tokens[t]`, so a datum maps to one `Datum` row position by position.
Weights: `cross_entropy` takes the datum's `weights` (all ones when it gives none);
the policy-gradient losses take none in Tinker and sum over every position, so each
position weighs 1, except that positions where the loss is identically zero whatever
the weights (`importance_sampling`, `ppo`, `cispo`: zero advantage; `dro`: zero
advantage and zero sampling log-prob, i.e. the padding before the sampled tokens)
get weight 0. That changes neither the loss nor its gradient, and lets the trainer
share the forward of a prompt between the samples of one group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from marlaas.config.specs import LoRASpec
from marlaas.errors import ConfigError
from marlaas.model.arch import Role
from marlaas.service.tinker import wire
from marlaas.service.tinker.errors import UserError
from marlaas.train.objectives import Objective, make_objective
from marlaas.train.optim import AdamParams
from marlaas.types import Datum, SamplingParams

#: LoRA alpha of every Tinker adapter (Tinker fixes it; the update is scaled by alpha/r).
LORA_ALPHA = 32.0
#: Losses this server runs, by Tinker name (all of the trainer's objective registry that
#: Tinker clients name).
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
_RL_LOSSES = frozenset(LOSSES) - {"cross_entropy"}
#: `loss_fn_inputs` each loss reads (beyond `target_tokens`).
_INPUTS = {
    "cross_entropy": frozenset({"weights"}),
    **{name: frozenset({"logprobs", "advantages", "weights"}) for name in _RL_LOSSES},
}


@dataclass(frozen=True)
class ModelLimits:
    """What the base accepts: its vocabulary and its context (positions)."""

    vocab_size: int
    max_positions: int


# -- LoRA -----------------------------------------------------------------------------


def lora_spec(config: wire.LoraConfig | None, roles: Mapping[str, frozenset[Role]]) -> LoRASpec:
    """The adapter of a `create_model`: rank as asked, alpha `LORA_ALPHA`, the layers of
    the roles asked for (`train_attn`: attention projections, `train_mlp`: feed-forward
    layers; `roles` maps the base's injected leaf names to theirs, `model.arch`). A leaf
    name of both roles (GPT-2's `c_proj`) is trained only when both are asked for: a
    leaf name adapts every layer of that name. `train_unembed` cannot be honoured (the
    unembedding is never adapted here) and is ignored; the README says so."""
    if config is None:
        raise UserError("create_model needs a lora_config (this server trains LoRA adapters)")
    if config.rank < 1:
        raise UserError(f"lora_config.rank must be >= 1, got {config.rank}")
    wanted: set[Role] = set()
    if config.train_attn:
        wanted.add("attention")
    if config.train_mlp:
        wanted.add("mlp")
    targets = tuple(name for name, of in roles.items() if of <= wanted)
    if not targets:
        described = ", ".join(f"{n} ({'+'.join(sorted(r))})" for n, r in roles.items())
        raise UserError(
            "lora_config trains no module this base has adapters on: set train_attn or "
            f"train_mlp (adaptable here: {described})"
        )
    return LoRASpec(rank=config.rank, alpha=LORA_ALPHA, target_modules=targets)


def lora_flags(spec: LoRASpec, roles: Mapping[str, frozenset[Role]]) -> dict[str, bool]:
    """The `train_*` flags a spec of `lora_spec` came from."""
    names = spec.target_modules
    assert isinstance(names, tuple), "a Tinker run's spec names its modules (lora_spec)"
    trained = set().union(*(roles.get(n, frozenset()) for n in names))
    return {
        "train_attn": "attention" in trained,
        "train_mlp": "mlp" in trained,
        "train_unembed": False,
    }


# -- training -------------------------------------------------------------------------


def objective(loss_fn: str, config: Mapping[str, float | str] | None) -> Objective:
    """The registry's objective for a Tinker loss name and `loss_fn_config`."""
    if loss_fn not in LOSSES:
        raise UserError(
            f"loss_fn {loss_fn!r} is not supported by this server; use one of "
            f"{', '.join(LOSSES)} (or forward_backward_custom with one of them)"
        )
    values = dict(config or {})
    texts = [k for k, v in values.items() if isinstance(v, str)]
    if texts:
        raise UserError(f"loss_fn_config of {loss_fn!r}: {', '.join(texts)} must be numbers")
    try:
        return make_objective(loss_fn, {k: float(v) for k, v in values.items()})
    except ConfigError as e:
        raise UserError(f"loss_fn_config: {e}") from e


def _vector(inputs: Mapping[str, np.ndarray], name: str, n: int, i: int) -> np.ndarray | None:
    value = inputs.get(name)
    if value is None:
        return None
    if value.ndim != 1 or value.shape[0] != n:
        raise UserError(
            f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(value.shape)}; it must "
            f"be [{n}], one value per model_input token"
        )
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise UserError(f"datum {i}: loss_fn_inputs[{name!r}] holds NaN or infinite values")
    return value


def _check_ids(ids: np.ndarray, what: str, limits: ModelLimits) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limits.vocab_size):
        raise UserError(f"{what}: token ids must be in [0, {limits.vocab_size}) for this model")


def datums(
    body: wire.ForwardBackwardBody, loss: Objective, limits: ModelLimits
) -> tuple[Datum, ...]:
    """The `Datum` rows of a forward/backward body scored with `loss` (see the module
    docstring for the weights)."""
    if not body.data:
        raise UserError("forward_backward needs at least one datum")
    allowed = _INPUTS[loss.name]
    rows = []
    for i, d in enumerate(body.data):
        n = int(d.tokens.shape[0])
        if n == 0:
            raise UserError(f"datum {i}: model_input has no tokens")
        if n > limits.max_positions:
            raise UserError(
                f"datum {i}: model_input has {n} tokens, beyond this model's context of "
                f"{limits.max_positions}; shorten it"
            )
        unknown = sorted(set(d.inputs) - allowed - {"target_tokens"})
        if unknown:
            raise UserError(
                f"datum {i}: loss {loss.name!r} takes no loss_fn_inputs {unknown}; it reads "
                f"target_tokens and {', '.join(sorted(allowed))}"
            )
        targets = _vector(d.inputs, "target_tokens", n, i)
        if targets is None:
            raise UserError(f"datum {i}: loss_fn_inputs needs target_tokens")
        _check_ids(d.tokens, f"datum {i}: model_input", limits)
        _check_ids(targets, f"datum {i}: target_tokens", limits)
        weights = _vector(d.inputs, "weights", n, i)
        sampling: tuple[float, ...] = ()
        advantages: tuple[float, ...] = ()
        if loss.name in _RL_LOSSES:
            q = _vector(d.inputs, "logprobs", n, i)
            a = _vector(d.inputs, "advantages", n, i)
            if q is None or a is None:
                raise UserError(
                    f"datum {i}: loss {loss.name!r} needs loss_fn_inputs logprobs (the "
                    "sampler's log-prob of each target) and advantages"
                )
            sampling, advantages = tuple(q.tolist()), tuple(a.tolist())
            if weights is None:
                live = a != 0 if loss.name != "dro" else (a != 0) | (q != 0)
                weights = live.astype(np.float32)
        elif weights is None:
            weights = np.ones(n, dtype=np.float32)
        rows.append(
            Datum(
                input_ids=tuple(int(t) for t in d.tokens.tolist()),
                target_ids=tuple(int(t) for t in targets.tolist()),
                weights_T=tuple(float(w) for w in weights.tolist()),
                sampling_logprobs_T=sampling,
                advantages_T=advantages,
            )
        )
    return tuple(rows)


def from_json(body: wire.ForwardBackwardJson) -> wire.ForwardBackwardBody:
    """A JSON forward/backward body as the records a protobuf one decodes to."""
    data = []
    for i, d in enumerate(body.forward_backward_input.data):
        tokens = np.asarray(prompt_tokens(d.model_input, f"datum {i}"), dtype=np.int64)
        inputs = {
            name: _json_tensor(t, f"datum {i}, {name}") for name, t in d.loss_fn_inputs.items()
        }
        data.append(wire.DatumIn(tokens=tokens, inputs=inputs))
    fbi = body.forward_backward_input
    return wire.ForwardBackwardBody(
        model_id=body.model_id,
        seq_id=body.seq_id or 0,
        loss_fn=fbi.loss_fn,
        loss_fn_config=dict(fbi.loss_fn_config or {}),
        forward_only=body.forward_only,
        data=data,
    )


def _json_tensor(t: wire.TensorJson, where: str) -> np.ndarray:
    if t.sparse_crow_indices is not None:
        raise UserError(f"{where}: send JSON tensors dense (sparse ones only as protobuf)")
    values = np.asarray(t.data, dtype=np.float32 if t.dtype == "float32" else np.int64)
    try:
        return values.reshape(t.shape) if t.shape is not None else values
    except ValueError as e:
        raise UserError(f"{where}: {len(t.data)} values do not fill shape {t.shape}") from e


def adam(params: wire.AdamParams | None, optimizer_params: Mapping[str, Any] | None) -> AdamParams:
    """marlaas's AdamW step parameters for Tinker's `AdamParams` (Tinker's AdamW is
    torch's; `grad_clip_norm <= 0` means no clipping)."""
    if params is None:
        kind = (optimizer_params or {}).get("type", "none")
        raise UserError(f"optimizer {kind!r} is not supported by this server; send adam_params")
    clip = params.grad_clip_norm if params.grad_clip_norm > 0 else None
    try:
        return AdamParams(
            lr=params.learning_rate,
            betas=(params.beta1, params.beta2),
            weight_decay=params.weight_decay,
            eps=params.eps,
            max_grad_norm=clip,
        )
    except ConfigError as e:
        raise UserError(f"adam_params: {e}") from e


# -- sampling -------------------------------------------------------------------------


def prompt_tokens(model_input: wire.ModelInputJson, where: str = "prompt") -> list[int]:
    """The token ids of a model input; only text chunks are accepted."""
    out: list[int] = []
    for chunk in model_input.chunks:
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise UserError(f"{where}: chunks of type {kind!r} are not supported; send text tokens")
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise UserError(f"{where}: an encoded_text chunk needs a list of integer tokens")
        out.extend(tokens)
    return out


@dataclass(frozen=True)
class Sampling:
    """One `asample`'s engine parameters, and the stop token ids the engine itself does
    not stop on (applied to each completion: it ends at the first of them)."""

    params: SamplingParams
    stop_tokens: frozenset[int]


def check_prompt(prompt: Sequence[int], limits: ModelLimits) -> None:
    if not prompt:
        raise UserError("the prompt has no tokens")
    _check_ids(np.asarray(prompt), "prompt", limits)
    if len(prompt) > limits.max_positions:
        raise UserError(
            f"the prompt has {len(prompt)} tokens, beyond this model's context of "
            f"{limits.max_positions}; shorten it"
        )


def sampling(params: wire.SamplingParams, prompt_len: int, limits: ModelLimits) -> Sampling:
    """The engine's sampling parameters for Tinker's (top_k -1: no limit; stop strings
    or stop token ids; max_tokens None: up to the end of the context)."""
    room = limits.max_positions - prompt_len + 1  # the last token needs no position
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens < 1:
        raise UserError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise UserError(
            f"a prompt of {prompt_len} tokens leaves room for {room} new tokens in this "
            f"model's context of {limits.max_positions}; ask for at most max_tokens={room}"
        )
    stop = params.stop
    if stop is not None and not isinstance(stop, str) and len(stop) == 0:
        raise UserError(
            "stop=[] (never stop, not even at EOS) is not supported: this server always "
            "stops at the tokenizer's end-of-text token; pass stop=None or stop sequences"
        )
    listed: Sequence[str | int] = () if stop is None or isinstance(stop, str) else stop
    strings = (stop,) if isinstance(stop, str) else tuple(s for s in listed if isinstance(s, str))
    ids = frozenset(s for s in listed if isinstance(s, int))
    _check_ids(np.asarray(sorted(ids)), "stop", limits)
    try:
        engine = SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0 if params.top_k in (-1, 0) else params.top_k,
            max_new_tokens=max_tokens,
            stop=strings,
            seed=params.seed,
        )
    except ValueError as e:
        raise UserError(f"sampling_params: {e} (top_k: -1 means no limit)") from e
    return Sampling(engine, ids)


def cut_at_stop(tokens: Sequence[int], stop_tokens: Iterable[int]) -> int | None:
    """The length of a completion ended by its first stop token (kept), or None."""
    stops = set(stop_tokens)
    for i, t in enumerate(tokens):
        if t in stops:
            return i + 1
    return None
