"""Suffix decoding's blocks and its trace: what the target scores, and what the store keeps so
that replay can price the suffix proposer (``autospec.suffix.suffix_trace``)."""

from __future__ import annotations

from collections import Counter

import pytest
from test_suffix import _requests

import autospec
from autospec.traces import PROPOSER_CODES

from conftest import tiny


@pytest.fixture(scope="module")
def target():
    return tiny("llama", layers=2, seed=5)


def test_the_target_scores_no_wider_than_the_longest_suffix_draft(target):
    """``"suffix:8"`` where the drafts hold fewer tokens (a short match, its own length rule):
    the target scores each iteration's longest draft + 1 tokens, never 8 + 1."""
    spec = autospec.Controller(target, None, store=False, policy="suffix:8")
    for ids in _requests(3):
        spec.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                      category="sql")
    st = spec.last_stats
    short = [k for k, p in zip(st.k_schedule, st.proposer_schedule)
             if p == PROPOSER_CODES["suffix"] and k < 8]
    assert short  # drafts shorter than the policy's k
    # one forward per iteration after the prefill, timed under the width it scored
    scored = Counter(k + 1 for k in st.k_schedule[1:])
    assert {n: len(times) for n, times in st.target_s_by_n.items()} == scored
