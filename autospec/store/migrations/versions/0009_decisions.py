"""The policy's decision records (``autospec.policies.explain``): why it chose each kept
iteration's k and proposer — the candidates it weighed, each one's expected seconds per token
and where its acceptance and costs came from. ``autospec explain`` and the report read them.

One nullable column on ``requests``, ``decisions``: the request's kept records as one JSON
array, zlib-compressed (``store.decisions``). Not a table of one row per iteration: the records
are written, read and dropped with their request and never queried by their fields; one blob
costs one insert with the request's own, and its records' repeated keys compress ~10×.

Existing rows get NULL: no record kept (logged before 0009, or nobody asked).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("decisions", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("decisions")
