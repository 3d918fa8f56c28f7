"""Opt-in: ``autospec.suffix`` against Arctic Inference's own suffix tree (the C++ one vLLM's
``method: "suffix"`` runs), on the same sequences and contexts: the same draft tokens and
match length. Skipped unless ``arctic_inference`` imports (it is not one of autospec's
dependencies: its only release on PyPI is a source archive that builds with a C++20
compiler, CMake, nanobind and torch already installed; see docs/proposers.md). Runs without
the suite's conftest (no torch needed):

    python -m pytest --noconftest tests/test_suffix_arctic.py
"""

from __future__ import annotations

import random

import pytest

from autospec.suffix import SuffixIndex, SuffixSettings

_C = pytest.importorskip("arctic_inference.suffix_decoding._C",
                         reason="arctic_inference is not installed")

DEPTH = 24


def _sequences(seed: int) -> list[list[int]]:
    """A few short sequences over a small vocabulary, sharing phrases: places per seed stay
    below autospec's 64 and matches below half the tree depth, where both index the same."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(4, 40) for _ in range(rng.randint(2, 5))] for _ in range(6)]
    return [[t for _ in range(rng.randint(2, 4)) for t in rng.choice(phrases)]
            + [rng.randrange(4, 40) for _ in range(rng.randint(0, 3))] for _ in range(5)]


@pytest.mark.parametrize(("factor", "min_prob"), [(1.0, 0.1), (2.0, 0.0), (1.0, 0.4)])
def test_the_same_draft_as_arctics_suffix_tree(factor, min_prob):
    """Finished sequences (a category's earlier outputs: Arctic's global tree) and contexts cut
    from them: the same score (the sum of the draft's path probabilities: how far and how
    surely it proposes) in all but a few cases, and the same tokens in most — where
    continuations are equally frequent (or drafts of two match lengths score the same),
    Arctic keeps its own order and autospec takes the earliest (the longest), and the walks
    part there with equal probabilities."""
    same = scored = total = 0
    for seed in range(40):
        seqs = _sequences(seed)
        tree = _C.SuffixTree(DEPTH)
        ours = SuffixIndex(SuffixSettings(max_depth=DEPTH, max_spec_factor=factor,
                                          min_token_prob=min_prob))
        for i, seq in enumerate(seqs):
            tree.extend(i, seq)
            ours.add(seq, finished=True)
        rng = random.Random(1000 + seed)
        for _ in range(20):
            src = rng.choice(seqs)
            a = rng.randrange(len(src))
            context = src[max(0, a - rng.randint(1, 6)) : a + 1]
            # Arctic matches at most len(context) - 1 tokens (its cache passes the last
            # max_depth tokens of a longer context): a token no sequence holds in front lets
            # it match them all
            theirs = tree.speculate([99] + context, 8, factor, 0.0, min_prob, False)
            toks, match, score = ours.draft(context, 8)
            total += 1
            scored += abs(score - theirs.score) < 1e-5
            same += toks == list(theirs.token_ids) and match == theirs.match_len
    assert total == 800 and scored >= 0.99 * total and same >= 0.85 * total, (scored, same)
