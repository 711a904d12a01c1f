"""The ragged KV batch: right-aligned rows, trimming, merging, compaction."""

from __future__ import annotations

import torch

from marlaas.rollout.kv import KVBatch

H, D, LAYERS = 2, 3, 2


def _row(n: int, tag: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A row whose entry j holds `tag + j` everywhere (keys) and its negation (values)."""
    vals = (tag + torch.arange(n, dtype=torch.float32))[None, :, None].expand(H, n, D)
    return [(vals.clone(), -vals.clone()) for _ in range(LAYERS)]


def _empty() -> KVBatch:
    return KVBatch.empty(LAYERS, H, D, torch.float32, torch.device("cpu"))


def _valid(kv: KVBatch, b: int) -> list[float]:
    return kv.row(b)[0][0][0, :, 0].tolist()


def test_from_rows_right_aligns_and_row_round_trips() -> None:
    kv = KVBatch.from_rows([_row(3, 10), None, _row(1, 20)], _empty())
    assert kv.width == 3 and kv.lengths_B.tolist() == [3, 0, 1]
    assert kv.mask_BS().tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 1]]
    assert kv.mask_BS(extra=1)[:, -1].tolist() == [1, 1, 1]
    assert _valid(kv, 0) == [10, 11, 12] and _valid(kv, 2) == [20]
    k, v = kv.row(0)[1]
    assert torch.equal(v, -k)


def test_select_trims_all_padding_columns() -> None:
    kv = KVBatch.from_rows([_row(5, 0), _row(2, 10), _row(3, 20)], _empty())
    sub = kv.select(torch.tensor([2, 1]))
    assert sub.width == 3 and sub.lengths_B.tolist() == [3, 2]
    assert _valid(sub, 0) == [20, 21, 22] and _valid(sub, 1) == [10, 11]
    assert kv.select(torch.tensor([], dtype=torch.long)).width == 0


def test_concat_left_pads_the_narrower_batch() -> None:
    a = KVBatch.from_rows([_row(2, 0)], _empty())
    b = KVBatch.from_rows([_row(4, 10), _row(1, 20)], _empty())
    for first, second in ((a, b), (b, a)):
        kv = KVBatch.concat(first, second)
        assert kv.width == 4 and kv.size == 3
        got = sorted(_valid(kv, i) for i in range(3))
        assert got == [[0, 1], [10, 11, 12, 13], [20]]
    assert KVBatch.concat(_empty(), a) is a


def test_compact_removes_holes_keeping_token_order() -> None:
    S = 6
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 0, 0, 0, 0, 1], [0, 0, 0, 1, 1, 1]])
    col = torch.arange(S, dtype=torch.float32)[None, None, :, None].expand(3, H, S, D)
    kv = KVBatch.compact([col.clone()] * LAYERS, [(-col).clone()] * LAYERS, mask)
    assert kv.lengths_B.tolist() == [3, 2, 3] and kv.width == 3
    assert _valid(kv, 0) == [1, 2, 4]
    assert _valid(kv, 1) == [0, 5]
    assert _valid(kv, 2) == [3, 4, 5]
