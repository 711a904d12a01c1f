"""The database: engine, sessions and migrations, for SQLite (default) and PostgreSQL.

One request, one transaction (`Database.transaction`): it commits when the block ends
and rolls back on any error, so a failed request leaves nothing half-written.

SQLite specifics: foreign keys are switched on per connection, the journal is WAL, and
every transaction starts with `BEGIN IMMEDIATE`, which takes the write lock up front, so
two concurrent quota checks cannot both read "one slot left" and both insert. PostgreSQL
gets the same guarantee by locking the tenant's row (`SELECT ... FOR UPDATE`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from marlaas.errors import ConfigError

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def _alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


@functools.cache
def head_revision() -> str:
    """The newest migration shipped with this package."""
    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None
    return head


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # Let SQLAlchemy's `begin` listener decide how transactions start (below).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_begin(connection: Any) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets the pragmas and locking described above."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise ConfigError(
            f"invalid database URL {url!r}: {e}; use e.g. sqlite:///path/marlaas.db "
            "or postgresql+psycopg://user:password@host:5432/dbname"
        ) from None
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    if parsed.get_backend_name() == "postgresql":
        if parsed.get_driver_name() != "psycopg":
            raise ConfigError(
                f"database URL {parsed.render_as_string(hide_password=True)}: use the "
                "psycopg 3 driver, postgresql+psycopg://..."
            )
        return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10)
    raise ConfigError(
        f"unsupported database {parsed.get_backend_name()!r}; use sqlite:/// or "
        "postgresql+psycopg://"
    )


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision (idempotent)."""
    config = _alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


class Database:
    """The service's engine and session factory; complete (migrated) once constructed."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        migrate(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session in one transaction: committed at the end, rolled back on error."""
        with self._sessions.begin() as session:
            yield session

    def ping(self) -> bool:
        """True when the database answers and its schema is at this package's head."""
        try:
            with self.engine.connect() as connection:
                version = connection.execute(text("SELECT version_num FROM alembic_version"))
                return version.scalar() == head_revision()
        except SQLAlchemyError:
            return False

    def close(self) -> None:
        self.engine.dispose()
