"""The slot cache: writes land in place at their positions, padding goes to the scratch
column, rows move and round-trip exactly, growth keeps what was there."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_archs import tiny_model
from marlaas.errors import ModelError
from marlaas.model.lora import LoRAModel
from marlaas.model.mixed import half_linears
from marlaas.rollout.kv import KVGeometry, SlotKV, kv_geometry

GEOMETRY = KVGeometry(num_layers=2, kv_heads=2, head_dim=3, windows=(None, None))


def _kv(max_rows: int = 8, max_positions: int | None = 40) -> SlotKV:
    return SlotKV(GEOMETRY, torch.float32, torch.device("cpu"), max_rows, max_positions)


def _states(R: int, N: int, base: float) -> torch.Tensor:
    """Distinct values `[R, H, N, D]`: base + 100 r + 10 n + h."""
    r = torch.arange(R).view(R, 1, 1, 1) * 100.0
    n = torch.arange(N).view(1, 1, N, 1) * 10.0
    h = torch.arange(2).view(1, 2, 1, 1).float()
    return (base + r + n + h).expand(R, 2, N, 3).clone()


def test_a_forward_writes_each_token_at_its_position_and_pads_to_scratch() -> None:
    kv = _kv()
    kv.reserve(3, 10)
    positions = torch.tensor([[-1, 0, 1], [4, 5, 6]])  # row 1's first 4 tokens exist
    cache = kv.cache(1, positions, columns=7)
    new_k = _states(2, 3, 1000.0)
    keys, values = cache.update(new_k, -new_k, 0)
    assert keys.shape == (2, 2, 7, 3) and values.shape == keys.shape
    assert torch.equal(kv.keys[0][1, :, 0], new_k[0, :, 1])
    assert torch.equal(kv.keys[0][1, :, 1], new_k[0, :, 2])
    assert torch.equal(kv.keys[0][2, :, 4:7], new_k[1])
    assert torch.equal(kv.values[0][2, :, 4:7], -new_k[1])
    scratch = kv.keys[0].shape[2] - 1
    assert torch.equal(kv.keys[0][1, :, scratch], new_k[0, :, 0])  # the padding token
    assert not kv.keys[0][0].any() and not kv.keys[1].any()  # other rows, other layers


def test_rows_move_round_trip_and_survive_growth() -> None:
    kv = _kv()
    kv.reserve(4, 5)
    rows = [  # [layers, keys / values, H, n, D]
        torch.stack(
            [
                torch.stack(
                    (torch.full((2, n, 3), 10.0 * b + layer), torch.full((2, n, 3), -10.0 * b))
                )
                for layer in range(2)
            ]
        )
        for b, n in enumerate([5, 2, 4, 1])
    ]
    kv.import_rows(range(4), rows)  # rows of different lengths in one op
    kv.move_rows([0, 1], [3, 0], columns=5)  # sources are read before writing
    for layer in range(2):
        assert torch.equal(kv.export_rows([0], [1])[0][layer][0], rows[3][layer][0])
        assert torch.equal(kv.export_rows([1], [5])[0][layer][0], rows[0][layer][0])
    kv.reserve(8, 70 // 2)  # grows rows and columns, keeps the contents
    assert kv.rows == 8 and kv.usable_columns >= 35
    assert torch.equal(kv.export_rows([1], [5])[0][1][1], rows[0][1][1])
    assert torch.equal(kv.export_rows([2], [4])[0][0][0], rows[2][0][0])


def test_release_frees_and_reserve_allocates_again() -> None:
    kv = _kv()
    kv.reserve(4, 10)
    kv.import_rows([0], [torch.ones(2, 2, 2, 3, 3)])
    kv.release()
    assert kv.rows == 0 and kv.usable_columns == 0
    kv.reserve(2, 5)
    assert kv.rows >= 2 and not kv.keys[0].any()  # fresh zeros, nothing of before


def test_limits_are_checked() -> None:
    kv = _kv(max_rows=4, max_positions=16)
    with pytest.raises(ModelError, match="at most 4 rows"):
        kv.reserve(5, 1)
    with pytest.raises(ModelError, match="16 positions"):
        kv.reserve(1, 17)


def test_geometry_reads_windows_and_refuses_unknown_layer_types() -> None:
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    assert kv_geometry(LlamaConfig(num_hidden_layers=2)).windows == (None, None)
    assert kv_geometry(MistralConfig(num_hidden_layers=2, sliding_window=8)).windows == (8, 8)
    qwen = Qwen2Config(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=5, max_window_layers=2
    )
    assert kv_geometry(qwen).windows == (None, None, 5)
    assert kv_geometry(Qwen2Config(num_hidden_layers=2)).windows == (None, None)
    gemma = Gemma2Config(num_hidden_layers=2, sliding_window=7)
    assert kv_geometry(gemma).windows == (7, None)
    odd = LlamaConfig(num_hidden_layers=2)
    odd.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ModelError, match="chunked_attention"):
        kv_geometry(odd)


def test_the_cache_takes_the_half_dtype_of_a_cpus_half_linears() -> None:
    """`LoRAModel.kv_dtype`: a float32 base keeps float32; bfloat16 linears over float32
    activations on the CPU cache bfloat16; a whole half model caches its own dtype."""
    assert LoRAModel(tiny_model("llama", 64), max_rank=2).kv_dtype == torch.float32
    mixed = tiny_model("llama", 64)
    half_linears(mixed, torch.bfloat16)
    assert LoRAModel(mixed, max_rank=2).kv_dtype == torch.bfloat16
    half16 = tiny_model("llama", 64)
    half_linears(half16, torch.float16)  # no kernel reads a float16 cache: float32
    assert LoRAModel(half16, max_rank=2).kv_dtype == torch.float32
    whole = tiny_model("llama", 64).to(torch.bfloat16)
    assert LoRAModel(whole, max_rank=2).kv_dtype == torch.bfloat16


def test_a_half_cache_stores_rounded_and_round_trips_rows() -> None:
    kv = SlotKV(GEOMETRY, torch.bfloat16, torch.device("cpu"), 8, 40)
    kv.reserve(3, 10)
    positions = torch.tensor([[0, 1, 2]])
    new_k = _states(1, 3, 0.1) / 7.0  # not representable in bfloat16
    cache = kv.cache(0, positions, columns=3)
    keys, _ = cache.update(new_k, -new_k, 0)
    assert keys.dtype == torch.bfloat16
    assert torch.equal(kv.keys[0][0, :, :3], new_k[0].bfloat16())
    row = kv.export_rows([0], [3])[0]
    kv.move_rows([2], [0], 3)
    assert torch.equal(kv.export_rows([2], [3])[0], row)
    kv.import_rows([1], [row])
    assert torch.equal(kv.export_rows([1], [3])[0], row)
    both = kv.export_rows([2, 1], [3, 2])  # each its own contiguous copy
    assert torch.equal(both[0], row) and torch.equal(both[1], row[:, :, :, :2])
    assert both[0].is_contiguous() and both[0].data_ptr() != row.data_ptr()
