"""The SDK RL loop is the SDK alone (it imports nothing of marlaas), and its task is the
built-in `reverse` family's: the same prompts' format and the same reward."""

from __future__ import annotations

import ast
import random
from pathlib import Path

from marlaas.bench import tinker_loop
from marlaas.envs.tasks import get_family


def test_the_loop_imports_nothing_of_marlaas() -> None:
    tree = ast.parse(Path(tinker_loop.__file__).read_text())
    modules = {
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not [m for m in modules if m.split(".")[0] == "marlaas"], modules
    assert "tinker" in modules


def test_the_task_is_the_reverse_family() -> None:
    prompt, answer = tinker_loop.reverse_prompt(random.Random(1))
    example = get_family("reverse").examples("train", 1, seed=0)[0]
    assert prompt.startswith("Q: reverse ") and example.prompt.startswith("Q: reverse ")
    assert prompt.endswith("\nA: ") and example.prompt.endswith("\nA: ")
    assert answer == prompt[len("Q: reverse ") : -len("\nA: ")][::-1]
    assert tinker_loop.reward(f" {answer} \nmore", answer) == 1.0
    assert tinker_loop.reward(answer[::-1] + "x", answer) == 0.0
