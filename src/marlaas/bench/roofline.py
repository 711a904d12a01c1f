"""`marlaas bench roofline`: the engine's and the trainer's work against this machine's limits.

In one run and one thread count: the machine's limits (`marlaas.bench.machine`), then
the engine and the trainer on the same model, each row with its measured time per
iteration, its model FLOPs and bytes (`marlaas.bench.cost`, counted from the shapes and
the real context lengths, never from padding), its **roofline time**
`max(FLOPs / peak FLOP/s, bytes / bandwidth)` and its **efficiency** = roofline time /
measured time (1.0 would be the machine's limit). The peaks are matmuls' (at the
model's shapes the faster of torch's and the project's own packed products, which on an
AMD CPU outrun torch's float32 MKL and bfloat16 oneDNN ones; torch's at a large square:
`marlaas.bench.machine`); on a CPU the `vs FMA` column puts the cores' own multiply-add
rates in their place (`Machine.fma_roofline_s`: what the silicon issues in registers),
the stricter ceiling.

Rows:
- engine prefill: 16 prompts of about `context` tokens (spread +-25%) admitted in one
  iteration and answered at prefill (one token each), the prompt cache off;
- engine decode: `batch` rows of about `context` tokens (spread +-25%) over `adapters`
  adapters (row i on adapter i mod adapters), sampling at temperature 1 with seeds; the
  time is the fastest of `iterations` decode iterations, after two warm-up iterations;
- trainer: `tenants` tenants of mixed prompt and completion lengths (as
  `bench trainer --mixed-lengths`), one GRPO group of 4 rows each, one optimizer step
  of every tenant per trainer call; the median of `steps` calls after a warm-up call,
  against the mean work of those calls, each group's prompt counted once (its samples
  share it: `ModelCost.train_flops`). A call's time is the device's part of it, the
  forward-backward and the optimizer step; the host's part, each tenant's batch made
  into the trainer's input and its step's result made from the outputs (which the
  pipeline's tenant coroutines do on the event loop), is timed beside it (`host ms`,
  JSON `host_seconds`) and not counted.

Times are the least disturbed of several (fastest, or median for the trainer's longer
calls), as for the machine's limits. Nothing is asserted about them.

Where the native CPU kernels are built (`marlaas.model.kernels`), every engine row is
also timed on torch's own path (`torch_path`: the kernels decline), alternating with
the default path iteration by iteration (decode) or prefill by prefill, so that the
`torch ms` column and its ratio compare the two in the same machine phase.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from marlaas.bench.cost import ModelCost, TrainGroup
from marlaas.bench.machine import Machine, measure_machine
from marlaas.config.specs import ALL_LINEAR, GRPOSpec, LoRASpec
from marlaas.fileio import atomic_write_json
from marlaas.model.bank import AdapterBank
from marlaas.model.kernels import native_kernels, torch_path
from marlaas.model.lora import LoRAModel
from marlaas.rollout.bench import random_adapters
from marlaas.rollout.engine import RolloutEngine
from marlaas.train.batch import TrainBatch
from marlaas.train.bench import synthetic_batches, tenant_lengths
from marlaas.train.grpo import GRPOTrainer
from marlaas.train.trainer import vocab_size
from marlaas.types import RolloutRequest, SamplingParams

SCHEMA = "marlaas.bench.roofline/1"
BATCHES = (1, 16, 64, 256, 512)
ADAPTERS = (1, 32)
CONTEXTS = (64, 192)
TRAINER_TENANTS = (1, 8, 32)
PREFILL_ROWS = 16
WARMUP = 2


def spread(context: int, n: int, limit: int, rng: random.Random) -> list[int]:
    """`n` lengths spread uniformly over +-25% of `context`, at most `limit`."""
    lo, hi = max(1, context * 3 // 4), max(1, context * 5 // 4)
    return [min(rng.randint(lo, hi), limit) for _ in range(n)]


class _Rig:
    """The model, a bank of `max(adapters)` tenants and what the rows need to build requests."""

    def __init__(self, model: LoRAModel, tokenizer: Any, spec: LoRASpec, tenants: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec
        self.bank = AdapterBank(model, num_slots=tenants, versions_kept=1)
        for i, tensors in enumerate(random_adapters(model, spec, tenants, seed=0)):
            self.bank.register(f"t{i}", spec, tensors=tensors)
        self.cost = ModelCost.of(model)
        config: Any = model.base.config.get_text_config(decoder=True)
        self.vocab = int(config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 30))
        self.lora_flops = self.cost.lora_flops(spec.rank, model.targets(spec))
        self.adapter_bytes = self.cost.lora_bytes(spec.rank, model.targets(spec))

    def engine(self, rows: int, prefill_tokens: int) -> RolloutEngine:
        return RolloutEngine(
            self.model,
            self.bank,
            self.tokenizer,
            max_batch_size=rows,
            max_prefill_tokens=max(prefill_tokens, 1),
            max_prompts=0,
            eos_token_ids=[],
            background=False,
        )

    def requests(
        self, lengths: Sequence[int], adapters: int, new_tokens: int, rng: random.Random
    ) -> list[RolloutRequest]:
        low = min(8, self.vocab - 1)  # skip the first ids, where tokenizers keep specials
        return [
            RolloutRequest(
                tenant=f"t{i % adapters}",
                prompt_ids=tuple(rng.randrange(low, self.vocab) for _ in range(n)),
                sampling=SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i),
            )
            for i, n in enumerate(lengths)
        ]


def _arms(rig: _Rig) -> tuple[bool, ...]:
    """The engine's paths to time side by side: the default (native kernels where they
    apply), and torch's own (`kernels.torch_path`) where the kernels are built."""
    native = rig.model.device.type == "cpu" and native_kernels()
    return (False, True) if native else (False,)


