"""Fixtures of the benchmark tests: the embedded base (skipped when it is not built),
one torch thread, and a small workload file written per test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from marlaas.model.base import default_base_path

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def base_dir() -> Path:
    path = default_base_path()
    if not (path / "config.json").is_file():
        pytest.skip("the embedded base is not built (marlaas base build)")
    return path
