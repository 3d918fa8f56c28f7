"""A draft-model block stops where one more token stops paying, by the draft's confidence
(``autospec.policies.stopping``): the rule's figures by hand, its calibration, the same stop
live and in replay, and output exactly the target's, greedy and sampled."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autospec
from autospec.engine.proposers.draft_model import replay_block
from autospec.policies import Choice, CostModelPolicy, LiveStats
from autospec.policies.stopping import BINS, StopRule, bin_of, calibrated, stop_rule
from autospec.store import open_store, queries
from autospec.traces import TRACE_GREEDY, UNOBSERVED
from autospec.tune.replay import simulate

from conftest import noisy_copy, prompt, tiny
from test_replay_equals_live import COSTS, _same_counts
from test_sampled_exact import V, exact_joint
from test_verify import ALPHA, _chi2_pvalue


def test_bins_cover_the_stored_bytes():
    assert [bin_of(c) for c in (0, 25, 26, 126, 127, 228, 229, 254)] == [0, 0, 1, 4, 5, 8, 9, 9]


def test_calibration_starts_at_the_bin_centres_and_follows_its_counts():
    zeros = [0.0] * BINS
    assert calibrated(zeros, zeros) == pytest.approx([(b + 0.5) / BINS for b in range(BINS)])
    hits, seen = list(zeros), list(zeros)
    hits[9], seen[9] = 18.0, 18.0  # a confident draft always right
    hits[2], seen[2] = 0.0, 8.0  # an unsure one never
    got = calibrated(hits, seen)
    assert got[9] == pytest.approx((0.95 * 2 + 18) / 20)
    # 0.25 · 2 / 10 = 0.05 alone, below bin 1's prior 0.15: the two pooled
    assert got[1] == got[2] == pytest.approx((0.15 * 2 + 0.25 * 2) / 12)
    # more confident is never read as less often right: bins 4 and 5 out of order are pooled
    hits, seen = list(zeros), list(zeros)
    hits[4], seen[4], hits[5], seen[5] = 9.0, 10.0, 1.0, 10.0
    got = calibrated(hits, seen)
    assert all(a <= b for a, b in zip(got, got[1:]))
    assert got[4] == got[5] == pytest.approx(((0.45 + 0.55) * 2 + 10) / 24)


def test_bars_price_one_more_token_by_hand():
    # T_d = 0.1, T_t(n) = 1 + 0.05 n, a token worth 0.8 s, acceptance 0.9 then 0.6
    rule = stop_rule([0.5] * BINS, [0.9, 0.9, 0.6], 0.1, lambda n: 1 + 0.05 * n, 0.8, 5)
    assert rule.bars == pytest.approx([0.15 / (0.8 * 0.9), 0.15 / (0.8 * 0.6),
                                       0.15 / (0.8 * 0.6), 0.15 / (0.8 * 0.6)])
    assert rule.longest == 5
    # verification that grows by 1 s a token from n = 4: no confidence pays for token 3
    steep = stop_rule([0.5] * BINS, [0.9] * 8, 0.1,
                      lambda n: 1 + 0.05 * n + (1.0 * (n - 3) if n > 3 else 0), 0.8, 8)
    assert len(steep.bars) == 2 and steep.bars[-1] >= 1 and steep.longest == 2
    # a step in T_t (at n = 3, as a GPU's tile fills): the second token alone costs 0.41 s
    # for 0.8 of a token, but it buys the cheap ones after it — the bar counts them
    step = stop_rule([0.5] * BINS, [0.8] * 8, 0.01, lambda n: 1.0 if n <= 2 else 1.4, 1.0, 8)
    best = min(sum(step.extra[:j]) / sum(0.8 ** m for m in range(1, j + 1))
               for j in range(1, 8))
    assert step.bars[0] == pytest.approx(best) and best < 0.2 < 0.41 / 0.8


def test_the_rule_multiplies_calibrated_acceptance_and_ignores_unobserved():
    accept = tuple((b + 0.5) / BINS for b in range(BINS))
    rule = StopRule(accept, (0.5, 0.5, 0.5))
    q = rule.step(0, 1.0, 254)
    assert q == pytest.approx(0.95) and not rule.stops(0, q)
    q = rule.step(1, q, 100)  # 0.95 · 0.35
    assert rule.stops(1, q)
    assert not rule.stops(3, 0.0)  # no bar past the last: the block's k ends it
    # a token whose confidence was not read counts at the category's acceptance there
    expecting = rule._replace(expect=(0.9, 0.6))
    assert expecting.step(1, 0.7, UNOBSERVED) == pytest.approx(0.42)
    assert expecting.step(5, 0.7, UNOBSERVED) == pytest.approx(0.42)  # past them: the last


def test_replay_stops_where_the_confidences_say():
    accept = tuple((b + 0.5) / BINS for b in range(BINS))
    rule = StopRule(accept, (0.5,) * 7)
    trace = bytes([1] * 10)
    conf = bytes([254, 254, 240, 60, 254, 254, 254, 254, 254, 254])
    # 0.95 · 0.95 · 0.95 = 0.857, then · 0.25: below the bar after the fourth token
    assert replay_block(TRACE_GREEDY, trace, 0, 8, confidence=conf, rule=rule) == (4, 4, False)
    # a rejection at the second token: past it the prefix's last confidence stands in
    trace = bytes([1, 0] + [1] * 8)
    assert replay_block(TRACE_GREEDY, trace, 0, 8, confidence=conf, rule=rule) == (8, 1, False)
    assert replay_block(TRACE_GREEDY, bytes([1] * 10), 0, 8, rule=rule) == (8, 8, False)


class Confident:
    """The draft model at k = 6, stopping by a fixed bar on the category's own calibration
    (which the accounting feeds, live and in replay alike), and a plain step now and then."""

    name = "confident"

    def choose(self, ctx):
        if ctx.request.iterations % 5 == 4:
            return 0
        return Choice(6, "draft", stop=StopRule(ctx.live.calibration("draft"), (0.45,) * 5))

    def update(self, ctx, k, outcome):
        pass


@pytest.fixture(scope="module")
def greedy_pair():
    target = tiny("llama", layers=2, seed=5, sharpen=30.0)
    return target, noisy_copy(target, 0.1)


def test_greedy_output_is_the_targets_and_blocks_stop_early(greedy_pair, tmp_path):
    target, draft = greedy_pair
    url = f"sqlite:///{tmp_path / 'live.db'}"
    spec = autospec.Controller(target, draft, store=url, policy=Confident())
    served, lengths = [], []
    for seed in range(4):
        ids = prompt(8, seed=seed)
        out = spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
        ref = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert torch.equal(out, ref)
        st = spec.last_stats
        served.append(st)
        lengths += [k for k, p in zip(st.k_schedule, st.proposer_schedule) if p == "draft"]
    # the rule stopped blocks short of 6 (not by the tokens left), and let others run whole
    assert any(0 < k < 6 for k in lengths[:-1]) and 6 in lengths
    live = spec.live["default"]
    hits, seen = live.by_proposer["draft"].by_confidence
    assert sum(seen) > 20 and 0 < sum(hits) < sum(seen)
    spec.close()
    # replay of the store: the same stops, the same counts, the same calibration
    with open_store(url) as store, store.session() as s:
        logged = list(queries.traces(s))
    replayed: dict = {}
    res = simulate(logged, Confident(), COSTS, live=replayed)
    assert [(st.k_schedule, st.accepted_schedule) for st in res.requests] == [
        (st.k_schedule, st.accepted_schedule) for st in served]
    _same_counts(live, replayed["default"])
    assert replayed["default"].by_proposer["draft"].by_confidence == (hits, seen)


def test_auto_runs_its_draft_blocks_to_where_the_next_token_stops_paying(greedy_pair,
                                                                          tmp_path):
    """``auto`` over logged traffic where the draft model pays (replay's costs: T_d 0.01 s
    against T_t 0.1 s): it prices the draft's block, then runs it to k_max under a rule
    whose bars its record reproduces, and the confidences end some blocks early."""
    target, draft = greedy_pair
    url = f"sqlite:///{tmp_path / 'log.db'}"
    spec = autospec.Controller(target, draft, store=url, policy=Confident())
    for seed in range(4):
        spec.generate(prompt(8, seed=seed), max_new_tokens=40, do_sample=False,
                      eos_token_id=None)
    spec.close()
    with open_store(url) as store, store.session() as s:
        logged = list(queries.traces(s))
    auto = CostModelPolicy(name="auto")
    chosen: list = []

    class Recording:
        name = "recording"

        def choose(self, ctx):
            why: list = []
            chosen.append((auto.choose(dataclasses.replace(ctx, why=why)), ctx.remaining, why))
            return chosen[-1][0]

        def update(self, ctx, k, outcome):
            auto.update(ctx, k, outcome)

    res = simulate(logged, Recording(), COSTS, k_max=8)
    ruled = [(c, left, why[0]) for c, left, why in chosen if getattr(c, "stop", None)]
    assert len(ruled) > len(chosen) // 2
    for c, _left, record in ruled:
        stop = record["stop"]
        assert int(c) == c.stop.longest <= 8 and stop["bars"] == list(c.stop.bars)
        assert stop["worth_s"] == pytest.approx(next(
            x["spt"] for x in record["candidates"]
            if x["proposer"] == "draft" and x["k"] == stop["priced_k"]))
    drafted = [k for st in res.requests for k, p in zip(st.k_schedule, st.proposer_schedule)
               if p == "draft"]
    assert any(0 < k < 7 for k in drafted) and max(drafted) == 8


def second_and_third(model, ids: torch.Tensor) -> torch.Tensor:
    """P(t2, t3) as ``model.generate`` samples them (top_k 0), enumerated from its own scores:
    P(t1, t2) (``exact_joint``) times P(t3 | t1, t2), read at step 3 of one batch row per
    (t1, t2) forced to emit them (``prefix_allowed_tokens_fn``), summed over t1: [V, V]."""
    L = ids.shape[1]
    pairs = [(a, b) for a in range(V) for b in range(V)]

    def force(row: int, seq: torch.Tensor) -> list[int]:
        t = seq.shape[-1] - L
        return [pairs[row][t]] if t < 2 else list(range(V))

    with torch.no_grad():
        out = model.generate(ids.repeat(len(pairs), 1), max_new_tokens=3, do_sample=True,
                             top_k=0, prefix_allowed_tokens_fn=force, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    first_two = exact_joint(model, ids, top_k=0).double()  # P(t1, t2)
    third = out.scores[2].double().softmax(-1)  # row (t1, t2): P(t3 | t1, t2), unforced
    law = torch.zeros(V, V, dtype=torch.float64)
    for row, (a, b) in enumerate(pairs):
        law[b] += first_two[a, b] * third[row]
    return law.float()


def test_sampled_tokens_keep_the_targets_law_when_blocks_stop():
    """The first block drafts tokens 1, 2 and 3. The draft's confidence in token 1 (from the
    prompt) is 0.27, in token 2 0.22-0.55 by the token 1 it sampled: where it is below 0.3 the
    block stops after token 2 (0.1 · 0.1 under the bar of 0.05), else it drafts token 3. The
    stop reads the draft's own distribution only, so tokens 2 and 3 still follow generate's
    law; the same counts reject the draft's law."""
    target = tiny("llama", vocab=V, sharpen=4.0, seed=3)
    draft = noisy_copy(target, 2.0, seed=4)
    accept = (0.1,) * 3 + (0.9,) * (BINS - 3)

    class Stopping:
        name = "stopping"

        def choose(self, ctx):
            return Choice(3, "draft", stop=StopRule(accept, (0.0, 0.05)))

        def update(self, ctx, k, outcome):
            pass

    spec = autospec.Controller(target, draft, store=False, policy=Stopping())
    ids = prompt(6, seed=1, vocab=V)
    g = torch.Generator().manual_seed(21)
    counts = torch.zeros(V * V, dtype=torch.long)
    firsts = []
    for _ in range(2000):
        out = spec.generate(ids, max_new_tokens=4, do_sample=True, top_k=0, generator=g,
                            eos_token_id=None)
        counts[out[0, 7] * V + out[0, 8]] += 1
        firsts.append(spec.last_stats.k_schedule[0])
    # both ways happen often: the first block stopped after two tokens, and ran to three
    assert firsts.count(2) > 500 and firsts.count(3) > 500, (firsts.count(2), firsts.count(3))
    assert _chi2_pvalue(counts, second_and_third(target, ids).flatten()) > ALPHA
    assert _chi2_pvalue(counts, second_and_third(draft, ids).flatten()) < ALPHA


def test_live_stats_copy_keeps_the_calibration():
    live = LiveStats()
    live.observe_confidence("draft", [(254, 1.0), (30, 0.0), (30, 1.0)])
    hits, seen = live.by_proposer["draft"].by_confidence
    assert (hits[9], seen[9], hits[1], seen[1]) == (1.0, 1.0, 1.0, 2.0)
    twin = live.copy()
    assert twin.by_proposer["draft"].by_confidence == (hits, seen)
    assert twin.calibration("draft") == live.calibration("draft")
    live.observe_confidence("draft", [(254, 0.0)])
    assert twin.by_proposer["draft"].by_confidence[1][9] == 1.0  # independent