def _path(torch_only: bool) -> contextlib.AbstractContextManager[None]:
    return torch_path() if torch_only else contextlib.nullcontext()


def _prefill_row(rig: _Rig, adapters: int, context: int, repeats: int) -> dict[str, Any]:
    rng = random.Random(context * 1000 + adapters)
    arms = _arms(rig)
    times: dict[bool, list[float]] = {arm: [] for arm in arms}
    lengths: list[int] = []
    for attempt in range(repeats * len(arms) + 1):  # the first one warms up
        arm = arms[attempt % len(arms)]
        lengths = spread(context, PREFILL_ROWS, rig.max_positions - 1, rng)
        engine = rig.engine(PREFILL_ROWS, sum(lengths))
        for request in rig.requests(lengths, adapters, 1, rng):
            engine.enqueue(request, lambda _: None)
        with _path(arm):
            start = time.perf_counter()
            engine.step()
            _sync(rig.model.device)
            if attempt:
                times[arm].append(time.perf_counter() - start)
        engine.shutdown()
    used = min(adapters, PREFILL_ROWS)
    flops = sum(rig.cost.prefill_flops(n, rig.lora_flops) for n in lengths)
    nbytes = rig.cost.prefill_bytes(lengths, used * rig.adapter_bytes)
    best, on_torch = _fastest(times)
    row = _row("prefill", PREFILL_ROWS, used, context, best, flops, nbytes, on_torch)
    return row | {"half_flops": rig.cost.half_flops(sum(lengths))}


def _decode_row(
    rig: _Rig, batch: int, adapters: int, context: int, iterations: int
) -> dict[str, Any]:
    rng = random.Random(batch * 7919 + context * 31 + adapters)
    arms = _arms(rig)
    timed = iterations * len(arms)
    limit = rig.max_positions - WARMUP - timed - 2
    prompts = spread(context, batch, limit, rng)
    engine = rig.engine(batch, sum(prompts))
    for request in rig.requests(prompts, adapters, WARMUP + timed + 2, rng):
        engine.enqueue(request, lambda _: None)
    engine.step()  # prefill, and the first decode iteration
    for _ in range(WARMUP):
        engine.step()
    times: dict[bool, list[float]] = {arm: [] for arm in arms}
    for i in range(timed):  # the paths alternate, iteration by iteration
        arm = arms[i % len(arms)]
        with _path(arm):
            start = time.perf_counter()
            engine.step()
            _sync(rig.model.device)
            times[arm].append(time.perf_counter() - start)
    engine.shutdown()
    # The k-th decode iteration feeds each row's k-th token: it attends to the prompt
    # and the k tokens fed so far. The row reports the middle timed iteration's work.
    k = 1 + WARMUP + timed // 2
    contexts = [n + k for n in prompts]
    used = min(adapters, batch)
    flops = rig.cost.decode_flops(contexts, rig.lora_flops)
    nbytes = rig.cost.decode_bytes(contexts, used * rig.adapter_bytes)
    best, on_torch = _fastest(times)
    row = _row("decode", batch, used, context, best, flops, nbytes, on_torch)
    return row | {"half_flops": rig.cost.half_flops(batch)}


