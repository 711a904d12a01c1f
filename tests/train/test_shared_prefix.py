"""Rows that start with the same prompt share its forward in the trainer: the adapters,
losses and statistics are the plain forward's, for every kind of tenant the trainer
keeps (ranks, targets, KL to the base, temperatures, loss normalisations)."""

from __future__ import annotations

import pytest
import torch
from test_trainer import TENANTS, _register, _rel_diff
from train_data import VOCAB, make_batch

import marlaas.train.prefix as prefix
from helpers.tiny_archs import ARCHS, WINDOW, tiny_model
from marlaas.model.lora import LoRAModel
from marlaas.train.batch import TrainBatch
from marlaas.train.decoder import RowGather
from marlaas.train.grpo import GRPOTrainer
from marlaas.train.prefix import SharedPrefix
from marlaas.train.rows import plan_microbatches, tensorise


def _data(model: LoRAModel, steps: int) -> dict[str, list[TrainBatch]]:
    """Groups of 6 samples of long prompts (what sharing pays for), tool stretches and
    all, as `make_batch` makes them."""
    out: dict[str, list[TrainBatch]] = {}
    for i, (name, (_, algo, temp, _)) in enumerate(TENANTS.items()):
        algo = algo.model_copy(update={"group_size": 6, "prompts_per_step": 2})
        out[name] = [
            make_batch(
                name,
                k,
                algo,
                seed=300 + 10 * i + k,
                model=model,
                temperature=temp,
                prompt_len=(14, 24),
                completion_len=(4, 12),
            )
            for k in range(steps)
        ]
    return out


def _train(
    model: LoRAModel, data: dict[str, list[TrainBatch]], steps: int
) -> tuple[GRPOTrainer, list[dict[str, object]]]:
    trainer = GRPOTrainer(model, max_tokens_per_microbatch=4096)
    for i, name in enumerate(TENANTS):
        _register(trainer, name, seed=i)
    results = [trainer.step([data[name][k] for name in TENANTS]) for k in range(steps)]
    return trainer, [{n: vars(r) for n, r in step.items()} for step in results]


def test_shared_prompts_train_exactly_like_the_plain_forward(
    lora_model: LoRAModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 2
    data = _data(lora_model, steps)
    shared, shared_results = _train(lora_model, data, steps)
    assert shared.stats.shared_prefix_microbatches >= steps
    monkeypatch.setattr(prefix, "MAX_COST", 0.0)  # never pays: the plain forward
    plain, plain_results = _train(lora_model, data, steps)
    assert plain.stats.shared_prefix_microbatches == 0
    for name in TENANTS:
        assert _rel_diff(shared.adapter(name), plain.adapter(name)) < 1e-5, name
    for got, want in zip(shared_results, plain_results, strict=True):
        for name in TENANTS:
            for key, value in want[name].items():
                if isinstance(value, float):
                    assert got[name][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
                else:
                    assert got[name][key] == value, key


def test_the_plan_shares_only_where_it_saves_tokens(lora_model: LoRAModel) -> None:
    name = "t-rank2"
    algo = TENANTS[name][1].model_copy(update={"group_size": 6, "prompts_per_step": 2})
    long_prompts = make_batch(name, 0, algo, seed=1, prompt_len=(14, 24))
    rows = tensorise([long_prompts], [("token", None)])
    plans = [(m, SharedPrefix.plan(rows, m)) for m in plan_microbatches(rows, 4096)]
    assert any(plan is not None for _, plan in plans)
    for micro, plan in plans:
        if plan is None:
            continue
        prompts = rows.prompt_N[micro.rows_B]
        assert int(plan.ids_GP.shape[0]) == len(set(prompts.tolist()))  # one per prompt
        # Every row's suffix starts at its prompt's last token and holds all its targets.
        lengths = rows.lengths_N[micro.rows_B]
        assert plan.start_B.tolist() == (rows.prompt_len_N[micro.rows_B] - 1).tolist()
        mask = rows.mask_NT[micro.rows_B, : micro.length]
        assert int(plan.suffix(mask).sum()) == int(mask.sum())
        ids = rows.input_ids_NT[micro.rows_B, : micro.length]
        for b in range(len(lengths)):
            start, n = int(plan.start_B[b]), int(lengths[b])
            assert plan.suffix(ids)[b, : n - start].tolist() == ids[b, start:n].tolist()
            g = plan.group_B[b]
            assert plan.ids_GP[g][plan.attn_GP[g].bool()].tolist() == ids[b, :start].tolist()
    # One sample per prompt: nothing to share.
    single = make_batch(
        name, 0, algo.model_copy(update={"group_size": 1}), seed=2, prompt_len=(14, 24)
    )
    rows = tensorise([single], [("token", None)])
    assert all(SharedPrefix.plan(rows, m) is None for m in plan_microbatches(rows, 4096))
    # Short prompts and long completions: sharing would save too little.
    short = make_batch(name, 0, algo, seed=3, prompt_len=(2, 4), completion_len=(20, 30))
    rows = tensorise([short], [("token", None)])
    assert all(SharedPrefix.plan(rows, m) is None for m in plan_microbatches(rows, 4096))
    assert torch.equal(rows.prompt_N, torch.repeat_interleave(torch.arange(2), 6))


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_sliding_windows_share_prompts_exactly(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts longer than the window (Mistral, Qwen2/3, Gemma2/3): the shared forward
    keeps every prompt token in the cache and trains like the plain forward."""
    model = LoRAModel(tiny_model(arch, VOCAB), max_rank=16)
    data = _data(model, 1)
    assert min(len(t.prompt_ids) for b in data.values() for t in b[0].trajectories) > WINDOW
    shared, _ = _train(model, data, 1)
    assert shared.stats.shared_prefix_microbatches >= 1
    monkeypatch.setattr(prefix, "MAX_COST", 0.0)
    plain, _ = _train(model, data, 1)
    for name in TENANTS:
        assert _rel_diff(shared.adapter(name), plain.adapter(name)) < 1e-5, name


def test_the_prefix_rows_gather_has_index_selects_gradient() -> None:
    """The Python layers' suffix pass reads each prefix's cache rows through `RowGather`:
    its backward
    (one `index_add_` on a contiguous copy) must be `index_select`'s, for strided and
    transposed incoming gradients, repeated and unused source rows."""
    torch.manual_seed(0)
    index = torch.tensor([0, 0, 0, 2, 2, 3, 3, 3, 3])  # row 1 unused
    x = torch.randn(4, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    for grad in (
        torch.randn(9, 2, 7, 8, dtype=torch.float64)[:, :, :5],  # a slice of a cat
        torch.randn(9, 5, 2, 8, dtype=torch.float64).transpose(1, 2),
    ):
        got = RowGather.apply(x, index)
        assert torch.equal(got, x.index_select(0, index))
        (g_got,) = torch.autograd.grad(got, x, grad)
        (g_want,) = torch.autograd.grad(x.index_select(0, index), x, grad)
        torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-12)
        assert not g_got[1].any()
