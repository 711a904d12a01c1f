"""The trainer's decoder layers in one native call each way (`kernels/train_layers.c`):
one pass of the compact forward (`marlaas.train.decoder`) runs every layer's forward in
one C call that keeps what the backward reads, and its backward is one more, instead of
a few dozen Python wrappers, autograd nodes and new tensors per layer each way
(`bench trainer`'s 32 tenants: ~20 ms of a ~77 ms round were that glue).

One autograd node per pass: its inputs are the embeddings, the past's keys and values
(a shared prompt's, `marlaas.train.prefix`: one row per prompt, which the C side copies
into each of its samples' rows, and whose gradient it sums back from them) and every
LoRA module's lane weights; its
outputs the last layer's residual stream and each layer's keys and values (the cache a
later pass attends: their gradients come back into the backward's). The same kernels
as the Python path, in the same order, except that q, k and v (and gate and up) are one
product each way, as their half weights lie together: the same values up to float
rounding (`tests/train/test_native_train_layers.py`).

It covers what `marlaas.model.native` covers (Qwen3's per-head norms included), for passes
whose every row's keys are one run of columns (`Spans`) and whose lanes the per-row
kernels take; elsewhere (`TrainLayers.of` None, or `run` None) the Python path runs.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from marlaas.model.decoder import DecoderStack, Layer
from marlaas.model.kernels import Spans, half_linear_takes, native_kernels
from marlaas.model.kernels.build import kernel as load
from marlaas.model.kernels.build import long_call
from marlaas.model.lane_layers import LaneGrads
from marlaas.model.lane_plan import RowLanes
from marlaas.model.native import (
    LORA_FIELDS,
    MODULES,
    LaneModules,
    NativeStack,
    address,
    covers,
    lane_scratch,
    lora_fields,
)

#: The C side's field counts and offsets (`train_layers.c`); the order of each list
#: below is its enums'. A module: its `LORA_FIELDS`, its gradients' (M_GA, M_GBT), the
#: tape of its h = s A x (M_H) and its gradients' lanes' fresh flags (M_FRESH).
_P_FIELDS, _M_FIELDS = 32, LORA_FIELDS + 4
_L_STATIC, _L_PASS, _L_TAPE = 19, 10, 10
_L_FIELDS = _L_STATIC + _L_PASS + _L_TAPE + len(MODULES) * _M_FIELDS
#: What the backward writes into the forward's fields: the hidden state's (now the
#: gradient's, P_HIDDEN) and its scratch (P_WIDE, P_GRAD2, P_DQ), whether to zero dK
#: and dV (P_ZERO_DKV) and whether the input needs its gradient (P_INPUT_GRAD: a pass
#: over a prompt's frozen embeddings does not); a layer's dK and dV
#: (L_DK, L_DV, after its static and four pass fields) and its past's (L_DPAST_K,
#: L_DPAST_V); a module's gA, gBt and fresh flags.
_P_HIDDEN, _P_SCRATCH, _P_ZERO_DKV, _P_INPUT_GRAD = 13, 25, 30, 31
_L_DK, _L_DPAST = _L_STATIC + 6, _L_STATIC + 8
_M_GA, _M_FRESH = LORA_FIELDS, LORA_FIELDS + 3
#: Per layer: keys and values `[B, Hkv, columns, D]` (a pass's past: `[Hkv, G, P, D]`).
LayerCache = list[tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class PassInputs:
    """One pass of the compact forward: `T` tokens (the embeddings `h_TE`, rotary tables
    `[T, D]`), each at `pad_T` of the `B x TQ` rows' layout (`b * TQ + column`), after
    `P` past columns (`past`: each layer's keys and values `[Hkv, G, P, D]`, row `b`'s
    at `past_rows[b]`, every row its own where None; or no past); each layer's query
    spans by its window."""

    h_TE: Tensor
    cos_TD: Tensor
    sin_TD: Tensor
    pad_T: Tensor
    B: int
    TQ: int
    past: LayerCache | None
    spans: dict[int | None, Spans]
    #: The pass runs under a lane batch (`LoRAModel.lanes`); else the plain base.
    lanes: bool
    past_rows: Tensor | None = None

    @property
    def P(self) -> int:
        """The past's columns."""
        return 0 if self.past is None else int(self.past[0][0].shape[2])


