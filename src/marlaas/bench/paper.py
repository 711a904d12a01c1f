"""`marlaas bench paper`: the paper's headline table, reproduced on this machine.

For each regime (a versioned workload file, see `workloads`) and each tenant count N,
side by side in one process:

1. marlaas, asynchronous and multi-tenant: `run_jobs(mode="async")` on all N tenants;
2. the synchronous baseline, tenant after tenant: `run_jobs(mode="sync")` on the first
   K = min(N, baseline_tenants) tenants (extrapolated to N when K < N);
3. TRL's `GRPOTrainer` + PEFT LoRA, tenant after tenant, on the single-turn tenants
   among those K (`trl_baseline`). Each tenant is trained with TRL once per regime; a
   row's TRL time is the sum over its tenants (tenant i is the same job for every N).

Every system gets the same jobs (data, seeds, hyper-parameters), one torch thread by
default, and its base loaded before its clock starts. Nothing is asserted about
timings: the result is a table (Markdown on screen and next to the JSON), the JSON and
a PNG, and the issue's targets marked met or not. Run folders (checkpoints, adapters,
`result.json`) go under `out_dir`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from marlaas.backends import open_backend
from marlaas.bench.machine import software, torch_threads
from marlaas.bench.report import build_row, check_targets, markdown, plot
from marlaas.bench.trl_baseline import NOTES as TRL_NOTES
from marlaas.bench.trl_baseline import run_trl_tenant
from marlaas.bench.workloads import Workload, is_single_turn
from marlaas.config.ray import RaySpec
from marlaas.config.specs import ModelDType
from marlaas.device.config import resolve_device
from marlaas.errors import ConfigError
from marlaas.fileio import atomic_write_json, atomic_write_text
from marlaas.model.base import default_base_path
from marlaas.pipeline.context import PipelineOptions
from marlaas.pipeline.runner import run_jobs

DEFAULT_TENANTS = (1, 4, 8, 16, 32)
QUICK_TENANTS = (1, 4)
#: Tenants each baseline runs in a full benchmark before extrapolating (a multiple of
#: both shipped workloads' template counts would be ideal; 10 covers paper-v1 twice).
DEFAULT_BASELINE_TENANTS = 10
SCHEMA = "marlaas.bench.paper/1"

Log = Callable[[str], None]


def _trl_available() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def run_paper_bench(
    workloads: Sequence[Workload],
    *,
    tenant_counts: Sequence[int] = DEFAULT_TENANTS,
    steps: int | None = None,
    quick: bool = False,
    include_trl: bool = True,
    baseline_tenants: int | None = None,
    out_dir: Path,
    json_path: Path | None = None,
    base_path: Path | None = None,
    threads: int | None = 1,
    backend: str = "inprocess",
    ray: RaySpec | None = None,
    log: Log = print,
    dtype: ModelDType = "auto",
) -> dict[str, Any]:
    """Run the benchmark and return the result (also written to `json_path`, with the
    Markdown table at `json_path.with_suffix('.md')` and the chart at `.png`).

    `steps` replaces each workload's `steps` (or `quick_steps` when `quick`);
    `baseline_tenants` caps the tenants the baselines run (None: all of them);
    `backend` runs marlaas and the synchronous baseline in-process or on Ray (TRL always
    runs in-process).
    """
    if backend not in ("inprocess", "ray"):
        raise ConfigError(f"backend must be 'inprocess' or 'ray', got {backend!r}")
    if not workloads:
        raise ConfigError("choose at least one workload (regime)")
    if not tenant_counts or min(tenant_counts) < 1:
        raise ConfigError("tenant counts must be positive integers")
    if baseline_tenants is not None and baseline_tenants < 1:
        raise ConfigError(f"baseline_tenants must be >= 1, got {baseline_tenants}")
    if include_trl and not _trl_available():
        raise ConfigError("trl is not installed; install it (pip install trl) or pass --no-trl")
    base = Path(base_path) if base_path is not None else default_base_path()
    counts = sorted(set(tenant_counts))
    started = time.perf_counter()
    regimes: list[dict[str, Any]] = []
    with torch_threads(threads) as used_threads:
        for workload in workloads:
            regimes.append(
                _run_regime(
                    workload,
                    counts,
                    steps,
                    quick,
                    include_trl,
                    baseline_tenants,
                    out_dir / workload.regime,
                    base,
                    log,
                    {"backend": backend, "ray": ray or RaySpec(), "dtype": dtype},
                )
            )
    rows = [row for regime in regimes for row in regime["rows"]]
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "config": {
            "quick": quick,
            "tenant_counts": counts,
            "steps_override": steps,
            "baseline_tenants": baseline_tenants,
            "include_trl": include_trl,
            "backend": backend,
            "ray": (ray or RaySpec()).model_dump(mode="json") if backend == "ray" else None,
            "base_model": str(base),
            "dtype": dtype,
            "device": resolve_device("auto"),
            "torch_threads": used_threads,
            **software(),
            "trl": _trl_version() if include_trl else None,
            "trl_differences": list(TRL_NOTES) if include_trl else [],
            "out_dir": str(out_dir),
        },
        "regimes": regimes,
        "targets": check_targets(rows),
        "bench_wall_s": time.perf_counter() - started,
    }
    if json_path is not None:
        write_outputs(result, Path(json_path))
    return result


def write_outputs(result: dict[str, Any], json_path: Path) -> list[Path]:
    """The JSON, the Markdown table (`.md`) and the chart (`.png`) side by side."""
    md = json_path.with_suffix(".md")
    png = json_path.with_suffix(".png")
    result["outputs"] = {"json": str(json_path), "markdown": str(md), "png": str(png)}
    atomic_write_json(json_path, result)
    atomic_write_text(md, markdown(result))
    plot(result, png)
    return [json_path, md, png]


def _load() -> float | None:
    """The 1-minute load average: other processes on the machine skew every timing."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _trl_version() -> str:
    from importlib.metadata import version

    return version("trl")


