"""The cost model weighs suffix decoding beside the draft model and prompt lookup, per row and
iteration, by its own acceptance statistics (per match length) — at batch 1 and B > 1 — and
the engine feeds them: blocks it proposed, and its shadow where another proposer drafted."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_batch_policy import grid_costs
from test_suffix import _requests, batch_is_generates

import autospec
from autospec.costs.table import CostTable
from autospec.policies import Context, CostModelPolicy
from autospec.policies.live import LiveStats

from conftest import noisy_copy, tiny


def _stats(suffix_agree: int, ngram_agree: int, table=None) -> tuple[LiveStats, object]:
    """A category where suffix blocks from a 4-token match hold ``suffix_agree`` of 16 tokens
    and prompt lookup's from a 3-token match ``ngram_agree`` (both learned from shadows), and
    the pair's costs at batch 1 (``table``'s, else a fresh table's)."""
    live = LiveStats(discount=1.0)
    costs = (CostTable() if table is None else table).at("eager")
    costs.t_target = {n: 0.1 + 0.01 * n for n in range(1, 18)}
    costs.t_draft, costs.t_lookup = 0.05, {"ngram": 1e-6, "suffix": 1e-6}
    for _ in range(40):
        live.observe_shadow("suffix", 4, suffix_agree, 16)
        live.observe_shadow("ngram", 3, ngram_agree, 16)
    return live, costs


CTX = dict(category="c", k_max=16, generated=5, remaining=60,
           proposers=("draft", "ngram", "suffix"), whole=("suffix",))


def test_the_suffix_proposer_is_counted_apart_by_the_length_of_its_match():
    live, _ = _stats(16, 0)
    assert live.first_acceptance("suffix") == 1.0
    assert live.first_acceptance("ngram") == 0.0  # prompt lookup's own counts are untouched
    assert sorted(live.by_proposer["suffix"].by_match) == [4] and sorted(live.by_proposer["ngram"].by_match) == [3]
    assert live.curve("suffix", 4, match=4)[0] > 0.95
    copy = live.copy()
    assert copy.counts("suffix")[1] == live.counts("suffix")[1]
    assert copy.by_proposer["suffix"].by_match == live.by_proposer["suffix"].by_match


def _lookups(suffix_match: int, suffix_size: int) -> dict:
    """A Context's lookups at one row: prompt lookup matching 3 tokens, suffix decoding
    ``suffix_match`` with a draft of ``suffix_size``."""
    return dict(matches={"ngram": (3,), "suffix": (suffix_match,)},
                sizes={"ngram": (16,), "suffix": (suffix_size,)})


def test_auto_drafts_with_the_suffix_where_it_holds_and_no_longer_than_its_draft():
    (live, costs), policy = _stats(16, 1), CostModelPolicy()
    choice = policy.choose(Context(**CTX, live=live, costs=costs, **_lookups(4, 16)))
    assert choice.proposer == "suffix" and int(choice) == 16
    # its draft holds 5 tokens: a longer block would score more tokens for none more kept
    short = policy.choose(Context(**CTX, live=live, costs=costs, **_lookups(4, 5)))
    assert short.proposer == "suffix" and int(short) == 5
    # where prompt lookup holds and the suffix does not, prompt lookup drafts
    live, costs = _stats(0, 16)
    choice = policy.choose(Context(**CTX, live=live, costs=costs, **_lookups(4, 16)))
    assert choice.proposer == "ngram" and int(choice) == 16
    # no suffix match now, or a proposer set without it: never the suffix
    live, costs = _stats(16, 1)
    for policy_, ctx in ((policy, _lookups(0, 0)),
                         (CostModelPolicy(proposers="draft+ngram"), _lookups(4, 16))):
        choice = policy_.choose(Context(**CTX, live=live, costs=costs, **ctx))
        assert getattr(choice, "proposer", "draft") != "suffix"


def test_a_proposer_set_that_names_no_known_proposer_is_refused():
    assert CostModelPolicy(proposers="draft+suffix").proposers == "draft+suffix"
    with pytest.raises(ValueError, match="'draft\\+suffix'"):
        CostModelPolicy(proposers="draft+not a name")
    with pytest.raises(ValueError, match="'lookup', which no registered proposer is"):
        autospec.Controller(tiny("llama"), None, store=False, policy="auto:draft+lookup")


def test_at_batch_the_suffix_drafts_for_the_rows_it_matches():
    costs = grid_costs()
    live, _ = _stats(16, 0, table=costs)  # the lookups' time measured at batch 1
    policy = CostModelPolicy()
    ctx = Context(category="c", k_max=16, batch_size=4, remaining=48,
                  costs=costs.at("eager", 4),
                  categories=("c",) * 4, rows=(live,) * 4,
                  proposers=("draft", "ngram", "suffix"), whole=("suffix",),
                  matches={"ngram": (3, 3, 0, 0), "suffix": (4, 4, 4, 0)},
                  sizes={"ngram": (16,) * 4, "suffix": (16, 12, 8, 0)})
    # the unmatched row is about to finish: the rows that set the batch's end are the
    # suffix's, and it drafts for them
    ending = replace(ctx, remaining_rows=(48, 48, 48, 2))
    choice = policy.choose(ending)
    assert choice.proposer == "suffix" and int(choice) >= 3  # B·(k + 1) ≤ 16 is flat here
    # with as many tokens left as the others, the unmatched row sets the end: on costs flat in
    # the rows (a row leaving early saves nothing), the suffix's block gains the call nothing
    # and the draft model, serving every row, drafts
    assert getattr(policy.choose(ctx), "proposer", "draft") == "draft"
    no_suffix = policy.choose(replace(ending, matches={"ngram": (3, 3, 0, 0),
                                                       "suffix": (0,) * 4},
                                      sizes={"ngram": (16,) * 4, "suffix": (0,) * 4}))
    assert getattr(no_suffix, "proposer", "draft") != "suffix"


