"""A real `marlaas serve` in a subprocess on a free loopback port, for the Tinker
benchmark and tests: started with a fresh admin key and data directory, waited for
until healthy, tenants and their `tml-` keys made through the admin API, its
`/metrics` read back as numbers, and stopped with SIGTERM (then killed if it hangs).
The subprocess imports this same copy of marlaas.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

import marlaas
from marlaas.errors import MarlaasError


@dataclass(frozen=True)
class Served:
    url: str
    admin_key: str
    log: Path
    pid: int

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system, all its threads):
        what a run cost, however busy the rest of the machine was (Linux `/proc`)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def tenant(self, name: str, **quotas: int) -> str:
        """A new tenant; returns a fresh `tml-` key of it."""
        admin = {"Authorization": f"Bearer {self.admin_key}"}
        r = httpx.post(
            f"{self.url}/v1/admin/tenants", json={"name": name, "quotas": quotas}, headers=admin
        )
        r.raise_for_status()
        r = httpx.post(
            f"{self.url}/v1/admin/tenants/{name}/keys", json={"format": "tml"}, headers=admin
        )
        r.raise_for_status()
        key: str = r.json()["key"]
        return key

    def metrics(self) -> dict[str, float]:
        """Every sample of `/metrics` by name and labels (`name{k=v,...}`); read with the
        admin key, as `/metrics` asks."""
        admin = {"Authorization": f"Bearer {self.admin_key}"}
        r = httpx.get(f"{self.url}/metrics", headers=admin, timeout=30)
        r.raise_for_status()
        text = r.text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(data_dir: Path, *extra: str, ready_s: float = 120.0) -> Iterator[Served]:
    """`marlaas serve --backend none` (Tinker clients get the hub's own device) unless
    `extra` says otherwise, on 127.0.0.1."""
    port = _free_port()
    admin_key = secrets.token_urlsafe(24)
    src = str(Path(marlaas.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "MARLAAS_ADMIN_KEY": admin_key,
        "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    env.pop("MARLAAS_DB_URL", None)
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "serve.log"
    args = ["--backend", "none", *extra] if "--backend" not in extra else list(extra)
    command = [sys.executable, "-m", "marlaas.cli", "serve", "--port", str(port)]
    command += ["--data-dir", str(data_dir), "--log-level", "warning", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                raise MarlaasError(f"marlaas serve exited early:\n{log.read_text()}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise MarlaasError(
                    f"marlaas serve did not answer in {ready_s:.0f} s:\n{log.read_text()}"
                )
            time.sleep(0.1)
        yield Served(url, admin_key, log, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