def _run_regime(
    workload: Workload,
    counts: Sequence[int],
    steps: int | None,
    quick: bool,
    include_trl: bool,
    baseline_tenants: int | None,
    out_dir: Path,
    base: Path,
    log: Log,
    placement: dict[str, Any] | None = None,
) -> dict[str, Any]:
    n_steps = (
        steps
        if steps is not None
        else (workload.spec.quick_steps if quick else workload.spec.steps)
    )
    options = PipelineOptions()
    trl_cache: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    for n in counts:
        k = n if baseline_tenants is None else min(n, baseline_tenants)
        on_base = {"base_model": str(base), **(placement or {})}
        spec = workload.instantiate(n, steps=n_steps).updated(**on_base)
        spec_k = workload.instantiate(k, steps=n_steps).updated(**on_base)
        run_dir = out_dir / f"n{n:03d}"
        load_start = _load()
        log(f"[{workload.regime}] N={n}: marlaas async, {n} tenants x {n_steps} steps")
        async_run = asyncio.run(
            run_jobs(spec, run_dir / "async", backend=open_backend, mode="async", options=options)
        ).to_json()
        log(f"[{workload.regime}] N={n}: async {async_run['wall_s']:.1f} s; sync on {k}")
        sync_run = asyncio.run(
            run_jobs(spec_k, run_dir / "sync", backend=open_backend, mode="sync", options=options)
        ).to_json()
        log(f"[{workload.regime}] N={n}: sync {sync_run['wall_s']:.1f} s")
        trl: list[dict[str, Any]] | None = None
        if include_trl:
            trl = []
            for job in spec_k.jobs:
                if not is_single_turn(job):
                    continue
                if job.name not in trl_cache:
                    log(f"[{workload.regime}] TRL GRPOTrainer: {job.name}")
                    trl_cache[job.name] = run_trl_tenant(
                        job, base, dtype=(placement or {}).get("dtype", "auto")
                    ).to_json()
                trl.append(trl_cache[job.name])
        single_turn = [job.name for job in spec.jobs if is_single_turn(job)]
        row = build_row(
            workload.regime, n, n_steps, async_run, sync_run, trl, single_turn=single_turn
        )
        row["load_avg_1m"] = {"start": load_start, "end": _load()}
        rows.append(row)
    return {"workload": workload.describe(), "steps": n_steps, "rows": rows}
