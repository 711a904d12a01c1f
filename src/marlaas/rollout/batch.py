"""The decode batch: row-aligned state of every running sequence, and its two forwards.

`RowBatch` keeps, for the `B` running rows, a Python `Row` (request, adapter handle,
result callback) and one tensor per per-row quantity (pending token, slot, sampling
knobs, token counts, output buffers), all aligned on the batch axis with the KV cache.
Rows join by `concat` and leave by `select`; nothing is done per row in between.

Invariants:
- Every tensor field has first dimension `B == len(rows) == kv.size`.
- `next_B[b]` is row b's newest sampled token; it is not in the KV cache yet, so
  `kv.lengths_B[b] == prompt_len + n_gen_B[b] - 1` and its position is `kv.lengths_B[b]`.
- `tokens_BN[b, :n_gen_B[b]]` / `logprobs_BN[b, :n_gen_B[b]]` are row b's output so far.
- `n_sampling`, `n_filter` and `n_stop` count the rows that sample (temperature > 0),
  use top-k/top-p, and have stop strings (`stop_rows`); `listen_rows` are the rows with
  a token listener: batch-level shortcuts for the hot path, recomputed only when rows
  join or leave.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from marlaas.model.bank import AdapterBank, AdapterHandle
from marlaas.model.lora import LoRAModel
from marlaas.rollout.kv import KVBatch, RowKV
from marlaas.types import Completion, RolloutRequest

Deliver = Callable[[Completion | BaseException], None]
#: Called with each newly sampled token id of one request, in order, from the thread that
#: steps the engine, before the request's `Deliver` (see `RolloutEngine.enqueue`).
TokenListener = Callable[[int], None]


@dataclass(eq=False)
class Row:
    """The Python side of one running sequence."""

    request: RolloutRequest
    handle: AdapterHandle
    deliver: Deliver
    #: Tokens of the decoded window checked for stop strings (0 = no stop strings).
    stop_window: int = 0
    #: The last `stop_window` generated tokens (kept only for rows with stop strings).
    tail: list[int] = field(default_factory=list)
    #: The final text when a stop string ended the row.
    stop_text: str | None = None
    #: Prompt tokens whose KV came from the session cache.
    reused: int = 0
    #: Gets each sampled token as it is recorded (None: nobody streams this row).
    listener: TokenListener | None = None


_ROW_TENSORS = (
    "next_B",
    "slot_B",
    "temperature_B",
    "top_k_B",
    "top_p_B",
    "seed_B",
    "n_gen_B",
    "max_new_B",
    "tokens_BN",
    "logprobs_BN",
)


@dataclass
class RowBatch:
    rows: list[Row]
    kv: KVBatch
    next_B: Tensor
    slot_B: Tensor
    temperature_B: Tensor
    top_k_B: Tensor
    top_p_B: Tensor
    seed_B: Tensor
    n_gen_B: Tensor
    max_new_B: Tensor
    tokens_BN: Tensor
    logprobs_BN: Tensor
    n_sampling: int = 0
    n_filter: int = 0
    n_stop: int = 0
    stop_rows: list[int] = field(default_factory=list)
    listen_rows: list[int] = field(default_factory=list)

    @staticmethod
    def build(
        rows: list[Row], kv: KVBatch, seeds: Sequence[int], max_new: Sequence[int]
    ) -> RowBatch:
        """New rows with nothing generated yet (`next_B` is set by the first `record`)."""
        dev = kv.lengths_B.device
        params = [r.request.sampling for r in rows]
        R, N = len(rows), max(max_new, default=1)

        def t(values: list[float] | list[int] | Sequence[int], dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        batch = RowBatch(
            rows=rows,
            kv=kv,
            next_B=torch.zeros(R, dtype=torch.long, device=dev),
            slot_B=t([r.handle.slot for r in rows], torch.long),
            temperature_B=t([p.temperature for p in params], torch.float32),
            top_k_B=t([p.top_k for p in params], torch.long),
            top_p_B=t([p.top_p for p in params], torch.float32),
            seed_B=t(seeds, torch.long),
            n_gen_B=torch.zeros(R, dtype=torch.long, device=dev),
            max_new_B=t(max_new, torch.long),
            tokens_BN=torch.zeros(R, N, dtype=torch.long, device=dev),
            logprobs_BN=torch.zeros(R, N, dtype=torch.float32, device=dev),
        )
        batch._count()
        return batch

    @property
    def size(self) -> int:
        return len(self.rows)

    def _count(self) -> None:
        params = [r.request.sampling for r in self.rows]
        self.n_sampling = sum(p.temperature > 0 for p in params)
        self.n_filter = sum(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params)
        self.stop_rows = [i for i, r in enumerate(self.rows) if r.stop_window > 0]
        self.n_stop = len(self.stop_rows)
        self.listen_rows = [i for i, r in enumerate(self.rows) if r.listener is not None]

    def record(self, tokens_B: Tensor, logprobs_B: Tensor) -> None:
        """Append one sampled token (and its log-prob) to every row."""
        ar_B = torch.arange(self.size, device=tokens_B.device)
        self.tokens_BN[ar_B, self.n_gen_B] = tokens_B
        self.logprobs_BN[ar_B, self.n_gen_B] = logprobs_B
        self.n_gen_B += 1
        self.next_B = tokens_B

    def select(self, keep: Sequence[int]) -> RowBatch:
        idx = torch.tensor(list(keep), dtype=torch.long, device=self.kv.lengths_B.device)
        fields = {name: getattr(self, name)[idx] for name in _ROW_TENSORS}
        return RowBatch._of([self.rows[i] for i in keep], self.kv.select(idx), fields)

    @staticmethod
    def concat(a: RowBatch, b: RowBatch) -> RowBatch:
        if a.size == 0:
            return b
        if b.size == 0:
            return a
        N = max(a.tokens_BN.shape[1], b.tokens_BN.shape[1])

        def cat(name: str) -> Tensor:
            x, y = getattr(a, name), getattr(b, name)
            if x.dim() == 2:
                x = torch.nn.functional.pad(x, (0, N - x.shape[1]))
                y = torch.nn.functional.pad(y, (0, N - y.shape[1]))
            return torch.cat([x, y])

        fields = {name: cat(name) for name in _ROW_TENSORS}
        return RowBatch._of(a.rows + b.rows, KVBatch.concat(a.kv, b.kv), fields)

    @staticmethod
    def _of(rows: list[Row], kv: KVBatch, t: dict[str, Tensor]) -> RowBatch:
        out = RowBatch(
            rows,
            kv,
            next_B=t["next_B"],
            slot_B=t["slot_B"],
            temperature_B=t["temperature_B"],
            top_k_B=t["top_k_B"],
            top_p_B=t["top_p_B"],
            seed_B=t["seed_B"],
            n_gen_B=t["n_gen_B"],
            max_new_B=t["max_new_B"],
            tokens_BN=t["tokens_BN"],
            logprobs_BN=t["logprobs_BN"],
        )
        out._count()
        return out


def _forward_last(
    model: LoRAModel,
    bank: AdapterBank,
    slot_B: Tensor,
    ids_BT: Tensor,
    mask_BS: Tensor,
    pos_BT: Tensor,
    kv: KVBatch,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """One forward of the base with each row's adapter; the last position's logits and
    the grown per-layer keys/values."""
    cache = kv.forward_cache()
    with torch.no_grad(), model.lanes(bank.slot_lanes(slot_B)):
        out = model.base(
            input_ids=ids_BT,
            attention_mask=mask_BS,
            position_ids=pos_BT,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    keys, values = KVBatch.grown(cache)
    return out.logits[:, -1], keys, values


def decode_logits(model: LoRAModel, bank: AdapterBank, batch: RowBatch) -> Tensor:
    """Feed every row's pending token; grow the cache by one column; `logits_BV`."""
    kv = batch.kv
    logits_BV, keys, values = _forward_last(
        model,
        bank,
        batch.slot_B,
        batch.next_B.unsqueeze(-1),
        kv.mask_BS(extra=1),
        kv.lengths_B.unsqueeze(-1),
        kv,
    )
    batch.kv = KVBatch(keys, values, kv.lengths_B + 1)
    return logits_BV


