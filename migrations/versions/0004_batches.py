"""batches: the OpenAI Batch API's files, batches and batch lines (qlm/store/batches.py)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25

Written to match ``qlm.store.models`` (StoredFile, FileBody, Batch, BatchLine; checked by
tests/broker/test_migrations.py::test_models_match_the_migrations on SQLite and PostgreSQL):
new tables only, so the upgrade and the downgrade touch nothing that exists.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(length=512), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("not_before", sa.Double(), nullable=True),
        sa.Column("request", sa.Text(), nullable=True),
        sa.Column("output", sa.Text(), nullable=True),
        sa.Column("done_at", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("batch_id", "line_no", name=op.f("pk_batch_lines")),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
    )
    op.create_index("ix_batch_lines_state", "batch_lines", ["batch_id", "state"], unique=False)

    op.create_table(
        "batches",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("window_s", sa.Double(), nullable=False),
        sa.Column("meta", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("in_progress_at", sa.Double(), nullable=True),
        sa.Column("finalizing_at", sa.Double(), nullable=True),
        sa.Column("completed_at", sa.Double(), nullable=True),
        sa.Column("failed_at", sa.Double(), nullable=True),
        sa.Column("expired_at", sa.Double(), nullable=True),
        sa.Column("cancelling_at", sa.Double(), nullable=True),
        sa.Column("cancelled_at", sa.Double(), nullable=True),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_until", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("batch_id", name=op.f("pk_batches")),
    )
    op.create_index("ix_batches_status", "batches", ["status"], unique=False)
    op.create_index("ix_batches_tenant_created", "batches", ["tenant", "created_at"], unique=False)

    op.create_table(
        "file_bodies",
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("file_id", name=op.f("pk_file_bodies")),
    )
    op.create_table(
        "files",
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=256), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("lines", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("file_id", name=op.f("pk_files")),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant", "created_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_files_tenant_created", table_name="files")

    op.drop_table("files")
    op.drop_table("file_bodies")
    op.drop_index("ix_batches_tenant_created", table_name="batches")
    op.drop_index("ix_batches_status", table_name="batches")

    op.drop_table("batches")
    op.drop_index("ix_batch_lines_state", table_name="batch_lines")

    op.drop_table("batch_lines")