class TrainLayers(NativeStack):
    """The native pass over one `DecoderStack` (see the module doc)."""

    def __init__(self, stack: DecoderStack) -> None:
        super().__init__(stack, _layer_static, transposes=True)
        #: Qwen3's per-head norms of the queries and keys.
        self.head_norms = stack.layers[0].q_norm is not None
        #: Each layer's modules' paths (`LaneBatch.grads`' keys), as `lane_modules`.
        self.paths = [[getattr(layer, name).path for name in MODULES] for layer in stack.layers]

    @staticmethod
    def of(stack: DecoderStack) -> TrainLayers | None:
        """The native pass of `stack`, or None where it does not cover it."""
        if not native_kernels("train_layers", "train_layers_backward") or not covers(stack):
            return None
        return TrainLayers(stack)

    def run(self, inputs: PassInputs) -> tuple[Tensor, LayerCache] | None:
        """The last layer's residual stream `[T, E]` and each layer's keys and values
        (past columns first), differentiable; None (nothing done) where the pass does
        not apply."""
        T = int(inputs.h_TE.shape[0])
        stack = self.stack
        if (
            load("train_layers") is None
            or load("train_layers_backward") is None
            or not half_linear_takes(T)
            or any(s.widest < 1 for s in inputs.spans.values())
        ):
            return None
        static = self.weights.get()
        if static is None:
            return None
        modules: LaneModules | None
        sink = None
        if inputs.lanes:
            lanes = stack.model.row_lanes(T)
            if lanes is None:
                return None
            batch, rows = lanes
            modules = self.lane_modules(batch.A, batch.B)
            if modules is None:
                return None
            sink = batch.grads
        else:  # the plain base: no module has an update (the lanes are never read)
            none = torch.zeros(1, dtype=torch.long)
            rows, modules = (
                RowLanes(none, none, None),
                [[None] * len(MODULES) for _ in stack.layers],
            )
        weights = [w for layer in modules for pair in layer if pair is not None for w in pair]
        # (a prefix pass's keys and values, seen as `[Hkv, G, P, D]`, are its tape's:
        # contiguous already)
        past = [t.contiguous() for kv in inputs.past for t in kv] if inputs.past else []
        if any(t.dtype != torch.float32 for t in past):
            return None
        groups = int(past[0].shape[1]) if past else 0
        rows_B = None  # each row's row of the past (the C side reads it with a past only)
        if past:
            given = inputs.past_rows
            rows_B = torch.arange(inputs.B) if given is None else given.long().contiguous()
        P = inputs.P
        row_T = torch.div(inputs.pad_T, inputs.TQ, rounding_mode="floor")
        col_T = inputs.pad_T - row_T * inputs.TQ + P
        first_T = row_T * (P + inputs.TQ)
        spans = {
            window: (
                (span.start_Q.index_select(0, inputs.pad_T) + first_T).contiguous(),
                (span.end_Q.index_select(0, inputs.pad_T) + first_T).contiguous(),
            )
            for window, span in inputs.spans.items()
        }
        widest = max(span.widest for span in inputs.spans.values())
        call = _Call(
            self, inputs, rows, modules, static, row_T, col_T, spans, widest, rows_B, groups, sink
        )
        outs = _Pass.apply(inputs.h_TE, call, *past, *weights)
        h, *kv = outs
        return h, list(zip(kv[0::2], kv[1::2], strict=True))


@dataclass(frozen=True)
class _Call:
    """What one pass's node needs besides its tensor inputs."""

    layers: TrainLayers
    inputs: PassInputs
    rows: RowLanes
    modules: LaneModules
    static: list[int]
    #: Each token's row and key column (after the past's).
    row_T: Tensor
    col_T: Tensor
    #: Per window, each token's span of columns counted across the rows (row `b`'s
    #: column `c` is `b * columns + c`: the tape's keys are `[Hkv, B, columns, D]`), and
    #: the widest span.
    spans: dict[int | None, tuple[Tensor, Tensor]]
    widest: int
    #: Each row's row of the past (`PassInputs.past_rows`; None: no past), and the
    #: past's rows.
    past_rows: Tensor | None
    past_groups: int
    #: The lanes' gradient buffers (`LaneBatch.grads`), or None: autograd's.
    sink: dict[str, LaneGrads] | None


