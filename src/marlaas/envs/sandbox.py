"""Run untrusted Python (model-written code, user graders) under hard limits.

`Sandbox.run_python(code, stdin)` runs `code` as a ``python -I -S -B -X utf8`` program
(standard library only) and returns a `SandboxResult`. A failure of the code (exception, limit,
timeout) is a result with ``ok=False`` and a `reason`, never an exception; `SandboxError`
means the sandbox itself could not start. Nothing blocks the event loop but the one-off
bubblewrap probe (tens of milliseconds, once per process).

Every call, on both backends:

- A clean environment (PATH, HOME, TMPDIR, LANG; none of the parent's variables, so no
  secrets from there) and a private in-memory stdin.
- rlimits set by a bootstrap in the child before any of the program runs: RLIMIT_CPU
  (SIGXCPU at `cpu_seconds` rounded up, SIGKILL a second later), RLIMIT_AS (a big allocation
  raises MemoryError), RLIMIT_FSIZE, RLIMIT_NPROC (processes and threads), RLIMIT_CORE = 0.
- One interpreter start per call: the bootstrap then runs the program itself, in the same
  interpreter (same flags), rather than exec a second one. A call cost ~35 ms of CPU, bwrap
  ~7 ms of it and each interpreter start ~8-10 ms, on 2 cores shared with the model's
  device thread; one start less measured ~4 ms of CPU (rlimit: 18.5 -> 14.7 ms a call) and
  ~4-6 ms of wall a call (bwrap 30.3 -> 24.7 ms, rlimit 18.7 -> 14.8 ms). The program
  sees what ``python <flags> main.py`` shows it: ``__name__ == "__main__"`` in a fresh
  ``__main__`` module with ``__file__``, ``sys.argv == [its path]``, exit status and signals
  as a script's (an uncaught exception prints its traceback, without the bootstrap's frame,
  and exits 1). What remains of the bootstrap: its modules (os, resource and, under root,
  ctypes) stay imported, and it is one frame under the program's (``sys._getframe(1)``,
  one level of recursion depth).
- A wall-clock limit enforced by the parent, which then SIGKILLs the child's process group
  (the group is swept the same way after a normal exit).
- At most `output_bytes` of stdout and of stderr are kept; one byte more kills the child
  and marks the result truncated, so a flood of output costs the parent O(output_bytes).

Backend ``bwrap`` (bubblewrap) isolates: new network, pid, ipc, uts and cgroup namespaces
(no network at all, not even loopback; no view of host processes); a read-only root of
/usr, the /bin and /lib links and the Python install only (no /etc, /home or project tree);
a fresh /proc, a minimal /dev, a private size-capped tmpfs /tmp as cwd; capabilities
dropped, no new privileges, ``--new-session``, ``--die-with-parent``: killing bwrap ends the
pid namespace, so no process outlives the call. The program runs as uid/gid 65534 in a
user namespace of its own, so RLIMIT_NPROC counts this call's processes alone and binds (a
fork bomb stops at `max_processes`). Under root, bwrap runs privileged keeping only
CAP_SETUID/CAP_SETGID and the bootstrap drops to 65534 and unshares that namespace itself
(then clears the capabilities it holds in it), because root ignores RLIMIT_NPROC and a user
namespace made by bwrap as root maps 65534 to host root; not as root, bwrap makes it
(``--uid 65534``). An exit status above 128 is read as a signal, as shells do. The child's
command lines and its bootstrap program are `marlaas.envs.sandbox_child`'s.

Backend ``rlimit`` (the fallback where bubblewrap is missing or cannot run, warned once per
process) has the limits above and a temporary cwd but NO isolation: the program can use the
network, read and write whatever the service's user can (/proc/<pid>/environ of other
processes included), and a child that calls setsid() escapes the group kill. As root
RLIMIT_NPROC does not apply: a fork bomb is bounded only by the wall-clock kill; as another
user it counts all processes and threads of that user. For trusted code and tests only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any, Literal

from marlaas.envs.sandbox_child import MiB, base_python, bootstrap_args, bwrap_argv, child_env
from marlaas.errors import ConfigError, SandboxError

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "default_sandbox"]

_log = logging.getLogger(__name__)

Backend = Literal["bwrap", "rlimit"]

_INSTALL_HINT = "install it with `apt-get install bubblewrap`"
#: How long the output pipes may drain once the child is gone.
_DRAIN_S = 1.0


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one call; every value must be positive."""

    cpu_seconds: float = 2.0
    wall_seconds: float = 5.0
    memory_bytes: int = 512 * MiB
    max_processes: int = 32
    file_size_bytes: int = 1 * MiB
    output_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ConfigError(f"SandboxLimits.{f.name} must be positive, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one run did. `returncode` is the exit status, -N after death by signal N, or
    None when the sandbox killed the program at a limit (timeout, output)."""

    ok: bool
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    #: "timeout", "output limit", "killed by signal ...", "exit code N"; None when ok.
    reason: str | None
    wall_s: float


class Sandbox:
    """Runs Python programs under `limits` (see the module docstring for the guarantees).

    ``backend="auto"`` uses bubblewrap where it works and otherwise falls back to
    ``"rlimit"`` with one warning per process; ``"bwrap"`` raises `SandboxError` where
    bubblewrap cannot run; ``"rlimit"`` never tries it.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        backend: Literal["auto", "bwrap", "rlimit"] = "auto",
    ) -> None:
        self.limits = limits or SandboxLimits()
        if backend == "auto":
            backend = _auto_backend()
        elif backend == "bwrap" and (problem := _bwrap_problem()) is not None:
            raise SandboxError(
                f"bubblewrap cannot run here ({problem}); {_INSTALL_HINT}, "
                "or use Sandbox(backend='rlimit') for trusted code"
            )
        self._backend: Backend = backend

    @property
    def backend_name(self) -> Backend:
        return self._backend

    async def run_python(
        self, code: str, stdin: str = "", limits: SandboxLimits | None = None
    ) -> SandboxResult:
        """Run `code` with `stdin` as its input; `limits` overrides the sandbox's limits."""
        limits, source = limits or self.limits, code.encode()
        with contextlib.ExitStack() as stack:
            stdin_fd = _memfd(stack, stdin.encode())
            if self._backend == "rlimit":
                return await self._run_rlimit(source, stdin_fd, limits)
            code_fd, (status_r, status_w) = _memfd(stack, source), _pipe(stack)
            argv = bwrap_argv(code_fd, status_w, len(source), limits)
            return await _execute(argv, stdin_fd, limits, cwd="/", env=child_env("/tmp"),
                                  pass_fds=(code_fd, status_w), status_fd=status_r)  # fmt: skip

    async def _run_rlimit(
        self, source: bytes, stdin_fd: int, limits: SandboxLimits
    ) -> SandboxResult:
        workdir = tempfile.mkdtemp(prefix="marlaas-sandbox-")
        try:
            main = os.path.join(workdir, "main.py")
            with open(main, "wb") as f:
                f.write(source)
            argv = [base_python(), *bootstrap_args(limits, drop=False, main=main)]
            return await _execute(argv, stdin_fd, limits, cwd=workdir, env=child_env(workdir))
        finally:
            await asyncio.to_thread(shutil.rmtree, workdir, True)


