"""One sandboxed call, whatever starts it (`marlaas.envs.sandbox`: a process of its own,
or a warm worker's fork, `marlaas.envs.sandbox_warm`): its limits and result, and
`collect`, which waits for the program under the wall limit and the output cap."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from marlaas.envs.sandbox_child import MiB
from marlaas.errors import ConfigError

#: How long the output pipes may drain once the program is gone.
DRAIN_S = 1.0


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

    def tmp_bytes(self, code_len: int) -> int:
        """The size of a call's /tmp: the program, room for 8 files at the size limit."""
        return code_len + 8 * self.file_size_bytes + MiB


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


class Call(Protocol):
    """A started call, as `collect` drives it."""

    #: Whether `stop()` is also needed after a normal exit (to sweep what the program left).
    sweep_on_exit: bool

    async def wait(self) -> None:
        """Return when the program has exited."""
        ...

    def stop(self) -> None:
        """Kill whatever the call started (idempotent)."""
        ...


CallT = TypeVar("CallT", bound=Call)


@dataclasses.dataclass(frozen=True)
class Output:
    """What `collect` saw of a call: its output (capped), whether it was killed (wall
    limit or output cap), whether the output overflowed, the wall time from its start."""

    stdout: bytearray
    stderr: bytearray
    killed: bool
    truncated: bool
    wall_s: float


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


async def collect(
    limits: SandboxLimits, launch: Callable[[int, int], Awaitable[CallT]]
) -> tuple[CallT, Output]:
    """Start a call with `launch(stdout_w, stderr_w)` and wait for it under the wall limit
    and the output cap; the call is stopped at either, after a normal exit where it
    sweeps, and on any exception. The pipes are ours, not asyncio's: in Python 3.11
    `Process.wait()` also waits for its pipes, which a writer left behind (or a full pipe)
    would hold open."""
    loop = asyncio.get_running_loop()
    overflow = asyncio.Event()
    out, err = _Capture(limits.output_bytes, overflow), _Capture(limits.output_bytes, overflow)
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
        start = time.monotonic()
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
            if killed or call.sweep_on_exit:
                call.stop()
            settled = True
            await exited
            await asyncio.wait([out.closed, err.closed], timeout=DRAIN_S)
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
    wall_s = time.monotonic() - start
    return call, Output(out.data, err.data, killed, overflow.is_set(), wall_s)


def result(rc: int | None, output: Output, failure: str | None = None) -> SandboxResult:
    """The result of a call that exited with `rc` (None: killed at a limit, or `failure`
    says why there is no status)."""
    timed_out = output.killed and not output.truncated
    reason = failure
    if reason is None:
        if output.truncated:
            reason = "output limit"
        elif timed_out:
            reason = "timeout"
        elif rc is not None and rc < 0:
            reason = f"killed by signal {_signal_name(-rc)}"
        elif rc != 0:
            reason = f"exit code {rc}"
    return SandboxResult(
        ok=reason is None, returncode=rc, stdout=output.stdout.decode(errors="replace"),
        stderr=output.stderr.decode(errors="replace"), timed_out=timed_out,
        truncated=output.truncated, reason=reason, wall_s=output.wall_s,
    )  # fmt: skip


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _signal_name(signum: int) -> str:
    """ "SIGXCPU (cpu limit)", "SIGKILL (memory or cpu limit?)", "SIGTERM", "signal 40"."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    hint = {"SIGXCPU": " (cpu limit)", "SIGKILL": " (memory or cpu limit?)"}.get(name, "")
    return name + hint