class _Tape:
    """One pass's buffers: what the forward keeps for the backward (a buffer per layer),
    and the keys and values."""

    def __init__(
        self, layers: TrainLayers, T: int, B: int, TQ: int, P: int, modules: LaneModules
    ) -> None:
        stack = layers.stack
        E, H, Hkv, D = int(stack.embed.shape[1]), stack.heads, stack.kv_heads, stack.head_dim
        HD, C, inter = H * D, layers.qkv_out, layers.inter
        self.sizes = [
            T * E,  # h_in
            T * E,  # x1
            T * C,  # qkv
            T * (H + Hkv) * D if layers.head_norms else 0,  # q and k before their norms
            T * H,  # the attention's log-sum-exp
            T * HD,  # its output
            T * E,  # h_mid
            T * E,  # x2
            T * 2 * inter,  # gate, up
            T * inter,  # gated
        ]
        # A buffer per layer: each small enough for the heap (`cli.process`'s malloc
        # settings), where one for the pass came from fresh pages every step (a page
        # fault each 4 KB: ~20% of `bench trainer`'s round). After its tape, each
        # module's h = s A x `[T, r]` (its backward reads it: A x not computed again).
        self.buffers: list[Tensor] = []
        self.fields: list[list[int]] = []
        #: Each layer's modules' h (0: a module without an update).
        self.h: list[list[int]] = []
        for layer in modules:
            ranks = [0 if pair is None else int(pair[0].shape[1]) for pair in layer]
            buffer = torch.empty(sum(self.sizes) + T * sum(ranks))
            at = buffer.data_ptr()
            fields = []
            for size in self.sizes:
                fields.append(at)
                at += 4 * size
            h = []
            for r in ranks:
                h.append(at if r else 0)
                at += 4 * T * r
            self.buffers.append(buffer)
            self.fields.append(fields)
            self.h.append(h)
        # [Hkv, B, P + TQ, D]: the rows' columns of a kv head one run (`train_layers.c`).
        self.kv = [torch.empty((Hkv, B, P + TQ, D)) for _ in range(2 * len(modules))]