def _train_step(
    trainer: GRPOTrainer, batches: Sequence[TrainBatch], device: torch.device
) -> tuple[float, float]:
    """One optimizer step of every tenant in `batches`, split as the pipeline splits it
    (`pipeline.lifecycle`'s `train`): each batch made into the trainer's input and its
    result made from the outputs by its tenant's coroutine, on the event loop (the host's
    part), the forward-backward and the optimizer step on the device thread (the
    device's). Seconds of `(device, host)`. Kept in this one place so that the trainer's
    API can change under it."""
    start = time.perf_counter()
    trainings = [trainer.training(b.tenant) for b in batches]
    inputs = [t.train_input(b) for t, b in zip(trainings, batches, strict=True)]
    prepared = time.perf_counter()
    outputs = trainer.trainer.forward_backward(inputs)
    steps = trainer.trainer.optim_step(
        [(b.tenant, t.adam) for t, b in zip(trainings, batches, strict=True)]
    )
    _sync(device)
    trained = time.perf_counter()
    for t, b in zip(trainings, batches, strict=True):
        t.result(b, outputs[b.tenant], steps[b.tenant])
    return trained - prepared, (prepared - start) + (time.perf_counter() - trained)


def _trainer_row(rig: _Rig, tenants: int, steps: int) -> dict[str, Any]:
    model = rig.model
    algo = GRPOSpec.model_validate({"group_size": 4, "prompts_per_step": 1, "max_staleness": 0})
    trainer = GRPOTrainer(model, max_tokens_per_microbatch=16384)
    data: dict[str, list[TrainBatch]] = {}
    vocab = vocab_size(model)
    for i in range(tenants):
        name = f"tenant-{i:03d}"
        trainer.register(name, rig.spec, algo, seed=i)
        prompt_len, completion_len = tenant_lengths(i, 16, 16)
        data |= synthetic_batches([name], steps + 1, algo, vocab, prompt_len, completion_len, i)
    times: list[float] = []
    host: list[float] = []
    for k in range(steps + 1):
        device_s, host_s = _train_step(trainer, [data[name][k] for name in data], model.device)
        if k > 0:  # the first call warms up
            times.append(device_s)
            host.append(host_s)
    median = statistics.median(times)
    # The timed steps' mean work (each step its own random completion lengths).
    steps_groups = [
        [group for name in data for group in _groups(data[name][k])] for k in range(1, steps + 1)
    ]
    cost = rig.cost
    flops = statistics.fmean(cost.train_flops(g, rig.lora_flops) for g in steps_groups)
    nbytes = statistics.fmean(cost.train_bytes(g, rig.adapter_bytes, tenants) for g in steps_groups)
    tokens = statistics.fmean(cost.train_tokens(g) for g in steps_groups)
    lengths = [  # each sample's sequence, the context column's figure
        len(t.prompt_ids) + len(t.token_ids) - 1
        for name in data
        for t in data[name][1].trajectories
    ]
    row = _row(
        "train", len(lengths), tenants, round(statistics.fmean(lengths)), median, flops, nbytes
    )
    row["tokens"] = round(tokens)
    row["half_flops"] = cost.half_flops(2 * tokens)  # forward and backward
    #: The host's part of a step (`_train_step`), not in `seconds`.
    row["host_seconds"] = statistics.median(host)
    return row


