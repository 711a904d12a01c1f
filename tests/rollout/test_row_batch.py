"""The decode batch's batch-level shortcuts (`marlaas.rollout.batch.RowBatch`): the
counts of rows that sample, filter, have stop strings and listen, the rows with stop
strings and those with listeners, and the stop strings' last characters, as rows join
(`concat`) and leave (`select`), equal a count over the rows themselves."""

from __future__ import annotations

import random

import torch

from marlaas.config.specs import LoRASpec
from marlaas.model.bank import AdapterHandle
from marlaas.rollout.batch import Row, RowBatch
from marlaas.types import RolloutRequest, SamplingParams

_HANDLE = AdapterHandle("t", 0, 0, LoRASpec(rank=4, alpha=8.0), 1)


def _row(rng: random.Random) -> Row:
    stop = rng.choice([(), ("\n",), ("END", "!")])
    sampling = SamplingParams(
        temperature=rng.choice([0.0, 1.0]),
        top_k=rng.choice([0, 5]),
        top_p=rng.choice([1.0, 0.9]),
        stop=stop,
        max_new_tokens=8,
    )
    request = RolloutRequest(tenant="t", prompt_ids=(3, 4), sampling=sampling)
    listener = (lambda _token: None) if rng.random() < 0.3 else None
    return Row(
        request, _HANDLE, lambda _result: None, stop_window=8 if stop else 0, listener=listener
    )


def _batch(rows: list[Row]) -> RowBatch:
    n = len(rows)
    return RowBatch.build(rows, [2] * n, list(range(n)), [8] * n, torch.device("cpu"))


def _check(batch: RowBatch) -> None:
    rows = batch.rows
    sampling = [r.request.sampling for r in rows]
    assert batch.n_sampling == sum(p.temperature > 0 for p in sampling)
    assert batch.n_filter == sum(
        p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in sampling
    )
    stops = [i for i, r in enumerate(rows) if r.stop_window > 0]
    assert batch.n_stop == len(stops)
    assert batch.stop_rows_R.tolist() == stops
    listens = [i for i, r in enumerate(rows) if r.listener is not None]
    assert batch.n_listen == len(listens) and batch.listen_rows == listens
    ends = {s[-1] for i in stops for s in rows[i].request.sampling.stop}
    assert ends <= batch.stop_ends if stops else batch.stop_ends == frozenset()


def test_the_shortcuts_follow_the_rows_as_they_join_and_leave() -> None:
    rng = random.Random(0)
    batch = _batch([])
    _check(batch)
    for _ in range(40):
        batch = RowBatch.concat(batch, _batch([_row(rng) for _ in range(rng.randint(1, 6))]))
        _check(batch)
        keep = sorted(rng.sample(range(batch.size), rng.randint(0, batch.size)))
        rng.shuffle(keep)
        batch = batch.select(keep)
        _check(batch)
