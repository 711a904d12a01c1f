"""`marlaas run JOBS.yaml`: run a set of tenant jobs in-process, no server.

The run folder gets the resolved spec, metrics and events (JSONL), a Perfetto trace,
PNG plots, per-tenant checkpoints and each tenant's final adapter in PEFT format.

Exit status: 0 when every job finished, 1 when any job failed (each failed job and its
reason are printed to stderr; the others' results are still written), 2 when the run
could not start (a bad spec, a model it cannot serve).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from marlaas.cli.process import device_process

if TYPE_CHECKING:
    from marlaas.config.job import RunSpec
    from marlaas.pipeline.runner import RunResult

console = Console()


def run(
    jobs_file: Path = typer.Argument(..., help="YAML file with a `jobs:` list (RunSpec)."),
    out: Path = typer.Option(None, help="Run folder (default: runs/<time>)."),
    mode: str = typer.Option("async", help="async (marlaas) or sync (the baseline loop)."),
    resume: bool = typer.Option(False, help="Continue each job from its last checkpoint."),
    live: bool = typer.Option(True, help="Show the live progress view."),
    backend: str = typer.Option(
        None, help="inprocess or ray (default: the file's `backend:`, else inprocess)."
    ),
) -> None:
    """Run tenant jobs on one shared base; write a run folder."""
    device_process()
    from marlaas.config.job import load_run_spec
    from marlaas.errors import ConfigError

    if mode not in ("async", "sync"):
        raise ConfigError(f"--mode must be 'async' or 'sync', got {mode!r}")
    if backend not in (None, "inprocess", "ray"):
        raise ConfigError(f"--backend must be 'inprocess' or 'ray', got {backend!r}")
    spec = load_run_spec(jobs_file)
    if backend is not None:
        spec = spec.updated(backend=backend)
    out = out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    result = execute(spec, out, mode=mode, restore=resume, live=live)
    failed = failures(result)
    if failed:
        for name, reason in failed.items():
            typer.echo(f"job {name} failed: {reason}", err=True)
        typer.echo(f"{len(failed)} of {len(spec.jobs)} jobs failed; see {out}", err=True)
        raise typer.Exit(1)


def failures(result: object) -> dict[str, str]:
    """Job name -> why, for every job of a `RunResult` that did not finish."""
    from marlaas.pipeline.runner import RunResult

    assert isinstance(result, RunResult)
    return {
        t.name: t.failure_reason or t.status for t in result.tenants.values() if t.status != "done"
    }


def execute(spec: object, out: Path, *, mode: str, restore: bool, live: bool) -> object:
    """Run `spec` with a recorder, live view, trace and plots; print the final table."""
    from marlaas.config.job import RunSpec

    assert isinstance(spec, RunSpec)
    result = record_run(spec, out, mode=mode, restore=restore, live=live)
    table = Table(title=f"{mode} run: {len(spec.jobs)} jobs, {result.wall_s:.1f} s")
    for col in ("job", "status", "steps", "eval before", "eval after", "max staleness"):
        table.add_column(col)
    for t in result.tenants.values():
        table.add_row(
            t.name,
            t.status if not t.failure_reason else f"{t.status}: {t.failure_reason[:60]}",
            f"{t.steps_done}/{t.steps}",
            "-" if t.eval_before is None else f"{t.eval_before:.1%}",
            "-" if t.eval_after is None else f"{t.eval_after:.1%}",
            str(t.staleness_max),
        )
    console.print(table)
    console.print(
        f"device busy {result.device_busy_fraction:.1%} of {result.wall_s:.1f} s; "
        f"mean decode batch {result.mean_decode_batch:.1f}; "
        f"{result.tokens_generated} tokens generated, {result.tokens_trained} trained; "
        f"staleness violations {result.staleness_violations}"
    )
    console.print(f"run folder: {out} (trace.json opens in ui.perfetto.dev)")
    return result


def record_run(
    spec: RunSpec, out: Path, *, mode: str, restore: bool, live: bool, title: str = "marlaas"
) -> RunResult:
    """Run `spec` into the run folder `out` with a recorder (metrics, events, summary),
    the live view when `live`, then the trace and the plots; return the `RunResult`."""
    from marlaas.backends import open_backend
    from marlaas.obs.live import LiveView
    from marlaas.obs.memory import RunRecorder
    from marlaas.obs.plots import write_plots
    from marlaas.obs.trace import write_trace
    from marlaas.pipeline.runner import Mode, run_jobs

    out.mkdir(parents=True, exist_ok=True)
    recorder = RunRecorder(out)
    totals = {job.name: job.steps for job in spec.jobs}
    run_mode: Mode = "sync" if mode == "sync" else "async"  # the callers checked it

    def run() -> RunResult:
        return asyncio.run(
            run_jobs(
                spec, out, backend=open_backend, mode=run_mode, recorder=recorder, restore=restore
            )
        )

    try:
        if live:
            with LiveView(recorder, total_steps=totals, console=console, title=title):
                result = run()
        else:
            result = run()
    finally:
        recorder.close()
    write_trace(recorder, out / "trace.json")
    write_plots(recorder, out)
    return result
