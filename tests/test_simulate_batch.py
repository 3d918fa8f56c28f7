"""Replay at batch > 1: traces logged at batch B replay in batches of B under T_t(B, n), rows
leave when they finish, and the baseline is plain batched decoding of the same batches."""

from __future__ import annotations

import json
import pickle
import random
from dataclasses import replace

import pytest
from test_tune import PAIR, make_store, record

from autospec.policies import Context, FixedK, as_policy, build_policy
from autospec.policies.table import TablePolicy
from autospec.store import add_probe, open_store, queries
from autospec.store.queries import TraceRow
from autospec.traces import TRACE_GREEDY, UNOBSERVED
from autospec.tune.replay import Costs, SimResult, plain_batch_seconds, simulate
from autospec.tune.study import evaluate, tune

# batch 1 and batch 4: verification flat in n (memory-bound); batch 16: linear in n
T_D = 0.01
FLAT_1 = {n: 0.10 + 0.001 * (n - 1) for n in range(1, 17)}
GRID = {4: {n: 0.12 + 0.002 * (n - 1) for n in range(1, 17)},
        16: {n: 0.25 * n for n in range(1, 17)}}
DRAFT_GRID = {4: 0.012, 16: 0.02}
COSTS = Costs(T_D, FLAT_1, GRID, DRAFT_GRID)


def row(trace, batch: int = 1, category: str = "code", kind: str = TRACE_GREEDY,
        **fields) -> TraceRow:
    """A logged request that had the draft model alone, with this trace."""
    return TraceRow(kind, {"draft": bytes(trace)}, b"", b"", category=category,
                    batch_size=batch, kinds={"draft": "model"}, **fields)


def iid(rng: random.Random, alpha: float, n: int) -> list[int]:
    return [1 if rng.random() < alpha else 0 for _ in range(n)]


def test_a_batch_replays_as_computed_by_hand():
    """Two rows at batch 2 with k = 2; row B finishes first and row A runs on alone at batch 1.
    it 1 (B = 2, k = 2): A accepts 1,1 → 3 tokens; B accepts 1 then rejects → 2 tokens.
        0.02 · 2 + T_t(2, 3) = 0.04 + 0.30
    it 2 (B = 2, k = 2): A accepts 1,1 → 3 tokens; B has one token left → k 0, 1 token.
        0.04 + 0.30
    it 3 (B = 1, A alone, 2 tokens left → k 1): accepts 1 → 2 tokens.  0.01 + T_t(1, 2) = 0.12
    plain: 3 steps of both rows at T_t(2, 1) = 0.2, then 5 of A alone at T_t(1, 1) = 0.1."""
    costs = Costs(0.01, {1: 0.10, 2: 0.11, 3: 0.12}, {2: {1: 0.20, 2: 0.25, 3: 0.30}},
                  {2: 0.02})
    a = row([1, 1, 0, 1, 1, 1, 1, 0], batch=2)
    b = row([1, 0, 1], batch=2)
    res = simulate([a, b], FixedK(2), costs, category="code")
    assert res.tokens == 11 and res.iterations == 3 and res.row_steps == 5
    assert res.seconds == pytest.approx(0.34 + 0.34 + 0.12)
    assert res.plain_seconds == pytest.approx(3 * 0.2 + 5 * 0.1)
    assert res.speedup == pytest.approx(1.1 / 0.80)
    assert res.accepted == 2 + 1 + 2 + 0 + 1 and res.drafted == 2 + 2 + 2 + 0 + 1
    assert res.k_by_batch() == {1: 1, 2: 2}


def batches(batch: int, count: int, alpha: float = 0.8, n: int = 64, seed: int = 0):
    rng = random.Random(seed)
    return [row(iid(rng, alpha, n), batch=batch) for _ in range(count * batch)]


def test_speculation_pays_where_verification_is_flat_and_loses_where_it_is_linear():
    at4 = simulate(batches(4, 3), FixedK(3), COSTS)
    at16 = simulate(batches(16, 2), FixedK(3), COSTS)
    assert at4.speedup > 1.5
    assert at16.speedup < 0.8
    assert set(at4.k_counts_by_batch) >= {4} and set(at16.k_counts_by_batch) >= {16}
    # the baseline is plain batched decoding: equal-length rows, one step per token
    assert at4.plain_seconds == pytest.approx(3 * 64 * GRID[4][1])
    assert at16.plain_seconds == pytest.approx(2 * 64 * GRID[16][1])
    # k = 0 is plain batched decoding itself
    off = simulate(batches(16, 2), FixedK(0), COSTS)
    assert off.seconds == pytest.approx(off.plain_seconds) and off.speedup == pytest.approx(1)


