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
