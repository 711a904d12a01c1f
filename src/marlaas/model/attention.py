"""The engine's attention, reached through transformers' `AttentionInterface`.

`install_attention(model)` routes the model's attention through `marlaas:<original>`:
a forward that passes an `AttentionPlan` (the keyword `PLAN_KWARG`) gets
`slot_attention`; every other forward (the trainer's, a plain evaluation) gets the
model's original implementation with exactly the arguments it would have had, so
installing changes nothing for them, but for one kernel choice: under `sdpa` on the
CPU, a masked query of several tokens over grouped key/value heads (a trainer
micro-batch, an evaluation) attends with SDPA's own grouping (`enable_gqa`) instead of
transformers' `repeat_kv` copies, the same product. The Hugging Face modules keep
computing their projections, norms and rotary embeddings; only the attention product is
ours.

`slot_attention` attends rows of the engine's slot cache (`marlaas.model.cache`) where
token `j` of a row sits in column `j`: each query sees the columns at or before its
position, within the layer's sliding window (`kv_idx > q_idx - window`, as Hugging
Face's masks), never another row's padding. Grouped-query heads attend their key/value
head without repeating it; `softcap` and `scaling` are the module's own. On the CPU
every query, decode or prefill, goes to the native kernel (`marlaas.model.kernels`:
each query over its own span of columns, `AttentionPlan.span`); elsewhere or without
it, a decode step is two batched matmuls over the cache columns and a prefill is
`scaled_dot_product_attention` with the plan's mask.

Invariants:
- Only forwards that pass a plan are changed; the plan's masks (and spans) are made
  once per forward and window, when first asked for, and shared by all layers.
- Padding queries (left padding of a prefill) attend column 0 of their own row: a
  finite, unused result, so no NaN can reach any value a real token reads.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from marlaas.errors import ModelError
from marlaas.model.kernels import Spans, span_attention

#: The forward keyword that carries an `AttentionPlan` down to every attention layer.
PLAN_KWARG = "marlaas_attention"
_PREFIX = "marlaas:"


@dataclass
class AttentionPlan:
    """The masks (and spans) of one forward over `R` cache rows, `N` new tokens each, `S`
    columns.

    `positions_RN` is each new token's position (= its column), -1 for padding.
    """

    positions_RN: Tensor
    columns: int
    #: The windows of the model's layers: the masks and spans this plan can make.
    windows: frozenset[int | None] = frozenset({None})
    #: window (None = full attention) -> mask `[R, 1, N, S]`, True where a query attends.
    masks: dict[int | None, Tensor] = field(default_factory=dict)
    #: (window, dtype) -> the mask as an additive bias `[R, 1, N, S]` (0 or -inf).
    biases: dict[tuple[int | None, torch.dtype], Tensor] = field(default_factory=dict)
    #: window -> each query's attended columns `[start_Q, end_Q)` (CPU int64, the
    #: `R * N` queries in row-major order) and the most columns a query attends.
    spans: dict[int | None, Spans] = field(default_factory=dict)

    @staticmethod
    def build(positions_RN: Tensor, columns: int, windows: Iterable[int | None]) -> AttentionPlan:
        """The plan of a forward; its masks and spans are made on first use, once per
        window (a native kernel needs only the spans, torch's path only the masks)."""
        return AttentionPlan(positions_RN, columns, windows=frozenset(windows))

    @property
    def decode(self) -> bool:
        return int(self.positions_RN.shape[1]) == 1

    def bias(self, window: int | None, dtype: torch.dtype) -> Tensor:
        """The mask of `window` as an additive bias, 0 where a query attends, else -inf
        (made once per forward and shared by the layers of one window)."""
        key = (window, dtype)
        if key not in self.biases:
            mask = self.mask(window)
            zero = torch.zeros((), dtype=dtype, device=mask.device)
            self.biases[key] = torch.where(mask, zero, float("-inf"))
        return self.biases[key]

    def span(self, window: int | None) -> Spans:
        """Each query's columns for `window`, `[start_Q, end_Q)` over the `R * N`
        queries in row-major order, the same columns as its mask (a padding query:
        column 0), and the widest span; made once per forward, on the host, for the
        native kernel."""
        if window not in self.spans:
            self._known(window)
            pos_Q = self.positions_RN.reshape(-1).to("cpu", torch.int64)
            end_Q = (pos_Q + 1).clamp_(min=1)  # a new, contiguous tensor
            start_Q = (
                (end_Q - window).clamp_(min=0) if window is not None else torch.zeros_like(end_Q)
            )
            self.spans[window] = Spans(start_Q, end_Q, int((end_Q - start_Q).max()))
        return self.spans[window]

    def mask(self, window: int | None) -> Tensor:
        """The mask of `window` `[R, 1, N, S]`, True where a query attends: each query
        the columns at or before its position, within the window; a padding query
        column 0 (finite and unused)."""
        if window not in self.masks:
            self._known(window)
            pos_RN1 = self.positions_RN.unsqueeze(-1)
            col_S = torch.arange(self.columns, device=pos_RN1.device)
            causal = col_S <= pos_RN1
            mask = causal if window is None else causal & (col_S > pos_RN1 - window)
            self.masks[window] = (mask | ((pos_RN1 < 0) & (col_S == 0))).unsqueeze(1)
        return self.masks[window]

    def _known(self, window: int | None) -> None:
        if window not in self.windows:
            raise ModelError(
                f"attention layer with sliding window {window} has no mask in this plan "
                f"(windows {sorted(map(str, self.windows))}); build the plan with the model's "
                "layer windows (marlaas.rollout.kv.kv_geometry)"
            )


def slot_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    plan: AttentionPlan,
    *,
    scaling: float | None,
    softcap: float | None = None,
    window: int | None = None,
) -> Tensor:
    """Attention of `query [R, H, N, D]` over `key`/`value [R, Hkv, S, D]` (the query's
    dtype, or a half cache's) under the plan's mask for `window`; returns `[R, N, H, D]`
    in the query's dtype (the layout HF modules expect)."""
    R, H, N, D = query.shape
    Hkv = int(key.shape[1])
    G = H // Hkv
    scale = scaling if scaling is not None else D**-0.5
    if query.device.type == "cpu":
        native = span_attention(query, key, value, plan.span(window), scale, softcap)
        if native is not None:
            return native
    if key.dtype != query.dtype:  # a half cache (`LoRAModel.kv_dtype`) off the kernel
        key, value = key.to(query.dtype), value.to(query.dtype)
    mask_R1NS = plan.mask(window)
    if N > 1 and softcap is None:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask_R1NS, scale=scale, enable_gqa=G > 1
        )
        return out.transpose(1, 2)
    S = int(key.shape[2])
    # Query heads h = kv_head * G + g (as `repeat_kv`): group them on their key/value
    # head, so each head's keys are read once and never repeated.
    if N == 1 and softcap is None:  # decode: scale the (small) query, add the mask in place
        k3, v3 = key.reshape(R * Hkv, S, D), value.reshape(R * Hkv, S, D)  # views
        scores = torch.bmm(query.reshape(R * Hkv, G, D) * scale, k3.transpose(1, 2))
        scores.view(R, Hkv, G, S).add_(plan.bias(window, scores.dtype))  # [R, 1, 1, S]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        return torch.bmm(probs, v3).view(R, 1, H, D)
    q = query.reshape(R, Hkv, G * N, D)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if N > 1:
        mask_R1NS = mask_R1NS.unsqueeze(2).expand(R, 1, G, N, -1).reshape(R, 1, G * N, -1)
    scores = scores.masked_fill(~mask_R1NS, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # [R, Hkv, G * N, D]
    return out.view(R, Hkv, G, N, D).permute(0, 3, 1, 2, 4).reshape(R, N, H, D)


AttentionFn = Callable[..., tuple[Tensor, Tensor | None]]


def _routed(original: str) -> AttentionFn:
    """The registered function for a model whose implementation was `original`."""

    def forward(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        plan = kwargs.pop(PLAN_KWARG, None)
        if plan is None:
            if original == "sdpa" and _grouped_sdpa_applies(module, query, attention_mask, kwargs):
                out = F.scaled_dot_product_attention(
                    query,
                    key,
                    value,
                    attn_mask=attention_mask,
                    scale=kwargs.get("scaling"),
                    enable_gqa=True,
                )
                return out.transpose(1, 2).contiguous(), None
            fallback = _original(original, module)
            return fallback(module, query, key, value, attention_mask, **kwargs)
        out = slot_attention(
            query,
            key,
            value,
            plan,
            scaling=kwargs.get("scaling"),
            softcap=kwargs.get("softcap"),
            window=kwargs.get("sliding_window"),
        )
        return out, None

    return forward


def _grouped_sdpa_applies(
    module: nn.Module, query: Tensor, attention_mask: Tensor | None, kwargs: dict[str, Any]
) -> bool:
    """Whether transformers' `sdpa` forward of these arguments is exactly one masked
    `scaled_dot_product_attention` over grouped key/value heads, so that SDPA can group
    the heads itself (`enable_gqa`) instead of `repeat_kv` copying every layer's keys
    and values (what it does whenever a mask is given): queries of several tokens under
    a mask, no dropout, no position bias, paged cache or softcap, on the CPU (CUDA's
    fused kernels take grouped heads only without a mask, transformers' reason for the
    copies)."""
    return (
        query.device.type == "cpu"
        and attention_mask is not None
        and int(query.shape[2]) > 1
        and int(getattr(module, "num_key_value_groups", 1)) > 1
        and not kwargs.get("dropout")
        and all(kwargs.get(name) is None for name in ("position_bias", "cache", "softcap"))
    )


def _original(name: str, module: nn.Module) -> AttentionFn:
    if name == "eager":  # each modeling file has its own eager function (softcap, sinks)
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ModelError(f"{type(module).__name__} has no eager_attention_forward")
        return fn  # type: ignore[no-any-return]
    return ALL_ATTENTION_FUNCTIONS[name]  # type: ignore[no-any-return]


def install_attention(model: PreTrainedModel) -> None:
    """Route `model`'s attention through `marlaas:<its implementation>` (idempotent).

    Raises `ModelError` for a model whose attention does not go through transformers'
    `AttentionInterface` (the engine cannot reach it).
    """
    current = str(model.config._attn_implementation or "eager")
    if current.startswith(_PREFIX):
        return
    if not model._can_set_attn_implementation():
        raise ModelError(
            f"{type(model).__name__} computes its attention without transformers' "
            "AttentionInterface, so the rollout engine cannot attend over its cache; use a "
            "model whose modeling code calls ALL_ATTENTION_FUNCTIONS (all current decoders)"
        )
    name = _PREFIX + current
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _routed(current))
        # The same masks as the original (none where it had none: HF then skips them).
        mask_fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(current)
        if mask_fn is not None:
            AttentionMaskInterface.register(name, mask_fn)  # type: ignore[arg-type]
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ModelError(f"could not set the attention implementation of {type(model).__name__}")
