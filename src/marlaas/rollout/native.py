"""The engine's decoder layers in one native call (`kernels/decoder_layers.c`): what the
compact forward (`marlaas.rollout.decoder`) runs layer by layer, kernel by kernel, run
by the same kernels in the same order from C, so the Python wrappers, ctypes and the
tensors of each step are paid once a forward instead of ~70 times (~0.5 ms of a decode
step of the embedded base, whatever its rows).

It covers what `marlaas.model.native` covers (the CPU's half dtype: bfloat16 linear
weights over float32 activations, every product through `kernels.half_linear_rows`)
with every other step on its native kernel: SwiGLU MLPs, Qwen3's per-head norms (the native RMS
norm, as the Python path), q/k/v and gate/up stored together (`mixed.Together`), the adapters' rows
on `kernels.lora_rows` (`RowLanes`). Elsewhere `NativeLayers.of` is None, and a
forward it does not take (`run` returns None: the kernels switched off, more rows than
the half kernel takes on several threads, a lane batch of another layout) runs the
Python path.

Invariant: its keys, values and residual stream equal the Python path's exactly (the
same kernels on the same values: `tests/rollout/test_native_layers.py`).
"""

from __future__ import annotations

import array
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from marlaas.model.attention import AttentionPlan
from marlaas.model.decoder import DecoderStack, Layer
from marlaas.model.kernels import half_linear_takes, native_kernels
from marlaas.model.kernels.build import kernel as load
from marlaas.model.kernels.build import long_call
from marlaas.model.native import (
    LORA_FIELDS,
    NativeStack,
    address,
    covers,
    lane_scratch,
    lora_fields,
)
from marlaas.rollout.kv import SlotKV, SlotWrites

#: The C side's field counts (`decoder_layers.c`: F_FIELDS, a layer's fields up to
#: L_K_NORM; M_FIELDS is `LORA_FIELDS`); the order of each list below is its enums'.
_F_FIELDS, _L_STATIC = 31, 15


@dataclass(frozen=True)
class LayerInputs:
    """What the decoder layers of one engine forward read: the cache and the forward's
    `R` rows of `N` new tokens from cache row `row0`, their residual stream `h_TE` (the
    embeddings), rotary tables, cache cells (`writes`) and attention plan."""

    kv: SlotKV
    row0: int
    R: int
    N: int
    h_TE: Tensor
    cos_TD: Tensor
    sin_TD: Tensor
    writes: SlotWrites
    plan: AttentionPlan


