"""PNG plots of a run, drawn with matplotlib's Agg canvas.

Figures are built with `matplotlib.figure.Figure` and an explicit Agg canvas, never
through `pyplot`: no global figure registry, no GUI backend, safe to call from any
thread and in headless CI. Every file is written atomically (temporary file, then
rename). matplotlib is imported with this module only, so the rest of `marlaas.obs`
does not need it.

- `plot_curves`: each tenant's mean reward per optimizer step and its eval accuracy
  per adapter version, from its typed progress records (`curves_figure` is the figure).
- `plot_utilization`: the device's busy fraction over time in fixed bins, and the
  busy/idle time of every stage over the whole run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from marlaas.fileio import atomic_write
from marlaas.obs.memory import RunRecorder

CURVES_FILE = "curves.png"
UTILIZATION_FILE = "utilization.png"
#: Bins in the utilization timeline when no bin size is given.
DEFAULT_BINS = 100
_DPI = 110


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    FigureCanvasAgg(fig)  # attaches itself to the figure

    def write(tmp: Path) -> None:
        fig.savefig(tmp, format="png", dpi=_DPI)

    return atomic_write(Path(path), write)


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _rewards(recorder: RunRecorder, tenant: str) -> list[tuple[int, float]]:
    return [(s, m.reward_mean) for s, m in recorder.steps(tenant) if m.reward_mean is not None]


#: The panels of `curves.png`: title, the x axis, the series of one tenant.
CURVE_PANELS: tuple[tuple[str, str, Callable[[RunRecorder, str], list[tuple[int, float]]]], ...] = (
    ("reward (mean per step)", "optimizer step", _rewards),
    ("eval accuracy", "adapter version", RunRecorder.evals),
)


def curves_figure(recorder: RunRecorder, *, tenants: Sequence[str] | None = None) -> Figure:
    """One panel per `CURVE_PANELS` entry, one line per tenant (a tenant without data
    in a panel has no line there)."""
    tenants = recorder.tenants() if tenants is None else list(tenants)
    fig = Figure(figsize=(5.0 * len(CURVE_PANELS), 4.2), layout="constrained")
    axes = fig.subplots(1, len(CURVE_PANELS), squeeze=False)[0]
    colors = _colors(len(tenants))
    legend: dict[str, Line2D] = {}
    for ax, (title, xlabel, series_of) in zip(axes, CURVE_PANELS, strict=True):
        for tenant, color in zip(tenants, colors, strict=True):
            series = series_of(recorder, tenant)
            if not series:
                continue
            steps, values = zip(*series, strict=True)
            marker = "o" if len(series) <= 30 else None
            (line,) = ax.plot(steps, values, color=color, marker=marker, markersize=3, label=tenant)
            legend.setdefault(tenant, line)
        ax.set_title(title)
        if ax.lines:
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        else:
            _no_data(ax, title.split(" (")[0])
    if legend:
        labels = [t for t in tenants if t in legend]  # tenant order, not drawing order
        fig.legend(
            [legend[t] for t in labels],
            labels,
            loc="outside lower center",
            ncols=min(len(labels), 6),
            fontsize="small",
        )
    fig.suptitle("per-tenant learning curves")
    return fig


def plot_curves(
    recorder: RunRecorder,
    path: str | os.PathLike[str],
    *,
    tenants: Sequence[str] | None = None,
) -> Path:
    """`curves_figure` as a PNG at `path`."""
    return _save(curves_figure(recorder, tenants=tenants), path)


def plot_utilization(
    recorder: RunRecorder,
    path: str | os.PathLike[str],
    *,
    stage: str = "device",
    bin_s: float | None = None,
    start: float | None = None,
    end: float | None = None,
) -> Path:
    """Top: the busy fraction of `stage` per time bin. Bottom: busy and idle seconds of
    every stage over `[start, end)` (default: the whole run)."""
    lo = recorder.origin if start is None else start
    hi = recorder.now() if end is None else end
    span_s = max(hi - lo, 0.0)
    if bin_s is None:
        bin_s = span_s / DEFAULT_BINS if span_s > 0 else 1.0
    bins = recorder.utilization_timeline(stage, bin_s, lo, hi)
    fig = Figure(figsize=(10.0, 6.0), layout="constrained")
    top, bottom = fig.subplots(2, 1, height_ratios=(3, 2))

    if bins and stage in recorder.stages():
        edges = [b.start - recorder.origin for b in bins] + [bins[-1].end - recorder.origin]
        fractions = [b.busy_fraction for b in bins]
        top.stairs(fractions, edges, fill=True, alpha=0.35, color="tab:blue")
        top.stairs(fractions, edges, color="tab:blue", linewidth=1.2)
        overall = recorder.busy_fraction(stage, lo, hi)
        top.axhline(overall, color="tab:red", linestyle="--", linewidth=1)
        top.set_title(f"{stage} utilization ({bin_s:.3g} s bins, mean {overall:.0%} dashed)")
        top.set_ylim(0, 1.05)
        top.set_xlim(edges[0], edges[-1])
        top.set_xlabel("seconds since start")
        top.set_ylabel("busy fraction")
        top.grid(alpha=0.3)
    else:
        _no_data(top, f"{stage} time")
        top.set_title(f"{stage} utilization")

    stages = recorder.stages()
    if stages and span_s > 0:
        busy = [recorder.busy_time(s, lo, hi) for s in stages]
        idle = [max(span_s - b, 0.0) for b in busy]
        rows = list(range(len(stages)))
        bottom.barh(rows, busy, color="tab:green", label="busy")
        bottom.barh(rows, idle, left=busy, color="0.85", label="idle")
        for row, b in zip(rows, busy, strict=True):
            bottom.text(span_s * 1.01, row, f"{b / span_s:.0%}", va="center", fontsize="small")
        bottom.set_yticks(rows, stages)
        bottom.invert_yaxis()
        bottom.set_xlim(0, span_s * 1.08)
        bottom.set_xlabel("seconds")
        bottom.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    else:
        _no_data(bottom, "spans")
    bottom.set_title("busy and idle time per stage")
    return _save(fig, path)


def write_plots(recorder: RunRecorder, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Both figures into `out_dir`, as `curves.png` and `utilization.png`."""
    out = Path(out_dir)
    return [
        plot_curves(recorder, out / CURVES_FILE),
        plot_utilization(recorder, out / UTILIZATION_FILE),
    ]


def _colors(n: int) -> list[tuple[float, float, float, float]]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]
