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


_ROW_TENSORS = (
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
    stop_rows: list[int] = field(default_factory=list)
    #: The last characters of the stop strings of `stop_rows` (`FinishPolicy`'s filter).
    stop_ends: frozenset[str] = frozenset()
    listen_rows: list[int] = field(default_factory=list)

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
        # One pass over the rows (the batch is rebuilt whenever rows leave or join).
        n_sampling = n_filter = 0
        stop_rows: list[int] = []
        listen_rows: list[int] = []
        stops: set[tuple[str, ...]] = set()
        for i, row in enumerate(self.rows):
            p = row.request.sampling
            if p.temperature > 0:
                n_sampling += 1
                if p.top_k > 0 or p.top_p < 1:
                    n_filter += 1
            if row.stop_window > 0:
                stop_rows.append(i)
                stops.add(p.stop)
            if row.listener is not None:
                listen_rows.append(i)
        self.n_sampling, self.n_filter = n_sampling, n_filter
        self.stop_rows, self.n_stop, self.listen_rows = stop_rows, len(stop_rows), listen_rows
        self.stop_ends = frozenset(s[-1] for stop in stops for s in stop if s)

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
        return RowBatch._of([self.rows[i] for i in keep], fields)

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
        return RowBatch._of(a.rows + b.rows, fields)

    @staticmethod
    def _of(rows: list[Row], t: dict[str, Tensor]) -> RowBatch:
        out = RowBatch(
            rows,
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
        )
        out._count()
        return out
