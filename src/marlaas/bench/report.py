"""The report of `marlaas bench paper`: rows, ratios, targets, Markdown and the PNG.

Pure functions over plain JSON records (a `RunResult.to_json()`, a
`TRLTenantResult.to_json()`), so the report is testable on synthetic results.

Extrapolation rule: a baseline measured on the first K of N tenants (the workload's
instantiation makes those the same K jobs) is scaled linearly by the number of tenants
it covers, and the row says so (`extrapolated_from: K`, "~" in the table). The TRL
baseline covers single-turn tenants only; in a regime with tool tasks its time is for
those tenants alone (`covers`), which makes the marlaas/TRL ratio conservative.

Eval tolerance: a tenant's final accuracy under marlaas async matches "trained alone"
(the synchronous baseline: that tenant alone on the same engine, data and seeds) when
`|async - alone| <= max(0.02, spread, 1 / eval_episodes)`, where spread is the sample
standard deviation of the alone accuracies of the tenants built from the same template
(the seed-to-seed spread; 0 when fewer than two were measured) and `1 / eval_episodes`
the accuracy's resolution: one held-out episode answered differently. Training together
equals training alone up to floating-point noise (other micro-batches sum in another
order), and greedy evals of two adapters that differ by noise can part on one episode.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from marlaas.bench.workloads import template_of

EVAL_TOLERANCE = 0.02
#: The issue's targets: (regime, metric, comparison, threshold), checked at N = 32.
TARGET_N = 32
TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("paper", "async_vs_sync", "<=", 0.10),
    ("paper", "device_busy_fraction", ">=", 0.95),
    ("paper", "eval_within_tolerance", "==", 1.0),
    ("compute", "async_vs_sync", "<=", 0.67),
    # TRL runs single-turn tasks only: the same work as marlaas only in the compute
    # regime (all single-turn); in the paper regime it covers a part, reported alone.
    ("compute", "speedup_vs_trl", ">=", 10.0),
)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _per_s(tokens: float | None, wall: float | None) -> float | None:
    if tokens is None or not wall:
        return None
    return tokens / wall


def _staleness(run: Mapping[str, Any]) -> dict[str, Any]:
    tenants = run["tenants"].values()
    means = [t["staleness_mean"] for t in tenants]
    return {
        "max": run["staleness_max"],
        "mean": statistics.fmean(means) if means else 0.0,
        "violations": run["staleness_violations"],
        "groups_dropped_stale": sum(t["groups_dropped_stale"] for t in tenants),
    }


def _device(run: Mapping[str, Any]) -> dict[str, Any]:
    """Where the device time went (what explains a ratio): decode vs train seconds, and
    the cost of one decode iteration at the run's mean batch."""
    steps = run.get("decode_steps") or 0
    return {
        "decode_busy_s": run.get("decode_busy_s"),
        "train_busy_s": run.get("train_busy_s"),
        "decode_steps": steps,
        "mean_decode_batch": run.get("mean_decode_batch"),
        "decode_s_per_iteration": run["decode_busy_s"] / steps if steps else None,
        "train_steps": run.get("train_steps"),
        "prefill_tokens": run.get("prefill_tokens"),
        "shared_prefill_tokens": run.get("shared_prefill_tokens"),
    }


def _failed(run: Mapping[str, Any]) -> dict[str, str]:
    return {
        name: t.get("failure_reason") or t["status"]
        for name, t in run["tenants"].items()
        if t["status"] != "done"
    }


