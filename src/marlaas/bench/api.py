"""`marlaas bench api`: the service's API latency while many jobs train.

Starts a real `marlaas serve` (the pipeline backend on the embedded base, SQLite in a
temporary data directory, a free loopback port), creates one tenant, submits N small
jobs over the five built-in families, and while they train, C client threads read the
job list, one job, its metrics and its checkpoints in a loop, and `inference_clients`
threads ask for 16-token completions of the base (`POST /v1/completions`) one after
another, so interactive inference is measured while the same engine samples the jobs'
rollouts. It stops when every job is done (or failed, or the time limit passes), then
polls and completes again for `idle_s` seconds with every job done, and reports latency
percentiles and throughput per phase and endpoint, side by side: a table on screen and
JSON on disk. Pollers either send back to back (a saturation test: latency is mostly
queueing) or at a fixed rate each (`rate`), timed from each request's scheduled start.
Nothing is asserted about the figures.
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
#: The interactive request: a short prompt of the arithmetic family, 16 new tokens.
COMPLETION = {"model": "base", "prompt": "Q: 37+485\nA: ", "max_tokens": 16, "seed": 0}
COMPLETION_TOKENS = COMPLETION["max_tokens"]


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
    rate: float = 0.0,
    idle_s: float = 10.0,
    inference_clients: int = 1,
    console: Console | None = None,
) -> dict[str, Any]:
    """Measure the API under `jobs` training jobs, `clients` polling threads and
    `inference_clients` completion threads, then for `idle_s` seconds with the same jobs
    done (the pipeline idle), side by side.

    `rate` > 0: each client sends `rate` requests per second on a fixed schedule and a
    latency counts from the request's scheduled time (a late start is the server's
    delay too); 0: each client sends its next request as soon as the last answers.
    """
    if jobs < 1 or clients < 1 or steps < 1:
        raise MarlaasError("jobs, clients and steps must be >= 1")
    if rate < 0 or idle_s < 0 or inference_clients < 0:
        raise MarlaasError("rate, idle_s and inference_clients must be >= 0")
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
            _wait_ready(base, proc, log, 300)  # a loaded machine starts slowly
            result = _measure(
                base, jobs, clients, steps, timeout_s, rate, idle_s, inference_clients
            )
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    result["config"] = {
        "jobs": jobs,
        "clients": clients,
        "steps": steps,
        "rate_per_client": rate,
        "idle_s": idle_s,
        "inference_clients": inference_clients,
        "cpus": os.cpu_count(),
    }
    _print(console, result)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2, sort_keys=True))
    return result


class _Pollers:
    """`clients` threads that read the job list, one job, its metrics and its
    checkpoints in turn until stopped, each at `rate` requests per second (0: closed
    loop), recording per-endpoint latencies; and `completers` threads that each ask for
    one `COMPLETION` after another (`complete`)."""

    def __init__(
        self,
        base: str,
        headers: dict[str, str],
        ids: list[str],
        clients: int,
        rate: float,
        completers: int = 0,
    ) -> None:
        self.samples: dict[str, list[float]] = {name: [] for name in ENDPOINTS}
        if completers:
            self.samples["complete"] = []
        self.completion_tokens: list[int] = []
        self.errors: list[str] = []
        self._base, self._headers, self._ids, self._rate = base, headers, ids, rate
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._poll, args=(k,), daemon=True) for k in range(clients)
        ] + [threading.Thread(target=self._complete, daemon=True) for _ in range(completers)]
        self.started = time.perf_counter()
        for th in self._threads:
            th.start()

    def stop(self) -> float:
        """Stop and join; the seconds they ran."""
        self._stop.set()
        for th in self._threads:
            th.join()
        return time.perf_counter() - self.started

    def _urls(self, job: str) -> tuple[str, ...]:
        return (
            "/v1/jobs",
            f"/v1/jobs/{job}",
            f"/v1/jobs/{job}/metrics",
            f"/v1/jobs/{job}/checkpoints",
        )

    def _poll(self, k: int) -> None:
        # Clients start spread over one period so that they do not send in lockstep.
        period = 1.0 / self._rate if self._rate > 0 else 0.0
        due = time.perf_counter() + period * k / max(len(self._threads), 1)
        with httpx.Client(base_url=self._base, headers=self._headers, timeout=60) as c:
            i = k
            while not self._stop.is_set():
                job = self._ids[i % len(self._ids)]
                i += 1
                for name, url in zip(ENDPOINTS, self._urls(job), strict=True):
                    if period:
                        wait = due - time.perf_counter()
                        if wait > 0 and self._stop.wait(wait):
                            return
                        start, due = due, due + period
                    else:
                        start = time.perf_counter()
                    r = c.get(url)
                    dt = time.perf_counter() - start
                    with self._lock:
                        if r.status_code == 200:
                            self.samples[name].append(dt)
                        else:
                            self.errors.append(f"{url}: {r.status_code}")

    def _complete(self) -> None:
        with httpx.Client(base_url=self._base, headers=self._headers, timeout=120) as c:
            while not self._stop.is_set():
                start = time.perf_counter()
                r = c.post("/v1/completions", json=COMPLETION)
                dt = time.perf_counter() - start
                with self._lock:
                    if r.status_code == 200:
                        self.samples["complete"].append(dt)
                        self.completion_tokens.append(r.json()["usage"]["completion_tokens"])
                    else:
                        self.errors.append(f"/v1/completions: {r.status_code} {r.text[:120]}")


def _phase(pollers: _Pollers, seconds: float) -> dict[str, Any]:
    n = sum(len(pollers.samples[name]) for name in ENDPOINTS)
    tokens = pollers.completion_tokens
    return {
        "seconds": seconds,
        "requests_per_s": n / seconds if seconds > 0 else 0.0,
        "completion_tokens_mean": sum(tokens) / len(tokens) if tokens else 0.0,
        "errors": pollers.errors[:20],
        "error_count": len(pollers.errors),
        "latency": {name: percentiles(xs) for name, xs in pollers.samples.items()},
    }


def _measure(
    base: str,
    jobs: int,
    clients: int,
    steps: int,
    timeout_s: float,
    rate: float,
    idle_s: float,
    completers: int,
) -> dict[str, Any]:
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
    training = _Pollers(base, headers, ids, clients, rate, completers)
    statuses: dict[str, int] = {}
    with httpx.Client(base_url=base, headers=headers, timeout=60) as c:
        while time.perf_counter() - training.started < timeout_s:
            listed = c.get("/v1/jobs", params={"limit": jobs}).json()["jobs"]
            statuses = {}
            for j in listed:
                statuses[j["status"]] = statuses.get(j["status"], 0) + 1
            if sum(statuses.get(s, 0) for s in ("done", "failed", "cancelled")) == jobs:
                break
            time.sleep(1.0)
    wall = training.stop()
    phases = {"training": _phase(training, wall)}
    if idle_s > 0:
        idle = _Pollers(base, headers, ids, clients, rate, completers)
        time.sleep(idle_s)
        phases["idle"] = _phase(idle, idle.stop())
    return {
        "wall_s": wall,
        "statuses": statuses,
        "create": percentiles(create),
        "phases": phases,
        "error_count": sum(p["error_count"] for p in phases.values()),
    }


def _print(console: Console, result: dict[str, Any]) -> None:
    cfg = result["config"]
    mode = (
        f"{cfg['rate_per_client']:g} requests/s each"
        if cfg["rate_per_client"] > 0
        else "back to back"
    )
    table = Table(
        title=f"API latency: {cfg['jobs']} jobs, {cfg['clients']} clients ({mode}); "
        f"training took {result['wall_s']:.0f} s"
    )
    for col in ("phase", "endpoint", "requests", "req/s", "p50 ms", "p95 ms", "p99 ms", "max ms"):
        table.add_column(col, justify="left" if col in ("phase", "endpoint") else "right")
    rows = [("training", "create", result["create"], None)]
    for phase, figures in result["phases"].items():
        rows += [(phase, name, p, figures) for name, p in figures["latency"].items()]
    for phase, name, p, figures in rows:
        table.add_row(
            phase,
            name,
            str(p["n"]),
            "" if figures is None or name != ENDPOINTS[0] else f"{figures['requests_per_s']:.0f}",
            f"{p['p50_ms']:.1f}",
            f"{p['p95_ms']:.1f}",
            f"{p['p99_ms']:.1f}",
            f"{p['max_ms']:.1f}",
        )
    console.print(table)
    training, idle = result["phases"]["training"], result["phases"].get("idle")
    if idle and idle["latency"]["get"]["n"] and training["latency"]["get"]["n"]:
        ratio = training["latency"]["get"]["p99_ms"] / max(idle["latency"]["get"]["p99_ms"], 1e-9)
        console.print(f"GET job p99, training / idle: {ratio:.2f}x")
    if (
        idle
        and idle["latency"].get("complete", {}).get("n")
        and training["latency"]["complete"]["n"]
    ):
        train_p99 = training["latency"]["complete"]["p99_ms"]
        ratio = train_p99 / max(idle["latency"]["complete"]["p99_ms"], 1e-9)
        console.print(
            f"{COMPLETION_TOKENS}-token completion p99, training / idle: {ratio:.2f}x "
            f"(mean tokens: {training['completion_tokens_mean']:.1f} / "
            f"{idle['completion_tokens_mean']:.1f})"
        )
    console.print(f"job statuses at the end: {result['statuses']}; errors: {result['error_count']}")
