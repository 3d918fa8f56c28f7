"""The n-gram (prompt-lookup) proposer: per request its counters and settings, which
iterations it drafted, and its trace (what it would have matched at every generated
position); per (category, pair) its running sums.

Existing rows get NULL (requests: unknown, nothing was recorded) and zeros (category_stats:
no n-gram iteration ran before the proposer existed, so the sums are exact).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-20
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_STAT_COUNTERS = ("ngram_drafts", "ngram_drafted", "ngram_accepted")


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        # {"max_n", "min_n", "drafts", "drafted", "accepted", "accepted_per_position",
        #  "drafted_per_position", "lookup_s"} (store.records.RequestRecord.ngram)
        batch.add_column(sa.Column("ngram", sa.JSON(), nullable=True))
        # one byte per iteration: 1 = drafted by the n-gram proposer
        batch.add_column(sa.Column("proposer_schedule", sa.LargeBinary(), nullable=True))
        # one byte per generated position (autospec.ngram.ngram_trace)
        batch.add_column(sa.Column("ngram_trace", sa.LargeBinary(), nullable=True))
    with op.batch_alter_table("category_stats") as batch:
        for name in _STAT_COUNTERS:
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=False,
                                       server_default="0"))
        # summed elementwise; NULL: no n-gram iteration yet
        batch.add_column(sa.Column("ngram_accepted_per_position", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("ngram_drafted_per_position", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("ngram_lookup_s", sa.Float(), nullable=False,
                                   server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("category_stats") as batch:
        batch.drop_column("ngram_lookup_s")
        batch.drop_column("ngram_drafted_per_position")
        batch.drop_column("ngram_accepted_per_position")
        for name in reversed(_STAT_COUNTERS):
            batch.drop_column(name)
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("ngram_trace")
        batch.drop_column("proposer_schedule")
        batch.drop_column("ngram")
