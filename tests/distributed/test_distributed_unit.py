"""Fast checks of the Ray backend that need no cluster: the spec, the import boundary
(only `marlaas.distributed` imports Ray; environment workers import no torch), the
driver's weightless copy of the base."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from helpers.pipeline_support import save_tiny_llama
from marlaas.errors import ModelError

SRC = Path(__file__).resolve().parents[2] / "src" / "marlaas"


def _imports_ray(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ray" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            return node.level == 0
    return False


def test_only_the_distributed_package_imports_ray() -> None:
    offenders = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if "distributed" not in p.relative_to(SRC).parts and _imports_ray(p)
    ]
    assert offenders == []
    assert _imports_ray(SRC / "distributed" / "cluster.py")


def test_the_spec_rejects_bad_values_and_unknown_fields() -> None:
    from marlaas.config.ray import ActorResources, RaySpec

    spec = RaySpec(engine_replicas=3, env=ActorResources(num_cpus=0.5, resources={"env": 1}))
    assert spec.engine.num_gpus is None and spec.env.resources == {"env": 1}
    with pytest.raises(ValidationError):
        RaySpec(engine_replicas=0)
    with pytest.raises(ValidationError):
        RaySpec.model_validate({"replicas": 2})
    with pytest.raises(ValidationError):
        ActorResources(num_gpus=-1)


def test_an_environment_worker_imports_no_torch() -> None:
    code = (
        "import sys, marlaas.distributed.env_worker as w; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(w.EnvWorker.__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_driver_holds_a_weightless_base_with_the_real_shapes(tmp_path: Path) -> None:
    from marlaas.distributed.ray_backend import load_skeleton
    from marlaas.model.base import load_base
    from marlaas.model.lora import LoRAModel

    path = save_tiny_llama(tmp_path / "base")
    skeleton, tokenizer = load_skeleton(path, max_rank=4)
    real = LoRAModel(load_base(path)[0], max_rank=4)
    assert skeleton.device == torch.device("meta")
    assert skeleton.module_shapes == real.module_shapes
    assert tokenizer("12+3")["input_ids"]
    with pytest.raises(ModelError, match=r"no config\.json"):
        load_skeleton(tmp_path, max_rank=4)


def test_the_spec_imports_without_ray() -> None:
    """Configs may name a `RaySpec` on machines without the `ray` extra."""
    code = (
        "import sys; sys.modules['ray'] = None; "
        "from marlaas.config.ray import RaySpec; print(RaySpec().engine_replicas)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "2", done.stderr[-2000:]
    blocked = "import sys; sys.modules['ray'] = None; from marlaas.config.ray import RaySpec; from marlaas.distributed import open_ray_backend"
    done = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0 and "pip install 'marlaas[ray]'" in done.stderr
