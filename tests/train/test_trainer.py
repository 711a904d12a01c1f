"""The multi-lane trainer: together == alone, the token budget, masks, KL, validation."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import Tensor
from train_data import make_batch, tiny_llama

from marlaas.config.specs import GRPOSpec, LoRASpec
from marlaas.errors import ConfigError, TenantNotFound
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.packing import MIN_FILL
from marlaas.train.advantages import group_advantages
from marlaas.train.batch import TrainBatch, TrainBatchError, batch_data
from marlaas.train.bench import paired_ratio, run_trainer_bench, tenant_lengths
from marlaas.train.grpo import GRPOTrainer
from marlaas.train.losses import policy_loss, token_logprobs
from marlaas.train.rows import Rows, plan_microbatches, tensorise

SMALL: dict[str, Any] = {"group_size": 4, "prompts_per_step": 2}

#: Tenants that differ in everything the trainer keeps per tenant.
TENANTS: dict[str, tuple[LoRASpec, GRPOSpec, float, int]] = {
    "t-rank2": (
        LoRASpec(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj")),
        GRPOSpec(**SMALL, learning_rate=3e-3, loss_norm="token"),
        1.0,
        0,
    ),
    "t-rank8-kl": (
        LoRASpec(rank=8, alpha=32.0),
        GRPOSpec(**SMALL, learning_rate=1e-3, loss_norm="sequence", kl_coef=0.5, weight_decay=0.1),
        0.7,
        0,
    ),
    "t-rank16-mlp": (
        LoRASpec(rank=16, alpha=8.0, target_modules=("gate_proj", "down_proj"), use_rslora=True),
        GRPOSpec(
            **SMALL,
            learning_rate=5e-3,
            clip_high=0.28,
            tis_cap=1.5,
            max_grad_norm=0.05,
            betas=(0.8, 0.99),
        ),
        1.0,
        2,
    ),
    "t-rank4-const": (
        LoRASpec(rank=4, alpha=8.0, target_modules=("o_proj", "up_proj", "k_proj")),
        GRPOSpec(**SMALL, learning_rate=2e-3, loss_norm="constant", scale_rewards=False),
        1.3,
        0,
    ),
}


def _register(trainer: GRPOTrainer, name: str, seed: int) -> None:
    lora, algo, temperature, warmup = TENANTS[name]
    trainer.register(
        name,
        lora,
        algo,
        seed=seed,
        temperature=temperature,
        warmup_steps=warmup,
        constant_norm_tokens=100.0 if algo.loss_norm == "constant" else None,
    )


def _data(model: LoRAModel, steps: int) -> dict[str, list[TrainBatch]]:
    return {
        name: [
            make_batch(name, k, algo, seed=100 * i + k, model=model, temperature=temp)
            for k in range(steps)
        ]
        for i, (name, (_, algo, temp, _)) in enumerate(TENANTS.items())
    }


def _rel_diff(a: AdapterTensors, b: AdapterTensors) -> float:
    assert a.keys() == b.keys()
    x = torch.cat([t.flatten() for pair in a.values() for t in pair])
    y = torch.cat([t.flatten() for pair in b.values() for t in pair])
    return float((x - y).norm() / y.norm())


def _minus(a: AdapterTensors, b: AdapterTensors) -> AdapterTensors:
    return {p: (a[p][0] - b[p][0], a[p][1] - b[p][1]) for p in a}


def test_together_equals_alone(lora_model: LoRAModel) -> None:
    steps = 3
    data = _data(lora_model, steps)
    together = GRPOTrainer(lora_model, max_tokens_per_microbatch=160)
    for i, name in enumerate(TENANTS):
        _register(together, name, seed=i)
    clipped = 0.0
    for k in range(steps):
        results = together.step([data[name][k] for name in TENANTS])
        assert {r.version for r in results.values()} == {k + 1}
        clipped += sum(r.clip_frac for r in results.values())
        assert all(r.ratio_mean != 1.0 and r.grad_norm > 0 for r in results.values())
    assert clipped > 0
    # Tenants really shared micro-batches.
    assert together.stats.max_microbatch_lanes >= 2

    for i, name in enumerate(TENANTS):
        alone = GRPOTrainer(lora_model, max_tokens_per_microbatch=4096)
        _register(alone, name, seed=i)
        for k in range(steps):
            alone.step([data[name][k]])
        init = lora_model.init_adapter(TENANTS[name][0], i)
        assert _rel_diff(together.adapter(name), init) > 1e-2  # it did train
        assert _rel_diff(together.adapter(name), alone.adapter(name)) < 1e-5, name
        # Stricter: the updates themselves (adapter - init) agree to float32 noise.
        assert (
            _rel_diff(_minus(together.adapter(name), init), _minus(alone.adapter(name), init))
            < 5e-5
        )


def test_microbatch_split_does_not_change_the_update(lora_model: LoRAModel) -> None:
    name = "t-rank8-kl"
    batch = _data(lora_model, 1)[name][0]
    adapters = []
    for budget in (24, 64, 10_000):
        trainer = GRPOTrainer(lora_model, max_tokens_per_microbatch=budget)
        _register(trainer, name, seed=0)
        trainer.step([batch])
        adapters.append(trainer.adapter(name))
    assert _rel_diff(adapters[0], adapters[2]) < 1e-5
    assert _rel_diff(adapters[1], adapters[2]) < 1e-5


@pytest.mark.parametrize("num_tenants", [1, 5, 12])
def test_token_budget_bounds_every_microbatch(lora_model: LoRAModel, num_tenants: int) -> None:
    budget = 48
    trainer = GRPOTrainer(lora_model, max_tokens_per_microbatch=budget)
    algo = GRPOSpec(group_size=2, prompts_per_step=2)
    batches = []
    for i in range(num_tenants):
        trainer.register(f"u{i}", LoRASpec(rank=2, target_modules=("q_proj",)), algo, seed=i)
        batches.append(make_batch(f"u{i}", 0, algo, seed=i))
    results = trainer.step(batches)
    assert len(results) == num_tenants
    assert 0 < trainer.stats.max_microbatch_tokens <= budget
    assert trainer.stats.microbatches >= num_tenants  # 4 rows of >= 12 tokens each
    assert trainer.stats.max_microbatch_lanes <= budget // 12


def test_microbatches_pad_at_most_a_quarter_whatever_the_mix_of_lengths() -> None:
    """Rows are packed longest first, and a row shorter than `MIN_FILL` of its
    micro-batch's length starts the next one, so long and short tenants' rows do not
    share a micro-batch padded to the longest."""
    lengths = [40, 39, 31, 30, 29, 20, 19, 10, 9, 0]
    n = len(lengths)
    rows = Rows(
        input_ids_NT=torch.zeros(n, 40, dtype=torch.long),
        target_ids_NT=torch.zeros(n, 40, dtype=torch.long),
        mask_NT=torch.zeros(n, 40),
        behaviour_NT=torch.zeros(n, 40),
        weights_NT=torch.zeros(n, 40),
        advantages_NT=torch.zeros(n, 40),
        lengths_N=torch.tensor(lengths),
        tenant_N=torch.tensor([i % 3 for i in range(n)]),
        prompt_N=torch.arange(n),
        prompt_len_N=torch.ones(n, dtype=torch.long),
    )
    plans = plan_microbatches(rows, max_tokens=4096)
    got = [sorted((lengths[int(i)] for i in p.rows_B), reverse=True) for p in plans]
    assert got == [[40, 39, 31, 30], [29], [20, 19], [10, 9]]
    for plan, members in zip(plans, got, strict=True):
        assert plan.length == members[0]
        assert min(members) >= MIN_FILL * plan.length
    assert [len(p.rows_B) for p in plan_microbatches(rows, max_tokens=80)] == [2, 2, 1, 2, 2]
    with pytest.raises(ValueError, match="exceeds the budget of 39"):
        plan_microbatches(rows, max_tokens=39)


def test_versions_adapter_copies_and_frozen_base(lora_model: LoRAModel) -> None:
    base_before = {k: v.clone() for k, v in lora_model.base.state_dict().items()}
    trainer = GRPOTrainer(lora_model)
    _register(trainer, "t-rank2", seed=0)
    _register(trainer, "t-rank8-kl", seed=1)
    assert trainer.version("t-rank2") == 0
    data = _data(lora_model, 2)
    trainer.step([data["t-rank2"][0]])
    assert (trainer.version("t-rank2"), trainer.version("t-rank8-kl")) == (1, 0)
    copy = trainer.adapter("t-rank2")
    A, _ = next(iter(copy.values()))
    assert not A.requires_grad and A.device.type == "cpu"
    A.add_(1.0)  # a copy: the trainer's adapter does not move
    assert _rel_diff(trainer.adapter("t-rank2"), copy) > 0
    trainer.step([data["t-rank2"][1], data["t-rank8-kl"][0]])
    assert (trainer.version("t-rank2"), trainer.version("t-rank8-kl")) == (2, 1)
    for key, value in lora_model.base.state_dict().items():
        assert torch.equal(value, base_before[key]), key
    assert not any(p.requires_grad for p in lora_model.base.parameters())
    trainer.remove("t-rank2")
    with pytest.raises(TenantNotFound):
        trainer.version("t-rank2")


def test_masked_tokens_carry_no_gradient(lora_model: LoRAModel) -> None:
    """Behaviour log-probs on unmasked-out positions and tokens after the last model
    token (a trailing tool output) do not change the update."""
    name = "t-rank2"
    algo = TENANTS[name][1]
    batch = make_batch(name, 0, algo, seed=7, model=lora_model)
    trajs = []
    for t in batch.trajectories:
        mask = (*t.loss_mask_T, 0, 0, 0)
        lps = tuple(lp if m else 123.0 for lp, m in zip(t.logprobs_T, t.loss_mask_T, strict=True))
        trajs.append(
            replace(
                t, token_ids=(*t.token_ids, 9, 9, 9), loss_mask_T=mask, logprobs_T=(*lps, 7, 7, 7)
            )
        )
    edited = replace(batch, trajectories=tuple(trajs))
    adapters = []
    for b in (batch, edited):
        trainer = GRPOTrainer(lora_model)
        _register(trainer, name, seed=0)
        trainer.step([b])
        adapters.append(trainer.adapter(name))
    assert _rel_diff(adapters[1], adapters[0]) < 1e-6


def test_on_policy_at_the_tenant_temperature(lora_model: LoRAModel) -> None:
    """Behaviour log-probs recorded at the tenant's temperature give ratio 1 exactly."""
    algo = GRPOSpec(**SMALL)
    trainer = GRPOTrainer(lora_model)
    trainer.register("hot", LoRASpec(rank=4), algo, temperature=1.7)
    batch = make_batch("hot", 0, algo, seed=3, model=lora_model, temperature=1.7, noise=0.0)
    result = trainer.step([batch])["hot"]
    assert result.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert result.clip_frac == 0.0
    assert abs(result.kl_behaviour) < 1e-6
    assert result.entropy > 0


