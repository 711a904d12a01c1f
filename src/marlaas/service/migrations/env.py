"""Alembic's environment: runs the migrations on the connection the caller passes in
`config.attributes["connection"]` (see `marlaas.service.db.migrate`)."""

from __future__ import annotations

from alembic import context

from marlaas.service.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "marlaas migrations run through marlaas.service.db.migrate(engine), "
        "which passes the connection; the alembic command line is not set up"
    )
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
