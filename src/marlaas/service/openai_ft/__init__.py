"""OpenAI-compatible fine-tuning: the Files API (`files`), fine-tuning jobs (`jobs`,
their wire shapes in `wire` and their mapping onto marlaas jobs in `convert`), the
`alpha/graders` routes (`graders`), the `ft:` model names (`names`) and a succeeded
job's results file (`results`); checkpoint permissions are refused (`permissions`).

An OpenAI fine-tuning job is an ordinary marlaas job underneath (same id, tenant, quotas,
dashboard, downloads, crash recovery); these modules only translate. `routers` lists
the routers the app mounts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from marlaas.service.models import Job


def routers() -> list[APIRouter]:
    from marlaas.service.openai_ft import files, graders, jobs, permissions

    return [files.router, jobs.router, graders.router, permissions.router]


def write_results(session: Session, job: Job, artifact_dir: Path) -> None:
    """The `JobReporter` hook that stores a succeeded job's results file."""
    from marlaas.service.openai_ft.results import write_results as write

    write(session, job, artifact_dir)
