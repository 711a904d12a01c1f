"""What the native decoder layers take of a `DecoderStack`: the engine's forward
(`marlaas.rollout.native`) and the trainer's forward and backward
(`marlaas.train.native`) run every layer in one C call over the same kernels, for the
CPU's half dtype (`marlaas.model.mixed`: bfloat16 linear weights over float32
activations, on a CPU with native bfloat16) and SwiGLU MLPs whose q/k/v and gate/up
weights lie together (`mixed.Together`), packed for `kernels.half_linear_rows`."""

from __future__ import annotations

import torch
from torch import Tensor

from marlaas.model.decoder import DecoderStack, Layer
from marlaas.model.mixed import native_bfloat16, packed


def covers(stack: DecoderStack) -> bool:
    """Whether the native layers take `stack` (see the module doc): Qwen3's per-head
    norms included (float32 weights of the head size, both or neither)."""
    model = stack.model
    E = int(stack.embed.shape[1])
    if (
        model.device.type != "cpu"
        or model.dtype != torch.float32
        or not native_bfloat16(model.device)
        or not stack.silu
        or stack.kv_dtype not in (torch.float32, torch.bfloat16)
        or E % 2
        or (stack.heads * stack.head_dim) % 2
    ):
        return False
    for layer in stack.layers:
        if layer.qkv is None or layer.gate_up is None:
            return False
        norms = [n for n in (layer.q_norm, layer.k_norm) if n is not None]
        if (
            any(
                n.weight.dtype != torch.float32 or n.weight.shape != (stack.head_dim,)
                for n in norms
            )
            or len(norms) == 1
        ):
            return False
        if (
            layer.gate_up.sizes[0] != layer.gate_up.sizes[1]
            or int(layer.down.weight.shape[1]) != layer.gate_up.sizes[0]
        ):
            return False
        weights = half_weights(layer)
        biases = (layer.qkv.bias, layer.o.bias, layer.gate_up.bias, layer.down.bias)
        if any(w.dtype != torch.bfloat16 for w in weights) or any(
            b is not None and (b.dtype != torch.bfloat16 or not b.is_contiguous()) for b in biases
        ):
            return False
        if int(layer.down.weight.shape[1]) % 2 or any(packed(w) is None for w in weights):
            return False
    return True


def half_weights(layer: Layer) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A layer's half weights as the native calls multiply them: q/k/v's span, o's,
    gate/up's span, down's."""
    assert layer.qkv is not None and layer.gate_up is not None
    return layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight
