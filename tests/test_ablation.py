"""``scripts/ablation.py``: every mechanism of ``auto`` switched off alone, replayed over a real
store's logged traffic, one ratio per request."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import autospec
from autospec.costs.measure import MEASURE
from autospec.policies import CallablePolicy, CostModelPolicy
from autospec.policies.params import DEFAULTS
from autospec.store import add_probe

from conftest import noisy_copy, prompt, tiny

SPEC = importlib.util.spec_from_file_location(
    "ablation", Path(__file__).resolve().parents[1] / "scripts" / "ablation.py")
ablation = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ablation)


def test_each_mechanism_is_a_real_parameter_change():
    for name, overrides in ablation.MECHANISMS.items():
        overrides = dict(overrides)
        measure = overrides.pop("measure", None)
        if measure is not None:  # the cost table's settings, not the policy's
            got = MEASURE.but(**measure)
            assert got != MEASURE and not overrides, name
            assert all(getattr(got, k) == v for k, v in measure.items()), name
            continue
        params = CostModelPolicy(**overrides).params
        assert params != DEFAULTS, name
        assert all(getattr(params, k) == v for k, v in overrides.items()), name
    for name, values in ablation.SENSITIVITY.items():  # each a parameter, off its default
        assert all(CostModelPolicy(**{name: v}).params != DEFAULTS for v in values), name


def test_the_ablation_replays_a_logged_store(tmp_path, capsys):
    target = tiny("llama", layers=2, seed=5, sharpen=30.0)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    # plain steps and blocks of 2 and 5: the draft's trace at most positions
    policy = CallablePolicy(lambda ctx: (0, 2, 5)[ctx.generated % 3])
    spec = autospec.Controller(target, noisy_copy(target, 0.1), store=url, policy=policy)
    for i, cat in enumerate(["code", "chat"] * 3):
        spec.generate(prompt(8, seed=i), max_new_tokens=24, do_sample=False, eos_token_id=None,
                      category=cat)
    # the pair's costs from a probe where the draft pays (tiny models' own timings do not
    # tell a draft model's cost from its target's)
    with spec.store.begin() as s:
        add_probe(s, spec.telemetry.pair, {
            "path": "eager", "target_s_by_n": {str(n): 0.1 + 0.004 * (n - 1)
                                               for n in range(1, 18)},
            "draft_s": 0.01})
    spec.close()
    out = tmp_path / "ablation.json"
    assert ablation.main([url, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "6 requests, 2 categories" in printed
    got = json.loads(out.read_text())
    assert set(got["mechanisms"]) == set(ablation.MECHANISMS)
    for name, cells in got["mechanisms"].items():
        assert cells["all"]["n"] == 6 and set(cells) == {"code", "chat", "all"}, name
        lo, hi = cells["all"]["interval"]
        assert 0 < lo <= cells["all"]["median"] <= hi, name
    # where the draft pays and its confidence tells (a sharpened pair), the stop rule does
    stop = got["mechanisms"]["stop rule (the draft's confidence ends its block)"]["all"]
    assert stop["median"] > 1.05
    # replay has no load: with the busy guard off, every decision is the same
    busy = got["mechanisms"]["busy-machine guard (no load in replay)"]["all"]
    assert busy["median"] == busy["interval"][0] == busy["interval"][1] == 1.0
    # --sensitivity: each parameter at each value, the same table; stop_rule False is the
    # ablation's stop-rule row again
    sens = tmp_path / "sensitivity.json"
    assert ablation.main([url, "--sensitivity", "--json", str(sens)]) == 0
    rows = json.loads(sens.read_text())["mechanisms"]
    assert set(rows) == {f"{n} = {v!r}" for n, vs in ablation.SENSITIVITY.items() for v in vs}
    assert rows["stop_rule = False"] == got["mechanisms"][
        "stop rule (the draft's confidence ends its block)"]


def test_an_empty_store_says_what_to_do(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    autospec.store.open_store(url).close()
    assert ablation.main([url]) == 1
    assert "run the bench with --db first" in capsys.readouterr().err


def test_interleaving_takes_the_categories_round_robin_each_in_its_order():
    class Row:
        def __init__(self, category, i):
            self.category, self.i = category, i

    rows = [Row("a", 0), Row("a", 1), Row("a", 2), Row("b", 3), Row("b", 4), Row(None, 5)]
    assert [r.i for r in ablation.interleaved(rows)] == [0, 3, 5, 1, 4, 2]
