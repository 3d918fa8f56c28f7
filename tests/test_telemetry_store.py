"""Requests logged through the controller: what lands in the store, and the store never
changing or breaking generation."""

from __future__ import annotations

import sqlite3

import pytest
import torch

import autospec
from autospec.store import StoreError, open_store, queries
from autospec.tune.replay import replay_greedy

from conftest import noisy_copy, prompt, tiny, tiny_tokenizer


@pytest.fixture
def models():
    target = tiny("qwen2", sharpen=30.0)
    return target, noisy_copy(target, 0.15)


def test_requests_and_category_stats_land_in_the_store(models, tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    spec = autospec.Controller(*models, store=url)
    live = []
    for seed, (cat, k) in enumerate([("code", 2), ("code", 4), ("chat", 3)]):
        spec.generate(prompt(10, seed=seed), max_new_tokens=24, do_sample=False, k=k,
                      category=cat, eos_token_id=None)
        live.append((cat, spec.last_stats))
    spec.close()
    with open_store(url) as store, store.session() as s:
        sums = {sm.category: sm for sm in queries.category_summaries(s)}
        assert sums.keys() == {"code", "chat"}
        for cat in ("code", "chat"):
            mine = [st for c, st in live if c == cat]
            sm = sums[cat]
            assert sm.requests == len(mine)
            assert sm.new_tokens == sum(st.new_tokens for st in mine)
            assert sm.drafted == sum(st.drafted for st in mine)
            assert sm.accepted == sum(st.accepted for st in mine)
            # the timing fields are the pair's (costs once, per (pair, path)): every
            # category's batch-1 requests on the path, pooled
            assert sm.draft_forwards == sum(st.draft_forwards for _, st in live)
            assert sm.pair.target == type(models[0]).__name__ or sm.pair.target
        rows = queries.recent_requests(s, limit=10)
        assert len(rows) == 3 and all(r.prompt_text is None for r in rows)  # no text by default


def test_stored_trace_replays_to_the_accepted_lengths_seen_live(models, tmp_path):
    url = f"sqlite:///{tmp_path / 'b.db'}"
    spec = autospec.Controller(*models, store=url)
    ids = prompt(10, seed=5)
    spec.generate(ids, max_new_tokens=40, do_sample=False, k=3, eos_token_id=None)
    live = {}
    for k in (1, 2, 5, 8):
        spec.generate(ids, max_new_tokens=40, do_sample=False, k=k, eos_token_id=None)
        live[k] = spec.last_stats.accepted_schedule
    spec.close()
    with open_store(url) as store, store.session() as s:
        first = next(iter(queries.traces(s)))
    assert first.trace_kind == "greedy"
    for k, sched in live.items():
        replayed = replay_greedy(first.trace, k, max_new_tokens=40)
        assert replayed == sched[: len(replayed)] and len(replayed) >= len(sched) - 2


def test_store_outage_changes_nothing_in_the_output_and_is_counted(models, tmp_path):
    db = tmp_path / "locked.db"
    url = f"sqlite:///{db}"
    spec = autospec.Controller(*models, store=open_store(url, busy_timeout_s=0.05))
    reference = autospec.Controller(*models, store=False)
    blocker = sqlite3.connect(db, timeout=0.05, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # the database is locked for everyone else
    try:
        for seed in range(3):
            ids = prompt(9, seed=seed)
            out = spec.generate(ids, max_new_tokens=16, do_sample=False, k=3)
            assert torch.equal(out, reference.generate(ids, max_new_tokens=16, do_sample=False, k=3))
        spec.writer.flush(timeout=1.0)
        assert spec.writer.failures > 0 and spec.writer.written == 0
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert spec.writer.flush(timeout=30.0)  # retried after the outage: nothing lost
    assert spec.writer.written == 3
    spec.close()


def test_unusable_store_urls_fail_at_wrap_time(models):
    target, draft = models
    for url in ("postgresql+nosuchdriver://x@localhost/db", "notadialect://foo", "://"):
        with pytest.raises(StoreError):
            autospec.wrap(target, draft, store=url)
        assert "generate" not in vars(target)  # nothing was wrapped


def test_free_text_categories_round_trip(models, tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    spec = autospec.Controller(*models, store=url)
    names = ["it's \"quoted\"; DROP TABLE requests; --", "日本語のカテゴリ 🚀", "x" * 10_000]
    for name in names:
        spec.generate(prompt(), max_new_tokens=4, do_sample=False, category=name)
    spec.close()
    with open_store(url) as store, store.session() as s:
        assert {sm.category for sm in queries.category_summaries(s)} == set(names)


def test_text_is_stored_only_when_opted_in(models, tmp_path):
    url = f"sqlite:///{tmp_path / 'd.db'}"
    tok = tiny_tokenizer()
    spec = autospec.Controller(*models, store=url, log_text=True, tokenizer=tok)
    out = spec.generate(prompt(), max_new_tokens=6, do_sample=False)
    spec.close()
    with open_store(url) as store, store.session() as s:
        row = queries.recent_requests(s, limit=1)[0]
    assert row.output_text == tok.decode(out[0, 10:])
    assert row.prompt_text == tok.decode(out[0, :10])


def test_a_new_controller_warms_from_the_store_with_costs_from_one_source(tmp_path):
    """History warms acceptance; T_t(n) and T_d come from the probe when one is stored (never
    a probe/live mix), else only from live points with enough forwards behind them."""
    from autospec.store import add_probe

    url = f"sqlite:///{tmp_path / 'w.db'}"
    target = tiny("llama", sharpen=30.0)
    spec = autospec.Controller(target, target, store=url)  # the draft is the target: α = 1
    for _ in range(5):  # 5 × 5 verifications of 4 tokens after the prefill: ≥ 16
        spec.generate(prompt(), max_new_tokens=24, do_sample=False, k=3, eos_token_id=None)
    spec.close()
    fresh = autospec.Controller(target, target, store=url, policy="auto")
    live = fresh.live_stats("default")
    costs = fresh.costs.at(fresh.path)  # the pair's, on the controller's path, at batch 1
    fresh.close()
    assert live.acceptance("draft", 0)[0] > 0.9  # acceptance history carried over
    # no probe: T_t(4) (k = 3, dozens of forwards) counts; the prefill-sized ones do not
    assert 4 in costs.t_target and all(n != 1 for n in costs.t_target)
    with open_store(url) as store, store.begin() as s:
        add_probe(s, spec.telemetry.pair, {"path": "eager", "target_s_by_n": {"1": 0.01, "4": 0.011},
                                           "draft_s": 0.002})
    fresh = autospec.Controller(target, target, store=url, policy="auto")
    fresh.live_stats("default")
    costs = fresh.costs.at(fresh.path)
    fresh.close()
    assert costs.t_target == {1: 0.01, 4: 0.011} and costs.t_draft == 0.002


def test_a_batched_row_records_its_batch_size_and_timings_by_batch(models, tmp_path):
    from autospec.engine.stats import LoopStats
    from autospec.telemetry import RequestTelemetry

    tel = RequestTelemetry(*models, measure_peak=False)
    plain = LoopStats(new_tokens=3, iterations=1, k_schedule=[0], accepted_schedule=[0],
                      proposer_schedule=[None], model="draft",
                      traces={"draft": b"\xff\xff\xff"}, trace_kind="greedy",
                      wall_s=0.1, target_s_by_n={1: [0.01]}, target_forwards=[(10, 0.01)])
    row = LoopStats(new_tokens=3, iterations=1, k_schedule=[2], accepted_schedule=[2],
                    proposer_schedule=["draft"], model="draft",
                    traces={"draft": b"\x01\x01\xff"}, trace_kind="greedy",
                    wall_s=0.1, target_forwards=[(10, 0.02)])
    row.count_block("draft", 2, 2)
    # the batched loop's fields (LoopStats gains them with issue 10; set here either way)
    row.batch_size = 4
    row.target_s_by_bn = {(4, 3): [0.02], (2, 1): [0.015]}
    row.draft_s_by_b = {4: [0.003, 0.004]}
    recs = [tel.record(st, category="code", policy="fixed(2)", greedy=True)
            for st in (plain, row)]
    tel.close()
    assert recs[0].batch_size == 1 and not recs[0].target_s_by_bn
    assert recs[1].batch_size == 4 and recs[1].target_s_by_n == {}
    assert recs[1].bandwidth_bytes_per_s is not None  # from the row's own forwards
    with open_store(f"sqlite:///{tmp_path / 'batch.db'}") as store:
        store.write(recs)
        with store.session() as s:
            got = sorted(queries.recent_requests(s), key=lambda r: r.batch_size)
            (sm,) = queries.category_summaries(s)
    assert [r.batch_size for r in got] == [1, 4]
    assert got[1].target_s_by_bn == {(2, 1): [0.015], (4, 3): [0.02]}
    assert got[1].draft_s_by_b == {4: [0.003, 0.004]}
    assert sm.requests == 2 and sm.target_count_by_n == {1: 1}  # batch 1's forward only
    # counters count at every batch size: the batched row's block is the draft model's
    assert (sm.drafts, sm.drafted, sm.accepted) == (1, 2, 2)
    assert [r.proposer_schedule for r in got] == [[None], ["draft"]]
