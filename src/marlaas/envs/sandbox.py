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

Warm workers (backend ``bwrap``, the default; ``Sandbox(warm=False)`` starts a bubblewrap
per call as described above): a sandbox keeps up to `default_workers()` worker processes,
each started once under its own bubblewrap with the isolation above, and forks a fresh
child per call (`marlaas.envs.sandbox_child.WORKER`). Before any of the program runs, the
child becomes uid 65534, enters user, mount and IPC namespaces of its own (so RLIMIT_NPROC
counts this call's processes alone, SysV IPC objects are the call's own, and no further
user namespace can be made), mounts a fresh size-capped tmpfs at /tmp with the program
read-only at /tmp/main.py, and drops every capability; then the limits and the program as
above. After the program exits, the worker kills and reaps every other process of its pid
namespace before it takes the next call (a call's /tmp, IPC objects and processes never
reach the next). The worker never reads a call's program, input or output (they go by
descriptor from the parent to the child), is not dumpable (a program can neither trace
it nor read its memory) and, as root, runs as another uid than the programs; where a
program kills it anyway (as non-root it can), that call ends with the reason "sandbox
worker died" and the worker is replaced. A worker that overruns the wall limit or the
output cap is killed whole and replaced. What a call shares with the others of its worker:
the pid, network and UTS namespaces (nothing of another call is left in them) and the
worker's interpreter state as forked: `sandbox_child.WARM_MODULES` already imported, the
process's hash seed. Cost: a cold call ~25 ms of CPU (bwrap, an interpreter start, the
evaluator's imports: 24.6 ms a `countdown` check), a warm one ~2.6 ms (`marlaas bench
sandbox`); in `marlaas bench paper --regime paper` (960 sandboxed checks) the machine's
CPU outside marlaas fell from 13.6 s to 2.5 s and the run from 34.7 s to 26.1 s. Where the
kernel refuses a call's namespaces, the sandbox warns once and goes on cold.

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
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from typing import Literal

from marlaas.envs.sandbox_call import SandboxLimits, SandboxResult, collect, kill_group, result
from marlaas.envs.sandbox_child import base_python, bootstrap_args, bwrap_argv, child_env
from marlaas.envs.sandbox_warm import CallSetupError, WorkerPool, default_workers
from marlaas.errors import ConfigError, SandboxError

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "default_sandbox"]

_log = logging.getLogger(__name__)

Backend = Literal["bwrap", "rlimit"]

_INSTALL_HINT = "install it with `apt-get install bubblewrap`"


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
        warm: bool = True,
        workers: int | None = None,
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
        #: Warm workers (bwrap only; None: every call starts its own bwrap).
        size = workers if workers is not None else default_workers()
        if size < 1:
            raise ConfigError(f"Sandbox(workers=...) must be at least 1, got {size}")
        self._pool = WorkerPool(size) if warm and backend == "bwrap" else None

    @property
    def backend_name(self) -> Backend:
        return self._backend

    @property
    def workers_started(self) -> int:
        """Warm workers this sandbox has started (0 where it starts none)."""
        return 0 if self._pool is None else self._pool.started

    def close(self) -> None:
        """Stop the idle warm workers (they also end with their sandbox or process)."""
        if self._pool is not None:
            self._pool.close()

    async def run_python(
        self, code: str, stdin: str = "", limits: SandboxLimits | None = None
    ) -> SandboxResult:
        """Run `code` with `stdin` as its input; `limits` overrides the sandbox's limits."""
        limits, source = limits or self.limits, code.encode()
        with contextlib.ExitStack() as stack:
            stdin_fd = _memfd(stack, stdin.encode())
            if self._backend == "rlimit":
                return await self._run_rlimit(source, stdin_fd, limits)
            code_fd = _memfd(stack, source)
            if self._pool is not None:
                try:
                    return await self._pool.run(code_fd, stdin_fd, len(source), limits)
                except CallSetupError as exc:  # e.g. no nested user namespaces here
                    _log.warning("sandbox: warm workers unavailable (%s); every call starts "
                                 "its own bubblewrap from now on", exc)  # fmt: skip
                    self._pool.close()
                    self._pool = None
                    for fd in (code_fd, stdin_fd):  # shared offsets: the child may have read
                        os.lseek(fd, 0, os.SEEK_SET)
            status_r, status_w = _pipe(stack)
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


class _Process:
    """A call that is a process of its own (the rlimit backend, a one-off bwrap), a
    `sandbox_call.Call`: stopped by killing its process group (bwrap's: that ends its pid
    namespace), after a normal exit too (what the program left)."""

    sweep_on_exit = True

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def wait(self) -> None:
        await self.proc.wait()

    def stop(self) -> None:
        kill_group(self.proc.pid)


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
    process group; `status_fd` is bwrap's status pipe when bwrap runs the program."""

    async def launch(out_w: int, err_w: int) -> _Process:
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
        return _Process(proc)

    call, output = await collect(limits, launch)
    rc = None if output.killed else call.proc.returncode
    if status_fd is not None and not output.killed:
        if (code := _exit_code(status_fd)) is None:  # bwrap failed before the program ran
            detail = bytes(output.stderr).decode(errors="replace").strip()
            raise SandboxError(f"bubblewrap could not set up the sandbox: {detail}")
        rc = 128 - code if 128 < code < 128 + signal.NSIG else code
    return result(rc, output)


def _exit_code(status_fd: int) -> int | None:
    """The program's exit status from bwrap's JSON status pipe; None if it never ran.
    bwrap has exited, so the pipe already holds all it will get (two short lines)."""
    os.set_blocking(status_fd, False)
    with contextlib.suppress(BlockingIOError):
        for line in os.read(status_fd, 65536).splitlines():
            if b'"exit-code"' in line:
                return int(json.loads(line)["exit-code"])
    return None
