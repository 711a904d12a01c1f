"""`marlaas demo` (what `make demo` runs): many tenants RL-fine-tune the embedded base at
once, then the same work's time under the synchronous baseline is measured on a slice and
extrapolated (`marlaas.pipeline.estimate`).

The run folder is a `marlaas run` folder (resolved spec, metrics, events, trace, plots,
checkpoints, PEFT adapters), plus `sync-slice/` (the baseline's slice run: spec, metrics,
events, trace, result), `sync_estimate.json` (the estimate and its inputs) and, with
`--sync`, `sync/` (the full baseline run, a `marlaas run` folder).
"""

from __future__ import annotations

import asyncio
import os
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from marlaas.cli.process import device_process

if TYPE_CHECKING:
    from marlaas.config.job import JobSpec, RunSpec
    from marlaas.pipeline.estimate import SyncEstimate
    from marlaas.pipeline.runner import RunResult

#: The packaged job set (package data of `marlaas`).
DEMO_JOBS = ("examples", "demo.yaml")


def load_demo_spec(jobs: Path | None) -> RunSpec:
    """The job set of `jobs`, or the packaged demo set."""
    from marlaas.config.job import load_run_spec

    if jobs is not None:
        return load_run_spec(jobs)
    with resources.as_file(resources.files("marlaas").joinpath(*DEMO_JOBS)) as path:
        return load_run_spec(path)


def demo(
    jobs: Path = typer.Option(
        None, "--jobs", help="A JOBS.yaml to run instead of the packaged demo set."
    ),
    out: Path = typer.Option(None, help="Run folder, new or empty (default: runs/demo-<time>)."),
    live: bool = typer.Option(True, help="Show the live progress view."),
    sync: bool = typer.Option(
        False, "--sync", help="Also run the whole synchronous baseline (doubles the wait)."
    ),
    slice_steps: int = typer.Option(
        2, min=1, help="Steps per tenant of the measured synchronous slice."
    ),
    threads: int = typer.Option(1, min=1, help="torch CPU threads."),
) -> None:
    """Many tenants fine-tune one shared base at once; eval before/after, device
    utilization, and the same work's time under the synchronous baseline."""
    device_process()
    import torch

    from marlaas.cli.run_cmd import record_run
    from marlaas.errors import ConfigError

    console = Console()
    if not console.is_terminal:  # a log file or pipe: no need to squeeze the table into 80
        console = Console(width=max(console.width, 120))
    spec = load_demo_spec(jobs)
    out = out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder; choose a new one")
    torch.set_num_threads(threads)
    # The base loads twice (the run, the baseline's slice); its progress bar is noise here.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    families = sorted({_family(job) for job in spec.jobs})
    console.print(
        f"[bold]marlaas demo[/]: {len(spec.jobs)} tenants over {len(families)} task families "
        f"({', '.join(families)}), one LoRA adapter each, one shared base; "
        f"{sum(j.steps for j in spec.jobs)} RL steps in all. Run folder: {out}"
    )
    result = record_run(
        spec, out, mode="async", restore=False, live=live, title="marlaas demo (async)"
    )
    loads = [_load()]
    full_sync = None
    if sync:
        console.print("running the whole synchronous baseline for comparison ...")
        full_sync = record_run(
            spec, out / "sync", mode="sync", restore=False, live=live, title="sync baseline"
        )
        loads.append(_load())
    console.print(f"measuring the synchronous baseline on {slice_steps} step(s) of each tenant ...")
    estimate, slice_result = _measure_sync(spec, out / "sync-slice", slice_steps, live, console)
    loads.append(_load())
    _report(console, spec, result, estimate, slice_result, full_sync)
    cpus = os.cpu_count() or 1
    if max(loads) > cpus + 1:  # this demo alone keeps about one or two CPUs busy
        console.print(
            f"note: other work was running on this machine (1-minute load average up to "
            f"{max(loads):.1f} on {cpus} CPUs); wall times, and so the comparison, are noisy."
        )
    console.print(
        f"run folder: {out} (trace.json opens in ui.perfetto.dev; the baseline's slice is "
        f"in sync-slice/); demo took {time.perf_counter() - started:.0f} s in all"
    )


def _load() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def _family(job: JobSpec) -> str:
    """The job's task family, or its dataset's file name."""
    from marlaas.config.specs import TaskSpec

    task = job.task
    return task.family if isinstance(task, TaskSpec) else f"dataset {Path(task.path).name}"


