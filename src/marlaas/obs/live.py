"""`LiveView`: a live terminal view of a run, drawn with rich from a `RunRecorder`.

One row per tenant (a progress bar of step / total steps, the latest step's mean
reward and the latest eval accuracy, the tenant's status), all read from the tenant's
typed progress records (`obs.progress`) as the recorder keeps them; the device's utilization over the whole run and over
the last few seconds, and the elapsed time.

It never runs on the event loop: on a terminal, rich's `Live` redraws from its own
refresh thread; elsewhere (a pipe, a log file, CI) a daemon thread prints one plain
line per `log_every_s` instead of cursor movements. Both only read the recorder, whose
queries are short under its lock, so a redraw never holds up the device thread.
Use it as a context manager (plain or `async with`) around the run.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from marlaas.obs.memory import RunRecorder


def format_elapsed(seconds: float) -> str:
    """`H:MM:SS` of a non-negative duration."""
    whole = max(int(seconds), 0)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


@dataclass(frozen=True, slots=True)
class TenantRow:
    """What the view shows of one tenant."""

    tenant: str
    step: int | None
    total: int | None
    reward: float | None
    eval_accuracy: float | None
    status: str

    @property
    def progress(self) -> str:
        step = 0 if self.step is None else self.step
        return f"{step}/{self.total}" if self.total is not None else str(step)


class LiveView:
    """Shows a run's progress while it runs; see the module docstring.

    `total_steps` is one number for every tenant, a number per tenant, or None to take
    each tenant's total from its `TenantQueued` record.
    """

    def __init__(
        self,
        recorder: RunRecorder,
        *,
        total_steps: int | Mapping[str, int] | None = None,
        console: Console | None = None,
        refresh_s: float = 0.5,
        log_every_s: float = 10.0,
        window_s: float = 10.0,
        title: str = "marlaas",
    ) -> None:
        if refresh_s <= 0 or log_every_s <= 0 or window_s <= 0:
            raise ValueError("refresh_s, log_every_s and window_s must be > 0 seconds")
        self.recorder = recorder
        self.console = Console() if console is None else console
        self.refresh_s = refresh_s
        self.log_every_s = log_every_s
        self.window_s = window_s
        self.title = title
        self._total_steps = total_steps
        self._live: Live | None = None
        self._logger: threading.Thread | None = None
        self._stop = threading.Event()

    # -- what is shown ------------------------------------------------------------

    def rows(self) -> list[TenantRow]:
        """One row per tenant, in the order the recorder first saw them."""
        totals = self._totals()
        rows = []
        for tenant in self.recorder.tenants():
            steps = self.recorder.steps(tenant)
            evals = self.recorder.evals(tenant)
            step = steps[-1][0] if steps else None
            job_status = self.recorder.job_status(tenant)
            if job_status is not None:
                status = str(job_status)
            else:
                status = "pending" if step is None else "running"
            rows.append(
                TenantRow(
                    tenant,
                    step,
                    totals.get(tenant),
                    steps[-1][1].reward_mean if steps else None,
                    evals[-1][1] if evals else None,
                    status,
                )
            )
        return rows

    def utilization(self) -> tuple[float, float]:
        """Device busy fraction over the whole run and over the last `window_s`."""
        now = self.recorder.now()
        recent_start = max(self.recorder.origin, now - self.window_s)
        return (
            self.recorder.busy_fraction("device", end=now),
            self.recorder.busy_fraction("device", recent_start, now),
        )

    def render(self) -> RenderableType:
        """The rich renderable of the current state."""
        overall, recent = self.utilization()
        elapsed = self.recorder.now() - self.recorder.origin
        header = Table.grid(padding=(0, 2))
        header.add_row(
            Text(self.title, style="bold"),
            Text(f"elapsed {format_elapsed(elapsed)}"),
            Text("device"),
            ProgressBar(total=1.0, completed=overall, width=20),
            Text(f"{overall:.0%} (last {self.window_s:.0f} s: {recent:.0%})"),
        )
        table = Table(expand=False, show_edge=False, pad_edge=False)
        for column in ("tenant", "progress", "step", "reward", "eval acc", "status"):
            table.add_column(column, justify="right" if column != "tenant" else "left")
        for row in self.rows():
            step = row.step or 0
            table.add_row(
                row.tenant,
                # total None: rich draws a pulsing bar
                ProgressBar(total=row.total, completed=min(step, row.total or step), width=30),
                row.progress,
                _number(row.reward, ".3f"),
                _number(row.eval_accuracy, ".1%"),
                row.status,
            )
        return Group(header, table)

    def status_line(self) -> str:
        """The plain one-line form used when stdout is not a terminal."""
        overall, recent = self.utilization()
        elapsed = self.recorder.now() - self.recorder.origin
        parts = [f"[{format_elapsed(elapsed)}] device {overall:.0%} (recent {recent:.0%})"]
        for row in self.rows():
            reward = _number(row.reward, ".3f")
            acc = _number(row.eval_accuracy, ".1%")
            parts.append(f"{row.tenant} {row.progress} reward={reward} acc={acc} {row.status}")
        return " | ".join(parts)

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Start redrawing (terminal) or logging (anything else); returns at once."""
        if self._live is not None or self._logger is not None:
            return
        if self.console.is_terminal:
            self._live = Live(
                get_renderable=self.render,
                console=self.console,
                refresh_per_second=1.0 / self.refresh_s,
            )
            self._live.start()
        else:
            self._stop.clear()
            self._logger = threading.Thread(target=self._log, name="marlaas-live", daemon=True)
            self._logger.start()

    def stop(self) -> None:
        """Draw or log the final state once more and stop. Idempotent."""
        if self._live is not None:
            self._live.refresh()
            self._live.stop()
            self._live = None
        if self._logger is not None:
            self._stop.set()
            self._logger.join()
            self._logger = None

    def _log(self) -> None:
        while not self._stop.wait(self.log_every_s):
            self._print_line()
        self._print_line()

    def _print_line(self) -> None:
        self.console.print(self.status_line(), markup=False, highlight=False, soft_wrap=True)

    def _totals(self) -> dict[str, int]:
        if isinstance(self._total_steps, int):
            return {t: self._total_steps for t in self.recorder.tenants()}
        if self._total_steps is not None:
            return dict(self._total_steps)
        totals: dict[str, int] = {}
        for tenant in self.recorder.tenants():
            total = self.recorder.total_steps(tenant)
            if total is not None:
                totals[tenant] = total
        return totals

    def __enter__(self) -> LiveView:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> LiveView:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
