"""Process-wide settings, made once by the commands that own their process and run a
device in it (`run`, `serve`, `demo`, `bench`: `device_process()`); library code never
changes them.

The GIL switch interval: torch releases the GIL inside each op and takes it back after,
so the device thread (`marlaas.device.executor`) re-acquires it thousands of times per
step. When another thread runs Python without pause (a saturated event loop), each
re-acquisition waits up to the interpreter's switch interval (5 ms by default). CPython
has no per-thread interval, so the only lever is the process's. Measured with
`run_trainer_bench` (the embedded base, 8 tenants, median multi-lane round of 3; two
runs on 2 shared CPU cores): at 5 ms, 0.13-0.16 s alone and 0.99-1.07 s beside one
busy pure-Python thread; at `GIL_SWITCH_INTERVAL_S`, 0.16-0.24 s alone and 0.23-0.43 s
beside it.

The allocator: torch's CPU tensors come from glibc's malloc, which serves a block above
its mmap threshold (128 KiB at first) with a fresh mapping and trims freed memory at the
top of the heap back to the system, so a forward's activations (a prefill of 16 rows x
64 tokens on the embedded base: ~1.4 MB per MLP activation) are page-faulted in again
on every forward: 3,879 minor faults a forward, 18 with `tune_the_allocator` (5-8% of
that prefill's CPU time on a 2-core machine). The cost is that freed memory below
`TRIM_THRESHOLD_BYTES` stays with the process instead of going back to the system.

The garbage collector: CPython collects its youngest generation every 700 net
allocations of container objects and, every 100 of those, all objects, holding the GIL
throughout. A process with torch and transformers loaded holds several hundred thousand
objects, so a full collection takes ~30-200 ms, during which the device thread cannot
take the GIL back between its ops; an RL run allocates many small containers per
episode (coroutines, futures, token lists). `marlaas bench paper --tenants 32 --regime
compute` (the async run): 907 collections taking 1.18 s of its 7.9 s, five of them full
(1.03 s); with `GC_YOUNG_OBJECTS`, 4 collections, 0.02 s, and the run 6.8 s. The cost is
that cyclic garbage lives a little longer (at most that many young objects).

Turns: the device thread and this thread's event loop take turns at the interpreter
(`marlaas.device.turns`, which gives the measurement): the loop's callbacks run while
the device thread is inside its long native calls or idle, not between its ops.

Tokenizers: Hugging Face's Rust tokenizers run batch calls on a thread pool of every
core unless `TOKENIZERS_PARALLELISM` says otherwise; here the other cores belong to the
environments and the event loop (the engine decodes its rows' stop-string tails in one
batch call each iteration), and a pool used before the sandboxes fork makes every
child warn and switch it off. `single_threaded_tokenizers` sets it to false unless the
user set it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys

#: The interpreter's thread switch interval in a process that runs a device.
GIL_SWITCH_INTERVAL_S = 1e-5
#: Net allocations of container objects between collections of the youngest generation
#: in a process that runs a device (CPython's default: 700).
GC_YOUNG_OBJECTS = 50_000
#: glibc's largest mmap threshold (64-bit): blocks up to this size come from the heap.
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory at the top of the heap kept rather than returned to the system.
TRIM_THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def device_process() -> None:
    """Every setting of a process that runs a device (the module doc)."""
    favour_the_device_thread()
    from marlaas.device import turns  # (the device package imports torch)

    turns.install()  # this thread's event loop and the device thread take turns
    tune_the_allocator()
    tune_the_collector()
    single_threaded_tokenizers()


def tune_the_collector() -> None:
    """Collect the youngest generation every `GC_YOUNG_OBJECTS` allocations (never more
    often than the process already does; the module doc)."""
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_OBJECTS), *older)


def single_threaded_tokenizers() -> None:
    """`TOKENIZERS_PARALLELISM=false` unless already set (the module doc)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def favour_the_device_thread() -> None:
    """Lower this process's switch interval to `GIL_SWITCH_INTERVAL_S` (never raise it):
    the device thread then gets the GIL back at once beside a busy event loop."""
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))


def tune_the_allocator() -> bool:
    """Make glibc's malloc keep activation-sized blocks in its heap and not trim them
    back to the system (`MMAP_THRESHOLD_BYTES`, `TRIM_THRESHOLD_BYTES`); False where
    the C library has no `mallopt` (not glibc) or refuses a value."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
