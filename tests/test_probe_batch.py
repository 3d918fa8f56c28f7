"""The probe's batch dimension: T_t(B, n) and T_d(B) on a grid, stored for
``queries.batch_costs``; sparse n at large B; out of memory and the time budget end the grid
early; ``memory_bound_batch``; ``autospec probe --batch``. Tiny random-weight models."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch

from autospec import probe as probe_mod
from autospec.cli import main
from autospec.engine.runners import Forward, new_cache
from autospec.probe import SPARSE_N, ProbeResult, probe
from autospec.store import add_probe, open_store, queries
from autospec.telemetry import RequestTelemetry

from conftest import noisy_copy, tiny, tiny_tokenizer


@pytest.fixture(scope="module")
def models():
    target = tiny("llama", layers=2)
    return target, noisy_copy(target, 0.1)


def test_probe_grid_is_stored_and_batch_costs_return_it(models, tmp_path):
    res = probe(*models, context=16, max_n=4, repeats=1, batches=(1, 2, 4),
                cache_dir=str(tmp_path))
    assert sorted(res.grid) == [1, 2, 4] and sorted(res.draft_grid) == [1, 2, 4]
    assert all(sorted(row) == [1, 2, 3, 4] for row in res.grid.values())
    assert all(t > 0 for row in res.grid.values() for t in row.values())
    assert res.grid[1] == res.target_s_by_n and res.draft_grid[1] == res.draft_s
    assert res.grid_note == ""
    payload = res.to_dict()
    assert json.dumps(payload) and "memory_bound_batch" in payload
    with open_store(f"sqlite:///{tmp_path / 'p.db'}") as store:
        pair = RequestTelemetry(*models, measure_peak=False).pair
        with store.begin() as s:
            add_probe(s, pair, payload)
        with store.session() as s:
            target, draft, source = queries.batch_costs(s, queries.pair_id(s, pair))
    assert source == "probe"
    assert target == res.grid and draft == res.draft_grid  # floats survive JSON exactly
    assert target[1] == res.target_s_by_n


def test_a_replicated_cache_scores_every_row_as_the_single_row_does(models):
    """The grid's batches repeat one prefilled row: each row's logits must be batch 1's
    (so the probe times real batched verification, not garbage rows)."""
    target, _ = models
    ids = torch.randint(4, 90, (1, 12), generator=torch.Generator().manual_seed(3))
    extra = torch.randint(4, 90, (1, 5), generator=torch.Generator().manual_seed(4))
    fwd, base = Forward(target), new_cache(target)
    with torch.inference_mode():
        fwd(ids, base, 1)
        wide = probe_mod._replicate(base, 3)
        assert base.get_seq_length() == 12 and wide.layers[0].keys.shape[0] == 3
        one = fwd(extra, base, 5)  # [1, 5, V]
        three = fwd(extra.expand(3, -1), wide, 5)  # [3, 5, V]
    for row in range(3):
        torch.testing.assert_close(three[row], one[0], rtol=1e-4, atol=1e-5)


def test_large_batches_measure_the_sparse_n_and_the_loop_s_n_always(models):
    res = probe(models[0], None, context=8, max_n=16, repeats=1, batches=(1, 2, 4),
                dense_up_to=2)
    assert sorted(res.grid[1]) == list(range(1, 17)) == sorted(res.grid[2])
    assert sorted(res.grid[4]) == list(SPARSE_N)
    assert set(range(1, 10)) <= set(res.grid[4])  # n = k + 1 for every k the loop runs
    assert res.draft_grid == {} and res.draft_s is None


def test_out_of_memory_ends_the_grid_and_is_logged(models, monkeypatch, caplog):
    real = probe_mod._replicate

    def replicate(cache, batch):
        if batch >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(cache, batch)

    monkeypatch.setattr(probe_mod, "_replicate", replicate)
    with caplog.at_level(logging.WARNING, logger="autospec.probe"):
        res = probe(*models, context=8, max_n=3, repeats=1, batches=(1, 2, 4, 8))
    assert sorted(res.grid) == [1, 2] and sorted(res.draft_grid) == [1, 2]
    assert "out of memory at B = 4" in res.grid_note
    assert "out of memory at B = 4" in caplog.text

    def broken(cache, batch):
        raise RuntimeError("shape mismatch in attention")

    monkeypatch.setattr(probe_mod, "_replicate", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):  # not memory: not swallowed
        probe(*models, context=8, max_n=2, repeats=1, batches=(1, 2))


def test_the_time_budget_stops_adding_batch_sizes(models):
    res = probe(models[0], None, context=8, max_n=3, repeats=1, batches=(1, 2, 4),
                max_seconds=0.0)
    assert sorted(res.grid) == [1]  # batch 1 is always measured
    assert "budget" in res.grid_note


def _result(grid: dict[int, dict[int, float]]) -> ProbeResult:
    return ProbeResult(hardware="cpu", dtype="float32", context=8, target_s_by_n=grid[1],
                       draft_s=None, target_param_bytes=1, kv_bytes=1,
                       achieved_bytes_per_s=1.0, peak_bytes_per_s=None, threads=1, grid=grid)


def test_memory_bound_batch_is_the_last_batch_before_verification_gets_costly():
    flat = {1: 1.0, 2: 1.0, 4: 1.05}
    res = _result({1: flat, 2: flat, 4: {1: 1.0, 4: 1.2}, 8: {1: 1.0, 4: 2.0},
                   16: {1: 1.0, 4: 1.1}})  # 16 is back under the ratio: noise, not trusted
    assert res.memory_bound_batch() == 4
    assert res.memory_bound_batch(n=4, ratio=1.1) == 2
    assert res.memory_bound_batch(n=4, ratio=3.0) == 16
    assert res.memory_bound_batch(n=2) == 2  # n = 2 measured at B = 1, 2 only
    assert _result({1: {1: 1.0, 4: 1.5}}).memory_bound_batch() is None
    assert res.batch_ratios(8) == {1: 1.0, 4: 2.0} and res.batch_ratios(32) == {}


def test_probe_cli_prints_the_grid_and_stores_it(models, tmp_path, capsys):
    tok = tiny_tokenizer()
    for name, model in zip(("target", "draft"), models, strict=True):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    code = main(["probe", "--target", str(tmp_path / "target"), "--draft",
                 str(tmp_path / "draft"), "--dtype", "fp32", "--threads", "1", "--context", "8",
                 "--max-n", "4", "--repeats", "1", "--batch", "1,2", "--db", url])
    assert code == 0
    out = capsys.readouterr().out
    assert "T_t(B,1) ms" in out and "n=4" in out and "T_d(B) ms" in out
    assert "within 1.25x of one token" in out
    with open_store(url) as store, store.session() as s:
        (pair,) = queries.pairs(s)
        target, draft, source = queries.batch_costs(s, pair.id)
    assert source == "probe" and sorted(target) == [1, 2] and sorted(draft) == [1, 2]
    assert sorted(target[2]) == [1, 2, 3, 4]


@pytest.mark.parametrize("bad", ["0,2", "1,x", ","])
def test_probe_cli_refuses_bad_batch_sizes(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["probe", "--batch", bad, "--no-store"])
    assert exit_.value.code == 2
    assert "batch size" in capsys.readouterr().err


def test_probe_cli_times_the_grid_at_the_traffics_median_context(models, tmp_path, capsys):
    """Without --context the probe reads the pair's logged requests: the grid is timed at
    their median context (prompt + half the new tokens), not at a fixed 200 tokens."""
    from transformers import AutoModelForCausalLM

    import autospec

    tok = tiny_tokenizer()
    dirs = {}
    for name, model in zip(("target", "draft"), models, strict=True):
        dirs[name] = str(tmp_path / name)
        model.save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    url = f"sqlite:///{tmp_path / 'traffic.db'}"
    torch.set_num_threads(1)  # the hardware string (part of the pair) names the threads
    target = AutoModelForCausalLM.from_pretrained(dirs["target"], dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(dirs["draft"], dtype=torch.float32)
    autospec.wrap(target, draft, store=url, policy=2)
    lengths = (5, 9, 30)  # prompt tokens; 6 new each: contexts 8, 12, 33 -> median 12
    try:
        for n in lengths:
            ids = torch.randint(4, 90, (1, n), generator=torch.Generator().manual_seed(n))
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             min_new_tokens=6, do_sample=False, category="code")
    finally:
        autospec.unwrap(target)
    with open_store(url) as store, store.session() as s:
        (pair,) = queries.pairs(s)
        assert queries.traffic_context(s, pair.id) == 12
        assert queries.traffic_context(s, 10**9) is None
    code = main(["probe", "--target", dirs["target"], "--draft", dirs["draft"], "--dtype",
                 "fp32", "--threads", "1", "--max-n", "2", "--repeats", "1", "--db", url])
    assert code == 0
    out = capsys.readouterr().out
    assert "context 12 tokens (the median context of this pair's logged requests)" in out
    with open_store(url) as store, store.session() as s:
        assert queries.latest_probe(s, pair.id).payload["context"] == 12
    # a store without this pair's traffic: the default, and it says so
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    assert main(["probe", "--target", dirs["target"], "--draft", dirs["draft"], "--dtype",
                 "fp32", "--threads", "1", "--max-n", "2", "--repeats", "1",
                 "--db", empty]) == 0
    assert "context 200 tokens (no logged requests for this pair: the default)" in \
        capsys.readouterr().out


def test_the_probe_times_the_drafts_catch_up_and_a_probe_only_store_prices_it(models, tmp_path):
    """The draft model's forward over g tokens it has not seen (and its first proposal) at each
    of CATCH_UP_SIZES; stored with the probe, it is the catch-up line a store with nothing
    logged yet gives a new process, so the first resumption is priced, not taken for free."""
    import autospec

    res = probe(*models, context=16, max_n=4, repeats=2, cache_dir=str(tmp_path))
    assert [g for g, _ in res.draft_catch_up] == list(probe_mod.CATCH_UP_SIZES)
    assert all(c > 0 for _, c in res.draft_catch_up)
    # the line of the points: exact on points that lie on one (timings are not asserted)
    line = replace(_result({1: {1: 1.0}}), draft_catch_up=[(8, 0.03), (32, 0.06), (128, 0.18)])
    assert line.catch_up_line == pytest.approx((0.02, 0.00125))
    assert _result({1: {1: 1.0}}).catch_up_line is None
    assert probe(models[0], None, context=16, max_n=2, repeats=1).draft_catch_up == []
    url = f"sqlite:///{tmp_path / 'p.db'}"
    pair = RequestTelemetry(*models, measure_peak=False).pair
    with open_store(url) as store:
        with store.begin() as s:
            add_probe(s, pair, res.to_dict())
        with store.session() as s:
            points, t_draft, source = queries.catch_up_source(s, queries.pair_id(s, pair))
    assert source == "probe" and t_draft == res.draft_s
    assert points == [tuple(p) for p in res.draft_catch_up]
    spec = autospec.Controller(*models, store=url, policy="fixed:2")
    spec.live_stats("any category")
    spec.close()
    from autospec.costs.table import CostTable

    live = spec.costs.at(spec.path)
    expected = CostTable().at(spec.path)
    expected.warm_catch_up(points)
    assert live.catch_up == pytest.approx(expected.catch_up) and live.catch_up[0] > 0
    assert live.catch_up_cost(100) is not None
    # a payload the probe did not write (or a broken one) prices nothing
    with open_store(url) as store:
        with store.begin() as s:
            add_probe(s, pair, {**res.to_dict(), "draft_catch_up": [["x", 1]]})
        with store.session() as s:
            assert queries.catch_up_source(s, queries.pair_id(s, pair)) == ([], None, "none")
