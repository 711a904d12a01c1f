"""What the native decoder layers take of a `DecoderStack`: the engine's forward
(`marlaas.rollout.native`) and the trainer's forward and backward
(`marlaas.train.native`) run every layer in one C call over the same kernels, for the
CPU's half dtype (`marlaas.model.mixed`: bfloat16 linear weights over float32
activations, on a CPU with native bfloat16) and SwiGLU MLPs whose q/k/v and gate/up
weights lie together (`mixed.Together`), packed for `kernels.half_linear_rows`."""

from __future__ import annotations

from collections.abc import Callable

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


class WeightFields:
    """Each layer's fields of its half weights for a native call: the addresses of their
    packed copies (`mixed.packed`; with `transposes`, each weight's transpose too, what
    a backward multiplies by) as `fields(layer, packs)` lays them out, kept while those
    copies are the current ones and made again where one is not (a weight written to
    since)."""

    def __init__(
        self,
        stack: DecoderStack,
        fields: Callable[[Layer, list[Tensor]], list[int]],
        transposes: bool = False,
    ) -> None:
        self.stack = stack
        self.fields = fields
        self.variants = (False, True) if transposes else (False,)
        #: The packed copies the fields point at (kept: C reads them by address).
        self._packed: list[Tensor] = []
        self._fields: list[int] = []

    def get(self) -> list[int] | None:
        """Every layer's fields, in order; None where a weight cannot be packed."""
        current = [
            packed(w, transposed)
            for layer in self.stack.layers
            for w in half_weights(layer)
            for transposed in self.variants
        ]
        if any(p is None for p in current):
            return None
        if len(current) != len(self._packed) or any(
            a is not b for a, b in zip(current, self._packed, strict=True)
        ):
            self._packed = [p for p in current if p is not None]
            per = len(self._packed) // len(self.stack.layers)
            self._fields = [
                v
                for i, layer in enumerate(self.stack.layers)
                for v in self.fields(layer, self._packed[per * i : per * (i + 1)])
            ]
        return self._fields