def prefill_logits(
    model: LoRAModel,
    bank: AdapterBank,
    slot_R: Tensor,
    past: Sequence[RowKV | None],
    new_tokens: Sequence[Sequence[int]],
    empty: KVBatch,
    pad_id: int,
) -> tuple[Tensor, KVBatch]:
    """Prefill new rows: `past[i]` is row i's reused session cache (or None) and
    `new_tokens[i]` the prompt tokens after it. Returns the last position's logits and
    the rows' compacted cache.

    Layout of row i: [pad | past_i | pad | new_i]; each row's new tokens are left-padded
    so the last column holds every row's last prompt token.
    """
    past_kv = KVBatch.from_rows(past, empty)
    dev = past_kv.lengths_B.device
    R, N = len(new_tokens), max(len(t) for t in new_tokens)
    ids_RN = torch.full((R, N), pad_id, dtype=torch.long, device=dev)
    new_mask_RN = torch.zeros(R, N, dtype=torch.long, device=dev)
    for i, toks in enumerate(new_tokens):
        ids_RN[i, N - len(toks) :] = torch.tensor(toks, dtype=torch.long)
        new_mask_RN[i, N - len(toks) :] = 1
    mask_RS = torch.cat([past_kv.mask_BS(), new_mask_RN], dim=1)
    pos_RN = past_kv.lengths_B.unsqueeze(-1) + (new_mask_RN.cumsum(-1) - 1).clamp_(min=0)
    logits_RV, keys, values = _forward_last(model, bank, slot_R, ids_RN, mask_RS, pos_RN, past_kv)
    return logits_RV, KVBatch.compact(keys, values, mask_RS)
