"""Trainer benchmark: multi-lane (all tenants in one step) vs single-lane (one tenant per
step, same code) vs PEFT with torch AdamW, one tenant at a time.

Every mode trains the same synthetic GRPO batches (random tokens, random rewards,
behaviour log-probs that make ratios differ from 1) with the same loss
(`policy_loss` with per-tenant `token_weights`), LoRA shape and AdamW settings, and
tensorises its data inside the timed region. Each mode runs one untimed warm-up round
first. Throughput counts tenant optimizer steps and trained (model-written) tokens.
Multi-lane's speed-up over each other mode is the ratio of their median rounds; over
single-lane, with which it takes turns round by round, also the median of the rounds'
own ratios (`paired`: robust to a machine whose speed moves in phases).

The PEFT baseline loads its own copy of the base (PEFT injects its layers into the
model it wraps); it is released before the next tenant count is measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from marlaas.config.specs import ALL_LINEAR, GRPOSpec, LoRASpec, ModelDType
from marlaas.fileio import atomic_write_json
from marlaas.model.base import default_base_path, load_base
from marlaas.model.lora import LoRAModel
from marlaas.model.peft_io import peft_target_modules
from marlaas.train.batch import TrainBatch
from marlaas.train.grpo import GRPOTrainer
from marlaas.train.losses import policy_loss, token_logprobs
from marlaas.train.rows import tensorise
from marlaas.train.trainer import vocab_size
from marlaas.types import Trajectory

MODES = ("multi-lane", "single-lane", "peft")


def synthetic_batches(
    tenants: Sequence[str],
    steps: int,
    algo: GRPOSpec,
    vocab: int,
    prompt_len: int,
    completion_len: int,
    seed: int = 0,
) -> dict[str, list[TrainBatch]]:
    """`steps` GRPO batches per tenant (batch k is for version k), random but seeded."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, list[TrainBatch]] = {}
    for tenant in tenants:
        out[tenant] = []
        for k in range(steps):
            groups: list[list[Trajectory]] = []
            for p in range(algo.prompts_per_step):
                prompt = tuple(torch.randint(0, vocab, (prompt_len,), generator=g).tolist())
                group = []
                for i in range(algo.group_size):
                    n = int(
                        torch.randint(completion_len // 2, completion_len + 1, (1,), generator=g)
                    )
                    group.append(
                        Trajectory(
                            tenant=tenant,
                            example_id=f"{tenant}-{k}-{p}",
                            prompt_ids=prompt,
                            token_ids=tuple(torch.randint(0, vocab, (n,), generator=g).tolist()),
                            loss_mask_T=(1,) * n,
                            logprobs_T=tuple((-torch.rand(n, generator=g) * 6 - 2).tolist()),
                            reward=float(torch.rand((), generator=g)) + 0.01 * i,
                            min_version=k,
                            max_version=k,
                            turns=1,
                            finish_reason="stop",
                        )
                    )
                groups.append(group)
            out[tenant].append(TrainBatch.from_groups(tenant, k, groups, scale_rewards=True))
    return out


def tenant_lengths(index: int, prompt_len: int, completion_len: int) -> tuple[int, int]:
    """Tenant `index`'s prompt and longest completion lengths under `mixed_lengths`:
    prompts cycle through 0.5, 1, 1.5 and 2 times `prompt_len`, completions through
    0.5, 1 and 1.5 times `completion_len` (at least 2 tokens each)."""
    p = max(2, prompt_len * (1 + index % 4) // 2)
    c = max(2, completion_len * (1 + index % 3) // 2)
    return p, c


def _timed(run_steps: Mapping[str, Callable[[int], None]], steps: int) -> dict[str, list[float]]:
    """Seconds of each round per mode after one untimed warm-up round each (allocations,
    lazy init); the modes take turns round by round, so a machine that drifts (a noisy
    neighbour, a clock change) weighs on each of them alike, not on whichever ran last."""
    for run_step in run_steps.values():
        run_step(0)
    times: dict[str, list[float]] = {mode: [] for mode in run_steps}
    for k in range(1, steps + 1):
        for mode, run_step in run_steps.items():
            started = time.perf_counter()
            run_step(k)
            times[mode].append(time.perf_counter() - started)
    return times


def paired_ratio(slow: Sequence[float], fast: Sequence[float]) -> float:
    """The median over rounds of `slow[k] / fast[k]`, of two modes that took turns round
    by round (`_timed`): each ratio compares two rounds run seconds apart, so a machine
    whose speed moves in phases (a VM's neighbours: the same round 1.5x slower a minute
    later) moves both of a pair, where the ratio of the two medians can pair a fast
    phase's rounds of one mode with a slow phase's of the other."""
    if len(slow) != len(fast) or not slow:
        raise ValueError("paired rounds need as many rounds of each mode, at least one")
    return statistics.median(s / f for s, f in zip(slow, fast, strict=True))


def _lanes_step(
    model: LoRAModel,
    data: dict[str, list[TrainBatch]],
    lora: LoRASpec,
    algo: GRPOSpec,
    budget: int,
    together: bool,
) -> Callable[[int], None]:
    """A round of the multi-lane trainer: every tenant in one step (`together`) or each
    in its own (single-lane), on a trainer of its own."""
    trainer = GRPOTrainer(model, max_tokens_per_microbatch=budget)
    for i, tenant in enumerate(data):
        trainer.register(tenant, lora, algo, seed=i)

    def run_step(k: int) -> None:
        batches = [data[t][k] for t in data]
        if together:
            trainer.step(batches)
        else:
            for batch in batches:
                trainer.step([batch])

    return run_step


def _bench_peft(
    model_path: Path,
    data: dict[str, list[TrainBatch]],
    lora: LoRASpec,
    algo: GRPOSpec,
    steps: int,
    dtype: ModelDType,
) -> list[float]:
    from peft import LoraConfig, PeftModel, get_peft_model

    base, _ = load_base(model_path, dtype=dtype)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=round(lora.alpha),  # integral here: alpha = 2 x rank
        target_modules=peft_target_modules(lora),
        lora_dropout=0.0,
        use_rslora=lora.use_rslora,
    )
    tenants = list(data)
    peft_model = get_peft_model(base, config, adapter_name=tenants[0])
    assert isinstance(peft_model, PeftModel)
    for tenant in tenants[1:]:
        peft_model.add_adapter(tenant, config)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    params: dict[str, list[torch.nn.Parameter]] = {}
    for tenant in tenants:
        params[tenant] = [
            p for n, p in peft_model.named_parameters() if f".{tenant}." in n and "lora_" in n
        ]
        for p in params[tenant]:
            p.requires_grad_(True)
        optimizers[tenant] = torch.optim.AdamW(
            params[tenant],
            lr=algo.learning_rate,
            betas=algo.betas,
            weight_decay=algo.weight_decay,
        )

    def run_step(k: int) -> None:
        for tenant in tenants:
            peft_model.set_adapter(tenant)
            rows = tensorise([data[tenant][k]], [(algo.loss_norm, None)])
            T = int(rows.lengths_N.max())
            attn = (torch.arange(T) < rows.lengths_N[:, None]).long()
            logits = peft_model(
                input_ids=rows.input_ids_NT[:, :T], attention_mask=attn, use_cache=False
            ).logits
            loss, _ = policy_loss(
                token_logprobs(logits.float(), rows.target_ids_NT[:, :T]),
                rows.behaviour_NT[:, :T],
                rows.advantages_NT[:, :T],
                rows.mask_NT[:, :T],
                clip_low=algo.clip_low,
                clip_high=algo.clip_high,
                weights_BT=rows.weights_NT[:, :T],
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params[tenant], algo.max_grad_norm)
            optimizers[tenant].step()
            optimizers[tenant].zero_grad(set_to_none=True)

    return _timed({"peft": run_step}, steps)["peft"]  # the PEFT copy is freed on return


def run_trainer_bench(
    model_path: str | Path | None = None,
    tenant_counts: Sequence[int] = (1, 8, 32),
    steps: int = 5,
    rows_per_tenant: int = 4,
    prompt_len: int = 16,
    completion_len: int = 16,
    rank: int = 8,
    max_tokens_per_microbatch: int = 16384,
    mixed_lengths: bool = False,
    modes: Sequence[str] = MODES,
    threads: int | None = 1,
    json_path: str | Path | None = None,
    seed: int = 0,
    console: Console | None = None,
    dtype: ModelDType = "auto",
) -> dict[str, Any]:
    """Measure optimizer steps/s and trained tokens/s per mode and tenant count.

    A round gives every tenant one optimizer step; each mode runs one warm-up round and
    `steps` timed rounds, and throughput uses the median round (robust to a busy
    machine); multi-lane and single-lane take turns round by round (`_timed`). `rows_per_tenant` is one GRPO group per tenant per step; completions are
    `completion_len / 2 .. completion_len` tokens. `mixed_lengths`: tenants differ in
    length like task families do (`tenant_lengths`), so multi-lane micro-batches mix
    rows of unequal runs and lengths. `threads` pins torch's intra-op
    threads for the run (None leaves them). Returns (and writes to `json_path`) the
    config, one record per (tenants, mode) and the speed-ups of multi-lane.
    """
    unknown = set(modes) - set(MODES)
    if unknown or not tenant_counts or steps < 1 or rows_per_tenant < 2:
        raise ValueError(
            f"need modes from {MODES}, tenant counts, steps >= 1 and rows_per_tenant >= 2 "
            f"(got unknown modes {sorted(unknown)})"
        )
    path = Path(model_path) if model_path is not None else default_base_path()
    console = console or Console()
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        base, _ = load_base(path, dtype=dtype)
        model = LoRAModel(base, max_rank=rank)
        vocab = vocab_size(model)
        lora = model.resolve(
            LoRASpec.model_validate(
                {"rank": rank, "alpha": 2.0 * rank, "target_modules": ALL_LINEAR}
            )
        )
        algo = GRPOSpec.model_validate(
            {"group_size": rows_per_tenant, "prompts_per_step": 1, "max_staleness": 0}
        )
        records: list[dict[str, Any]] = []
        for count in tenant_counts:
            names = [f"tenant-{i:03d}" for i in range(count)]
            data: dict[str, list[TrainBatch]] = {}
            for i, name in enumerate(names):
                p_len, c_len = (
                    tenant_lengths(i, prompt_len, completion_len)
                    if mixed_lengths
                    else (prompt_len, completion_len)
                )
                data |= synthetic_batches([name], steps + 1, algo, vocab, p_len, c_len, seed + i)
            tokens = [sum(data[n][k].tokens for n in names) for k in range(1, steps + 1)]
            # The two modes of our trainer take turns (`_timed`); PEFT loads a base of its
            # own, so it runs after them.
            lane_steps = {
                mode: _lanes_step(
                    model, data, lora, algo, max_tokens_per_microbatch, mode == "multi-lane"
                )
                for mode in modes
                if mode != "peft"
            }
            by_mode = _timed(lane_steps, steps) if lane_steps else {}
            if "peft" in modes:
                by_mode["peft"] = _bench_peft(path, data, lora, algo, steps, dtype)
            for mode in modes:
                times = by_mode[mode]
                median = statistics.median(times)
                records.append(
                    {
                        "tenants": count,
                        "mode": mode,
                        "round_seconds": times,
                        "median_round_s": median,
                        "optimizer_steps_per_s": count / median,
                        "tokens_per_s": statistics.fmean(tokens) / median,
                    }
                )
                console.log(f"{count} tenants, {mode}: median round {median:.3f} s")
    finally:
        torch.set_num_threads(previous_threads)

    speedup: dict[str, dict[str, float]] = {}
    for count in tenant_counts:
        rounds = {r["mode"]: r["round_seconds"] for r in records if r["tenants"] == count}
        if "multi-lane" not in rounds:
            continue
        multi = rounds["multi-lane"]
        ratios = {
            f"multi_vs_{m.removesuffix('-lane')}": statistics.median(t) / statistics.median(multi)
            for m, t in rounds.items()
            if m != "multi-lane"
        }
        if "single-lane" in rounds:  # the two took turns round by round (`_timed`)
            ratios["multi_vs_single_paired"] = paired_ratio(rounds["single-lane"], multi)
        speedup[str(count)] = ratios
    result: dict[str, Any] = {
        "model": str(path),
        "config": {
            "tenant_counts": list(tenant_counts),
            "steps": steps,
            "rows_per_tenant": rows_per_tenant,
            "prompt_len": prompt_len,
            "completion_len": completion_len,
            "rank": rank,
            "target_modules": peft_target_modules(lora),
            "max_tokens_per_microbatch": max_tokens_per_microbatch,
            "mixed_lengths": mixed_lengths,
            "device": str(model.device),
            "dtype": str(model.dtype),
            "torch_threads": threads if threads is not None else previous_threads,
        },
        "results": records,
        "speedup": speedup,
    }
    _print_table(console, result)
    if json_path is not None:
        atomic_write_json(Path(json_path), result)
    return result


def _print_table(console: Console, result: dict[str, Any]) -> None:
    cfg = result["config"]
    table = Table(
        title=f"Trainer throughput: {Path(result['model']).name}, rank {cfg['rank']}, "
        f"{cfg['rows_per_tenant']} rows/tenant/step, {cfg['device']} x{cfg['torch_threads']}"
    )
    for column in ("tenants", "mode", "opt steps/s", "tokens/s", "multi-lane speed-up", "paired"):
        table.add_column(column, justify="right" if column != "mode" else "left")
    for r in result["results"]:
        speedup = result["speedup"].get(str(r["tenants"]), {})
        key = f"multi_vs_{r['mode'].removesuffix('-lane')}"
        table.add_row(
            str(r["tenants"]),
            r["mode"],
            f"{r['optimizer_steps_per_s']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            f"{speedup[key]:.2f}x" if key in speedup else "-",
            f"{speedup[key + '_paired']:.2f}x" if key + "_paired" in speedup else "-",
        )
    console.print(table)
