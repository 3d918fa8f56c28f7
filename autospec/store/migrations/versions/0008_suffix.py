"""Suffix decoding, per request: its counters (blocks, tokens drafted and accepted, per
position, host seconds of its lookups) and its trace (what it would have drafted at every
generated position from the category's memory as the request saw it: match length, agreeing
tokens and draft length, no tokens), which replay (``autospec tune``) prices it from.

Existing rows get NULL: not recorded.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        # {"drafts", "drafted", "accepted", "accepted_per_position", "drafted_per_position",
        #  "lookup_s"} (store.records.RequestRecord.suffix)
        batch.add_column(sa.Column("suffix", sa.JSON(), nullable=True))
        # two bytes per generated position (autospec.suffix.suffix_trace)
        batch.add_column(sa.Column("suffix_trace", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("suffix_trace")
        batch.drop_column("suffix")
