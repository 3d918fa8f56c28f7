"""The draft model's catch-up, logged and replayed (schema 0007). The loop records each
catch-up forward (tokens it took in, seconds); the store keeps them per request; a new
process warms its pricing from them; replay tracks the draft's gap as the loop does, hands it
to the policy and charges C(gap) − T_d from their fit. Before, replay let the draft model
resume for free — after the prompt, a stretch at k = 0 or n-gram blocks — so ``autospec
tune`` scored policies that switch proposers, or speculate over long prompts, above what the
live loop pays for them."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import MetaData, create_engine, select
from test_draft_cost import Stretches
from test_simulate_batch import row as trace_row
from test_store_batch import _create_at, _downgrade, _insert_legacy

import autospec
from autospec.costs.rules import catch_up_line, catch_up_sums
from autospec.costs.table import CostTable
from autospec.store import open_store, queries
from autospec.store.migrate import current_revision, head_revision
from autospec.store.tables import Request
from autospec.store.write import validate_record
from autospec.tune.replay import Costs, simulate
from autospec.tune.study import catch_up_fit

from conftest import noisy_copy, prompt, tiny
from test_store import BACKENDS, PAIRS, fresh_url, make_record


def _expected_gaps(prompt_len: int, ks: bytes, accepted: bytes) -> list[int]:
    """The draft's catch-ups by the loop's rule, from the schedule it ran: the prompt is
    unseen at first; a step at k = 0 adds its token; a block of k takes in its proposals but
    the last, then keeps the accepted ones (gap 1, or 2 when all k were accepted); a block
    that starts more than 2 tokens behind opens with a catch-up over them."""
    gap, out = prompt_len, []
    for k, m in zip(ks, accepted, strict=True):
        if k == 0:
            gap += m + 1
            continue
        if gap > 2:
            out.append(gap)
        gap = 1 if m < k else 2
    return out


def test_the_loop_logs_each_catch_up_and_the_store_keeps_them(tmp_path):
    target = tiny("llama", sharpen=30.0)
    draft = noisy_copy(target, 0.5)
    url = f"sqlite:///{tmp_path / 's.db'}"
    spec = autospec.Controller(target, draft, store=url, policy=Stretches(off=5, on=2))
    ids = prompt(12)
    spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    stats = spec.last_stats
    spec.close()
    with open_store(url) as st, st.session() as s:
        (row,) = queries.recent_requests(s)
        points, t_draft = queries.catch_ups(s, row.pair_id, path=row.path)
        (trace,) = list(queries.traces(s))
    gaps = _expected_gaps(ids.shape[1], row.k_schedule, row.accepted_schedule)
    assert len(gaps) >= 4 and gaps[0] == ids.shape[1] + 5  # the prompt and 5 plain tokens
    assert [g for g, _ in row.draft_catch_ups] == gaps  # the rule replay runs by
    assert all(c > 0 for _, c in row.draft_catch_ups)
    assert sum(c for _, c in row.draft_catch_ups) == pytest.approx(stats.draft_prefill_s)
    assert points == row.draft_catch_ups
    assert t_draft == pytest.approx(row.draft_s / row.draft_forwards)
    assert trace.prompt_tokens == row.prompt_tokens == ids.shape[1]


def test_a_batched_request_and_a_pair_without_draft_log_no_catch_up(tmp_path):
    target = tiny("llama", sharpen=30.0)
    url = f"sqlite:///{tmp_path / 's.db'}"
    spec = autospec.Controller(target, None, store=url)
    spec.generate(prompt(12), max_new_tokens=8, do_sample=False, eos_token_id=None)
    spec.close()
    spec = autospec.Controller(target, noisy_copy(target, 0.5), store=url, policy="fixed:2")
    ids = prompt(12).repeat(2, 1)
    spec.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=8,
                  do_sample=False, eos_token_id=None)
    spec.close()
    with open_store(url) as st, st.session() as s:
        rows = queries.recent_requests(s)
    assert sorted(r.batch_size for r in rows) == [1, 2, 2]
    assert all(r.draft_catch_ups is None for r in rows)  # not recorded: NULL, not []


def test_a_new_process_prices_the_first_catch_up_from_the_store(tmp_path):
    target = tiny("llama", sharpen=30.0)
    draft = noisy_copy(target, 0.5)
    url = f"sqlite:///{tmp_path / 's.db'}"
    first = autospec.Controller(target, draft, store=url, policy=Stretches(off=5, on=2))
    first.generate(prompt(12), max_new_tokens=40, do_sample=False, eos_token_id=None)
    logged = list(first.last_stats.draft_catch_ups)
    first.close()
    fresh = CostTable().at("eager")
    assert fresh.catch_up_cost(50) is None  # before: the first catch-up went unpriced
    second = autospec.Controller(target, draft, store=url, policy="fixed:2")
    live = second.live_stats("another category")  # the cost is the pair's, not the category's
    second.close()
    expected = CostTable().at("eager")
    for g, c in logged:
        expected.observe_catch_up(g, c)
    costs = second.costs.at("eager")
    assert len(logged) >= 4 and costs.catch_up == pytest.approx(expected.catch_up)
    assert costs.catch_up_cost(50) is not None
    assert live.spent == [0.0, 0.0]  # warming spends nothing of the category's time


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    u, cleanup = fresh_url(request.param, tmp_path)
    yield u
    cleanup()


def test_an_0006_database_is_upgraded_in_place_and_back(url):
    _create_at(url, "0006")
    engine = create_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=["pairs", "requests"])
    assert "draft_catch_ups" not in meta.tables["requests"].c
    old = make_record(random.Random(3), category="code", pair=PAIRS[1])
    with engine.begin() as conn:
        _insert_legacy(conn, meta.tables["requests"], validate_record(old),
                       ("draft_catch_ups", "suffix", "suffix_trace", "decisions"))
    engine.dispose()
    with open_store(url) as st:
        with st.engine.connect() as conn:
            assert current_revision(conn) == (head_revision(),)
        new = make_record(random.Random(4), category="code", pair=PAIRS[1])
        new.draft_catch_ups = [(40, 0.5), (7, 0.1)]
        st.write([new])
        with st.session() as s:
            got = [r.draft_catch_ups for r in queries.recent_requests(s)]  # newest first
            assert got == [[(40, 0.5), (7, 0.1)], None]  # the old row: not recorded
            pid = s.scalar(select(Request.pair_id))
            assert queries.catch_ups(s, pid)[0] == [(40, 0.5), (7, 0.1)]
    _downgrade(url, "0006").dispose()
    with open_store(url) as st, st.session() as s:  # upgraded again: the column is back empty
        assert all(r.draft_catch_ups is None for r in queries.recent_requests(s))


@pytest.mark.parametrize("bad", [[(0, 0.1)], [(5, -1.0)], [(5,)], [5], "5,0.1",
                                 [(2.5, 0.1)], [(True, 0.1)]])
def test_a_malformed_catch_up_list_is_refused(bad):
    rec = make_record(random.Random(5), category="code", pair=PAIRS[1])
    rec.draft_catch_ups = bad
    with pytest.raises(ValueError, match="draft_catch_ups"):
        validate_record(rec)


# -- replay -------------------------------------------------------------------------------
class Recorder:
    """A fixed schedule of k by iteration (then the last one), recording the gap it saw."""

    name = "recorder"

    def __init__(self, ks):
        self.ks, self.i, self.gaps = list(ks), 0, []

    def choose(self, ctx) -> int:
        self.gaps.append(ctx.gap)
        k = self.ks[min(self.i, len(self.ks) - 1)]
        self.i += 1
        return k

    def update(self, ctx, k, outcome) -> None:
        pass


T_D, T1, T4 = 0.005, 0.1, 0.12
LINE = (0.01, 0.001)  # C(g) = 10 ms + 1 ms per token


def _costs(catch_up=LINE) -> Costs:
    return Costs(t_draft=T_D, t_target={1: T1, 4: T4}, catch_up=catch_up)


def test_replay_charges_the_prompt_and_each_resumption_and_tells_the_policy():
    # 12 generated tokens, the draft right everywhere but position 4; prompt of 50 tokens
    trace = bytes([1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1])
    row = trace_row(trace, prompt_tokens=50)
    # k = 3 (accepts 3: g 0 → 4), k = 0 twice (g 4 → 6), k = 3 (accepts 3: 6 → 10),
    # k = 3 → clipped to remaining − 1 = 1 (10 → 12)
    policy = Recorder([3, 0, 0, 3, 3])
    res = simulate([row], policy, _costs(), k_max=8)
    assert policy.gaps == [50, 2, 3, 4, 2]  # as the live loop's draft_gap
    charged = (LINE[0] + LINE[1] * 50 - T_D) + (LINE[0] + LINE[1] * 4 - T_D)
    assert res.catch_up_seconds == pytest.approx(charged)
    bare = simulate([row], Recorder([3, 0, 0, 3, 3]), _costs(None), k_max=8)
    assert bare.catch_up_seconds == 0.0
    assert res.seconds - bare.seconds == pytest.approx(charged)
    assert res.tokens == bare.tokens == 12
    assert res.plain_seconds == bare.plain_seconds == pytest.approx(12 * T1)


def test_replay_feeds_the_charged_catch_ups_to_the_policys_statistics():
    row = trace_row(bytes([1] * 20), prompt_tokens=30)
    live, table = {}, _costs().table()
    simulate([row], Recorder([0, 0, 0, 3]), _costs(), k_max=8, category="c", live=live,
             table=table)
    g = 30 + 3
    costs = table.at(None)  # the pair's, on the replayed path, at batch 1
    assert costs.catch_up[:2] == [1.0, g]  # one catch-up, over the prompt and 3 tokens
    assert costs.catch_up_cost(g) == pytest.approx(LINE[0] + LINE[1] * g)
    assert live["c"].spent[0] >= LINE[0] + LINE[1] * g  # the category's time, spent on it


def test_a_catch_up_is_never_charged_below_one_proposal():
    costs = _costs((0.0, 0.0005))  # C(5) = 2.5 ms, under T_d: the forward still proposes
    assert costs.catch_up_seconds(5) == T_D
    assert costs.catch_up_seconds(2) is None and _costs(None).catch_up_seconds(99) is None
    assert Costs.from_description(costs.describe()) == costs
    assert "catch_up_s" not in _costs(None).describe()


def test_tune_reads_the_fit_at_the_ratio_to_t_d_it_was_logged_at():
    points = [(g, 0.01 + 0.002 * g) for g in (300, 5, 12, 250, 40)]
    a, b = catch_up_line(catch_up_sums(points))
    assert (a, b) == pytest.approx((0.01, 0.002))
    # logged where T_d was 20 ms; replayed with a probe's T_d of 10 ms: half the seconds
    assert catch_up_fit(points, 0.02, 0.01) == pytest.approx((0.005, 0.001))
    assert catch_up_fit(points, None, 0.01) == pytest.approx((0.01, 0.002))
    assert catch_up_fit([], 0.02, 0.01) is None


def test_tune_charges_the_logged_catch_ups_in_its_replay(tmp_path):
    from test_tune import CURVE, make_store
    from test_tune import PAIR as TUNE_PAIR
    from test_tune import T_D as PROBE_T_D

    from autospec.store import add_probe
    from autospec.tune.study import tune

    scores = {}
    for logged in (False, True, "probed"):
        store = make_store(tmp_path / f"{logged}.db", {"code": (0.85, 30)}, seed=2)
        if logged == "probed":  # nothing logged, a probe that timed the catch-up: its line
            with store.begin() as s:
                add_probe(s, TUNE_PAIR, {"path": "eager", "draft_s": PROBE_T_D,
                                         "target_s_by_n": {str(n): t for n, t in CURVE.items()},
                                         "draft_catch_up": [[8, 0.03], [32, 0.06], [128, 0.18]]})
        elif logged:  # three requests that drafted: T_d 40 ms (twice the probe's), C(g) line
            recs = [make_record(random.Random(i), category="other", pair=TUNE_PAIR)
                    for i in range(3)]
            for rec, g in zip(recs, (16, 40, 100), strict=True):
                rec.path, rec.batch_size = "eager", 1
                rec.draft_s, rec.draft_forwards = 0.4, 10
                rec.draft_catch_ups = [(g, 0.04 + 0.01 * g)]
            store.write(recs)
        with store:
            (res,) = tune(store, category="code", trials=12, families=("fixed",), seed=0,
                          holdout=0)
        scores[logged] = res
    charged, free, probed = scores[True], scores[False], scores["probed"]
    assert "draft catch-up: none logged or probed, not charged" in free.costs["source"]
    assert "draft catch-up: the probe's (3 sizes)" in probed.costs["source"]
    assert probed.costs["catch_up_s"] == pytest.approx([0.02, 0.00125])  # 20 ms + 1.25 ms/tok
    assert probed.train_tokens_per_s < free.train_tokens_per_s
    assert "catch_up_s" not in free.costs
    assert "draft catch-up: 3 logged" in charged.costs["source"]
    # the line at the probe's level: scaled by the probe's T_d over the 40 ms it was logged at
    scale = PROBE_T_D / 0.04
    assert charged.costs["catch_up_s"] == pytest.approx([0.04 * scale, 0.01 * scale])
    # every request's first block takes in its 16-token prompt: C(16) − T_d more per request
    assert charged.train_tokens_per_s < free.train_tokens_per_s
    # so does the untuned default it is compared with
    assert charged.baseline_train_tokens_per_s < free.baseline_train_tokens_per_s
