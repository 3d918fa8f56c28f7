"""`autospec report` / `autospec stats` at batch: on a real SQLite store with a probe grid whose
verification is flat at small batch sizes and linear at large ones, the memory-bound batch
size, the crossover and the k per batch size shown in text, HTML and JSON equal what the cost
model gives when recomputed here, independently, from the synthetic grid and the requests'
acceptance; without a grid the report says what to run."""

from __future__ import annotations

import json
import random
import re
import xml.etree.ElementTree as ET
from dataclasses import replace
from html import unescape

import pytest
from test_report import FLAT, T0, accepted_run, check_formats, record

from autospec.report import build_report, render_html, render_json
from autospec.store import add_probe, add_tuned_params, open_store, write_records
from autospec.store.history import fixed_block_acceptance
from autospec.store.write import get_or_create_pair

from records import draft, trace_row

BATCHES = (1, 2, 4, 8, 16, 32)
BASE, SLOPE, FREE = 0.05, 0.004, 16  # T_t(B, n) = BASE + SLOPE · max(0, B·n − FREE)
K_MAX = 8  # the report's K_MAX (the records never run a larger k)
TABLE = {(1, 4): 3, (5, 8): 1, (9, None): 0}  # the tuned table stored for "code"
BATCH_COUNTS = {1: 30, 4: 12, 16: 32}  # logged requests per batch size


def t_target(b: int, n: int) -> float:
    """Flat while the batch scores at most FREE tokens in all, linear beyond."""
    return BASE + SLOPE * max(0, b * n - FREE)


def t_draft(b: int) -> float:
    return 0.005 + 0.0005 * b


def grid_payload() -> dict:
    return {"path": "eager", "target_s_by_n": {str(n): t_target(1, n) for n in range(1, 17)},
            "draft_s": t_draft(1),
            "grid": {str(b): {str(n): t_target(b, n) for n in range(1, 17)} for b in BATCHES},
            "draft_grid": {str(b): t_draft(b) for b in BATCHES}}


def requests(seed: int = 0):
    """ "code" on one pair: k = 4 throughout, α ≈ 0.8, at the batch sizes of BATCH_COUNTS."""
    rng = random.Random(seed)
    recs, t = [], T0
    for b, count in BATCH_COUNTS.items():
        for _ in range(count):
            t += 20
            ks = [4] * 8
            rec = record(FLAT, "code", ks, [accepted_run(rng, 4, 0.8) for _ in ks],
                         t_target=lambda n: t_target(1, n), t_draft=t_draft(1), created_at=t)
            if b > 1:  # batched rows keep their forwards out of batch 1's curve
                rec = replace(rec, batch_size=b, target_s_by_n={}, draft_s=0.0,
                              target_s_by_bn={(b, 5): [t_target(b, 5)] * len(ks)})
            recs.append(rec)
    return recs


def acceptance(recs) -> list[float]:
    """The acceptance a fixed k is priced at: P(i accepted | i − 1 accepted) in a block from
    any position of the batch-1 rows' greedy draft traces (``history.fixed_block_acceptance``,
    counted by hand in tests/test_fixed_block.py), up to the last position a run reached."""
    rows = [trace_row("greedy", r.proposers["draft"].trace, batch_size=r.batch_size,
                      new_tokens=r.new_tokens) for r in recs]
    got = fixed_block_acceptance(rows, limit=len(rows))
    return [a for a in got if a is not None]


def expected_k(alphas: list[float], b: int) -> tuple[int, float]:
    """argmax_k of B·E[N](k)/(k·T_d(B) + T_t(B, k+1)) over B/T_t(B, 1), from the formula
    (rates past the measured positions: the last one; ties: the smallest k; k = 0: 1)."""
    best, best_s = 0, 1.0
    for k in range(1, K_MAX + 1):
        en = 1.0 + sum(_prod(alphas, i) for i in range(1, k + 1))
        s = (b * en / (k * t_draft(b) + t_target(b, k + 1))) / (b / t_target(b, 1))
        if s > best_s + 1e-12:
            best, best_s = k, s
    return best, best_s


