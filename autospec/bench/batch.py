"""The benchmark at batch > 1: prompts grouped as a server groups them, every mode on the same
batches.

At batch size B the prompts are sorted by token length and cut into consecutive batches of B
(the last may hold fewer), each left-padded with an attention mask as transformers users pass
batches to ``generate``. For each repeat, for each batch, every mode runs once (the order
rotated, as at batch 1), so that machine noise hits all modes alike. A mode that refuses a
batch (transformers' assisted generation does at B > 1) is reported "unsupported" with its
reason; the benchmark goes on without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from autospec.bench.stats import BatchRecord

log = logging.getLogger(__name__)

__all__ = ["Batch", "parse_int_list", "parse_batch_sizes", "make_batches", "run_batched", "until_stop",
           "batch_stats", "DEFAULT_TABLE"]

DEFAULT_TABLE = "table:1-2:4,3-8:2,9-:0"  # the engines' hand-written batch size → k table


def parse_int_list(text: str, what: str, example: str) -> list[int]:
    """``"1,4,16"`` → [1, 4, 16] as typed; ValueError naming ``what`` (one item, e.g. "batch
    size") and ``example`` for anything else: a word, an empty list, or an empty item
    (``"1,,4"``, ``"1,4,"``) — a typo is refused, not read as the list without it."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise ValueError(f"expected at least one {what}, like {example}")
    if not all(parts):
        raise ValueError(f"an empty item in {text!r}: expected comma-separated {what}s like "
                         f"{example}")
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"expected comma-separated {what}s like {example}, got {text!r}"
                         ) from None


def parse_batch_sizes(text: str, limit: int = 4096) -> list[int]:
    """``"1,4,16"`` → [1, 4, 16] (sorted, each once); ValueError with a message fit for a user
    (an empty item, as in ``"1,,4"`` or ``"1,4,"``, is refused: it is a typo, not a size)."""
    sizes = parse_int_list(text, "batch size", "1,4,16")
    bad = [b for b in sizes if not 1 <= b <= limit]
    if bad:
        raise ValueError(f"every batch size must be in 1..{limit}, got {bad}")
    return sorted(set(sizes))


@dataclass(frozen=True)
class Batch:
    indices: tuple[int, ...]  # prompt indices, shortest prompt first
    input_ids: object  # torch.Tensor [B, L], left-padded
    attention_mask: object  # torch.Tensor [B, L], 0 over the padding


def make_batches(encoded: Sequence, batch_size: int, tokenizer) -> list[Batch]:
    """Prompts (token ids [1, L_i] each) sorted by length (ties: file order) and grouped into
    consecutive batches of ``batch_size``, left-padded by the tokenizer with an attention mask.
    The tokenizer pads with its pad token, else with EOS; its settings are left as they were."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    order = sorted(range(len(encoded)), key=lambda i: (encoded[i].shape[-1], i))
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    if pad is None and tokenizer.eos_token is None:
        raise ValueError("the tokenizer has neither a pad token nor an EOS token to pad with")
    try:
        tokenizer.padding_side = "left"
        if pad is None:
            tokenizer.pad_token = tokenizer.eos_token
        batches = []
        for start in range(0, len(order), batch_size):
            idx = tuple(order[start:start + batch_size])
            enc = tokenizer.pad({"input_ids": [encoded[i][0].tolist() for i in idx]},
                                padding=True, return_tensors="pt")
            batches.append(Batch(idx, enc["input_ids"], enc["attention_mask"]))
    finally:
        tokenizer.padding_side = side
        if pad is None:
            tokenizer.pad_token = None
    return batches


def until_stop(tokens: list[int], eos: Sequence[int]) -> list[int]:
    """A row's new tokens up to and including its first EOS (the padding after it dropped)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def batch_stats(stats) -> dict:
    """Counters of a batched autospec call (``Controller.last_stats``: the batch's LoopStats,
    or one per row), as BatchRecord fields; peak KV None where the loop does not report it."""
    if stats is None:
        return {}
    rows = list(stats) if isinstance(stats, (list, tuple)) else [stats]
    peaks = [getattr(s, "peak_kv_bytes", 0) or 0 for s in rows]
    return {"drafted": sum(s.drafted for s in rows), "accepted": sum(s.accepted for s in rows),
            "k_schedule": list(rows[0].k_schedule), "peak_kv_bytes": max(peaks) or None}


def run_batched(runner, batches: list[Batch], modes: list, *, batch_size: int, categories,
                repeats: int, max_new_tokens: int, seed: int, warmup: bool, bar
                ) -> tuple[list[BatchRecord], dict[tuple[int, str], str]]:
    """Every mode on every batch ``repeats`` times, interleaved; returns the records and the
    modes that refused this batch size ((batch size, mode name) → reason).

    runner: bench._Runner; categories: each prompt's category, by prompt index.
    """
    unsupported: dict[tuple[int, str], str] = {}
    records: list[BatchRecord] = []

    def attempt(mode, batch: Batch, new: int, run_seed: int):
        if (batch_size, mode.name) in unsupported:
            return None
        cats = [categories[i] for i in batch.indices]
        try:
            return runner.run(mode, batch.input_ids, new, run_seed, cats,
                              attention_mask=batch.attention_mask)
        except Exception as e:
            if mode.kind != "hf-assisted" or len(batch.indices) == 1:
                raise
            # transformers refuses assisted generation at batch > 1: report, do not stop
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.info("bench: %s unsupported at batch %d: %s", mode.name, batch_size, reason)
            unsupported[(batch_size, mode.name)] = reason
            return None

    if warmup and batches:  # allocation and lazy setup at this batch shape, untimed
        for mode in modes:
            attempt(mode, batches[0], min(8, max_new_tokens), seed)
    for rep in range(repeats):
        for g, batch in enumerate(batches):
            shift = (rep + g) % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                bar.set_postfix_str(f"batch {batch_size} #{g} {mode.name}", refresh=False)
                out = attempt(mode, batch, max_new_tokens, seed + 1000 * rep + g)
                if out is not None:
                    records.append(BatchRecord(
                        batch=batch_size, group=g, prompt_indices=list(batch.indices),
                        repeat=rep, mode=mode.name, k=mode.k, **out))
                bar.update()
    return records, unsupported
