"""Versioned benchmark workloads: loading, validation and instantiation for N tenants.

A workload file (YAML, shipped under `marlaas/bench/workloads/`, one file per version,
named `{workload}-v{version}.yaml`) defines a regime of `marlaas bench paper`: a list of
tenant templates, the job fields they share, the run's engine sizes and the number of
samples per tenant step. `instantiate(workload, n)` cycles the templates: tenant `i`
is template `i mod len(templates)`, named `{template}-{i:03d}`, with job seed
`seed + i`. So the first K tenants of any N >= K are the same jobs, which is what makes
measuring a baseline on a prefix of the tenants (and extrapolating) meaningful.

Invariants checked at load time (errors name the file and the field):
- every template, merged over `defaults`, is a valid `JobSpec`;
- every template samples exactly `samples_per_step` episodes per step (G x P);
- the `compute` regime has only single-turn tasks and no tool latency.

The file's bytes are hashed (sha256) so a result names exactly what it ran.
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator

from marlaas.config.job import JobSpec, RunSpec
from marlaas.config.specs import Spec, TaskSpec
from marlaas.envs.tasks import FAMILIES
from marlaas.errors import ConfigError

WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"
_FILE_NAME = re.compile(r"^(?P<name>[a-z][a-z0-9_]*)-v(?P<version>[0-9]+)\.ya?ml$")
_TEMPLATE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")
Regime = Literal["paper", "compute"]


class WorkloadError(ConfigError):
    """A workload file is missing, unreadable or invalid; the message names the field."""


class TenantTemplate(Spec):
    """One tenant template: a name prefix and the job fields that differ from `defaults`."""

    name: str = Field(..., description="Prefix of the tenant names built from this template.")
    task: dict[str, Any] = Field(..., description="The job's `task` (built-in family).")
    lora: dict[str, Any] = Field(default_factory=dict, description="Overrides of `lora`.")
    algorithm: dict[str, Any] = Field(default_factory=dict, description="Overrides.")
    sampling: dict[str, Any] = Field(default_factory=dict, description="Overrides.")
    eval_episodes: int | None = Field(None, description="Override of `eval_episodes`.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _TEMPLATE_NAME.match(v):
            raise ValueError("use 1-32 letters, digits or '_', starting with a letter")
        return v


class WorkloadSpec(Spec):
    """The contents of a workload file (see the module docstring)."""

    workload: str = Field(..., description="Name of the workload, e.g. 'paper'.")
    version: int = Field(..., ge=1, description="Bumped whenever anything in the file changes.")
    regime: Regime = Field(..., description="paper: tools + latency; compute: single-turn.")
    samples_per_step: int = Field(..., ge=2, description="G x P of every tenant's step.")
    steps: int = Field(..., ge=1, le=10_000, description="RL steps per tenant (full run).")
    quick_steps: int = Field(..., ge=1, le=10_000, description="RL steps per tenant (--quick).")
    seed: int = Field(0, description="Tenant i gets job seed `seed + i`.")
    run: dict[str, Any] = Field(
        default_factory=dict, description="RunSpec fields other than `jobs` (engine sizes...)."
    )
    defaults: dict[str, Any] = Field(
        default_factory=dict, description="JobSpec fields shared by every template."
    )
    tenants: tuple[TenantTemplate, ...] = Field(..., min_length=1, description="Templates.")

    @field_validator("tenants")
    @classmethod
    def _unique(cls, v: tuple[TenantTemplate, ...]) -> tuple[TenantTemplate, ...]:
        names = [t.name for t in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"template names must be unique; repeated: {', '.join(dup)}")
        return v


@dataclass(frozen=True)
class Workload:
    """A loaded, validated workload file and where it came from."""

    spec: WorkloadSpec
    path: Path
    sha256: str

    @property
    def name(self) -> str:
        return self.spec.workload

    @property
    def regime(self) -> Regime:
        return self.spec.regime

    def describe(self) -> dict[str, Any]:
        """What a result records about the workload it ran."""
        return {
            "workload": self.spec.workload,
            "version": self.spec.version,
            "regime": self.spec.regime,
            "file": self.path.name,
            "sha256": self.sha256,
            "samples_per_step": self.spec.samples_per_step,
            "templates": [t.name for t in self.spec.tenants],
            "max_new_tokens": {
                t.name: self.template_job(i).sampling.max_new_tokens
                for i, t in enumerate(self.spec.tenants)
            },
        }

    def template_job(self, index: int, *, steps: int | None = None) -> JobSpec:
        """The job of tenant `index` (template `index mod len(templates)`)."""
        return _build_job(self.spec, index, steps, self.path.name)

    def instantiate(self, n: int, *, steps: int | None = None) -> RunSpec:
        """The run of tenants 0..n-1 (`steps` replaces the file's `steps` when given)."""
        if n < 1:
            raise WorkloadError(f"the number of tenants must be >= 1, got {n}")
        jobs = [self.template_job(i, steps=steps) for i in range(n)]
        try:
            return RunSpec.model_validate({**self.spec.run, "jobs": jobs})
        except ValidationError as e:
            raise WorkloadError(f"{self.path.name}: run: {_problems(e)}") from e


def template_of(tenant: str) -> str:
    """The template a tenant name was built from (`calc-007` -> `calc`)."""
    return tenant.rsplit("-", 1)[0]


def is_single_turn(job: JobSpec) -> bool:
    """Whether the job's task is a single-turn built-in family."""
    if not isinstance(job.task, TaskSpec):
        return False
    family = FAMILIES.get(job.task.family)
    return family is not None and family.max_turns == 1


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _problems(e: ValidationError, prefix: str = "") -> str:
    return "; ".join(
        f"{prefix}{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
        for err in e.errors()
    )


def _build_job(spec: WorkloadSpec, index: int, steps: int | None, source: str) -> JobSpec:
    t = index % len(spec.tenants)
    tpl = spec.tenants[t]
    overrides = tpl.model_dump(exclude={"name"}, exclude_none=True)
    raw = _merge(spec.defaults, overrides)
    raw.update(
        name=f"{tpl.name}-{index:03d}",
        seed=spec.seed + index,
        steps=spec.steps if steps is None else steps,
    )
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        raise WorkloadError(
            f"{source}: invalid tenant template: {_problems(e, f'tenants[{t}] ({tpl.name}).')}"
        ) from e


def _check(spec: WorkloadSpec, source: str) -> None:
    for i, tpl in enumerate(spec.tenants):
        job = _build_job(spec, i, None, source)
        where = f"{source}: tenants[{i}] ({tpl.name})"
        if job.grpo.samples_per_step != spec.samples_per_step:
            raise WorkloadError(
                f"{where}.algorithm: group_size x prompts_per_step = "
                f"{job.grpo.samples_per_step}, but samples_per_step is "
                f"{spec.samples_per_step}; every tenant must sample the same amount per step"
            )
        if not isinstance(job.task, TaskSpec) or job.task.family not in FAMILIES:
            known = ", ".join(sorted(FAMILIES))
            raise WorkloadError(f"{where}.task.family: must be a built-in family ({known})")
        if spec.regime == "compute":
            if not is_single_turn(job):
                raise WorkloadError(
                    f"{where}.task.family: the compute regime takes single-turn families only, "
                    f"got {job.task.family!r}"
                )
            if job.task.tool_latency_s != (0.0, 0.0):
                raise WorkloadError(
                    f"{where}.task.tool_latency_s: the compute regime has no tool latency"
                )


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload file; raises `WorkloadError` naming the field."""
    source = Path(path)
    try:
        data = source.read_bytes()
    except OSError as e:
        raise WorkloadError(f"cannot read workload file {source}: {e.strerror or e}") from e
    try:
        raw = yaml.safe_load(data.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise WorkloadError(f"{source.name} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise WorkloadError(f"{source.name}: expected a mapping at the top level")
    try:
        spec = WorkloadSpec.model_validate(raw)
    except ValidationError as e:
        raise WorkloadError(f"{source.name}: invalid workload: {_problems(e)}") from e
    m = _FILE_NAME.match(source.name)
    if m and (m["name"] != spec.workload or int(m["version"]) != spec.version):
        raise WorkloadError(
            f"{source.name}: the file name says {m['name']} v{m['version']} but the file "
            f"declares workload {spec.workload!r} version {spec.version}; keep them in step"
        )
    _check(spec, source.name)
    return Workload(spec=spec, path=source, sha256=hashlib.sha256(data).hexdigest())


def builtin_workloads() -> dict[str, Path]:
    """The shipped workload files by stem (`paper-v1`), plus each name's newest (`paper`)."""
    found: dict[str, tuple[int, Path]] = {}
    out: dict[str, Path] = {}
    for path in sorted(WORKLOAD_DIR.glob("*.y*ml")):
        m = _FILE_NAME.match(path.name)
        if not m:
            continue
        out[path.stem] = path
        version = int(m["version"])
        if m["name"] not in found or found[m["name"]][0] < version:
            found[m["name"]] = (version, path)
    out.update({name: path for name, (_, path) in found.items()})
    return out


def resolve_workload(name_or_path: str | Path) -> Workload:
    """A shipped workload by name (`paper`, `paper-v1`) or any workload file by path."""
    shipped = builtin_workloads()
    key = str(name_or_path)
    if key in shipped:
        return load_workload(shipped[key])
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return load_workload(path)
    known = ", ".join(sorted(shipped))
    raise WorkloadError(f"unknown workload {key!r}; shipped workloads: {known} (or a file path)")