def _prod(alphas: list[float], i: int) -> float:
    out = 1.0
    for j in range(i):
        out *= alphas[min(j, len(alphas) - 1)]
    return out


def expected_view(recs):
    alphas = acceptance(recs)
    ks = {b: expected_k(alphas, b) for b in BATCHES}
    upto = None
    for b in BATCHES:  # every batch size up to it within 1.25× at k = 3
        if t_target(b, 4) / t_target(b, 1) > 1.25:
            break
        upto = b
    off = [b for b in BATCHES if all(ks[c][0] == 0 for c in BATCHES if c >= b)]
    return ks, upto, (min(off) if off else None)


def table_k(b: int) -> int:
    return next(k for (lo, hi), k in TABLE.items() if lo <= b and (hi is None or b <= hi))


@pytest.fixture
def store(tmp_path):
    st = open_store(f"sqlite:///{tmp_path / 'b.db'}")
    yield st
    st.close()


def fill(store, *, grid: bool = True, tuned: bool = True):
    recs = requests()
    with store.begin() as s:
        write_records(s, recs)
        pid = get_or_create_pair(s, FLAT)
        if grid:
            add_probe(s, pid, grid_payload())
        if tuned:
            spec = "table:" + ",".join(f"{lo}-{'' if hi is None else hi}:{k}"
                                       for (lo, hi), k in TABLE.items())
            add_tuned_params(s, category="code", pair_id=pid, family="table",
                             params={"table": spec}, tokens_per_s=10.0,
                             baseline_tokens_per_s=9.0, provenance={})
    return recs


def _batch_section(text: str) -> str:
    return text.split("\n4. batch: ", 1)[1].split("\n\n", 1)[0]


def test_expected_values_cross_over_inside_the_grid(store):
    """The synthetic grid is a real test: memory-bound at small B only, speculation on at
    B = 1 and off at the largest B, and the k differs between batch sizes."""
    ks, upto, off = expected_view(requests())
    assert upto is not None and BATCHES[0] <= upto < BATCHES[-1]
    assert off is not None and BATCHES[0] < off <= BATCHES[-1]
    assert ks[1][0] > 0 and ks[BATCHES[-1]][0] == 0
    assert len({k for k, _ in ks.values()}) >= 3


def test_text_shows_crossover_and_k_per_batch_size(store):
    recs = fill(store)
    ks, upto, off = expected_view(recs)
    rep = build_report(store)
    (w,) = rep.workloads
    # the rows' live points equal the grid there: read at the live level, nothing moves
    assert w.batch.source.startswith("probe at the live level")
    assert [(p.batch, p.k) for p in w.batch.points] == [(b, ks[b][0]) for b in BATCHES]
    for p in w.batch.points:
        assert p.speedup == pytest.approx(ks[p.batch][1], rel=1e-9)
        assert p.cost_ratio == pytest.approx(t_target(p.batch, 4) / t_target(p.batch, 1))
    assert (w.batch.memory_bound_up_to, w.batch.crossover) == (upto, off)

    text, _, _ = check_formats(rep)
    section = _batch_section(text)
    assert f"memory-bound up to B = {upto} " in section
    assert f"switches speculation off from B = {off}" in section
    rows = {}
    for line in section.splitlines():
        cells = line.split()
        if len(cells) == 12 and cells[0].isdigit():
            rows[int(cells[0])] = cells
    assert sorted(rows) == list(BATCHES)
    for b, cells in rows.items():
        assert int(cells[4]) == ks[b][0]  # k (cost model)
        assert cells[5] == f"{ks[b][1]:.2f}×"  # its predicted speedup
        assert float(cells[2]) == pytest.approx(t_target(b, 4) / t_target(b, 1), abs=0.005)
        assert int(cells[10]) == table_k(b)  # the tuned table's k
        assert int(cells[11]) == BATCH_COUNTS.get(b, 0)  # logged requests at B
    assert ", ".join(f"B = {b}: {n}" for b, n in sorted(BATCH_COUNTS.items())) in section


