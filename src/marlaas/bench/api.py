"""`marlaas bench api`: the service's API latency while many jobs train.

Starts a real `marlaas serve` (the pipeline backend on the embedded base, SQLite in a
temporary data directory, a free loopback port), creates one tenant, submits N small
jobs over the five built-in families, and while they train, C client threads read the
job list, one job, its metrics and its checkpoints in a loop. It stops when every job
is done (or failed, or the time limit passes) and reports latency percentiles per
endpoint: a table on screen and JSON on disk. Nothing is asserted about the figures.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from marlaas.errors import MarlaasError

FAMILIES = ("reverse", "arithmetic", "countdown", "calculator", "search")
ADMIN_KEY = "bench-admin-key-local-only"
ENDPOINTS = ("list", "get", "metrics", "checkpoints")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_body(index: int, steps: int) -> dict[str, Any]:
    """A small job of family `index % 5`."""
    return {
        "name": f"job{index:03d}",
        "task": {"family": FAMILIES[index % len(FAMILIES)]},
        "steps": steps,
        "checkpoint_every": 2,
        "eval_episodes": 8,
        "lora": {"rank": 8},
        "algorithm": {"group_size": 4, "prompts_per_step": 2, "max_staleness": 1},
        "sampling": {"max_new_tokens": 16},
        "seed": index,
    }


def percentiles(samples_s: Sequence[float]) -> dict[str, float]:
    """n, p50, p95, p99 and max of latencies given in seconds, in milliseconds."""
    xs = sorted(samples_s)
    if not xs:
        return {"n": 0, "p50_ms": 0.0, "p95_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000

    return {
        "n": len(xs),
        "p50_ms": q(0.5),
        "p95_ms": q(0.95),
        "p99_ms": q(0.99),
        "max_ms": xs[-1] * 1000,
    }


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise MarlaasError(f"marlaas serve exited early:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise MarlaasError(f"marlaas serve did not become ready in {timeout_s:.0f} s")


def run_api_bench(
    jobs: int = 32,
    clients: int = 8,
    steps: int = 6,
    json_path: str | Path | None = None,
    timeout_s: float = 1800.0,
    console: Console | None = None,
) -> dict[str, Any]:
    """Measure the API under `jobs` training jobs and `clients` polling threads."""
    if jobs < 1 or clients < 1 or steps < 1:
        raise MarlaasError("jobs, clients and steps must be >= 1")
    console = console or Console()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="marlaas-bench-api-") as tmp:
        log = Path(tmp) / "serve.log"
        env = {**os.environ, "MARLAAS_ADMIN_KEY": ADMIN_KEY}
        env.pop("MARLAAS_DB_URL", None)
        cmd = [sys.executable, "-m", "marlaas.cli", "serve", "--port", str(port)]
        cmd += ["--data-dir", str(Path(tmp) / "data"), "--max-active-jobs", str(jobs)]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_ready(base, proc, log, 120)
            result = _measure(base, jobs, clients, steps, timeout_s)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    result["config"] = {"jobs": jobs, "clients": clients, "steps": steps, "cpus": os.cpu_count()}
    _print(console, result)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2, sort_keys=True))
    return result


def _measure(base: str, jobs: int, clients: int, steps: int, timeout_s: float) -> dict[str, Any]:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    quotas = {"max_concurrent_jobs": jobs, "max_total_steps": jobs * steps}
    httpx.post(
        base + "/v1/admin/tenants", json={"name": "bench", "quotas": quotas}, headers=admin
    ).raise_for_status()
    key = httpx.post(base + "/v1/admin/tenants/bench/keys", json={}, headers=admin)
    key.raise_for_status()
    headers = {"Authorization": f"Bearer {key.json()['key']}"}
    create: list[float] = []
    ids: list[str] = []
    with httpx.Client(base_url=base, headers=headers, timeout=60) as c:
        for i in range(jobs):
            t = time.perf_counter()
            r = c.post("/v1/jobs", json=job_body(i, steps))
            create.append(time.perf_counter() - t)
            r.raise_for_status()
            ids.append(r.json()["id"])
    samples: dict[str, list[float]] = {name: [] for name in ENDPOINTS}
    errors: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def poll(k: int) -> None:
        with httpx.Client(base_url=base, headers=headers, timeout=60) as c:
            i = k
            while not stop.is_set():
                job = ids[i % len(ids)]
                i += 1
                for name, url in zip(
                    ENDPOINTS,
                    (
                        "/v1/jobs",
                        f"/v1/jobs/{job}",
                        f"/v1/jobs/{job}/metrics",
                        f"/v1/jobs/{job}/checkpoints",
                    ),
                    strict=True,
                ):
                    t = time.perf_counter()
                    r = c.get(url)
                    dt = time.perf_counter() - t
                    with lock:
                        if r.status_code == 200:
                            samples[name].append(dt)
                        else:
                            errors.append(f"{url}: {r.status_code}")

    threads = [threading.Thread(target=poll, args=(k,), daemon=True) for k in range(clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    statuses: dict[str, int] = {}
    with httpx.Client(base_url=base, headers=headers, timeout=60) as c:
        while time.perf_counter() - t0 < timeout_s:
            listed = c.get("/v1/jobs", params={"limit": jobs}).json()["jobs"]
            statuses = {}
            for j in listed:
                statuses[j["status"]] = statuses.get(j["status"], 0) + 1
            if sum(statuses.get(s, 0) for s in ("done", "failed", "cancelled")) == jobs:
                break
            time.sleep(1.0)
    stop.set()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "statuses": statuses,
        "errors": errors[:20],
        "error_count": len(errors),
        "latency": {"create": percentiles(create)}
        | {name: percentiles(xs) for name, xs in samples.items()},
    }


def _print(console: Console, result: dict[str, Any]) -> None:
    cfg = result["config"]
    table = Table(
        title=f"API latency: {cfg['jobs']} jobs training, {cfg['clients']} polling clients, "
        f"{result['wall_s']:.0f} s"
    )
    for col in ("endpoint", "requests", "p50 ms", "p95 ms", "p99 ms", "max ms"):
        table.add_column(col, justify="left" if col == "endpoint" else "right")
    for name, p in result["latency"].items():
        table.add_row(
            name,
            str(p["n"]),
            f"{p['p50_ms']:.1f}",
            f"{p['p95_ms']:.1f}",
            f"{p['p99_ms']:.1f}",
            f"{p['max_ms']:.1f}",
        )
    console.print(table)
    console.print(f"job statuses at the end: {result['statuses']}; errors: {result['error_count']}")
