"""Tinker-compatible API: `tinker_runs` (training runs) and `tinker_checkpoints` (their
saved states and sampler weights).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from marlaas.service.models import UTCDateTime

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tinker_runs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column(
            "tenant_id",
            sa.String(32),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("session_id", sa.String(32), nullable=False),
        sa.Column("base_model", sa.String(512), nullable=False),
        sa.Column("lora", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("user_metadata", sa.JSON()),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("last_request_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_tinker_runs_tenant_status", "tinker_runs", ["tenant_id", "status"])
    op.create_table(
        "tinker_checkpoints",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "run_id",
            sa.String(64),
            sa.ForeignKey("tinker_runs.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("path", sa.String(512), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("user_metadata", sa.JSON()),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime()),
        sa.UniqueConstraint("run_id", "kind", "name", name="uq_tinker_checkpoints_run_kind_name"),
    )
    op.create_index("ix_tinker_checkpoints_run_id", "tinker_checkpoints", ["run_id"])


def downgrade() -> None:
    # The files under <artifact dir>/tinker stay; an older schema cannot refer to them.
    op.drop_index("ix_tinker_checkpoints_run_id", table_name="tinker_checkpoints")
    op.drop_table("tinker_checkpoints")
    op.drop_index("ix_tinker_runs_tenant_status", table_name="tinker_runs")
    op.drop_table("tinker_runs")