def test_kl_to_base_uses_the_plain_base(lora_model: LoRAModel) -> None:
    """With flat rewards (zero advantages) only the KL term moves the adapter, and the
    reported KL equals k3 between the adapter's and the base's log-probs."""
    lora = LoRASpec(rank=4, target_modules=("q_proj", "down_proj"))
    algo = GRPOSpec(**SMALL, kl_coef=1.0, kl_estimator="k3")
    g = torch.Generator().manual_seed(0)
    tensors = {
        p: (A, torch.randn(B.shape, generator=g) * 0.3)
        for p, (A, B) in lora_model.init_adapter(lora, 0).items()
    }
    batch = make_batch("kl", 0, algo, seed=5, model=lora_model)
    flat = tuple(replace(t, reward=1.0) for t in batch.trajectories)
    batch = TrainBatch.from_groups("kl", 0, [flat[:4], flat[4:]], scale_rewards=True)
    assert set(batch.advantages) == {0.0}

    trainer = GRPOTrainer(lora_model)
    trainer.register("kl", lora, algo, tensors=tensors)
    result = trainer.step([batch])["kl"]
    assert result.grad_norm > 0 and result.kl_base is not None

    # Independent computation, one row at a time.
    num, den = 0.0, 0
    for t in batch.trajectories:
        full = torch.tensor([*t.prompt_ids, *t.token_ids])[None]
        mask = torch.tensor([0] * (len(t.prompt_ids) - 1) + list(t.loss_mask_T)).bool()
        lane = lora_model.lane_batch([(lora, tensors)], torch.zeros(1, dtype=torch.long))
        with torch.no_grad():
            base_lp = token_logprobs(lora_model.base(input_ids=full[:, :-1]).logits, full[:, 1:])
            with lora_model.lanes(lane):
                pol_lp = token_logprobs(lora_model.base(input_ids=full[:, :-1]).logits, full[:, 1:])
        log_r = (base_lp - pol_lp)[0][mask]
        num += float((torch.expm1(log_r) - log_r).sum())
        den += int(mask.sum())
    assert result.kl_base == pytest.approx(num / den, rel=1e-4)
    assert result.kl_base > 0


