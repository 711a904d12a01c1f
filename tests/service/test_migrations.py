"""The shipped migrations build exactly the schema the models describe, on SQLite and
PostgreSQL, and applying them again changes nothing."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from marlaas.service.db import Database, current_revision, head_revision, migrate
from marlaas.service.models import Base


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
    assert head_revision() == "0001"
