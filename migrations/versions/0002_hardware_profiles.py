"""hardware_profiles: every `qlm profile run` (gpu type, model, engine, time, profile JSON)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22

Written to match ``qlm.store.models.HardwareProfileRun`` (checked by
tests/broker/test_migrations.py::test_models_match_the_migrations on SQLite and PostgreSQL): a new
table only, so the upgrade and the downgrade touch nothing that exists.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hardware_profiles",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("engine", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hardware_profiles")),
    )
    op.create_index(
        "ix_hardware_profiles_lookup",
        "hardware_profiles",
        ["gpu_type", "model", "created_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_hardware_profiles_lookup", table_name="hardware_profiles")
    op.drop_table("hardware_profiles")
