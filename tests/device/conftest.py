"""The device tests reuse the pipeline tests' helpers (tiny base, job factory, recorder)
and the trainer tests' synthetic GRPO data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline_support import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("device-tiny-llama"))
