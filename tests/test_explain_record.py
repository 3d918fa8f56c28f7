"""The cost model's decision record (``autospec/policies/explain.py``): every figure in it recomputes
from the record's own fields, and the choice it names follows from them by the policy's rules
— so `autospec explain` shows a reader why, not just what."""

from __future__ import annotations

import math

import pytest

from autospec.costs.price import expected_tokens
from autospec.costs.table import CostTable
from autospec.policies import Context, CostModelPolicy, LiveStats
from autospec.policies.base import proposer_of
from autospec.policies.explain import FORMAT, RULES


def _stats(alpha: float, ngram_alpha: float, t_draft: float = 0.02, table=None):
    """A probed category: the draft model at ``alpha`` and prompt lookup at ``ngram_alpha``
    per position (400 blocks each), and the pair's costs at batch 1 (of ``table``, else a
    fresh one): flat-then-rising T_t."""
    live = LiveStats()
    cum = [400 * alpha ** (i + 1) for i in range(8)]
    ngram = [400 * ngram_alpha ** (i + 1) for i in range(8)]
    live.warm_start({"draft": (cum, [400] * 8), "ngram": (ngram, [400] * 8)})
    costs = (CostTable() if table is None else table).at("eager")
    costs.warm(t_draft=t_draft, t_target={n: 0.2 * (1 + 0.03 * max(0, n - 4))
                                          for n in range(1, 18)},
               probe=True, t_lookup={"ngram": 1e-5})
    return live, costs


def bars_of(stop: dict) -> list[float]:
    """A stop rule's bars from its record: after token i + 1, the least seconds per expected
    token of drafting on to any later token j (docs/policy.md, "Where a block stops")."""
    extra, expect, worth = stop["extra_s"], stop["expect"], stop["worth_s"]
    bars = []
    for i in range(len(stop["bars"])):
        bars.append(min(sum(extra[i:j + 1]) / (worth * sum(
            math.prod(expect[i + 1:m + 2]) for m in range(i, j + 1)))
            for j in range(i, len(extra))))
    return bars


def recompute(record: dict) -> tuple[int, str]:
    """Check every candidate's figures against its own fields, then decide from them as the
    policy's one rule says: a proposer's block is in where some k beat a plain step by S (a
    record of a proposer whose k was 0 shows its best S, at most 1), a probe (acceptance from
    "perfect") where the rule named it; of the blocks whose S at the rate reaches 1 +
    min_gain, the one that saves the most seconds."""
    t1, value, min_gain = record["t_plain"], record["value"], record["min_gain"]
    v = t1 if value is None else value
    best = None  # (saved, k, proposer)
    for c in record["candidates"]:
        k, tokens, block, extra = c["k"], c["tokens"], c["block_s"], c["extra_s"]
        if c["proposer"] == "plain":
            assert (k, tokens, c["spt"]) == (0, 1.0, t1)
            continue
        assert len(c["acceptance"]) == k
        assert tokens == pytest.approx(expected_tokens(c["acceptance"], k))
        assert block == pytest.approx(k * c["t_propose"] + c["t_verify"])
        assert c["spt"] == pytest.approx((block + tokens * extra) / tokens)
        dear = block + tokens * extra
        plain_s = tokens * t1 / dear  # S as k was chosen by
        valued = plain_s if value is None else (t1 + (tokens - 1) * v) / dear
        assert c["speedup"] == pytest.approx(valued)
        assert c["saved_s"] == pytest.approx(t1 + (tokens - 1) * v - dear - c["induced_s"])
        if c["acceptance_from"] == "perfect":
            if record["rule"] != "explore":
                continue  # offered, and beaten by a block of the evidence
        elif plain_s <= 1 or valued < 1 + min_gain:
            continue
        if best is None or c["saved_s"] > best[0]:
            best = (c["saved_s"], k, c["proposer"])
    return (best[1], best[2]) if best else (0, "plain")


