"""`marlaas bench dtype`: does training with the base's linear layers in bfloat16 learn
as well as in float32?

The same learning run (the `learning` workload: the compute regime's tasks, long
enough to learn, evaluated on 128 held-out episodes) is run once per dtype through the
asynchronous pipeline, the same jobs, seeds and data; only the base's linear weights
differ (`dtype`: on the CPU, `model.mixed`'s bfloat16 linear layers over float32
activations; LoRA weights, optimizer state and log-probs stay float32 either way). Each
tenant's final greedy accuracy is compared with its float32 twin's.

Verdict (`compare`), per template: bfloat16 loses no accuracy when its tenants' mean
final accuracy is at least float32's minus the eval tolerance of `bench paper`
(`report.EVAL_TOLERANCE`, the float32 tenants' seed-to-seed spread, one held-out episode:
whichever is largest); and the run means something only where float32 itself learned
(its mean final accuracy above its mean initial one by more than that tolerance). This
is the evidence `model.base.resolve_dtype` rests on when `auto` picks bfloat16 on a CPU
with native bfloat16.

Times are end-to-end seconds of each run (evals included), reported side by side;
they are not the point of this bench (`bench paper --dtype` is).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from marlaas.backends import open_backend
from marlaas.bench.machine import software, torch_threads
from marlaas.bench.report import EVAL_TOLERANCE
from marlaas.bench.workloads import Workload, template_of
from marlaas.config.specs import ModelDType
from marlaas.errors import ConfigError
from marlaas.fileio import atomic_write_json, atomic_write_text
from marlaas.model.base import default_base_path
from marlaas.pipeline import PipelineOptions, run_jobs

SCHEMA = "marlaas.bench.dtype/1"
#: The reference dtype first, then the one under test.
DTYPES: tuple[ModelDType, ModelDType] = ("float32", "bfloat16")
DEFAULT_TENANTS = 12

Log = Callable[[str], None]


def run_dtype_bench(
    workload: Workload,
    *,
    tenants: int = DEFAULT_TENANTS,
    steps: int | None = None,
    out_dir: Path,
    json_path: Path | None = None,
    base_path: Path | None = None,
    threads: int | None = 1,
    log: Log = print,
) -> dict[str, Any]:
    """Run `workload`'s first `tenants` jobs once per dtype of `DTYPES` and compare
    their final accuracies (`compare`); the result is also written to `json_path`,
    with its Markdown table at `json_path.with_suffix('.md')`."""
    if tenants < 1:
        raise ConfigError(f"tenants must be >= 1, got {tenants}")
    base = Path(base_path) if base_path is not None else default_base_path()
    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    with torch_threads(threads) as used_threads:
        for dtype in DTYPES:
            spec = workload.instantiate(tenants, steps=steps).updated(
                base_model=str(base), dtype=dtype
            )
            log(f"[{dtype}] {tenants} tenants x {spec.jobs[0].steps} steps")
            runs[dtype] = asyncio.run(
                run_jobs(spec, out_dir / dtype, backend=open_backend, options=PipelineOptions())
            ).to_json()
            log(f"[{dtype}] {runs[dtype]['wall_s']:.1f} s")
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "config": {
            "workload": workload.describe(),
            "tenants": tenants,
            "steps": steps,
            "base_model": str(base),
            "torch_threads": used_threads,
            **software(),
        },
        "runs": {
            dtype: {"wall_s": run["wall_s"], "tenants": run["tenants"]}
            for dtype, run in runs.items()
        },
        "comparison": compare({dtype: run["tenants"] for dtype, run in runs.items()}),
        "bench_wall_s": time.perf_counter() - started,
    }
    if json_path is not None:
        atomic_write_json(Path(json_path), result)
        atomic_write_text(Path(json_path).with_suffix(".md"), markdown(result))
    return result


def compare(tenants_by_dtype: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The verdict of the module doc from each dtype's tenant results (`TenantResult`
    JSON: `eval_before`, `eval_after`, `eval_episodes`, `status`), the first dtype the
    reference."""
    (ref_name, ref), (test_name, test) = list(tenants_by_dtype.items())
    missing = sorted(set(ref) ^ set(test))
    if missing:
        raise ConfigError(f"the runs trained different tenants: {', '.join(missing)}")
    failed = sorted(n for runs in (ref, test) for n, t in runs.items() if t["status"] != "done")
    templates: dict[str, list[str]] = {}
    for name in sorted(ref):
        templates.setdefault(template_of(name), []).append(name)
    rows: dict[str, dict[str, Any]] = {}
    for template, names in templates.items():
        if any(ref[n]["eval_after"] is None or test[n]["eval_after"] is None for n in names):
            continue
        before = [_number(ref[n]["eval_before"]) for n in names]
        ref_after = [_number(ref[n]["eval_after"]) for n in names]
        test_after = [_number(test[n]["eval_after"]) for n in names]
        spread = statistics.stdev(ref_after) if len(ref_after) > 1 else 0.0
        episodes = ref[names[0]].get("eval_episodes") or 0
        tolerance = max(EVAL_TOLERANCE, spread, 1.0 / episodes if episodes else 0.0)
        delta = statistics.fmean(test_after) - statistics.fmean(ref_after)
        gain = statistics.fmean(ref_after) - statistics.fmean(before)
        rows[template] = {
            "tenants": len(names),
            "before": statistics.fmean(before),
            f"{ref_name}_after": statistics.fmean(ref_after),
            f"{test_name}_after": statistics.fmean(test_after),
            f"{ref_name}_gain": gain,
            "delta": delta,
            "paired_deltas": [t - r for t, r in zip(test_after, ref_after, strict=True)],
            "tolerance": tolerance,
            "learned": gain > tolerance,
            "no_loss": delta >= -tolerance - 1e-9,
        }
    conclusive = bool(rows) and not failed and all(r["learned"] for r in rows.values())
    return {
        "reference": ref_name,
        "tested": test_name,
        "templates": rows,
        "failed_tenants": failed,
        "conclusive": conclusive,
        "no_loss": conclusive and all(r["no_loss"] for r in rows.values()),
    }


