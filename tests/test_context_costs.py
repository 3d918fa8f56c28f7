"""Costs that know the context length ("`auto`, cut down…", item 6): a batch-1 request whose
prompt is past ``MEASURE.context_band`` tokens prices by its band's own cost row, started from
the band below and measured at its own context — so long-prompt traffic stops speculating
where its dearer draft steps no longer pay, while short prompts keep their row. Timings are
given (never measured) except where a real tiny model runs."""

from __future__ import annotations

import pytest
from test_batch_policy import warm_stats

import autospec
from autospec.costs.measure import MEASURE
from autospec.costs.table import CostTable
from autospec.policies import Context, CostModelPolicy

from conftest import noisy_copy, prompt, tiny

BAND = MEASURE.context_band


def test_a_prompts_length_picks_its_context_bands_row_at_batch_1_only():
    table = CostTable()
    short = table.at("eager", 1)
    assert table.at("eager", 1, context=BAND - 1) is short
    one = table.at("eager", 1, context=BAND)
    assert one is not short and one.band == 1
    assert table.at("eager", 1, context=2 * BAND - 1) is one
    two = table.at("eager", 1, context=2 * BAND)
    assert two.band == 2 and table.at("eager", 1, context=4 * BAND - 1) is two
    assert table.at("eager", 1, context=4 * BAND).band == 3
    assert table.at("eager", 4, context=10 * BAND) is table.at("eager", 4)  # B > 1: no bands
    assert table.at("static", 1, context=BAND) is not one  # the path is part of the key
    assert {(r.path, r.batch, r.band) for r in table.rows()} == {
        ("eager", 1, 0), ("eager", 1, 1), ("eager", 1, 2), ("eager", 1, 3), ("eager", 4, 0),
        ("static", 1, 0), ("static", 1, 1)}
    with pytest.raises(ValueError, match="context_band"):
        MEASURE.but(context_band=0)


def _short_row(table: CostTable):
    row = table.at("eager", 1)
    for _ in range(3):
        row.observe(0, 0.100)
    row.observe(2, 0.110, 0.060)  # T_t(3), T_d = 0.030
    row.observe(4, 0.120, 0.120)  # T_t(5)
    return row


def test_a_new_band_times_its_own_level_first_then_carries_the_rest_to_it():
    table = CostTable()
    short = _short_row(table)
    assert short.t_target == pytest.approx({1: 0.100, 3: 0.110, 5: 0.120})
    long = table.at("eager", 1, context=3 * BAND)
    # the seed: the short row's points, not yet decided by (its level is timed here first)
    assert long.t_target == short.t_target and not long.ready()
    policy, stats = CostModelPolicy(), warm_stats(0.8)
    why: list = []
    assert policy.choose(Context(category="c", live=stats, costs=long, why=why)) == 0
    assert why[-1]["rule"] == "baseline"
    for t in (0.125, 0.130, 0.135):  # plain steps at the long context
        long.observe(0, t)
    assert long.ready() and long.t_target[1] == pytest.approx(0.130)
    factor = 0.130 / 0.100
    assert long.t_target[3] == pytest.approx(0.110 * factor)
    assert long.t_target[5] == pytest.approx(0.120 * factor)
    assert long.t_draft == pytest.approx(0.030 * factor) and long.carried()
    long.observe(2, 0.140, 0.100)  # the first samples at this context replace the carried ones
    assert long.t_target[3] == pytest.approx(0.140) and long.t_draft == pytest.approx(0.050)
    assert not long.carried() and long.t_target[5] == pytest.approx(0.120 * factor)
    # the short row is untouched, and decides as before
    assert short.t_target == pytest.approx({1: 0.100, 3: 0.110, 5: 0.120})
    assert short.t_draft == pytest.approx(0.030)
    assert "context ≥ 1024" in long.cost_origin() and "context" not in short.cost_origin()
    copied = table.copy().at("eager", 1, context=3 * BAND)
    assert copied is not long and copied.t_target == long.t_target and copied.band == 2


def test_a_dearer_draft_at_a_long_context_turns_speculation_off_there_only():
    """At a short context the draft's step is 0.30 of a plain step and a block pays; at the
    long one it is 0.65 of it and, at acceptance 0.5, none does — the short row's costs alone
    would have kept speculating on the long prompt."""
    table = CostTable()
    short = _short_row(table)
    long = table.at("eager", 1, context=BAND)
    for _ in range(3):
        long.observe(0, 0.110)
    for _ in range(3):
        long.observe(2, 0.125, 2 * 0.072)
        long.observe(4, 0.135, 4 * 0.072)
    policy, stats = CostModelPolicy(), warm_stats(0.5)
    assert policy.choose(Context(category="c", live=stats, costs=short)) > 0
    why: list = []
    assert policy.choose(Context(category="c", live=stats, costs=long, why=why)) == 0
    assert why[-1]["rule"] == "off"
    assert policy.choose(Context(category="c", live=stats, costs=short)) > 0  # unchanged


def test_a_long_prompt_in_the_engine_feeds_its_bands_row_and_stays_exact():
    """A real loop: a prompt past the first band times its forwards into its band's row (the
    short prompt's row is left as it was), and its output is the target's greedy output."""
    target = tiny("llama", layers=2, seed=0, sharpen=30.0, max_pos=2 * BAND)
    spec = autospec.Controller(target, noisy_copy(target, 0.5), store=False, policy="auto")
    spec.generate(prompt(12), max_new_tokens=16, do_sample=False, eos_token_id=None,
                  category="c")
    short = spec.costs.at(spec.last_stats.path, 1)
    before = (dict(short.t_target), short.t_draft, short.iterations)
    ids = prompt(BAND + 40, seed=3)
    out = spec.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                        category="c")
    ref = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert out.tolist() == ref.tolist()
    long = spec.costs.at(spec.last_stats.path, 1, context=BAND + 40)
    assert long.band == 1 and long.iterations > 0 and long.settled(1)
    assert (dict(short.t_target), short.t_draft, short.iterations) == before
    spec.close()
