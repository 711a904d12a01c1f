"""`marlaas base build`: make the embedded default base model, reproducibly.

A small Llama-architecture causal LM with the byte-level tokenizer, trained from scratch
by supervised warm-up on demonstrations of the built-in task families' *train* splits.
The warm-up is deliberately short, so the model is partially competent on every family
(held-out accuracy well inside (0, 1)) and RL has room to improve it.

Determinism: one seed drives the data, the initialisation and the batch order, and the
build runs with a fixed number of threads, so the same command gives the same weights
on the same software stack.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from marlaas.envs.base import Example, Segment
from marlaas.envs.tasks import get_family
from marlaas.model.evaluate import play_episodes
from marlaas.model.tokenizer import save_tokenizer

IGNORE = -100


@dataclass(frozen=True)
class BuildRecipe:
    """Everything that determines the embedded base. Written next to the weights."""

    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 352
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 256
    #: Train demonstrations drawn per family, and each family's share of the batches.
    examples_per_family: int = 6000
    family_weights: dict[str, float] = field(
        default_factory=lambda: {
            "arithmetic": 1.5,
            "reverse": 0.75,
            "countdown": 1.5,
            "calculator": 0.4,
            "search": 1.0,
        }
    )
    max_steps: int = 3000
    batch_size: int = 48
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    #: Partial competence, not mastery: every `check_every` steps (from `first_check`)
    #: each family is played greedily on `dev_episodes` train-split instances it was not
    #: trained on, and the build keeps the weights whose worst family sits deepest inside
    #: `dev_band` (the held-out target is 10%-70%; the dev band leaves room for noise).
    dev_band: tuple[float, float] = (0.15, 0.6)
    first_check: int = 2550
    check_every: int = 25
    dev_episodes: int = 80
    #: One thread: reproducible, and robust to a busy machine.
    threads: int = 1


def _encode(
    tokenizer: PreTrainedTokenizerBase, segments: Sequence[Segment]
) -> tuple[list[int], list[int]]:
    """Token ids and labels of a demonstration: labels are IGNORE on untrainable text."""
    ids: list[int] = []
    labels: list[int] = []
    for seg in segments:
        seg_ids = tokenizer(seg.text, add_special_tokens=False)["input_ids"]
        ids.extend(seg_ids)
        labels.extend(seg_ids if seg.trainable else [IGNORE] * len(seg_ids))
    return ids, labels


def _collate(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; the model shifts labels itself."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def _model_config(recipe: BuildRecipe, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


Demo = tuple[list[int], list[int]]


def build_base(
    out_dir: Path,
    recipe: BuildRecipe = BuildRecipe(),
    log: Callable[[str], None] = print,
) -> dict[str, object]:
    """Train the embedded base into `out_dir` (replaced atomically). Returns build facts."""
    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".base-build-", dir=out_dir.parent))
    try:
        tokenizer = save_tokenizer(work)
        data: dict[str, list[Demo]] = {}
        dev: dict[str, list[Example]] = {}
        for name in recipe.family_weights:
            family = get_family(name)
            n = recipe.examples_per_family
            examples = family.examples("train", n + recipe.dev_episodes, seed=recipe.seed)
            data[name] = [_encode(tokenizer, family.demonstration(ex)) for ex in examples[:n]]
            dev[name] = examples[n:]
        model = LlamaForCausalLM(_model_config(recipe, tokenizer))
        params = sum(p.numel() for p in model.parameters())
        log(
            f"model: {params / 1e6:.2f}M parameters; data: "
            + ", ".join(f"{k}={len(v)}" for k, v in data.items())
        )
        history = _train(model, tokenizer, data, dev, recipe, log)
        model.save_pretrained(str(work), safe_serialization=True)
        _declare_dtype(work / "config.json")
        facts: dict[str, object] = {
            "parameters": params,
            "build_seconds": round(time.perf_counter() - started, 1),
            "torch": torch.__version__,
            "recipe": asdict(recipe),
            **history,
        }
        (work / "build.json").write_text(json.dumps(facts, indent=2) + "\n")
        # mkdtemp makes a private folder; the model is package data, readable by all.
        work.chmod(0o755)
        for f in work.iterdir():
            f.chmod(0o644)
        if out_dir.exists():
            old = out_dir.with_name(out_dir.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            out_dir.rename(old)
            work.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            work.rename(out_dir)
        return facts
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _dev_accuracy(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    dev: dict[str, list[Example]],
    names: list[str],
) -> dict[str, float]:
    model.eval()
    scores: dict[str, float] = {}
    for name in names:
        family = get_family(name)
        envs = [family.make_env(ex) for ex in dev[name]]
        rewards = asyncio.run(play_episodes(model, tokenizer, envs, temperature=0.0))
        scores[name] = sum(rewards) / len(rewards)
    model.train()
    return scores


def _band_margin(scores: dict[str, float], band: tuple[float, float]) -> float:
    """How deep the worst family sits inside `band` (negative: some family is outside)."""
    lo, hi = band
    return min(min(acc - lo, hi - acc) for acc in scores.values())


def _train(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    data: dict[str, list[Demo]],
    dev: dict[str, list[Example]],
    recipe: BuildRecipe,
    log: Callable[[str], None],
) -> dict[str, object]:
    rng = random.Random(recipe.seed)
    names = list(data)
    weights = [recipe.family_weights[n] for n in names]
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=recipe.learning_rate,
        betas=(0.9, 0.98),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / recipe.warmup_steps)
    )
    model.train()
    curve: list[float] = []
    checks: list[dict[str, object]] = []
    best: tuple[float, int, dict[str, torch.Tensor], dict[str, float]] | None = None
    running = 0.0
    for step in range(recipe.max_steps):
        # One family per batch: rows of a family have similar lengths, so little padding.
        name = rng.choices(names, weights=weights)[0]
        rows = [rng.choice(data[name]) for _ in range(recipe.batch_size)]
        loss = model(**_collate(rows, tokenizer.pad_token_id)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running += loss.item()
        steps = step + 1
        if steps % recipe.check_every == 0:
            curve.append(round(running / recipe.check_every, 4))
            running = 0.0
            if steps < recipe.first_check and steps < recipe.max_steps:
                continue
            scores = _dev_accuracy(model, tokenizer, dev, names)
            margin = _band_margin(scores, recipe.dev_band)
            checks.append({"step": steps, "dev_accuracy": scores, "margin": round(margin, 4)})
            log(
                f"step {steps}: loss {curve[-1]:.4f}; dev accuracy "
                + " ".join(f"{n}={a:.2f}" for n, a in scores.items())
                + f"; band margin {margin:+.2f}"
            )
            if best is None or margin > best[0]:
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                best = (margin, steps, state, scores)
    if best is None:  # max_steps below the first check: keep the last weights
        return {"steps": recipe.max_steps, "kept_step": recipe.max_steps, "loss_curve": curve}
    model.load_state_dict(best[2])
    model.eval()
    log(f"kept the weights of step {best[1]} (band margin {best[0]:+.2f})")
    return {
        "steps": recipe.max_steps,
        "kept_step": best[1],
        "kept_dev_accuracy": best[3],
        "loss_curve": curve,
        "checks": checks,
    }


#: The dtype the embedded base declares (`config.json` `dtype`; its weights are stored in
#: float32): `auto` runs it in bfloat16 where the device computes that natively
#: (`model.base.resolve_dtype`; `marlaas bench dtype` measured no loss of accuracy).
DECLARED_DTYPE = "bfloat16"


def _declare_dtype(config_json: Path) -> None:
    config = json.loads(config_json.read_text())
    config["dtype"] = DECLARED_DTYPE
    config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
