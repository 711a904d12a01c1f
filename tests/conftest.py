"""Shared fixtures. Tests run on the CPU with few threads: the CI machine has 2 cores."""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The test process runs devices beside a busy event loop, as `marlaas run` does: it
# makes the same process-wide setting (`marlaas.cli.process`).
from marlaas.cli.process import favour_the_device_thread

favour_the_device_thread()


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _turns_end_with_their_test() -> Iterator[None]:
    """A command run in-process (`demo`, `bench`, `serve` through typer's runner) installs
    turns for the test process's loop thread (`marlaas.cli.process.device_process`): they
    end with that test, so no later test inherits them (or a device thread of it)."""
    yield
    from marlaas.device import turns

    turns.uninstall()


@pytest.fixture
def no_native_kernels() -> Iterator[None]:
    """The native kernels off for one test (`helpers.native.kernels_off`)."""
    from helpers.native import kernels_off

    with kernels_off():
        yield
