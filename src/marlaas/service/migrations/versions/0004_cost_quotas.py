"""Quotas of a job's cost and of inference: five columns of `tenants`, filled for the
tenants that exist with the service's default values (`settings.QuotaSpec`).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

#: (column, type, the value existing tenants get): the defaults of `QuotaSpec` when this
#: migration was written, spelled out so that later default changes do not rewrite it.
COLUMNS: tuple[tuple[str, type[sa.types.TypeEngine[int]], int], ...] = (
    ("max_samples_per_step", sa.BigInteger, 1024),
    ("max_eval_episodes", sa.Integer, 1024),
    ("max_tokens_per_step", sa.BigInteger, 262_144),
    ("max_inference_requests", sa.Integer, 8),
    ("max_inference_tokens", sa.BigInteger, 65_536),
)


def upgrade() -> None:
    # The server default fills the existing rows. It stays (dropping it would copy the
    # table on SQLite, see below); the service always writes every quota of a new tenant.
    for name, kind, value in COLUMNS:
        op.add_column("tenants", sa.Column(name, kind(), nullable=False, server_default=str(value)))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite >= 3.35 and PostgreSQL): a batch copy of `tenants` would
    # cascade-delete every job and key on SQLite.
    for name, _, _ in reversed(COLUMNS):
        op.drop_column("tenants", name)