@pytest.mark.parametrize("alpha, ngram_alpha, match, min_gain", [
    (0.8, 0.3, 0, 0.0),   # the draft model alone
    (0.8, 0.95, 6, 0.0),  # a long prompt-lookup match beside a good draft model
    (0.05, 0.5, 1, 0.0),  # a draft model that cannot pay and a chance match
    (0.8, 0.95, 6, 9.0),  # nothing pays by a gain of 9: off
])
def test_the_record_reproduces_the_decision(alpha, ngram_alpha, match, min_gain):
    live, costs = _stats(alpha, ngram_alpha)
    policy = CostModelPolicy(min_gain=min_gain)
    why: list = []
    ctx = Context(category="code", k_max=8, live=live, costs=costs, remaining=200,
                  proposers=("draft", "ngram"), matches={"ngram": (match,)}, why=why)
    k = policy.choose(ctx)
    assert len(why) == 1
    record = why[0]
    assert record["format"] == FORMAT and record["rule"] in RULES
    proposer = (proposer_of(k)[0] or "draft") if k else "plain"
    assert (record["k"], record["proposer"]) == (int(k), proposer)
    assert record["rule"] == ("best" if k else "off")
    stop = record["stop"]
    priced = int(k) if stop is None else stop["priced_k"]
    assert recompute(record) == (priced, proposer)
    assert (priced, proposer) == {0.0: (5, "draft") if not match else (k, "ngram"),
                                  9.0: (0, "plain")}[min_gain]
    if stop is not None:  # the priced block runs on to where one more token stops paying
        assert proposer == "draft" and int(k) == 8  # k_max
        assert len(stop["bars"]) == int(k) - 1
        assert stop["bars"] == pytest.approx(bars_of(stop))
    names = [c["proposer"] for c in record["candidates"]]
    assert names == ["plain", "draft"] + (["ngram"] if match else [])
    draft = record["candidates"][1]
    assert draft["acceptance_from"] == "live" and draft["costs_from"] == "probe"
    assert draft["acceptance"] == pytest.approx([alpha] * draft["k"], abs=0.02)


def test_the_record_names_each_rule_that_is_not_the_cost_model():
    policy, why = CostModelPolicy(), []
    assert policy.choose(Context(k_max=8, live=LiveStats(), why=why)) == 0
    live, costs = LiveStats(), CostTable().at("eager")
    for _ in range(3):
        live.observe(0, 0, 0.0, 0.2)
        costs.observe(0, 0.2)
    assert policy.choose(Context(k_max=8, live=live, costs=costs, why=why)) == 3  # T_d unknown
    assert policy.choose(Context(k_max=8, why=why)) == 3  # no statistics
    assert [r["rule"] for r in why] == ["baseline", "explore", "no-stats"]
    assert [r["k"] for r in why] == [0, 3, 3]


def test_nobody_asking_builds_no_record():
    live, costs = _stats(0.8, 0.5)
    ctx = Context(category="code", k_max=8, live=live, costs=costs, remaining=200)
    asked = Context(category="code", k_max=8, live=live, costs=costs, remaining=200, why=[])
    assert CostModelPolicy().choose(ctx) == CostModelPolicy().choose(asked) > 0
    assert ctx.why is None and len(asked.why) == 1


def test_a_batch_decision_is_recorded_with_its_rule():
    table = CostTable(live=False)
    live, _ = _stats(0.8, 0.3, table=table)
    table.warm_grid("eager", {b: {n: 0.25 * b ** 0.2 * (1 + 0.05 * max(0, n - 3))
                                  for n in range(1, 18)} for b in (1, 2)}, {1: 0.02, 2: 0.03})
    why: list = []
    ctx = Context(category="code", k_max=8, batch_size=2, live=live, rows=(live, live),
                  categories=("code", "code"), costs=table.at("eager", 2), remaining=100,
                  remaining_rows=(100, 100), why=why)
    k = CostModelPolicy().choose(ctx)
    assert len(why) == 1 and why[0]["batch"] == 2 and why[0]["k"] == int(k)
    assert why[0]["rule"] == ("best" if k else "off")
    draft = [c for c in why[0]["candidates"] if c["proposer"] == "draft"]
    if k:
        assert draft and draft[0]["k"] == int(k) and math.isfinite(draft[0]["spt"])


