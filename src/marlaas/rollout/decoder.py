"""The engine's compact forward of Llama-family decoders: the Hugging Face modules' math
over the slot cache, without their frames.

A decode step of the embedded base through the Hugging Face modules is ~2,000 small
calls (module wrappers, keyword plumbing, the cache interface, rotary's halves and
concatenations, masks); at one row they are the whole step (1.4 ms), at 256 rows a
fifth of it. This forward runs the same computation from the modules' own parameters
in a few dozen calls per layer:

    h = embed(ids)
    per layer: x = rms_norm(h)
               q, k, v = x W_q^T (+ b), ... each plus its rows' LoRA update
               [Qwen3: q, k = rms_norm per head]
               q, k = rotary(q, k); k and v stored into the cache rows
               h = h + (attention(q, cache) W_o^T + LoRA)
               x = rms_norm(h)
               h = h + (act(x W_gate^T + LoRA) * (x W_up^T + LoRA)) W_down^T + LoRA
    logits = rms_norm(h) W_head^T

The LoRA updates are the injected layers' own (`LoRAModel.add_lora`: the same lane plan
and native kernel), attention is `marlaas.model.attention.slot_attention` with the
forward's plan, the rotary tables come from the model's own rotary module (every RoPE
scaling it implements), and on the CPU in float32 the rotary embedding and the cache
writes are one native call per layer (`marlaas.model.kernels.rope_store`; torch's ops
elsewhere).

Covered (`CompactDecoder.of`): the model types in `MODEL_TYPES` (Llama, Mistral, Qwen2,
Qwen3: with biases, sliding windows, grouped heads, Qwen3's per-head norms) whose layers
are of exactly those Hugging Face classes; any other model, or one whose modules were
replaced, runs through the Hugging Face modules as before.

Invariants:
- Logits, keys and values equal the Hugging Face forward's over the same cache, up to
  float rounding (`tests/rollout/test_decoder.py`, every covered architecture, decode
  and prefill, float32 and bfloat16).
- It reads the base's parameters where they lie (nothing copied) and writes only the
  cache columns of its new tokens (padding: the scratch column).
- `kernels.torch_path()` turns it off as it turns off the kernels: the benchmarks' and
  tests' plain path is the Hugging Face modules with torch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from marlaas.model.attention import AttentionPlan, slot_attention
from marlaas.model.kernels import add_rms_norm, rope_store
from marlaas.model.lora import LoRAModel, MultiLoRALinear
from marlaas.rollout.kv import SlotKV

#: `config.model_type`s whose decoder layers this forward reproduces (`_classes`; each
#: checked against the Hugging Face forward by the tests).
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class _Linear:
    """One projection: the base weight and bias, and the module path its LoRA update
    is found under (None: not injected, the base alone)."""

    weight: Tensor
    bias: Tensor | None
    path: str | None

    @staticmethod
    def of(module: nn.Module) -> _Linear | None:
        if isinstance(module, MultiLoRALinear):
            path: str | None = module.path
            module = module.base_layer
        else:
            path = None
        if type(module) is not nn.Linear:
            return None
        return _Linear(module.weight, module.bias, path)


@dataclass(frozen=True)
class _Norm:
    """An RMSNorm of Llama's form: `weight * (x / rms(x))`, computed in float32."""

    weight: Tensor
    eps: float

    def __call__(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Hugging Face's order of roundings: normalised in float32, cast, then scaled.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def after(self, h_TE: Tensor, delta_TE: Tensor | None) -> tuple[Tensor, Tensor]:
        """The residual stream `h + delta` (`h` itself without a delta; `h` may be
        updated in place) and its norm, in one native pass where it applies."""
        x_TE = add_rms_norm(h_TE, delta_TE, self.weight, self.eps)
        if x_TE is not None:
            return h_TE, x_TE
        if delta_TE is not None:
            h_TE = h_TE + delta_TE
        return h_TE, self(h_TE)


@dataclass(frozen=True)
class _Layer:
    input_norm: _Norm
    q: _Linear
    k: _Linear
    v: _Linear
    o: _Linear
    q_norm: _Norm | None
    k_norm: _Norm | None
    scaling: float
    post_norm: _Norm
    gate: _Linear
    up: _Linear
    down: _Linear
    act: Callable[[Tensor], Tensor]


class CompactDecoder:
    """The compact forward of one `LoRAModel`'s base (see the module doc)."""

    def __init__(
        self,
        model: LoRAModel,
        layers: list[_Layer],
        embed: Tensor,
        norm: _Norm,
        head: _Linear,
        rotary: nn.Module,
        heads: int,
        kv_heads: int,
        head_dim: int,
    ) -> None:
        self.model = model
        self.layers = layers
        self.embed = embed
        self.norm = norm
        self.head = head
        self.rotary = rotary
        self.heads = heads
        self.kv_heads = kv_heads
        self.head_dim = head_dim

    @staticmethod
    def of(model: LoRAModel) -> CompactDecoder | None:
        """The compact forward of `model`'s base, or None where it does not reproduce
        the base's own (another architecture, or modules of other classes)."""
        base: Any = model.base
        config = base.config
        inner = getattr(base, "model", None)
        classes = _classes(str(getattr(config, "model_type", "")))
        if classes is None or inner is None:
            return None
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        rotary: Any = getattr(inner, "rotary_emb", None)
        inv_freq = getattr(rotary, "inv_freq", None)
        embed = getattr(inner, "embed_tokens", None)
        norm: Any = getattr(inner, "norm", None)
        head = _Linear.of(base.get_output_embeddings())
        if (
            not isinstance(inv_freq, Tensor)
            or 2 * int(inv_freq.numel()) != head_dim  # the rotary covers every feature
            or type(embed) is not nn.Embedding
            or type(norm) is not classes.norm
            or head is None
            or head.path is not None
        ):
            return None
        layers = [_layer(layer, classes) for layer in inner.layers]
        if not layers or any(layer is None for layer in layers):
            return None
        return CompactDecoder(
            model,
            [layer for layer in layers if layer is not None],
            embed.weight,
            _Norm(norm.weight, float(norm.variance_epsilon)),
            head,
            rotary,
            heads,
            kv_heads,
            head_dim,
        )

    def forward(
        self,
        kv: SlotKV,
        row0: int,
        ids_RN: Tensor,
        positions_RN: Tensor,
        plan: AttentionPlan,
        all_logits: bool,
    ) -> Tensor:
        """Logits `[R, N or 1, V]` of new tokens `ids_RN` at `positions_RN` (-1: padding)
        of cache rows `row0 ..`, under the plan's columns, writing their keys and values
        into the cache; run inside the model's `lanes()` context (each row's adapter)."""
        R, N = (int(n) for n in ids_RN.shape)
        T, H, Hkv, D = R * N, self.heads, self.kv_heads, self.head_dim
        h_TE = F.embedding(ids_RN.reshape(-1), self.embed)
        cos, sin = self.rotary(h_TE, positions_RN.clamp(min=0))
        cos_TD, sin_TD = cos.reshape(T, D), sin.reshape(T, D)
        writes = kv.writes(row0, positions_RN)
        add_lora = self.model.add_lora
        windows = kv.geometry.windows

        def linear(x: Tensor, lin: _Linear) -> Tensor:
            y = F.linear(x, lin.weight, lin.bias)
            return y if lin.path is None else add_lora(lin.path, x, y)

        delta_TE: Tensor | None = None  # the last block's output, not yet added to h
        for i, layer in enumerate(self.layers):
            h_TE, x_TE = layer.input_norm.after(h_TE, delta_TE)
            q_THD = linear(x_TE, layer.q).view(T, H, D)
            k_THD = linear(x_TE, layer.k).view(T, Hkv, D)
            v_THD = linear(x_TE, layer.v).view(T, Hkv, D)
            if layer.q_norm is not None and layer.k_norm is not None:
                q_THD, k_THD = layer.q_norm(q_THD), layer.k_norm(k_THD)
            keys, values = kv.keys[i], kv.values[i]
            if not rope_store(
                q_THD, k_THD, v_THD, cos_TD, sin_TD, keys, values, writes.row_T, writes.col_T
            ):
                q_THD = _rotated(q_THD, cos_TD, sin_TD)
                kv.store(i, writes, _rotated(k_THD, cos_TD, sin_TD), v_THD)
            keys, values = kv.views(i, row0, R, plan.columns)
            out = slot_attention(
                q_THD.view(R, N, H, D).transpose(1, 2),
                keys,
                values,
                plan,
                scaling=layer.scaling,
                window=windows[i],
            )
            h_TE, x_TE = layer.post_norm.after(h_TE, linear(out.reshape(T, H * D), layer.o))
            gated = layer.act(linear(x_TE, layer.gate)) * linear(x_TE, layer.up)
            delta_TE = linear(gated, layer.down)
        if not all_logits:  # the last token of each row
            h_TE = h_TE.view(R, N, -1)[:, -1].contiguous()
            delta_TE = None if delta_TE is None else delta_TE.view(R, N, -1)[:, -1].contiguous()
        _, x_TE = self.norm.after(h_TE, delta_TE)
        logits = F.linear(x_TE, self.head.weight, self.head.bias)
        return logits.view(R, -1, logits.shape[-1])


def _layer(layer: nn.Module, classes: _Classes) -> _Layer | None:
    """The parts of one decoder layer, or None unless it is of exactly the covered
    classes (their forwards are what this module reproduces)."""
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    norms: list[Any] = [
        getattr(layer, "input_layernorm", None),
        getattr(layer, "post_attention_layernorm", None),
    ]
    if classes.qk_norm:
        norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if (
        type(layer) is not classes.layer
        or type(attn) is not classes.attention
        or type(mlp) is not classes.mlp
        or any(type(norm) is not classes.norm for norm in norms)
    ):
        return None
    linears = [
        _Linear.of(module)
        for module in (
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
        )
    ]
    q, k, v, o, gate, up, down = linears
    if (
        q is None
        or k is None
        or v is None
        or o is None
        or gate is None
        or up is None
        or down is None
    ):
        return None
    input_norm, post_norm, *qk = (
        _Norm(norm.weight, float(norm.variance_epsilon)) for norm in norms
    )
    q_norm, k_norm = qk if qk else (None, None)
    return _Layer(
        input_norm,
        q,
        k,
        v,
        o,
        q_norm,
        k_norm,
        float(attn.scaling),
        post_norm,
        gate,
        up,
        down,
        mlp.act_fn,
    )


def _rotated(x_THD: Tensor, cos_TD: Tensor, sin_TD: Tensor) -> Tensor:
    """Hugging Face's rotary embedding, `x * cos + rotate_half(x) * sin`, per head."""
    half = x_THD.shape[-1] // 2
    cos, sin = cos_TD.unsqueeze(1), sin_TD.unsqueeze(1)
    rotated = torch.cat((-x_THD[..., half:], x_THD[..., :half]), dim=-1)
    return x_THD * cos + rotated * sin


@dataclass(frozen=True)
class _Classes:
    """The Hugging Face classes of one covered model type."""

    layer: type[Any]
    attention: type[Any]
    mlp: type[Any]
    norm: type[Any]
    #: The attention normalises queries and keys per head before the rotary (Qwen3).
    qk_norm: bool = False


def _classes(model_type: str) -> _Classes | None:
    """The classes whose forwards `CompactDecoder` reproduces, for `model_type`."""
    if model_type == "llama":
        from transformers.models.llama import modeling_llama as m

        return _Classes(m.LlamaDecoderLayer, m.LlamaAttention, m.LlamaMLP, m.LlamaRMSNorm)
    if model_type == "mistral":
        from transformers.models.mistral import modeling_mistral as mi

        return _Classes(
            mi.MistralDecoderLayer, mi.MistralAttention, mi.MistralMLP, mi.MistralRMSNorm
        )
    if model_type == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as q2

        return _Classes(q2.Qwen2DecoderLayer, q2.Qwen2Attention, q2.Qwen2MLP, q2.Qwen2RMSNorm)
    if model_type == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as q3

        return _Classes(
            q3.Qwen3DecoderLayer, q3.Qwen3Attention, q3.Qwen3MLP, q3.Qwen3RMSNorm, qk_norm=True
        )
    return None
