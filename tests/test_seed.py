"""A category nobody has seen starts from what the pair already knows (``LiveStats.seed_from``):
its other categories' acceptance pooled, at ``cold_start`` blocks' weight, which the
category's own evidence then outweighs — in the controller and in replay alike."""

from __future__ import annotations

import random

import pytest

import autospec
from autospec.costs.table import CostTable
from autospec.policies import Context, CostModelPolicy, LiveStats
from autospec.policies.stopping import BINS
from autospec.tune.replay import simulate

from conftest import noisy_copy, prompt, tiny
from test_replay_equals_live import COSTS


def _blocks(live: LiveStats, n: int, alpha: float, k: int = 4, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        m = 0
        while m < k and rng.random() < alpha:
            m += 1
        live.observe(k, m, 0.04, 0.1)


def test_a_new_category_starts_from_the_pooled_acceptance_at_cold_start_weight():
    code, chat = LiveStats(discount=1.0), LiveStats(discount=1.0)
    _blocks(code, 300, 0.9)
    _blocks(chat, 100, 0.5, seed=1)
    code.observe_confidence("draft", [(250, 1.0)] * 30 + [(40, 0.0)] * 10)
    new = LiveStats(discount=1.0)
    assert new.seed_from([code, chat]) == pytest.approx(8.0)  # cold_start
    acc = new.by_proposer["draft"]
    pooled = [(a + b) / (c + d) for a, b, c, d in list(zip(
        code.by_proposer["draft"].accepted, chat.by_proposer["draft"].accepted,
        code.by_proposer["draft"].reached, chat.by_proposer["draft"].reached))[:4]]
    assert [a / r for a, r in zip(acc.accepted[:4], acc.reached[:4])] == pytest.approx(pooled)
    assert acc.reached[0] == pytest.approx(8.0) and new.blocks("draft") == pytest.approx(8.0)
    # the draft's calibration comes along, at the same scale
    scale = 8.0 / 400
    assert acc.by_confidence[1][9] == pytest.approx(30 * scale)
    assert acc.by_confidence[1][1] == pytest.approx(10 * scale)
    assert sum(acc.by_confidence[1]) == pytest.approx(40 * scale)
    assert len(acc.by_confidence[0]) == BINS
    # the category's own evidence outweighs the seed
    _blocks(new, 200, 0.3, seed=2)
    assert new.curve("draft", 1)[0] == pytest.approx(0.3, abs=0.06)
    # nothing known: nothing seeded
    assert LiveStats().seed_from([LiveStats()]) == 0.0


def _timed(live: LiveStats, category: str, forecast=None) -> Context:
    costs = CostTable().at("eager")
    costs.warm(t_draft=0.02, t_target={n: 0.1 for n in range(1, 18)})
    return Context(category=category, k_max=8, live=live, costs=costs, remaining=200,
                   predicted_alpha=forecast)


def test_pooled_evidence_outweighs_a_pessimistic_forecast_for_a_new_category():
    """A new category's request forecast at 5 % acceptance decoded plainly until its own
    blocks outweighed the forecast (a math request ran k = 0 for 21 iterations at 0.75);
    with the pair's other categories drafting at 0.8, it drafts from its first step."""
    other = LiveStats()
    _blocks(other, 200, 0.8)
    policy = CostModelPolicy(stop_rule=False)
    alone = LiveStats()
    assert policy.choose(_timed(alone, "math", forecast=0.05)) == 0
    seeded = LiveStats()
    seeded.seed_from([other])
    assert policy.choose(_timed(seeded, "math", forecast=0.05)) > 0


def test_the_controller_and_replay_seed_a_new_category_alike(tmp_path):
    target = tiny("llama", layers=2, seed=5, sharpen=30.0)
    spec = autospec.Controller(target, noisy_copy(target, 0.1), store=False, policy="fixed:3")
    spec.generate(prompt(8, seed=1), max_new_tokens=30, do_sample=False, eos_token_id=None,
                  category="code")
    first = spec.live["code"]
    new = spec.live_stats("chat")
    got = new.by_proposer["draft"]
    assert got.reached[0] == pytest.approx(min(8.0, first.by_proposer["draft"].reached[0]))
    assert got.accepted[0] / got.reached[0] == pytest.approx(
        first.by_proposer["draft"].accepted[0] / first.by_proposer["draft"].reached[0])
    # replay: the second category of a log starts from the first's, as the controller does
    # (its one request is empty: what it holds is its start)
    lives: dict = {}
    cats = iter(["code", "chat"])
    simulate([("greedy", bytes([1, 1, 0, 1] * 8)), ("greedy", b"")], CostModelPolicy(), COSTS,
             category=lambda row: next(cats), live=lives)
    want = LiveStats()
    assert want.seed_from([lives["code"]]) > 0
    assert lives["chat"].by_proposer["draft"].reached == want.by_proposer["draft"].reached
    assert lives["chat"].by_proposer["draft"].accepted == want.by_proposer["draft"].accepted


def test_a_stored_category_is_not_seeded(tmp_path):
    """Where the store holds the category's history, that history is its start."""
    target = tiny("llama", layers=2, seed=5, sharpen=30.0)
    url = f"sqlite:///{tmp_path / 's.db'}"
    spec = autospec.Controller(target, noisy_copy(target, 0.1), store=url, policy="fixed:3")
    for cat in ("code", "chat"):
        spec.generate(prompt(8, seed=2), max_new_tokens=80, do_sample=False, eos_token_id=None,
                      category=cat)
    spec.close()
    again = autospec.Controller(target, noisy_copy(target, 0.1), store=url, policy="fixed:3")
    again.live_stats("code")
    chat = again.live_stats("chat")  # stored: its own history, not the pool of "code"
    assert chat.by_proposer["draft"].reached[0] > 2 * 8.0  # more than a seed's weight
    again.close()


def test_a_new_process_reads_how_long_a_categorys_requests_ran_from_the_store(tmp_path):
    """``LiveStats.expected_left`` starts from the category's logged requests (new tokens, and
    whether their cap stopped them), oldest first, so the first batch of a new process does not
    hold every row to its ``max_new_tokens``."""
    target = tiny("llama", layers=2, seed=5, sharpen=30.0)
    url = f"sqlite:///{tmp_path / 's.db'}"
    spec = autospec.Controller(target, noisy_copy(target, 0.1), store=url, policy="fixed:3")
    ran = []
    for seed, eos in ((2, None), (4, [73]), (9, [89])):
        spec.generate(prompt(8, seed=seed), max_new_tokens=30, do_sample=False,
                      eos_token_id=eos, category="code")
        st = spec.last_stats
        ran.append((st.new_tokens, st.stop_reason == "max_new_tokens"))
    spec.close()
    assert (30, True) in ran and any(not capped for _, capped in ran)  # both kinds logged
    again = autospec.Controller(target, noisy_copy(target, 0.1), store=url, policy="fixed:3")
    assert list(again.live_stats("code").lengths) == ran
    assert list(again.live_stats("chat").lengths) == []  # nothing of it logged
