"""Perfect foresight (``autospec.oracle``): the least time any per-iteration choice could take,
knowing every outcome, by a dynamic programme over positions — checked on traces small enough
to price by hand, against fixed schedules priced the same way, and in ``autospec bench``'s
foresight column; ``scripts/oracle_bound.py`` runs on the same function."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from autospec import oracle as orc
from autospec.traces import NGRAM_NONE, encode_trace_value

SPEC = importlib.util.spec_from_file_location(
    "oracle_bound", Path(__file__).resolve().parents[1] / "scripts" / "oracle_bound.py")
oracle_bound = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(oracle_bound)
SPEC = importlib.util.spec_from_file_location(
    "stop_bound", Path(__file__).resolve().parents[1] / "scripts" / "stop_bound.py")
stop_bound = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(stop_bound)


class Flat:
    """T_t(n) = 1 s whatever n, T_d = 0.1 s."""

    t_draft = 0.1

    def __call__(self, n: int) -> float:
        return 1.0


N = 10  # positions 0 … 9; position 0 is the prefill's


def _suffix(at: dict[int, tuple[int, int]]) -> bytes:
    """A suffix trace with (agreeing tokens, draft length) at the given positions."""
    out = bytearray()
    for p in range(N):
        agree, size = at.get(p, (0, 0))
        out += bytes([encode_trace_value(3, agree), size] if size else [NGRAM_NONE, 0])
    return bytes(out)


def test_the_oracle_stops_each_block_where_acceptance_ends():
    draft = bytes([255] + [1] * 9)
    ngram = bytes([NGRAM_NONE] * N)
    none = _suffix({})
    # one draft block of 8 from position 1, all accepted, and the target's token: 9 tokens
    assert oracle_bound.oracle(N, draft, none, ngram, {"draft"}, Flat()) == pytest.approx(1.8)
    assert oracle_bound.oracle(N, draft, none, ngram, set(), Flat()) == pytest.approx(9.0)
    # the draft model misses at position 4: 3 accepted + the target's, then 5 more
    draft = bytes([255, 1, 1, 1, 0, 1, 1, 1, 1, 1])
    assert oracle_bound.oracle(N, draft, none, ngram, {"draft"}, Flat()) == pytest.approx(
        (0.3 + 1) + (0.4 + 1))


def test_a_position_the_draft_model_never_saw_counts_in_its_favour():
    """A request the draft model never drafted (lookups served it all: its trace unobserved
    throughout) read as the draft failing everywhere, which priced perfect foresight above
    what the run itself took (above 100 %). Unseen, it counts as accepted: the least time
    stays a lower bound."""
    ngram = bytes([NGRAM_NONE] + [encode_trace_value(3, 2)] * (N - 1))  # 2-token lookups
    unseen = bytes([255] * N)
    lookups_only = oracle_bound.oracle(N, unseen, _suffix({}), ngram, {"ngram"}, Flat())
    got = oracle_bound.oracle(N, unseen, _suffix({}), ngram, {"draft", "ngram"}, Flat())
    assert got == oracle_bound.oracle(N, bytes([255] + [1] * 9), _suffix({}), ngram,
                                      {"draft", "ngram"}, Flat())
    assert got == pytest.approx(1.8) and got < lookups_only  # a block of 8 + the target's
    # seen misses still count as misses
    missed = bytes([255] + [0] * 9)
    assert oracle_bound.oracle(N, missed, _suffix({}), ngram, {"draft", "ngram"}, Flat()) == (
        pytest.approx(lookups_only))


def test_a_suffix_draft_continued_by_the_draft_model_only_with_hybrid():
    draft = bytes([255, 0, 0, 0, 0, 0, 1, 1, 1, 1])  # the draft model helps only late
    ngram = bytes([NGRAM_NONE] * N)
    sfx = _suffix({1: (5, 5)})  # at position 1 a 5-token suffix draft, all right
    t = orc.T_LOOKUP
    # suffix block: 5 + 1 tokens to position 7; then the draft model, 2 + 1 to the end
    assert oracle_bound.oracle(N, draft, sfx, ngram, {"draft", "suffix"}, Flat()) == \
        pytest.approx(t + 1 + 0.2 + 1)
    # hybrid: the suffix's 5, the draft model's 3 after them, the target's token: one forward
    assert oracle_bound.oracle(N, draft, sfx, ngram, {"draft", "suffix", "hybrid"},
                               Flat()) == pytest.approx(t + 0.3 + 1)
    # prompt lookup's block holds what its trace says agreed
    ngram = bytes([NGRAM_NONE, encode_trace_value(2, 8)] + [NGRAM_NONE] * 8)
    assert oracle_bound.oracle(N, draft, sfx, ngram, {"ngram"}, Flat()) == pytest.approx(t + 1)


def _fixed_k_seconds(n: int, draft: bytes, k: int, prices) -> float:
    """A schedule of draft blocks of k from position 1, priced as the oracle prices them."""
    p, seconds = 1, 0.0
    while p < n:
        a = orc.leading(draft, p, k)
        seconds += k * prices.t_draft + prices(k + 1)
        p += a + 1
    return seconds


def test_foresight_is_never_slower_than_any_fixed_k_or_plain():
    rng = random.Random(0)
    prices = orc.Prices({1: 0.10, 2: 0.11, 5: 0.13, 17: 0.30}, t_draft=0.02)
    for _ in range(50):
        n = rng.randint(2, 60)
        draft = bytes(rng.choice([0, 1, 1, 1, 255]) for _ in range(n))
        best = orc.least_seconds(n, {"draft": draft}, {"draft"}, prices, model="draft")
        assert best <= (n - 1) * prices(1) + 1e-12
        for k in range(1, 17):
            assert best <= _fixed_k_seconds(n, draft, k, prices) + 1e-12
        # a proposer not allowed, or without a trace, changes nothing
        assert orc.least_seconds(n, {"draft": draft}, {"draft", "ngram"}, prices,
                                 model="draft") == best
        plain = orc.least_seconds(n, {"draft": draft}, set(), prices, model="draft")
        assert plain == pytest.approx((n - 1) * prices(1))


def test_the_schedule_run_is_priced_as_foresight_prices_it():
    """``scheduled_seconds``: the forwards a request ran at the same prices as perfect
    foresight's (catch-ups on neither side), so least ÷ it is how near its choices came: 1
    where it ran the oracle's own schedule, less for a worse one."""
    prices = orc.Prices({1: 0.10, 4: 0.20}, t_draft=0.02)
    # widths as the store keeps them (strings) or the loop (ints); one timing or a list
    ran = orc.scheduled_seconds({"1": [0.5, 0.7], 4: [9.0], "2": 0.3}, 3, 2, prices)
    assert ran == pytest.approx(2 * 0.10 + 0.20 + (0.10 + (0.20 - 0.10) / 3)
                                + 3 * 0.02 + 2 * orc.T_LOOKUP)
    assert orc.scheduled_seconds({1: [1.0]}, 0, 0, orc.Prices({1: 0.1}, float("inf"))) == 0.1
    # every draft token accepted, T_t flat: the oracle drafts 8 in one block, positions 1 → 10
    draft = bytes([1] * N)
    best = orc.least_seconds(N, {"draft": draft}, {"draft"}, Flat(), model="draft")
    assert best == pytest.approx(8 * 0.1 + 1.0)
    assert best / orc.scheduled_seconds({9: [1.0]}, 8, 0, Flat()) == pytest.approx(1.0)
    # k = 2 on the same trace: three blocks of 2 (positions 1 → 4 → 7 → 10)
    assert best / orc.scheduled_seconds({3: [1.0] * 3}, 6, 0, Flat()) == pytest.approx(0.5)


