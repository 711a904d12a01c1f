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
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from marlaas.envs.sandbox_child import (
    MiB,
    base_python,
    bootstrap_args,
    bwrap_argv,
    child_env,
    worker_argv,
)
from marlaas.errors import ConfigError, SandboxError

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "default_sandbox"]

_log = logging.getLogger(__name__)

Backend = Literal["bwrap", "rlimit"]

_INSTALL_HINT = "install it with `apt-get install bubblewrap`"
#: How long the output pipes may drain once the child is gone.
_DRAIN_S = 1.0
#: How long a warm worker may take to start.
_WORKER_START_S = 30.0


def default_workers() -> int:
    """Warm workers a sandbox runs at most by default: twice the cores, at least 4 (calls
    are mostly short and CPU-bound; more would only contend for the cores)."""
    return max(4, 2 * (os.cpu_count() or 1))


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
    #: "timeout", "output limit", "killed by signal ...", "exit code N", "sandbox worker
    #: died" (the program killed its warm worker); None when ok.
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
        self._pool = _Pool(size) if warm and backend == "bwrap" else None

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
                except _CallSetupError as exc:  # e.g. no nested user namespaces here
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


class _CallSetupError(SandboxError):
    """A warm worker's child could not isolate a call (nothing of the program ran)."""


class _Call:
    """One started call, as `_collect` drives it: `wait()` returns when the program has
    exited; `stop()` kills whatever the call started (idempotent); `sweep_on_exit` says
    whether that is needed after a normal exit too."""

    sweep_on_exit = True

    async def wait(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


async def _collect(
    limits: SandboxLimits, launch: Callable[[int, int], Awaitable[_Call]]
) -> tuple[_Call, bytearray, bytearray, bool, bool, float]:
    """Start a call with `launch(stdout_w, stderr_w)` and wait for it under the wall limit
    and the output cap; returns the call, its stdout and stderr, whether it was killed
    (limit or cap), whether the output overflowed, and the wall time. The pipes are ours,
    not asyncio's: in Python 3.11 `Process.wait()` also waits for its pipes, which a
    writer left behind (or a full pipe) would hold open."""
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
            call = await launch(out_w, err_w)
        finally:
            os.close(out_w)  # the child holds the write ends now; EOF comes when it is gone
            os.close(err_w)
        settled = False  # stopped, or ended without needing it
        try:
            for reader, capture in zip(readers, (out, err), strict=True):
                transports.append((await loop.connect_read_pipe(capture.factory, reader))[0])
            exited = asyncio.ensure_future(call.wait())
            waiters = [exited, asyncio.ensure_future(overflow.wait())]
            done, _ = await asyncio.wait(
                waiters, timeout=limits.wall_seconds, return_when=asyncio.FIRST_COMPLETED
            )
            killed = exited not in done
            if killed or call.sweep_on_exit:  # after a normal exit: what the program left
                call.stop()
            settled = True
            await exited
            await asyncio.wait([out.closed, err.closed], timeout=_DRAIN_S)
        finally:
            if not settled:
                call.stop()
    finally:
        for waiter in waiters:
            waiter.cancel()
        for transport in transports:
            transport.close()
        for reader in readers:
            reader.close()
    return call, out.data, err.data, killed, overflow.is_set(), time.monotonic() - start


class _Process(_Call):
    """A call that is a process of its own (the rlimit backend, a one-off bwrap): stopped
    by killing its process group (bwrap's: that ends its pid namespace)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def wait(self) -> None:
        await self.proc.wait()

    def stop(self) -> None:
        _kill_group(self.proc.pid)


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

    async def launch(out_w: int, err_w: int) -> _Call:
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

    call, out, err, killed, overflow, wall_s = await _collect(limits, launch)
    assert isinstance(call, _Process)
    rc = None if killed else call.proc.returncode
    if status_fd is not None and not killed:
        if (code := _exit_code(status_fd)) is None:  # bwrap failed before the program ran
            detail = bytes(err).decode(errors="replace").strip()
            raise SandboxError(f"bubblewrap could not set up the sandbox: {detail}")
        rc = 128 - code if 128 < code < 128 + signal.NSIG else code
    return _result(rc, out, err, killed, overflow, wall_s)


class _Worker(_Call):
    """A warm worker (`sandbox_child.WORKER`) under its own bwrap, and the call it serves."""

    sweep_on_exit = False  # the worker sweeps its pid namespace before it answers

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock
        self.reply: dict[str, Any] | None = None

    @staticmethod
    async def start() -> _Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            ours.setblocking(False)
            try:
                proc = subprocess.Popen(
                    worker_argv(theirs.fileno()), stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/",
                    env=child_env("/tmp"), pass_fds=(theirs.fileno(),), start_new_session=True,
                )  # fmt: skip
            except OSError as exc:
                raise SandboxError(f"could not start the sandbox (bwrap): {exc}") from exc
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        worker = _Worker(proc, ours)
        try:
            ready = await asyncio.wait_for(worker._line(), _WORKER_START_S)
        except BaseException:
            worker.retire()
            raise
        stderr = proc.stderr
        if ready is None or not ready.get("ready"):
            worker.retire()
            detail = stderr.read().decode(errors="replace").strip() if stderr else ""
            raise SandboxError(f"bubblewrap could not set up the sandbox: {detail[-2000:]}")
        if stderr is not None:  # the worker's own stderr is /dev/null from here on
            stderr.close()
        return worker

    async def _line(self) -> dict[str, Any] | None:
        """The worker's next JSON line; None at EOF (the worker is gone)."""
        loop, data = asyncio.get_running_loop(), b""
        while not data.endswith(b"\n"):
            chunk = await loop.sock_recv(self.sock, 4096)
            if not chunk:
                return None
            data += chunk
        return dict(json.loads(data))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, fds: list[int], limits: SandboxLimits, tmp_size: int) -> None:
        cpu = max(1, math.ceil(limits.cpu_seconds))
        header = [cpu, limits.memory_bytes, limits.max_processes, limits.file_size_bytes, tmp_size]
        socket.send_fds(self.sock, [json.dumps(header).encode()], fds)

    async def wait(self) -> None:
        self.reply = await self._line()

    def stop(self) -> None:
        """Kill the worker with everything it runs (its bwrap's pid namespace ends; a
        pending `wait` then sees EOF)."""
        _kill_group(self.proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1.0)  # SIGKILL: at once

    def retire(self) -> None:
        self.stop()
        self.sock.close()


