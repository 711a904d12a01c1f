"""Multi-LoRA layers: per-row adapters in one batched forward, exact against the math,
and the frozen base is never written."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from marlaas.config.specs import LoRASpec
from marlaas.errors import ConfigError, ModelError
from marlaas.model.base import default_base_path, load_base
from marlaas.model.lane_layers import LaneBatch, LaneContext, MultiLoRALinear
from marlaas.model.lora import AdapterTensors, LoRAModel

MakeAdapter = Callable[[LoRAModel, LoRASpec, int], AdapterTensors]

SPEC_X = LoRASpec(rank=4, alpha=8.0)
SPEC_Y = LoRASpec(rank=2, alpha=3.0, target_modules=("q_proj", "v_proj", "down_proj"))
SPEC_Z = LoRASpec(rank=8, alpha=4.0, target_modules=("o_proj", "up_proj"), use_rslora=True)


def _ids(rows: int, seq: int = 7, seed: int = 0) -> Tensor:
    return torch.randint(4, 128, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model: LoRAModel, ids: Tensor, batch: LaneBatch | None = None) -> Tensor:
    with torch.no_grad():
        if batch is None:
            return model.base(input_ids=ids).logits
        with model.lanes(batch):
            return model.base(input_ids=ids).logits


def test_load_base_freezes_and_names_bad_paths(tiny_llama_dir: Path, tmp_path: Path) -> None:
    base, tokenizer = load_base(tiny_llama_dir)
    assert not base.training
    assert all(not p.requires_grad for p in base.parameters())
    assert max(tokenizer("abc").input_ids) < 128
    with pytest.raises(ModelError, match="does not exist"):
        load_base(tmp_path / "nowhere")
    with pytest.raises(ModelError, match=r"config\.json"):
        load_base(tmp_path)
    assert default_base_path().name == "embedded"


def test_no_lanes_is_the_plain_base(tiny_dir: Path) -> None:
    reference, _ = load_base(tiny_dir)
    base, _ = load_base(tiny_dir)
    model = LoRAModel(base, max_rank=8)
    assert isinstance(base.get_submodule("model.layers.1.mlp.down_proj"), MultiLoRALinear)
    assert len(model.module_shapes) == 2 * 7
    ids = _ids(2)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    assert torch.equal(_logits(model, ids), expected)
    # A lane batch whose only lane is the base (scale 0, zeros) is exact too.
    plain = model.lane_batch([None], torch.zeros(2, dtype=torch.long))
    assert torch.equal(_logits(model, ids, plain), expected)


def test_layer_matches_the_lora_formula() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 5)
    context = LaneContext()
    layer = MultiLoRALinear(linear, "m", context)
    A_Lri, B_Lor, scale_L = torch.randn(3, 2, 6), torch.randn(3, 5, 2), torch.tensor([0.0, 2, 0.5])
    lane_B = torch.tensor([2, 0, 1, 2])
    context.batch = LaneBatch(lane_B, {"m": A_Lri}, {"m": B_Lor}, scale_L)
    context.scale_B = scale_L[lane_B]
    context.owner = threading.get_ident()
    for x in (torch.randn(4, 6), torch.randn(4, 3, 6)):
        got = layer(x)
        for b, lane in enumerate(lane_B.tolist()):
            delta = scale_L[lane] * (x[b] @ A_Lri[lane].T) @ B_Lor[lane].T
            torch.testing.assert_close(got[b], linear(x[b]) + delta, rtol=1e-6, atol=1e-6)
    packed = torch.randn(1, 4, 6)  # one lane per token
    got = layer(packed)[0]
    for t, lane in enumerate(lane_B.tolist()):
        delta = scale_L[lane] * (packed[0, t] @ A_Lri[lane].T) @ B_Lor[lane].T
        torch.testing.assert_close(got[t], linear(packed[0, t]) + delta, rtol=1e-6, atol=1e-6)
    with pytest.raises(ModelError, match="one lane per row"):
        layer(torch.randn(3, 6))


@pytest.mark.parametrize(
    ("lanes", "size", "gather"),
    [
        ([2, 0, 1, 2, 1, 1], 1, True),  # no common run length: one block per row
        ([0, 0, 1, 1, 2, 2], 2, False),  # block k is lane k: no weight gather
        ([0, 1, 2], 1, False),
        ([0, 0, 1, 1, 2, 2, 2, 2], 2, True),  # lane 2 spans two blocks
        ([2, 2, 2, 0, 0, 0], 3, True),  # grouped, lanes out of order
        ([1, 1, 1, 1, 0, 0, 1, 1], 2, True),  # a lane in two runs, lane 2 absent
        ([1, 1, 1, 1], 4, True),
    ],
)
def test_row_blocks_match_the_formula_with_gradients(
    lanes: list[int], size: int, gather: bool
) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 5).requires_grad_(False)
    context = LaneContext()
    layer = MultiLoRALinear(linear, "m", context)
    A_Lri = torch.randn(3, 2, 6, requires_grad=True)
    B_Lor = torch.randn(3, 5, 2, requires_grad=True)
    scale_L = torch.tensor([0.0, 2.0, 0.5])
    lane_B = torch.tensor(lanes)
    context.batch = LaneBatch(lane_B, {"m": A_Lri}, {"m": B_Lor}, scale_L)
    context.scale_B = scale_L[lane_B]
    context.owner = threading.get_ident()
    x = torch.randn(len(lanes), 3, 6, requires_grad=True)
    got = layer(x)
    plan = context.plan
    assert plan is not None and plan.size == size and (plan.lane_K is not None) == gather
    expected = torch.stack(
        [
            linear(x[b]) + scale_L[lane] * (x[b] @ A_Lri[lane].T) @ B_Lor[lane].T
            for b, lane in enumerate(lanes)
        ]
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, (x, A_Lri, B_Lor), g)
    want = torch.autograd.grad(expected, (x, A_Lri, B_Lor), g)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    absent = sorted(set(range(3)) - set(lanes))
    assert all(not grads[1][lane].any() and not grads[2][lane].any() for lane in absent)
    # float32 adapters on a bfloat16 base: the update is added in the base's dtype.
    context.plan = None
    layer16 = MultiLoRALinear(torch.nn.Linear(6, 5).to(torch.bfloat16), "m", context)
    y16 = layer16(x.detach().to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    ref16 = layer16.base_layer(x.detach().to(torch.bfloat16)).float() + (expected - linear(x))
    torch.testing.assert_close(y16.float(), ref16, rtol=0.02, atol=0.05)


@pytest.mark.parametrize(
    ("lanes", "num_lanes", "pieces", "gathers_weights"),
    [
        ([2, 0, 1, 2, 1, 1, 0, 2], 3, 3, False),  # every lane, in order: no weight gather
        ([5, 1, 5, 1, 5, 5, 1, 5], 40, 2, True),  # few of many lanes: pieces of those
        ([3, 1, 3, 3, 3, 3, 3, 3, 3, 2], 40, 4, True),  # a crowded lane: two pieces of 4
    ],
)
def test_interleaved_decode_rows_run_as_segments(
    lanes: list[int], num_lanes: int, pieces: int, gathers_weights: bool
) -> None:
    """One token per row, no two neighbours on one lane (a decode batch): the rows are
    regrouped by lane, and every row gets exactly its lane's update, gradients too."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 5).requires_grad_(False)
    context = LaneContext()
    q_layer = MultiLoRALinear(linear, "q", context)
    k_layer = MultiLoRALinear(torch.nn.Linear(6, 5).requires_grad_(False), "k", context)
    A = {m: torch.randn(num_lanes, 4, 6, requires_grad=True) for m in "qk"}
    B = {m: torch.randn(num_lanes, 5, 4, requires_grad=True) for m in "qk"}
    scale_L = torch.rand(num_lanes) + 0.5
    lane_B = torch.tensor(lanes)
    context.batch = LaneBatch(lane_B, A, B, scale_L)
    context.scale_B = scale_L[lane_B]
    context.owner = threading.get_ident()
    x = torch.randn(len(lanes), 1, 6, requires_grad=True)
    got = torch.stack([q_layer(x), k_layer(x)])  # one input for two modules: one gather
    plan = context.plan
    assert plan is not None and plan.segments is not None
    assert plan.segments.pieces == pieces and (plan.lane_K is not None) == gathers_weights
    layers = {"q": q_layer, "k": k_layer}
    expected = torch.stack(
        [
            torch.stack(
                [
                    layers[m].base_layer(x[b])
                    + scale_L[lane] * (x[b] @ A[m][lane].T) @ B[m][lane].T
                    for b, lane in enumerate(lanes)
                ]
            )
            for m in "qk"
        ]
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    g = torch.randn_like(got)
    params = (x, A["q"], B["q"], A["k"], B["k"])
    for a, b in zip(
        torch.autograd.grad(got, params, g), torch.autograd.grad(expected, params, g), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mixed_batch_equals_each_row_alone(tiny_dir: Path, make_adapter: MakeAdapter) -> None:
    base, _ = load_base(tiny_dir)
    model = LoRAModel(base, max_rank=8)
    adapters = [
        (spec, make_adapter(model, spec, i)) for i, spec in enumerate([SPEC_X, SPEC_Y, SPEC_Z])
    ]
    ids = _ids(4)
    lanes: list[tuple[LoRASpec, AdapterTensors] | None] = [*adapters, None]
    mixed = _logits(model, ids, model.lane_batch(lanes, torch.tensor([0, 1, 2, 3])))
    plain = _logits(model, ids)
    for row, adapter in enumerate(lanes):
        one = model.lane_batch([adapter], torch.zeros(1, dtype=torch.long))
        alone = _logits(model, ids[row : row + 1], one)
        assert (mixed[row] - alone[0]).abs().max() < 1e-5
        if adapter is None:
            assert (mixed[row] - plain[row]).abs().max() < 1e-6
        else:  # the adapter really changes the output
            assert (mixed[row] - plain[row]).abs().max() > 1e-3


def test_training_reaches_only_the_batch_adapters(
    tiny_llama_dir: Path, make_adapter: MakeAdapter
) -> None:
    base, _ = load_base(tiny_llama_dir)
    model = LoRAModel(base, max_rank=8)
    before = {name: p.detach().clone() for name, p in base.named_parameters()}
    leaves = {}
    for name, spec, seed in (("x", SPEC_X, 0), ("y", SPEC_Y, 1), ("z", SPEC_Z, 2)):
        tensors = {
            p: (A.requires_grad_(), B.requires_grad_())
            for p, (A, B) in make_adapter(model, spec, seed).items()
        }
        leaves[name] = (spec, tensors)
    ids = _ids(3)

    def loss_of(rows: slice, lanes: list[str], lane_B: list[int]) -> Tensor:
        batch = model.lane_batch([leaves[n] for n in lanes], torch.tensor(lane_B))
        with model.lanes(batch):
            logits = base(input_ids=ids[rows]).logits
        return logits.logsumexp(-1).sum()  # backward runs after the context exits

    _logits(model, ids, model.lane_batch([leaves["x"]], torch.zeros(3, dtype=torch.long)))
    loss_of(slice(0, 3), ["x", "y"], [0, 1, 0]).backward()
    assert all(A.grad is None and B.grad is None for A, B in leaves["z"][1].values())
    assert all(A.grad is not None and B.grad is not None for A, B in leaves["x"][1].values())
    assert all(B.grad is not None and B.grad.abs().sum() > 0 for _, B in leaves["y"][1].values())
    for name, p in base.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None and not p.requires_grad

    # Multi-lane gradients equal those of each tenant's rows alone.
    grad_y = {p: B.grad.clone() for p, (_, B) in leaves["y"][1].items() if B.grad is not None}
    for _, B in leaves["y"][1].values():
        B.grad = None
    loss_of(slice(1, 2), ["y"], [0]).backward()
    for path, (_, B) in leaves["y"][1].items():
        assert B.grad is not None
        torch.testing.assert_close(B.grad, grad_y[path], rtol=1e-4, atol=1e-5)


def test_specs_and_injection_are_checked(tiny_llama_dir: Path) -> None:
    base, _ = load_base(tiny_llama_dir)
    with pytest.raises(ConfigError, match=r"'qkv' matches no linear layer.*'down_proj'"):
        LoRAModel(base, max_rank=4, target_modules=("q_proj", "qkv"))
    model = LoRAModel(base, max_rank=4, target_modules=("q_proj", "v_proj"))
    with pytest.raises(ModelError, match="already has multi-LoRA"):
        LoRAModel(base, max_rank=4)
    with pytest.raises(ModelError, match="max_rank 4"):
        model.init_adapter(LoRASpec(rank=8, target_modules=("q_proj",)), 0)
    with pytest.raises(ConfigError, match="'o_proj' was not injected"):
        model.init_adapter(LoRASpec(rank=2, target_modules=("q_proj", "o_proj")), 0)
    spec = LoRASpec(rank=2, target_modules=("v_proj",))
    tensors = model.init_adapter(spec, 0)
    path = next(iter(tensors))
    tensors[path] = (tensors[path][0][:1], tensors[path][1])
    with pytest.raises(ModelError, match="expected A"):
        model.lane_batch([(spec, tensors)], torch.zeros(1, dtype=torch.long))
    bad = LaneBatch(torch.tensor([3]), {}, {}, torch.zeros(2))
    with pytest.raises(ModelError, match="outside"):
        model.lanes(bad).__enter__()


def test_init_adapter_is_peft_default_and_seeded(tiny_llama_dir: Path) -> None:
    base, _ = load_base(tiny_llama_dir)
    model = LoRAModel(base, max_rank=8)
    first, again = model.init_adapter(SPEC_Y, 3), model.init_adapter(SPEC_Y, 3)
    assert len(first) == 2 * 3
    for path, (A, B) in first.items():
        fan_in, fan_out = model.module_shapes[path]
        assert A.shape == (2, fan_in) and B.shape == (fan_out, 2)
        assert torch.equal(A, again[path][0]) and not B.any()
        assert A.abs().max() <= fan_in**-0.5 and A.std() > 0.2 * fan_in**-0.5
    assert not torch.equal(
        next(iter(first.values()))[0], next(iter(model.init_adapter(SPEC_Y, 4).values()))[0]
    )


def test_lanes_are_private_to_the_thread(tiny_llama_dir: Path, make_adapter: MakeAdapter) -> None:
    base, _ = load_base(tiny_llama_dir)
    model = LoRAModel(base, max_rank=8)
    ids = _ids(1)
    plain = _logits(model, ids)
    batch = model.lane_batch(
        [(SPEC_X, make_adapter(model, SPEC_X, 0))], torch.zeros(1, dtype=torch.long)
    )
    seen: list[Tensor] = []
    with model.lanes(batch):
        worker = threading.Thread(target=lambda: seen.append(_logits(model, ids)))
        worker.start()
        worker.join()
        with pytest.raises(ModelError, match="do not nest"), model.lanes(batch):
            pass
    assert torch.equal(seen[0], plain)


def test_flattened_token_inputs_keep_each_rows_lane() -> None:
    """`[B * T, in]` inputs (OPT's MLP, Qwen2-MoE's shared expert) get each row's lane,
    as `[B, T, in]` does; a count that fits no row layout is refused."""
    torch.manual_seed(0)
    context = LaneContext()
    layer = MultiLoRALinear(torch.nn.Linear(6, 5), "m", context)
    A_Lri, B_Lor, scale_L = torch.randn(2, 2, 6), torch.randn(2, 5, 2), torch.tensor([1.0, 0.5])
    lane_B = torch.tensor([1, 0, 1])
    context.batch = LaneBatch(lane_B, {"m": A_Lri}, {"m": B_Lor}, scale_L)
    context.scale_B = scale_L[lane_B]
    context.owner = threading.get_ident()
    x_BTi = torch.randn(3, 4, 6)
    with torch.no_grad():
        y_BTo = layer(x_BTi)
        flat = layer(x_BTi.reshape(12, 6))
        expected = layer.base_layer(x_BTi) + scale_L[lane_B, None, None] * (
            x_BTi @ A_Lri[lane_B].transpose(1, 2) @ B_Lor[lane_B].transpose(1, 2)
        )
        torch.testing.assert_close(y_BTo, expected)
        torch.testing.assert_close(flat, expected.reshape(12, 5))
        with pytest.raises(ModelError, match="does not match a lane batch of 3"):
            layer(torch.randn(10, 6))
