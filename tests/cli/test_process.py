"""The commands that run a device set the process's GIL switch interval once, at start,
and tune the allocator and the garbage collector (`marlaas.cli.process`); the interval
is only ever lowered, the collector's young threshold only ever raised."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from marlaas.cli.main import app
from marlaas.cli.process import (
    GC_YOUNG_OBJECTS,
    GIL_SWITCH_INTERVAL_S,
    favour_the_device_thread,
    tune_the_allocator,
    tune_the_collector,
)


@pytest.fixture
def default_interval() -> Iterator[None]:
    before, thresholds = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(0.005)  # the interpreter's defaults
    gc.set_threshold(700, 10, 10)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
        gc.set_threshold(*thresholds)


def test_tuning_the_collector_raises_the_young_threshold_and_never_lowers_it(
    default_interval: None,
) -> None:
    tune_the_collector()
    assert gc.get_threshold() == (GC_YOUNG_OBJECTS, 10, 10)  # the older generations kept
    gc.set_threshold(GC_YOUNG_OBJECTS * 2, 5, 5)
    tune_the_collector()
    assert gc.get_threshold() == (GC_YOUNG_OBJECTS * 2, 5, 5)


def test_favouring_the_device_thread_lowers_the_interval_and_never_raises_it(
    default_interval: None,
) -> None:
    favour_the_device_thread()
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S / 2)
    favour_the_device_thread()
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S / 2)


@pytest.mark.parametrize(
    "args",
    [
        ["run", "no-such-jobs.yaml"],  # fails after the setting, before any work
        ["bench", "sandbox", "--calls", "0"],  # the bench group's callback, then refused
    ],
)
def test_a_command_that_runs_a_device_lowers_the_interval_first(
    default_interval: None, args: list[str]
) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
    assert gc.get_threshold()[0] == GC_YOUNG_OBJECTS


def test_a_client_command_leaves_the_interval_alone(default_interval: None) -> None:
    CliRunner().invoke(app, ["version"])
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert gc.get_threshold()[0] == 700


def test_a_tuned_allocator_reuses_freed_activations_without_page_faults() -> None:
    """An MLP-shaped forward on 1,024 tokens (activations of ~1.4 MB, freed as it goes):
    under glibc's defaults ~3,400 minor faults a forward here (fresh mappings, trimmed
    heap tops); tuned, ~35 (the heap serves the blocks again)."""
    import resource

    import torch
    import torch.nn.functional as F

    assert tune_the_allocator()
    x, w_in, w_out = torch.randn(1024, 128), torch.randn(352, 128), torch.randn(128, 352)

    def forward() -> torch.Tensor:
        h = x
        for _ in range(4):
            h = h + F.linear(F.silu(F.linear(h, w_in)) * F.linear(h, w_in), w_out)
        return h

    forward()  # the first one faults its blocks in
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        forward()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
    assert faults < 500, faults