def _groups(batch: TrainBatch) -> list[TrainGroup]:
    """A batch's GRPO groups: samples of one prompt share it (`ModelCost.train_flops`)."""
    fed: dict[tuple[int, ...], list[int]] = {}
    for t in batch.trajectories:
        fed.setdefault(tuple(t.prompt_ids), []).append(len(t.token_ids) - 1)
    return [TrainGroup(len(prompt), tuple(f)) for prompt, f in fed.items()]


def _fastest(times: dict[bool, list[float]]) -> tuple[float, float | None]:
    """The fastest time of the default path and of torch's own (None: not timed)."""
    return min(times[False]), (min(times[True]) if True in times else None)


def _row(
    kind: str,
    rows: int,
    adapters: int,
    context: int,
    seconds: float,
    flops: float,
    nbytes: float,
    torch_seconds: float | None = None,
) -> dict[str, Any]:
    return {
        "kind": kind,
        "rows": rows,
        "adapters": adapters,
        "context": context,
        "seconds": seconds,
        #: The same work on torch's path (the native kernels declined), timed in
        #: alternation with `seconds`; None where the kernels are not built or apply.
        "torch_seconds": torch_seconds,
        "flops": flops,
        "bytes": nbytes,
    }


def run_roofline_bench(
    model: LoRAModel,
    tokenizer: Any,
    json_path: str | Path | None = None,
    *,
    batches: Sequence[int] = BATCHES,
    adapters: Sequence[int] = ADAPTERS,
    contexts: Sequence[int] = CONTEXTS,
    trainer_tenants: Sequence[int] = TRAINER_TENANTS,
    iterations: int = 8,
    trainer_steps: int = 10,
    rank: int = 8,
    square: int | None = None,
    copy_mb: int | None = None,
    print_table: bool = True,
    log: Any = None,
) -> dict[str, Any]:
    """Measure the machine, then every engine and trainer row (see the module doc).

    `model` is the shared `LoRAModel` (its device, dtype and torch's thread count are
    the run's); its `max_rank` must be at least `rank`. The machine is measured before
    and after the rows; the roofline uses the better of each figure (the less disturbed
    by other processes), both are in the result. `square` and `copy_mb` size the
    machine's large matmul and copy (None: the device's defaults).
    """
    if not batches or not adapters or not contexts or iterations < 1 or trainer_steps < 1:
        raise ValueError("need batch sizes, adapter counts, contexts and iterations >= 1")
    say = log or (lambda _msg: None)
    spec = model.resolve(
        LoRASpec(rank=rank, alpha=2.0 * rank, target_modules=ALL_LINEAR, use_rslora=False)
    )
    say("measuring the machine")
    before = measure_machine(model, square=square, copy_mb=copy_mb)
    rig = _Rig(model, tokenizer, spec, max(adapters))
    rows: list[dict[str, Any]] = []
    for context in contexts:
        for k in adapters:
            say(f"engine prefill: {PREFILL_ROWS} rows, {k} adapters, context {context}")
            rows.append(_prefill_row(rig, k, context, repeats=3))
    for context in contexts:
        for k in adapters:
            for b in batches:
                say(f"engine decode: {b} rows, {k} adapters, context {context}")
                rows.append(_decode_row(rig, b, k, context, iterations))
    for tenants in trainer_tenants:
        say(f"trainer: {tenants} tenants")
        rows.append(_trainer_row(rig, tenants, trainer_steps))
    after = measure_machine(model, square=square, copy_mb=copy_mb)
    machine = Machine.best(before, after)
    for row in rows:
        _score(row, machine)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "model": getattr(model.base.config, "_name_or_path", "") or type(model.base).__name__,
        "machine": machine.as_dict(),
        "machine_before": before.as_dict(),
        "machine_after": after.as_dict(),
        "rank": rank,
        "target_modules": list(model.targets(spec)),
        "iterations": iterations,
        "rows": rows,
    }
    if json_path is not None:
        atomic_write_json(Path(json_path), result)
    if print_table:
        print_roofline(result)
    return result


