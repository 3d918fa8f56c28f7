"""`autospec export --engine vllm` priced by vLLM's own steps: a real SQLite store holding
autospec's traffic (prompt-lookup traces, a transformers probe) and vLLM's steps as the
custom_class proposer's sink writes them (path "vllm", pair without a draft model); the real
export code. Where vLLM's costs say verification is steep the lookup's k — and the draft
model's, its draft at autospec's measured share of a plain step — is shorter than where they
say it is flat; the header names the costs used; without vLLM's records (or with
``--costs-from autospec``) the export is what it was."""

from __future__ import annotations

import random
import re

import pytest
from test_export import check_vllm, check_vllm_ngram, export

from autospec.costs import MIN_FORWARDS
from autospec.fleet.export import ExportError, plan_for
from autospec.fleet.vllm_sink import PATH, POLICY
from autospec.ngram import encode_trace_value
from autospec.store import PairInfo, RequestRecord, add_probe, open_store
from autospec.telemetry import NO_DRAFT
from autospec.traces import NGRAM_NONE, TRACE_GREEDY

from records import draft, lookup

PAIR = PairInfo("org/target-1.5b", "org/draft-0.5b", "bfloat16", "cpu: test")
# transformers' curve: memory-bound, nearly flat; T_d a third of a step
CURVE = {n: 0.2 * (1 + 0.02 * (n - 1)) for n in range(1, 10)}
T_D = 0.06
FLAT = {n: 0.15 * (1 + 0.02 * (n - 1)) for n in range(1, 10)}  # vLLM: every draft token ~free
STEEP = {n: 0.15 * (1 + 0.6 * (n - 1)) for n in range(1, 10)}  # vLLM: each costs 0.6 step


def autospec_traffic(rng, category: str, copy_share: float, draft_alpha: float,
                     n: int = 96) -> list:
    """Greedy traffic served by autospec (written first: pair #1) at k = 0 with prompt lookup's trace: a draft at
    ``copy_share`` of positions, agreeing for 0–8 tokens there (shorter agreement likelier); the draft model's trace
    Bernoulli(``draft_alpha``)."""
    recs = []
    for i in range(30):
        ngram = bytes(encode_trace_value(3, min(8, int(rng.expovariate(0.35))))
                      if rng.random() < copy_share else NGRAM_NONE for _ in range(n))
        trace = bytes(1 if rng.random() < draft_alpha else 0 for _ in range(n))
        recs.append(RequestRecord(
            pair=PAIR, category=category, policy="off", greedy=True, prompt_tokens=16,
            new_tokens=n, iterations=n, k_schedule=bytes(n), accepted_schedule=bytes(n),
            wall_s=n * CURVE[1], prefill_s=0.0, draft_s=0.0, draft_forwards=0,
            target_s_by_n={1: [CURVE[1]] * 4}, trace_kind=TRACE_GREEDY,
            created_at=1.0e9 + i, path="eager", proposer_schedule=None,
            proposers={**draft(trace=trace),
                       **lookup("ngram", trace=ngram, settings={"max_n": 3, "min_n": 1})}))
    return recs


def vllm_records(curve: dict[int, float], requests: int, *, target: str = PAIR.target,
                 steps_per_n: int = 1) -> list:
    """Requests that ran alone in vLLM with autospec's custom_class proposer, as
    ``vllm_sink.StoreSink.record`` writes them: the served model without a draft model, path
    "vllm", policy "autospec (vllm)", the engine's step seconds by tokens scored."""
    recs = []
    for i in range(requests):
        new = len(curve) * steps_per_n
        recs.append(RequestRecord(
            pair=PairInfo(target=target, draft=NO_DRAFT, dtype=PAIR.dtype,
                          hardware=PAIR.hardware),
            category="copy", policy=POLICY, greedy=True, prompt_tokens=16, new_tokens=new,
            iterations=new, proposers={}, proposer_schedule=[None] * new,
            k_schedule=bytes(new), accepted_schedule=bytes(new), wall_s=sum(curve.values()),
            prefill_s=0.0, draft_s=0.0, draft_forwards=0,
            target_s_by_n={n: [t] * steps_per_n for n, t in curve.items()},
            trace_kind=TRACE_GREEDY, stop_reason="", created_at=2.0e9 + i, batch_size=1,
            path=PATH))
    return recs