def test_metrics_from_the_batch(lora_model: LoRAModel) -> None:
    algo = GRPOSpec(**SMALL, max_staleness=2)
    trainer = GRPOTrainer(lora_model)
    trainer.register("m", LoRASpec(rank=2), algo)
    trainer.step([make_batch("m", 0, algo, seed=1)])
    batch = make_batch("m", 1, algo, seed=2, staleness=1)
    result = trainer.step([batch])["m"]
    assert (result.staleness_max, result.staleness_mean, result.version) == (1, 1.0, 2)
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)
    assert result.reward_mean == pytest.approx(float(rewards.mean()))
    assert result.reward_std == pytest.approx(float(rewards.std(unbiased=False)))
    assert result.advantage_mean == pytest.approx(0.0, abs=1e-6)
    assert result.tokens == sum(sum(t.loss_mask_T) for t in batch.trajectories)
    assert result.rows == algo.samples_per_step and result.lr == algo.learning_rate


def test_train_batch_advantages_and_staleness() -> None:
    algo = GRPOSpec(**SMALL)
    batch = make_batch("x", 3, algo, seed=0, staleness=2)
    rewards = torch.tensor(batch.rewards, dtype=torch.float64).view(2, 4)
    expected = group_advantages(rewards, scale=True).flatten()
    assert torch.allclose(torch.tensor(batch.advantages, dtype=torch.float64), expected)
    assert batch.staleness() == (2,) * 8 and batch.max_staleness == 2
    ragged = TrainBatch.from_groups(
        "x", 3, [batch.trajectories[:4], batch.trajectories[4:7]], scale_rewards=False
    )
    assert len(ragged.advantages) == 7
    with pytest.raises(TrainBatchError):
        TrainBatch("y", 0, batch.trajectories, batch.advantages)  # wrong tenant


