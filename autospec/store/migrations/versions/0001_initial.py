"""The first schema: pairs, requests, category_stats, probes.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
When = sa.DateTime(timezone=True)
Seconds = sa.Float()


def upgrade() -> None:
    op.create_table(
        "pairs",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("draft", sa.Text(), nullable=False),
        sa.Column("dtype", sa.Text(), nullable=False),
        sa.Column("hardware", sa.Text(), nullable=False),
        sa.Column("target_param_bytes", sa.BigInteger(), nullable=False),
        sa.Column("draft_param_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", When, nullable=False),
        sa.UniqueConstraint("key", name="uq_pairs_key"),
    )
    op.create_table(
        "requests",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("created_at", When, nullable=False),
        sa.Column("category", sa.Text(), nullable=False),
        sa.Column("category_key", sa.String(64), nullable=False),
        sa.Column("pair_id", sa.BigInteger(), sa.ForeignKey("pairs.id", name="fk_requests_pair"),
                  nullable=False),
        sa.Column("policy", sa.Text(), nullable=False),
        sa.Column("greedy", sa.Boolean(), nullable=False),
        *(sa.Column(name, sa.Integer(), nullable=False) for name in (
            "prompt_tokens", "new_tokens", "iterations", "drafts", "drafted", "accepted")),
        sa.Column("accepted_per_position", sa.JSON(), nullable=False),
        sa.Column("drafted_per_position", sa.JSON(), nullable=False),
        sa.Column("k_schedule", sa.LargeBinary(), nullable=False),
        sa.Column("accepted_schedule", sa.LargeBinary(), nullable=False),
        sa.Column("trace_kind", sa.String(16), nullable=False),
        sa.Column("trace", sa.LargeBinary(), nullable=False),
        sa.Column("wall_s", Seconds, nullable=False),
        sa.Column("prefill_s", Seconds, nullable=False),
        sa.Column("draft_s", Seconds, nullable=False),
        sa.Column("draft_forwards", sa.Integer(), nullable=False),
        sa.Column("target_s_by_n", sa.JSON(), nullable=False),
        sa.Column("bandwidth_bytes_per_s", sa.Float(), nullable=True),
        sa.Column("bandwidth_peak_bytes_per_s", sa.Float(), nullable=True),
        sa.Column("nvml_mem_busy_pct", sa.Float(), nullable=True),
        sa.Column("nvml_sm_util_pct", sa.Float(), nullable=True),
        sa.Column("prompt_text", sa.Text(), nullable=True),
        sa.Column("output_text", sa.Text(), nullable=True),
        sa.Column("stop_reason", sa.Text(), nullable=False),
    )
    op.create_index("ix_requests_category_pair_created", "requests",
                    ["category_key", "pair_id", "created_at"])
    op.create_table(
        "category_stats",
        sa.Column("category_key", sa.String(64), primary_key=True),
        sa.Column("pair_id", sa.BigInteger(),
                  sa.ForeignKey("pairs.id", name="fk_category_stats_pair"), primary_key=True),
        sa.Column("category", sa.Text(), nullable=False),
        *(sa.Column(name, sa.BigInteger(), nullable=False) for name in (
            "requests", "prompt_tokens", "new_tokens", "iterations", "drafts", "drafted",
            "accepted")),
        sa.Column("accepted_per_position", sa.JSON(), nullable=False),
        sa.Column("drafted_per_position", sa.JSON(), nullable=False),
        sa.Column("draft_s", Seconds, nullable=False),
        sa.Column("draft_forwards", sa.BigInteger(), nullable=False),
        sa.Column("target_s_sum_by_n", sa.JSON(), nullable=False),
        sa.Column("target_count_by_n", sa.JSON(), nullable=False),
        sa.Column("k_counts", sa.JSON(), nullable=False),
        sa.Column("wall_s", Seconds, nullable=False),
        sa.Column("prefill_s", Seconds, nullable=False),
        sa.Column("bandwidth_bytes", sa.Float(), nullable=False),
        sa.Column("bandwidth_s", Seconds, nullable=False),
        sa.Column("bandwidth_peak_bytes_per_s", sa.Float(), nullable=True),
        sa.Column("nvml_mem_busy_sum", sa.Float(), nullable=False),
        sa.Column("nvml_mem_busy_n", sa.BigInteger(), nullable=False),
        sa.Column("nvml_sm_util_sum", sa.Float(), nullable=False),
        sa.Column("nvml_sm_util_n", sa.BigInteger(), nullable=False),
        sa.Column("first_seen", When, nullable=False),
        sa.Column("last_seen", When, nullable=False),
    )
    op.create_table(
        "probes",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("pair_id", sa.BigInteger(), sa.ForeignKey("pairs.id", name="fk_probes_pair"),
                  nullable=False),
        sa.Column("created_at", When, nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
    )
    op.create_index("ix_probes_pair_created", "probes", ["pair_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_probes_pair_created", table_name="probes")
    op.drop_table("probes")
    op.drop_table("category_stats")
    op.drop_index("ix_requests_category_pair_created", table_name="requests")
    op.drop_table("requests")
    op.drop_table("pairs")