@functools.cache
def default_sandbox() -> Sandbox:
    """The process-wide sandbox with default limits, made on first use."""
    return Sandbox()


def _memfd(stack: contextlib.ExitStack, data: bytes) -> int:
    """An anonymous in-memory file holding `data`, positioned at its start."""
    fd = os.memfd_create("marlaas-sandbox", os.MFD_CLOEXEC)
    stack.callback(os.close, fd)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _pipe(stack: contextlib.ExitStack) -> tuple[int, int]:
    r, w = os.pipe()
    stack.callback(os.close, r)
    stack.callback(os.close, w)
    return r, w


@functools.cache
def _bwrap_problem() -> str | None:
    """None when bubblewrap runs a program here, else why not. Probed once per process,
    synchronously, with the arguments every call uses."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap not found on PATH"
    source = b"print('ok')"
    try:
        with contextlib.ExitStack() as stack:
            code_fd, (_, status_w) = _memfd(stack, source), _pipe(stack)
            argv = bwrap_argv(code_fd, status_w, len(source), SandboxLimits())
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                  cwd="/", env=child_env("/tmp"), pass_fds=(code_fd, status_w),
                                  timeout=30)  # fmt: skip
    except (SandboxError, OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if proc.returncode != 0 or proc.stdout != b"ok\n":
        detail = proc.stderr.decode(errors="replace").strip()[-500:]
        return f"the probe program failed with status {proc.returncode}: {detail}"
    return None


@functools.cache
def _auto_backend() -> Backend:
    """The backend "auto" means here; warns once per process when it is the fallback."""
    problem = _bwrap_problem()
    if problem is None:
        return "bwrap"
    _log.warning(
        "SANDBOX FALLBACK: bubblewrap is unavailable (%s); sandboxed code runs in a plain "
        "subprocess with rlimits only, WITHOUT network, filesystem or process isolation. "
        "To isolate it, %s.",
        problem,
        _INSTALL_HINT,
    )
    return "rlimit"


class _Capture(asyncio.Protocol):
    """Keeps the first `cap` bytes read from a pipe; one byte more sets `overflow`."""

    def __init__(self, cap: int, overflow: asyncio.Event) -> None:
        self.data = bytearray()
        self.cap = cap
        self.overflow = overflow
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def factory(self) -> _Capture:
        return self

    def data_received(self, data: bytes) -> None:
        room = max(0, self.cap - len(self.data))
        self.data += data[:room]
        if len(data) > room:
            self.overflow.set()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def _execute(
    argv: list[str],
    stdin_fd: int,
    limits: SandboxLimits,
    *,
    cwd: str,
    env: dict[str, str],
    pass_fds: tuple[int, ...] = (),
    status_fd: int | None = None,
) -> SandboxResult:
    """Run `argv` in a new session with bounded output and the wall limit, then kill its
    process group; `status_fd` is bwrap's status pipe when bwrap runs the program. The
    pipes are ours, not asyncio's: in Python 3.11 `Process.wait()` also waits for its pipes,
    which a writer left behind (or a full pipe) would hold open."""
    loop = asyncio.get_running_loop()
    overflow = asyncio.Event()
    out, err = _Capture(limits.output_bytes, overflow), _Capture(limits.output_bytes, overflow)
    start = time.monotonic()
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    readers = [open(out_r, "rb", buffering=0), open(err_r, "rb", buffering=0)]  # noqa: SIM115
    transports: list[asyncio.BaseTransport] = []
    waiters: list[asyncio.Future[Any]] = []
    try:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=stdin_fd,
                stdout=out_w,
                stderr=err_w,
                cwd=cwd,
                env=env,
                pass_fds=pass_fds,
                start_new_session=True,
            )
        except OSError as exc:
            raise SandboxError(f"could not start the sandbox ({argv[0]}): {exc}") from exc
        finally:
            os.close(out_w)  # the child holds the write ends now; EOF comes when it is gone
            os.close(err_w)
        swept = False
        try:
            for reader, capture in zip(readers, (out, err), strict=True):
                transports.append((await loop.connect_read_pipe(capture.factory, reader))[0])
            exited = asyncio.ensure_future(proc.wait())
            waiters = [exited, asyncio.ensure_future(overflow.wait())]
            done, _ = await asyncio.wait(
                waiters, timeout=limits.wall_seconds, return_when=asyncio.FIRST_COMPLETED
            )
            killed = exited not in done
            _kill_group(proc.pid)  # after a normal exit, this sweeps what the program left
            swept = True
            await exited
            await asyncio.wait([out.closed, err.closed], timeout=_DRAIN_S)
        finally:
            if not swept:
                _kill_group(proc.pid)
    finally:
        for waiter in waiters:
            waiter.cancel()
        for transport in transports:
            transport.close()
        for reader in readers:
            reader.close()
    rc = None if killed else proc.returncode
    if status_fd is not None and not killed:
        if (code := _exit_code(status_fd)) is None:  # bwrap failed before the program ran
            detail = bytes(err.data).decode(errors="replace").strip()
            raise SandboxError(f"bubblewrap could not set up the sandbox: {detail}")
        rc = 128 - code if 128 < code < 128 + signal.NSIG else code
    return _result(rc, out.data, err.data, killed, overflow.is_set(), time.monotonic() - start)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _exit_code(status_fd: int) -> int | None:
    """The program's exit status from bwrap's JSON status pipe; None if it never ran.
    bwrap has exited, so the pipe already holds all it will get (two short lines)."""
    os.set_blocking(status_fd, False)
    with contextlib.suppress(BlockingIOError):
        for line in os.read(status_fd, 65536).splitlines():
            if b'"exit-code"' in line:
                return int(json.loads(line)["exit-code"])
    return None


def _result(
    rc: int | None, out: bytearray, err: bytearray, killed: bool, truncated: bool, wall_s: float
) -> SandboxResult:
    timed_out = killed and not truncated
    reason: str | None = None
    if truncated:
        reason = "output limit"
    elif timed_out:
        reason = "timeout"
    elif rc is not None and rc < 0:
        reason = f"killed by signal {_signal_name(-rc)}"
    elif rc != 0:
        reason = f"exit code {rc}"
    return SandboxResult(
        ok=reason is None, returncode=rc, stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"), timed_out=timed_out, truncated=truncated,
        reason=reason, wall_s=wall_s,
    )  # fmt: skip


def _signal_name(signum: int) -> str:
    """ "SIGXCPU (cpu limit)", "SIGKILL (memory or cpu limit?)", "SIGTERM", "signal 40"."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    hint = {"SIGXCPU": " (cpu limit)", "SIGKILL": " (memory or cpu limit?)"}.get(name, "")
    return name + hint
