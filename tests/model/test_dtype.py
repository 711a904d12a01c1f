"""The base's dtype: `auto` is the checkpoint's own on an accelerator, and on the CPU
bfloat16 only for a bfloat16 checkpoint on a CPU that computes it natively (else
float32); an explicit dtype is the whole model's on an accelerator, and on the CPU a half
dtype is the linear layers' weights only (`marlaas.model.mixed`: embeddings, norms, the
head and the activations stay float32); LoRA slots stay float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_support import CONFIGS, char_tokenizer, save_model
from torch import nn
from transformers import AutoConfig, PreTrainedModel

import marlaas.model.base as base_module
from marlaas.config.specs import check_dtype, parse_target_modules
from marlaas.errors import ConfigError
from marlaas.model.bank import AdapterBank
from marlaas.model.base import load_base, resolve_dtype
from marlaas.model.lora import LoRAModel
from marlaas.model.mixed import HalfLinear


def _split_dtypes(base: PreTrainedModel) -> tuple[set[torch.dtype], set[torch.dtype]]:
    """The dtypes of the linear layers' parameters (but the head's), and of the rest."""
    head = base.get_output_embeddings()
    linear = {
        id(p)
        for m in base.modules()
        if isinstance(m, nn.Linear) and m is not head
        for p in m.parameters()
    }
    params = list(base.parameters())
    return (
        {p.dtype for p in params if id(p) in linear},
        {p.dtype for p in params if id(p) not in linear},
    )


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = CONFIGS["llama"]()
    config.dtype = torch.bfloat16  # as a checkpoint saved in bfloat16 records it
    return save_model(config, tmp_path_factory.mktemp("bf16"), char_tokenizer())


def test_auto_is_the_checkpoints_dtype_where_the_device_computes_it(
    bf16_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = AutoConfig.from_pretrained(bf16_dir)
    assert resolve_dtype("auto", "cuda", config) == torch.bfloat16
    monkeypatch.setattr(base_module, "native_bfloat16", lambda device: True)
    assert resolve_dtype("auto", "cpu", config) == torch.bfloat16
    config.dtype = torch.float16  # a float16 half is emulated on the CPU: float32
    assert resolve_dtype("auto", "cpu", config) == torch.float32
    config.dtype = torch.bfloat16
    monkeypatch.setattr(base_module, "native_bfloat16", lambda device: False)
    assert resolve_dtype("auto", "cpu", config) == torch.float32
    assert resolve_dtype("float16", "cpu", config) == torch.float16
    assert resolve_dtype("auto", "cuda", CONFIGS["qwen2"]()) == torch.float32  # none recorded
    with pytest.raises(ConfigError, match="dtype must be auto"):
        resolve_dtype("fp8", "cpu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--dtype must be auto, float32, bfloat16 or float16"):
        check_dtype("half")


def test_a_half_dtype_on_the_cpu_is_the_linear_weights_and_slots_stay_float32(
    bf16_dir: Path,
) -> None:
    plain, _ = load_base(bf16_dir, dtype="float32")
    assert {p.dtype for p in plain.parameters()} == {torch.float32}
    assert not any(isinstance(m, HalfLinear) for m in plain.modules())
    base, _ = load_base(bf16_dir, dtype="bfloat16")
    assert _split_dtypes(base) == ({torch.bfloat16}, {torch.float32})
    assert type(base.get_output_embeddings()) is nn.Linear
    assert sum(isinstance(m, HalfLinear) for m in base.modules()) == 7 * len(base.model.layers)
    model = LoRAModel(base, max_rank=4)
    bank = AdapterBank(model, num_slots=2)
    assert model.dtype == torch.float32 and bank.dtype == torch.float32
    ids = torch.tensor([[1, 5, 9, 3]])
    assert base(input_ids=ids).logits.dtype == torch.float32  # float32 activations


def test_target_modules_on_the_command_line() -> None:
    assert parse_target_modules(None) is None
    assert parse_target_modules("all-linear") == "all-linear"
    assert parse_target_modules(" q_proj, v_proj,q_proj") == ("q_proj", "v_proj")
    with pytest.raises(ConfigError, match=r"--target-modules: 'model\.q_proj' is not"):
        parse_target_modules("model.q_proj")
    with pytest.raises(ConfigError, match="--target-modules"):
        parse_target_modules("q_proj,,v_proj")


async def test_the_services_own_engine_loads_its_base_in_the_asked_dtype(
    bf16_dir: Path,
) -> None:
    """`marlaas serve --backend none --dtype/--device`: the engine the OpenAI routes start
    (no job backend to share) loads the base as asked, adapters in float32."""
    from marlaas.service.inference import open_engine

    engine = await open_engine(bf16_dir, max_rank=4, adapter_slots=2, device="cpu", dtype="float32")
    assert {p.dtype for p in engine.model.base.parameters()} == {torch.float32}
    engine = await open_engine(
        bf16_dir, max_rank=4, adapter_slots=2, device="cpu", dtype="bfloat16"
    )
    assert _split_dtypes(engine.model.base) == ({torch.bfloat16}, {torch.float32})


def test_the_embedded_base_runs_in_bfloat16_where_the_cpu_computes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The embedded base declares bfloat16 (`marlaas bench dtype`: no loss of accuracy),
    its weights stored in float32: `auto` takes bfloat16 linears on a CPU with native
    bfloat16 only."""
    root = base_module.default_base_path()
    if not (root / "config.json").is_file():
        pytest.skip("the embedded base is not built (marlaas base build)")
    config = AutoConfig.from_pretrained(root)
    monkeypatch.setattr(base_module, "native_bfloat16", lambda device: True)
    assert resolve_dtype("auto", "cpu", config) == torch.bfloat16
    monkeypatch.setattr(base_module, "native_bfloat16", lambda device: False)
    assert resolve_dtype("auto", "cpu", config) == torch.float32


def test_half_products_run_at_bucketed_row_counts() -> None:
    """Without gradient, a half product's rows are padded to `bucket_rows` (a multiple of
    16, from 128 rows on at most an eighth more) so that oneDNN's per-shape kernels repeat; the
    padding changes nothing but the rows' order of summation at most, the gradient to
    the input alike."""
    from marlaas.model.mixed import bucket_rows, linear, matmul

    assert [bucket_rows(n) for n in (1, 16, 17, 127, 129, 1527, 2135)] == [
        16, 16, 32, 128, 144, 1536, 2304,
    ]  # fmt: skip
    assert all(0 <= bucket_rows(n) - n < max(16, n // 8 + 1) for n in range(1, 5000))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g).to(torch.bfloat16)
    b = torch.randn(24, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 7, 40, generator=g)  # 21 rows: run as 32
    want = torch.nn.functional.linear(x.to(torch.bfloat16), w, b).to(torch.float32)
    got = linear(x, w, b)
    assert got.shape == (3, 7, 24) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    a = torch.randn(21, 24, generator=g)
    torch.testing.assert_close(
        matmul(a, w), (a.to(torch.bfloat16) @ w).to(torch.float32), rtol=1e-5, atol=1e-5
    )
    # With gradient to x (a frozen weight): buckets both ways, autograd's gradient.
    x.requires_grad_(True)
    (linear(x, w, b) * want).sum().backward()
    got_grad, x.grad = x.grad, None
    plain = torch.nn.functional.linear(x.to(torch.bfloat16), w, b).to(torch.float32)
    (plain * want).sum().backward()
    assert got_grad is not None and x.grad is not None
    torch.testing.assert_close(got_grad, x.grad, rtol=1e-5, atol=1e-5)