class NativeLayers(NativeStack):
    """The native call's view of one `DecoderStack` (see the module doc)."""

    def __init__(self, stack: DecoderStack) -> None:
        super().__init__(stack, _layer_static)
        #: The lane batch's weights (`A`, `B` mappings) -> each layer's LoRA fields and
        #: the floats of scratch the kernel needs (0: every B rank-major, none).
        self._lora: tuple[Mapping[str, Tensor], Mapping[str, Tensor], list[list[int]], int]
        self._lora = ({}, {}, [], 0)

    @staticmethod
    def of(stack: DecoderStack) -> NativeLayers | None:
        """The native layers of `stack`, or None where they do not cover it."""
        if not native_kernels("decoder_layers") or not covers(stack):
            return None
        return NativeLayers(stack)

    def run(self, inputs: LayerInputs) -> Tensor | None:
        """Every layer over the forward's tokens: `inputs.h_TE` updated in place (all but
        the last layer's MLP output) and that last output returned, the keys and values
        written into the cache; None (nothing done) where the call does not apply."""
        kv, row0, R, N = inputs.kv, inputs.row0, inputs.R, inputs.N
        h_TE, cos_TD, sin_TD = inputs.h_TE, inputs.cos_TD, inputs.sin_TD
        writes, plan = inputs.writes, inputs.plan
        stack = self.stack
        T, E = (int(n) for n in h_TE.shape)
        H, Hkv, D = stack.heads, stack.kv_heads, stack.head_dim
        kernel = load("decoder_layers")
        if kernel is None or not half_linear_takes(T) or kv.dtype != stack.kv_dtype:
            return None  # (a cache of another dtype: the kernels would misread it)
        lanes = stack.model.row_lanes(T)
        if lanes is None or not _takes(h_TE, cos_TD, sin_TD, writes, T, D):
            return None
        batch, rows = lanes
        lora = self._lora_fields(batch.A, batch.B)
        static = self.weights.get()
        if lora is None or static is None:
            return None
        layer_lora, lora_floats = lora
        spans = {w: plan.span(w) for w in set(kv.geometry.windows)}
        columns = int(plan.columns)
        if any(s.widest < 1 or s.widest > columns for s in spans.values()):
            return None
        widest = max(s.widest for s in spans.values())
        units = int(rows.lane_N.shape[0])
        width, C = max(E, H * D, self.inter), self.qkv_out
        x = torch.empty((T, E))
        qkv = torch.empty((T, C))
        att = torch.empty((T, H * D))
        out = torch.empty((T, E))
        gu = torch.empty((T, 2 * self.inter))
        gated = torch.empty((T, self.inter))
        delta = torch.empty((T, E))
        xb = torch.empty(T * width, dtype=torch.bfloat16)
        scores = torch.empty((H // Hkv) * widest)
        lora_scratch = torch.empty(lora_floats) if lora_floats else None
        fields = [
            *(len(stack.layers), T, R, N, E, H, Hkv, D, self.inter),
            *(int(self.kv_bf16), units, T // units, row0),
            h_TE.data_ptr(),
            cos_TD.data_ptr(),
            sin_TD.data_ptr(),
            writes.row_T.data_ptr(),
            writes.col_T.data_ptr(),
            rows.lane_N.data_ptr(),
            rows.order_N.data_ptr(),
            address(rows.scale_L),
            *(x.data_ptr(), qkv.data_ptr(), att.data_ptr(), out.data_ptr(), gu.data_ptr()),
            *(gated.data_ptr(), delta.data_ptr(), xb.data_ptr(), scores.data_ptr()),
            address(lora_scratch),
        ]
        assert len(fields) == _F_FIELDS
        for i, window in enumerate(kv.geometry.windows):
            keys, values = kv.keys[i], kv.values[i]
            span = spans[window]
            fields += static[i * _L_STATIC : (i + 1) * _L_STATIC]
            fields += (keys.data_ptr(), values.data_ptr(), *keys.stride()[:3])
            fields += (span.start_Q.data_ptr(), span.end_Q.data_ptr())
            fields += layer_lora[i]
        program = array.array("q", fields)
        long_call(kernel, program.buffer_info()[0], self.floats.buffer_info()[0])
        return delta

    def _lora_fields(
        self, A: Mapping[str, Tensor], B: Mapping[str, Tensor]
    ) -> tuple[list[list[int]], int] | None:
        """Each layer's LoRA modules' fields for the lane batch's weights, and the floats
        of scratch the kernel needs for B in PEFT's layout (kept while the batch's
        mappings are the same objects: the adapter bank's, step after step); None where
        the kernel does not take one of them."""
        kept_A, kept_B, kept, floats = self._lora
        if kept_A is A and kept_B is B:
            return kept, floats
        modules = self.lane_modules(A, B)
        if modules is None:
            return None
        layers = [
            [
                v
                for pair in layer
                for v in ([0] * LORA_FIELDS if pair is None else lora_fields(*pair))
            ]
            for layer in modules
        ]
        floats = lane_scratch(modules)
        self._lora = (A, B, layers, floats)
        return layers, floats


def _layer_static(layer: Layer, packs: list[Tensor]) -> list[int]:
    """A layer's fields of its weights (`packs`: `native.half_weights` packed), in the C side's
    order (L_NORM1 .. L_K_NORM)."""
    assert layer.qkv is not None and layer.gate_up is not None
    qkv, o, gate_up, down = packs
    return [
        layer.input_norm.weight.data_ptr(),
        layer.post_norm.weight.data_ptr(),
        qkv.data_ptr(),
        address(layer.qkv.bias),
        *layer.qkv.sizes,
        o.data_ptr(),
        address(layer.o.bias),
        gate_up.data_ptr(),
        address(layer.gate_up.bias),
        down.data_ptr(),
        address(layer.down.bias),
        *(address(None if n is None else n.weight) for n in (layer.q_norm, layer.k_norm)),
    ]


def _takes(
    h_TE: Tensor, cos_TD: Tensor, sin_TD: Tensor, writes: SlotWrites, T: int, D: int
) -> bool:
    """Whether the forward's own tensors are of the layouts the kernels take."""
    return (
        all(
            t.is_cpu and t.dtype == torch.float32 and t.is_contiguous()
            for t in (h_TE, cos_TD, sin_TD)
        )
        and tuple(cos_TD.shape) == (T, D)
        and tuple(sin_TD.shape) == (T, D)
        and all(
            t.dtype == torch.int64 and t.is_contiguous() and int(t.shape[0]) == T
            for t in (writes.row_T, writes.col_T)
        )
    )
