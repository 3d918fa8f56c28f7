"""The draft's confidence per generated position, beside the acceptance trace: what
draft-side early stopping decides on, so that its threshold can be tuned by replay.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        # one byte per generated position: round(254 · the draft's top probability), 255
        # where the draft did not run on the target's prefix (see records.confidence)
        batch.add_column(sa.Column("confidence", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("confidence")
