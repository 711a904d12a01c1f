"""The engine's decoder layers in one native call (`marlaas.rollout.native`) compute
exactly what the compact forward's Python path computes kernel by kernel: the same
logits and the same keys and values, bit for bit, through prefill with left padding, a
continued turn and decode steps, each row with its own adapter, for the architectures
and layouts it covers (grouped heads, sliding windows, biases, Qwen3's per-head norms,
adapters on some modules only); it declines what it does not cover, and the Python path runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from rollout_support import ALL_SPEC, decoder_model, forwards
from torch import Tensor

from marlaas.config.specs import LoRASpec
from marlaas.model import kernels
from marlaas.model.bank import AdapterBank
from marlaas.model.lora import LoRAModel
from marlaas.model.mixed import native_bfloat16
from marlaas.rollout.decoder import CompactDecoder
from marlaas.rollout.forward import RowForward
from marlaas.rollout.kv import SlotKV, kv_geometry
from marlaas.rollout.native import NativeLayers

pytestmark = pytest.mark.skipif(
    not (native_bfloat16("cpu") and kernels.native_kernels()),
    reason="the native layers cover bfloat16 linear weights on a CPU computing them natively",
)

Run = tuple[list[Tensor], SlotKV, list[int]]


def _half_model(arch: str, spec: LoRASpec = ALL_SPEC) -> tuple[LoRAModel, AdapterBank]:
    return decoder_model(arch, torch.float32, spec, half=torch.bfloat16)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Whether each native call ran (True) or declined (False)."""
    seen: list[bool] = []
    run = NativeLayers.run

    def spy(self: NativeLayers, *args: Any) -> Tensor | None:
        out = run(self, *args)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(NativeLayers, "run", spy)
    yield seen


def _python_path(model: LoRAModel, bank: AdapterBank, monkeypatch: pytest.MonkeyPatch) -> Run:
    with monkeypatch.context() as patch:
        patch.setattr(NativeLayers, "run", lambda *_: None)
        return forwards(model, bank)


def _assert_identical(got: Run, want: Run) -> None:
    for a, b in zip(got[0], want[0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got[1].buffer, want[1].buffer)
    assert got[2] == want[2]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_native_layers_equal_the_python_path(
    arch: str, calls: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, bank = _half_model(arch)
    decoder = CompactDecoder.of(model)
    assert decoder is not None and decoder.native is not None
    got = forwards(model, bank)
    assert calls and all(calls)  # every forward, prefill and decode, ran natively
    _assert_identical(got, _python_path(model, bank, monkeypatch))


def test_adapters_on_some_modules_only(calls: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    """Modules no adapter targets are left out of the lane batch: the plain base."""
    model, bank = _half_model("llama", LoRASpec(rank=4, alpha=8.0, target_modules=("v_proj",)))
    got = forwards(model, bank)
    assert calls and all(calls)
    _assert_identical(got, _python_path(model, bank, monkeypatch))


def test_the_python_path_runs_what_the_native_layers_do_not_cover() -> None:
    # float32 linear weights: their products are torch's.
    llama, _ = decoder_model("llama", torch.float32)
    decoder = CompactDecoder.of(llama)
    assert decoder is not None and decoder.native is None


def test_several_threads_leave_many_rows_to_oneDNN(
    calls: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On more than one torch thread the half kernel takes up to
    `kernels.HALF_LINEAR_MAX_ROWS` rows (oneDNN the rest, spread over the threads): a
    forward of more tokens runs the Python path, one of fewer the native call."""
    monkeypatch.setattr("marlaas.model.kernels.fused.HALF_LINEAR_MAX_ROWS", 6)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    model, bank = _half_model("llama")
    forwards(model, bank)
    # The prefills (3 x 13 and 2 x 4 tokens) decline; the decode steps (3 rows) run.
    assert calls == [False, False, True, True, True]


def test_a_cache_of_another_dtype_runs_the_python_path(calls: list[bool]) -> None:
    """The native call reads keys and values as the model caches them (bfloat16 here);
    a cache made in another dtype goes through the Python path, which converts."""
    model, bank = _half_model("llama")
    kv = SlotKV(kv_geometry(model.base.config), torch.float32, model.device, 4, 128)
    forward = RowForward(model, bank, kv)
    slot_R = torch.tensor([bank.acquire("t0").slot])
    logits = forward.prefill(0, slot_R, [0], [[5, 6, 7]], 0, all_logits=True)
    assert calls == [False] and torch.isfinite(logits).all()
