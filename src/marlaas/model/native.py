"""What the native decoder layers take of a `DecoderStack`: the engine's forward
(`marlaas.rollout.native`) and the trainer's forward and backward
(`marlaas.train.native`) run every layer in one C call over the same kernels, for the
CPU's half dtype (`marlaas.model.mixed`: bfloat16 linear weights over float32
activations, on a CPU with native bfloat16) and SwiGLU MLPs whose q/k/v and gate/up
weights lie together (`mixed.Together`), packed for `kernels.half_linear_rows`.

What both calls read of a stack is here once (`NativeStack`: sizes, each layer's
floats, its weights' fields kept while their packed copies are current, the lane
batch's weights of each module and their fields)."""

from __future__ import annotations

import array
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from marlaas.model.decoder import DecoderStack, Layer, Linear
from marlaas.model.kernels import lane_weights_take
from marlaas.model.mixed import native_bfloat16, packed

#: A layer's LoRA modules, in the native calls' order (their C enums Q .. DOWN).
MODULES = ("q", "k", "v", "o", "gate", "up", "down")
#: A module's LoRA fields (`lora_fields`: A, its two strides, B, its three, the rank).
LORA_FIELDS = 8
#: A lane batch's weights of each layer's modules, in `MODULES` order (None: no update).
LaneModules = list[list[tuple[Tensor, Tensor] | None]]


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


class NativeStack:
    """What both native calls read of one `DecoderStack` that `covers` takes: its sizes,
    each layer's floats in the C sides' order (FL_*: the two norms' eps, the attention's
    scaling, Qwen3's head norms' eps) and its weights' fields (`WeightFields`, laid out
    by `fields`; with `transposes`, the backward's too)."""

    def __init__(
        self,
        stack: DecoderStack,
        fields: Callable[[Layer, list[Tensor]], list[int]],
        transposes: bool = False,
    ) -> None:
        self.stack = stack
        first = stack.layers[0]
        assert first.qkv is not None  # `covers` checked every layer
        self.qkv_out = sum(first.qkv.sizes)
        self.inter = int(first.down.weight.shape[1])
        self.kv_bf16 = stack.kv_dtype == torch.bfloat16
        self.floats = array.array("f", [v for layer in stack.layers for v in _floats(layer)])
        self.weights = WeightFields(stack, fields, transposes)

    def lane_modules(self, A: Mapping[str, Tensor], B: Mapping[str, Tensor]) -> LaneModules | None:
        """Each layer's modules' lane weights in the lane batch's `A` and `B`; None where
        the per-row kernels do not take one of them."""
        found: LaneModules = []
        for layer in self.stack.layers:
            modules: list[tuple[Tensor, Tensor] | None] = []
            for name in MODULES:
                lin: Linear = getattr(layer, name)
                A_Lri = A.get(lin.path) if lin.path is not None else None
                if A_Lri is None:
                    modules.append(None)
                    continue
                B_Lor = B[lin.path]  # type: ignore[index]
                out_features, in_features = (int(n) for n in lin.weight.shape)
                if not lane_weights_take(A_Lri, B_Lor, in_features, out_features):
                    return None
                modules.append((A_Lri, B_Lor))
            found.append(modules)
        return found


def lora_fields(A_Lri: Tensor, B_Lor: Tensor) -> list[int]:
    """A module's LoRA fields in the C sides' order (M_A .. M_RANK)."""
    return [
        A_Lri.data_ptr(),
        *A_Lri.stride()[:2],
        B_Lor.data_ptr(),
        *B_Lor.stride(),
        int(A_Lri.shape[1]),
    ]


def lane_scratch(modules: LaneModules) -> int:
    """The floats of scratch the per-row kernels need for `modules`: B in PEFT's layout
    (`r` contiguous) is transposed into it a lane at a time; 0 where every B is
    rank-major (the adapter bank's)."""
    pairs = [pair for layer in modules for pair in layer if pair is not None]
    return max((A.shape[1] * B.shape[1] for A, B in pairs if B.stride(1) != 1), default=0)


def address(t: Tensor | None) -> int:
    """A tensor's address for a native call's fields (0: none)."""
    return 0 if t is None else t.data_ptr()


def _floats(layer: Layer) -> list[float]:
    q_eps, k_eps = (0.0 if n is None else n.eps for n in (layer.q_norm, layer.k_norm))
    return [layer.input_norm.eps, layer.post_norm.eps, layer.scaling, q_eps, k_eps]