def make_store(tmp_path, name: str, vllm_curve: dict[int, float] | None, requests: int = 0,
               **kw) -> str:
    url = f"sqlite:///{tmp_path / name}"
    st = open_store(url)
    rng = random.Random(7)
    st.write(autospec_traffic(rng, "copy", 0.6, 0.3) + autospec_traffic(rng, "free", 0.0, 0.8))
    if vllm_curve is not None:
        st.write(vllm_records(vllm_curve, requests, **kw))
    with st.begin() as s:
        add_probe(s, PAIR, {"path": "eager", "draft_s": T_D,
                            "target_s_by_n": {str(n): t for n, t in CURVE.items()}})
    st.close()
    return url


def exported(url, tmp_path, *extra) -> tuple[str, dict]:
    text = export(url, "vllm", tmp_path, "--category", "copy", "--pair-id", "1", "--proposer",
                  "ngram", *extra)
    return text, check_vllm_ngram(text)


def costs_line(text: str) -> str:
    (line,) = [ln for ln in text.splitlines() if ln.startswith("# costs: ")]
    return line


def test_vllm_steps_price_the_lookups_k_flat_against_steep(tmp_path):
    enough = MIN_FORWARDS
    base = make_store(tmp_path, "none.db", None)
    flat = make_store(tmp_path, "flat.db", FLAT, enough)
    steep = make_store(tmp_path, "steep.db", STEEP, enough)
    t0, c0 = exported(base, tmp_path)
    tf, cf = exported(flat, tmp_path)
    ts, cs = exported(steep, tmp_path)
    k0, kf, ks = (c["num_speculative_tokens"] for c in (c0, cf, cs))
    # vLLM's flat verification drafts long, its steep one short: a different k
    assert ks < kf and ks < k0, (k0, kf, ks)
    # the header names the costs: autospec's probe without vLLM's steps, vLLM's with them
    assert "autospec's own timings (transformers loop)" in costs_line(t0)
    assert "probe #" in costs_line(t0)
    for text, curve in ((tf, FLAT), (ts, STEEP)):
        line = costs_line(text)
        assert f"vLLM's own steps ({len(curve) * enough} steps, path vllm, pair #" in line
        assert f"T_t(1) {curve[1] * 1e3:.1f} ms" in line
    # --costs-from autospec: the store's vLLM steps are left aside, the export as without them
    ta, ca = exported(steep, tmp_path, "--costs-from", "autospec")
    assert ca == c0 and costs_line(ta) == costs_line(t0)
    assert re.search(r"B=1: k=\d+, S≈[\d.]+×", ta).group(0) == \
        re.search(r"B=1: k=\d+, S≈[\d.]+×", t0).group(0)
    # the k vLLM's steps give is the report's own rule over vLLM's curve
    with open_store(steep, read_only=True) as st:
        plan = plan_for(st, category="copy", pair_id=1, engine="vllm", costs_from="engine",
                        proposer="ngram")
    assert plan.table[0][1] == ks and plan.costs.startswith("vLLM's own steps")


def test_too_few_vllm_steps_fall_back_or_refuse(tmp_path, capsys):
    few = make_store(tmp_path, "few.db", STEEP, MIN_FORWARDS - 1)
    base = make_store(tmp_path, "base.db", None)
    text, cfg = exported(few, tmp_path)
    t0, c0 = exported(base, tmp_path)
    assert cfg == c0 and costs_line(text) == costs_line(t0)  # auto: autospec's, unchanged
    from autospec.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["export", "--db", few, "--engine", "vllm", "--category", "copy", "--pair-id", "1",
              "--costs-from", "engine"])
    err = capsys.readouterr().err
    assert "too few vLLM steps (path vllm)" in err and f"≥ {MIN_FORWARDS} steps" in err
    # other engines' steps are never recorded: engine costs refused, auto is autospec's
    with open_store(few, read_only=True) as st:
        with pytest.raises(ExportError, match="SGLang's own step costs are never recorded"):
            plan_for(st, category="copy", pair_id=1, engine="sglang", costs_from="engine")
        plan = plan_for(st, category="copy", pair_id=1, engine="sglang")
    assert plan.costs.startswith("autospec's own timings")


