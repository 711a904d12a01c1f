"""Reading job specs from a file for submission: one job (a mapping with `name` and
`task`), a bare list of jobs, or a run file with a `jobs:` list (its run-level
settings, which the server decides, are ignored)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from marlaas.config.job import JobSpec
from marlaas.errors import ConfigError


def _problems(error: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}" for e in error.errors()
    )


def load_job_specs(path: str | Path) -> list[JobSpec]:
    """The validated job specs in a YAML (or JSON) file; `ConfigError` names the file,
    the job and the field of any problem."""
    import yaml

    source = Path(path)
    try:
        raw: Any = yaml.safe_load(source.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read {source}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {e}") from e
    if isinstance(raw, dict) and "jobs" in raw:
        raw = raw["jobs"]
    items = raw if isinstance(raw, list) else [raw]
    if not items or not all(isinstance(item, dict) for item in items):
        raise ConfigError(
            f"{source}: expected a job (a mapping with name, task, ...), a list of jobs, "
            "or a `jobs:` list"
        )
    specs = []
    for i, item in enumerate(items):
        try:
            specs.append(JobSpec.model_validate(item))
        except ValidationError as e:
            which = f"job {item.get('name', i)!r}" if len(items) > 1 else "job"
            raise ConfigError(f"{source}: invalid {which}: {_problems(e)}") from None
    return specs
