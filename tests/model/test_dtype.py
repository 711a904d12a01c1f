"""The base's dtype: `auto` is the checkpoint's own on an accelerator, and on the CPU
bfloat16 only for a bfloat16 checkpoint on a CPU that computes it natively (else
float32); an explicit dtype is the whole model's on an accelerator, and on the CPU a half
dtype is the linear layers' weights only (`marlaas.model.mixed`: embeddings, norms, the
head and the activations stay float32); LoRA slots stay float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from arch_support import CONFIGS, char_tokenizer, save_model
from torch import Tensor, nn
from transformers import AutoConfig, PreTrainedModel

import marlaas.model.base as base_module
from marlaas.config.specs import check_dtype, parse_target_modules
from marlaas.errors import ConfigError
from marlaas.model import kernels
from marlaas.model.bank import AdapterBank
from marlaas.model.base import load_base, resolve_dtype
from marlaas.model.lora import LoRAModel
from marlaas.model.mixed import HalfLinear, linear


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
    """A half product's rows are padded to `bucket_rows` (from 32 rows on a multiple of
    16, from 128 rows on at most an eighth more) so that oneDNN's per-shape kernels repeat; the
    padding changes nothing but the rows' order of summation at most, the gradient to
    the input alike."""
    from marlaas.model.mixed import bucket_rows, linear, matmul

    assert [bucket_rows(n) for n in (1, 16, 31, 33, 127, 129, 1527, 2135)] == [
        1, 16, 31, 48, 128, 144, 1536, 2304,
    ]  # fmt: skip
    assert all(0 <= bucket_rows(n) - n < max(16, n // 8 + 1) for n in range(1, 5000))
    assert len({bucket_rows(n) for n in range(1, 5000)}) < 100  # shapes that repeat
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g).to(torch.bfloat16)
    b = torch.randn(24, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 7, 40, generator=g)  # 35 rows: run as 48
    want = torch.nn.functional.linear(x.to(torch.bfloat16), w, b).to(torch.float32)
    got = linear(x, w, b)
    assert got.shape == (5, 7, 24) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    a = torch.randn(35, 24, generator=g)
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


@pytest.mark.parametrize(
    ("rows", "out", "fan_in"),
    [(1, 72, 96), (3, 72, 96), (4, 16, 34), (13, 130, 96), (32, 704, 128)],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_a_few_rows_of_a_bfloat16_layer_skip_onednn_and_round_alike(
    rows: int, out: int, fan_in: int, with_bias: bool
) -> None:
    """`kernels.half_linear_rows` (on a CPU with AVX512-BF16, over the packed weight): torch's bfloat16 result up to one bfloat16
    rounding step (products summed in another order may land on the other side of a
    rounding boundary), output blocks and row groups whole or not; `mixed.linear` takes
    it."""
    from marlaas.model import kernels
    from marlaas.model.mixed import linear, native_bfloat16, packed

    if not (native_bfloat16("cpu") and kernels.native_kernels("half_linear_rows")):
        pytest.skip("needs a CPU with AVX512-BF16 and the native kernels")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out, fan_in, generator=g).to(torch.bfloat16)
    b = torch.randn(out, generator=g).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, fan_in, generator=g)
    want = torch.nn.functional.linear(x.to(torch.bfloat16), w, b).to(torch.float32)
    weights = packed(w)
    assert weights is not None and packed(w) is weights  # packed once
    got = kernels.half_linear_rows(x, weights, out, b)
    assert got is not None and got.shape == (rows, out)
    assert torch.all((got - want).abs() <= want.abs() * 2**-7)
    assert float((got == want).float().mean()) > 0.9  # rounded to bfloat16 as torch does
    assert torch.equal(linear(x[None], w, b)[0], got)
    many = torch.randn(kernels.HALF_LINEAR_MAX_ROWS + 1, fan_in)
    threads = torch.get_num_threads()
    try:  # on one thread it takes any rows; on more, oneDNN takes many rows
        torch.set_num_threads(1)
        assert kernels.half_linear_rows(many, weights, out, b) is not None
        torch.set_num_threads(2)
        assert kernels.half_linear_rows(many, weights, out, b) is None
    finally:
        torch.set_num_threads(threads)
    assert kernels.half_linear_rows(x[:, :-2].contiguous(), weights, out, b) is None
    with torch.no_grad():
        w.mul_(2.0)  # written to: packed again
    assert packed(w) is not weights


@pytest.mark.parametrize("fan_in", [96, 34])
def test_a_bfloat16_rows_product_does_not_depend_on_the_other_rows(fan_in: int) -> None:
    """`kernels.half_linear_rows` gives a row the same bits alone as among 37 others
    (two full blocks of 16 rows and a short one on AMX's tiles where the CPU has them:
    `fan_in` a multiple of 32; the vector path's blocks of four rows else), and each
    output the same bits whatever outputs share the call."""
    from marlaas.model import kernels
    from marlaas.model.mixed import native_bfloat16, packed

    if not (native_bfloat16("cpu") and kernels.native_kernels("half_linear_rows")):
        pytest.skip("needs a CPU with AVX512-BF16 and the native kernels")
    g = torch.Generator().manual_seed(fan_in)
    w = torch.randn(72, fan_in, generator=g).to(torch.bfloat16)
    b = torch.randn(72, generator=g).to(torch.bfloat16)
    x = torch.randn(38, fan_in, generator=g)
    weights, first = packed(w), packed(w[:40].contiguous())
    assert weights is not None and first is not None
    together = kernels.half_linear_rows(x, weights, 72, b)
    assert together is not None
    for row in (0, 15, 16, 31, 32, 37):
        alone = kernels.half_linear_rows(x[row : row + 1].contiguous(), weights, 72, b)
        assert alone is not None and torch.equal(alone[0], together[row])
    part = kernels.half_linear_rows(x, first, 40, b[:40].contiguous())
    assert part is not None and torch.equal(part, together[:, :40])


@pytest.mark.parametrize("rows", [1, 13, 300])
def test_a_layers_input_gradient_multiplies_by_the_packed_transpose(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mixed.matmul(g, W)` (a half layer's input gradient) goes through
    `kernels.half_linear_rows` over W's packed transpose: torch's bfloat16 `g W` up to
    one bfloat16 rounding step."""
    from marlaas.model import kernels
    from marlaas.model.mixed import matmul, native_bfloat16, packed

    if not (native_bfloat16("cpu") and kernels.native_kernels("half_linear_rows")):
        pytest.skip("needs a CPU with AVX512-BF16 and the native kernels")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(40, 72, generator=g).to(torch.bfloat16)  # [out, in]
    a = torch.randn(rows, 40, generator=g)
    want = torch.mm(a.to(torch.bfloat16), w).to(torch.float32)
    calls: list[Tensor | None] = []
    rows_kernel = kernels.half_linear_rows

    def spy(*args: Any) -> Tensor | None:
        calls.append(rows_kernel(*args))
        return calls[-1]

    monkeypatch.setattr(kernels, "half_linear_rows", spy)
    got = matmul(a, w)
    assert len(calls) == 1 and calls[0] is got  # the kernel's product
    assert got.shape == (rows, 72) and got.dtype == torch.float32
    assert torch.all((got - want).abs() <= want.abs() * 2**-7)
    assert float((got == want).float().mean()) > 0.9
    transposed = packed(w, transposed=True)
    assert transposed is not None and transposed is not packed(w)
    assert packed(w, transposed=True) is transposed


@pytest.mark.parametrize("rows", [1, 3, 35, 256])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_projections_of_one_input_are_stored_together_and_multiply_as_one(
    rows: int, arch: str
) -> None:
    """`half_linears` stores q/k/v (Qwen2: and their biases) and gate/up one after another
    in one tensor, each module's parameters views of it (the weights exist once, the
    modules unchanged); `Together` multiplies them in one product, whose parts are each
    layer's own `linear`: the same values where the packed kernel runs (each output
    sums in one order whatever shares the call), up to one bfloat16 rounding step
    through oneDNN (another product shape may sum in another order)."""
    from helpers.tiny_archs import tiny_model
    from marlaas.model import kernels
    from marlaas.model.mixed import Together, half_linears, linear, native_bfloat16

    base = tiny_model(arch, 64)
    half_linears(base, torch.bfloat16)
    attn, mlp = base.model.layers[0].self_attn, base.model.layers[0].mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    storage = {m.weight.untyped_storage().data_ptr() for m in qkv}
    assert len(storage) == 1
    assert all(m.weight.is_contiguous() for m in qkv)
    assert len({m.weight.untyped_storage().data_ptr() for m in (mlp.gate_proj, mlp.up_proj)}) == 1
    together = Together.of([m.weight for m in qkv], [m.bias for m in qkv])
    assert together is not None and together.sizes == tuple(m.out_features for m in qkv)
    # The same layers, the same span (and its packed weight), whoever asks.
    assert Together.of([m.weight for m in qkv], [m.bias for m in qkv]) is together
    assert (together.bias is not None) == (arch == "qwen2")
    x = torch.randn(rows, base.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    for got, m in zip(together.linear(x), qkv, strict=True):
        want = linear(x, m.weight, m.bias)
        assert got.is_contiguous() and got.shape == want.shape
        assert torch.all((got - want).abs() <= want.abs() * 2**-7 + 1e-6)
        if native_bfloat16("cpu") and kernels.native_kernels("half_linear_rows"):
            assert torch.equal(got, want)
    # Layers apart in memory, or with and without bias, are not together.
    assert Together.of([attn.q_proj.weight, attn.v_proj.weight], [None, None]) is None
    some_bias = [None, torch.zeros(32, dtype=torch.bfloat16), None]
    assert Together.of([m.weight for m in qkv], some_bias) is None
    apart = [attn.q_proj.weight.clone(), attn.k_proj.weight.clone()]
    assert Together.of(apart, [None, None]) is None


@pytest.mark.parametrize("out_features", [258, 32, 7])
def test_a_small_float32_layer_runs_the_512_bit_kernel_and_equals_torch(out_features: int) -> None:
    """`kernels.f32_linear_rows` over the packed weight (the output head's path on a CPU
    with AVX-512, `mixed.linear`): torch's float32 product up to float rounding, with
    and without bias, outputs past a block of 16 included; each row the same whatever
    the rows around it (bit for bit); the input gradient through the packed transpose
    equal to torch's; and what it does not take (a weight that trains, bfloat16 rows) it
    leaves to torch."""
    if not kernels.native_kernels("linear_f32_rows"):
        pytest.skip("the native kernels are not built here")
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 128, generator=g)
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(37, 128, generator=g)
    packed = kernels.f32_pack(weight)
    assert packed is not None
    for b in (None, bias):
        got = kernels.f32_linear_rows(x, packed, out_features, b)
        assert got is not None
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        for rows in (x[:1], x[5:9], x[:13]):  # a row's logits do not depend on the batch
            alone = kernels.f32_linear_rows(rows.contiguous(), packed, out_features, b)
            assert alone is not None
            start = int((rows.data_ptr() - x.data_ptr()) // (4 * 128))
            assert torch.equal(alone, got[start : start + rows.shape[0]])
    transposed = kernels.f32_pack(weight, transposed=True)
    grad = torch.randn(37, out_features, generator=g)
    assert transposed is not None
    back = kernels.f32_linear_rows(grad, transposed, 128, None)
    assert back is not None
    torch.testing.assert_close(back, grad @ weight, rtol=1e-5, atol=1e-5)
    # Through `mixed.linear`, with gradient to x alone (the weight frozen).
    xs = x.clone().requires_grad_(True)
    ref = x.clone().requires_grad_(True)
    out = linear(xs, weight, bias)
    torch.testing.assert_close(out, F.linear(ref, weight, bias), rtol=1e-5, atol=1e-5)
    out.backward(grad)
    F.linear(ref, weight, bias).backward(grad)
    torch.testing.assert_close(xs.grad, ref.grad, rtol=1e-5, atol=1e-5)
    assert kernels.f32_linear_rows(x.bfloat16(), packed, out_features, None) is None
    assert kernels.f32_linear_rows(x[:, :64].contiguous(), packed, out_features, None) is None
    trains = weight.clone().requires_grad_(True)
    out = linear(xs, trains, None)
    out.sum().backward()
    assert trains.grad is not None  # torch's own product: the weight gets its gradient