def test_another_target_or_hardware_does_not_price(tmp_path):
    other = make_store(tmp_path, "other.db", STEEP, MIN_FORWARDS, target="org/another-7b")
    base = make_store(tmp_path, "base.db", None)
    assert exported(other, tmp_path)[1] == exported(base, tmp_path)[1]
    # the target named by its last part (vLLM serving a local directory) is the same target
    local = make_store(tmp_path, "local.db", STEEP, MIN_FORWARDS, target="/models/target-1.5b")
    steep = make_store(tmp_path, "steep.db", STEEP, MIN_FORWARDS)
    assert exported(local, tmp_path)[1] == exported(steep, tmp_path)[1]
    # --engine-hardware: the engine's costs are looked for on the hardware it runs
    with open_store(steep, read_only=True) as st:
        plan = plan_for(st, category="copy", pair_id=1, engine="vllm",
                        engine_hardware="gpu: other", proposer="ngram")
    assert plan.costs.startswith("autospec's own") and any(
        "re-probe there" in w for w in plan.warnings)


def test_a_draft_model_export_is_priced_by_vllms_steps_and_says_how(tmp_path):
    """The draft model's k over vLLM's T_t(n), the draft at the share of a plain step autospec
    measured (T_d / T_t(1) of the probe: 0.06 / 0.2): a verification that grows with each
    token shortens the block; one that makes every draft token cost 0.6 of a step leaves
    nothing that pays."""
    from autospec.costs.price import best_k
    from autospec.report import build_report

    mid = {n: 0.15 * (1 + 0.15 * (n - 1)) for n in range(1, 10)}
    urls = {name: make_store(tmp_path, f"{name}.db", curve, MIN_FORWARDS)
            for name, curve in (("base", None), ("flat", FLAT), ("mid", mid),
                                ("steep", STEEP))}
    texts = {name: export(url, "vllm", tmp_path, "--category", "free", "--pair-id", "1",
                          "--default-margin", "0")  # the argmax, not vLLM's documented k
             for name, url in urls.items()}
    ks = {name: check_vllm(texts[name])["num_speculative_tokens"]
          for name in ("base", "flat", "mid")}
    assert ks["mid"] < ks["flat"] and ks["mid"] < ks["base"], ks
    assert "autospec's own timings (transformers loop)" in costs_line(texts["base"])
    share = f"the draft at autospec's measured share of a plain step (T_d = {T_D / CURVE[1]:.2f}"
    for name in ("flat", "mid", "steep"):
        line = costs_line(texts[name])
        assert line.startswith("# costs: vLLM's own steps (") and share in line, line
        assert "one k, priced at batch 1 over vLLM's steps" in texts[name]
    # vLLM's steep steps: speculation does not pay, so none is exported
    assert "--speculative-config" not in texts["steep"]
    assert "serve without it" in texts["steep"]
    # the k is the cost model's argmax over vLLM's curve, at the acceptance of a fixed-k
    # block the draft's traces give (Bernoulli(0.8) per position: 0.8 at each)
    with open_store(urls["mid"], read_only=True) as st:
        (w,) = build_report(st, category="free", pair_id=1).workloads
        plan = plan_for(st, category="free", pair_id=1, engine="vllm", costs_from="engine",
                        default_margin=0)
    fixed = w.acceptance.fixed_block
    assert all(abs(a - 0.8) < 0.05 for a in fixed[:3]), fixed
    k, s = best_k(fixed, T_D / CURVE[1] * mid[1], mid, 8)
    assert plan.table == [(1, k, s)] and k == ks["mid"]
    assert "acceptance by position in a block of fixed k, from the draft model's greedy " \
           "traces: " + " ".join(f"{a:.2f}" for a in fixed[:3]) in texts["mid"]
    # --costs-from autospec: the export as without vLLM's steps
    text = export(urls["steep"], "vllm", tmp_path, "--category", "free", "--pair-id", "1",
                  "--costs-from", "autospec")
    assert check_vllm(text) == check_vllm(texts["base"])
    assert costs_line(text) == costs_line(texts["base"])


