"""scripts/oracle_bound.py: the least time any per-iteration choice could take, knowing every
outcome, by a dynamic programme over positions — checked on traces small enough to price by
hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from autospec.traces import NGRAM_NONE, encode_trace_value

SPEC = importlib.util.spec_from_file_location(
    "oracle_bound", Path(__file__).resolve().parents[1] / "scripts" / "oracle_bound.py")
oracle_bound = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(oracle_bound)


class Flat:
    """T_t(n) = 1 s whatever n, T_d = 0.1 s."""

    t_draft = 0.1

    def __call__(self, n: int) -> float:
        return 1.0


N = 10  # positions 0 … 9; position 0 is the prefill's


def _suffix(at: dict[int, tuple[int, int]]) -> bytes:
    """A suffix trace with (agreeing tokens, draft length) at the given positions."""
    out = bytearray()
    for p in range(N):
        agree, size = at.get(p, (0, 0))
        out += bytes([encode_trace_value(3, agree), size] if size else [NGRAM_NONE, 0])
    return bytes(out)


def test_the_oracle_stops_each_block_where_acceptance_ends():
    draft = bytes([255] + [1] * 9)
    ngram = bytes([NGRAM_NONE] * N)
    none = _suffix({})
    # one draft block of 8 from position 1, all accepted, and the target's token: 9 tokens
    assert oracle_bound.oracle(N, draft, none, ngram, {"draft"}, Flat()) == pytest.approx(1.8)
    assert oracle_bound.oracle(N, draft, none, ngram, set(), Flat()) == pytest.approx(9.0)
    # the draft model misses at position 4: 3 accepted + the target's, then 5 more
    draft = bytes([255, 1, 1, 1, 0, 1, 1, 1, 1, 1])
    assert oracle_bound.oracle(N, draft, none, ngram, {"draft"}, Flat()) == pytest.approx(
        (0.3 + 1) + (0.4 + 1))


def test_a_suffix_draft_continued_by_the_draft_model_only_with_hybrid():
    draft = bytes([255, 0, 0, 0, 0, 0, 1, 1, 1, 1])  # the draft model helps only late
    ngram = bytes([NGRAM_NONE] * N)
    sfx = _suffix({1: (5, 5)})  # at position 1 a 5-token suffix draft, all right
    t = oracle_bound.T_LOOKUP
    # suffix block: 5 + 1 tokens to position 7; then the draft model, 2 + 1 to the end
    assert oracle_bound.oracle(N, draft, sfx, ngram, {"draft", "suffix"}, Flat()) == \
        pytest.approx(t + 1 + 0.2 + 1)
    # hybrid: the suffix's 5, the draft model's 3 after them, the target's token: one forward
    assert oracle_bound.oracle(N, draft, sfx, ngram, {"draft", "suffix", "hybrid"},
                               Flat()) == pytest.approx(t + 0.3 + 1)
    # prompt lookup's block holds what its trace says agreed
    ngram = bytes([NGRAM_NONE, encode_trace_value(2, 8)] + [NGRAM_NONE] * 8)
    assert oracle_bound.oracle(N, draft, sfx, ngram, {"ngram"}, Flat()) == pytest.approx(t + 1)
