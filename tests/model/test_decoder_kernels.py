"""The native kernels of the engine's compact decoder (`marlaas.model.kernels`):
`rope_store` rotates queries and keys as Hugging Face's rotary embedding does and
writes keys and values into exactly their cache cells; `add_rms_norm` adds the residual
in place and normalises as `torch.nn.functional.rms_norm`. Both decline, writing
nothing, what they do not take."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from marlaas.model import kernels


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(x_THD: Tensor, cos_TR: Tensor, sin_TR: Tensor) -> Tensor:
    """Hugging Face's rotary on the first `rot` features, the rest passed through."""
    rot = cos_TR.shape[-1]
    head, tail = x_THD[..., :rot], x_THD[..., rot:]
    cos, sin = cos_TR[:, None], sin_TR[:, None]
    return torch.cat((head * cos + _rotate_half(head) * sin, tail), dim=-1)


def _tables(T: int, rot: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    angles = torch.rand(T, rot // 2, generator=g) * 6.0
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().contiguous(), angles.sin().contiguous()


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "rot"), [(4, 2, 32, 32), (6, 3, 16, 8)])
def test_rope_store_rotates_and_writes_each_token_into_its_cell(
    heads: int, kv_heads: int, dim: int, rot: int
) -> None:
    assert kernels.native_kernels("rope_store")
    g = torch.Generator().manual_seed(heads)
    T, rows, cap = 7, 5, 12
    # The projections' outputs as the decoder has them: q, k and v columns of one
    # fused row (a token stride wider than the heads).
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim + 3, generator=g)
    q = qkv[:, : heads * dim].view(T, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(T, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim : (heads + 2 * kv_heads) * dim].view(T, kv_heads, dim)
    cos, sin = _tables(T, rot, g)
    keys = torch.randn(rows + 1, kv_heads, cap, dim, generator=g)[1:]  # a strided view
    values = torch.randn(rows + 1, kv_heads, cap, dim, generator=g)[1:]
    row_T = torch.tensor([0, 0, 3, 3, 3, 4, 1])
    col_T = torch.tensor([0, 1, 5, 6, cap - 1, 2, 9])
    want_q = _rotary(q, cos, sin)
    want_keys, want_values = keys.clone(), values.clone()
    want_keys[row_T, :, col_T] = _rotary(k, cos, sin)
    want_values[row_T, :, col_T] = v
    assert kernels.rope_store(q, k, v, cos, sin, keys, values, row_T, col_T)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(keys, want_keys, atol=1e-6, rtol=0)  # nothing else moved
    assert torch.equal(values, want_values)


@pytest.mark.parametrize(("dim", "rot"), [(32, 32), (24, 16)])
def test_rope_store_rounds_into_a_bfloat16_cache_as_torch_rounds(dim: int, rot: int) -> None:
    """A bfloat16 cache (`LoRAModel.kv_dtype`) gets the float32 kernel's keys and
    values rounded as `Tensor.to` rounds them, bit for bit; the queries are the same."""
    g = torch.Generator().manual_seed(dim)
    T, rows, cap, H, Hkv = 6, 4, 10, 4, 2
    q, k, v = (torch.randn(T, h, dim, generator=g) for h in (H, Hkv, Hkv))
    cos, sin = _tables(T, rot, g)
    row_T, col_T = torch.tensor([0, 1, 1, 3, 2, 0]), torch.tensor([0, 4, 5, 9, 2, 1])
    keys, values = torch.zeros(rows, Hkv, cap, dim), torch.zeros(rows, Hkv, cap, dim)
    q32 = q.clone()
    assert kernels.rope_store(q32, k, v, cos, sin, keys, values, row_T, col_T)
    half_keys = torch.zeros(rows, Hkv, cap, dim, dtype=torch.bfloat16)
    half_values = torch.zeros_like(half_keys)
    assert kernels.rope_store(q, k, v, cos, sin, half_keys, half_values, row_T, col_T)
    assert torch.equal(q, q32)
    assert torch.equal(half_keys, keys.bfloat16()) and torch.equal(half_values, values.bfloat16())


def test_rope_store_declines_what_it_does_not_take() -> None:
    T, H, D = 3, 2, 8
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    keys, values = torch.zeros(2, H, 4, D), torch.zeros(2, H, 4, D)
    rows, cols = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0])
    before = q.clone()
    for args in (
        (q.bfloat16(), k, v, cos, sin, keys, values, rows, cols),  # another dtype
        (q.transpose(0, 1).contiguous().transpose(0, 1), k, v, cos, sin, keys, values, rows, cols),
        (q, k, v, torch.ones(T, D + 2), sin, keys, values, rows, cols),  # rot > D
        (q, k, v, cos, sin, keys, values, rows.int(), cols),  # not int64
        (q, k, v, cos, sin, keys, values.transpose(2, 3), rows, cols),  # other strides
        (q, k, v, cos, sin, keys.bfloat16(), values, rows, cols),  # two cache dtypes
        (q, k, v, cos, sin, keys.half(), values.half(), rows, cols),  # a float16 cache
    ):
        assert not kernels.rope_store(*args)
    assert torch.equal(q, before) and not keys.any() and not values.any()


