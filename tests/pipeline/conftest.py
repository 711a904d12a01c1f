"""Fixtures of the pipeline tests: the base they run on (the embedded base when it has
been built, else a tiny random Llama with the byte tokenizer), one torch thread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.pipeline_support import embedded_base, save_tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    found = embedded_base()
    if found is not None:
        return found
    return save_tiny_llama(tmp_path_factory.mktemp("pipeline-tiny-llama"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Always the tiny random base (mechanics tests that must not depend on the build)."""
    return save_tiny_llama(tmp_path_factory.mktemp("pipeline-random-llama"))
