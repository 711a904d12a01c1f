"""The trainer's primitives: forward_backward accumulates per tenant until optim_step, any
objective of the registry per tenant in one pass, forward without gradient, snapshots."""

from __future__ import annotations

import pytest
import torch
from test_trainer import TENANTS, _rel_diff
from torch import Tensor
from train_data import make_batch

from marlaas.config.specs import LoRASpec
from marlaas.errors import ConfigError, TenantNotFound
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.train.batch import TrainBatchError
from marlaas.train.decoder import Packed
from marlaas.train.grpo import GRPOTraining
from marlaas.train.losses import token_logprobs
from marlaas.train.objectives import CrossEntropy, PolicyGradient, make_objective
from marlaas.train.optim import AdamParams
from marlaas.train.records import TrainInput
from marlaas.train.trainer import MultiLaneTrainer
from marlaas.types import Datum


def _grpo(name: str, model: LoRAModel, seed: int = 0) -> tuple[GRPOTraining, TrainInput]:
    _, algo, temperature, warmup = TENANTS[name]
    const = 100.0 if algo.loss_norm == "constant" else None
    training = GRPOTraining(algo, temperature, warmup, const)
    batch = make_batch(name, 0, algo, seed=seed, model=model, temperature=temperature)
    return training, training.train_input(batch)


def _trainer(model: LoRAModel, *names: str, budget: int = 4096) -> MultiLaneTrainer:
    trainer = MultiLaneTrainer(model, max_tokens_per_microbatch=budget)
    for i, name in enumerate(names):
        trainer.add(name, TENANTS[name][0], seed=i)
    return trainer


def _chunks(inp: TrainInput, cut: int) -> tuple[TrainInput, TrainInput]:
    return (
        TrainInput(inp.tenant, inp.data[:cut], inp.loss, inp.temperature, inp.version),
        TrainInput(inp.tenant, inp.data[cut:], inp.loss, inp.temperature, inp.version),
    )


def test_a_batch_in_two_forward_backward_chunks_gives_the_adapter_of_one_call(
    lora_model: LoRAModel,
) -> None:
    names = ("t-rank8-kl", "t-rank4-const")  # KL to the base, sequence and constant norms
    inputs = {n: _grpo(n, lora_model, seed=i) for i, n in enumerate(names)}
    one = _trainer(lora_model, *names)
    whole = one.forward_backward([inp for _, inp in inputs.values()])
    one.optim_step([(n, t.adam) for n, (t, _) in inputs.items()])

    two = _trainer(lora_model, *names)
    first = [_chunks(inp, 3)[0] for _, inp in inputs.values()]
    second = [_chunks(inp, 3)[1] for _, inp in inputs.values()]
    out1 = two.forward_backward(first)
    out2 = two.forward_backward(second)
    assert {two.version(n) for n in names} == {0}  # nothing applied before optim_step
    steps = two.optim_step([(n, t.adam) for n, (t, _) in inputs.items()])
    assert {s.version for s in steps.values()} == {1}
    for n in names:
        assert _rel_diff(two.adapter(n), one.adapter(n)) < 1e-5, n
        for key in whole[n].sums:  # sums add up across calls
            assert out1[n].sums[key] + out2[n].sums[key] == pytest.approx(
                whole[n].sums[key], rel=1e-4, abs=1e-6
            ), key
    assert "kl_base" in whole["t-rank8-kl"].sums


