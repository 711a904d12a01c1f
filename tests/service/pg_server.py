"""A throwaway PostgreSQL server for the `postgres` tests: initdb + pg_ctl on a temp
directory, listening on a free loopback port and a private unix socket.

PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user
that Debian's package creates (through `runuser`). Binaries are found on PATH or under
/usr/lib/postgresql/<version>/bin.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = (
    "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or under "
    "/usr/lib/postgresql/*/bin; install Debian's `postgresql` package "
    "(`make system-deps` does it)"
)


def find_bin_dir() -> Path | None:
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(os.path.realpath(initdb)).parent
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
    )
    for candidate in reversed(candidates):
        if (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class PgServer:
    port: int
    user: str

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{database}"


@contextmanager
def running_server(bin_dir: Path) -> Iterator[PgServer]:
    """Start a server for the duration of the block; stop it and delete its files."""
    as_root = os.geteuid() == 0
    prefix = ["runuser", "-u", "postgres", "--"] if as_root else []
    root = Path(tempfile.mkdtemp(prefix="marlaas-pg-"))
    data, log = root / "data", root / "server.log"
    if as_root:
        shutil.chown(root, "postgres", "postgres")
    port = _free_port()

    def run(*args: str) -> None:
        done = subprocess.run([*prefix, *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            server_log = log.read_text() if log.exists() else ""
            raise RuntimeError(
                f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}\n"
                f"{server_log}"
            )

    user = "marlaas"
    initdb = [str(bin_dir / "initdb"), "-D", str(data), "-U", user, "--auth=trust"]
    pg_ctl = [str(bin_dir / "pg_ctl"), "-D", str(data), "-w"]
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    try:
        run(*initdb, "-E", "UTF8", "--no-sync")
        run(*pg_ctl, "-l", str(log), "-o", options, "-t", "60", "start")
        try:
            yield PgServer(port=port, user=user)
        finally:
            run(*pg_ctl, "-m", "immediate", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
