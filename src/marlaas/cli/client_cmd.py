"""The tenant's commands against a running server: `submit`, `jobs`, `show`, `logs`,
`cancel`, `pause`, `resume`, `delete`, `checkpoints`, `download` (thin wrappers over
`marlaas.client.Client`).

The server and key come from `--url`/`--key` or $MARLAAS_URL/$MARLAAS_API_KEY. Errors
are `ClientError`s carrying the server's message; the console entry point prints them
as one line. Long waits (`logs -f`, `submit --wait`, `download`) show progress bars.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from marlaas.client import Client, Job, JobEvent

console = Console()

UrlOption = typer.Option(
    None,
    "--url",
    envvar="MARLAAS_URL",
    help="Server URL (default: $MARLAAS_URL, else http://127.0.0.1:8321).",
    show_default=False,
)
KeyOption = typer.Option(
    None,
    "--key",
    envvar="MARLAAS_API_KEY",
    help="Your API key (default: $MARLAAS_API_KEY).",
    show_default=False,
)
JobArg = typer.Argument(..., help="The job's id (see `marlaas jobs`).")

_STATUS_STYLE = {
    "queued": "yellow",
    "running": "cyan",
    "paused": "magenta",
    "done": "green",
    "failed": "red",
    "cancelled": "dim",
}


@contextmanager
def _client(url: str | None, key: str | None) -> Iterator[Client]:
    from marlaas.client import Client

    with Client(url, key) as client:
        yield client


def _status(status: str) -> Text:
    return Text(status, style=_STATUS_STYLE.get(status, ""))


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _metrics(metrics: dict[str, Any]) -> str:
    return " ".join(f"{k}={_num(v)}" for k, v in sorted(metrics.items()))


def describe(event: JobEvent) -> Text:
    """One line for an event, as `logs` prints it."""
    when = event.time.astimezone().strftime("%H:%M:%S")
    data = event.data
    line = Text(f"{when} #{event.id} ", style="dim")
    if event.kind == "status":
        line.append("status ")
        line.append_text(_status(str(data.get("status"))))
        if data.get("action"):
            line.append(f" (you asked to {data['action']})")
        if data.get("reason"):
            line.append(f": {data['reason']}")
    elif event.kind == "step":
        line.append(f"step {data.get('step')}  {_metrics(data.get('metrics') or {})}")
    elif event.kind == "checkpoint":
        metrics = _metrics(data.get("metrics") or {})
        line.append(f"checkpoint at step {data.get('step')}  {metrics}".rstrip())
    else:
        line.append(f"{event.kind} {json.dumps(data)}")
    return line


def _step_progress() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _follow(
    client: Client, job: Job, progress: Progress, on_event: Callable[[JobEvent], None] | None
) -> Job:
    """Follow `job`'s events to its end, moving its bar; returns the final job."""
    task: TaskID = progress.add_task(job.name, total=job.steps, completed=job.steps_done)

    def update(event: JobEvent) -> None:
        if on_event is not None:
            on_event(event)
        if event.kind == "step":
            progress.update(task, completed=int(event.data.get("step", 0)))
        elif event.kind == "status":
            progress.update(task, description=f"{job.name} ({event.data.get('status')})")

    final = client.wait(job.id, progress=update)
    progress.update(task, completed=final.steps_done, description=f"{job.name} ({final.status})")
    return final


def _job_table(jobs: list[Job], title: str | None = None) -> Table:
    table = Table(title=title)
    table.add_column("id", no_wrap=True)
    for col in ("name", "status", "steps", "priority", "updated"):
        table.add_column(col)
    for job in jobs:
        status = _status(job.status)
        if job.failure_reason:
            status.append(f": {job.failure_reason[:60]}")
        table.add_row(
            job.id,
            job.name,
            status,
            f"{job.steps_done}/{job.steps}",
            f"{job.priority:g}",
            job.updated_at.astimezone().strftime("%Y-%m-%d %H:%M:%S"),
        )
    return table


