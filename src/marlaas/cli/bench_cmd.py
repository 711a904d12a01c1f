"""`marlaas bench ...`: side-by-side benchmarks that print a table and write JSON.

Benchmarks never assert timings; they report ratios measured in one run.
"""

from __future__ import annotations

from pathlib import Path

import typer

from marlaas.cli.process import device_process
from marlaas.config.ray import RaySpec, load_ray_spec
from marlaas.config.specs import DTYPE_HELP, check_dtype

app = typer.Typer(no_args_is_help=True, help="Benchmarks (a table on screen, JSON on disk).")


@app.callback()
def bench() -> None:
    """Benchmarks (a table on screen, JSON on disk)."""
    device_process()


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from e
    if not counts or min(counts) < 1:
        raise typer.BadParameter("tenant counts must be positive integers")
    return counts


@app.command("rollout")
def rollout(
    json_out: Path = typer.Option(Path("bench-rollout.json"), "--json", help="Result file."),
    model: Path = typer.Option(None, help="Base model directory (default: embedded)."),
    tenants: str = typer.Option("1,8,32,64", help="Tenant counts, comma-separated."),
    requests_per_tenant: int = typer.Option(2, min=1),
    max_new_tokens: int = typer.Option(24, min=1),
    repeats: int = typer.Option(3, min=1, help="Each figure is the best of this many runs."),
    no_hf: bool = typer.Option(False, help="Skip the Hugging Face + PEFT comparison."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
) -> None:
    """Tokens/s of the engine with N mixed adapters vs one adapter vs HF generate + PEFT."""
    from marlaas.rollout.bench import run_rollout_bench

    run_rollout_bench(
        model,
        _counts(tenants),
        requests_per_tenant,
        max_new_tokens,
        json_out,
        repeats=repeats,
        include_hf=not no_hf,
        dtype=check_dtype(dtype),
    )
    typer.echo(f"wrote {json_out}")


@app.command("roofline")
def roofline(
    json_out: Path = typer.Option(Path("bench-roofline.json"), "--json", help="Result file."),
    model: Path = typer.Option(None, help="Base model directory (default: embedded)."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    threads: int = typer.Option(1, min=1, help="torch threads (CPU)."),
    batches: str = typer.Option("1,16,64,256,512", help="Decode batch sizes."),
    adapters: str = typer.Option("1,32", help="Adapters mixed in a batch."),
    contexts: str = typer.Option("64,192", help="Context lengths of the rows."),
    tenants: str = typer.Option("1,8,32", help="Trainer tenant counts."),
    iterations: int = typer.Option(8, min=1, help="Timed decode iterations per row."),
    trainer_steps: int = typer.Option(
        10, min=1, help="Timed trainer steps per row (each of its own random lengths)."
    ),
    square: int = typer.Option(
        None, min=16, help="Side of the large-square matmul (default: 1024 CPU, 8192 GPU)."
    ),
    copy_mb: int = typer.Option(
        None, min=1, help="MB of the bandwidth copy (default: 256 CPU, 1024 GPU)."
    ),
) -> None:
    """Engine and trainer time per iteration against this machine's FLOP/s and bandwidth."""
    import torch

    from marlaas.bench.roofline import run_roofline_bench
    from marlaas.device.config import resolve_device
    from marlaas.model.base import default_base_path, load_base
    from marlaas.model.lora import LoRAModel

    torch.set_num_threads(threads)
    base, tokenizer = load_base(
        model or default_base_path(), dtype=check_dtype(dtype), device=resolve_device(device)
    )
    run_roofline_bench(
        LoRAModel(base, max_rank=8),
        tokenizer,
        json_out,
        batches=_counts(batches),
        adapters=_counts(adapters),
        contexts=_counts(contexts),
        trainer_tenants=_counts(tenants),
        iterations=iterations,
        trainer_steps=trainer_steps,
        square=square,
        copy_mb=copy_mb,
        log=typer.echo,
    )
    typer.echo(f"wrote {json_out}")


@app.command("trainer")
def trainer(
    json_out: Path = typer.Option(Path("bench-trainer.json"), "--json", help="Result file."),
    model: Path = typer.Option(None, help="Base model directory (default: embedded)."),
    tenants: str = typer.Option("1,8,32", help="Tenant counts, comma-separated."),
    steps: int = typer.Option(5, min=1, help="Timed rounds per mode (the median is used)."),
    rows_per_tenant: int = typer.Option(4, min=1, help="Rows (one GRPO group) per tenant."),
    completion_len: int = typer.Option(16, min=2, help="Longest completion, in tokens."),
    mixed_lengths: bool = typer.Option(
        False, help="Tenants of different prompt and completion lengths, as task families."
    ),
    microbatch_tokens: int = typer.Option(
        16384, min=64, help="Token budget of one forward/backward of the trainer."
    ),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    modes: str = typer.Option(
        "multi-lane,single-lane,peft",
        help="Modes to time, comma-separated (PEFT takes most of the time at 32 tenants).",
    ),
) -> None:
    """Optimizer steps/s: multi-lane vs single-lane vs PEFT + torch AdamW per tenant."""
    from marlaas.train.bench import MODES, run_trainer_bench

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    unknown = sorted(set(chosen) - set(MODES))
    if not chosen or unknown:
        raise typer.BadParameter(
            f"--modes takes some of {', '.join(MODES)}, got {modes!r}"
            + (f" ({', '.join(unknown)} unknown)" if unknown else "")
        )
    run_trainer_bench(
        model,
        _counts(tenants),
        steps=steps,
        rows_per_tenant=rows_per_tenant,
        completion_len=completion_len,
        max_tokens_per_microbatch=microbatch_tokens,
        mixed_lengths=mixed_lengths,
        modes=chosen,
        json_path=json_out,
        dtype=check_dtype(dtype),
    )
    typer.echo(f"wrote {json_out}")


@app.command("sandbox")
def sandbox(
    json_out: Path = typer.Option(Path("bench-sandbox.json"), "--json", help="Result file."),
    calls: int = typer.Option(
        100, min=1, help="Calls per backend (the machine's CPU is counted in 10 ms ticks)."
    ),
) -> None:
    """Overhead of one sandboxed Python call: bubblewrap warm and cold, the rlimit fallback."""
    from rich.console import Console
    from rich.table import Table

    from marlaas.envs.bench import run_sandbox_bench

    result = run_sandbox_bench(calls, json_out)
    table = Table(title="sandbox overhead per call (print(1))")
    columns = ("backend", "mean ms", "median ms", "min ms", "machine CPU ms", "concurrent calls/s")
    for col in columns:
        table.add_column(col)
    for row in result["rows"]:
        if not row["available"]:
            table.add_row(row["backend"], "unavailable", "", "", "", row["reason"][:40])
            continue
        table.add_row(
            row["backend"],
            f"{row['mean_ms']:.1f}",
            f"{row['median_ms']:.1f}",
            f"{row['min_ms']:.1f}",
            f"{row['machine_cpu_ms']:.1f}",
            f"{row['concurrent_calls_per_s']:.0f}",
        )
    Console().print(table)
    typer.echo(f"wrote {json_out}")


def _ray_spec(path: Path | None) -> RaySpec | None:
    return None if path is None else load_ray_spec(path)


@app.command("paper")
def paper(
    json_out: Path = typer.Option(Path("bench-paper.json"), "--json", help="Result file."),
    quick: bool = typer.Option(
        False, "--quick", help="Small tenant counts and few steps (a few minutes)."
    ),
    tenants: str = typer.Option(
        None, help="Tenant counts, comma-separated (default 1,4,8,16,32; --quick: 1,4)."
    ),
    regime: str = typer.Option("both", help="paper, compute or both."),
    no_trl: bool = typer.Option(False, "--no-trl", help="Skip the TRL GRPOTrainer baseline."),
    steps: int = typer.Option(
        None, min=1, help="RL steps per tenant (default: the workload file's)."
    ),
    baseline_tenants: int = typer.Option(
        None,
        min=1,
        help="Run the baselines on at most this many tenants and extrapolate linearly "
        "(default: all with --quick, else 10).",
    ),
    out: Path = typer.Option(
        None, help="Folder for the run outputs (default: a temporary folder, removed)."
    ),
    paper_workload: str = typer.Option(
        "paper", help="Workload of the paper regime: a shipped name or a file."
    ),
    compute_workload: str = typer.Option(
        "compute", help="Workload of the compute-bound regime: a shipped name or a file."
    ),
    threads: int = typer.Option(1, min=1, help="torch threads for every system."),
    model: Path = typer.Option(None, help="Base model directory (default: embedded)."),
    backend: str = typer.Option(
        "inprocess", help="inprocess or ray: where marlaas and the sync baseline run."
    ),
    ray_spec: Path = typer.Option(
        None, help="YAML file of the Ray spec (RaySpec: address, replicas, resources)."
    ),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
) -> None:
    """The paper's headline table: marlaas async vs the sync baseline vs TRL GRPOTrainer."""
    import tempfile

    from transformers.utils import logging as hf_logging

    from marlaas.bench.paper import (
        DEFAULT_BASELINE_TENANTS,
        DEFAULT_TENANTS,
        QUICK_TENANTS,
        run_paper_bench,
    )
    from marlaas.bench.report import markdown
    from marlaas.bench.workloads import resolve_workload

    if regime not in ("paper", "compute", "both"):
        raise typer.BadParameter(f"--regime must be paper, compute or both, got {regime!r}")
    counts = _counts(tenants) if tenants else (QUICK_TENANTS if quick else DEFAULT_TENANTS)
    names = {"paper": paper_workload, "compute": compute_workload}
    chosen = ("paper", "compute") if regime == "both" else (regime,)
    workloads = [resolve_workload(names[r]) for r in chosen]
    for r, w in zip(chosen, workloads, strict=True):
        if w.regime != r:
            raise typer.BadParameter(f"workload {w.path.name} is a {w.regime} regime, not {r}")
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per run otherwise
    if baseline_tenants is None and not quick:
        baseline_tenants = DEFAULT_BASELINE_TENANTS
    with tempfile.TemporaryDirectory(prefix="marlaas-bench-paper-") as tmp:
        result = run_paper_bench(
            workloads,
            tenant_counts=counts,
            steps=steps,
            quick=quick,
            include_trl=not no_trl,
            baseline_tenants=baseline_tenants,
            out_dir=out if out is not None else Path(tmp),
            json_path=json_out,
            base_path=model,
            threads=threads,
            backend=backend,
            ray=_ray_spec(ray_spec),
            log=typer.echo,
            dtype=check_dtype(dtype),
        )
    typer.echo(markdown(result))
    typer.echo(f"bench wall time {result['bench_wall_s']:.0f} s")
    typer.echo(f"wrote {json_out}, {json_out.with_suffix('.md')}, {json_out.with_suffix('.png')}")


@app.command("dtype")
def dtype_bench(
    json_out: Path = typer.Option(Path("bench-dtype.json"), "--json", help="Result file."),
    tenants: int = typer.Option(12, min=1, help="Tenants of the learning run (each dtype)."),
    steps: int = typer.Option(
        None, min=1, help="RL steps per tenant (default: the workload file's)."
    ),
    workload: str = typer.Option(
        "learning", help="A compute-regime workload: a shipped name or a file."
    ),
    threads: int = typer.Option(1, min=1, help="torch threads."),
    model: Path = typer.Option(None, help="Base model directory (default: embedded)."),
    out: Path = typer.Option(
        None, help="Folder for the run outputs (default: a temporary folder, removed)."
    ),
) -> None:
    """Does bfloat16 learn as well as float32? The same learning run in each dtype."""
    import tempfile

    from transformers.utils import logging as hf_logging

    from marlaas.bench.dtype import markdown, run_dtype_bench
    from marlaas.bench.workloads import resolve_workload

    chosen = resolve_workload(workload)
    if chosen.regime != "compute":
        raise typer.BadParameter(f"workload {chosen.path.name} is not a compute regime")
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="marlaas-bench-dtype-") as tmp:
        result = run_dtype_bench(
            chosen,
            tenants=tenants,
            steps=steps,
            out_dir=out if out is not None else Path(tmp),
            json_path=json_out,
            base_path=model,
            threads=threads,
            log=typer.echo,
        )
    typer.echo(markdown(result))
    typer.echo(f"wrote {json_out}, {json_out.with_suffix('.md')}")


@app.command("api")
def api(
    json_out: Path = typer.Option(Path("bench-api.json"), "--json", help="Result file."),
    jobs: int = typer.Option(32, min=1, help="Jobs training at once."),
    clients: int = typer.Option(8, min=1, help="Client threads polling the API."),
    steps: int = typer.Option(6, min=1, help="RL steps per job."),
    rate: float = typer.Option(
        0.0, min=0.0, help="Requests per second per client, on a fixed schedule; 0: back to back."
    ),
    idle_s: float = typer.Option(
        10.0, min=0.0, help="Seconds to poll again once every job is done (0: skip)."
    ),
    inference_clients: int = typer.Option(
        1, min=0, help="Client threads asking for 16-token completions one after another."
    ),
) -> None:
    """API and inference latency of a real `marlaas serve` while many jobs train, and
    idle after."""
    from marlaas.bench.api import run_api_bench

    run_api_bench(
        jobs=jobs,
        clients=clients,
        steps=steps,
        json_path=json_out,
        rate=rate,
        idle_s=idle_s,
        inference_clients=inference_clients,
    )
    typer.echo(f"wrote {json_out}")


@app.command("tinker")
def tinker_bench(
    json_out: Path = typer.Option(Path("bench-tinker.json"), "--json", help="Result file."),
    clients: str = typer.Option("1,4,16", help="SDK client counts, comma-separated."),
    steps: int = typer.Option(4, min=1, help="RL steps of each client's loop."),
    prompts_per_step: int = typer.Option(8, min=1),
    group_size: int = typer.Option(8, min=2, help="Samples per prompt."),
    loss_fn: str = typer.Option(
        "importance_sampling", help="importance_sampling, ppo, cispo or dro."
    ),
    engine_rows: int | None = typer.Option(
        None,
        min=1,
        max=4096,
        help="The server's engine rows (serve --max-batch-rows); default: one step's "
        "samples of every client of the largest N (prompts x group x N, at most 4096).",
    ),
) -> None:
    """N tinker SDK clients running the same RL loop on one marlaas serve: together vs
    one after another (wall-time ratio, tokens/s, passes shared)."""
    from marlaas.bench.tinker import run_tinker_bench
    from marlaas.bench.tinker_loop import LoopConfig

    if loss_fn not in ("importance_sampling", "ppo", "cispo", "dro"):
        raise typer.BadParameter(
            f"unknown loss {loss_fn!r}; use importance_sampling, ppo, cispo or dro"
        )
    config = LoopConfig(
        steps=steps,
        prompts_per_step=prompts_per_step,
        group_size=group_size,
        loss_fn=loss_fn,  # type: ignore[arg-type]  # checked just above
        eval_prompts=0,
    )
    run_tinker_bench(_counts(clients), config, json_out, engine_rows=engine_rows)
    typer.echo(f"wrote {json_out}")
