"""`marlaas bench rollout`: multi-LoRA rollout throughput, side by side, in one run.

For each tenant count N the same workload (N * requests_per_tenant greedy requests of
random prompts, exactly `max_new_tokens` new tokens each, EOS disabled) runs on:
- `engine_mixed`: our engine, request i on tenant i mod N (N adapters in every batch);
- `engine_single`: our engine, every request on one tenant (the multi-LoRA overhead is
  `engine_mixed / engine_single`);
- `hf_peft_mixed`: Hugging Face `generate` on a PEFT model holding the same N adapters,
  left-padded batches of `max_batch_size` with `adapter_names=[...]` (PEFT's mixed-batch
  inference), the standard way to serve many LoRAs with transformers.

Throughput is generated tokens per wall-clock second, the best of `repeats` runs, after
one untimed warm-up run of each system. Greedy outputs of the three systems must agree (`outputs_agree`; the
engine is checked against PEFT on every request), so the numbers compare equal work.

`efficiency` is `marlaas bench roofline`'s: the mixed run's roofline time (its model
FLOPs and bytes, `marlaas.bench.cost`, at the machine's limits measured in the same
run) over its measured time.
"""

from __future__ import annotations

import random
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from marlaas.bench.cost import ModelCost
from marlaas.bench.machine import measure_machine
from marlaas.config.specs import ALL_LINEAR, LoRASpec, ModelDType
from marlaas.fileio import atomic_write_json
from marlaas.model.bank import AdapterBank
from marlaas.model.base import default_base_path, load_base
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.model.peft_io import save_peft
from marlaas.rollout.engine import RolloutEngine
from marlaas.types import RolloutRequest, SamplingParams


def random_adapters(model: LoRAModel, spec: LoRASpec, n: int, seed: int) -> list[AdapterTensors]:
    """`n` random adapters with non-zero B (so each tenant's outputs differ)."""
    g = torch.Generator().manual_seed(seed)
    out: list[AdapterTensors] = []
    for _ in range(n):
        tensors: AdapterTensors = {}
        for path in model.module_paths(spec):
            fan_in, fan_out = model.module_shapes[path]
            tensors[path] = (
                torch.randn(spec.rank, fan_in, generator=g) / fan_in**0.5,
                torch.randn(fan_out, spec.rank, generator=g) * 0.05,
            )
        out.append(tensors)
    return out


