"""Proposers are rows, keyed by name: every per-proposer count, trace and setting of a request
moves into ``request_proposers`` (one row per (request, proposer)), every running sum of a
(category, pair) into ``category_proposers``; requests carry the id of the batched call they
ran in (``batch_id``).

What moves, per request: the draft model's counters (``drafts`` → blocks, ``drafted`` →
proposed, ``accepted``, the per-position lists), its acceptance ``trace`` and ``confidence``
into its row "draft" (kind "model"; a pair logged without a draft model — its draft named
"none (n-gram)" — gets no such row: its trace held nothing observed); prompt lookup's
``ngram`` counters (its ``lookup_s`` → seconds; ``max_n``/``min_n`` → settings) and
``ngram_trace`` into its row "ngram"; suffix decoding's ``suffix`` and ``suffix_trace`` into
"suffix" (kind "lookup" both). The per-iteration ``proposer_schedule`` (0 the draft model or
nobody, 1 prompt lookup, 2 suffix decoding) becomes an index into the request's proposers
sorted by name, 1-based, 0 for a plain step (a 0 byte where k was 0; the draft model's
otherwise). Per (category, pair): the draft model's sums and prompt lookup's (``ngram_*``)
into their rows; suffix decoding had no running sums, so its rows are added up from its
requests' (a category's sums are its requests', for every proposer). Every value is kept; the
old columns are dropped.

Downgrade puts them back from the rows ("draft", "ngram", "suffix"; another proposer's rows
have no column to go to and are dropped with the tables).

Revision ID: 0011
Revises: 0010
Create Date: 2027-01-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

NO_DRAFT = "none (n-gram)"  # the draft's name in the pair row of a pair without one
_LOOKUPS = {"ngram": 1, "suffix": 2}  # the old schedule's codes
# lookups 0010 kept no category sums of (only each request's counters): their
# ``category_proposers`` rows are summed from the request rows, so that a category's sums are
# its requests' as for every other proposer
_UNSUMMED = ("suffix",)
_REQUEST_COLUMNS = (
    ("drafts", sa.Integer()), ("drafted", sa.Integer()), ("accepted", sa.Integer()),
    ("accepted_per_position", sa.JSON()), ("drafted_per_position", sa.JSON()),
    ("trace", sa.LargeBinary()), ("confidence", sa.LargeBinary()), ("ngram", sa.JSON()),
    ("ngram_trace", sa.LargeBinary()), ("suffix", sa.JSON()), ("suffix_trace", sa.LargeBinary()))
_STAT_COLUMNS = (
    ("drafts", sa.BigInteger()), ("drafted", sa.BigInteger()), ("accepted", sa.BigInteger()),
    ("accepted_per_position", sa.JSON()), ("drafted_per_position", sa.JSON()),
    ("ngram_drafts", sa.BigInteger()), ("ngram_drafted", sa.BigInteger()),
    ("ngram_accepted", sa.BigInteger()), ("ngram_accepted_per_position", sa.JSON()),
    ("ngram_drafted_per_position", sa.JSON()), ("ngram_lookup_s", sa.Float()))
_PAGE = 500  # requests read, and their rows written, at a time


def _table(name: str, *columns) -> sa.TableClause:
    return sa.table(name, *(sa.column(n, t) for n, t in columns))


_requests_old = _table("requests", ("id", sa.BigInteger()), ("pair_id", sa.BigInteger()),
                       ("category_key", sa.String()), ("k_schedule", sa.LargeBinary()),
                       ("proposer_schedule", sa.LargeBinary()), *_REQUEST_COLUMNS)
_stats_old = _table("category_stats", ("category_key", sa.String()),
                    ("pair_id", sa.BigInteger()), *_STAT_COLUMNS)
_pairs = _table("pairs", ("id", sa.BigInteger()), ("draft", sa.Text()))
_request_rows = _table("request_proposers", ("request_id", sa.BigInteger()),
                       ("proposer", sa.String()), ("kind", sa.String()),
                       ("blocks", sa.Integer()), ("proposed", sa.Integer()),
                       ("accepted", sa.Integer()), ("proposed_per_position", sa.JSON()),
                       ("accepted_per_position", sa.JSON()), ("seconds", sa.Float()),
                       ("trace", sa.LargeBinary()), ("confidence", sa.LargeBinary()),
                       ("settings", sa.JSON()))
_category_rows = _table("category_proposers", ("category_key", sa.String()),
                        ("pair_id", sa.BigInteger()), ("proposer", sa.String()),
                        ("kind", sa.String()), ("blocks", sa.BigInteger()),
                        ("proposed", sa.BigInteger()), ("accepted", sa.BigInteger()),
                        ("proposed_per_position", sa.JSON()),
                        ("accepted_per_position", sa.JSON()), ("seconds", sa.Float()))


def _bytes(value) -> bytes | None:
    return None if value is None else bytes(value)


def _schedule(old: bytes | None, ks: bytes, names: list[str]) -> bytes | None:
    """The old codes (0 the draft or nobody, 1 prompt lookup, 2 suffix) as indices into
    ``names`` (sorted, 1-based; 0 a plain step)."""
    if old is None:
        if "draft" not in names:
            return None
        old = bytes(len(ks))
    index = {name: i + 1 for i, name in enumerate(names)}
    code_of = {0: "draft", **{c: n for n, c in _LOOKUPS.items()}}
    out = bytearray()
    for code, k in zip(old, ks):
        name = code_of.get(code)
        out.append(0 if k == 0 or name not in index else index[name])
    return bytes(out)


def _add(sums: dict, row: dict) -> None:
    """``row``'s counters (a request's proposer row) added into ``sums``."""
    for name in ("blocks", "proposed", "accepted", "seconds"):
        sums[name] = sums.get(name, 0) + row[name]
    for name in ("proposed_per_position", "accepted_per_position"):
        have, more = sums.setdefault(name, []), row[name]
        have.extend([0] * (len(more) - len(have)))
        for i, v in enumerate(more):
            have[i] += v


def _request_rows_of(r, drafted: bool) -> list[dict]:
    """A 0010 request's proposer rows (without its id): the draft model's where its pair had
    one, each lookup's that it ran."""
    mine = []
    if drafted:
        mine.append(dict(proposer="draft", kind="model", blocks=r["drafts"] or 0,
                         proposed=r["drafted"] or 0, accepted=r["accepted"] or 0,
                         proposed_per_position=list(r["drafted_per_position"] or []),
                         accepted_per_position=list(r["accepted_per_position"] or []),
                         seconds=0.0, trace=_bytes(r["trace"]),
                         confidence=_bytes(r["confidence"]), settings=None))
    for name in _LOOKUPS:
        counters = r[name]
        if counters is None:
            continue
        settings = {k: counters[k] for k in ("max_n", "min_n") if k in counters}
        mine.append(dict(proposer=name, kind="lookup", blocks=counters.get("drafts", 0),
                         proposed=counters.get("drafted", 0),
                         accepted=counters.get("accepted", 0),
                         proposed_per_position=list(counters.get("drafted_per_position") or []),
                         accepted_per_position=list(counters.get("accepted_per_position")
                                                    or []),
                         seconds=float(counters.get("lookup_s", 0.0) or 0.0),
                         trace=_bytes(r[f"{name}_trace"]), confidence=None,
                         settings=settings or None))
    return mine