def submit(
    job_file: Path = typer.Argument(
        ..., help="YAML file: one job, a list of jobs, or a `jobs:` list."
    ),
    wait: bool = typer.Option(False, "--wait", help="Follow the jobs until they end."),
    url: str | None = UrlOption,
    key: str | None = KeyOption,
) -> None:
    """Submit the job(s) in a YAML file."""
    from marlaas.client import load_job_specs

    specs = load_job_specs(job_file)
    with _client(url, key) as client:
        created: list[Job] = []
        try:
            for spec in specs:
                created.append(client.submit(spec))
        finally:  # say what was created even when a later job is refused
            if created:
                console.print(_job_table(created, title="submitted"))
        if not wait:
            return
        with _step_progress() as progress:
            finals = [_follow(client, job, progress, None) for job in created]
    console.print(_job_table(finals, title="finished"))
    if any(job.status != "done" for job in finals):
        raise typer.Exit(1)


def jobs(
    status: str | None = typer.Option(None, "--status", help="Only jobs in this status."),
    limit: int = typer.Option(100, min=1, max=1000, help="At most this many."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    url: str | None = UrlOption,
    key: str | None = KeyOption,
) -> None:
    """List your jobs, newest first."""
    with _client(url, key) as client:
        found = client.jobs(status=status, limit=limit)
    if as_json:
        typer.echo(json.dumps([j.model_dump(mode="json") for j in found], indent=2))
    elif not found:
        console.print("no jobs" + (f" with status {status}" if status else ""))
    else:
        console.print(_job_table(found))


def show(
    job_id: str = JobArg,
    as_json: bool = typer.Option(False, "--json", help="Print the job as JSON."),
    url: str | None = UrlOption,
    key: str | None = KeyOption,
) -> None:
    """Show a job: status, progress, spec, latest metrics and checkpoints."""
    with _client(url, key) as client:
        job = client.job(job_id)
        if as_json:
            typer.echo(json.dumps(job.model_dump(mode="json"), indent=2))
            return
        points = client.metrics(job_id, since_step=max(job.steps_done, 1))
        ckpts = client.checkpoints(job_id)
    table = Table(show_header=False, title=f"job {job.id}")
    table.add_column("field", style="bold")
    table.add_column("value")
    spec = job.spec
    task = spec.get("task", {})
    status = _status(job.status)
    if job.failure_reason:
        status.append(f": {job.failure_reason}")
    rows: list[tuple[str, str | Text]] = [
        ("name", job.name),
        ("status", status),
        ("steps", f"{job.steps_done}/{job.steps}"),
        ("task", str(task.get("family") or task.get("path") or task)),
        (
            "lora",
            f"rank {spec.get('lora', {}).get('rank')}, alpha {spec.get('lora', {}).get('alpha')}",
        ),
        ("priority", f"{job.priority:g}"),
        ("created", job.created_at.astimezone().strftime("%Y-%m-%d %H:%M:%S")),
        ("updated", job.updated_at.astimezone().strftime("%Y-%m-%d %H:%M:%S")),
    ]
    if points:
        step = points[-1].step
        latest = {p.name: p.value for p in points if p.step == step}
        rows.append((f"metrics (step {step})", _metrics(latest)))
    rows.append(("checkpoints", ", ".join(str(c.step) for c in ckpts) or "none yet"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def logs(
    job_id: str = JobArg,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep following until the job ends."),
    after: int = typer.Option(0, "--after", min=0, help="Only events after this id."),
    url: str | None = UrlOption,
    key: str | None = KeyOption,
) -> None:
    """Print a job's events (status changes, steps with metrics, checkpoints)."""
    with _client(url, key) as client:
        if not follow:
            for event in client.events(job_id, after=after, follow=False):
                console.print(describe(event))
            return
        job = client.job(job_id)
        with _step_progress() as progress:
            task = progress.add_task(job.name, total=job.steps, completed=job.steps_done)
            for event in client.events(job_id, after=after):
                progress.console.print(describe(event))
                if event.kind == "step":
                    progress.update(task, completed=int(event.data.get("step", 0)))
                elif event.kind == "status":
                    progress.update(task, description=f"{job.name} ({event.data.get('status')})")
        final = client.job(job_id)
    console.print(Text(f"job {final.id} ({final.name}) ended: ").append_text(_status(final.status)))


def _act(action: str, job_id: str, url: str | None, key: str | None) -> None:
    with _client(url, key) as client:
        job: Job = getattr(client, action)(job_id)
    console.print(Text(f"job {job.id} ({job.name}) is now ").append_text(_status(job.status)))


def cancel(job_id: str = JobArg, url: str | None = UrlOption, key: str | None = KeyOption) -> None:
    """Cancel a job for good."""
    _act("cancel", job_id, url, key)


def pause(job_id: str = JobArg, url: str | None = UrlOption, key: str | None = KeyOption) -> None:
    """Pause a queued or running job."""
    _act("pause", job_id, url, key)


def resume(job_id: str = JobArg, url: str | None = UrlOption, key: str | None = KeyOption) -> None:
    """Resume a paused job."""
    _act("resume", job_id, url, key)


def delete(
    job_id: str = JobArg,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    url: str | None = UrlOption,
    key: str | None = KeyOption,
) -> None:
    """Delete a done, failed or cancelled job with its checkpoints and adapters, for good."""
    with _client(url, key) as client:
        job = client.job(job_id)
        if not yes:
            console.print(
                Text(f"job {job.id} ({job.name}) is ").append_text(_status(job.status))
                + Text(
                    f", {job.steps_done}/{job.steps} steps; deleting it removes its "
                    "checkpoints and adapters for good (the steps it used still count "
                    "toward your quota)"
                )
            )
            typer.confirm("Delete it?", abort=True)
        client.delete_job(job.id)
    console.print(f"job {job.id} ({job.name}) deleted, with its checkpoints and adapters")


def checkpoints(
    job_id: str = JobArg, url: str | None = UrlOption, key: str | None = KeyOption
) -> None:
    """List a job's checkpoints with their metrics."""
    with _client(url, key) as client:
        found = client.checkpoints(job_id)
    if not found:
        console.print(f"job {job_id} has no checkpoints yet")
        return
    table = Table(title=f"checkpoints of {job_id}")
    for col in ("step", "metrics", "created"):
        table.add_column(col)
    for c in found:
        created = c.created_at.astimezone().strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(str(c.step), _metrics(c.metrics), created)
    console.print(table)


def download(
    job_id: str = JobArg,
    out: Path = typer.Option(..., "--out", help="Directory to create (a PEFT adapter)."),
    version: int | None = typer.Option(
        None, "--version", min=0, help="Checkpoint step (default: the newest / final)."
    ),
    fmt: str = typer.Option("tar.gz", "--format", help="Archive on the wire: tar.gz or zip."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out if it exists."),
    url: str | None = UrlOption,
    key: str | None = KeyOption,
) -> None:
    """Download a checkpoint's adapter as a PEFT directory."""
    from marlaas.client import ClientError

    if fmt not in ("tar.gz", "zip"):
        raise ClientError(f"--format must be tar.gz or zip, got {fmt!r}")
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
    )
    with _client(url, key) as client, progress:
        task = progress.add_task(f"adapter of {job_id}", total=None)

        def moved(received: int, total: int | None) -> None:
            progress.update(task, completed=received, total=total)

        got = client.download(
            job_id,
            out,
            version,
            fmt="zip" if fmt == "zip" else "tar.gz",
            progress=moved,
            overwrite=overwrite,
        )
        progress.update(task, total=progress.tasks[0].completed)
    console.print(f"adapter of job {job_id} at step {got.step} saved to {got.path} (PEFT format)")


COMMANDS: dict[str, Callable[..., None]] = {
    "submit": submit,
    "jobs": jobs,
    "show": show,
    "logs": logs,
    "cancel": cancel,
    "pause": pause,
    "resume": resume,
    "delete": delete,
    "checkpoints": checkpoints,
    "download": download,
}


def register(app: typer.Typer) -> None:
    """Mount the client commands on the `marlaas` app."""
    for name, command in COMMANDS.items():
        app.command(name)(command)
