"""Model FLOPs and bytes of engine and trainer work, counted from the model's shapes.

What one token costs is read off the model, never off padding:
- weights: `2 * in * out` FLOPs per token for every weight matrix of the decoder layers
  and the output head (a dense model; the embedding lookup is free);
- LoRA: `2 * r * (in + out)` per token for every module the adapter targets;
- attention: `4 * heads * head_dim * c` per token and attention layer at a context of
  `c` tokens (`q k^T` and `p v`), `c` capped at the layer's sliding window.

A training token costs `2 x` its weight FLOPs (the forward, and the gradient with
respect to the input: the base is frozen, so it has no weight gradient) plus `3 x` its
LoRA and attention FLOPs (forward, input gradient, weight gradient / the two attention
products' gradients). A GRPO group's prompt counts once (`train_flops`): its samples
share it, so the work of running it again per sample is work no step needs (counted per
sample, as up to stop 30, a trainer that shares prompts scored over 1.0 in float32).

Bytes moved are what a perfect implementation would have to read or write: every
weight once per forward (twice in training), the adapters in use, the KV cache of the
real context lengths read and the new entries written, and the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from marlaas.model.lane_layers import MultiLoRALinear
from marlaas.model.lora import LoRAModel


@dataclass(frozen=True)
class ModelCost:
    """Per-token costs of one model (see the module docstring)."""

    #: FLOPs of the weight matrices for one token (decoder layers and output head).
    weight_flops: float
    #: The part of `weight_flops` whose weights are of another dtype than the
    #: activations (half linear layers on the CPU, `marlaas.model.mixed`); else 0.
    half_weight_flops: float
    #: Bytes of those weights in the model's dtype (read once per forward).
    weight_bytes: float
    #: Attention FLOPs per token per context token, in one attention layer.
    attention_flops_per_context: float
    #: Sliding window of each attention layer (None: full attention).
    windows: tuple[int | None, ...]
    #: Key and value bytes per token, summed over the layers, in the engine's cache dtype
    #: (`LoRAModel.kv_dtype`).
    kv_bytes: float
    #: Vocabulary size (logits per row).
    vocab: int
    #: The output head's part of `weight_flops` (paid only where logits are taken).
    head_flops: float
    #: Module path -> (in_features, out_features) of every module LoRA can target.
    lora_shapes: dict[str, tuple[int, int]]

    @staticmethod
    def of(model: LoRAModel) -> ModelCost:
        config: Any = model.base.config.get_text_config(decoder=True)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        layers = int(config.num_hidden_layers)
        elem = model.kv_dtype.itemsize  # what the engine caches
        weight_flops = 0.0
        half_weight_flops = 0.0
        weight_bytes = 0.0
        for matrix in weight_matrices(model.base):
            weight_flops += 2.0 * matrix.numel()
            if matrix.dtype != model.dtype:
                half_weight_flops += 2.0 * matrix.numel()
            weight_bytes += matrix.numel() * matrix.element_size()
        return ModelCost(
            weight_flops=weight_flops,
            half_weight_flops=half_weight_flops,
            weight_bytes=weight_bytes,
            attention_flops_per_context=4.0 * heads * head_dim,
            windows=tuple(_windows(config, layers)),
            kv_bytes=float(layers * 2 * kv_heads * head_dim * elem),
            vocab=int(config.vocab_size),
            head_flops=2.0 * float(model.base.get_output_embeddings().weight.numel()),
            lora_shapes=model.module_shapes,
        )

    def lora_flops(self, rank: int, targets: Sequence[str]) -> float:
        """LoRA FLOPs per token of an adapter of `rank` on the leaf names `targets`."""
        wanted = set(targets)
        return sum(
            2.0 * rank * (fan_in + fan_out)
            for path, (fan_in, fan_out) in self.lora_shapes.items()
            if path.rsplit(".", 1)[-1] in wanted
        )

    def lora_bytes(self, rank: int, targets: Sequence[str], elem: int = 4) -> float:
        """Bytes of one adapter's weights."""
        return self.lora_flops(rank, targets) / 2.0 * elem

    def attention_flops(self, context: int) -> float:
        """Attention FLOPs of one token that attends to `context` tokens (itself included)."""
        seen = sum(min(context, w) if w else context for w in self.windows)
        return self.attention_flops_per_context * seen

    def causal_attention_flops(self, length: int) -> float:
        """Attention FLOPs of a causal pass over `length` tokens (token i sees i + 1)."""
        n = length
        seen = 0
        for w in self.windows:
            if w is None or n <= w:
                seen += n * (n + 1) // 2
            else:  # the first w tokens see 1..w, the rest w each
                seen += w * (w + 1) // 2 + (n - w) * w
        return self.attention_flops_per_context * seen

    def half_flops(self, tokens: float) -> float:
        """The FLOPs of half linear weights (`half_weight_flops`) in a forward of
        `tokens` tokens (a training step's forward and backward: twice its tokens)."""
        return tokens * self.half_weight_flops

    def prefill_flops(self, length: int, lora: float) -> float:
        """FLOPs of prefilling a prompt of `length` tokens (causal attention; the output
        head at its last position only, whose logits sample the first new token)."""
        layers = self.weight_flops - self.head_flops
        return length * (layers + lora) + self.head_flops + self.causal_attention_flops(length)

    def decode_flops(self, contexts: Sequence[int], lora: float) -> float:
        """FLOPs of one decode iteration over rows attending to `contexts` tokens."""
        return sum(self.weight_flops + lora + self.attention_flops(c) for c in contexts)

    def decode_bytes(self, contexts: Sequence[int], adapter_bytes: float) -> float:
        """Bytes of one decode iteration: weights, adapters, KV read and written, logits."""
        kv = sum(self.kv_bytes * c for c in contexts)
        return self.weight_bytes + adapter_bytes + kv + len(contexts) * self.vocab * 4.0

    def prefill_bytes(self, lengths: Sequence[int], adapter_bytes: float) -> float:
        """Bytes of one prefill forward: weights, adapters, the KV written, last logits."""
        kv = sum(self.kv_bytes * n for n in lengths)
        return self.weight_bytes + adapter_bytes + kv + len(lengths) * self.vocab * 4.0

    def generation(
        self, prompts: Sequence[int], new_tokens: int, iterations: int, lora: float, adapters: float
    ) -> tuple[float, float, float]:
        """`(FLOPs, half FLOPs, bytes)` of generating `new_tokens` after each prompt in
        `iterations` engine iterations: each prompt prefilled, then each new token but the
        last fed at its context (`half_flops` of those tokens); weights and `adapters`
        bytes read once per iteration."""
        flops = 0.0
        kv = 0.0
        for n in prompts:
            flops += self.prefill_flops(n, lora)
            contexts = range(n + 1, n + new_tokens)
            flops += sum(self.weight_flops + lora + self.attention_flops(c) for c in contexts)
            kv += self.kv_bytes * (n + sum(contexts))
        half = self.half_flops(sum(prompts) + len(prompts) * (new_tokens - 1))
        logits = len(prompts) * new_tokens * self.vocab * 4.0
        return flops, half, iterations * (self.weight_bytes + adapters) + kv + logits

    def train_flops(self, groups: Sequence[TrainGroup], lora: float) -> float:
        """FLOPs of a forward and backward over GRPO groups: each group's prompt once
        (its samples share it: `marlaas.train.prefix`, its keys and values serve them
        all), then each sample's fed tokens after it, attending the prompt and its own
        earlier tokens; the output head only where log-probs are taken (the prompt's
        last position, once, and every fed token). The work a step must do, not what a
        trainer that ran each sample's prompt again would."""
        body = self.train_tokens(groups)
        attention = sum(
            self.causal_attention_flops(g.prompt)
            + sum(
                self.causal_attention_flops(g.prompt + f) - self.causal_attention_flops(g.prompt)
                for f in g.fed
            )
            for g in groups
        )
        layers = self.weight_flops - self.head_flops
        return (
            body * (2.0 * layers + 3.0 * lora)
            + self.logit_positions(groups) * 2.0 * self.head_flops
            + 3.0 * attention
        )

    @staticmethod
    def logit_positions(groups: Sequence[TrainGroup]) -> int:
        """Positions whose logits a training step takes (see `train_flops`)."""
        return sum(1 + sum(g.fed) for g in groups)

    @staticmethod
    def train_tokens(groups: Sequence[TrainGroup]) -> int:
        """Tokens a training step runs through the decoder layers (see `train_flops`)."""
        return sum(g.prompt + sum(g.fed) for g in groups)

    def train_bytes(
        self, groups: Sequence[TrainGroup], adapter_bytes: float, tenants: int
    ) -> float:
        """Bytes of a training step: weights read twice; per tenant its adapter, gradient
        and two AdamW moments read and written; the float32 logits written and read back
        (forward, log-softmax, gradient)."""
        logits = self.logit_positions(groups) * self.vocab * 4.0 * 3
        return 2.0 * self.weight_bytes + tenants * adapter_bytes * 8 + logits


@dataclass(frozen=True)
class TrainGroup:
    """One GRPO group of a training step: its prompt's tokens, and the tokens each
    sample feeds after it (its completion but the last token, which nothing reads)."""

    prompt: int
    fed: tuple[int, ...]


def weight_matrices(base: PreTrainedModel) -> list[nn.Parameter]:
    """Every 2-D weight the forward multiplies by: linear layers (and GPT-2's `Conv1D`)
    and the output head, each parameter once (tied embeddings count as the head)."""
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    embedding = base.get_input_embeddings()
    head = base.get_output_embeddings()
    for module in base.modules():
        if isinstance(module, MultiLoRALinear) or module is embedding:
            continue
        weight = getattr(module, "weight", None)
        is_matmul = isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
        if (
            (module is head or is_matmul)
            and isinstance(weight, nn.Parameter)
            and weight.dim() == 2
            and id(weight) not in seen
        ):
            seen.add(id(weight))
            out.append(weight)
    return out


def _windows(config: Any, layers: int) -> list[int | None]:
    """The sliding window of each layer, None for full attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [int(window) if t == "sliding_attention" and window else None for t in layer_types]
    if window and getattr(config, "use_sliding_window", True):
        return [int(window)] * layers
    return [None] * layers