def test_a_stopping_rule_replays_by_hand():
    """``scripts/stop_bound.py``'s replay: blocks end where the rule says (the token that ends
    them kept) or at the request's end, each priced k · T_d + T_t(k + 1), advancing past the
    accepted tokens and the target's own; never faster than perfect foresight."""
    trace = bytes([255, 1, 1, 0, 1, 1, 1, 1, 1, 1])
    conf = bytes([255, 250, 250, 40, 250, 250, 30, 250, 250, 250])
    # k = 3: positions 1-3 (2 accepted) → 4-6 (3) → 8-9 (the last two, cut at the end)
    fixed = stop_bound.run(N, trace, Flat(), lambda p, i: i + 1 >= 3)
    assert fixed == pytest.approx(3 * 0.1 + 1 + 3 * 0.1 + 1 + 2 * 0.1 + 1)
    # stop after a token below confidence 0.5: 1-3 (3 is the doubtful one: 2 accepted) →
    # 4-6 (6 doubtful, all 3 accepted) → 8-9
    doubt = stop_bound.run(N, trace, Flat(),
                           lambda p, i: i + 1 >= 16 or conf[p + i] < 127)
    assert doubt == pytest.approx(fixed)
    # the same through a StopRule: every token read at its bin's acceptance (1 above
    # confidence 0.5, 0.1 below), the block ending where survival falls under 0.5
    bins = stop_bound.BINS
    rule = stop_bound.StopRule(tuple(0.1 if b < bins // 2 else 1.0 for b in range(bins)),
                               (0.5,) * 15)
    ruled = stop_bound.run(N, trace, Flat(), lambda p, i: stop_bound.by_rule(rule)(conf, p, i))
    assert ruled == pytest.approx(fixed)
    # never stopping before 16: 1-9 (2 accepted) → 4-9 (all six)
    assert stop_bound.run(N, trace, Flat(), lambda p, i: i + 1 >= 16) == pytest.approx(
        9 * 0.1 + 1 + 6 * 0.1 + 1)
    best = orc.least_seconds(N, {"draft": trace}, {"draft"}, Flat(), model="draft")
    assert best <= min(fixed, doubt) + 1e-12


def test_prices_pool_the_measured_forwards():
    class R:
        def __init__(self, by_n, draft_s, forwards):
            self.target_s_by_n, self.draft_s, self.draft_forwards = by_n, draft_s, forwards

    p = orc.Prices.of([R({1: [0.1, 0.3], 4: [0.5]}, 0.2, 4), R({1: [0.2], 8: 0.9}, 0.2, 6)])
    assert p(1) == pytest.approx(0.2) and p(4) == 0.5 and p(8) == 0.9
    assert p(6) == pytest.approx(0.7)  # linear between measured n
    assert p.t_draft == pytest.approx(0.04)
    assert orc.Prices.of([R({2: [0.1]}, 0, 0)]) is None  # no forward of one token


def test_what_each_mode_may_use():
    have = ("draft", "ngram", "suffix")
    assert orc.may_use("plain", have, "draft") == set()
    assert orc.may_use("autospec:3", have, "draft") == {"draft"}
    assert orc.may_use("ngram:4", have, "draft") == {"ngram"}
    assert orc.may_use("suffix:8", have, "draft") == {"suffix"}
    assert orc.may_use("policy:auto", have, "draft") == set(have)
    assert orc.may_use("suffix:8", ("draft", "ngram", "suffix"), "draft") == {"suffix"}
    assert orc.may_use("auto", ("ngram",), model=None) == {"ngram"}


def test_report_measures_each_policy_against_perfect_foresight(tmp_path):
    """``autospec report``'s section 7, from the store's traces: per policy the median of
    perfect foresight's time (its own traces, the proposers it may use) ÷ the request's."""
    import statistics

    import autospec
    from autospec.report import build_report, render_html, render_text
    from autospec.store import open_store, queries

    from conftest import noisy_copy, prompt, tiny

    target = tiny("llama", layers=2, seed=0, sharpen=30.0)
    draft = noisy_copy(target, 0.5)
    url = f"sqlite:///{tmp_path / 'f.db'}"
    for policy in ("fixed:3", "auto"):
        spec = autospec.Controller(target, draft, store=url, policy=policy, category="code")
        for seed in range(4):
            spec.generate(prompt(10, seed=seed), max_new_tokens=24, do_sample=False,
                          eos_token_id=None)
        spec.close()
    with open_store(url) as store:
        rep = build_report(store)
    (w,) = rep.workloads
    assert set(w.foresight) == {"fixed:3", "auto"}, w.foresight
    fixed = w.foresight["fixed:3"]
    assert fixed["requests"] == 4 and fixed["proposers"] == ["draft"]
    assert set(w.foresight["auto"]["proposers"]) >= {"draft", "ngram"}
    # by hand, for the fixed k: its requests' traces, the workload's pooled forwards
    with open_store(url) as store, store.session() as s:
        from autospec.store.tables import Request

        rows = list(s.query(Request).order_by(Request.id))
        s.expunge_all()
        props = queries.request_proposers(s, [r.id for r in rows])
    prices = orc.Prices.of(rows)
    want = statistics.median(
        (r.prefill_s + orc.least_seconds(r.new_tokens, {"draft": props[r.id]["draft"].trace},
                                         {"draft"}, prices, model="draft")) / r.wall_s
        for r in rows if r.policy == "fixed:3")
    assert fixed["share"] == pytest.approx(want)
    want = statistics.median(
        (r.prefill_s + orc.least_seconds(r.new_tokens, {"draft": props[r.id]["draft"].trace},
                                         {"draft"}, prices, model="draft"))
        / (r.prefill_s + orc.scheduled_seconds(r.target_s_by_n, r.draft_forwards, 0, prices))
        for r in rows if r.policy == "fixed:3")
    assert fixed["choices"] == pytest.approx(want) and 0 < fixed["choices"] <= 1 + 1e-9
    text, html = render_text(rep), render_html(rep)
    assert "7. foresight" in text and "choices" in text
    assert "perfect foresight" in html and "choices" in html