def _measure_sync(
    spec: RunSpec, out: Path, slice_steps: int, live: bool, console: Console
) -> tuple[SyncEstimate, RunResult]:
    """Run the baseline's slice into `out` (recorder files, trace, live view) and write
    the estimate next to the demo's run folder."""
    from marlaas.backends import open_backend
    from marlaas.fileio import atomic_write_json
    from marlaas.obs.live import LiveView
    from marlaas.obs.memory import RunRecorder
    from marlaas.obs.trace import write_trace
    from marlaas.pipeline.estimate import estimate_sync_time, slice_spec

    out.mkdir(parents=True, exist_ok=True)
    recorder = RunRecorder(out)
    totals = {job.name: job.steps for job in slice_spec(spec, slice_steps).jobs}

    def measure() -> tuple[SyncEstimate, RunResult]:
        return asyncio.run(
            estimate_sync_time(
                spec, out, backend=open_backend, slice_steps=slice_steps, recorder=recorder
            )
        )

    try:
        if live:
            title = f"sync baseline, {slice_steps} step(s) per tenant"
            with LiveView(recorder, total_steps=totals, console=console, title=title):
                estimate, result = measure()
        else:
            estimate, result = measure()
    finally:
        recorder.close()
    write_trace(recorder, out / "trace.json")
    atomic_write_json(out.parent / "sync_estimate.json", estimate.to_json(), sort_keys=True)
    return estimate, result


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _report(
    console: Console,
    spec: RunSpec,
    result: RunResult,
    estimate: SyncEstimate,
    slice_result: RunResult,
    full_sync: RunResult | None,
) -> None:
    tenants = [(job, result.tenants[job.name]) for job in spec.jobs if job.name in result.tenants]
    show_status = any(t.status != "done" for _, t in tenants)
    table = Table(title=f"marlaas demo: {len(tenants)} tenants, one shared base")
    table.add_column("tenant")
    table.add_column("task")
    if show_status:
        table.add_column("status")
    for col in ("steps", "eval before", "eval after", "change", "sync time (est.)"):
        table.add_column(col, justify="right")
    for job, t in tenants:
        change = "-"
        if t.eval_before is not None and t.eval_after is not None:
            change = f"{100 * (t.eval_after - t.eval_before):+.1f} pt"
        tenant_estimate = estimate.tenants.get(job.name)
        status = [t.status if not t.failure_reason else f"{t.status}: {t.failure_reason[:50]}"]
        table.add_row(
            job.name,
            _family(job),
            *(status if show_status else []),
            f"{t.steps_done}/{t.steps}",
            _pct(t.eval_before),
            _pct(t.eval_after),
            change,
            "-" if tenant_estimate is None else f"{tenant_estimate.total_s:.1f} s",
        )
    console.print(table)
    episodes = "/".join(sorted({str(job.eval_episodes) for job in spec.jobs}, key=int))
    console.print(
        f"eval: greedy accuracy on {episodes} held-out episodes of the tenant's task, "
        "before its first step and after its last."
    )
    steps = sum(t.steps_done for _, t in tenants)
    console.print(
        f"[bold]marlaas (async)[/]: {steps} RL steps in [bold]{result.wall_s:.1f} s[/] wall, "
        f"device busy [bold]{result.device_busy_fraction:.1%}[/] (mean decode batch "
        f"{result.mean_decode_batch:.1f} rows; tenants per train step up to "
        f"{result.max_tenants_per_train_step}; staleness violations "
        f"{result.staleness_violations})"
    )
    sync_s = estimate.total_s
    comparison = ""
    if sync_s > 0 and result.wall_s > 0:
        comparison = (
            f" -> marlaas took {result.wall_s / sync_s:.2f}x that time "
            f"({sync_s / result.wall_s:.2f}x faster)"
        )
    console.print(
        f"[bold]synchronous baseline, same work[/]: [bold]{sync_s:.1f} s[/] estimated "
        f"(device busy {slice_result.device_busy_fraction:.1%} in its measured slice)"
        f"{comparison}"
    )
    if full_sync is not None:
        console.print(
            f"[bold]synchronous baseline, same work, measured (--sync)[/]: "
            f"{full_sync.wall_s:.1f} s wall, device busy {full_sync.device_busy_fraction:.1%}"
        )
    console.print(f"how the sync time was estimated: {estimate.explain()}", highlight=False)
