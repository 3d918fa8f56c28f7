"""Costs are the pair's, once: the batch-1 live timing sums move from one row per (category,
pair, execution path) (``category_costs``) to one row per (pair, path) (``pair_costs``), and
which paths served a category is kept apart (``category_paths``), with no timings.

T_t(n) and T_d are facts of the model pair, the hardware and the path, not of the traffic: a
category's forwards measure the same curve as another's. Kept per category, each category's
curve rested on its own forwards alone, a new category started from nothing, and readers
pooled the rows again on every read.

What is pooled: for every (pair, path), the sums of its ``category_costs`` rows, whatever
their category — ``requests``, ``draft_s``, ``draft_forwards``, and ``target_s_sum_by_n`` /
``target_count_by_n`` elementwise by n (their union of n) — and ``last_seen`` the latest.
Each ``category_costs`` row's (category_key, pair_id, path, category, requests, last_seen)
becomes its ``category_paths`` row: the path a category's requests ran on stays per category
(``queries.serving_path``, the report's path per workload). Nothing else changes:
``category_stats`` keeps acceptance and the counters; its timing sums (every path's together,
rows of unknown path included) were never a cost source and stay as they are. Per-request
timings (``requests.target_s_by_n``, ...) are untouched, so nothing logged is lost.

Downgrade: ``category_costs`` again, one row per ``category_paths`` row, each carrying its
(pair, path)'s pooled sums (the split per category is not kept: every category reads the
pair's curve, the mean per n as the upgrade left it; forward counts are then the pair's).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-31
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_TIMINGS = ("draft_s", "draft_forwards", "target_s_sum_by_n", "target_count_by_n")


def _category_costs() -> sa.TableClause:
    return sa.table("category_costs", sa.column("category_key", sa.String()),
                    sa.column("pair_id", sa.BigInteger()), sa.column("path", sa.String()),
                    sa.column("category", sa.Text()), sa.column("requests", sa.BigInteger()),
                    sa.column("draft_s", sa.Float()),
                    sa.column("draft_forwards", sa.BigInteger()),
                    sa.column("target_s_sum_by_n", sa.JSON()),
                    sa.column("target_count_by_n", sa.JSON()),
                    sa.column("last_seen", sa.DateTime(timezone=True)))


def _add_maps(a: dict, b: dict | None) -> dict:
    out = dict(a)
    for n, v in (b or {}).items():
        out[str(n)] = out.get(str(n), 0) + v
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def upgrade() -> None:
    pair_costs = op.create_table(
        "pair_costs",
        sa.Column("pair_id", sa.BigInteger(),
                  sa.ForeignKey("pairs.id", name="fk_pair_costs_pair"), primary_key=True),
        sa.Column("path", sa.String(64), primary_key=True),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("draft_s", sa.Float(), nullable=False),
        sa.Column("draft_forwards", sa.BigInteger(), nullable=False),
        sa.Column("target_s_sum_by_n", sa.JSON(), nullable=False),
        sa.Column("target_count_by_n", sa.JSON(), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
    )
    category_paths = op.create_table(
        "category_paths",
        sa.Column("category_key", sa.String(64), primary_key=True),
        sa.Column("pair_id", sa.BigInteger(),
                  sa.ForeignKey("pairs.id", name="fk_category_paths_pair"), primary_key=True),
        sa.Column("path", sa.String(64), primary_key=True),
        sa.Column("category", sa.Text(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
    )
    old = _category_costs()
    rows = op.get_bind().execute(sa.select(old).order_by(
        old.c.pair_id, old.c.path, old.c.category_key)).mappings().all()
    pooled: dict[tuple, dict] = {}
    for r in rows:
        p = pooled.setdefault((r["pair_id"], r["path"]), dict(
            pair_id=r["pair_id"], path=r["path"], requests=0, draft_s=0.0, draft_forwards=0,
            target_s_sum_by_n={}, target_count_by_n={}, last_seen=r["last_seen"]))
        p["requests"] += r["requests"] or 0
        p["draft_s"] += r["draft_s"] or 0.0
        p["draft_forwards"] += r["draft_forwards"] or 0
        for name in ("target_s_sum_by_n", "target_count_by_n"):
            p[name] = _add_maps(p[name], r[name])
        p["last_seen"] = max(p["last_seen"], r["last_seen"])
    if pooled:
        op.bulk_insert(pair_costs, list(pooled.values()))
    if rows:
        op.bulk_insert(category_paths, [
            {name: r[name] for name in ("category_key", "pair_id", "path", "category",
                                        "requests", "last_seen")} for r in rows])
    op.drop_table("category_costs")


def downgrade() -> None:
    category_costs = op.create_table(
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
    bind = op.get_bind()
    pair_costs = sa.table("pair_costs", sa.column("pair_id", sa.BigInteger()),
                          sa.column("path", sa.String()), sa.column("draft_s", sa.Float()),
                          sa.column("draft_forwards", sa.BigInteger()),
                          sa.column("target_s_sum_by_n", sa.JSON()),
                          sa.column("target_count_by_n", sa.JSON()))
    category_paths = sa.table(
        "category_paths", sa.column("category_key", sa.String()),
        sa.column("pair_id", sa.BigInteger()), sa.column("path", sa.String()),
        sa.column("category", sa.Text()), sa.column("requests", sa.BigInteger()),
        sa.column("last_seen", sa.DateTime(timezone=True)))
    pooled = {(r["pair_id"], r["path"]): r
              for r in bind.execute(sa.select(pair_costs)).mappings()}
    rows = []
    for r in bind.execute(sa.select(category_paths)).mappings():
        p = pooled.get((r["pair_id"], r["path"]))
        rows.append(dict(r, **{name: (p[name] if p is not None else
                                      {} if name.startswith("target") else 0)
                               for name in _TIMINGS}))
    if rows:
        op.bulk_insert(category_costs, rows)
    op.drop_table("category_paths")
    op.drop_table("pair_costs")