def _ingest_steps(tmp_path, url, steps: dict[int, float], n: int = 40) -> None:
    """vLLM's windows ingested for PAIR: ``n`` decode steps of ``steps[k]`` seconds each at
    each k (0: a plain server's window), four requests one at a time."""
    from test_ingest import ingest_window

    for k, seconds in steps.items():
        where = tmp_path / f"w{k}"
        where.mkdir()
        zero = dict(model=PAIR.target, drafts=0, k=k, per_pos=())
        ingest_window(where, url, zero, dict(
            zero, drafts=n if k else 0, per_pos=[n] * k, decode_s=seconds * n, decoded=4,
            steps=n + 4, tokens=n + 4), "--category", "free", "--target", PAIR.target,
            "--draft", PAIR.draft, "--dtype", PAIR.dtype, "--hardware", PAIR.hardware)


def test_vllms_own_steps_with_its_draft_model_are_listed_and_price_where_nothing_else_does(
        tmp_path, capsys):
    """Windows of vLLM serving this draft model one request at a time at k = 1, 3 and 5 (and
    plain), ingested from its metrics (``autospec ingest --baseline``). Beside vLLM's T_t(n)
    from the custom_class proposer, the export prices the draft at autospec's share as before
    and lists the ingested steps, not priced (one server per k priced worse, measured); where
    the store has no custom_class steps, a step at k is priced on the line through them."""
    from autospec.costs.price import best_k
    from autospec.report import build_report

    mid = {n: 0.15 * (1 + 0.15 * (n - 1)) for n in range(1, 10)}
    step = {1: 0.21, 3: 0.27, 5: 0.33}  # seconds a step at k: 0.18 + 0.03 k
    listed = ("vLLM's own steps with its draft model (its clock over ingested scrape windows, "
              "path vllm+draft): plain 120 ms (40 steps), k = 1 210 ms (40 steps), k = 3 270 ms "
              "(40 steps), k = 5 330 ms (40 steps); their line 180 + 30.0 k ms")
    # beside the custom_class proposer's T_t(n): the share prices, the steps are listed
    url = make_store(tmp_path, "steps.db", mid, MIN_FORWARDS)
    before = check_vllm(export(url, "vllm", tmp_path, "--category", "free", "--pair-id", "1"))
    _ingest_steps(tmp_path, url, {0: 0.12, **step})
    text = export(url, "vllm", tmp_path, "--category", "free", "--pair-id", "1")
    assert check_vllm(text) == before
    line = costs_line(text)
    assert line.startswith("# costs: vLLM's own steps (") and (
        f"the draft at autospec's measured share of a plain step (T_d = {T_D / CURVE[1]:.2f} "
        f"T_t(1)) — {listed}, not priced (one server per k)") in line, line
    # no custom_class steps: priced on the line through the ingested ones
    alone = make_store(tmp_path, "alone.db", None)
    (tmp_path / "alone").mkdir()
    _ingest_steps(tmp_path / "alone", alone, {0: 0.12, **step})
    capsys.readouterr()
    text = export(alone, "vllm", tmp_path, "--category", "free", "--pair-id", "1",
                  "--default-margin", "0")
    assert costs_line(text) == f"# costs: {listed}: a step at k priced on the line, no k past 5"
    with open_store(alone, read_only=True) as st:
        (w,) = build_report(st, category="free", pair_id=1).workloads
        plan = plan_for(st, category="free", pair_id=1, engine="vllm", costs_from="engine",
                        default_margin=0)
    k, s = best_k(w.acceptance.fixed_block, 0.0,
                  lambda n: 0.12 if n <= 1 else 0.18 + 0.03 * (n - 1), 5)
    assert plan.table == [(1, k, pytest.approx(s))] and 1 <= k <= 5
    assert check_vllm(text)["num_speculative_tokens"] == k
    # --costs-from autospec: autospec's own costs, whatever vLLM's
    text = export(alone, "vllm", tmp_path, "--category", "free", "--pair-id", "1",
                  "--costs-from", "autospec")
    assert "autospec's own timings" in costs_line(text)


