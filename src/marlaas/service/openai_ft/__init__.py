"""OpenAI-compatible fine-tuning: the Files API (`files`), fine-tuning jobs (`jobs`,
their wire shapes in `wire` and their mapping onto marlaas jobs in `convert`), the
`alpha/graders` routes (`graders`) and the `ft:` model names (`names`).

An OpenAI fine-tuning job is an ordinary marlaas job underneath (same id, tenant, quotas,
dashboard, downloads, crash recovery); these modules only translate. `routers` lists
the routers the app mounts.
"""

from __future__ import annotations

from fastapi import APIRouter


def routers() -> list[APIRouter]:
    from marlaas.service.openai_ft import files, graders, jobs

    return [files.router, jobs.router, graders.router]