@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_adds_in_place_and_normalises(with_delta: bool) -> None:
    assert kernels.native_kernels("add_rms_norm")
    g = torch.Generator().manual_seed(1)
    h = torch.randn(9, 40, generator=g) * 3.0
    delta = torch.randn(9, 40, generator=g) if with_delta else None
    weight = torch.randn(40, generator=g)
    summed = h + delta if delta is not None else h.clone()
    out = kernels.add_rms_norm(h, delta, weight, 1e-5)
    assert out is not None
    torch.testing.assert_close(h, summed, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        out, torch.nn.functional.rms_norm(summed, (40,), weight, 1e-5), atol=1e-5, rtol=1e-5
    )


def test_add_rms_norm_declines_without_writing() -> None:
    h, weight = torch.randn(4, 8), torch.randn(8)
    before = h.clone()
    assert kernels.add_rms_norm(h.bfloat16(), None, weight, 1e-6) is None
    assert kernels.add_rms_norm(h.t().contiguous().t(), None, weight, 1e-6) is None
    assert kernels.add_rms_norm(h, torch.randn(4, 8).t().contiguous().t(), weight, 1e-6) is None
    assert kernels.add_rms_norm(h, None, torch.randn(9), 1e-6) is None
    assert torch.equal(h, before)


def test_copy_rows_moves_the_first_columns_of_every_block_and_head() -> None:
    g = torch.Generator().manual_seed(3)
    buffer = torch.randn(3, 2, 12, 2, 10, 4, generator=g)  # [L, k/v, rows, heads, cols, D]
    want = buffer.clone()
    dst, src, columns = [0, 4, 7], [11, 2, 9], 6
    view = want[:, :, :, :, :columns]
    view.index_copy_(2, torch.tensor(dst), view.index_select(2, torch.tensor(src)))
    assert kernels.copy_rows(buffer, dst, src, columns)
    assert torch.equal(buffer, want)  # the later columns and the other rows untouched


def test_copy_rows_moves_a_bfloat16_cache_alike() -> None:
    g = torch.Generator().manual_seed(4)
    buffer = torch.randn(2, 2, 8, 2, 10, 6, generator=g).bfloat16()
    want = buffer.clone()
    dst, src, columns = [1, 5], [7, 0], 7
    view = want[:, :, :, :, :columns]
    view.index_copy_(2, torch.tensor(dst), view.index_select(2, torch.tensor(src)))
    assert kernels.copy_rows(buffer, dst, src, columns)
    assert torch.equal(buffer, want)


@pytest.mark.parametrize(
    "case",
    ["a row both source and destination", "float64", "a row out of range", "too many columns"],
)
def test_copy_rows_declines_what_it_cannot_copy_in_one_pass(case: str) -> None:
    buffer = torch.randn(2, 2, 6, 1, 5, 4)
    dst, src, columns = [0, 1], [4, 5], 3
    if case == "a row both source and destination":
        dst, src = [0, 1], [1, 2]
    elif case == "float64":
        buffer = buffer.double()
    elif case == "a row out of range":
        src = [4, 6]
    else:
        columns = 6
    before = buffer.clone()
    assert not kernels.copy_rows(buffer, dst, src, columns)
    assert torch.equal(buffer, before)