@pytest.mark.parametrize("pack", [True, False])
def test_each_tenant_has_its_own_objective_in_one_pass(
    lora_model: LoRAModel, pack: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cross-entropy tenant and a policy-gradient tenant share a pass; the
    cross-entropy loss is -sum(w * log p) of a plain forward under its adapter, and
    the metrics are those of its logits, with the rows' tokens packed or not."""
    monkeypatch.setattr(Packed, "MIN_PADDING", 0.0 if pack else 1.0)
    _, rl = _grpo("t-rank2", lora_model)
    g = torch.Generator().manual_seed(4)
    data = []
    for n in (14, 16, 18):
        ids = torch.randint(4, 128, (n + 1,), generator=g).tolist()
        w = torch.rand(n, generator=g).tolist()
        w[0] = 0.0  # a prompt position
        data.append(Datum(tuple(ids[:-1]), tuple(ids[1:]), tuple(w)))
    sft = TrainInput("sft", tuple(data), CrossEntropy())
    trainer = _trainer(lora_model, "t-rank2")
    lora = LoRASpec(rank=4, target_modules=("q_proj", "o_proj"))
    trainer.add("sft", lora, seed=9)
    out = trainer.forward_backward([rl, sft])
    assert trainer.stats.max_microbatch_lanes == 2 and trainer.stats.passes == 1
    assert set(out["t-rank2"].sums) >= {"clipped", "ratio", "entropy"}
    tensors = trainer.adapter("sft")
    expected, correct = 0.0, 0
    for d in data:
        logits = _plain_logits(lora_model, lora, tensors, d)
        lp = token_logprobs(logits, torch.tensor([d.target_ids]))[0]
        expected -= float((torch.tensor(d.weights_T) * lp).sum())
        top = logits[0].argmax(-1) == torch.tensor(d.target_ids)
        correct += int((top & (torch.tensor(d.weights_T) != 0)).sum())
    assert out["sft"].loss == pytest.approx(expected, rel=1e-5)
    assert out["sft"].sums["correct"] == correct
    # The policy-gradient tenant's entropy: its weighted positions' alone.
    entropy = 0.0
    rl_tensors = trainer.adapter("t-rank2")
    for d in rl.data:
        logits = _plain_logits(lora_model, TENANTS["t-rank2"][0], rl_tensors, d)
        logp = torch.log_softmax(logits[0] / rl.temperature, -1)
        weighted = torch.tensor(d.weights_T) != 0
        entropy -= float((logp.exp() * logp).sum(-1)[weighted].sum())
    assert out["t-rank2"].sums["entropy"] == pytest.approx(entropy, rel=1e-5)
    assert out["sft"].tokens == sum(sum(w != 0 for w in d.weights_T) for d in data)
    steps = trainer.optim_step([("sft", AdamParams(lr=1e-2, max_grad_norm=None))])
    assert steps["sft"].grad_norm > 0 and trainer.version("t-rank2") == 0
    after = trainer.forward([TrainInput("sft", tuple(data), CrossEntropy())])
    assert after["sft"].loss < out["sft"].loss  # one step of SFT lowered the loss


def _plain_logits(
    lora_model: LoRAModel, lora: LoRASpec, tensors: AdapterTensors, d: Datum
) -> Tensor:
    """`d`'s logits `[1, T, V]` under one adapter, through the modules, alone."""
    lane = lora_model.lane_batch([(lora, tensors)], torch.zeros(1, dtype=torch.long))
    with torch.no_grad(), lora_model.lanes(lane):
        return lora_model.base(input_ids=torch.tensor([d.input_ids])).logits  # type: ignore[no-any-return]


def test_forward_returns_every_log_prob_and_leaves_no_gradient(lora_model: LoRAModel) -> None:
    _, rl = _grpo("t-rank2", lora_model)
    trainer = _trainer(lora_model, "t-rank2")
    want = TrainInput(rl.tenant, rl.data, rl.loss, rl.temperature, return_logprobs=True)
    out = trainer.forward([want])["t-rank2"]
    assert out.logprobs is not None and len(out.logprobs) == len(rl.data)
    tensors = trainer.adapter("t-rank2")
    lora = TENANTS["t-rank2"][0]
    for d, got in zip(rl.data, out.logprobs, strict=True):
        lane = lora_model.lane_batch([(lora, tensors)], torch.zeros(1, dtype=torch.long))
        with torch.no_grad(), lora_model.lanes(lane):
            logits = lora_model.base(input_ids=torch.tensor([d.input_ids])).logits
        lp = token_logprobs(logits, torch.tensor([d.target_ids]))[0]
        torch.testing.assert_close(torch.tensor(got), lp, rtol=1e-5, atol=1e-5)
    step = trainer.optim_step([("t-rank2", AdamParams(lr=1e-2))])["t-rank2"]
    assert step.grad_norm == 0.0  # forward accumulated nothing


def test_add_from_a_snapshot_at_its_version_and_refusals(lora_model: LoRAModel) -> None:
    training, inp = _grpo("t-rank2", lora_model)
    trainer = _trainer(lora_model, "t-rank2")
    for _ in range(3):
        trainer.forward_backward([TrainInput(inp.tenant, inp.data, inp.loss)])
        trainer.optim_step([("t-rank2", training.adam)])
    snap = trainer.snapshot("t-rank2")
    copy = MultiLaneTrainer(lora_model)
    assert copy.add("copy", snap.lora, snapshot=snap) == 3
    assert _rel_diff(copy.adapter("copy"), trainer.adapter("t-rank2")) == 0.0
    with pytest.raises(ConfigError, match="already registered"):
        copy.add("copy", snap.lora)
    with pytest.raises(ConfigError, match="another LoRA spec"):
        copy.add("other", LoRASpec(rank=2), snapshot=snap)
    with pytest.raises(TrainBatchError, match="adapter is at version 3"):
        copy.forward_backward([TrainInput("copy", inp.data, inp.loss, version=0)])
    with pytest.raises(TenantNotFound):
        copy.optim_step([("nobody", training.adam)])
    with pytest.raises(ConfigError, match="repeated"):
        copy.forward([TrainInput("copy", inp.data, inp.loss)] * 2)
    with pytest.raises(TrainBatchError, match="needs sampling_logprobs and advantages"):
        TrainInput("copy", (Datum((5, 6), (6, 7), (1.0, 1.0)),), PolicyGradient())


def test_the_objective_registry_names_what_is_wrong() -> None:
    assert make_objective("policy_gradient", {"clip_high": 0.28}) == PolicyGradient(clip_high=0.28)
    assert make_objective("cross_entropy") == CrossEntropy()
    with pytest.raises(
        ConfigError,
        match="known: cispo, cross_entropy, dro, importance_sampling, policy_gradient, ppo",
    ):
        make_objective("dpo")
    with pytest.raises(ConfigError, match="no option 'clip'"):
        make_objective("policy_gradient", {"clip": 0.2})
    with pytest.raises(ConfigError, match="kl_coef"):
        make_objective("policy_gradient", {"kl_coef": -1.0})
