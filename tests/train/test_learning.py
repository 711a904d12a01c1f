"""GRPO on the embedded base raises held-out accuracy (issue: multi-lane trainer).

A deliberately plain on-policy loop over the real components, with two tenants on two
task families trained *together*: the rollout engine samples every tenant's groups in
shared batches through the episode driver, one multi-lane trainer step updates both
adapters, and the new versions are published. Thresholds are generous (about half of
what this seed gives on this machine); the real curves belong in the benchmarks.

Measured with this file's settings (greedy held-out accuracy, 128 episodes; three
training seeds, each alone): reverse 0.45 -> 0.61..0.70 in 16 steps, calculator
0.20 -> 0.31..0.34 in 32 steps.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass, replace

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from marlaas.config.specs import GRPOSpec, LoRASpec
from marlaas.envs.base import Example, TaskFamily
from marlaas.envs.tasks import get_family
from marlaas.model.bank import AdapterBank
from marlaas.model.base import default_base_path, load_base
from marlaas.model.lora import LoRAModel
from marlaas.rollout.engine import RolloutEngine
from marlaas.rollout.episode import run_episode
from marlaas.train.batch import TrainBatch
from marlaas.train.grpo import GRPOTrainer
from marlaas.types import SamplingParams, Trajectory

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
TRAIN = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
HELD_OUT = 128


@dataclass
class Tenant:
    name: str
    family: TaskFamily
    steps: int
    train: list[Example]
    held_out: list[Example]


async def accuracy(
    engine: RolloutEngine, tok: PreTrainedTokenizerBase, tenant: Tenant, params: SamplingParams
) -> float:
    trajs = await asyncio.gather(
        *(
            run_episode(
                engine.submit,
                tok,
                tenant.family.make_env(ex),
                tenant=tenant.name,
                example_id=ex.id,
                sampling=replace(params, seed=i),
            )
            for i, ex in enumerate(tenant.held_out)
        )
    )
    return statistics.fmean(t.reward for t in trajs)


async def play_step(
    engine: RolloutEngine,
    tok: PreTrainedTokenizerBase,
    tenant: Tenant,
    algo: GRPOSpec,
    step: int,
) -> list[list[Trajectory]]:
    prompts = tenant.train[step * algo.prompts_per_step : (step + 1) * algo.prompts_per_step]
    return list(
        await asyncio.gather(
            *(
                asyncio.gather(
                    *(
                        run_episode(
                            engine.submit,
                            tok,
                            tenant.family.make_env(ex),
                            tenant=tenant.name,
                            example_id=ex.id,
                            sampling=TRAIN,
                        )
                        for _ in range(algo.group_size)
                    )
                )
                for ex in prompts
            )
        )
    )


async def train_together(plan: dict[str, tuple[str, int]]) -> dict[str, tuple[float, float]]:
    """Train one tenant per entry (`name -> (family, steps)`) in the same engine and
    trainer; return each tenant's greedy held-out accuracy (before, after)."""
    torch.manual_seed(0)
    base, tok = load_base(default_base_path())
    ratio_tol = 1e-4 if {p.dtype for p in base.parameters()} == {torch.float32} else 2e-3
    model = LoRAModel(base, max_rank=8)
    bank = AdapterBank(model, num_slots=8, versions_kept=2)
    engine = RolloutEngine(model, bank, tok, max_batch_size=128, seed=0)
    trainer = GRPOTrainer(model, max_tokens_per_microbatch=8192)
    lora = LoRASpec(rank=8, alpha=16)
    algo = GRPOSpec(group_size=8, prompts_per_step=8, learning_rate=5e-4, max_staleness=0)
    tenants: list[Tenant] = []
    for name, (family_name, steps) in plan.items():
        family = get_family(family_name)
        tenants.append(
            Tenant(
                name=name,
                family=family,
                steps=steps,
                train=family.examples("train", steps * algo.prompts_per_step, seed=0),
                held_out=family.examples("eval", HELD_OUT, seed=0),
            )
        )
        init = model.init_adapter(lora, seed=0)
        bank.register(name, lora, tensors=init)
        trainer.register(name, lora, algo, tensors=init, seed=0, temperature=TRAIN.temperature)
    before = {t.name: await accuracy(engine, tok, t, GREEDY) for t in tenants}
    for step in range(max(t.steps for t in tenants)):
        active = [t for t in tenants if step < t.steps]
        groups = await asyncio.gather(*(play_step(engine, tok, t, algo, step) for t in active))
        batches = [
            TrainBatch.from_groups(t.name, step, g, scale_rewards=algo.scale_rewards)
            for t, g in zip(active, groups, strict=True)
        ]
        assert all(b.max_staleness == 0 for b in batches)  # strictly on-policy
        results = trainer.step(batches)  # one multi-lane step for every active tenant
        for t in active:
            assert results[t.name].version == step + 1
            # Engine and trainer agree on the behaviour log-probs of on-policy data (up to
            # rounding: bfloat16 linears, the default where the CPU has them, round the
            # two sides' differently shaped products differently; both hold keys and
            # values in bfloat16: up to 6.6e-4 over three runs, where 4e-3 and once 1.2e-2
            # when only the engine rounded them).
            assert abs(results[t.name].ratio_mean - 1.0) < ratio_tol
            engine.publish(t.name, results[t.name].version, trainer.adapter(t.name))
    after = {t.name: await accuracy(engine, tok, t, GREEDY) for t in tenants}
    await engine.close()
    return {name: (before[name], after[name]) for name in before}


def test_grpo_raises_held_out_accuracy_for_tenants_trained_together() -> None:
    scores = asyncio.run(train_together({"rev": ("reverse", 16), "calc": ("calculator", 32)}))
    print({k: (round(b, 3), round(a, 3)) for k, (b, a) in scores.items()})
    rev_before, rev_after = scores["rev"]
    calc_before, calc_after = scores["calc"]
    assert rev_after >= rev_before + 0.08, scores
    assert calc_after >= calc_before + 0.05, scores
