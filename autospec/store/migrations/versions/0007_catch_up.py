"""The draft model's catch-up forwards, per request: (tokens it took in, seconds) for each
forward over more than 2 tokens it had not seen (the prompt at its first use, and what k = 0
or the n-gram proposer emitted since). They are the points of the pair's catch-up cost C(g),
which replay (``autospec tune``) charges and a new process warms its policy's pricing from.

Existing rows get NULL: not recorded.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        # [[tokens, seconds], ...] (store.records.RequestRecord.draft_catch_ups)
        batch.add_column(sa.Column("draft_catch_ups", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("draft_catch_ups")
