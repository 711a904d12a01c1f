"""The decoder stack of a Llama-family base, read from its Hugging Face modules once: what
the compact forwards of the engine (`marlaas.rollout.decoder`) and of the trainer
(`marlaas.train.decoder`) compute with, instead of calling the modules.

Each decoder layer is

    x = rms_norm(h)
    q, k, v = x W_q^T (+ b), x W_k^T (+ b), x W_v^T (+ b)     each plus its LoRA update
    [Qwen3: q, k = rms_norm over each head]
    q, k = rotary(q, k)
    h = h + attention(q, k, v) W_o^T (+ b)                      plus LoRA
    x = rms_norm(h)
    h = h + (act(x W_gate^T) * (x W_up^T)) W_down^T             each plus LoRA

and the model `logits = rms_norm(h) W_head^T` after `h = embed(ids)`: the forwards of
Llama, Mistral, Qwen2 and Qwen3 (`MODEL_TYPES`), with biases, sliding windows, grouped
heads and Qwen3's per-head norms. `DecoderStack.of` reads a base whose modules are of
exactly those Hugging Face classes (their forwards are what the compact forwards
reproduce) and returns None for any other, which keeps running its modules.

Invariants:
- Parameters are the modules' own tensors (nothing copied); the LoRA updates are the
  injected layers' own (`LoRAModel.lora_linear`: the same lane plan and kernels, the
  base layer and its update one autograd node in a trainer's packed forward); half
  precision linear layers over float32 activations (`marlaas.model.mixed`) multiply as
  their modules do.
- The rotary tables come from the model's rotary module (every RoPE scaling it
  implements); the rotary covers every feature of a head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from marlaas.model.fused import rms_norm
from marlaas.model.lane_layers import MultiLoRALinear
from marlaas.model.lora import LoRAModel
from marlaas.model.mixed import HalfLinear, Together, linear

#: `config.model_type`s whose decoder layers the compact forwards reproduce (`_classes`;
#: each checked against the Hugging Face forward by the tests).
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


#: Rotary scalings whose tables depend on the positions a call sees (Hugging Face's
#: `dynamic_rope_update`): `DecoderStack.rope` leaves them to the module.
DYNAMIC_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class Linear:
    """One projection: the base weight and bias, and the module path its LoRA update is
    found under (None: not injected, the base alone)."""

    weight: Tensor
    bias: Tensor | None
    path: str | None

    @staticmethod
    def of(module: nn.Module) -> Linear | None:
        if isinstance(module, MultiLoRALinear):
            path: str | None = module.path
            module = module.base_layer
        else:
            path = None
        if not isinstance(module, nn.Linear) or type(module) not in (nn.Linear, HalfLinear):
            return None
        return Linear(module.weight, module.bias, path)


@dataclass(frozen=True)
class Norm:
    """An RMSNorm of Llama's form: `weight * (x / rms(x))`, normalised in float32."""

    weight: Tensor
    eps: float

    def __call__(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            if torch.is_grad_enabled() and x.requires_grad:  # the trainer: fused both ways
                fused = rms_norm(x, self.weight, self.eps)
                if fused is not None:
                    return fused
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Hugging Face's order of roundings: normalised in float32, cast, then scaled.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@dataclass(frozen=True)
class Layer:
    """One decoder layer's parameters (see the module doc)."""

    input_norm: Norm
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    #: Qwen3's per-head norms of the queries and keys (None: none).
    q_norm: Norm | None
    k_norm: Norm | None
    scaling: float
    #: The attention's sliding window (None: full attention).
    window: int | None
    post_norm: Norm
    gate: Linear
    up: Linear
    down: Linear
    act: nn.Module
    #: q, k and v, and gate and up, where their half weights lie together in memory
    #: (`mixed.Together`; None: apart, or not half).
    qkv: Together | None = None
    gate_up: Together | None = None


class DecoderStack:
    """A Llama-family base's parameters, layer by layer (see the module doc)."""

    def __init__(
        self,
        model: LoRAModel,
        layers: list[Layer],
        embed: Tensor,
        norm: Norm,
        head: Linear,
        rotary: nn.Module,
        shape: tuple[int, int, int],
        silu: bool,
    ) -> None:
        self.model = model
        self.layers = layers
        self.embed = embed
        self.norm = norm
        self.head = head
        self.rotary = rotary
        self.heads, self.kv_heads, self.head_dim = shape
        #: The MLP's activation is SiLU (SwiGLU: the fused kernels apply).
        self.silu = silu
        #: The dtype keys and values are held in (`LoRAModel.kv_dtype`, read once).
        self.kv_dtype = model.kv_dtype
        #: The rotary module's (cos, sin) at positions 0 .. n - 1 (`rope`).
        self._rope_table: tuple[Tensor, Tensor] | None = None

    @staticmethod
    def of(model: LoRAModel) -> DecoderStack | None:
        """The stack of `model`'s base, or None where the compact forwards would not
        reproduce its own (another architecture, or modules of other classes)."""
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
        head = Linear.of(base.get_output_embeddings())
        if (
            not isinstance(inv_freq, Tensor)
            or 2 * int(inv_freq.numel()) != head_dim  # the rotary covers every feature
            or type(embed) is not nn.Embedding
            or type(norm) is not classes.norm
            or head is None
            or head.path is not None
        ):
            return None
        layers = [_layer(layer, classes, config) for layer in inner.layers]
        if not layers or any(layer is None for layer in layers):
            return None
        return DecoderStack(
            model,
            [layer for layer in layers if layer is not None],
            embed.weight,
            Norm(norm.weight, float(norm.variance_epsilon)),
            head,
            rotary,
            (heads, kv_heads, head_dim),
            silu=str(getattr(config, "hidden_act", "")) in ("silu", "swish"),
        )

    def rope(self, like: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The rotary module's `(cos, sin)` at `positions` (`[..., D]`, in `like`'s dtype
        and device): rows of a table the module computed once for positions from 0 (grown
        as later positions need it), one lookup a forward instead of the module's
        half-dozen ops (~0.1 ms of a decode step at 256 rows). Where the module's scaling
        depends on the positions a call sees (`DYNAMIC_ROPE`), or a position is negative,
        the module itself computes them."""
        rope_type = getattr(self.rotary, "rope_type", "default")
        if positions.numel() == 0 or not isinstance(rope_type, str) or rope_type in DYNAMIC_ROPE:
            return self.rotary(like, positions)  # type: ignore[no-any-return]
        low, high = (int(v) for v in torch.aminmax(positions))
        if low < 0:
            return self.rotary(like, positions)  # type: ignore[no-any-return]
        table = self._rope_table
        if (
            table is None
            or int(table[0].shape[0]) <= high
            or table[0].dtype != like.dtype
            or table[0].device != like.device
        ):
            size = max(high + 1, 2 * (0 if table is None else int(table[0].shape[0])), 256)
            cos, sin = self.rotary(like, torch.arange(size, device=like.device)[None])
            table = self._rope_table = (cos[0], sin[0])
        flat, width = positions.reshape(-1), int(table[0].shape[-1])
        return (
            table[0].index_select(0, flat).view(*positions.shape, width),
            table[1].index_select(0, flat).view(*positions.shape, width),
        )

    def linear(self, x: Tensor, lin: Linear) -> Tensor:
        """`x W^T (+ b)` plus the LoRA update of the rows' adapters (the lane batch of the
        current `lanes()` context)."""
        if lin.path is None:
            return linear(x, lin.weight, lin.bias)
        return self.model.lora_linear(lin.path, x, lin.weight, lin.bias)

    def linears(self, x: Tensor, lins: Sequence[Linear], together: Together | None) -> list[Tensor]:
        """`linear(x, lin)` for each of `lins` (layers of the same input `x`): without
        gradient (the engine's forwards) and where their half weights lie together, one
        product for all of them (`mixed.Together`: a call's fixed cost fewer, and `x`
        rounded once), each output plus its LoRA update."""
        if together is None or torch.is_grad_enabled():
            return [self.linear(x, lin) for lin in lins]
        outs = together.linear(x)
        return [
            out if lin.path is None else self.model.add_lora(lin.path, x, out)
            for lin, out in zip(lins, outs, strict=True)
        ]

    def logits(self, h: Tensor) -> Tensor:
        """The output head over the final norm of the residual stream `h`."""
        return linear(self.norm(h), self.head.weight, self.head.bias)


class StackForward:
    """A compact forward over a `DecoderStack`: the engine's
    (`marlaas.rollout.decoder.CompactDecoder`) and the trainer's
    (`marlaas.train.decoder.TrainDecoder`)."""

    def __init__(self, stack: DecoderStack) -> None:
        self.stack = stack

    @classmethod
    def of(cls, model: LoRAModel) -> Self | None:
        """The compact forward of `model`'s base, or None where it does not reproduce
        the base's own (`DecoderStack.of`)."""
        stack = DecoderStack.of(model)
        return None if stack is None else cls(stack)


@dataclass(frozen=True)
class _Classes:
    """The Hugging Face classes of one covered model type."""

    layer: type[Any]
    attention: type[Any]
    mlp: type[Any]
    norm: type[Any]
    #: Where the attention's sliding window comes from: "module" (its `sliding_window`,
    #: per layer), "config" (the config's, every layer) or "none".
    window: str
    #: The attention normalises queries and keys per head before the rotary (Qwen3).
    qk_norm: bool = False


def _layer(layer: nn.Module, classes: _Classes, config: Any) -> Layer | None:
    """The parts of one decoder layer, or None unless it is of exactly the covered
    classes (their forwards are what the compact forwards reproduce)."""
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
    q, k, v, o, gate, up, down = (
        Linear.of(module)
        for module in (
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
        )
    )
    if None in (q, k, v, o, gate, up, down):
        return None
    assert q and k and v and o and gate and up and down
    input_norm, post_norm, *qk = (Norm(norm.weight, float(norm.variance_epsilon)) for norm in norms)
    q_norm, k_norm = qk if qk else (None, None)
    source = {"module": attn, "config": config}.get(classes.window)
    window = getattr(source, "sliding_window", None) if source is not None else None
    return Layer(
        input_norm=input_norm,
        q=q,
        k=k,
        v=v,
        o=o,
        q_norm=q_norm,
        k_norm=k_norm,
        scaling=float(attn.scaling),
        window=int(window) if window else None,
        post_norm=post_norm,
        gate=gate,
        up=up,
        down=down,
        act=mlp.act_fn,
        qkv=Together.of([q.weight, k.weight, v.weight], [q.bias, k.bias, v.bias]),
        gate_up=Together.of([gate.weight, up.weight], [gate.bias, up.bias]),
    )


def _classes(model_type: str) -> _Classes | None:
    """The classes whose forwards the compact forwards reproduce, for `model_type`."""
    if model_type == "llama":
        from transformers.models.llama import modeling_llama as m

        return _Classes(m.LlamaDecoderLayer, m.LlamaAttention, m.LlamaMLP, m.LlamaRMSNorm, "none")
    if model_type == "mistral":
        from transformers.models.mistral import modeling_mistral as mi

        return _Classes(
            mi.MistralDecoderLayer, mi.MistralAttention, mi.MistralMLP, mi.MistralRMSNorm, "config"
        )
    if model_type == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as q2

        return _Classes(
            q2.Qwen2DecoderLayer, q2.Qwen2Attention, q2.Qwen2MLP, q2.Qwen2RMSNorm, "module"
        )
    if model_type == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as q3

        return _Classes(
            q3.Qwen3DecoderLayer,
            q3.Qwen3Attention,
            q3.Qwen3MLP,
            q3.Qwen3RMSNorm,
            "module",
            qk_norm=True,
        )
    return None
