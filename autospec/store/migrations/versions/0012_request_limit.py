"""Each request's limit: how many tokens it could have generated (``max_new_tokens`` as the
engine took it), beside what it did generate (``new_tokens``).

Replay runs a policy over a stored request as the live run did: the policy reads how many
tokens a row may still generate (``Context.remaining``) and every block is cut to that room.
A request that ended at its limit shows its limit as its length; one that ended earlier (an
EOS, a stopping criterion) does not, and without its limit replay showed the policy a request
about to end at every iteration and cut its last block to the tokens left before the EOS —
which the live run could not know. One nullable column on ``requests``.

Existing rows get NULL: replay then takes the length as the limit, as before.

Revision ID: 0012
Revises: 0011
Create Date: 2027-01-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("max_new_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("max_new_tokens")