@pytest.fixture(scope="module")
def target():
    return tiny("llama", layers=2, seed=5)


@pytest.mark.parametrize("with_draft", [False, True], ids=["alone", "with-draft"])
def test_auto_with_the_suffix_is_generates_and_serves_a_repeated_request_from_memory(
        target, with_draft):
    draft = noisy_copy(target, 0.1) if with_draft else None
    spec = autospec.Controller(target, draft, store=False, suffix=True)
    ids = _requests(1, seed=3)[0]
    ref = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    served = []
    for _ in range(3):
        out = spec.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None,
                            category="tools")
        assert torch.equal(out, ref)
        st = spec.last_stats
        served.append((st.proposer("suffix").proposed, st.proposer("suffix").accepted, st.iterations))
    # the first request taught the suffix's statistics (its blocks or its shadow) ...
    assert spec.live["tools"].counts("suffix")[1][0] > 0
    # ... and the repeats are drafted from the first one's output (prompt lookup copies
    # too: the tiny target repeats itself), almost all of it kept, in far fewer iterations
    # than tokens (how few follows auto's k, which prices measured timings: load moves it)
    for drafted, accepted, iterations in served[1:]:
        assert accepted > 0 and accepted >= 0.9 * drafted
        assert iterations < 20 < 40


def test_auto_with_the_suffix_at_batch_is_generates(target):
    spec = autospec.Controller(target, None, store=False, suffix=True)
    reqs = _requests(6, seed=1)
    for ids in reqs[:3]:  # earlier requests of the category, one of them repeated below
        spec.generate(ids, max_new_tokens=24, do_sample=False, category="sql")
    ids = torch.cat([reqs[0], reqs[4], reqs[5]])
    rows = batch_is_generates(spec, target, ids, torch.ones_like(ids))
    assert rows[0].proposer("suffix").accepted > 0  # the repeated row, from the memory


def test_auto_over_a_proposer_set_is_a_policy_name_and_opens_the_suffix_memory(target):
    from autospec.policies import as_policy

    assert as_policy("auto:draft+suffix").proposers == "draft+suffix"
    assert as_policy("auto:ngram").name == "auto:ngram"
    with pytest.raises(ValueError, match="no registered proposer"):
        autospec.Controller(target, None, store=False, policy="auto:lookup")
    assert autospec.Controller(target, None, store=False, policy="auto:ngram+suffix"
                               ).suffix_memory is not None
    assert autospec.Controller(target, None, store=False, policy="auto:ngram"
                               ).suffix_memory is None
    spec = autospec.Controller(target, None, store=False, policy="auto:ngram")
    ids = _requests(1, seed=3)[0]
    for _ in range(2):
        spec.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
        assert spec.last_stats.proposer("suffix").proposed == 0


def test_a_request_the_suffix_drafted_is_stored_with_its_proposers(target, tmp_path):
    """The store takes a record whose iterations the suffix proposer drafted (its name in
    its proposer schedule) — before, the writer refused it and the request was lost."""
    from autospec.store import open_store, queries

    db = f"sqlite:///{tmp_path / 's.db'}"
    spec = autospec.Controller(target, None, store=db, policy="suffix:8")
    ids = _requests(1, seed=3)[0]
    for _ in range(2):
        spec.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                      category="tools")
    st = spec.last_stats
    spec.close()
    assert "suffix" in st.proposer_schedule
    with open_store(db) as store, store.session() as s:
        rows = queries.recent_requests(s)
    assert len(rows) == 2
    assert rows[0].proposer_schedule == st.proposer_schedule  # who drafted, by name
    assert rows[0].proposers["suffix"].blocks == st.proposer_schedule.count("suffix") > 0


def test_a_tuned_suffix_policy_opens_the_suffix_memory(target):
    """A category tuned to a proposer set with suffix decoding: a controller serving
    ``policy="tuned"`` opens the suffix memory on its next call (else the tuned suffix blocks
    would be plain steps)."""
    from types import SimpleNamespace

    from autospec.policies import as_policy
    from autospec.policies.base import wanted

    tuned = as_policy("tuned")
    spec = autospec.Controller(target, None, store=False, policy=tuned)
    assert spec.suffix_memory is None and "suffix" not in wanted(tuned)
    row = SimpleNamespace(id=1, category="tools", family="costmodel",
                          params={"proposers": "ngram+suffix"})
    tuned.attach(lambda after: [row] if after < 1 else [])
    assert "suffix" in wanted(tuned)
    ids = _requests(1, seed=3)[0]
    for _ in range(2):
        spec.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                      category="tools")
    assert spec.suffix_memory is not None and spec.last_stats.proposer("suffix").proposed > 0
    tuned.close()
    assert "suffix" in wanted(as_policy("suffix:3+stop=0.5"))
