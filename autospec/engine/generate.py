"""The engine's entry: generate B prompts exactly as ``target.generate`` would, speculating.

``run`` sets up a ``Batch`` (the rows, the target's slot cache and a proposer per name the
pair can use: the draft model where there is one, prompt lookup always), runs ``step`` until
every row has finished, and returns each row's result. Batch 1 is a batch of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autospec.engine.batch import Batch, CallView, LoopResult
from autospec.engine.proposers import registered
from autospec.engine.runners import Forward, crop_cache
from autospec.engine.sampling import SamplingConfig
from autospec.engine.step import step

__all__ = ["run", "speculative_generate", "generated_cache", "usable", "EngineResult"]


@dataclass
class EngineResult:
    rows: list[LoopResult]  # one per prompt, in input order; sequences [1, L_i + new_i]
    peak_kv_bytes: int  # the largest target + draft KV the call held at once
    wall_s: float
    cache: object = None  # batch 1, eager: the target's cache (its tokens but the last)


def run(target, draft, prompts: list[torch.Tensor], *, sampling: SamplingConfig, policy,
        max_new_tokens: int, categories: list[str] | None = None, lives: list | None = None,
        keep_cache: bool = False, **options) -> EngineResult:
    """Generate ``prompts`` (each [1, L_i], padding removed) with ``draft`` (None: prompt
    lookup alone) exactly as ``target.generate`` would.

    categories / lives: each row's traffic category and its ``LiveStats`` (fed every
    iteration, shown to the policy); keep_cache: return the target's cache at batch 1 on
    the eager path (``generated_cache`` builds generate's cache elsewhere). Options
    (``Batch``): costs (the pair's ``autospec.costs.table.CostTable``, fed every iteration
    at the call's execution path and the rows running; None: one for this call), forecasts
    (each row's acceptance forecast), min_new_tokens, eos_token_ids, stopping_criteria (called
    per row with its left padding, ``row_prefix``, then its tokens, as generate passes its
    padded row), streamer (batch 1), generator, k_max, target_context, draft_context,
    output_scores, output_logits, row_prefix, record_confidence (the draft's top
    probability per token, for the store), memory (the category memory of earlier outputs,
    ``autospec.suffix.SuffixMemory``: proposers that need it open with it), options (by
    proposer name, what ``wrap`` gave it: prompt lookup's index factory, ``tokens -> index``),
    static_cache and cuda_graphs (batch 1:
    a static KV cache reused across requests, its forwards replayed from CUDA graphs),
    explain ("all": every iteration's decision record, "sample": ``batch.WHY_KEPT``'s sample,
    None: none; on each row's ``LoopStats.decisions``)."""
    B = len(prompts)
    opening = usable(draft is not None, options.get("memory") is not None)
    batch = Batch(target, draft, prompts, sampling=sampling, policy=policy,
                  max_new_tokens=max_new_tokens, categories=categories or ["default"] * B,
                  lives=lives or [None] * B,
                  hidden_states=any("hidden_states" in c.needs for c in opening.values()),
                  **options)
    try:
        view = CallView(batch)
        for name, cls in opening.items():
            batch.proposers[name] = cls(view)
        batch.opened()
        with torch.inference_mode():
            while batch.rows:
                step(batch)
        rows = batch.results()
        cache = None
        if keep_cache and B == 1 and not batch.static:
            cache = batch.target_slots.runner.cache
            crop_cache(cache, rows[0].stats.prompt_tokens + rows[0].stats.new_tokens - 1)
    finally:
        for proposer in batch.proposers.values():
            proposer.release()
        batch.target_slots.release()
        batch.proposers = {}  # they refer to the batch: no cycle left for the collector
        batch.opened()
    return EngineResult(rows=rows, peak_kv_bytes=batch.peak_kv, wall_s=_wall(batch),
                        cache=cache)


def usable(has_draft: bool, has_memory: bool) -> dict:
    """The registered proposers (``autospec.engine.proposers``) a call can open, by name,
    the model proposer first: those whose needs it meets (the draft model, the category
    memory; the target's hidden states always)."""
    have = {"hidden_states"} | ({"draft_model"} if has_draft else set()) | (
        {"memory"} if has_memory else set())
    found = {n: c for n, c in registered().items() if set(c.needs) <= have}
    return dict(sorted(found.items(), key=lambda item: item[1].kind != "model"))


def generated_cache(model, sequences: torch.Tensor, pads: list[int], mask=None):
    """The cache ``generate`` returns beside ``sequences`` [B, W] (left-padded, row b by
    ``pads[b]`` tokens; ``mask``: the input's attention mask where it has holes): a
    DynamicCache as generate makes it, holding every token but the last at generate's
    positions and mask (padding and holes masked, every later token attended to, finished
    rows' padding included), built by one forward of ``model``."""
    from transformers import DynamicCache

    ids = sequences[:, :-1]
    cols = torch.arange(ids.shape[1], device=ids.device)
    if mask is not None:
        grown = torch.ones(ids.shape, dtype=torch.long, device=ids.device)
        grown[:, : mask.shape[1]] = mask
        mask = grown
    else:
        mask = (cols[None] >= torch.tensor(pads, device=ids.device)[:, None]).long()
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate's position ids
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    with torch.no_grad():
        Forward(model)(ids, cache, 1, attention_mask=mask, position_ids=pos)
    return cache


def speculative_generate(target, draft, input_ids: torch.Tensor, *, sampling: SamplingConfig,
                         policy, max_new_tokens: int, category: str = "default", live=None,
                         **options) -> LoopResult:
    """One prompt ([1, L]): ``run`` with a batch of one, its row's result."""
    res = run(target, draft, [input_ids], sampling=sampling, policy=policy,
              max_new_tokens=max_new_tokens, categories=[category], lives=[live], **options)
    return res.rows[0]


def _wall(batch) -> float:
    import time

    return time.perf_counter() - batch.t_start