def test_a_bad_batch_changes_nothing(lora_model: LoRAModel) -> None:
    algo = GRPOSpec(**SMALL, max_staleness=0)
    trainer = GRPOTrainer(lora_model, max_tokens_per_microbatch=64)
    trainer.register("good", LoRASpec(rank=2), algo, seed=0)
    trainer.register("bad", LoRASpec(rank=2), algo, seed=1)
    trainer.step([make_batch("bad", 0, algo, seed=1)])
    before = trainer.adapter("good")
    good = make_batch("good", 0, algo, seed=0)
    t0 = make_batch("bad", 1, algo, seed=1).trajectories[0]
    cases = {
        "wrong step": make_batch("bad", 2, algo, seed=1),
        "too stale": make_batch("bad", 1, algo, seed=1, staleness=1),
        "bad token": TrainBatch("bad", 1, (replace(t0, prompt_ids=(5, 10_000)),), (1.0,)),
        "too long": TrainBatch(
            "bad",
            1,
            (replace(t0, token_ids=(5,) * 80, loss_mask_T=(1,) * 80, logprobs_T=(-1.0,) * 80),),
            (1.0,),
        ),
        "nan logprob": TrainBatch(
            "bad", 1, (replace(t0, logprobs_T=(float("nan"),) * len(t0.token_ids)),), (1.0,)
        ),
    }
    for case, bad in cases.items():
        with pytest.raises(TrainBatchError) as info:
            trainer.step([good, bad])
        assert info.value.tenant == "bad", case
    with pytest.raises(ConfigError):
        trainer.step([good, good])
    assert (trainer.version("good"), trainer.version("bad")) == (0, 1)
    assert _rel_diff(trainer.adapter("good"), before) == 0.0
    assert trainer.step([good])["good"].version == 1


