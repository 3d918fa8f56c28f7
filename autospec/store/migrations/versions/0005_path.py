"""Costs per execution path: the path (eager, static cache, CUDA graphs) on every request and
probe, and the batch-1 timing sums per (category, pair, path).

Existing rows get path NULL, meaning unknown: a store cannot tell which path an old request
ran on (``wrap(static_cache=True)`` existed before), and a probe from before 0005 timed bare
eager forwards, not the loop's step. They keep counting for acceptance and the counters; no
path's costs read them (the controller re-measures T_t(n) within a few requests).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("path", sa.String(64), nullable=True))
    with op.batch_alter_table("probes") as batch:
        batch.add_column(sa.Column("path", sa.String(64), nullable=True))
    op.create_table(
        "category_costs",
        sa.Column("category_key", sa.String(64), primary_key=True),
        sa.Column("pair_id", sa.BigInteger(),
                  sa.ForeignKey("pairs.id", name="fk_category_costs_pair"), primary_key=True),
        sa.Column("path", sa.String(64), primary_key=True),
        sa.Column("category", sa.Text(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("draft_s", sa.Float(), nullable=False),
        sa.Column("draft_forwards", sa.BigInteger(), nullable=False),
        sa.Column("target_s_sum_by_n", sa.JSON(), nullable=False),
        sa.Column("target_count_by_n", sa.JSON(), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("category_costs")
    with op.batch_alter_table("probes") as batch:
        batch.drop_column("path")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("path")
