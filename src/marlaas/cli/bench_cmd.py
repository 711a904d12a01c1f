"""`marlaas bench ...`: side-by-side benchmarks that print a table and write JSON.

Benchmarks never assert timings; they report ratios measured in one run.
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, help="Benchmarks (a table on screen, JSON on disk).")


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
) -> None:
    """Optimizer steps/s: multi-lane vs single-lane vs PEFT + torch AdamW per tenant."""
    from marlaas.train.bench import run_trainer_bench

    run_trainer_bench(
        model,
        _counts(tenants),
        steps=steps,
        rows_per_tenant=rows_per_tenant,
        completion_len=completion_len,
        json_path=json_out,
    )
    typer.echo(f"wrote {json_out}")


@app.command("sandbox")
def sandbox(
    json_out: Path = typer.Option(Path("bench-sandbox.json"), "--json", help="Result file."),
    calls: int = typer.Option(20, min=1, help="Calls per backend."),
) -> None:
    """Overhead of one sandboxed Python call, bubblewrap vs the rlimit fallback."""
    from rich.console import Console
    from rich.table import Table

    from marlaas.envs.bench import run_sandbox_bench

    result = run_sandbox_bench(calls, json_out)
    table = Table(title="sandbox overhead per call (print(1))")
    for col in ("backend", "mean ms", "median ms", "min ms", "concurrent calls/s"):
        table.add_column(col)
    for row in result["rows"]:
        if not row["available"]:
            table.add_row(row["backend"], "unavailable", "", "", row["reason"][:40])
            continue
        table.add_row(
            row["backend"],
            f"{row['mean_ms']:.1f}",
            f"{row['median_ms']:.1f}",
            f"{row['min_ms']:.1f}",
            f"{row['concurrent_calls_per_s']:.0f}",
        )
    Console().print(table)
    typer.echo(f"wrote {json_out}")
