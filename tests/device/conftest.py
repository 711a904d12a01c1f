"""Fixtures of the device tests: the tiny random base of the shared helpers, one torch
thread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.pipeline_support import save_tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("device-tiny-llama"))