def upgrade() -> None:
    op.create_table(
        "request_proposers",
        sa.Column("request_id", sa.BigInteger(), sa.ForeignKey(
            "requests.id", name="fk_request_proposers_request", ondelete="CASCADE"),
            primary_key=True),
        sa.Column("proposer", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("blocks", sa.Integer(), nullable=False),
        sa.Column("proposed", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("proposed_per_position", sa.JSON(), nullable=False),
        sa.Column("accepted_per_position", sa.JSON(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("trace", sa.LargeBinary(), nullable=True),
        sa.Column("confidence", sa.LargeBinary(), nullable=True),
        sa.Column("settings", sa.JSON(), nullable=True))
    op.create_table(
        "category_proposers",
        sa.Column("category_key", sa.String(64), primary_key=True),
        sa.Column("pair_id", sa.BigInteger(), sa.ForeignKey(
            "pairs.id", name="fk_category_proposers_pair"), primary_key=True),
        sa.Column("proposer", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("blocks", sa.BigInteger(), nullable=False),
        sa.Column("proposed", sa.BigInteger(), nullable=False),
        sa.Column("accepted", sa.BigInteger(), nullable=False),
        sa.Column("proposed_per_position", sa.JSON(), nullable=False),
        sa.Column("accepted_per_position", sa.JSON(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False))
    bind = op.get_bind()
    drafted = {r.id for r in bind.execute(sa.select(_pairs.c.id, _pairs.c.draft))
               if r.draft != NO_DRAFT}
    sched = _table("requests", ("id", sa.BigInteger()), ("proposer_schedule", sa.LargeBinary()))
    unsummed: dict[tuple, dict] = {}  # (category_key, pair_id, proposer) → its sums
    last = None
    while True:  # a page of requests at a time: a large store's traces never all in memory
        stmt = sa.select(_requests_old).order_by(_requests_old.c.id).limit(_PAGE)
        if last is not None:
            stmt = stmt.where(_requests_old.c.id > last)
        page = list(bind.execute(stmt).mappings())
        if not page:
            break
        last = page[-1]["id"]
        rows = []
        for r in page:
            mine = _request_rows_of(r, r["pair_id"] in drafted)
            rows += [dict(request_id=r["id"], **row) for row in mine]
            for row in mine:
                if row["proposer"] in _UNSUMMED:
                    _add(unsummed.setdefault((r["category_key"], r["pair_id"],
                                              row["proposer"]), {}), row)
            names = sorted(row["proposer"] for row in mine)
            value = _schedule(_bytes(r["proposer_schedule"]), bytes(r["k_schedule"] or b""),
                              names)
            if value != _bytes(r["proposer_schedule"]):
                bind.execute(sa.update(sched).where(sched.c.id == r["id"])
                             .values(proposer_schedule=value))
        if rows:
            bind.execute(sa.insert(_request_rows), rows)
    sums = []
    for r in bind.execute(sa.select(_stats_old)).mappings():
        key = dict(category_key=r["category_key"], pair_id=r["pair_id"])
        if r["pair_id"] in drafted:
            sums.append(dict(key, proposer="draft", kind="model", blocks=r["drafts"] or 0,
                             proposed=r["drafted"] or 0, accepted=r["accepted"] or 0,
                             proposed_per_position=list(r["drafted_per_position"] or []),
                             accepted_per_position=list(r["accepted_per_position"] or []),
                             seconds=0.0))
        if r["ngram_drafts"] or r["ngram_drafted_per_position"]:
            sums.append(dict(key, proposer="ngram", kind="lookup", blocks=r["ngram_drafts"] or 0,
                             proposed=r["ngram_drafted"] or 0,
                             accepted=r["ngram_accepted"] or 0,
                             proposed_per_position=list(r["ngram_drafted_per_position"] or []),
                             accepted_per_position=list(r["ngram_accepted_per_position"]
                                                        or []),
                             seconds=float(r["ngram_lookup_s"] or 0.0)))
    for (key, pid, name), mine in sorted(unsummed.items()):
        sums.append(dict(category_key=key, pair_id=pid, proposer=name, kind="lookup", **mine))
    if sums:
        bind.execute(sa.insert(_category_rows), sums)
    with op.batch_alter_table("requests") as batch:
        for name, _type in _REQUEST_COLUMNS:
            batch.drop_column(name)
        batch.add_column(sa.Column("batch_id", sa.String(32), nullable=True))
    with op.batch_alter_table("category_stats") as batch:
        for name, _type in _STAT_COLUMNS:
            batch.drop_column(name)


def _old_columns(r, mine: dict) -> dict:
    """A request's 0010 columns from its proposer rows ``mine`` (name → row)."""
    names = sorted(mine)
    draft = mine.get("draft")
    values = dict(drafts=0, drafted=0, accepted=0, accepted_per_position=[],
                  drafted_per_position=[], trace=bytes([255]) * (r["new_tokens"] or 0))
    if draft is not None:
        values.update(drafts=draft["blocks"], drafted=draft["proposed"],
                      accepted=draft["accepted"],
                      accepted_per_position=list(draft["accepted_per_position"]),
                      drafted_per_position=list(draft["proposed_per_position"]),
                      confidence=_bytes(draft["confidence"]))
        if draft["trace"] is not None:
            values["trace"] = bytes(draft["trace"])
    for name in _LOOKUPS:
        row = mine.get(name)
        if row is None:
            continue
        values[name] = {**(row["settings"] or {}), "drafts": row["blocks"],
                        "drafted": row["proposed"], "accepted": row["accepted"],
                        "accepted_per_position": list(row["accepted_per_position"]),
                        "drafted_per_position": list(row["proposed_per_position"]),
                        "lookup_s": row["seconds"]}
        values[f"{name}_trace"] = _bytes(row["trace"])
    sched = r["proposer_schedule"]
    if sched is not None:
        codes = {i + 1: _LOOKUPS.get(n, 0) for i, n in enumerate(names)}
        values["proposer_schedule"] = bytes(codes.get(b, 0) for b in bytes(sched))
    return values


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("batch_id")
        for name, type_ in _REQUEST_COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))
    with op.batch_alter_table("category_stats") as batch:
        for name, type_ in _STAT_COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))
    bind = op.get_bind()
    reqs = _table("requests", ("id", sa.BigInteger()), ("new_tokens", sa.Integer()),
                  ("k_schedule", sa.LargeBinary()), ("proposer_schedule", sa.LargeBinary()),
                  *_REQUEST_COLUMNS)
    last = None
    while True:  # a page of requests at a time, as upgrade
        stmt = (sa.select(reqs.c.id, reqs.c.new_tokens, reqs.c.proposer_schedule)
                .order_by(reqs.c.id).limit(_PAGE))
        if last is not None:
            stmt = stmt.where(reqs.c.id > last)
        page = list(bind.execute(stmt).mappings())
        if not page:
            break
        last = page[-1]["id"]
        by_request: dict[int, dict] = {}
        for r in bind.execute(sa.select(_request_rows).where(
                _request_rows.c.request_id.in_([r["id"] for r in page]))).mappings():
            by_request.setdefault(r["request_id"], {})[r["proposer"]] = r
        for r in page:
            bind.execute(sa.update(reqs).where(reqs.c.id == r["id"]).values(
                **_old_columns(r, by_request.get(r["id"], {}))))
    stats = _table("category_stats", ("category_key", sa.String()),
                   ("pair_id", sa.BigInteger()), *_STAT_COLUMNS)
    keys = bind.execute(sa.select(stats.c.category_key, stats.c.pair_id)).all()
    sums: dict[tuple, dict] = {}
    for r in bind.execute(sa.select(_category_rows)).mappings():
        sums.setdefault((r["category_key"], r["pair_id"]), {})[r["proposer"]] = r
    for key in keys:
        mine = sums.get(tuple(key), {})
        draft, ngram = mine.get("draft"), mine.get("ngram")
        values = dict(drafts=0, drafted=0, accepted=0, accepted_per_position=[],
                      drafted_per_position=[], ngram_drafts=0, ngram_drafted=0,
                      ngram_accepted=0, ngram_lookup_s=0.0)
        if draft is not None:
            values.update(drafts=draft["blocks"], drafted=draft["proposed"],
                          accepted=draft["accepted"],
                          accepted_per_position=list(draft["accepted_per_position"]),
                          drafted_per_position=list(draft["proposed_per_position"]))
        if ngram is not None:
            values.update(ngram_drafts=ngram["blocks"], ngram_drafted=ngram["proposed"],
                          ngram_accepted=ngram["accepted"], ngram_lookup_s=ngram["seconds"],
                          ngram_accepted_per_position=list(ngram["accepted_per_position"]),
                          ngram_drafted_per_position=list(ngram["proposed_per_position"]))
        bind.execute(sa.update(stats).where(stats.c.category_key == key[0],
                                            stats.c.pair_id == key[1]).values(**values))
    with op.batch_alter_table("requests") as batch:  # NOT NULL again, as 0010 had them
        for name in ("drafts", "drafted", "accepted", "accepted_per_position",
                     "drafted_per_position", "trace"):
            batch.alter_column(name, existing_type=dict(_REQUEST_COLUMNS)[name],
                               nullable=False)
    with op.batch_alter_table("category_stats") as batch:
        for name in ("drafts", "drafted", "accepted", "accepted_per_position",
                     "drafted_per_position", "ngram_drafts", "ngram_drafted",
                     "ngram_accepted", "ngram_lookup_s"):
            batch.alter_column(name, existing_type=dict(_STAT_COLUMNS)[name], nullable=False)
    op.drop_table("category_proposers")
    op.drop_table("request_proposers")
