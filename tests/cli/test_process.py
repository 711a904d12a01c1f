"""The commands that run a device set the process's GIL switch interval once, at start
(`marlaas.cli.process`); it is only ever lowered."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from marlaas.cli.main import app
from marlaas.cli.process import GIL_SWITCH_INTERVAL_S, favour_the_device_thread


@pytest.fixture
def default_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # the interpreter's default
    try:
        yield
    finally:
        sys.setswitchinterval(before)


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


def test_a_client_command_leaves_the_interval_alone(default_interval: None) -> None:
    CliRunner().invoke(app, ["version"])
    assert sys.getswitchinterval() == pytest.approx(0.005)