def _prompts(n: int, vocab: int, lengths: tuple[int, int], seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    low = min(8, vocab - 1)  # skip the first ids, where tokenizers keep special tokens
    return [
        tuple(rng.randrange(low, vocab) for _ in range(rng.randint(*lengths))) for _ in range(n)
    ]


def _timed(
    run: Callable[[], list[tuple[int, ...]]], repeats: int
) -> tuple[float, list[tuple[int, ...]]]:
    """The best wall time of `repeats` runs (the least disturbed by other processes)."""
    best, outputs = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = run()
        best = min(best, time.perf_counter() - start)
    return best, outputs


def _engine_run(
    engine: RolloutEngine, prompts: Sequence[tuple[int, ...]], tenants: Sequence[str], n: int
) -> list[tuple[int, ...]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=n)
    requests = [
        RolloutRequest(tenant=t, prompt_ids=p, sampling=params)
        for p, t in zip(prompts, tenants, strict=True)
    ]
    return [c.token_ids for c in engine.generate(requests)]


def _hf_run(
    peft_model: Any,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[tuple[int, ...]],
    adapter_names: Sequence[str],
    n: int,
    batch_size: int,
) -> list[tuple[int, ...]]:
    pad = tokenizer.pad_token_id if isinstance(tokenizer.pad_token_id, int) else 0
    device = next(peft_model.parameters()).device
    # Greedy, exactly n new tokens, EOS disabled (an id past the vocabulary; None would
    # mean "the model default"), not suppressed: what the engine runs.
    never = int(peft_model.config.get_text_config(decoder=True).vocab_size)
    config = GenerationConfig(
        max_new_tokens=n, do_sample=False, eos_token_id=never, pad_token_id=pad
    )
    out: list[tuple[int, ...]] = []
    for lo in range(0, len(prompts), batch_size):
        chunk = prompts[lo : lo + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            gen = peft_model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                adapter_names=list(adapter_names[lo : lo + batch_size]),
                generation_config=config,
            )
        out.extend(tuple(row) for row in gen[:, width:].tolist())
    return out


def run_rollout_bench(
    model_path: str | Path | None = None,
    tenant_counts: Sequence[int] = (1, 8, 32, 64),
    requests_per_tenant: int = 2,
    max_new_tokens: int = 24,
    json_path: str | Path | None = None,
    *,
    rank: int = 8,
    max_batch_size: int = 64,
    prompt_lengths: tuple[int, int] = (8, 24),
    num_threads: int | None = 1,
    repeats: int = 3,
    include_hf: bool = True,
    seed: int = 0,
    print_table: bool = True,
    dtype: ModelDType = "auto",
) -> dict[str, Any]:
    """Measure rollout throughput (see the module docstring); returns the results dict.

    `model_path=None` uses the embedded base. `num_threads` sets torch's CPU threads
    (1 by default: on a shared 2-core machine more threads slow every system down);
    None leaves torch's default. Each figure is the best of `repeats` timed runs. The
    dict is also written to `json_path` (atomically) and printed as a table.
    """
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    path = Path(model_path) if model_path is not None else default_base_path()
    base, tokenizer = load_base(path, dtype=dtype)
    lora_model = LoRAModel(base, max_rank=rank)
    spec = lora_model.resolve(
        LoRASpec(rank=rank, alpha=2.0 * rank, target_modules=ALL_LINEAR, use_rslora=False)
    )
    n_max = max(tenant_counts)
    adapters = random_adapters(lora_model, spec, n_max, seed)
    bank = AdapterBank(lora_model, num_slots=n_max, versions_kept=1)
    for i, tensors in enumerate(adapters):
        bank.register(f"t{i}", spec, tensors=tensors)
    engine = RolloutEngine(
        lora_model, bank, tokenizer, max_batch_size=max_batch_size, eos_token_ids=[]
    )
    vocab = int(base.config.get_text_config(decoder=True).vocab_size)

    peft_model = None
    if include_hf:
        peft_model = _peft_model(path, spec, adapters, dtype)

    machine = measure_machine(lora_model)
    cost = ModelCost.of(lora_model)
    lora_flops = cost.lora_flops(rank, lora_model.targets(spec))
    rows: list[dict[str, Any]] = []
    warm = _prompts(min(4, max_batch_size), vocab, prompt_lengths, seed + 1)
    _engine_run(engine, warm, ["t0"] * len(warm), max_new_tokens)
    if peft_model is not None:
        _hf_run(peft_model, tokenizer, warm, ["t0"] * len(warm), max_new_tokens, max_batch_size)
    for n in tenant_counts:
        total = n * requests_per_tenant
        prompts = _prompts(total, vocab, prompt_lengths, seed + 100 + n)
        mixed = [f"t{i % n}" for i in range(total)]
        tokens = total * max_new_tokens
        before = engine.stats.iterations
        t_mixed, out_mixed = _timed(
            partial(_engine_run, engine, prompts, mixed, max_new_tokens), repeats
        )
        iterations = (engine.stats.iterations - before) / repeats
        flops, half_flops, nbytes = cost.generation(
            [len(p) for p in prompts],
            max_new_tokens,
            round(iterations),
            lora_flops,
            min(n, total) * cost.lora_bytes(rank, lora_model.targets(spec)),
        )
        single = ["t0"] * total
        t_single, _ = _timed(partial(_engine_run, engine, prompts, single, max_new_tokens), repeats)
        row: dict[str, Any] = {
            "tenants": n,
            "requests": total,
            "new_tokens": tokens,
            "engine_mixed_tok_s": tokens / t_mixed,
            "engine_single_tok_s": tokens / t_single,
            "mixed_vs_single": t_single / t_mixed,
            "iterations": iterations,
            "flops": flops,
            "bytes": nbytes,
            "efficiency": machine.roofline_s(flops, nbytes, half_flops) / t_mixed,
        }
        if peft_model is not None:
            hf = partial(_hf_run, peft_model, tokenizer, prompts, mixed, max_new_tokens)
            t_hf, out_hf = _timed(partial(hf, max_batch_size), repeats)
            row["hf_peft_mixed_tok_s"] = tokens / t_hf
            row["engine_vs_hf"] = t_hf / t_mixed
            row["outputs_agree"] = (
                sum(a == b for a, b in zip(out_mixed, out_hf, strict=True)) / total
            )
        rows.append(row)

    result: dict[str, Any] = {
        "model": str(path),
        "device": str(lora_model.device),
        "dtype": str(lora_model.dtype),
        "num_threads": torch.get_num_threads(),
        "rank": rank,
        "max_batch_size": max_batch_size,
        "max_new_tokens": max_new_tokens,
        "requests_per_tenant": requests_per_tenant,
        "repeats": repeats,
        "prompt_lengths": list(prompt_lengths),
        "machine": machine.as_dict(),
        "rows": rows,
    }
    if json_path is not None:
        atomic_write_json(Path(json_path), result)
    if print_table:
        _print_table(result)
    return result


def _peft_model(
    path: Path, spec: LoRASpec, adapters: Sequence[AdapterTensors], dtype: ModelDType
) -> Any:
    """A plain copy of the base with every adapter loaded under PEFT, named t0, t1, ..."""
    from peft import PeftModel

    base, _ = load_base(path, dtype=dtype)
    with (
        tempfile.TemporaryDirectory(prefix="marlaas-bench-") as tmp,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", FutureWarning)  # PEFT calls deprecated HF helpers
        dirs = [save_peft(Path(tmp) / f"t{i}", spec, t) for i, t in enumerate(adapters)]
        model = PeftModel.from_pretrained(base, str(dirs[0]), adapter_name="t0")
        for i, d in enumerate(dirs[1:], start=1):
            model.load_adapter(str(d), adapter_name=f"t{i}")
    return model.eval()


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"rollout: new tokens/s ({result['device']}, {result['num_threads']} thread(s), "
        f"rank {result['rank']}, {result['max_new_tokens']} tokens/request)"
    )
    for name in ("tenants", "reqs", "ours mixed", "efficiency", "ours 1 LoRA", "mixed/1"):
        table.add_column(name, justify="right")
    has_hf = any("hf_peft_mixed_tok_s" in r for r in result["rows"])
    if has_hf:
        for name in ("HF+PEFT", "ours/HF", "agree"):
            table.add_column(name, justify="right")
    for r in result["rows"]:
        cells = [
            str(r["tenants"]),
            str(r["requests"]),
            f"{r['engine_mixed_tok_s']:.0f}",
            f"{r['efficiency']:.3f}",
            f"{r['engine_single_tok_s']:.0f}",
            f"{r['mixed_vs_single']:.2f}x",
        ]
        if has_hf:
            cells += [
                f"{r['hf_peft_mixed_tok_s']:.0f}",
                f"{r['engine_vs_hf']:.2f}x",
                f"{100 * r['outputs_agree']:.0f}%",
            ]
        table.add_row(*cells)
    Console().print(table)
