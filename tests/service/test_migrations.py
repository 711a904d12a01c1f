"""The shipped migrations build exactly the schema the models describe, on SQLite and
PostgreSQL, and applying them again changes nothing; each step downgrades and upgrades
again without losing rows it should keep."""

from __future__ import annotations

from datetime import UTC, datetime

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, func, insert, inspect, select, text, update

from marlaas.service.db import (
    Database,
    _alembic_config,
    current_revision,
    head_revision,
    migrate,
)
from marlaas.service.models import Base, Dataset, File, Job, Metric, Tenant


def test_migrated_schema_matches_models(db_url: str) -> None:
    db = Database(db_url)
    try:
        with db.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == []
        assert current_revision(db.engine) == head_revision()
        migrate(db.engine)  # idempotent
        assert current_revision(db.engine) == head_revision()
        assert db.ping()
    finally:
        db.close()


def test_migrations_ship_with_the_package() -> None:
    """They are found next to the installed module, with no alembic.ini anywhere."""
    from marlaas.service import db

    assert (db.MIGRATIONS_DIR / "env.py").is_file()
    assert list((db.MIGRATIONS_DIR / "versions").glob("0001_*.py"))
    assert head_revision() == "0005"


def _downgrade(engine: Engine, revision: str) -> None:
    config = _alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def test_deleted_at_downgrades_and_upgrades(db_url: str) -> None:
    """0002 -> 0001 drops `jobs.deleted_at` without copying the table (a copy would
    cascade-delete child rows on SQLite) and drops deleted jobs for good; upgrading
    again restores the column."""
    db = Database(db_url)
    now = datetime.now(UTC)
    try:
        with db.engine.begin() as conn:
            conn.execute(
                insert(Tenant).values(
                    id="ten_1",
                    name="acme",
                    max_concurrent_jobs=1,
                    max_total_steps=10,
                    max_dataset_bytes=10,
                    created_at=now,
                )
            )
            for jid in ("job_kept", "job_gone"):
                conn.execute(
                    insert(Job).values(
                        id=jid,
                        tenant_id="ten_1",
                        name=jid,
                        spec={},
                        status="done",
                        steps=2,
                        steps_done=2,
                        priority=1.0,
                        created_at=now,
                        updated_at=now,
                    )
                )
                conn.execute(
                    insert(Metric).values(job_id=jid, step=1, name="r", value=1.0, time=now)
                )
            conn.execute(update(Job).where(Job.id == "job_gone").values(deleted_at=now))
        _downgrade(db.engine, "0001")
        assert current_revision(db.engine) == "0001"
        with db.engine.connect() as conn:
            assert conn.execute(select(Job.id)).scalars().all() == ["job_kept"]
        migrate(db.engine)
        assert current_revision(db.engine) == head_revision()
        with db.engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(Metric)) == 1
            assert conn.execute(select(Job.id, Job.deleted_at)).all() == [("job_kept", None)]
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == []
    finally:
        db.close()


def test_openai_files_downgrade_and_upgrade(db_url: str) -> None:
    """0003 -> 0002 drops OpenAI's view of files and jobs but keeps the files' bytes as
    the tenant's datasets; upgrading again brings the (empty) tables back."""
    db = Database(db_url)
    now = datetime.now(UTC)
    try:
        with db.engine.begin() as conn:
            conn.execute(
                insert(Tenant).values(
                    id="ten_1", name="acme", max_concurrent_jobs=1, max_total_steps=10,
                    max_dataset_bytes=10, created_at=now,
                )
            )  # fmt: skip
            conn.execute(
                insert(Dataset).values(
                    id="ds_1", tenant_id="ten_1", name="file-1", path="datasets/x.jsonl",
                    size_bytes=3, rows=1, sha256="0" * 64, created_at=now,
                )
            )  # fmt: skip
            conn.execute(
                insert(File).values(
                    id="file-1", tenant_id="ten_1", filename="t.jsonl", purpose="fine-tune",
                    size_bytes=3, rows=1, status="processed", created_at=now,
                )
            )  # fmt: skip
        _downgrade(db.engine, "0002")
        with db.engine.connect() as conn:
            assert not inspect(conn).has_table("files")
            assert not inspect(conn).has_table("fine_tuning_jobs")
            assert conn.execute(select(Dataset.name)).scalars().all() == ["file-1"]
        migrate(db.engine)
        with db.engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(File)) == 0
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        db.close()


def test_cost_quotas_fill_existing_tenants_and_downgrade_without_losing_rows(
    db_url: str,
) -> None:
    """0004 adds the cost and inference quotas: tenants created before it get the
    defaults of the day; 0004 -> 0003 drops the columns without copying `tenants` (a
    copy would cascade-delete every job and key on SQLite), and upgrading again fills
    them once more."""
    db = Database(db_url)
    now = datetime.now(UTC)
    try:
        _downgrade(db.engine, "0003")
        with db.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO tenants (id, name, max_concurrent_jobs, max_total_steps, "
                    "max_dataset_bytes, created_at) VALUES ('ten_1', 'acme', 1, 10, 10, :now)"
                ),
                {"now": now},
            )
            conn.execute(
                insert(Job).values(
                    id="job_1",
                    tenant_id="ten_1",
                    name="j",
                    spec={},
                    status="done",
                    steps=2,
                    steps_done=2,
                    priority=1.0,
                    created_at=now,
                    updated_at=now,
                )
            )
        migrate(db.engine)
        expected = (1024, 1024, 262_144, 8, 65_536)
        columns = (
            Tenant.max_samples_per_step,
            Tenant.max_eval_episodes,
            Tenant.max_tokens_per_step,
            Tenant.max_inference_requests,
            Tenant.max_inference_tokens,
        )
        with db.engine.connect() as conn:
            assert conn.execute(select(*columns)).one() == expected
        _downgrade(db.engine, "0003")
        with db.engine.connect() as conn:
            assert conn.execute(text("SELECT id FROM jobs")).scalars().all() == ["job_1"]
        migrate(db.engine)
        with db.engine.connect() as conn:
            assert conn.execute(select(*columns)).one() == expected
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == []
    finally:
        db.close()
