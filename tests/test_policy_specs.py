"""Policy specs at their edges: one parser and one rule for ``KIND:K`` wherever a spec is read
(``as_policy``, bench's modes), ASCII digits only, a hybrid's match length within what is
measured, each proposer of ``auto:SET`` named once, and a controller without a draft model
refusing, at wrap, a policy that drafts with one."""

from __future__ import annotations

import pytest

import autospec
from autospec.bench.run import _Runner, parse_modes
from autospec.policies import as_policy
from autospec.policies.base import K_LIMIT
from autospec.traces import MATCH_REACH

from conftest import tiny


def test_a_hybrid_match_length_beyond_what_is_measured_is_refused():
    assert as_policy(f"hybrid:3:{MATCH_REACH}").min_match == MATCH_REACH
    for spec in ("hybrid:3:99", f"hybrid:3:{MATCH_REACH + 1}", "hybrid:3:0"):
        with pytest.raises(ValueError, match=rf"min_match must be an int in 1\.\.{MATCH_REACH}"):
            as_policy(spec)


@pytest.mark.parametrize("spec", ["auto:draft+draft", "auto:ngram+suffix+ngram"])
def test_a_proposer_named_twice_is_refused(spec):
    with pytest.raises(ValueError, match="more than once: name each proposer once"):
        as_policy(spec)


@pytest.mark.parametrize("spec", ["ngram:٣", "fixed:３", "suffix:²", "hybrid:3:٢", "hybrid:٣"])
def test_only_ascii_digits_make_a_k(spec):
    with pytest.raises(ValueError, match="ASCII digits"):
        as_policy(spec)
    if not spec.startswith(("fixed", "hybrid")):  # bench's lookup modes read it the same way
        with pytest.raises(ValueError, match="ASCII digits"):
            parse_modes([spec], [1])


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_a_lookup_proposer_at_k_0_is_refused_alike_as_a_policy_and_as_a_bench_mode(kind):
    with pytest.raises(ValueError) as policy:
        as_policy(f"{kind}:0")
    with pytest.raises(ValueError) as mode:
        parse_modes([f"{kind}:0"], [1])
    reason = str(policy.value).split(": ", 1)[1]
    assert "drafts nothing" in reason and "'off'" in reason
    assert str(mode.value) == f"bad mode '{kind}:0': {reason}"
    # the same range on both sides
    assert as_policy(f"{kind}:{K_LIMIT}").k == K_LIMIT
    assert parse_modes([f"{kind}:{K_LIMIT}"], [1])[-1].k == K_LIMIT
    for spec in (f"{kind}:{K_LIMIT + 1}", "hybrid:0"):
        with pytest.raises(ValueError):
            as_policy(spec)
    assert as_policy("fixed:0").name == "off" and parse_modes(["autospec:0"], [1])[-1].k == 0


@pytest.mark.parametrize("policy", ["hybrid:3", "hybrid:4:1", "auto:draft", "auto:draft+ngram",
                                    "fixed:3", 3, "fixed:3+stop=0.5"])
def test_wrap_without_a_draft_model_refuses_a_policy_that_needs_one(policy):
    with pytest.raises(ValueError, match="draft model, and this controller has none"):
        autospec.Controller(tiny(), None, store=False, policy=policy)


@pytest.mark.parametrize("policy", ["auto", "off", 0, "ngram:3", "suffix:3",
                                    "auto:ngram+suffix", "bandit", "table:1-:2"])
def test_wrap_without_a_draft_model_takes_a_policy_that_drafts_without_it(policy):
    autospec.Controller(tiny(), None, store=False, policy=policy).close()


def test_bench_without_a_draft_model_reports_a_policy_that_needs_one_as_not_run():
    modes = parse_modes(["policy:hybrid:3", "policy:auto"], [1])
    runner = _Runner(tiny(), None, None, draft_tokenizer=None, modes=modes, sample=False,
                     sampling={})
    (why,) = runner.unsupported.values()
    assert "no draft model" in why and "'hybrid:3:2' drafts with the draft model" in why
    assert [m.policy for m in runner.policy_ctrls] == ["auto"]
