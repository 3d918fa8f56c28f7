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

from autospec.sampling import (
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
