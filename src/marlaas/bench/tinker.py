"""`marlaas bench tinker`: N `tinker` SDK clients, each running the same RL loop
(`bench.tinker_loop`, the reverse task), served by one real `marlaas serve` together
(N threads at once, each its own tenant) and one after another, side by side.

One server serves every run (the base is loaded once; its device is the hub's own,
`--backend none`), with engine rows for one step's samples of every client of the
largest N (`serve --max-batch-rows`), so clients served together can share decode
iterations; one client alone uses its share of them. Per N and mode: wall time, tokens per second (sampled plus trained),
and what the device shared over the run (training passes, the most tenants one pass
held, rows per engine iteration), read from the server's `/metrics` before and after.
The ratio is the one-after-another wall time over the together wall time. A table on
screen, JSON on disk; nothing is asserted about the figures.
"""

from __future__ import annotations

import json
import platform
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import tinker
from rich.console import Console
from rich.table import Table

from marlaas.bench.tinker_loop import LoopConfig, LoopResult, run_loop
from marlaas.bench.tinker_server import Served, serving
from marlaas.errors import MarlaasError

_PASSES = "marlaas_device_train_passes_total"
_DECODES = "marlaas_device_decode_steps_total"
_CALLS = "marlaas_tinker_forward_backward_calls_total"


def _loop(served: Served, name: str, base: str, config: LoopConfig) -> LoopResult:
    service = tinker.ServiceClient(base_url=served.url, api_key=served.tenant(name))
    try:
        return run_loop(service, base, config)
    finally:
        service.close("success").result()


def _together(served: Served, n: int, base: str, config: LoopConfig, tag: str) -> list[LoopResult]:
    results: list[LoopResult | None] = [None] * n
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            results[i] = _loop(served, f"{tag}-{i}", base, replace(config, seed=i))
        except BaseException as e:  # reported below, after every thread ended
            errors.append(e)

    threads = [
        threading.Thread(target=client, args=(i,), name=f"tinker-client-{i}") for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise MarlaasError(f"a benchmark client failed: {errors[0]!r}") from errors[0]
    return [r for r in results if r is not None]


def _run(
    served: Served, n: int, base: str, config: LoopConfig, mode: str, tag: str
) -> dict[str, Any]:
    """One run of `n` loops in `mode`; `tag` makes its tenants' names unique."""
    before = served.metrics()
    server_cpu, client_cpu = served.cpu_s(), time.process_time()
    start = time.perf_counter()
    if mode == "together":
        results = _together(served, n, base, config, tag)
    else:
        results = [_loop(served, f"{tag}-{i}", base, replace(config, seed=i)) for i in range(n)]
    wall = time.perf_counter() - start
    server_cpu, client_cpu = served.cpu_s() - server_cpu, time.process_time() - client_cpu
    after = served.metrics()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    passes, calls = delta(_PASSES), delta(_CALLS)
    tokens = sum(r.tokens_sampled + r.tokens_trained for r in results)
    return {
        "clients": n,
        "mode": mode,
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "server_cpu_s": server_cpu,
        "client_cpu_s": client_cpu,
        "device_busy_s": delta("marlaas_device_busy_seconds_total"),
        "device_decode_s": delta("marlaas_device_decode_seconds_total"),
        "device_train_s": delta("marlaas_device_train_seconds_total"),
        "train_passes": passes,
        "forward_backward_calls": calls,
        "calls_per_pass": calls / passes if passes else 0.0,
        "tenants_per_pass": delta("marlaas_device_pass_tenants_total") / passes if passes else 0.0,
        "pass_tenants_max": after.get("marlaas_device_pass_tenants_max", 0.0),
        "decode_steps": delta(_DECODES),
        "reward_last": sum(r.rewards[-1] for r in results) / len(results),
    }


def default_engine_rows(clients: Sequence[int], config: LoopConfig) -> int:
    """Rows for one step's samples of every client of the largest N (at most 4096)."""
    return min(config.prompts_per_step * config.group_size * max(clients), 4096)


def run_tinker_bench(
    clients: Sequence[int],
    config: LoopConfig,
    json_path: str | Path | None = None,
    console: Console | None = None,
    *,
    engine_rows: int | None = None,
) -> dict[str, Any]:
    """Run every N together and one after another on one server; print and return."""
    console = console or Console(width=120)  # the whole table, even without a terminal
    rows = engine_rows or default_engine_rows(clients, config)
    runs: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="marlaas-bench-tinker-") as tmp,
        serving(Path(tmp), "--max-batch-rows", str(rows)) as served,
    ):
        key = served.tenant("bench-probe")
        caps = tinker.RestClient(base_url=served.url, api_key=key).get_server_capabilities()
        base = str(caps.result().supported_models[0].model_name)
        _loop(served, "warmup", base, replace(config, steps=1))  # first-use costs out of the runs
        for n in clients:
            for mode in ("together", "one_after_another"):
                console.print(f"[bold]{n} client(s), {mode}[/bold] ...")
                runs.append(_run(served, n, base, config, mode, f"{mode}-{n}"))
    result = {
        "config": asdict(config),
        "engine_rows": rows,
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "runs": runs,
        "ratios": {str(n): _ratio(runs, n) for n in clients},
    }
    _print(console, result)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2, sort_keys=True))
    return result


def _ratio(runs: list[dict[str, Any]], n: int) -> float:
    by_mode = {r["mode"]: r["wall_s"] for r in runs if r["clients"] == n}
    together = by_mode.get("together", 0.0)
    return by_mode.get("one_after_another", 0.0) / together if together else 0.0


def _print(console: Console, result: dict[str, Any]) -> None:
    c = result["config"]
    table = Table(
        title=f"Tinker SDK clients, each an RL loop of {c['steps']} steps "
        f"({c['prompts_per_step']}x{c['group_size']} samples, {c['loss_fn']}; "
        f"{result['engine_rows']} engine rows)"
    )
    for col in (
        "clients",
        "mode",
        "wall s",
        "tokens/s",
        "server CPU s",
        "device s",
        "decode s",
        "train s",
        "calls/pass",
        "ratio",
    ):
        table.add_column(col, justify="right")
    for r in result["runs"]:
        together = r["mode"] == "together"
        table.add_row(
            str(r["clients"]),
            r["mode"].replace("_", " "),
            f"{r['wall_s']:.1f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['server_cpu_s']:.1f}",
            f"{r['device_busy_s']:.1f}",
            f"{r['device_decode_s']:.1f}",
            f"{r['device_train_s']:.1f}",
            f"{r['tenants_per_pass']:.2f}",
            f"{result['ratios'][str(r['clients'])]:.2f}x" if together else "",
        )
    console.print(table)
    console.print(
        "ratio: one-after-another wall time / together wall time (same server, same loops). "
        "server CPU s: CPU the server used; device s: time inside engine iterations (decode "
        "s) and training passes and optimizer steps (train s); tenants/pass: tenants per forward/backward pass of the device."
    )
