"""The engine's compact forward of Llama-family decoders (`marlaas.model.decoder`): the
Hugging Face modules' math over the slot cache, without their frames.

A decode step of the embedded base through the Hugging Face modules is ~2,000 small
calls (module wrappers, keyword plumbing, the cache interface, rotary's halves and
concatenations, masks); at one row they are the whole step (1.4 ms), at 256 rows a
fifth of it. This forward runs the same computation from the modules' own parameters
in a few dozen calls per layer (the layer of `marlaas.model.decoder`'s doc).

Where the native kernels cover the whole layer (bfloat16 linear weights over float32
activations on the CPU, `marlaas.rollout.native`), every layer runs in one native call:
the same kernels in the same order, without their Python wrappers (a decode step of the
embedded base at 256 rows x 32 adapters 4.2-4.3 -> 3.1-3.2 ms, at one row 0.70 -> 0.19).

The LoRA updates are the injected layers' own (`LoRAModel.add_lora`: the same lane plan
and native kernel), attention is `marlaas.model.attention.slot_attention` with the
forward's plan, the rotary tables come from the model's own rotary module (every RoPE
scaling it implements), and on the CPU in float32 the rotary embedding and the cache
writes are one native call per layer (`marlaas.model.kernels.rope_store`; elsewhere
`marlaas.model.fused.rotary` and an indexed copy).

Covered: the bases `DecoderStack.of` reads (Llama, Mistral, Qwen2, Qwen3 of their own
Hugging Face classes); any other runs through the Hugging Face modules.

Invariants:
- Logits, keys and values equal the Hugging Face forward's over the same cache, up to
  float rounding (`tests/rollout/test_engine_decoder.py`, every covered architecture, decode
  and prefill, float32 and bfloat16).
- The native call's logits, keys and values equal the Python path's bit for bit
  (`tests/rollout/test_native_layers.py`).
- It reads the base's parameters where they lie (nothing copied) and writes only the
  cache columns of its new tokens (padding: the scratch column).
- `kernels.torch_path()` turns it off as it turns off the kernels: the benchmarks' and
  tests' plain path is the Hugging Face modules with torch's ops.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from marlaas.model.attention import AttentionPlan, slot_attention
from marlaas.model.decoder import DecoderStack, Norm, StackForward
from marlaas.model.fused import rotary
from marlaas.model.kernels import add_rms_norm, rope_store, swiglu
from marlaas.model.mixed import linear
from marlaas.rollout.kv import SlotKV
from marlaas.rollout.native import LayerInputs, NativeLayers


class CompactDecoder(StackForward):
    """The engine's compact forward of one `LoRAModel`'s base (see the module doc)."""

    def __init__(self, stack: DecoderStack) -> None:
        super().__init__(stack)
        self.native = NativeLayers.of(stack)

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
        stack = self.stack
        R, N = (int(n) for n in ids_RN.shape)
        T, D = R * N, stack.head_dim
        h_TE = F.embedding(ids_RN.reshape(-1), stack.embed)
        cos, sin = stack.rope(h_TE, positions_RN.clamp(min=0))
        cos_TD, sin_TD = cos.reshape(T, D), sin.reshape(T, D)
        writes = kv.writes(row0, positions_RN)
        # The last block's output, not yet added to h: all the layers in one native call
        # where it applies (`marlaas.rollout.native`), else kernel by kernel.
        inputs = LayerInputs(kv, row0, R, N, h_TE, cos_TD, sin_TD, writes, plan)
        delta_TE = None if self.native is None else self.native.run(inputs)
        if delta_TE is None:
            h_TE, delta_TE = self._layers(inputs)
        if not all_logits:  # the last token of each row
            h_TE = h_TE.view(R, N, -1)[:, -1].contiguous()
            delta_TE = delta_TE.view(R, N, -1)[:, -1].contiguous()
        _, x_TE = _after(stack.norm, h_TE, delta_TE)
        logits = linear(x_TE, stack.head.weight, stack.head.bias)
        return logits.view(R, -1, logits.shape[-1])

    def _layers(self, inputs: LayerInputs) -> tuple[Tensor, Tensor]:
        """The decoder layers, kernel by kernel: the residual stream `inputs.h_TE`
        (updated in place where the native norm applies) before the last layer's MLP
        output, and that output; keys and values written into the cache."""
        stack = self.stack
        kv, row0, R, N, h_TE = inputs.kv, inputs.row0, inputs.R, inputs.N, inputs.h_TE
        cos_TD, sin_TD, writes, plan = inputs.cos_TD, inputs.sin_TD, inputs.writes, inputs.plan
        T, H, Hkv, D = R * N, stack.heads, stack.kv_heads, stack.head_dim
        linear = stack.linear
        windows = kv.geometry.windows
        delta_TE: Tensor | None = None
        for i, layer in enumerate(stack.layers):
            h_TE, x_TE = _after(layer.input_norm, h_TE, delta_TE)
            q_TO, k_TO, v_TO = stack.linears(x_TE, (layer.q, layer.k, layer.v), layer.qkv)
            q_THD, k_THD, v_THD = q_TO.view(T, H, D), k_TO.view(T, Hkv, D), v_TO.view(T, Hkv, D)
            if layer.q_norm is not None and layer.k_norm is not None:
                q_THD, k_THD = _head_norm(layer.q_norm, q_THD), _head_norm(layer.k_norm, k_THD)
            keys, values = kv.keys[i], kv.values[i]
            if not rope_store(
                q_THD, k_THD, v_THD, cos_TD, sin_TD, keys, values, writes.row_T, writes.col_T
            ):
                q_THD = rotary(q_THD, cos_TD, sin_TD)
                kv.store(i, writes, rotary(k_THD, cos_TD, sin_TD), v_THD)
            keys, values = kv.views(i, row0, R, plan.columns)
            out = slot_attention(
                q_THD.view(R, N, H, D).transpose(1, 2),
                keys,
                values,
                plan,
                scaling=layer.scaling,
                window=windows[i],
            )
            h_TE, x_TE = _after(layer.post_norm, h_TE, linear(out.reshape(T, H * D), layer.o))
            gate_TI, up_TI = stack.linears(x_TE, (layer.gate, layer.up), layer.gate_up)
            gated = swiglu(gate_TI, up_TI) if stack.silu else None
            if gated is None:
                gated = layer.act(gate_TI) * up_TI
            delta_TE = linear(gated, layer.down)
        assert delta_TE is not None
        return h_TE, delta_TE


def _head_norm(norm: Norm, x_THD: Tensor) -> Tensor:
    """Qwen3's norm of each head of the queries or keys, through the native norm where it
    applies (as the native layers compute it), else the module's math."""
    T, H, D = x_THD.shape
    out = add_rms_norm(x_THD.reshape(T * H, D), None, norm.weight, norm.eps)
    return norm(x_THD) if out is None else out.view(T, H, D)


def _after(norm: Norm, h_TE: Tensor, delta_TE: Tensor | None) -> tuple[Tensor, Tensor]:
    """The residual stream `h + delta` (`h` itself without a delta; `h` may be updated in
    place: no gradient flows in the engine) and its norm, in one native pass where it
    applies."""
    x_TE = add_rms_norm(h_TE, delta_TE, norm.weight, norm.eps)
    if x_TE is not None:
        return h_TE, x_TE
    if delta_TE is not None:
        h_TE = h_TE + delta_TE
    return h_TE, norm(h_TE)
