"""Alembic migrations of the service database, shipped inside the package.

`marlaas.service.db.migrate` applies them at startup through Alembic's API; no
alembic.ini is needed. A new revision is a hand-written module in `versions/` whose
`down_revision` names the previous head; `tests/service/test_migrations.py` fails when
the models and the migrated schema disagree.
"""
