"""Entry point of the `marlaas` command. Sub-commands live beside this file, one module
per concern, and are mounted here."""

from __future__ import annotations

import sys

import typer

from marlaas import __version__
from marlaas.cli import base_cmd, bench_cmd, client_cmd, demo_cmd, run_cmd, serve_cmd
from marlaas.errors import MarlaasError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def main() -> None:
    """marlaas: many tenants fine-tune one shared language model with RL, at once."""


app.add_typer(base_cmd.app, name="base")
app.add_typer(bench_cmd.app, name="bench")
app.command("run")(run_cmd.run)
app.command("demo")(demo_cmd.demo)
app.command("serve")(serve_cmd.serve)
client_cmd.register(app)  # submit, jobs, show, logs, ... against a server


@app.command()
def version() -> None:
    """Print the marlaas version."""
    typer.echo(__version__)


def run() -> None:
    """The console entry point: our own errors are one clear line, not a traceback."""
    try:
        app(prog_name="marlaas")
    except MarlaasError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