class _Pass(torch.autograd.Function):
    """One pass's layers forward and backward (see the module doc). Inputs: the
    embeddings `[T, E]`, the call, the past's keys and values (each layer's, or none),
    the modules' `A` and `B`; outputs: the residual stream `[T, E]`, then each layer's
    keys and values."""

    @staticmethod
    def forward(ctx: Any, h_TE: Tensor, call: _Call, *tensors: Tensor) -> tuple[Tensor, ...]:
        layers, inputs, rows = call.layers, call.inputs, call.rows
        stack = layers.stack
        count = len(stack.layers)
        past = tensors[: 2 * count] if inputs.past is not None else ()
        T, E = (int(n) for n in h_TE.shape)
        B, TQ, P = inputs.B, inputs.TQ, inputs.P
        H, Hkv, D = stack.heads, stack.kv_heads, stack.head_dim
        tape = _Tape(layers, T, B, TQ, P, call.modules)
        h = h_TE.detach().clone(memory_format=torch.contiguous_format)
        units = int(rows.lane_N.shape[0])
        inter, C, HD = layers.inter, layers.qkv_out, H * D
        xb = torch.empty(T * max(E, HD, 2 * inter, C), dtype=torch.bfloat16)
        scores = torch.empty((H // Hkv) * call.widest)
        out = torch.empty(T * max(E, inter))
        lora_scratch = torch.empty(max(lane_scratch(call.modules), 1))
        program = [
            *(count, T, B, TQ, P, E, H, Hkv, D, inter, int(layers.kv_bf16), units, T // units),
            h.data_ptr(),
            inputs.cos_TD.data_ptr(),
            inputs.sin_TD.data_ptr(),
            call.row_T.data_ptr(),
            call.col_T.data_ptr(),
            rows.lane_N.data_ptr(),
            rows.order_N.data_ptr(),
            address(rows.scale_L),
            xb.data_ptr(),
            scores.data_ptr(),
            lora_scratch.data_ptr(),
            out.data_ptr(),
            *(0, 0, 0),  # the backward's scratch
            call.past_groups,
            address(call.past_rows),
            *(0, 0),  # the backward's
        ]
        assert len(program) == _P_FIELDS
        for i, layer in enumerate(stack.layers):
            start_T, end_T = call.spans[layer.window]
            keys, values = tape.kv[2 * i], tape.kv[2 * i + 1]
            program += call.static[i * _L_STATIC : (i + 1) * _L_STATIC]
            program += (start_T.data_ptr(), end_T.data_ptr())
            program += (past[2 * i].data_ptr(), past[2 * i + 1].data_ptr()) if past else (0, 0)
            program += (keys.data_ptr(), values.data_ptr(), 0, 0, 0, 0)  # dK, dV, the past's:
            # the backward's
            program += tape.fields[i]
            for j, pair in enumerate(call.modules[i]):  # gA, gBt: the backward's
                program += (
                    [0] * _M_FIELDS
                    if pair is None
                    else [*lora_fields(*pair), 0, 0, tape.h[i][j], 0]
                )
        assert len(program) == _P_FIELDS + count * _L_FIELDS
        fields = array.array("q", program)
        long_call(load("train_layers"), fields.buffer_info()[0], layers.floats.buffer_info()[0])
        ctx.set_materialize_grads(False)
        ctx.call, ctx.fields, ctx.tape, ctx.kv = call, fields, tape.buffers, tape.kv
        ctx.past = past
        ctx.keep = (xb, scores, out, lora_scratch, *tensors)  # C reads them by address
        # Each layer's keys and values as the Python path's ([B, Hkv, columns, D]).
        return (h, *(t.transpose(0, 1) for t in tape.kv))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        call: _Call = ctx.call
        layers, inputs = call.layers, call.inputs
        stack = layers.stack
        count = len(stack.layers)
        kv: list[Tensor] = ctx.kv
        g_h, g_kv = grads[0], grads[1:]
        fields = array.array("q", ctx.fields)
        T, E = (int(n) for n in inputs.h_TE.shape)
        H, D = stack.heads, stack.head_dim
        inter, C, HD = layers.inter, layers.qkv_out, H * D
        g = (
            torch.zeros((T, E))
            if g_h is None
            else g_h.detach().clone(memory_format=torch.contiguous_format)
        )
        wide = torch.empty(T * max(E, HD, C, 2 * inter))
        g2 = torch.empty((T, E))
        dq = torch.empty((T, HD))
        fields[_P_HIDDEN] = g.data_ptr()
        scratch = [wide.data_ptr(), g2.data_ptr(), dq.data_ptr()]
        fields[_P_SCRATCH : _P_SCRATCH + 3] = array.array("q", scratch)
        # dK and dV in the tape's layout, `[Hkv, B, columns, D]`: where no later pass
        # attended this one's keys and values, left for the C side to zero a layer's just
        # before its attention (in cache then; ~8 MB of torch zeros a 32-tenant step).
        fresh = all(given is None for given in g_kv)
        fields[_P_ZERO_DKV] = int(fresh)
        fields[_P_INPUT_GRAD] = int(ctx.needs_input_grad[0])
        dkv = [
            torch.empty_like(t)
            if fresh
            else torch.zeros_like(t)
            if given is None
            else given.transpose(0, 1).contiguous()
            for t, given in zip(kv, g_kv, strict=True)
        ]
        # The past's gradients `[Hkv, G, P, D]`: its rows' columns summed by the C side.
        g_past = [torch.zeros_like(t) for t in ctx.past]
        own: list[LaneGrads | None] = []  # per module: this pass's own buffers, or None
        for i in range(count):
            at = _P_FIELDS + i * _L_FIELDS
            fields[at + _L_DK] = dkv[2 * i].data_ptr()
            fields[at + _L_DK + 1] = dkv[2 * i + 1].data_ptr()
            if g_past:
                fields[at + _L_DPAST] = g_past[2 * i].data_ptr()
                fields[at + _L_DPAST + 1] = g_past[2 * i + 1].data_ptr()
            for j, pair in enumerate(call.modules[i]):
                if pair is None:
                    continue
                path = layers.paths[i][j]
                # The C side writes a lane's gradients at its first block, then adds:
                # into this pass's own buffers, for autograd, or the micro-batch's (made
                # at its first pass).
                if call.sink is None or path is None:
                    buffers = LaneGrads.of(*pair)
                    own.append(buffers)
                else:
                    if path not in call.sink:
                        call.sink[path] = LaneGrads.of(*pair)
                    buffers = call.sink[path]
                    own.append(None)
                m = at + _L_STATIC + _L_PASS + _L_TAPE + j * _M_FIELDS
                fields[m + _M_GA] = buffers.gA.data_ptr()
                fields[m + _M_GA + 1] = buffers.gBt.data_ptr()
                fields[m + _M_FRESH] = buffers.fresh_L.data_ptr()
        long_call(
            load("train_layers_backward"), fields.buffer_info()[0], layers.floats.buffer_info()[0]
        )
        grads_w: list[Tensor | None] = []
        for mine in own:  # (B's rank-major gradient seen in PEFT's layout)
            gA, gBt = (None, None) if mine is None else mine.settled()
            grads_w += (gA, None if gBt is None else gBt.transpose(1, 2))
        return (g if ctx.needs_input_grad[0] else None, None, *g_past, *grads_w)


def _layer_static(layer: Layer, packs: list[Tensor]) -> list[int]:
    """A layer's fields of its weights (`packs`: each of `half_weights` packed, then its
    transpose packed), in the C side's order (L_NORM1 .. L_K_NORM)."""
    assert layer.qkv is not None and layer.gate_up is not None
    qkv, qkv_t, o, o_t, gate_up, gate_up_t, down, down_t = packs
    return [
        layer.input_norm.weight.data_ptr(),
        layer.post_norm.weight.data_ptr(),
        qkv.data_ptr(),
        qkv_t.data_ptr(),
        address(layer.qkv.bias),
        *layer.qkv.sizes,
        o.data_ptr(),
        o_t.data_ptr(),
        address(layer.o.bias),
        gate_up.data_ptr(),
        gate_up_t.data_ptr(),
        address(layer.gate_up.bias),
        down.data_ptr(),
        down_t.data_ptr(),
        address(layer.down.bias),
        *(address(None if n is None else n.weight) for n in (layer.q_norm, layer.k_norm)),
    ]
