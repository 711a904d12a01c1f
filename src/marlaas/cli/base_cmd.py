"""`marlaas base ...`: build and evaluate the embedded default base model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(no_args_is_help=True, help="Build and evaluate the base model.")
console = Console()


@app.command("build")
def build(
    out: Path = typer.Option(None, help="Output directory (default: the embedded base)."),
    max_steps: int = typer.Option(None, help="Override the recipe's step limit."),
    seed: int = typer.Option(None, help="Seed of data, init and batch order (default: recipe's)."),
) -> None:
    """Train the embedded base from the built-in task families (reproducible)."""
    from dataclasses import replace

    from marlaas.model.base import default_base_path
    from marlaas.model.build import BuildRecipe, build_base

    recipe = BuildRecipe()
    if seed is not None:
        recipe = replace(recipe, seed=seed)
    if max_steps is not None:
        recipe = replace(recipe, max_steps=max_steps)
    target = out or default_base_path()
    facts = build_base(target, recipe, log=console.print)
    console.print(
        f"built {target} in {facts['build_seconds']} s ({facts['parameters']} parameters)"
    )


@app.command("eval")
def evaluate(
    model: Path = typer.Option(
        None, help="A Hugging Face causal LM directory (default: embedded)."
    ),
    episodes: int = typer.Option(100, help="Held-out episodes per family."),
    json_out: Path = typer.Option(None, "--json", help="Also write the scores to this JSON file."),
    seed: int = typer.Option(0, help="Seed of the eval split and of sampling."),
) -> None:
    """Per-family held-out accuracy of a base model, greedy and sampled."""
    show_base_accuracy(model, episodes, seed, json_out)


def show_base_accuracy(model: Path | None, episodes: int, seed: int, json_out: Path | None) -> None:
    from marlaas.fileio import atomic_write_json
    from marlaas.model.base import default_base_path, load_base
    from marlaas.model.evaluate import as_json, evaluate_base

    path = model or default_base_path()
    lm, tokenizer = load_base(path)
    scores = asyncio.run(evaluate_base(lm, tokenizer, episodes=episodes, seed=seed))
    table = Table(title=f"held-out accuracy of {path.name}")
    for col in ("family", "episodes", "greedy", "sampled (T=1)"):
        table.add_column(col, justify="right" if col != "family" else "left")
    for s in scores:
        table.add_row(s.family, str(s.episodes), f"{s.greedy:.1%}", f"{s.sampled:.1%}")
    console.print(table)
    if json_out is not None:
        payload = {"model": str(path), "seed": seed, **as_json(scores)}
        atomic_write_json(json_out, payload)
        console.print(f"wrote {json_out}")
