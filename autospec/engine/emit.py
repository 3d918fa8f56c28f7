"""Emitting a row's new tokens, stopping exactly where ``generate`` would.

``generate`` checks, after every token: an EOS token ends the row; reaching max_new_tokens
ends it; a stopping criterion (stop strings, max_time, the caller's) stops it — but without
an EOS id to pad finished rows with, a batch runs on until every row has stopped, and every
row then has the tokens of the step where the last one stopped (``settle``).

Stopping criteria are evaluated for every emitted position of every row on the device and
read back together: one extra host read per iteration when criteria are given.
"""

from __future__ import annotations

import time

import torch

__all__ = ["criteria_hits", "emit", "settle"]


def criteria_hits(criteria, rows, new: list[list[int]], eos: set[int], tokens: torch.Tensor,
                  scores: torch.Tensor) -> list[list[bool]]:
    """Per row, whether the criteria hold after each of its new tokens (up to its first EOS),
    with one host read. ``tokens`` [B, cap] holds each row's sequence, new tokens included;
    ``scores`` [B, k+1, V] the processed scores they were chosen from; a row's criteria see
    what generate's would (``Row.as_generate``: its input row, then what it generated)."""
    if criteria is None:
        return [[] for _ in rows]
    hits, shape = [], []
    for b, (row, toks) in enumerate(zip(rows, new)):
        upto = next((j + 1 for j, t in enumerate(toks) if t in eos), len(toks))
        if row.stop_at is not None:
            upto = 0  # stopped already: it only runs on until the batch stops
        shape.append(upto)
        for j in range(1, upto + 1):
            ids = row.as_generate(tokens[b : b + 1, : row.n + j])
            hit = criteria(ids, scores[b : b + 1, j - 1])
            hits.append(hit.reshape(-1)[:1].to(tokens.device, torch.bool)
                        if isinstance(hit, torch.Tensor)
                        else torch.tensor([bool(hit)], device=tokens.device))
    flat = torch.cat(hits).tolist() if hits else []  # the one read
    out, at = [], 0
    for upto in shape:
        out.append(flat[at : at + upto])
        at += upto
    return out


def emit(row, new: list[int], hits: list[bool], eos: set[int], has_eos: bool) -> int:
    """Take ``new`` into the row up to where it stops; returns how many tokens were emitted.
    Sets ``row.finished`` and ``row.stats.stop_reason``; ``row.stop_at`` where a criterion
    hit without an EOS id (the row runs on until ``settle``)."""
    emitted, gen = 0, row.n - row.L
    for j, tok in enumerate(new):
        emitted += 1
        if tok in eos:
            row.finished, row.stats.stop_reason = True, "eos"
            break
        if hits and j < len(hits) and hits[j] and row.stop_at is None:
            row.stats.stop_reason = "stopping_criteria"
            if has_eos:
                row.finished = True
                break
            row.stop_at = gen + emitted
        if gen + emitted >= row.limit:
            row.finished = True
            row.stats.stop_reason = row.stats.stop_reason or "max_new_tokens"
            break
    row.tokens.extend(new[:emitted])
    row.n += emitted
    if row.finished:
        row.wall_end = time.perf_counter()
    return emitted


def settle(rows, limit_dev=None) -> None:
    """Without an EOS id ``generate`` stops rows only all together: at the step where the
    last row is stopped by a criterion (or at max_new_tokens), every row has that many
    tokens. Once every row of the call (``rows``: running or not) has stopped, cut every row
    past that length — a row that ran on to its limit and left the batch included — and let
    the others run to it (``limit_dev``: the running rows' limits on the device)."""
    if any(r.stop_at is None and r.stats.stop_reason != "max_new_tokens" for r in rows):
        return
    if any(r.stats.stop_reason == "max_new_tokens" for r in rows):
        return  # every row runs to max_new_tokens, as in generate
    end = max(r.stop_at for r in rows)
    for r in rows:
        if r.gen >= end:
            extra = r.gen - end
            if extra:
                del r.tokens[len(r.tokens) - extra :]
                for out in (r.scores, r.logits):
                    if out is not None:
                        del out[len(out) - extra :]
                r.n -= extra
            if not r.finished:
                r.finished = True
                r.wall_end = time.perf_counter()
        r.limit = end
    if limit_dev is not None:
        limit_dev.fill_(end)