def _number(value: Any) -> float:
    return float(value) if value is not None else 0.0


def markdown(result: Mapping[str, Any]) -> str:
    """The result as a Markdown table, one row per template, and the verdict."""
    c = result["comparison"]
    ref, test = c["reference"], c["tested"]
    runs = result["runs"]
    lines = [
        "# marlaas bench dtype",
        "",
        f"Workload `{result['config']['workload']['file']}`, {result['config']['tenants']} "
        f"tenants; greedy held-out accuracy (mean over a template's tenants), "
        f"{ref} vs {test} base linear weights, everything else the same.",
        "",
        f"| template | tenants | before | {ref} after | {test} after | {ref} gain | "
        f"{test} - {ref} | tolerance | learned | no loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for template, r in c["templates"].items():
        lines.append(
            f"| {template} | {r['tenants']} | {r['before']:.3f} | {r[f'{ref}_after']:.3f} | "
            f"{r[f'{test}_after']:.3f} | {r[f'{ref}_gain']:+.3f} | {r['delta']:+.3f} | "
            f"{r['tolerance']:.3f} | {_yes(r['learned'])} | {_yes(r['no_loss'])} |"
        )
    verdict = (
        f"{test} loses no accuracy"
        if c["no_loss"]
        else (f"{test} loses accuracy" if c["conclusive"] else "inconclusive")
    )
    lines += [
        "",
        f"Verdict: **{verdict}**"
        + (f" (failed tenants: {', '.join(c['failed_tenants'])})" if c["failed_tenants"] else ""),
        "",
        "Wall time: "
        + ", ".join(f"{d} {r['wall_s']:.1f} s" for d, r in runs.items())
        + f" ({test} / {ref} = {runs[test]['wall_s'] / runs[ref]['wall_s']:.2f}x)",
    ]
    return "\n".join(lines) + "\n"


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


__all__: Sequence[str] = ("DTYPES", "compare", "markdown", "run_dtype_bench")
