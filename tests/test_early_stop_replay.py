"""Draft-side early stopping, made tunable: the loop records the draft's confidence beside the
acceptance trace, and replay applies any threshold to it with the live loop's own rule."""

from __future__ import annotations

import pytest
import torch

import autospec
from autospec.policies import FixedK
from autospec.policies.base import EarlyStop
from autospec.store import queries
from autospec.store.record import UNOBSERVED
from autospec.tune.replay import Costs, replay_greedy, simulate

from conftest import noisy_copy, prompt, tiny

N = 40


@pytest.fixture(scope="module")
def pair():
    target = tiny("llama", sharpen=30.0)
    return target, noisy_copy(target, 0.4)


def draft_confidence(draft, out: torch.Tensor, L: int) -> list[int]:
    """round(254 · max q) of the draft at each generated position, from the target's prefix."""
    with torch.no_grad():
        probs = draft(out).logits[0, L - 1 : -1].float().softmax(-1)
    return (probs.max(-1).values * 254).round().to(torch.int64).tolist()


def test_confidence_is_the_drafts_top_probability_where_it_ran_on_the_prefix(pair, tmp_path):
    target, draft = pair
    spec = autospec.Controller(target, draft, store=f"sqlite:///{tmp_path / 'c.db'}")
    ids = prompt(10, seed=3)
    out = spec.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=None, k=4)
    st = spec.last_stats
    conf, trace = st.confidence, st.trace
    assert len(conf) == len(trace) == N
    # greedy: the draft ran on the target's prefix exactly where the trace is observed
    assert [c != UNOBSERVED for c in conf] == [v != UNOBSERVED for v in trace]
    direct = draft_confidence(draft, out, ids.shape[1])
    seen = [i for i, c in enumerate(conf) if c != UNOBSERVED]
    assert len(seen) >= N - 2
    assert all(abs(conf[i] - direct[i]) <= 1 for i in seen), [(conf[i], direct[i]) for i in seen]
    assert len(set(conf[i] for i in seen)) > 3  # not a constant: the test can tell
    spec.writer.flush(timeout=30)
    with spec.store.session() as s:
        (row,) = list(queries.traces(s))
    assert row.confidence == conf and row.trace == trace


@pytest.mark.parametrize("threshold", [0.5, 0.8, 0.95])
def test_replayed_early_stopping_accepts_exactly_what_the_live_loop_accepted(pair, threshold,
                                                                              tmp_path):
    """A trace recorded at k = 4 without stopping, replayed with a threshold, gives the
    accepted length of every block a live run with that threshold had; the drafted count is
    the live one or more (past a rejection the draft's confidence was not recorded)."""
    target, draft = pair
    # the confidence is recorded for the store: without one it is not computed
    spec = autospec.Controller(target, draft, store=f"sqlite:///{tmp_path / 'r.db'}")
    live_stopped = 0
    for seed in range(3):
        ids = prompt(10, seed=seed)
        spec.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=None, k=4)
        trace, conf = spec.last_stats.trace, spec.last_stats.confidence
        spec.policy = EarlyStop(FixedK(4), threshold)
        try:
            spec.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=None)
        finally:
            spec.policy = autospec.policies.as_policy("auto")
        live_acc, live_k = spec.last_stats.accepted_schedule, spec.last_stats.k_schedule
        drafted: list[int] = []
        replayed = replay_greedy(trace, 4, N, confidence=conf, early_stop=threshold,
                                 drafted=drafted)
        assert replayed == live_acc[: len(replayed)] and len(replayed) >= len(live_acc) - 2
        for d, k, m in zip(drafted, live_k, replayed):
            assert d >= k
            if m >= k - 1:  # every stop decision of the live block was on the prefix
                assert d == k
        live_stopped += sum(1 for k in live_k[: len(replayed)] if 0 < k < 4)
        # without confidences replay cannot stop early: what it replays is the k = 4 run
        blind: list[int] = []
        plain: list[int] = []
        assert replay_greedy(trace, 4, N, early_stop=threshold, drafted=blind) == \
            replay_greedy(trace, 4, N, drafted=plain)
        assert blind == plain
    assert live_stopped > 0  # the threshold bit somewhere: the comparison means something


