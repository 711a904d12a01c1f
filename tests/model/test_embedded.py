"""The embedded default base: committed, offline, a real HF architecture, reproducible."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from marlaas.model.base import default_base_path, load_base
from marlaas.model.build import BuildRecipe, build_base
from marlaas.model.evaluate import evaluate_base

EMBEDDED = default_base_path()


def test_embedded_base_loads_offline_with_auto_classes() -> None:
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(EMBEDDED, local_files_only=True)
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tok)
    text = "Q: capital of Zorbia?\nA: search Zorbia\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_embedded_base_is_small_enough_to_commit() -> None:
    size = sum(f.stat().st_size for f in EMBEDDED.iterdir())
    assert size <= 16 * 2**20


def test_embedded_base_was_built_by_the_current_recipe() -> None:
    """`marlaas base build` with the default recipe is what produced the committed model."""
    facts = json.loads((EMBEDDED / "build.json").read_text())
    assert facts["recipe"] == json.loads(json.dumps(asdict(BuildRecipe())))


def test_build_is_reproducible(tmp_path: Path) -> None:
    recipe = BuildRecipe(max_steps=3, examples_per_family=50, dev_episodes=4, check_every=3)
    build_base(tmp_path / "a", recipe, log=lambda _: None)
    build_base(tmp_path / "b", recipe, log=lambda _: None)
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_embedded_base_is_partially_competent_on_every_family() -> None:
    """Room for RL: held-out greedy accuracy strictly between 10% and 70% per family."""
    model, tok = load_base(EMBEDDED)
    scores = asyncio.run(evaluate_base(model, tok, episodes=100, seed=0))
    for s in scores:
        assert 0.10 <= s.greedy <= 0.70, s
