"""Turns of the interpreter between the device thread and the event loop.

In a process that runs a device (`marlaas run`, `serve`, `demo`, `bench`) two threads
run Python: the device thread (`device.executor`: engine iterations, training passes)
and the event loop (tenants' episodes, environments, graders, the service). CPython
runs one of them at a time, and every op of the device thread lets the interpreter go:
torch releases it inside each op, a native kernel releases it for its whole call. When
the loop is runnable it takes the interpreter at each such release, and the device
thread gets it back only when the loop is made to drop it, a hand-over of ~13 us on a
2-core VM whatever the switch interval (1e-6 to 1e-5 s: `add_` 1.8 us alone, 13-15 us
beside a busy thread), while between two ops each thread's Python is cut every switch
interval. Measured: an engine serving 14,400 requests alone 1.05 s, beside a thread
running Python half of the time 1.46 s, beside one running it all the time 2.67 s.

Turns: the device thread holds the turn while it runs Python and gives it away only
where it would leave the interpreter idle anyway: inside its long native calls (the
decoder layers of an engine forward, a training pass's layers: milliseconds each,
`kernels.build.long_call`) and while it waits for work. The loop takes the turn for
each callback it runs (`asyncio.Handle._run`). Where work waits for the device (the
executor sets `device_first`: training ops queued, requests the engine has no room for),
a device thread that waits for the turn goes before the loop's next callback; otherwise
the loop keeps the turn while it has callbacks ready (it makes the device's work: the
synchronous baseline, measured 8.2-8.6 s with the device always first against 7.7-8.3
without turns). So the loop's Python runs beside the device's native compute rather than
between its ops, and each side's Python runs uninterrupted. A compute-regime `bench
paper` at N = 32 (the embedded base, one torch thread, three runs alternating with the
code before): marlaas 4.23-4.39 s against 5.42-5.52 without turns, the synchronous
baseline 7.52-7.69 against 7.74-8.17.

The turn is advisory, never a lock that correctness rests on: a side that has waited
`WAIT_S` for it goes ahead without it (both then run Python, as without turns). So a
lock one side holds across a native call (the engine's, while it steps) can cost the
other side that wait, never a deadlock, and neither side can starve the other for
longer. Only the loop thread given to `install` takes turns; other loops and threads are
untouched.

Where the device's compute has no long native calls (a GPU, the torch path) the device
thread would hold the turn for all its work and the loop would only run on timeouts, so
the executor takes turns only where the native CPU kernels run its forwards
(`DeviceExecutor`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from marlaas.model.kernels.build import set_away

#: Longest either side waits for the turn before it goes ahead without it.
WAIT_S = 0.005

_DEVICE, _LOOP = 1, 2


class Turns:
    """The turn of one device thread and one event loop thread (see the module doc)."""

    def __init__(self, loop_thread: int) -> None:
        self.loop_thread = loop_thread
        self._cv = threading.Condition(threading.Lock())
        self._holder = 0  # _DEVICE, _LOOP or 0
        self._device_waits = False
        self._device_thread: int | None = None
        #: Whether a device thread that waits for the turn goes before the loop's next
        #: callback (the device is the bottleneck: work waits for it), or the loop keeps
        #: the turn while it has callbacks ready (the loop is: it makes the device's work).
        self.device_first = True
        #: Times a side went ahead without the turn after `WAIT_S` (for tests and
        #: diagnostics: both should stay near zero in a healthy run).
        self.timeouts = 0
        self._away = _Away(self)

    # -- the device thread ------------------------------------------------------------------

    def claim(self) -> bool:
        """Make the calling thread these turns' device thread: it takes the turn, and its
        long native calls (`kernels.build.long_call`) give it away. False where another
        thread is (one device thread per process takes turns, the others do without)."""
        with self._cv:
            if self._device_thread is not None:
                return False
            self._device_thread = threading.get_ident()
        self.device_take()
        set_away(self._away)
        return True

    def unclaim(self) -> None:
        """The device thread leaves: give the turn back, let another device thread claim."""
        self.device_give()
        with self._cv:
            if self._device_thread != threading.get_ident():
                return
            self._device_thread = None
        set_away(None)

    def device_take(self) -> None:
        """Take the turn, before the loop's next callback (at most `WAIT_S` of waiting)."""
        with self._cv:
            self._device_waits = True
            if not self._wait_for(lambda: self._holder == 0):
                self.timeouts += 1
            self._device_waits = False
            self._holder = _DEVICE

    def device_give(self) -> None:
        with self._cv:
            if self._holder == _DEVICE:
                self._holder = 0
                self._cv.notify_all()

    @property
    def away(self) -> _Away:
        """`with turns.away:` the device thread leaves Python for a while (a long native
        call, a wait): the turn is the loop's meanwhile."""
        return self._away

    # -- the loop thread --------------------------------------------------------------------

    def loop_take(self) -> bool:
        """Take the turn for one callback; False (none taken) where the caller is not the
        loop thread."""
        if threading.get_ident() != self.loop_thread:
            return False
        with self._cv:
            if (self._holder != 0 or (self._device_waits and self.device_first)) and not (
                self._wait_for(lambda: self._holder == 0 and not self._device_waits)
            ):
                self.timeouts += 1
                return False  # goes ahead without it
            self._holder = _LOOP
            return True

    def loop_give(self) -> None:
        with self._cv:
            if self._holder == _LOOP:
                self._holder = 0
                if self._device_waits:
                    self._cv.notify_all()

    def _wait_for(self, ready: Callable[[], bool]) -> bool:
        """Wait (holding `_cv`) until `ready()`, at most `WAIT_S`; whether it is."""
        if ready():
            return True
        deadline = time.monotonic() + WAIT_S
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cv.wait(left)
        return True


class _Away:
    """`Turns.away`: a context manager made once (it is entered around every long native
    call of the device thread, where a generator's would cost a frame each time)."""

    __slots__ = ("_turns",)

    def __init__(self, turns: Turns) -> None:
        self._turns = turns

    def __enter__(self) -> None:
        self._turns.device_give()

    def __exit__(self, *exc: object) -> None:
        self._turns.device_take()


_turns: Turns | None = None
_handle_run: Callable[[asyncio.Handle], None] | None = None


def installed() -> Turns | None:
    """The process's turns, where `install` was called and not `uninstall`."""
    return _turns


def install(loop_thread: int | None = None) -> Turns:
    """Make `loop_thread`'s (default: this thread's) event loop take a turn for each
    callback it runs; the device executor started after this takes turns too (see the
    module doc). Idempotent for one thread; replaces the turns of another."""
    global _turns, _handle_run
    ident = threading.get_ident() if loop_thread is None else loop_thread
    if _turns is not None and _turns.loop_thread == ident:
        return _turns
    _turns = Turns(ident)
    if _handle_run is None:
        _handle_run = asyncio.Handle._run
        asyncio.Handle._run = _run_with_turn  # type: ignore[method-assign,assignment]
    return _turns


def uninstall() -> None:
    """Undo `install` (tests)."""
    global _turns, _handle_run
    _turns = None
    if _handle_run is not None:
        asyncio.Handle._run = _handle_run  # type: ignore[method-assign,assignment]
        _handle_run = None


def _run_with_turn(handle: asyncio.Handle) -> None:
    run = _handle_run
    assert run is not None
    turns = _turns
    if turns is None or not turns.loop_take():
        run(handle)
        return
    try:
        run(handle)
    finally:
        turns.loop_give()
