"""One batch cost grid for every reader of the store: a new process's controller starts from
the grid the report shows and tune replays (``costgrid.batch_grid``: the probe's shape at the
level the loop's own batched forwards logged), not from the raw probe. A real SQLite store,
real tiny models wrapped by autospec."""

from __future__ import annotations

import pytest

import autospec
from autospec.costs.grid import batch_grid
from autospec.store import add_probe, open_store, queries, write_records
from autospec.store.record import RequestRecord
from autospec.telemetry import RequestTelemetry

from conftest import noisy_copy, tiny
from records import draft

BATCHES = (1, 4, 16)


def _probe_payload() -> dict:
    """A probe on which verification looks flat everywhere (T_t(B, n) ≈ 50 ms)."""
    flat = {b: {n: 0.05 * (1 + 0.01 * b * n) for n in range(1, 9)} for b in BATCHES}
    return {"path": "eager", "target_s_by_n": {str(n): t for n, t in flat[1].items()},
            "draft_s": 0.005,
            "grid": {str(b): {str(n): t for n, t in ns.items()} for b, ns in flat.items()},
            "draft_grid": {str(b): 0.005 for b in BATCHES}}


def _batched_row(pair, i: int, *, batch: int = 16, forwards: int = 16,
                 category: str = "code") -> RequestRecord:
    """One row of a logged batch of ``batch`` whose forwards (``forwards`` per point) say
    each scored token adds 0.8× one."""
    return RequestRecord(
        pair=pair, category=category, policy="auto", greedy=True, prompt_tokens=8,
        new_tokens=16, iterations=16, proposers=draft(trace=None), k_schedule=bytes(16),
        accepted_schedule=bytes(16), trace_kind="greedy", wall_s=1.0,
        prefill_s=0.01, draft_s=0.0, draft_forwards=0, target_s_by_n={},
        created_at=1_700_000_000.0 + i, batch_size=batch, path="eager",
        target_s_by_bn={(batch, n): [0.05 + 0.04 * (n - 1)] * forwards for n in range(1, 6)},
        draft_s_by_b={batch: [0.005] * forwards})


def test_a_new_controller_starts_from_the_grid_the_report_shows(tmp_path):
    target = tiny("llama", layers=1)
    draft = noisy_copy(target, 0.1)
    url = f"sqlite:///{tmp_path / 'grid.db'}"
    pair = RequestTelemetry(target, draft, measure_peak=False).pair
    with open_store(url) as store:
        with store.begin() as s:
            write_records(s, [_batched_row(pair, i) for i in range(2)])
            add_probe(s, queries.pair_id(s, pair), _probe_payload())
        with store.session() as s:
            pid = queries.pair_id(s, pair)
            raw, _, raw_source = queries.batch_costs(s, pid)
            grid, draft_grid, source = batch_grid(s, pid)
    assert raw_source == "probe" and source.startswith("probe at the live level")
    assert grid[16][3] == pytest.approx(0.13) and raw[16][3] == pytest.approx(0.074)
    ctrl = autospec.wrap(target, draft, store=url)
    try:
        ctrl._warm_batched("code")  # what the first batched call warms
        costs = ctrl.costs
        for b in (4, 16):  # where the probe and the live level differ: the live level
            got = costs.target_points("eager", b)
            assert got == pytest.approx({n: grid[b][n] for n in got})
            assert set(got) == set(grid[b])
        assert costs.target_points("eager", 16)[3] == pytest.approx(0.13)
        assert costs.draft_cost("eager", 16) == pytest.approx(draft_grid[16])
    finally:
        autospec.unwrap(target)
