"""Database URLs: clear errors for ones the service cannot use; reporter and spec
invariants that need no HTTP."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from marlaas.errors import ConfigError
from marlaas.service.db import make_engine
from marlaas.service.reporter import JobReporter
from marlaas.service.settings import ServiceSettings


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "invalid database URL"),
        ("postgresql+psycopg2://u@127.0.0.1/db", "psycopg 3 driver"),
        ("mysql+pymysql://u@127.0.0.1/db", "unsupported database 'mysql'"),
    ],
)
def test_unusable_database_urls_say_what_to_use(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_engine(url)


def test_plain_postgresql_url_uses_psycopg_3() -> None:
    engine = make_engine("postgresql://u@127.0.0.1/db")  # connects lazily: nothing is reached
    assert engine.dialect.driver == "psycopg"
    engine.dispose()


def test_default_database_is_sqlite_in_the_data_dir(tmp_path: Path) -> None:
    settings = ServiceSettings(data_dir=tmp_path)
    assert settings.database_url == f"sqlite:///{tmp_path.resolve() / 'marlaas.db'}"
    assert settings.artifact_dir == tmp_path / "artifacts"
    with pytest.raises(ValueError, match="at least 16 characters"):
        ServiceSettings(admin_key="short")


def test_reporter_refuses_checkpoints_outside_the_artifact_dir(tmp_path: Path) -> None:
    reporter = JobReporter(db=None, artifact_dir=tmp_path / "artifacts")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside the artifact directory"):
        asyncio.run(reporter.checkpoint("job_x", 1, tmp_path / "elsewhere", {}))
