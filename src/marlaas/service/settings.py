"""The service's settings: where its state lives, its limits and default quotas.

Settings are data (a frozen pydantic model); `marlaas serve` builds them from its
options and the environment, tests build them directly.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, field_validator

from marlaas.config.specs import Spec

ADMIN_KEY_ENV = "MARLAAS_ADMIN_KEY"


class QuotaSpec(Spec):
    """Per-tenant limits. A new tenant gets the service's defaults unless told otherwise."""

    max_concurrent_jobs: int = Field(
        4, ge=0, le=10_000, description="Jobs queued, running or paused at once."
    )
    max_total_steps: int = Field(
        10_000,
        ge=0,
        le=10**12,
        description="Optimizer steps over all the tenant's jobs; a cancelled or failed job "
        "counts only the steps it ran.",
    )
    max_dataset_bytes: int = Field(
        100 * 2**20, ge=0, le=2**50, description="Bytes of all the tenant's uploaded datasets."
    )


class ServiceSettings(Spec):
    """Where the service keeps its state and how much it accepts."""

    data_dir: Path = Field(
        Path("marlaas-data"), description="Holds the SQLite database and the artifacts."
    )
    db_url: str | None = Field(
        None,
        description="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db; "
        "None: SQLite at <data_dir>/marlaas.db.",
    )
    admin_key: str | None = Field(
        None,
        description="The admin key; None: one is generated at first start, printed once "
        "and stored hashed.",
        repr=False,
    )
    max_body_bytes: int = Field(
        1 * 2**20, ge=1024, description="Largest JSON request body; larger answers 413."
    )
    max_upload_bytes: int = Field(
        256 * 2**20, ge=1024, description="Largest dataset upload; larger answers 413."
    )
    max_lora_rank: int = Field(16, ge=1, le=256, description="Largest LoRA rank a job may ask.")
    max_staleness: int = Field(
        4, ge=0, le=64, description="Largest `algorithm.max_staleness` a job may ask."
    )
    serve_base_model: Path | None = Field(
        None,
        description="Base model directory the OpenAI-compatible routes load when no job "
        "backend shares its engine; None: the embedded base.",
    )
    max_serving_adapters: int = Field(
        8,
        ge=1,
        le=4096,
        description="Checkpoint adapters kept loaded for inference; beyond this the least "
        "recently used idle one is unloaded.",
    )
    auth_cache_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="Seconds an authenticated API key is remembered (no database query "
        "per request). Revocations through this server apply at once; ones made by "
        "another process on the same database within this time. 0: no cache.",
    )
    default_quotas: QuotaSpec = Field(default_factory=QuotaSpec)

    @field_validator("admin_key")
    @classmethod
    def _admin_key(cls, v: str | None) -> str | None:
        if v is not None and len(v) < 16:
            raise ValueError("the admin key must be at least 16 characters long")
        return v

    @property
    def artifact_dir(self) -> Path:
        """Checkpoints, adapters and datasets; database rows hold paths relative to it."""
        return self.data_dir / "artifacts"

    @property
    def database_url(self) -> str:
        return self.db_url or f"sqlite:///{(self.data_dir / 'marlaas.db').resolve()}"


def admin_key_from_env() -> str | None:
    """The admin key set in the environment (`MARLAAS_ADMIN_KEY`), if any."""
    return os.environ.get(ADMIN_KEY_ENV) or None
