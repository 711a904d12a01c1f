"""Entry point of the `marlaas` command. Sub-commands live beside this file, one module
per concern, and are mounted here."""

from __future__ import annotations

import typer

from marlaas import __version__

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.callback()
def main() -> None:
    """marlaas: many tenants fine-tune one shared language model with RL, at once."""


@app.command()
def version() -> None:
    """Print the marlaas version."""
    typer.echo(__version__)
