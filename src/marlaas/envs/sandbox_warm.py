"""Warm sandbox workers (`marlaas.envs.sandbox`, backend bwrap): each started once under its
own bubblewrap (`sandbox_child.WORKER`), forking a fresh, isolated child per call. What a
call gets and shares is in `marlaas.envs.sandbox`'s module doc."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import weakref
from typing import Any

from marlaas.envs.sandbox_call import Output, SandboxLimits, SandboxResult, collect, kill_group
from marlaas.envs.sandbox_call import result as call_result
from marlaas.envs.sandbox_child import child_env, rlimit_values, worker_argv
from marlaas.errors import SandboxError

#: How long a warm worker may take to start.
WORKER_START_S = 30.0


def default_workers() -> int:
    """Warm workers a sandbox runs at most by default: twice the cores, at least 4 (calls
    are mostly short and CPU-bound; more would only contend for the cores)."""
    return max(4, 2 * (os.cpu_count() or 1))


class CallSetupError(SandboxError):
    """A warm worker's child could not isolate a call (nothing of the program ran)."""


class Worker:
    """A warm worker under its own bwrap, and the call it serves (a `sandbox_call.Call`)."""

    sweep_on_exit = False  # the worker sweeps its pid namespace before it answers

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock
        self.reply: dict[str, Any] | None = None

    @staticmethod
    async def start() -> Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        try:
            proc = subprocess.Popen(
                worker_argv(theirs.fileno()), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/",
                env=child_env("/tmp"), pass_fds=(theirs.fileno(),), start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            ours.close()
            raise SandboxError(f"could not start the sandbox (bwrap): {exc}") from exc
        finally:
            theirs.close()
        worker = Worker(proc, ours)
        try:
            ready = await asyncio.wait_for(worker._line(), WORKER_START_S)
        except BaseException:
            worker.retire()
            raise
        assert proc.stderr is not None
        if ready is None or not ready.get("ready"):
            worker.retire()
            detail = proc.stderr.read().decode(errors="replace").strip()
            raise SandboxError(f"bubblewrap could not set up the sandbox: {detail[-2000:]}")
        proc.stderr.close()  # the worker's own stderr is /dev/null from here on
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

    def send(self, fds: list[int], limits: SandboxLimits, code_len: int) -> None:
        """The call's limits, its /tmp size and its descriptors: source, stdin, stdout,
        stderr (the worker's protocol: `sandbox_child.WORKER`)."""
        header = [*rlimit_values(limits), limits.tmp_bytes(code_len)]
        socket.send_fds(self.sock, [json.dumps(header).encode()], fds)

    async def wait(self) -> None:
        self.reply = await self._line()

    def stop(self) -> None:
        """Kill the worker with everything it runs (its bwrap's pid namespace ends; a
        pending `wait` then sees EOF). The namespace's init, bwrap's child, is killed
        directly as well as through its parent-death signal (bwrap's
        ``--die-with-parent``): the namespace ends with it, whatever that signal does."""
        for pid in _children(self.proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        kill_group(self.proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1.0)  # SIGKILL: at once

    def retire(self) -> None:
        self.stop()
        self.sock.close()


class WorkerPool:
    """A sandbox's warm workers: at most `size`, each serving one call at a time. A call
    takes an idle worker, or starts one while there are fewer than `size`, or else waits
    for one (outside its wall clock: a worker's call takes a few milliseconds, a worker's
    start ~30 ms of CPU). Workers belong to the process that started them (a forked
    process starts its own)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.idle: list[Worker] = []
        self.live = 0  # started and not retired: busy, idle or starting
        self.started = 0
        self.pid = os.getpid()
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._finalizer = weakref.finalize(self, WorkerPool._stop_all, self.idle, self.pid)

    async def run(
        self, code_fd: int, stdin_fd: int, code_len: int, limits: SandboxLimits
    ) -> SandboxResult:
        """Run the program in `code_fd` on a worker (`CallSetupError` where the worker
        could not isolate the call)."""
        taken: list[Worker] = []

        async def launch(out_w: int, err_w: int) -> Worker:
            for _ in range(2):  # an idle worker may have died meanwhile: then another
                worker = await self._acquire()
                try:
                    worker.send([code_fd, stdin_fd, out_w, err_w], limits, code_len)
                except OSError:
                    self._release(worker, healthy=False)
                    continue
                taken.append(worker)
                return worker
            raise SandboxError("no sandbox worker could take the call")

        try:
            worker, output = await collect(limits, launch)
        except BaseException:  # cancelled: the worker was stopped
            for worker in taken:
                self._release(worker, healthy=False)
            raise
        reply = worker.reply
        self._release(worker, healthy=reply is not None and "status" in reply)
        return _result(reply, output)

    async def _acquire(self) -> Worker:
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
                    worker = await Worker.start()
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

    def _release(self, worker: Worker, *, healthy: bool) -> None:
        if healthy and worker.alive() and os.getpid() == self.pid:
            self.idle.append(worker)
        else:
            self._retire(worker)
        self._wake()

    def _retire(self, worker: Worker) -> None:
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
        WorkerPool._stop_all(self.idle, self.pid)

    @staticmethod
    def _stop_all(idle: list[Worker], owner: int) -> None:
        """Stop the idle workers, in the process that started them (a forked copy of the
        list, at its exit, must not stop the parent's)."""
        if os.getpid() != owner:
            return
        while idle:
            idle.pop().retire()


def _result(reply: dict[str, Any] | None, output: Output) -> SandboxResult:
    """A call's result from its worker's reply (None: the worker is gone: killed at a
    limit, or by the program)."""
    if reply is not None and reply.get("setup"):
        raise CallSetupError(f"a warm worker could not set up the call: {reply['setup']}")
    if reply is None:
        return call_result(None, output, None if output.killed else "sandbox worker died")
    return call_result(
        None if output.killed else os.waitstatus_to_exitcode(reply["status"]), output
    )


def _children(pid: int) -> list[int]:
    """The live children of process `pid` ([] where it is gone or the kernel does not
    list them)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def _wake_up(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