def _score(row: dict[str, Any], machine: Machine) -> None:
    half = row.get("half_flops", 0.0)
    row["roofline_s"] = machine.roofline_s(row["flops"], row["bytes"], half)
    row["bound"] = (
        "compute"
        if machine.compute_s(row["flops"], half) >= row["bytes"] / machine.bandwidth
        else "memory"
    )
    row["efficiency"] = row["roofline_s"] / row["seconds"]
    #: The same against the cores' multiply-add rates (`Machine.fma_roofline_s`).
    fma = machine.fma_roofline_s(row["flops"], row["bytes"], half)
    row["fma_efficiency"] = None if fma is None else fma / row["seconds"]
    row["us_per_row"] = row["seconds"] / row["rows"] * 1e6


def print_roofline(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    m, b, a = result["machine"], result["machine_before"], result["machine_after"]
    console = Console(width=max(Console().width, 150))
    console.print(
        f"machine: {m['device']} {m['dtype']}, {m['threads']} thread(s): matmul "
        f"{m['model_shape_flops'] / 1e9:.1f} GFLOP/s at the model's shapes ({m['rows']} rows), "
        f"{m['square_flops'] / 1e9:.1f} GFLOP/s at {m['square_size']}^2; copy "
        f"{m['bandwidth'] / 1e9:.1f} GB/s (best of before / after the rows: "
        f"{b['model_shape_flops'] / 1e9:.1f} / {a['model_shape_flops'] / 1e9:.1f} GFLOP/s, "
        f"{b['bandwidth'] / 1e9:.1f} / {a['bandwidth'] / 1e9:.1f} GB/s)"
    )
    if m.get("fma_flops"):
        bf16 = m.get("bf16_fma_flops") or 0.0
        console.print(
            f"the cores' multiply-adds in registers: {m['fma_flops'] / 1e9:.1f} GFLOP/s float32"
            + (f", {bf16 / 1e9:.1f} bfloat16" if bf16 else "")
            + " (the `vs FMA` column's ceilings; the efficiency column's are the matmuls')"
        )
    if m["bf16_model_shape_flops"]:
        console.print(
            f"bfloat16 at the model's shapes: {m['bf16_model_shape_flops'] / 1e9:.1f} GFLOP/s "
            f"(native bfloat16: {'yes' if m['bf16_hardware'] else 'no'})"
        )
    if m.get("weights_flops"):
        console.print(
            f"linear weights in {m['weights_dtype']} over {m['dtype']} activations: their "
            f"FLOPs count at {m['weights_flops'] / 1e9:.1f} GFLOP/s, the rest at "
            f"{m['peak_flops'] / 1e9:.1f}"
        )
    table = Table(title=f"roofline: {result['model']}, LoRA rank {result['rank']}")
    for name in (
        "kind",
        "rows",
        "adapters",
        "context",
        "ms/iter",
        "us/row",
        "GFLOP",
        "MB",
        "roofline ms",
        "bound",
        "efficiency",
        "vs FMA",
        "torch ms",
        "torch / this",
        "host ms",
    ):
        table.add_column(name, justify="left" if name in ("kind", "bound") else "right")
    for r in result["rows"]:
        table.add_row(
            r["kind"],
            str(r["rows"]),
            str(r["adapters"]),
            str(r["context"]),
            f"{r['seconds'] * 1e3:.2f}",
            f"{r['us_per_row']:.1f}",
            f"{r['flops'] / 1e9:.3f}",
            f"{r['bytes'] / 1e6:.1f}",
            f"{r['roofline_s'] * 1e3:.2f}",
            r["bound"],
            f"{r['efficiency']:.3f}",
            "-" if r.get("fma_efficiency") is None else f"{r['fma_efficiency']:.3f}",
            "-" if r["torch_seconds"] is None else f"{r['torch_seconds'] * 1e3:.2f}",
            "-" if r["torch_seconds"] is None else f"{r['torch_seconds'] / r['seconds']:.2f}x",
            f"{r['host_seconds'] * 1e3:.2f}" if "host_seconds" in r else "-",
        )
    console.print(table)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
