"""Tuning and categorisation: tuned policy parameters, fitted categorisers, and per-request
prompt features / category provenance.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
When = sa.DateTime(timezone=True)


def upgrade() -> None:
    # batch mode: SQLite cannot ALTER … ADD a column with a constraint in place
    with op.batch_alter_table("requests") as batch:
        # "given": the caller named the category; "auto": the categoriser assigned it;
        # "default": neither (the controller's default category)
        batch.add_column(sa.Column("category_source", sa.String(16), nullable=False,
                                   server_default="given"))
        # hashed prompt-token n-grams (autospec.categorize.categorizer): features, never text
        batch.add_column(sa.Column("features", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("predicted_alpha", sa.Float(), nullable=True))
    op.create_table(
        "tuned_params",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("created_at", When, nullable=False),
        sa.Column("category", sa.Text(), nullable=False),
        sa.Column("category_key", sa.String(64), nullable=False),
        sa.Column("pair_id", sa.BigInteger(),
                  sa.ForeignKey("pairs.id", name="fk_tuned_params_pair"), nullable=False),
        sa.Column("family", sa.Text(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=False),
        sa.Column("baseline_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("provenance", sa.JSON(), nullable=False),
    )
    op.create_index("ix_tuned_params_category_pair_created", "tuned_params",
                    ["category_key", "pair_id", "created_at"])
    op.create_table(
        "categorizers",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("created_at", When, nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("meta", sa.JSON(), nullable=False),
    )
    op.create_index("ix_categorizers_name_version", "categorizers", ["name", "version"],
                    unique=True)


def downgrade() -> None:
    op.drop_index("ix_categorizers_name_version", table_name="categorizers")
    op.drop_table("categorizers")
    op.drop_index("ix_tuned_params_category_pair_created", table_name="tuned_params")
    op.drop_table("tuned_params")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("predicted_alpha")
        batch.drop_column("features")
        batch.drop_column("category_source")
