"""Batched speculation: the batch size each request ran at, its forward timings by batch
size, and the probe's (B, n) grid.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        # rows of the batch the request ran in (1 for every request logged before 0004)
        batch.add_column(sa.Column("batch_size", sa.Integer(), nullable=False,
                                   server_default="1"))
        # "B,n" → [seconds]: target forwards scoring n tokens per row at batch B > 1
        batch.add_column(sa.Column("target_s_by_bn", sa.JSON(), nullable=True))
        # "B" → [seconds per proposed token]: draft steps at batch B > 1
        batch.add_column(sa.Column("draft_s_by_b", sa.JSON(), nullable=True))
    with op.batch_alter_table("probes") as batch:
        batch.add_column(sa.Column("grid", sa.JSON(), nullable=True))  # "B" → {"n": s}
        batch.add_column(sa.Column("draft_grid", sa.JSON(), nullable=True))  # "B" → s


def downgrade() -> None:
    with op.batch_alter_table("probes") as batch:
        batch.drop_column("draft_grid")
        batch.drop_column("grid")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("draft_s_by_b")
        batch.drop_column("target_s_by_bn")
        batch.drop_column("batch_size")
