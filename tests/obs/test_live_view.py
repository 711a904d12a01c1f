"""LiveView: rendered text from typed progress records, plain log lines off a terminal,
no blocking of the event loop. (`tests/pipeline/test_progress_views.py` renders it from
a real run.)"""

from __future__ import annotations

import asyncio
import io
import time

import pytest
from obs_support import step_metrics
from rich.console import Console

from marlaas.obs.live import LiveView, format_elapsed
from marlaas.obs.memory import RunRecorder
from marlaas.obs.progress import StepDone


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=120, color_system=None), out


def test_render_shows_every_tenant_and_its_progress(progress_sample: RunRecorder) -> None:
    progress_sample.progress(StepDone("gamma", 2, step_metrics(0.25)))
    console, out = _console(terminal=True)
    console.print(LiveView(progress_sample, console=console).render())
    text = out.getvalue()
    for expected in ("alpha", "beta", "gamma", "6/6", "0.500", "55.0%", "done", "60%"):
        assert expected in text
    assert "0.450" in text and "0.250" in text  # beta's and gamma's latest rewards
    assert "elapsed 0:00:10" in text


def test_total_steps_given_explicitly(progress_sample: RunRecorder) -> None:
    view = LiveView(progress_sample, total_steps={"alpha": 12, "beta": 24})
    rows = {row.tenant: row for row in view.rows()}
    assert rows["alpha"].progress == "6/12"
    assert rows["beta"].progress == "6/24"
    assert rows["alpha"].eval_accuracy == pytest.approx(0.55)
    assert rows["beta"].reward == pytest.approx(0.45)
    assert LiveView(progress_sample, total_steps=30).rows()[0].progress == "6/30"


def test_status_line(progress_sample: RunRecorder) -> None:
    line = LiveView(progress_sample).status_line()
    assert line.startswith("[0:00:10] device 60% (recent 60%)")
    assert "alpha 6/6 reward=0.500 acc=55.0% done" in line
    assert "beta 6/6 reward=0.450 acc=- running" in line


def test_free_form_metrics_are_not_progress(sample: RunRecorder) -> None:
    """Only typed records move a row: a free-form metric named like a reward does not."""
    (alpha, beta) = LiveView(sample).rows()
    assert (alpha.reward, alpha.step, alpha.eval_accuracy) == (None, None, None)
    assert beta.status == "pending"


def test_plain_log_lines_when_not_a_terminal(progress_sample: RunRecorder) -> None:
    console, out = _console(terminal=False)
    with LiveView(progress_sample, console=console, log_every_s=0.02):
        time.sleep(0.15)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3  # periodic lines plus the final one
    assert all(line.startswith("[0:00:10] device 60%") for line in lines)
    assert "\x1b[" not in out.getvalue()  # no cursor movement, no colour


async def test_live_redraws_without_blocking_the_event_loop() -> None:
    recorder = RunRecorder()
    console, out = _console(terminal=True)
    async with LiveView(recorder, console=console, refresh_s=0.02, total_steps=5):
        for step in range(1, 6):
            t = time.perf_counter()
            recorder.span("device", "decode", t, t + 0.01)
            recorder.progress(StepDone("tenant-a", step, step_metrics(step / 10)))
            before = time.perf_counter()
            await asyncio.sleep(0.02)
            assert time.perf_counter() - before < 0.5
    text = out.getvalue()
    assert "tenant-a" in text
    assert "5/5" in text and "0.500" in text  # the final redraw shows the final state


def test_start_and_stop_are_idempotent(recorder: RunRecorder) -> None:
    console, _ = _console(terminal=False)
    view = LiveView(recorder, console=console, log_every_s=5)
    view.start()
    view.start()
    view.stop()
    view.stop()


def test_format_elapsed_and_bad_arguments(recorder: RunRecorder) -> None:
    assert format_elapsed(3725.9) == "1:02:05"
    assert format_elapsed(-1) == "0:00:00"
    with pytest.raises(ValueError, match="> 0"):
        LiveView(recorder, refresh_s=0)
