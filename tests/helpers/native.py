"""The native kernels switched off for a while (`MARLAAS_NATIVE_KERNELS=0`, the kernel
cache cleared on the way in and out): torch's path, as on a machine without a compiler.
A plain module (imported by tests in several folders); `tests/conftest.py` makes it the
fixture `no_native_kernels`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from marlaas.model import kernels


@contextmanager
def kernels_off() -> Iterator[None]:
    before = os.environ.get("MARLAAS_NATIVE_KERNELS")
    os.environ["MARLAAS_NATIVE_KERNELS"] = "0"
    kernels._library.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ["MARLAAS_NATIVE_KERNELS"]
        else:
            os.environ["MARLAAS_NATIVE_KERNELS"] = before
        kernels._library.cache_clear()