def test_the_worked_example_in_the_docs_is_what_the_policy_does():
    """docs/policy.md, "A worked example": its table of the draft model's blocks and the two
    decisions it predicts are the policy's own figures."""
    import pathlib
    import re

    from autospec.costs.price import speedup

    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "policy.md").read_text()
    example = doc.split("### A worked example", 1)[1].split("\n## ", 1)[0]
    rows = [[float(x) for x in line.strip("|").split("|")]
            for line in example.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) == 5
    t = {n: 0.220 if n <= 4 else 0.220 + 0.015 * (n - 4) for n in range(1, 10)}
    live, costs = LiveStats(), CostTable().at("eager")
    live.warm_start({"draft": ([400 * 0.75 ** (i + 1) for i in range(8)], [400] * 8),
                     "ngram": ([400 * 0.9 ** (i + 1) for i in range(8)], [400] * 8)})
    costs.warm(t_draft=0.030, t_target=t, probe=True, t_lookup={"ngram": 0.0001})
    curve, cost = live.curve("draft", 8), costs.cost(optimistic=True)
    for k, tokens, block, spt, s in rows:
        k = int(k)
        assert expected_tokens(curve, k) == pytest.approx(tokens, abs=5e-4)
        assert k * 0.030 + cost(k + 1) == pytest.approx(block, abs=5e-4)
        assert (k * 0.030 + cost(k + 1)) / expected_tokens(curve, k) == pytest.approx(spt,
                                                                                       abs=5e-5)
        assert speedup(k, curve, 0.030, cost) == pytest.approx(s, abs=5e-4)
    policy = CostModelPolicy()
    picks = []
    for match in (0, 4):
        why: list = []
        k = policy.choose(Context(category="code", k_max=8, live=live, costs=costs,
                                  remaining=100, proposers=("draft", "ngram"),
                                  matches={"ngram": (match,)}, why=why))
        stop = why[0]["stop"]
        picks.append((int(k), stop and stop["priced_k"], why[0]["proposer"], round(max(
            c["saved_s"] for c in why[0]["candidates"]), 3)))
    # the draft's block, priced at k = 3, runs on to k_max while its tokens pay
    assert picks == [(8, 3, "draft", 0.290), (8, None, "ngram", 1.032)]
    rule = policy.choose(Context(category="code", k_max=8, live=live, costs=costs,
                                 remaining=100, proposers=("draft", "ngram"),
                                 matches={"ngram": (0,)})).stop
    assert [round(b, 2) for b in rule.bars] == [0.35, 0.35] + [0.53] * 5
    assert rule.step(1, rule.step(0, 1.0, round(254 * 0.5)), round(254 * 0.35)) == (
        pytest.approx(0.55 * 0.35))
    assert "bars 0.35, 0.35 after tokens 1 and 2" in example and "stops the block at 2" in example
    assert "**k = 3**" in example and "**prompt lookup at k = 8**" in example


@pytest.mark.parametrize("left, ngram_alpha", [((100, 100), 0.5), ((100, 8), 0.5),
                                               ((100, 100), 0.95), ((60, 60, 60, 5), 0.3)])
def test_a_batch_record_recomputes_from_its_own_fields(left, ngram_alpha):
    """At batch B the record is batch 1's in batch tokens: a candidate's ``tokens`` are what
    the rows' finish counts — Σ E[N_i] over the rows where a lookup's rows gain alike, less
    for the draft's (plain decoding's: B) —, its S is (T_t(B, 1) + (tokens − B) · value) / C and it
    saves T_t(B, 1) + (tokens − B) · value − C; the block that runs is, of those whose S
    reaches 1 + min_gain, the one that saves the most — all from the record's own fields."""
    batch = len(left)
    table = CostTable(live=False)
    live, _ = _stats(0.8, ngram_alpha, table=table)
    table.warm_grid("eager", {b: {n: 0.25 * b ** 0.2 * (1 + 0.05 * max(0, n - 3))
                                  for n in range(1, 18)} for b in (1, 2, 4)},
                    {1: 0.02, 2: 0.03, 4: 0.04})
    why: list = []
    k = CostModelPolicy().choose(Context(
        category="code", k_max=8, batch_size=batch, rows=(live,) * batch,
        categories=("code",) * batch, costs=table.at("eager", batch), remaining=max(left),
        remaining_rows=left,
        proposers=("draft", "ngram"), matches={"ngram": (4,) * batch}, why=why))
    (record,) = why
    t1, v, gain = record["t_plain"], record["value"], record["min_gain"]
    assert record["batch"] == batch and record["rule"] in ("best", "off")
    plain, *blocks = record["candidates"]
    assert (plain["proposer"], plain["tokens"], plain["spt"]) == ("plain", batch, t1 / batch)
    assert {c["proposer"] for c in blocks} == {"draft", "ngram"}
    best = None
    for c in blocks:
        # Σ E[N_i] where every row gains alike: a lookup matching every row; the draft where
        # every row has as many tokens left counts less (its S is the rows' finish ratio, the
        # call waiting for its unluckiest row)
        alike = batch * expected_tokens(c["acceptance"], c["k"])
        if c["proposer"] == "ngram":
            assert c["tokens"] == pytest.approx(alike)
        elif len(set(left)) == 1:
            assert c["tokens"] < alike
        assert c["block_s"] == pytest.approx(c["k"] * c["t_propose"] + c["t_verify"])
        dear = c["block_s"] + c["tokens"] * c["extra_s"]
        assert c["speedup"] == pytest.approx((t1 + (c["tokens"] - batch) * v) / dear)
        assert c["saved_s"] == pytest.approx(t1 + (c["tokens"] - batch) * v - dear
                                             - c["induced_s"])
        if c["speedup"] >= 1 + gain and (best is None or c["saved_s"] > best["saved_s"]):
            best = c
    assert (int(k), getattr(k, "proposer", "draft") if k else "plain") == (
        (best["k"], best["proposer"]) if best else (0, "plain"))
