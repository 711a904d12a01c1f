"""Plots: PNG files that exist, decode as PNG and carry a drawing (not a blank page), and
curves drawn from the tenants' typed progress records. (`tests/pipeline/
test_progress_views.py` draws them from a real run.)"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from marlaas.obs.memory import RunRecorder
from marlaas.obs.plots import (
    CURVES_FILE,
    UTILIZATION_FILE,
    curves_figure,
    plot_utilization,
    write_plots,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    assert data.rstrip(b"\x00").endswith(b"IEND\xaeB`\x82")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_write_plots(progress_sample: RunRecorder, tmp_path: Path) -> None:
    paths = write_plots(progress_sample, tmp_path / "plots")
    assert [p.name for p in paths] == [CURVES_FILE, UTILIZATION_FILE]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(
        [CURVES_FILE, UTILIZATION_FILE]
    )
    for path in paths:
        width, height = _png_size(path)
        assert width >= 600 and height >= 300
        assert path.stat().st_size > 20_000  # lines, bars and text, not an empty canvas


def test_curves_draw_every_tenants_reward_and_eval(progress_sample: RunRecorder) -> None:
    reward, accuracy = curves_figure(progress_sample).axes[:2]
    drawn = {line.get_label(): line.get_xydata().tolist() for line in reward.lines}
    assert drawn == {
        "alpha": [[i + 1, pytest.approx(0.1 * i)] for i in range(6)],
        "beta": [[i + 1, pytest.approx(0.2 + 0.05 * i)] for i in range(6)],
    }
    (alpha,) = accuracy.lines  # beta has no eval
    assert alpha.get_label() == "alpha"
    assert alpha.get_xydata().tolist() == [[i + 1, pytest.approx(0.3 + 0.05 * i)] for i in range(6)]


def test_curves_ignore_free_form_metrics(sample: RunRecorder) -> None:
    """A free-form metric named like a reward is not a step's reward: nothing is drawn."""
    assert all(not ax.lines for ax in curves_figure(sample).axes)


def test_empty_recorder_still_plots(recorder: RunRecorder, tmp_path: Path) -> None:
    for path in write_plots(recorder, tmp_path):
        _png_size(path)


def test_utilization_plot_options(sample: RunRecorder, tmp_path: Path) -> None:
    t0 = sample.origin
    path = plot_utilization(sample, tmp_path / "u.png", bin_s=0.5, start=t0 + 2, end=t0 + 6)
    _png_size(path)
    with pytest.raises(ValueError, match="bin_s"):
        plot_utilization(sample, tmp_path / "bad.png", bin_s=-1)
    assert not (tmp_path / "bad.png").exists()