def test_one_tenant_matches_peft_and_torch_adamw(lora_model: LoRAModel) -> None:
    """An independent reference: PEFT's LoRA layers, the same loss, torch's AdamW and
    clip_grad_norm_, one tenant, three steps."""
    from peft import LoraConfig, get_peft_model

    lora, algo, _, _ = TENANTS["t-rank2"]
    algo = algo.model_copy(update={"weight_decay": 0.05, "max_grad_norm": 0.1})
    batches = _data(lora_model, 3)["t-rank2"]
    trainer = GRPOTrainer(lora_model, max_tokens_per_microbatch=64)
    trainer.register("t-rank2", lora, algo, seed=0)
    for batch in batches:
        trainer.step([batch])

    peft_model = get_peft_model(
        tiny_llama(),
        LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules)),
    )
    init = lora_model.init_adapter(lora, 0)
    params = []
    for path, (A, B) in init.items():
        module = peft_model.base_model.model.get_submodule(path)
        with torch.no_grad():
            module.lora_A["default"].weight.copy_(A)
            module.lora_B["default"].weight.copy_(B)
        params += [module.lora_A["default"].weight, module.lora_B["default"].weight]
    opt = torch.optim.AdamW(params, lr=algo.learning_rate, weight_decay=algo.weight_decay)
    for batch in batches:
        rows = tensorise([batch], [(algo.loss_norm, None)])
        logits = peft_model(input_ids=rows.input_ids_NT).logits
        loss, _ = policy_loss(
            token_logprobs(logits, rows.target_ids_NT),
            rows.behaviour_NT,
            rows.advantages_NT,
            rows.mask_NT,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            weights_BT=rows.weights_NT,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, algo.max_grad_norm)
        opt.step()
        opt.zero_grad()
    reference = {
        path: (
            peft_model.base_model.model.get_submodule(path).lora_A["default"].weight.detach(),
            peft_model.base_model.model.get_submodule(path).lora_B["default"].weight.detach(),
        )
        for path in init
    }
    ours = trainer.adapter("t-rank2")
    assert _rel_diff(_minus(ours, init), _minus(reference, init)) < 1e-5
    assert _rel_diff(ours, reference) < 1e-5


def _small_bench(path: Path, **options: Any) -> dict[str, Any]:
    """`run_trainer_bench` on tiny GRPO groups (2 rows of 4 prompt and up to 6 completion
    tokens), its table printed nowhere."""
    return run_trainer_bench(
        path,
        rows_per_tenant=2,
        prompt_len=4,
        completion_len=6,
        console=Console(file=io.StringIO()),
        **options,
    )


