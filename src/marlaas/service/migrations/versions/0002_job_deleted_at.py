"""Deleted jobs: `jobs.deleted_at` (soft delete; the row stays for quota accounting).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from marlaas.service.models import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("deleted_at", UTCDateTime()))


def downgrade() -> None:
    # The older schema cannot hide a job, and a tenant's deleted job must not come back:
    # its rows go for good (their child rows cascade), and its steps stop counting.
    op.execute(sa.text("DELETE FROM jobs WHERE deleted_at IS NOT NULL"))
    # A plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35 and PostgreSQL), not a batch
    # table copy: re-creating `jobs` on SQLite would cascade-delete every child row.
    op.drop_column("jobs", "deleted_at")