def test_the_step_line_averages_the_windows_and_starts_from_plain_with_one():
    """A step at k is priced on the least-squares line through every window's step (one
    window one point): a window off the line — here k = 7, cheaper than k = 5 — moves it by
    its share, not to itself; one window: the line from the plain step through it."""
    from autospec.fleet.export import _step_line

    a, b = _step_line({1: 0.21, 3: 0.27, 5: 0.33, 7: 0.30}, 0.15)
    assert (a, b) == (pytest.approx(0.2115), pytest.approx(0.0165))
    assert a + 7 * b > 0.30 and a + 5 * b < 0.33
    assert _step_line({5: 0.33}, 0.15) == (0.15, pytest.approx(0.036))
    assert _step_line({1: 0.3, 3: 0.2}, 0.15)[1] == 0.0  # never falling with k


def test_vllms_documented_k_stays_unless_another_is_priced_beyond_the_margin(tmp_path):
    """The draft model at α ≈ 0.8 over vLLM's T_t(n) rising 8 % a token (the draft at 0.3 of
    a plain step): k = 3 is priced best, about 7 % above k = 5, vLLM's documented k. Within
    the default 10 % margin the export keeps k = 5 and its note says why; with a 5 % margin
    (or 0) it exports the argmax. Where k = 5 does not pay itself (verification rising 30 % a
    token: k = 1 priced 19 % above it) the argmax stays, even at a 25 % margin."""
    from autospec.costs.price import best_k, offer
    from autospec.report import build_report

    def priced(url, margin):
        with open_store(url, read_only=True) as st:
            (w,) = build_report(st, category="free", pair_id=1).workloads
            plan = plan_for(st, category="free", pair_id=1, engine="vllm",
                            costs_from="engine", default_margin=margin)
        return w.acceptance.fixed_block, plan

    for rise, margin in ((0.08, 0.10), (0.08, 0.05), (0.3, 0.10), (0.3, 0.25)):
        curve = {n: 0.15 * (1 + rise * (n - 1)) for n in range(1, 10)}
        url = make_store(tmp_path, f"r{rise}-m{margin}.db", curve, MIN_FORWARDS)
        fixed, plan = priced(url, margin)
        t_d = T_D / CURVE[1] * curve[1]
        k_best, s_best = best_k(fixed, t_d, curve, 8)
        five = offer("draft", fixed, 5, t_d, curve.__getitem__)
        s_five = five.tokens * curve[1] / five.seconds
        ((_, k, s),) = plan.table
        kept = [n for n in plan.notes if "vLLM's documented k, kept" in n]
        if rise == 0.08:
            assert k_best == 3 and 1.05 < s_best / s_five < 1.10, (k_best, s_best, s_five)
        else:
            assert k_best == 1 and s_five < 1 < s_best < s_five * 1.25, (k_best, s_best, s_five)
        if rise == 0.08 and margin == 0.10:
            assert (k, s) == (5, pytest.approx(s_five)) and kept == [
                f"k = 5, vLLM's documented k, kept: k = 3 is priced at S≈{s_best:.2f}×, "
                f"within 10% of its S≈{s_five:.2f}× (--default-margin)"]
        else:  # beyond the margin, or k = 5 does not pay
            assert (k, s) == (k_best, pytest.approx(s_best)) and not kept
        # what vLLM is told is what the plan says; --default-margin 0: the argmax
        text = export(url, "vllm", tmp_path, "--category", "free", "--pair-id", "1",
                      "--default-margin", str(margin))
        assert check_vllm(text)["num_speculative_tokens"] == k
        assert priced(url, 0)[1].table == [(1, k_best, pytest.approx(s_best))]