class _SendFailed(SandboxError):
    """A worker that looked alive could not take a call (it died meanwhile)."""


class _Pool:
    """A sandbox's warm workers: at most `size`, each serving one call at a time. A call
    takes an idle worker, or starts one while there are fewer than `size`, or else waits
    for one (outside its wall clock: a worker's call takes a few milliseconds, a worker's
    start ~30 ms of CPU). Workers belong to the process that started them (a forked
    process starts its own)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.idle: list[_Worker] = []
        self.live = 0  # started and not retired: busy, idle or starting
        self.started = 0
        self.pid = os.getpid()
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._finalizer = weakref.finalize(self, _Pool._stop_all, self.idle, self.pid)

    async def run(
        self, code_fd: int, stdin_fd: int, code_len: int, limits: SandboxLimits
    ) -> SandboxResult:
        tmp_size = code_len + 8 * limits.file_size_bytes + MiB
        for attempt in range(2):  # an idle worker may have died meanwhile: then another
            worker = await self._acquire()

            async def launch(out_w: int, err_w: int, worker: _Worker = worker) -> _Call:
                try:
                    worker.send([code_fd, stdin_fd, out_w, err_w], limits, tmp_size)
                except OSError as exc:
                    raise _SendFailed(f"the worker could not take the call: {exc}") from exc
                return worker

            try:
                _, out, err, killed, overflow, wall_s = await _collect(limits, launch)
            except _SendFailed:
                self._release(worker, healthy=False)
                if attempt:
                    raise
                continue
            except BaseException:  # cancelled: the worker was stopped
                self._release(worker, healthy=False)
                raise
            break
        reply = worker.reply
        self._release(worker, healthy=not killed and reply is not None and "status" in reply)
        if reply is not None and reply.get("setup"):
            raise _CallSetupError(f"a warm worker could not set up the call: {reply['setup']}")
        if reply is None and not killed:  # the program brought its worker down
            return _result(None, out, err, killed, overflow, wall_s, "sandbox worker died")
        rc = None if killed or reply is None else os.waitstatus_to_exitcode(reply["status"])
        return _result(rc, out, err, killed, overflow, wall_s)

    async def _acquire(self) -> _Worker:
        if os.getpid() != self.pid:  # forked: the workers are the parent's
            for worker in self.idle:
                worker.sock.close()  # this process's copy only
            self.idle.clear()
            self.live, self.pid = 0, os.getpid()
        while True:
            while self.idle:
                worker = self.idle.pop()
                if worker.alive():
                    return worker
                self._retire(worker)
            if self.live < self.size:
                self.live += 1
                try:
                    worker = await _Worker.start()
                except BaseException:
                    self.live -= 1
                    self._wake()
                    raise
                self.started += 1
                return worker
            waiter = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken, then cancelled: pass the turn on
                else:
                    with contextlib.suppress(ValueError):
                        self.waiters.remove(waiter)
                raise

    def _release(self, worker: _Worker, *, healthy: bool) -> None:
        if healthy and os.getpid() == self.pid:
            self.idle.append(worker)
        else:
            self._retire(worker)
        self._wake()

    def _retire(self, worker: _Worker) -> None:
        worker.retire()
        self.live -= 1

    def _wake(self) -> None:
        """Let the longest-waiting call try again (on its own event loop)."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if waiter.done():
                continue
            try:
                waiter.get_loop().call_soon_threadsafe(_wake_up, waiter)
                return
            except RuntimeError:  # its loop is closed
                continue

    def close(self) -> None:
        self.live -= len(self.idle)
        _Pool._stop_all(self.idle, self.pid)

    @staticmethod
    def _stop_all(idle: list[_Worker], owner: int) -> None:
        """Stop the idle workers, in the process that started them (a forked copy of the
        list, at its exit, must not stop the parent's)."""
        if os.getpid() != owner:
            return
        while idle:
            idle.pop().retire()


def _wake_up(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


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
    rc: int | None,
    out: bytearray,
    err: bytearray,
    killed: bool,
    truncated: bool,
    wall_s: float,
    failure: str | None = None,
) -> SandboxResult:
    timed_out = killed and not truncated
    reason: str | None = failure
    if reason is not None:
        pass
    elif truncated:
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