def test_the_cost_model_switches_speculation_off_at_large_batch_in_replay():
    """The batch-aware default policy, fed rows and batch costs by the replay as the live loop
    feeds them: k > 0 at batch 4, k = 0 at batch 16 (mostly: it re-probes now and then)."""
    at4 = simulate(batches(4, 3), as_policy("auto"), COSTS)
    at16 = simulate(batches(16, 2), as_policy("auto"), COSTS)
    assert sum(c for k, c in at4.k_counts_by_batch[4].items() if k > 0) > \
        0.8 * sum(at4.k_counts_by_batch[4].values())
    assert at16.k_counts_by_batch[16][0] > 0.8 * sum(at16.k_counts_by_batch[16].values())
    assert at4.speedup > 1.5 and at16.speedup > 0.9


def test_finished_rows_leave_the_batch():
    """Rows of lengths 4, 8, 20, 40 at batch 4 and k = 0: one row-step per token (72), not
    4 × 40, each step costing T_t at the rows still running."""
    rng = random.Random(1)
    rows = [row(iid(rng, 0.8, n), batch=4) for n in (4, 8, 20, 40)]
    res = simulate(rows, FixedK(0), COSTS)
    assert res.row_steps == res.tokens == 72 < 4 * 40
    t = {b: COSTS.at(b)[0](1) for b in (1, 2, 3, 4)}
    by_hand = 4 * t[4] + 4 * t[3] + 12 * t[2] + 20 * t[1]
    assert res.seconds == pytest.approx(by_hand)
    assert plain_batch_seconds([4, 8, 20, 40], COSTS) == pytest.approx(by_hand)
    assert t[4] > t[3] > t[2] > t[1]  # compaction makes the tail cheaper
    spec = simulate(rows, FixedK(3), COSTS)
    assert spec.row_steps < 72 and spec.iterations < 40


class RowsLeft(FixedK):
    """Fixed k; records each batch decision's tokens left per row."""

    def __init__(self, k):
        super().__init__(k)
        self.seen: list[tuple[int, int, tuple[int, ...]]] = []

    def choose(self, ctx):
        if ctx.batch_size > 1:
            self.seen.append((ctx.batch_size, ctx.remaining, ctx.remaining_rows))
        return super().choose(ctx)


def test_replay_tells_the_policy_each_rows_tokens_left():
    rng = random.Random(2)
    rows = [row(iid(rng, 0.8, n), batch=4) for n in (4, 8, 20, 40)]
    policy = RowsLeft(0)
    simulate(rows, policy, COSTS)
    # k = 0: one token per row per step, rows leaving at their lengths
    assert policy.seen[0] == (4, 40, (4, 8, 20, 40))
    assert policy.seen[4] == (3, 36, (4, 16, 36))
    assert all(len(left) == b and max(left) == rem for b, rem, left in policy.seen)


def test_batch_one_traces_replay_as_before_and_a_lone_row_as_batch_one():
    rng = random.Random(2)
    traces = [iid(rng, 0.7, 50) for _ in range(6)]
    single = simulate([row(t) for t in traces], FixedK(4), Costs(T_D, FLAT_1), category="c")
    with_grid = simulate([row(t) for t in traces], FixedK(4), COSTS, category="c")
    assert vars(single) == vars(with_grid)
    assert single.speedup == pytest.approx(single.plain_seconds / single.seconds)
    # a batch of which the window holds one row replays as that row alone
    lone = simulate([row(traces[0], batch=8)], FixedK(4), COSTS, category="c")
    alone = simulate([row(traces[0])], FixedK(4), COSTS, category="c")
    assert (lone.tokens, lone.k_counts) == (alone.tokens, alone.k_counts)
    assert lone.seconds == pytest.approx(alone.seconds)
    assert lone.plain_seconds == pytest.approx(alone.plain_seconds)


def test_rows_are_batched_per_batch_size_and_category_in_logged_order():
    rng = random.Random(3)
    rows = ([row(iid(rng, 0.8, 30), batch=2, category="a") for _ in range(2)]
            + [row(iid(rng, 0.8, 30), batch=2, category="b")]
            + [row(iid(rng, 0.8, 30), batch=2, category="b")])
    seen = []

    class Spy(FixedK):
        def choose(self, context):
            seen.append((context.categories, context.batch_size))
            return super().choose(context)

    res = simulate(rows, Spy(2), COSTS, category=lambda r: r.category)
    assert seen[0] == (("a", "a"), 2) and ("b", "b") in {c for c, _ in seen}
    assert all(len(set(c)) == 1 for c, _ in seen)
    assert res.tokens == 4 * 30 and isinstance(res, SimResult)


def test_batch_traces_need_batch_costs_unless_replayed_alone():
    traces = batches(4, 1, n=20)
    with pytest.raises(ValueError, match="batch > 1"):
        simulate(traces, FixedK(2), Costs(T_D, FLAT_1))
    alone = simulate(traces, FixedK(2), Costs(T_D, FLAT_1), batched=False)
    assert alone.k_counts_by_batch.keys() == {1} and alone.tokens == 80


