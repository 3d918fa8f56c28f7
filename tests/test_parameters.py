"""The policy's numbers live in one documented object (``policies.params.Parameters``): none
left as module constants, each documented, the tuned ones searched by ``autospec tune``, and a
changed field changes the decision it names."""

from __future__ import annotations

import ast
import pathlib

import pytest

from autospec.costs.table import CostTable
from autospec.policies import Context, CostModelPolicy, LiveStats
from autospec.policies.params import DEFAULTS, TUNED, Parameters, markdown_table, parameter_docs

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
    assert len(docs) >= 30
    for name, _default, doc, tuned, why_fixed in docs:
        assert len(doc) > 20, name
        assert tuned or len(why_fixed) > 20, f"{name} is neither tuned nor says why it is fixed"
    page = (POLICIES.parent.parent / "docs" / "parameters.md").read_text()
    assert markdown_table() in page, ("docs/parameters.md's table differs from the code: "
                                      "python scripts/parameters_table.py prints it")


def test_tune_searches_the_tuned_fields_and_trial_zero_is_the_defaults():
    from autospec.tune import study

    assert study.SEARCHED_COSTMODEL == TUNED
    flat = study.default_params()
    for name in TUNED:
        value = getattr(DEFAULTS, name)
        expected = DEFAULTS.acceptance_discount if name == "discount" and value is None else value
        assert flat[f"costmodel.{name}"] == expected


def test_keyword_overrides_are_parameters_and_unknown_names_are_refused():
    policy = CostModelPolicy(z=0.5, trial_gain=0.3)
    assert policy.params == DEFAULTS.but(z=0.5, trial_gain=0.3)
    with pytest.raises(ValueError, match="unknown policy parameter.*zz"):
        CostModelPolicy(zz=1)
    with pytest.raises(ValueError, match="shape_floor"):
        Parameters(shape_floor=1.5)


def _untried(t_draft: float):
    """The pair's costs of a probed category the draft model never drafted on: flat T_t
    (its statistics: fresh, the prior α = 0.5)."""
    costs = CostTable().at("eager")
    costs.warm(t_draft=t_draft, t_target={n: 0.16 for n in range(1, 18)})
    return costs


def test_trial_gain_decides_whether_an_untried_draft_model_is_tried():
    # at perfect acceptance k = 1 gains 2 · 0.16 / (0.1 + 0.16) − 1 = 0.23: tried at the
    # default 0.1, not where the trial must gain 0.3
    ctx = Context(category="chat", k_max=1, live=LiveStats(), costs=_untried(0.1))
    assert CostModelPolicy().choose(ctx) == 1
    assert CostModelPolicy(trial_gain=0.3).choose(ctx) == 0


def test_shape_floor_decides_which_live_timing_is_held_out():
    for floor, held in ((DEFAULTS.shape_floor, True), (0.5, False)):
        costs = CostTable(params=DEFAULTS.but(shape_floor=floor)).at("eager")
        for _ in range(3):
            costs.observe(0, 1.0)
        costs.observe(3, 0.6, 0.03)  # T_t(4) at 0.6 · T_t(1)
        assert (4 not in costs.t_target) == held and costs.held_out == int(held)


def test_marginal_bounds_k_on_a_busy_machine():
    """Busy (a level move), acceptance 0.5: k is bounded where a₁⋯a_k ≥ marginal."""
    picks = {}
    for marginal in (0.1, 0.4):
        params = DEFAULTS.but(marginal=marginal)
        live, costs = LiveStats(params=params), CostTable(params=params).at("eager")
        live.warm_start({"draft": ([50, 25, 12.5, 6.25, 3.125, 1.5625], [100] * 6)})
        costs.warm(t_draft=0.001, t_target={n: 0.2 for n in range(1, 18)}, probe=True)
        costs._busy_until = 10 ** 6  # the guard's state after a level move
        assert costs.busy()
        picks[marginal] = CostModelPolicy(marginal=marginal).choose(
            Context(category="chat", k_max=8, live=live, costs=costs, remaining=100))
    # 0.5³ = 0.125 ≥ 0.1 > 0.5⁴; 0.5 ≥ 0.4 > 0.5²
    assert picks == {0.1: 3, 0.4: 1}