def test_html_shows_crossover_k_per_batch_size_and_batch_distribution(store):
    recs = fill(store)
    ks, upto, off = expected_view(recs)
    rep = build_report(store)
    html = render_html(rep)
    batch = html.split("<h3>Batch</h3>", 1)[1]
    headline = unescape(re.search(r"<p><b>(.*?)</b>", batch).group(1))
    assert f"memory-bound up to B = {upto} " in headline
    assert f"switches speculation off from B = {off}" in headline
    table_html = re.search(r"<table>.*?</table>", batch, re.S).group(0)
    cells = [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", table_html)]
    got = {int(r[0]): (int(r[4]), unescape(r[5]), int(r[10]), int(r[11])) for r in cells if r}
    assert got == {b: (ks[b][0], f"{ks[b][1]:.2f}×", table_k(b), BATCH_COUNTS.get(b, 0))
                   for b in BATCHES}
    # the plots: speedup by batch size with the crossover marked, and the logged batch sizes
    svgs = re.findall(r"<svg\b.*?</svg>", batch, re.S)
    assert len(svgs) == 2 and html.count("<svg") == 4 + 2
    speed, dist = (ET.fromstring(svg) for svg in svgs)
    texts = ["".join(t.itertext()) for t in speed.iter("text")]
    assert f"off from B = {off}" in texts
    assert [t for t in texts if t.startswith("k=")] == [f"k={ks[b][0]}" for b in BATCHES]
    assert all(str(b) in texts for b in BATCHES)  # log2 axis ticks labelled with B
    assert len(speed.findall("polyline")) == 6  # plain, chosen k, fixed k = 1 … 4
    bars = {t.text for t in dist.iter("title")}
    for b in sorted(set(BATCH_COUNTS) | set(BATCHES)):
        assert f"{b}: {BATCH_COUNTS.get(b, 0)}" in bars


def test_json_carries_the_batch_view(store):
    recs = fill(store)
    ks, upto, off = expected_view(recs)
    js = json.loads(render_json(build_report(store)))
    b = js["workloads"][0]["batch"]
    assert (b["memory_bound_up_to"], b["crossover"]) == (upto, off)
    assert {p["batch"]: p["k"] for p in b["points"]} == {x: ks[x][0] for x in BATCHES}
    assert {int(k): v for k, v in b["requests_by_batch"].items()} == BATCH_COUNTS


def test_live_forwards_set_the_level_of_the_probes_grid(store):
    """The probe's grid says verification stays cheap at B = 16; the loop's own forwards
    there (logged by batched rows) say each scored token adds 0.8× one. The report reads the
    grid as the live policy does (the probe's shape at the live level) and shows k = 0 at
    B = 16, where on the probe alone it showed k > 0 (as it did on the default pair, where
    the loop ran k = 1 at 0.73–0.88× plain)."""
    recs = [r for r in requests() if r.batch_size == 1]
    flat = {b: {n: 0.05 * (1 + 0.01 * b * n) for n in range(1, 17)} for b in BATCHES}
    payload = {"path": "eager",
               "target_s_by_n": {str(n): t for n, t in flat[1].items()}, "draft_s": 0.005,
               "grid": {str(b): {str(n): t for n, t in ns.items()} for b, ns in flat.items()},
               "draft_grid": {str(b): 0.005 for b in BATCHES}}
    with store.begin() as s:
        write_records(s, recs)
        add_probe(s, get_or_create_pair(s, FLAT), payload)
    probe_only = build_report(store).workloads[0].batch
    at16 = {p.batch: p for p in probe_only.points}[16]
    assert probe_only.source == "probe" and at16.k > 0
    live = [replace(recs[0], batch_size=16, target_s_by_n={}, draft_s=0.0, created_at=T0 + i,
                    target_s_by_bn={(16, n): [0.05 + 0.04 * (n - 1)] * 16
                                    for n in range(1, 10)},
                    draft_s_by_b={16: [0.005] * 16}) for i in range(2)]
    with store.begin() as s:
        write_records(s, live)
    view = build_report(store).workloads[0].batch
    assert view.source.startswith("probe at the live level")
    pts = {p.batch: p for p in view.points}
    assert pts[16].t_target_1_s == pytest.approx(0.05)
    assert pts[16].k == 0 and view.crossover is not None and view.crossover <= 16
    # `autospec tune` replays the same grid the report shows (it read the raw probe before)
    from autospec.tune.study import tune

    (res,) = tune(store, trials=2, families=("fixed",), write=False, seed=0)
    assert res.costs["source"].endswith(view.source)
    assert res.costs["t_target_s_by_bn"][16] == pytest.approx(
        {n: 0.05 + 0.04 * (n - 1) for n in range(1, 10)} | {
            n: t for n, t in res.costs["t_target_s_by_bn"][16].items() if n >= 10})
    assert res.costs["t_target_s_by_bn"][16][1] == pytest.approx(pts[16].t_target_1_s)


def test_without_a_grid_the_report_says_what_to_run(store):
    fill(store, grid=False, tuned=False)
    rep = build_report(store)
    (w,) = rep.workloads
    assert w.batch.points == [] and w.batch.crossover is None
    text, html, _ = check_formats(rep)
    hint = "autospec probe --batch 1,2,4,8,16,32"
    assert hint in _batch_section(text) and hint in html.split("<h3>Batch</h3>", 1)[1]
    # only the logged batch sizes are plotted beside the four usual charts
    assert html.count("<svg") == 4 + 1


def test_stats_prints_crossover_and_k_per_batch_size(store, tmp_path, capsys):
    from autospec.cli import build_parser

    recs = fill(store)
    ks, upto, off = expected_view(recs)
    parser = build_parser()
    url = f"sqlite:///{tmp_path / 'b.db'}"
    args = parser.parse_args(["stats", "--db", url, "--json"])
    assert args.run(args, parser) == 0
    (d,) = json.loads(capsys.readouterr().out)
    assert d["batch"]["crossover"] == off and d["batch"]["memory_bound_up_to"] == upto
    assert d["batch"]["k_by_batch"] == {str(b): ks[b][0] for b in BATCHES}
    args = parser.parse_args(["stats", "--db", url])
    assert args.run(args, parser) == 0
    out = capsys.readouterr().out
    cells = " ".join(f"{b}:{ks[b][0]}" for b in BATCHES)
    assert f"{cells} (off from {off})" in out


def test_stats_k_is_batch_ones_not_the_mix_of_every_batch_size(store, tmp_path, capsys):
    """30 requests ran k = 4 at batch 1; 60 batched rows ran k = 0 at B = 16 (more
    iterations in all). `stats` shows k = 4: the workload's own choice, as the report's
    policy in force is (before, it showed 0 and T_t(1) beside it)."""
    from autospec.cli import build_parser

    recs = [r for r in requests() if r.batch_size == 1]
    off = [replace(recs[0], batch_size=16, k_schedule=bytes(24), accepted_schedule=bytes(24),
                   iterations=24, proposers=draft(trace=recs[0].proposers["draft"].trace),
                   target_s_by_n={}, draft_s=0.0, draft_forwards=0,
                   target_s_by_bn={(16, 1): [t_target(16, 1)] * 24}, created_at=T0 + 10**5 + i)
           for i in range(60)]
    with store.begin() as s:
        write_records(s, recs + off)
    parser = build_parser()
    url = f"sqlite:///{tmp_path / 'b.db'}"
    args = parser.parse_args(["stats", "--db", url, "--json"])
    assert args.run(args, parser) == 0
    (d,) = json.loads(capsys.readouterr().out)
    assert max(d["k_counts"], key=lambda k: d["k_counts"][k]) == "0"  # all-time: the mix
    assert d["k_batch_1"] == 4
    args = parser.parse_args(["stats", "--db", url])
    assert args.run(args, parser) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("code"))
    assert row.split()[-1] == "4"
