"""The policy's numbers live in one documented object (``policies.params.Parameters``): none
left as module constants, each documented, the tuned ones searched by ``autospec tune``, and a
changed field changes the decision it names."""

from __future__ import annotations

import ast
import pathlib

import pytest

from autospec.costs.measure import MEASURE
from autospec.costs.table import CostTable
from autospec.policies import Context, CostModelPolicy, LiveStats
from autospec.policies.params import (
    DEFAULTS,
    RETIRED,
    TUNED,
    Parameters,
    constants_table,
    current,
    markdown_table,
    parameter_docs,
)

POLICIES = pathlib.Path(__file__).resolve().parent.parent / "autospec" / "policies"


def _numbers(node) -> list:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)]


def test_the_policy_package_has_no_numeric_module_constants():
    found = []
    for path in sorted(POLICIES.glob("*.py")):
        for stmt in ast.parse(path.read_text()).body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                if _numbers(stmt.value):
                    found.append(f"{path.name}:{stmt.lineno}")
    assert len(list(POLICIES.glob("*.py"))) >= 10  # the walk saw the package
    assert found == [], f"numeric module constants left in the policy package: {found}"


def test_every_parameter_is_documented_and_every_fixed_one_says_why():
    docs = parameter_docs()
    assert 8 <= len(docs) <= 12  # the bound: at most a dozen
    for name, _default, doc, tuned, why_fixed in docs:
        assert len(doc) > 20, name
        assert tuned or len(why_fixed) > 20, f"{name} is neither tuned nor says why it is fixed"
    page = (POLICIES.parent.parent / "docs" / "parameters.md").read_text()
    for table in (markdown_table(), constants_table()):
        assert table in page, ("docs/parameters.md's tables differ from the code: "
                               "python scripts/parameters_table.py prints them")


def test_tune_searches_the_tuned_fields_and_trial_zero_is_the_defaults():
    from autospec.tune import study

    assert study.SEARCHED_COSTMODEL == TUNED
    flat = study.default_params()
    for name in TUNED:
        assert flat[f"costmodel.{name}"] == getattr(DEFAULTS, name)


def test_keyword_overrides_are_parameters_and_unknown_names_are_refused():
    policy = CostModelPolicy(min_gain=0.05, k_cap=4)
    assert policy.params == DEFAULTS.but(min_gain=0.05, k_cap=4)
    with pytest.raises(ValueError, match="unknown policy parameter.*zz"):
        CostModelPolicy(zz=1)
    with pytest.raises(ValueError, match="acceptance_discount"):
        Parameters(acceptance_discount=1.5)
    with pytest.raises(ValueError, match="shape_floor"):
        MEASURE.but(shape_floor=1.5)


def test_a_retired_parameter_is_refused_with_what_became_of_it_and_a_stored_row_still_loads(
        caplog):
    from autospec.policies.tuned import build_policy

    with pytest.raises(ValueError, match="reprobe_every is retired: the re-probe is cut"):
        CostModelPolicy(reprobe_every=32)
    assert current({"min_gain": 0.1, "z": 0.5, "probe_k": 2}) == {"min_gain": 0.1}
    policy = build_policy("costmodel", {"min_gain": 0.1, "discount": 0.99, "z": 0.5})
    assert policy.params == DEFAULTS.but(min_gain=0.1)
    assert "retired parameter(s) discount, z" in caplog.text
    assert set(RETIRED).isdisjoint(f for f, *_ in parameter_docs())


def test_shape_floor_decides_which_live_timing_is_held_out():
    for floor, held in ((MEASURE.shape_floor, True), (0.5, False)):
        costs = CostTable(measure=MEASURE.but(shape_floor=floor)).at("eager")
        for _ in range(3):
            costs.observe(0, 1.0)
        costs.observe(3, 0.6, 0.03)  # T_t(4) at 0.6 · T_t(1)
        assert (4 not in costs.t_target) == held and costs.held_out == int(held)


def test_marginal_bounds_k_on_a_busy_machine():
    """Busy (a level move), acceptance 0.5: k is bounded where a₁⋯a_k ≥ marginal."""
    picks = {}
    for marginal in (0.1, 0.4):
        live, costs = LiveStats(), CostTable(measure=MEASURE.but(marginal=marginal)).at("eager")
        live.warm_start({"draft": ([50, 25, 12.5, 6.25, 3.125, 1.5625], [100] * 6)})
        costs.warm(t_draft=0.001, t_target={n: 0.2 for n in range(1, 18)}, probe=True)
        costs._busy_until = 10 ** 6  # the guard's state after a level move
        assert costs.busy()
        picks[marginal] = CostModelPolicy().choose(
            Context(category="chat", k_max=8, live=live, costs=costs, remaining=100))
    # 0.5³ = 0.125 ≥ 0.1 > 0.5⁴; 0.5 ≥ 0.4 > 0.5²
    assert picks == {0.1: 3, 0.4: 1}
