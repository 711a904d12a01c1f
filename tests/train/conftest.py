"""Fixtures for the trainer tests (helpers live in `train_data.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_data import tiny_llama

from marlaas.model.lora import LoRAModel
from marlaas.model.tokenizer import save_tokenizer


@pytest.fixture
def lora_model() -> LoRAModel:
    """A fresh tiny base with every projection injected (rank up to 16)."""
    return LoRAModel(tiny_llama(), max_rank=16)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny base saved as a Hugging Face directory (for the benchmark)."""
    path = tmp_path_factory.mktemp("tiny-llama-train")
    tiny_llama().save_pretrained(path)
    save_tokenizer(path)  # `load_base` wants one; the benchmark never tokenizes
    return path
