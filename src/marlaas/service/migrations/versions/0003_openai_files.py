"""OpenAI-compatible fine-tuning: `files` (uploads of the Files API) and
`fine_tuning_jobs` (what an OpenAI request said of a job beyond its spec).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from marlaas.service.models import UTCDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column(
            "tenant_id",
            sa.String(32),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("status_details", sa.Text()),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime()),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant_id", "created_at"])
    op.create_table(
        "fine_tuning_jobs",
        sa.Column(
            "job_id",
            sa.String(32),
            sa.ForeignKey("jobs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("training_file", sa.String(40), nullable=False),
        sa.Column("validation_file", sa.String(40)),
        sa.Column("suffix", sa.String(64)),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("method", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON()),
        sa.Column("fine_tuned_model", sa.String(400), nullable=False),
    )


def downgrade() -> None:
    # The files' bytes stay as the tenants' datasets (named by the file ids); only
    # OpenAI's view of them and of the jobs goes.
    op.drop_table("fine_tuning_jobs")
    op.drop_index("ix_files_tenant_created", table_name="files")
    op.drop_table("files")
