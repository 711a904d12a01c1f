"""The device boundary in the import graph: the pipeline reaches model compute only
through the device port and never chooses (or imports) a backend; the device and the
trainer never import the pipeline."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "marlaas"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{p.relative_to(SRC)} imports {m}"
        for p in (SRC / package).rglob("*.py")
        for m in _imports(p)
        if m.startswith(forbidden)
    )


def test_the_pipeline_does_not_know_where_the_device_lives() -> None:
    forbidden = (
        "marlaas.distributed",
        "marlaas.backends",
        "marlaas.rollout.engine",
        "marlaas.train.trainer",
        "marlaas.model.bank",
    )
    assert _offenders("pipeline", forbidden) == []


def test_the_device_and_the_trainer_do_not_import_the_pipeline_or_a_backend() -> None:
    for package in ("device", "train"):
        assert _offenders(package, ("marlaas.pipeline", "marlaas.distributed")) == []