def build_row(
    regime: str,
    n_tenants: int,
    steps: int,
    async_run: Mapping[str, Any],
    sync_run: Mapping[str, Any],
    trl: Sequence[Mapping[str, Any]] | None,
    *,
    single_turn: Sequence[str],
) -> dict[str, Any]:
    """One row of the table: N tenants of one regime, the three systems side by side.

    `sync_run` may cover only the first K <= N tenants (then it is extrapolated);
    `trl` holds the TRL results of the single-turn tenants among those K (None: TRL was
    not run). `single_turn` names the single-turn tenants among all N.
    """
    measured = list(sync_run["tenants"])
    k = len(measured)
    if k < 1 or k > n_tenants or list(async_run["tenants"])[:k] != measured:
        raise ValueError("the sync run must cover a non-empty prefix of the async run's tenants")
    scale = n_tenants / k
    extrapolated = k if k < n_tenants else None
    async_wall = float(async_run["wall_s"])
    sync_wall = float(sync_run["wall_s"]) * scale
    row: dict[str, Any] = {
        "regime": regime,
        "n_tenants": n_tenants,
        "steps": steps,
        "marlaas_async": {
            "wall_s": async_wall,
            "device_busy_fraction": async_run["device_busy_fraction"],
            "tokens_generated": async_run["tokens_generated"],
            "tokens_per_s": _per_s(async_run["tokens_generated"], async_wall),
            "max_tenants_per_train_step": async_run["max_tenants_per_train_step"],
            "device": _device(async_run),
            "staleness": _staleness(async_run),
            "failed": _failed(async_run),
        },
        "sync": {
            "measured_tenants": k,
            "wall_s_measured": float(sync_run["wall_s"]),
            "wall_s": sync_wall,
            "extrapolated_from": extrapolated,
            "device_busy_fraction": sync_run["device_busy_fraction"],
            "tokens_per_s": _per_s(sync_run["tokens_generated"], sync_run["wall_s"]),
            "device": _device(sync_run),
            "failed": _failed(sync_run),
        },
        "trl": _trl_block(trl, measured, single_turn, n_tenants),
    }
    same_work = row["trl"] is not None and row["trl"].get("covers_all", False)
    trl_wall = row["trl"]["wall_s"] if same_work else None
    row["ratios"] = {
        "async_vs_sync": _ratio(async_wall, sync_wall),
        "speedup_vs_sync": _ratio(sync_wall, async_wall),
        "async_vs_trl": _ratio(async_wall, trl_wall),
        "speedup_vs_trl": _ratio(trl_wall, async_wall),
    }
    row["eval"] = _eval_block(async_run, sync_run, trl)
    return row


def _trl_block(
    trl: Sequence[Mapping[str, Any]] | None,
    measured: Sequence[str],
    single_turn: Sequence[str],
    n_tenants: int,
) -> dict[str, Any] | None:
    if trl is None:
        return None
    covered_measured = [t for t in measured if t in set(single_turn)]
    names = [r["name"] for r in trl]
    if sorted(names) != sorted(covered_measured):
        raise ValueError(
            f"TRL results {sorted(names)} must be the single-turn measured tenants "
            f"{sorted(covered_measured)}"
        )
    if not trl:
        return {
            "covers": f"0 of {n_tenants} tenants (no single-turn tenant)",
            "wall_s": None,
            "extrapolated_from": None,
            "tenants": {},
        }
    measured_wall = sum(float(r["wall_s"]) for r in trl)
    scale = len(single_turn) / len(trl)
    tokens = sum(int(r["tokens_generated"]) for r in trl)
    return {
        "covers": f"{len(single_turn)} of {n_tenants} tenants (single-turn only)"
        if len(single_turn) < n_tenants
        else f"all {n_tenants} tenants",
        "covers_all": len(single_turn) == n_tenants,
        "measured_tenants": len(trl),
        "wall_s_measured": measured_wall,
        "train_s_measured": sum(float(r["train_s"]) for r in trl),
        "wall_s": measured_wall * scale,
        "extrapolated_from": len(trl) if len(trl) < len(single_turn) else None,
        "tokens_per_s": _per_s(tokens, measured_wall),
        "adapters_changed": all(r["adapter_changed"] for r in trl),
        "tenants": {r["name"]: dict(r) for r in trl},
    }