def test_costs_round_trip_through_their_description_and_pickle():
    again = Costs.from_description(json.loads(json.dumps(COSTS.describe())))
    assert again == COSTS
    assert again.at(16)[0](5) == pytest.approx(1.25) and again.at(16)[1] == 0.02
    assert Costs(T_D, FLAT_1).describe() == {"t_draft_s": T_D, "t_target_s_by_n": FLAT_1}
    # tune's worker processes get the costs pickled, interpolation caches and all
    copied = pickle.loads(pickle.dumps(again))
    assert copied == COSTS and copied.at(16)[0](5) == pytest.approx(1.25)


# -- tuning on batched traffic ------------------------------------------------------------------

def batched_store(path, alpha: float = 0.8):
    """Greedy i.i.d. traces of one category logged through the store's writer: 16 batches of
    4 and, interleaved, 4 of 16; and a probe with T_t(n), T_d and the (B, n) grid."""
    rng = random.Random(0)
    store = open_store(path)
    recs, at = [], 1.0e9
    for i in range(16):
        for b in (4, 16) if i % 4 == 3 else (4,):
            for _ in range(b):
                at += 1
                recs.append(replace(record(rng, alpha, at=at), batch_size=b))
    store.write(recs)
    with store.begin() as s:
        add_probe(s, PAIR, {"path": "eager", "target_s_by_n": {str(n): t for n, t in FLAT_1.items()},
                            "draft_s": T_D, "grid": GRID, "draft_grid": DRAFT_GRID})
    return store


def test_tuning_batched_traffic_finds_a_table_on_at_small_batch_and_off_at_large(tmp_path):
    with batched_store(tmp_path / "b.db") as store:
        # no held-back part: the best is written whatever the batch-aware default would do
        (res,) = tune(store, trials=60, families=("table", "fixed"), seed=0, holdout=0)
        with store.session() as s:
            (row,) = queries.tuned_params(s)
            window = list(queries.traces(s))
    assert res.status == "tuned", res.reason
    assert res.table_searched and res.batch_sizes == {4: 64, 16: 64}
    assert res.family == "table" and not res.kept_default
    table = TablePolicy.parse(row.params["table"])
    assert table.k_for(4) > 0 and table.k_for(16) == 0 and table.k_for(64) == 0
    # it beats every single k, which must lose at one batch size or the other
    costs = Costs.from_description(res.costs)
    assert costs.batched and costs.target_grid[16][2] == GRID[16][2]
    train = window
    best_fixed = max(evaluate("fixed", {"k": k}, train, costs, k_max=16).tokens_per_s
                     for k in range(0, 6))
    assert res.train_tokens_per_s > 1.05 * best_fixed
    # the stored row applies live: k by the batch size the loop reports
    policy = build_policy(row.family, row.params)
    assert policy.choose(Context(category="code", batch_size=4)) == table.k_for(4) > 0
    assert policy.choose(Context(category="code", batch_size=16)) == 0
    assert res.k_by_batch[4] > 0 and res.k_by_batch[16] == 0


def test_the_table_is_not_searched_without_a_batch_dimension(tmp_path):
    with make_store(tmp_path / "one.db", {"code": (0.8, 40)}) as store:
        (res,) = tune(store, trials=6, seed=0, write=False)
    assert res.status == "tuned" and not res.table_searched and res.batch_sizes == {1: 40}
    assert "table" not in res.provenance["families"]


# -- a draft model's trace that does not cover the request ---------------------------------------

def test_a_request_without_its_draft_trace_replays_without_the_draft_model(tmp_path):
    """A draft model's row whose trace is empty (nothing recorded; the store refuses one
    now, but a row migrated from before 0011 can hold one): replay runs its positions as
    plain steps, the draft model offered nothing there, as for a request logged without a
    trace of it."""
    rng = random.Random(0)
    with open_store(tmp_path / "e.db") as store:
        store.write([record(rng, 0.9, at=1.0e9)])
        with store.session() as s:
            (full,) = queries.traces(s)
    bare = full._replace(traces={"draft": b""})
    rows = [bare, full]
    both = simulate(rows, FixedK(4), COSTS)
    alone = simulate(rows[1:], FixedK(4), COSTS)
    assert both.tokens == 2 * 96 and both.unobserved_hits == alone.unobserved_hits == 0
    assert both.proposer("draft").proposed == alone.proposer("draft").proposed > 0
    assert both.k_counts[0] == alone.k_counts[0] + 96  # the bare request: plain steps


def test_positions_past_the_end_of_a_draft_trace_replay_as_unobserved():
    """A trace shorter than the request's generated positions: its blocks past the trace's
    end meet unobserved positions (counted rejected, as an unobserved byte is), and every
    position is still replayed."""
    short = row([1] * 6, new_tokens=10)
    res = simulate([short], FixedK(3), COSTS)
    assert res.tokens == 10 and res.unobserved_hits >= 1
    # the observed part replays as the whole trace would: 3 accepted, then 2 before its end
    whole = simulate([row([1] * 6 + [UNOBSERVED] * 4, new_tokens=10)], FixedK(3), COSTS)
    assert (res.accepted, res.unobserved_hits, res.seconds) == (
        whole.accepted, whole.unobserved_hits, whole.seconds)
