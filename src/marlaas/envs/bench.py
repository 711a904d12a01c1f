"""`marlaas bench sandbox`: the cost of one sandboxed call, per backend, side by side: bwrap
with warm workers (the default), bwrap starting one per call (`warm=False`) and the rlimit
fallback. Besides wall times, the machine's CPU per call (from /proc/stat, every process:
bubblewrap and the interpreters are not this process), which is what a sandboxed check
takes from a model's device thread on a shared machine."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from marlaas.envs.sandbox import Sandbox
from marlaas.errors import SandboxError
from marlaas.fileio import atomic_write_json


def machine_cpu_s() -> float:
    """CPU seconds every process of this (Linux) machine has used since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


async def _time_calls(sandbox: Sandbox, calls: int) -> tuple[list[float], float]:
    await sandbox.run_python("print(1)")  # warm-up
    walls: list[float] = []
    cpu = machine_cpu_s()
    for _ in range(calls):
        start = time.perf_counter()
        result = await sandbox.run_python("print(1)")
        walls.append(time.perf_counter() - start)
        if not result.ok or result.stdout.strip() != "1":
            raise SandboxError(f"the {sandbox.backend_name} sandbox failed: {result.reason}")
    return walls, (machine_cpu_s() - cpu) / calls


async def _concurrent(sandbox: Sandbox, calls: int) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(sandbox.run_python("print(1)") for _ in range(calls)))
    return time.perf_counter() - start


def run_sandbox_bench(calls: int = 20, json_path: Path | None = None) -> dict[str, Any]:
    """Sequential per-call wall time and concurrent throughput, for each backend here."""
    rows: list[dict[str, Any]] = []
    for name, backend, warm in (("bwrap", "bwrap", True), ("bwrap cold", "bwrap", False),
                                ("rlimit", "rlimit", False)):  # fmt: skip
        try:
            sandbox = Sandbox(backend=backend, warm=warm)  # type: ignore[arg-type]
        except SandboxError as e:
            rows.append({"backend": name, "available": False, "reason": str(e)})
            continue
        try:
            walls, cpu_s = asyncio.run(_time_calls(sandbox, calls))
            burst = asyncio.run(_concurrent(sandbox, calls))
        finally:
            sandbox.close()
        rows.append(
            {
                "backend": name,
                "available": True,
                "calls": calls,
                "mean_ms": 1000 * statistics.fmean(walls),
                "median_ms": 1000 * statistics.median(walls),
                "min_ms": 1000 * min(walls),
                "machine_cpu_ms": 1000 * cpu_s,
                "concurrent_calls_per_s": calls / burst,
            }
        )
    result = {"program": "print(1)", "rows": rows}
    if json_path is not None:
        atomic_write_json(Path(json_path), result)
    return result
