"""Process-wide settings, made once by the commands that own their process and run a
device in it (`run`, `serve`, `demo`, `bench`); library code never changes them.

The GIL switch interval: torch releases the GIL inside each op and takes it back after,
so the device thread (`marlaas.device.executor`) re-acquires it thousands of times per
step. When another thread runs Python without pause (a saturated event loop), each
re-acquisition waits up to the interpreter's switch interval (5 ms by default). CPython
has no per-thread interval, so the only lever is the process's. Measured with
`run_trainer_bench` (the embedded base, 8 tenants, median multi-lane round of 3; two
runs on 2 shared CPU cores): at 5 ms, 0.13-0.16 s alone and 0.99-1.07 s beside one
busy pure-Python thread; at `GIL_SWITCH_INTERVAL_S`, 0.16-0.24 s alone and 0.23-0.43 s
beside it.
"""

from __future__ import annotations

import sys

#: The interpreter's thread switch interval in a process that runs a device.
GIL_SWITCH_INTERVAL_S = 1e-5


def favour_the_device_thread() -> None:
    """Lower this process's switch interval to `GIL_SWITCH_INTERVAL_S` (never raise it):
    the device thread then gets the GIL back at once beside a busy event loop."""
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
