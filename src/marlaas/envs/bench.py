"""`marlaas bench sandbox`: the cost of one sandboxed call, per backend, side by side."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from marlaas.envs.sandbox import Sandbox
from marlaas.errors import SandboxError
from marlaas.fileio import atomic_write_json


async def _time_calls(sandbox: Sandbox, calls: int) -> list[float]:
    await sandbox.run_python("print(1)")  # warm-up
    walls: list[float] = []
    for _ in range(calls):
        start = time.perf_counter()
        result = await sandbox.run_python("print(1)")
        walls.append(time.perf_counter() - start)
        if not result.ok or result.stdout.strip() != "1":
            raise SandboxError(f"the {sandbox.backend_name} sandbox failed: {result.reason}")
    return walls


async def _concurrent(sandbox: Sandbox, calls: int) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(sandbox.run_python("print(1)") for _ in range(calls)))
    return time.perf_counter() - start


def run_sandbox_bench(calls: int = 20, json_path: Path | None = None) -> dict[str, Any]:
    """Sequential per-call wall time and concurrent throughput, for each backend here."""
    rows: list[dict[str, Any]] = []
    for backend in ("bwrap", "rlimit"):
        try:
            sandbox = Sandbox(backend=backend)  # type: ignore[arg-type]
        except SandboxError as e:
            rows.append({"backend": backend, "available": False, "reason": str(e)})
            continue
        walls = asyncio.run(_time_calls(sandbox, calls))
        burst = asyncio.run(_concurrent(sandbox, calls))
        rows.append(
            {
                "backend": backend,
                "available": True,
                "calls": calls,
                "mean_ms": 1000 * statistics.fmean(walls),
                "median_ms": 1000 * statistics.median(walls),
                "min_ms": 1000 * min(walls),
                "concurrent_calls_per_s": calls / burst,
            }
        )
    result = {"program": "print(1)", "rows": rows}
    if json_path is not None:
        atomic_write_json(Path(json_path), result)
    return result