def _eval_block(
    async_run: Mapping[str, Any],
    sync_run: Mapping[str, Any],
    trl: Sequence[Mapping[str, Any]] | None,
) -> dict[str, Any]:
    trl_after = {r["name"]: r["eval_after"] for r in trl or ()}
    alone_by_template: dict[str, list[float]] = {}
    for name, t in sync_run["tenants"].items():
        if t["eval_after"] is not None:
            alone_by_template.setdefault(template_of(name), []).append(t["eval_after"])
    spread = {
        tpl: statistics.stdev(values) if len(values) > 1 else 0.0
        for tpl, values in alone_by_template.items()
    }
    tenants: dict[str, dict[str, Any]] = {}
    for name, alone in sync_run["tenants"].items():
        ours = async_run["tenants"][name]
        a, s = ours["eval_after"], alone["eval_after"]
        delta = a - s if a is not None and s is not None else None
        episodes = alone.get("eval_episodes")
        resolution = 1.0 / episodes if episodes else 0.0
        tolerance = max(EVAL_TOLERANCE, spread.get(template_of(name), 0.0), resolution)
        tenants[name] = {
            "eval_before": ours["eval_before"],
            "async_after": a,
            "alone_after": s,
            "trl_after": trl_after.get(name),
            "delta": delta,
            "tolerance": tolerance,
            "within": delta is not None and abs(delta) <= tolerance + 1e-9,
        }
    deltas = [abs(t["delta"]) for t in tenants.values() if t["delta"] is not None]
    return {
        "tenants": tenants,
        "spread_by_template": spread,
        "max_abs_delta": max(deltas) if deltas else None,
        "mean_abs_delta": statistics.fmean(deltas) if deltas else None,
        "within_tolerance": bool(tenants) and all(t["within"] for t in tenants.values()),
    }


