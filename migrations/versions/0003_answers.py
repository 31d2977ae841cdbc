"""answers: the durable record of each request's one reply (exactly-once across restarts)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25

Written to match ``qlm.store.models.Answer`` (checked by
tests/broker/test_migrations.py::test_models_match_the_migrations on SQLite and PostgreSQL): a new
table only, so the upgrade and the downgrade touch nothing that exists.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "answers",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("reply_id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("answered_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_answers")),
    )
    op.create_index(op.f("ix_answers_answered_at"), "answers", ["answered_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_answers_answered_at"), table_name="answers")
    op.drop_table("answers")