def test_simulated_early_stopping_saves_draft_time_on_traces_with_confidence():
    """Synthetic traces where the draft is unsure exactly where it is wrong: a threshold
    between the two confidence levels drafts less and loses no accepted token."""
    trace = bytes([1, 1, 0, 1, 1, 1, 0, 1] * 12)
    conf = bytes(250 if v else 60 for v in trace)  # 0.98 where right, 0.24 where wrong
    costs = Costs(t_draft=0.05, t_target={1: 0.1, 9: 0.11})
    base = simulate([("greedy", trace, conf)], FixedK(8), costs)
    stop = simulate([("greedy", trace, conf)], EarlyStop(FixedK(8), 0.5), costs)
    blind = simulate([("greedy", trace)], EarlyStop(FixedK(8), 0.5), costs)
    assert stop.accepted == base.accepted and stop.tokens == base.tokens
    assert stop.drafted < base.drafted and stop.tokens_per_s > base.tokens_per_s
    assert (blind.drafted, blind.accepted) == (base.drafted, base.accepted)


class PerCategory:
    """A per-category policy (as ``TunedPolicy``): k = 4 everywhere, stopping only in "a"."""

    name = "per-category"

    def choose(self, context):
        return 4

    def update(self, context, k, outcome):
        pass

    def early_stop_for(self, category):
        return 0.95 if category == "a" else None


def test_the_loop_takes_the_threshold_of_the_requests_category(pair):
    target, draft = pair
    spec = autospec.Controller(target, draft, store=False, policy=PerCategory())
    ids = prompt(10, seed=1)
    shortened = {}
    for cat in ("a", "b"):
        out = spec.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=None,
                            category=cat)
        assert torch.equal(out, target.generate(ids, max_new_tokens=N, do_sample=False,
                                                eos_token_id=None))
        st, g, short = spec.last_stats, 0, 0
        for k, m in zip(st.k_schedule, st.accepted_schedule):
            short += k < min(4, N - g - 1)  # fewer than k = 4 where there was room for 4
            g += m + 1
        shortened[cat] = short
    assert shortened["a"] > 0 and shortened["b"] == 0


@pytest.mark.parametrize("do_sample", [False, True])
def test_the_drafts_confidence_is_computed_only_where_it_is_used(pair, tmp_path, do_sample):
    """Without a store and without early stopping nothing reads the draft's confidence: no
    vocabulary-wide softmax runs for it (greedy: none at all) and none is recorded; with a
    store it is recorded; early stopping without a store still stops."""
    from opcount import OpCounter

    target, draft = pair
    V = target.config.vocab_size
    ids = prompt(10, seed=3)
    kw = dict(max_new_tokens=N, do_sample=do_sample, eos_token_id=None)
    bare = autospec.Controller(target, draft, store=False)
    with OpCounter(width=V) as ops:
        bare.generate(ids, k=4, generator=torch.Generator().manual_seed(0), **kw)
    plain = ops
    if not do_sample:
        assert plain.counts["softmax"] == 0, plain.counts
    assert bare.last_stats.confidence == b""
    stored = autospec.Controller(target, draft, store=f"sqlite:///{tmp_path / 's.db'}")
    with OpCounter(width=V) as ops:
        stored.generate(ids, k=4, generator=torch.Generator().manual_seed(0), **kw)
    assert len(stored.last_stats.confidence) == N
    # the work is the confidence's: greedy, a softmax per draft token; sampled, a maximum of q
    if do_sample:
        assert ops.every["max"] > plain.every["max"]
    else:
        assert ops.counts["softmax"] > 0
    stored.close()
    stopping = autospec.Controller(target, draft, store=False, policy=EarlyStop(FixedK(4), 0.95))
    stopping.generate(ids, generator=torch.Generator().manual_seed(0), **kw)
    assert 0 < min(k for k in stopping.last_stats.k_schedule if k) < 4
    assert stopping.last_stats.confidence == b""


def test_a_batch_computes_the_drafts_confidence_only_for_a_store(pair, tmp_path):
    """The batched loop, greedy: no softmax of the draft's without a store; recorded with one."""
    from opcount import OpCounter

    target, draft = pair
    ids = torch.cat([prompt(10, seed=3), prompt(10, seed=4)])
    kw = dict(max_new_tokens=N, do_sample=False, eos_token_id=None,
              attention_mask=torch.ones_like(ids))
    bare = autospec.Controller(target, draft, store=False)
    with OpCounter(width=target.config.vocab_size) as ops:
        bare.generate(ids, k=4, **kw)
    assert ops.counts["softmax"] == 0, ops.counts
    assert all(st.confidence == b"" for st in bare.last_row_stats)
    stored = autospec.Controller(target, draft, store=f"sqlite:///{tmp_path / 'b.db'}")
    stored.generate(ids, k=4, **kw)
    assert all(len(st.confidence) == N for st in stored.last_row_stats)
    stored.close()