def check_targets(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets against the rows at N = 32 (`met: None` when not measured)."""
    out: list[dict[str, Any]] = []
    for regime, metric, op, threshold in TARGETS:
        row = next((r for r in rows if r["regime"] == regime and r["n_tenants"] == TARGET_N), None)
        value: float | None = None
        note = None
        if row is not None:
            if metric == "device_busy_fraction":
                value = row["marlaas_async"]["device_busy_fraction"]
            elif metric == "eval_within_tolerance":
                value = 1.0 if row["eval"]["within_tolerance"] else 0.0
                note = f"over the {len(row['eval']['tenants'])} tenants the baseline ran"
            else:
                value = row["ratios"][metric]
                baseline = row["trl"] if metric.endswith("trl") else row["sync"]
                notes = []
                if baseline and baseline.get("extrapolated_from"):
                    notes.append(f"extrapolated from {baseline['extrapolated_from']} tenants")
                if baseline and "single-turn" in baseline.get("covers", ""):
                    notes.append(f"TRL covers {baseline['covers']}")
                note = "; ".join(notes) or None
        met = None
        if value is not None:
            met = value <= threshold if op == "<=" else value >= threshold
            if op == "==":
                met = value == threshold
        out.append(
            {
                "regime": regime,
                "n_tenants": TARGET_N,
                "metric": metric,
                "target": f"{op} {threshold:g}",
                "value": value,
                "met": met,
                "note": note,
            }
        )
    return out


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _approx(block: Mapping[str, Any] | None) -> str:
    return "~" if block and block.get("extrapolated_from") else ""


def markdown(result: Mapping[str, Any]) -> str:
    """The headline table(s) and the targets, as Markdown."""
    lines: list[str] = []
    cfg = result["config"]
    lines.append(f"# marlaas bench paper ({'quick' if cfg['quick'] else 'full'})")
    lines.append("")
    lines.append(
        f"Machine: {cfg['device']}, torch threads {cfg['torch_threads']}; base "
        f"`{Path(cfg['base_model']).name}`. Times are end-to-end seconds (evals before and "
        "after included, base loading excluded). `~` marks a baseline measured on the first "
        "K tenants and extrapolated linearly (K in the notes)."
    )
    differences = cfg.get("trl_differences") or []
    if differences:
        lines += [
            "",
            "TRL GRPOTrainer + PEFT LoRA gets each job's data, grader and "
            "hyper-parameters; what differs: " + "; ".join(differences) + ".",
        ]
    for regime in result["regimes"]:
        wl = regime["workload"]
        lines += [
            "",
            f"## {wl['regime']} regime: `{wl['file']}` (v{wl['version']}, sha256 "
            f"{wl['sha256'][:12]}), {wl['samples_per_step']} samples per tenant step",
            "",
            "| N | steps | marlaas s | sync s | TRL s | marlaas/sync | marlaas/TRL "
            "| busy marlaas | busy sync | tok/s marlaas | tok/s sync | tok/s TRL "
            "| eval Δ max (mean) vs alone | staleness max/mean | notes |",
            "|" + "---|" * 15,
        ]
        for row in regime["rows"]:
            a, s, t, r, e = (
                row["marlaas_async"],
                row["sync"],
                row["trl"],
                row["ratios"],
                row["eval"],
            )
            notes = []
            if s["extrapolated_from"]:
                notes.append(f"sync from {s['extrapolated_from']}")
            if t and t.get("extrapolated_from"):
                notes.append(f"TRL from {t['extrapolated_from']}")
            if t and t["wall_s"] is not None and "single-turn" in t["covers"]:
                notes.append(f"TRL covers {t['covers']}")
            if t and t["wall_s"] is None:
                notes.append("no TRL (no single-turn tenant)")
            load = row.get("load_avg_1m") or {}
            busiest = max((v for v in load.values() if v is not None), default=None)
            cores = cfg.get("cpu_count")
            if busiest is not None and cores and busiest > cores:
                notes.append(f"machine load up to {busiest:.1f} on {cores} cores")
            if a["failed"] or s["failed"]:
                notes.append(f"FAILED: {', '.join(sorted({*a['failed'], *s['failed']}))}")
            delta = (
                f"{e['max_abs_delta']:+.3f} ({e['mean_abs_delta']:.3f})"
                if e["max_abs_delta"] is not None
                else "-"
            )
            lines.append(
                "| "
                + " | ".join(
                    [
                        str(row["n_tenants"]),
                        str(row["steps"]),
                        f"{a['wall_s']:.1f}",
                        _approx(s) + f"{s['wall_s']:.1f}",
                        _approx(t) + _fmt(t["wall_s"] if t else None, ".1f"),
                        _approx(s) + _fmt(r["async_vs_sync"], ".2f", "x"),
                        _approx(t) + _fmt(r["async_vs_trl"], ".2f", "x"),
                        f"{a['device_busy_fraction']:.0%}",
                        f"{s['device_busy_fraction']:.0%}",
                        _fmt(a["tokens_per_s"], ".0f"),
                        _fmt(s["tokens_per_s"], ".0f"),
                        _fmt(t.get("tokens_per_s") if t else None, ".0f"),
                        delta,
                        f"{a['staleness']['max']}/{a['staleness']['mean']:.2f}",
                        "; ".join(notes) or "",
                    ]
                )
                + " |"
            )
    lines += _device_tables(result)
    lines += [
        "",
        "## Targets (issue #5, at N = 32)",
        "",
        "| regime | metric | target | value | met | note |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for tgt in result["targets"]:
        met = {True: "yes", False: "**no**", None: "not run"}[tgt["met"]]
        lines.append(
            f"| {tgt['regime']} | {tgt['metric']} | {tgt['target']} | "
            f"{_fmt(tgt['value'], '.3g')} | {met} | {tgt.get('note') or ''} |"
        )
    lines.append("")
    return "\n".join(lines)


def _device_tables(result: Mapping[str, Any]) -> list[str]:
    """Where the device time went, per system (measured runs, not extrapolated)."""
    lines = [
        "",
        "## Device time (measured runs)",
        "",
        "| regime | N | system | decode s | train s | decode iterations | mean batch "
        "| ms / iteration | train steps | prompt tokens run | prompt tokens shared |",
        "|" + "---|" * 11,
    ]
    for regime in result["regimes"]:
        for row in regime["rows"]:
            for label, block in (("marlaas", row["marlaas_async"]), ("sync", row["sync"])):
                d = block.get("device")
                if not d:
                    continue
                per_iter = d["decode_s_per_iteration"]
                lines.append(
                    f"| {row['regime']} | {row['n_tenants']} | {label}"
                    + (f" (first {block['measured_tenants']})" if label == "sync" else "")
                    + f" | {_fmt(d['decode_busy_s'], '.1f')} | {_fmt(d['train_busy_s'], '.1f')} "
                    f"| {d['decode_steps']} | {_fmt(d['mean_decode_batch'], '.1f')} "
                    f"| {_fmt(per_iter * 1000 if per_iter else None, '.1f')} "
                    f"| {d['train_steps']} | {_fmt(d.get('prefill_tokens'), 'd')} "
                    f"| {_fmt(d.get('shared_prefill_tokens'), 'd')} |"
                )
    return lines


def plot(result: Mapping[str, Any], path: Path) -> Path:
    """Bar chart: end-to-end seconds of each system per N (log scale), one panel per
    regime; extrapolated bars are hatched; ratios marlaas/baseline above the bars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from marlaas.fileio import atomic_write

    regimes = result["regimes"]
    fig = Figure(figsize=(6.0 * max(len(regimes), 1), 4.8), layout="constrained")
    axes = fig.subplots(1, max(len(regimes), 1), squeeze=False)[0]
    for ax, regime in zip(axes, regimes, strict=False):
        rows = regime["rows"]
        partial = any(r["trl"] and "single-turn" in r["trl"]["covers"] for r in rows)
        systems = (
            ("marlaas async", "tab:green"),
            ("sync baseline", "tab:blue"),
            ("TRL (single-turn tenants only)" if partial else "TRL", "tab:red"),
        )
        width = 0.27
        for j, (label, color) in enumerate(systems):
            xs, heights, hatches = [], [], []
            for i, row in enumerate(rows):
                block = row["marlaas_async"] if j == 0 else row["sync"] if j == 1 else row["trl"]
                if not block or block.get("wall_s") is None:
                    continue
                xs.append(i + (j - 1) * width)
                heights.append(block["wall_s"])
                hatches.append("//" if block.get("extrapolated_from") else "")
            bars = ax.bar(xs, heights, width, color=color, label=label)
            for bar, hatch in zip(bars, hatches, strict=True):
                bar.set_hatch(hatch)
        for i, row in enumerate(rows):
            r = row["ratios"]
            text = f"marlaas/sync {_fmt(r['async_vs_sync'], '.2f', 'x')}"
            if r["async_vs_trl"] is not None:
                text += f"\nmarlaas/TRL {r['async_vs_trl']:.2f}x"
            top = max(
                b["wall_s"]
                for b in (row["marlaas_async"], row["sync"], row["trl"])
                if b and b.get("wall_s") is not None
            )
            ax.text(i, top * 1.15, text, ha="center", va="bottom", fontsize="x-small")
        ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), [str(r["n_tenants"]) for r in rows])
        ax.set_xlabel("tenants (N)")
        ax.set_ylabel("end-to-end seconds (log)")
        wl = regime["workload"]
        ax.set_title(f"{wl['regime']} regime ({wl['file']})")
        ax.margins(y=0.3)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")
    fig.suptitle("end-to-end time per system (hatched: baseline extrapolated from a prefix)")
    FigureCanvasAgg(fig)

    def write(tmp: Path) -> None:
        fig.savefig(tmp, format="png", dpi=110)

    return atomic_write(path, write)
