"""The decode batch: row-aligned state of every running sequence.

`RowBatch` keeps, for the `B` running rows, a Python `Row` (request, adapter handle,
result callback) and one tensor per per-row quantity (cache length, pending token, slot,
sampling knobs, token counts, output buffers), all aligned on the batch axis; batch row
`b` is row `b` of the engine's KV cache (`marlaas.rollout.kv.SlotKV`). Rows join by
`concat` and leave by `select` (the scheduler moves their cache rows alongside);
nothing is done per row in between.

Invariants:
- Every tensor field has first dimension `B == len(rows)`.
- `next_B[b]` is row b's newest sampled token; it is not in the KV cache yet, so
  `lengths_B[b] == prompt_len + n_gen_B[b] - 1` and its position is `lengths_B[b]`.
- `tokens_BN[b, :n_gen_B[b]]` / `logprobs_BN[b, :n_gen_B[b]]` are row b's output so far;
  `uniform_BN[b, n]` is the uniform that samples its `n`-th new token (a function of its
  seed and `n` only, see `marlaas.rollout.sampling`).
- `n_sampling`, `n_filter`, `n_stop` and `n_listen` count the rows that sample
  (temperature > 0), use top-k/top-p, have stop strings (`stop_rows_R`) and a token
  listener (`listen_rows`): batch-level shortcuts for the hot path, counted from the
  rows' flags (`flags_B`, set once as a row joins) when rows join or leave, in one
  tensor op rather than a pass over the rows in Python (~1 us a row: 0.6 ms an
  iteration at 560 rows). `stop_ends` holds the last characters of the stop strings of
  every row since the batch last had none: those of the rows left, or more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from marlaas.model.bank import AdapterHandle
from marlaas.rollout.sampling import uniform_B
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
    #: The final text when a stop string ended the row.
    stop_text: str | None = None
    #: Prompt tokens whose KV came from the session cache.
    reused: int = 0
    #: Gets each sampled token as it is recorded (None: nobody streams this row).
    listener: TokenListener | None = None
    #: log p(prompt[i] | prompt[:i]) at temperature 1 (entry 0 is 0.0), when asked for.
    prompt_logprobs: tuple[float, ...] | None = None


#: A row's flags (`RowBatch.flags_B`): it samples, filters (top-k/top-p), has stop
#: strings, has a token listener.
SAMPLES, FILTERS, STOPS, LISTENS = 1, 2, 4, 8


def _flags(row: Row) -> int:
    p = row.request.sampling
    flags = 0
    if p.temperature > 0:
        flags |= SAMPLES
        if p.top_k > 0 or p.top_p < 1:
            flags |= FILTERS
    if row.stop_window > 0:
        flags |= STOPS
    if row.listener is not None:
        flags |= LISTENS
    return flags


_ROW_TENSORS = (
    "flags_B",
    "lengths_B",
    "next_B",
    "slot_B",
    "temperature_B",
    "top_k_B",
    "top_p_B",
    "seed_B",
    "uniform_BN",
    "n_gen_B",
    "max_new_B",
    "tokens_BN",
    "logprobs_BN",
)


@dataclass
class RowBatch:
    rows: list[Row]
    #: Each row's flags (`SAMPLES | FILTERS | STOPS | LISTENS`), uint8.
    flags_B: Tensor
    lengths_B: Tensor
    next_B: Tensor
    slot_B: Tensor
    temperature_B: Tensor
    top_k_B: Tensor
    top_p_B: Tensor
    seed_B: Tensor
    #: The uniform draw of each row's n-th new token (`sampling.uniform_B`), made once.
    uniform_BN: Tensor
    n_gen_B: Tensor
    max_new_B: Tensor
    tokens_BN: Tensor
    logprobs_BN: Tensor
    n_sampling: int = 0
    n_filter: int = 0
    n_stop: int = 0
    n_listen: int = 0
    #: The last characters of the stop strings of the rows with any (`FinishPolicy`'s
    #: filter): theirs, or more (see the module doc).
    stop_ends: frozenset[str] = frozenset()

    @staticmethod
    def build(
        rows: list[Row],
        lengths: Sequence[int],
        seeds: Sequence[int],
        max_new: Sequence[int],
        device: torch.device,
    ) -> RowBatch:
        """New rows with `lengths` tokens cached and nothing generated yet (`next_B` is
        set by the first `record`)."""
        dev = device
        params = [r.request.sampling for r in rows]
        R, N = len(rows), max(max_new, default=1)

        def t(values: list[float] | list[int] | Sequence[int], dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        batch = RowBatch(
            rows=rows,
            flags_B=t([_flags(r) for r in rows], torch.uint8),
            lengths_B=t(lengths, torch.long),
            next_B=torch.zeros(R, dtype=torch.long, device=dev),
            slot_B=t([r.handle.slot for r in rows], torch.long),
            temperature_B=t([p.temperature for p in params], torch.float32),
            top_k_B=t([p.top_k for p in params], torch.long),
            top_p_B=t([p.top_p for p in params], torch.float32),
            seed_B=t(seeds, torch.long),
            uniform_BN=torch.zeros(R, N, dtype=torch.float32, device=dev),
            n_gen_B=torch.zeros(R, dtype=torch.long, device=dev),
            max_new_B=t(max_new, torch.long),
            tokens_BN=torch.zeros(R, N, dtype=torch.long, device=dev),
            logprobs_BN=torch.zeros(R, N, dtype=torch.float32, device=dev),
        )
        batch._count()
        batch.stop_ends = frozenset(
            s[-1] for r in rows if r.stop_window > 0 for s in r.request.sampling.stop if s
        )
        if batch.n_sampling:  # every draw of the rows' lives: no hashing per iteration
            counter_N = torch.arange(N, dtype=torch.long, device=dev)
            batch.uniform_BN = uniform_B(batch.seed_B[:, None], counter_N[None, :])
        return batch

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def max_length(self) -> int:
        """The longest row's cache length (0 for an empty batch)."""
        return int(self.lengths_B.max()) if self.rows else 0

    def _count(self) -> None:
        """The counts of the rows' flags (one histogram of `flags_B`)."""
        if not self.rows:
            self.n_sampling = self.n_filter = self.n_stop = self.n_listen = 0
            self.stop_ends = frozenset()
            return
        bins = torch.bincount(self.flags_B, minlength=16).tolist()
        self.n_sampling = sum(n for f, n in enumerate(bins) if f & SAMPLES)
        self.n_filter = sum(n for f, n in enumerate(bins) if f & FILTERS)
        self.n_stop = sum(n for f, n in enumerate(bins) if f & STOPS)
        self.n_listen = sum(n for f, n in enumerate(bins) if f & LISTENS)
        if not self.n_stop:
            self.stop_ends = frozenset()

    @property
    def stop_rows_R(self) -> Tensor:
        """The rows with stop strings, in order (long)."""
        return ((self.flags_B & STOPS) != 0).nonzero().squeeze(-1)

    @property
    def listen_rows(self) -> list[int]:
        """The rows with a token listener, in order."""
        if not self.n_listen:
            return []
        return ((self.flags_B & LISTENS) != 0).nonzero().squeeze(-1).tolist()

    def record(self, tokens_B: Tensor, logprobs_B: Tensor) -> None:
        """Append one sampled token (and its log-prob) to every row."""
        ar_B = torch.arange(self.size, device=tokens_B.device)
        self.tokens_BN[ar_B, self.n_gen_B] = tokens_B
        self.logprobs_BN[ar_B, self.n_gen_B] = logprobs_B
        self.n_gen_B += 1
        self.next_B = tokens_B

    def select(self, keep: Sequence[int]) -> RowBatch:
        """Rows `keep`, in that order (the caller moves their cache rows alongside)."""
        idx = torch.tensor(list(keep), dtype=torch.long, device=self.lengths_B.device)
        fields = {name: getattr(self, name)[idx] for name in _ROW_TENSORS}
        return RowBatch._of([self.rows[i] for i in keep], fields, self.stop_ends)

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
        return RowBatch._of(a.rows + b.rows, fields, a.stop_ends | b.stop_ends)

    @staticmethod
    def _of(rows: list[Row], t: dict[str, Tensor], stop_ends: frozenset[str]) -> RowBatch:
        out = RowBatch(
            rows,
            flags_B=t["flags_B"],
            lengths_B=t["lengths_B"],
            next_B=t["next_B"],
            slot_B=t["slot_B"],
            temperature_B=t["temperature_B"],
            top_k_B=t["top_k_B"],
            top_p_B=t["top_p_B"],
            seed_B=t["seed_B"],
            uniform_BN=t["uniform_BN"],
            n_gen_B=t["n_gen_B"],
            max_new_B=t["max_new_B"],
            tokens_BN=t["tokens_BN"],
            logprobs_BN=t["logprobs_BN"],
            stop_ends=stop_ends,
        )
        out._count()
        return out