def test_benchmark_reports_every_mode(tiny_llama_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = _small_bench(tiny_llama_path, tenant_counts=(1, 3), steps=1, json_path=out)
    assert json.loads(out.read_text()) == result
    assert [(r["tenants"], r["mode"]) for r in result["results"]] == [
        (n, mode) for n in (1, 3) for mode in ("multi-lane", "single-lane", "peft")
    ]
    assert all(r["optimizer_steps_per_s"] > 0 and r["tokens_per_s"] > 0 for r in result["results"])
    assert set(result["speedup"]["3"]) == {
        "multi_vs_single",
        "multi_vs_single_paired",
        "multi_vs_peft",
    }


def test_a_batch_without_model_tokens_still_counts_as_a_step(lora_model: LoRAModel) -> None:
    """All-observation trajectories carry no gradient but the step (and version) happen."""
    algo = GRPOSpec(**SMALL)
    trainer = GRPOTrainer(lora_model)
    trainer.register("empty", LoRASpec(rank=2), algo)
    trainer.register("full", LoRASpec(rank=2), algo, seed=1)
    batch = make_batch("empty", 0, algo, seed=4)
    empty = replace(
        batch,
        trajectories=tuple(
            replace(t, loss_mask_T=(0,) * len(t.token_ids), logprobs_T=(0.0,) * len(t.token_ids))
            for t in batch.trajectories
        ),
    )
    before = trainer.adapter("empty")
    results = trainer.step([empty, make_batch("full", 0, algo, seed=5)])
    assert (results["empty"].tokens, results["empty"].grad_norm) == (0, 0.0)
    assert results["empty"].version == 1 and results["full"].tokens > 0
    assert _rel_diff(trainer.adapter("empty"), before) == 0.0  # zero gradient, no decay


def test_benchmark_with_mixed_lengths_gives_tenants_different_lengths(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    assert [tenant_lengths(i, 8, 6) for i in range(4)] == [(4, 3), (8, 6), (12, 9), (16, 3)]
    result = _small_bench(
        tiny_llama_path,
        tenant_counts=(3,),
        steps=1,
        mixed_lengths=True,
        max_tokens_per_microbatch=64,
        modes=("multi-lane", "single-lane"),
    )
    assert result["config"]["mixed_lengths"] is True
    assert result["config"]["max_tokens_per_microbatch"] == 64
    assert set(result["speedup"]["3"]) == {"multi_vs_single", "multi_vs_single_paired"}


def test_benchmark_pairs_the_rounds_of_the_modes_that_take_turns(
    tiny_llama_path: Path,
) -> None:
    """Multi-lane's paired speed-up is the median of each round's single-lane time over
    the multi-lane round beside it, from the rounds the result reports; unequal rounds
    are refused."""
    result = _small_bench(
        tiny_llama_path, tenant_counts=(2,), steps=3, modes=("multi-lane", "single-lane")
    )
    rounds = {r["mode"]: r["round_seconds"] for r in result["results"]}
    assert len(rounds["multi-lane"]) == len(rounds["single-lane"]) == 3
    ratios = sorted(s / m for s, m in zip(rounds["single-lane"], rounds["multi-lane"], strict=True))
    assert result["speedup"]["2"]["multi_vs_single_paired"] == pytest.approx(ratios[1])
    assert paired_ratio([2.0, 4.0, 9.0], [1.0, 4.0, 3.0]) == 2.0  # the medians' ratio: 4 / 3
    with pytest.raises(ValueError, match="as many rounds"):
        paired_ratio([1.0, 2.0], [1.0])


def _uniform_groups(
    batch: TrainBatch, groups: set[int], copies: set[int], group_size: int
) -> TrainBatch:
    """`batch` with every sample of `groups` rewarded alike (advantage 0 there), and the
    samples numbered in `copies` replaced by the sample before them (same tokens,
    log-probs and reward)."""
    trajs = list(batch.trajectories)
    for i in sorted(copies):
        trajs[i] = trajs[i - 1]
    trajs = [
        replace(t, reward=1.0) if i // group_size in groups else t for i, t in enumerate(trajs)
    ]
    chunks = [trajs[i : i + group_size] for i in range(0, len(trajs), group_size)]
    return TrainBatch.from_groups(batch.tenant, batch.step, chunks, scale_rewards=True)


def _gradient(model: LoRAModel, name: str, seed: int, batch: TrainBatch, every: bool) -> Tensor:
    """The tenant's gradient after `forward_backward` of `batch`: the rows
    `GRPOTraining.train_input` runs, or `every` row (its objective and weights)."""
    trainer = GRPOTrainer(model)
    _register(trainer, name, seed)
    training = trainer.training(name)
    train_input = training.train_input(batch)
    if every:
        data = batch_data(batch, training.algo.loss_norm, training.constant_norm_tokens)
        train_input = replace(train_input, data=data)
    trainer.trainer.forward_backward([train_input])
    grad = trainer.trainer._get(name).flat_P.grad
    assert grad is not None
    return grad


@pytest.mark.parametrize(
    ("name", "uniform", "copies", "run"),
    [
        ("t-rank2", {0}, set(), 4),  # one group of two has advantage 0: its rows don't run
        ("t-rank2", {0}, {5, 7}, 2),  # and two rows of the other are copies: one of each runs
        ("t-rank16-mlp", {0, 1}, set(), 1),  # no row carries a gradient: one runs (sums)
        ("t-rank8-kl", {0}, set(), 8),  # a KL term has a gradient at advantage 0: all run
        ("t-rank8-kl", set(), {2, 3}, 6),  # copies of one row run once, KL or not
    ],
)
def test_rows_without_a_gradient_of_their_own_are_not_run_and_change_nothing(
    lora_model: LoRAModel, name: str, uniform: set[int], copies: set[int], run: int
) -> None:
    """Rows of advantage 0 (without a KL term) and copies of another row are not run;
    the gradient is the one of every row run (`GRPOTraining.carried`)."""
    _, algo, temperature, _ = TENANTS[name]
    batch = make_batch(name, 0, algo, seed=7, model=lora_model, temperature=temperature)
    batch = _uniform_groups(batch, uniform, copies, algo.group_size)
    zero = sum(1 for a in batch.advantages if a == 0)
    assert zero == algo.group_size * len(uniform)
    trainer = GRPOTrainer(lora_model)
    _register(trainer, name, seed=3)
    result = trainer.step([batch])[name]
    assert trainer.stats.rows == run
    assert (result.rows, result.rows_trained) == (len(batch.trajectories), run)
    assert result.tokens == sum(sum(t.loss_mask_T) for t in batch.trajectories)
    got = _gradient(lora_model, name, 3, batch, every=False)
    want = _gradient(lora_model, name, 3, batch, every=True)
    if run > 1:
        assert float(want.norm()) > 0
        assert float((got - want).norm() / want.norm()) < 1e-5
    else:  # nothing carries a gradient
        assert float(want.abs().max()) == float(got.abs().max()) == 0.0
