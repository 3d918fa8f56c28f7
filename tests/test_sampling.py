"""sampling.py against transformers' own logits processors, position by position."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from autospec.engine.sampling import (
    SamplingConfig,
    block_presence,
    logits_to_probs,
    process_logits,
    seen_tokens,
)

V = 50


def reference(logits_row, ids, cfg: SamplingConfig):
    """What generate computes for one position: transformers' processors in its order."""
    procs = []
    if cfg.repetition_penalty not in (None, 1.0):
        procs.append(RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    if cfg.do_sample:
        if cfg.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(cfg.temperature))
        if cfg.top_k:
            procs.append(TopKLogitsWarper(cfg.top_k))
        if cfg.top_p is not None:
            procs.append(TopPLogitsWarper(cfg.top_p))
        if cfg.min_p is not None:
            procs.append(MinPLogitsWarper(cfg.min_p))
    scores = logits_row[None].clone()
    for p in procs:
        scores = p(ids, scores)
    return scores[0]


CONFIGS = [
    SamplingConfig(),
    SamplingConfig(repetition_penalty=1.3),
    SamplingConfig(do_sample=True, temperature=0.7),
    SamplingConfig(do_sample=True, top_k=5),
    SamplingConfig(do_sample=True, temperature=1.3, top_p=0.8),
    SamplingConfig(do_sample=True, min_p=0.1),
    SamplingConfig(do_sample=True, temperature=0.6, top_k=20, top_p=0.9, min_p=0.05,
                   repetition_penalty=1.2),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_block_processing_matches_transformers_one_position_at_a_time(cfg):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, V, (1, 12), generator=g)
    block = torch.randint(0, V, (1, 4), generator=g)  # 4 draft tokens → 5 positions
    logits = torch.randn(1, 5, V, generator=g) * 3
    seen = block_presence(seen_tokens(prefix, V), block, 5)
    ours = process_logits(logits, cfg, seen=seen)
    for j in range(5):
        ids = torch.cat([prefix, block[:, :j]], dim=1)  # what generate sees at position j
        ref = reference(logits[0, j], ids, cfg)
        assert torch.equal(torch.isinf(ours[0, j]), torch.isinf(ref)), j
        finite = torch.isfinite(ref)
        torch.testing.assert_close(ours[0, j][finite], ref[finite])


def test_greedy_probs_are_one_hot_at_the_first_maximum():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.5]]])
    probs = logits_to_probs(process_logits(logits, SamplingConfig()), SamplingConfig())
    assert probs.tolist() == [[[0.0, 1.0, 0.0, 0.0]]]


# EOS suppression before min_new_tokens is checked where the loop applies it, against
# generate's MinNewTokensLengthLogitsProcessor: test_sampled_exact.py (per-position scores and
# the sampled joint law).


def test_from_generation_config_ignores_warpers_when_greedy():
    gc = GenerationConfig(do_sample=False, temperature=0.5, top_k=3, repetition_penalty=1.1)
    cfg = SamplingConfig.from_generation_config(gc)
    assert cfg == SamplingConfig(do_sample=False, repetition_penalty=1.1)


@pytest.mark.parametrize("bad", [dict(do_sample=True, temperature=0.0), dict(top_p=1.5),
                                 dict(top_k=-1), dict(repetition_penalty=0.0)])
def test_invalid_settings_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


def _topk_topp_rows(seed: int, rows: int = 64, vocab: int = 4096):
    """Random logits [rows, vocab]: half continuous, half rounded to a coarse grid (many ties,
    as bf16 logits have), some rows entirely equal; with a top_k and top_p per batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[rows // 2 :] = (x[rows // 2 :] * 2).round() / 2
    x[-2:] = 1.5  # every token tied
    k = int(torch.randint(1, 80, (1,), generator=g))
    top_p = float(torch.rand(1, generator=g)) * 0.98 + 0.01
    return x, k, top_p


@pytest.mark.parametrize("seed", range(12))
def test_top_p_over_the_top_k_values_is_transformers_top_k_then_top_p(seed):
    """Top-p computed over the top-k candidates (no vocabulary-wide sort) equals transformers'
    TopKLogitsWarper + TopPLogitsWarper and the full-sort path, ties included."""
    from autospec.engine.sampling import FAST_TOP_P_VOCAB, _top_k_top_p, _top_p_full_sort

    x, k, top_p = _topk_topp_rows(seed)
    assert x.shape[-1] >= FAST_TOP_P_VOCAB  # process_logits takes the top-k path
    want = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(k)(None, x.clone()))
    got = process_logits(x[:, None], SamplingConfig(do_sample=True, top_k=k, top_p=top_p))[:, 0]
    assert torch.equal(got, want)
    assert torch.equal(_top_k_top_p(x, k, top_p), want)
    for r in range(x.shape[0]):  # row by row: rows without a cut between ties skip the sort
        assert torch.equal(_top_k_top_p(x[r : r + 1], k, top_p), want[r : r + 1]), r
    kth = torch.topk(x, k, dim=-1).values[..., -1:]
    assert torch.equal(_top_k_top_p(x, k, top_p),
                       _top_p_full_sort(x.masked_fill(x < kth, float("-inf")), top_p))


@pytest.mark.parametrize("seed", range(12))
def test_top_p_over_the_top_k_values_resolves_ties_as_a_stable_sort(seed):
    """Without the CPU's fallback (the path a GPU takes), a cut between equal scores keeps the
    tied tokens a stable ascending sort keeps: the highest ids."""
    from autospec.engine.sampling import _top_k_top_p

    x, k, top_p = _topk_topp_rows(seed)
    kept = x.masked_fill(x < torch.topk(x, k, dim=-1).values[..., -1:], float("-inf"))
    srt, order = torch.sort(kept, dim=-1, stable=True)
    drop = srt.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    drop[..., -1:] = False
    want = kept.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    assert torch.equal(_top_k_top_p(x, k, top_p, exact_ties=False), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("vocab", [4096, 151936])
def test_top_p_over_the_top_k_values_is_transformers_on_cuda(vocab):
    """On CUDA the fast path takes no fallback (a host sync per draft token): its tie rule
    must be what CUDA's sort does for TopPLogitsWarper."""
    for seed in range(8):
        x, k, top_p = _topk_topp_rows(seed, vocab=vocab)
        x = x.cuda()
        want = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(k)(None, x.clone()))
        cfg = SamplingConfig(do_sample=True, top_k=k, top_p=top_p)
        assert torch.equal(process_logits(x[:, None], cfg)[:, 0], want)
