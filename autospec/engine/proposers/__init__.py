"""Proposers: who drafts the block the target verifies. One module per proposer, one interface.

Call order, per call of the engine: the proposer is made by its ``open`` factory for the call's
rows (``PROPOSERS[name](batch)``); then, every iteration,

1. what the policy and ``decide`` read of it: a lookup proposer's ``matches()`` (each row's
   match length now), a model proposer's ``gaps()`` (tokens each row's cache has not taken
   in: its next block starts by catching up on them);
2. ``propose(it, rows, lengths)`` — only when ``decide`` assigned it rows: a ``Block`` for
   every row of the batch (rows it does not serve get length 0), drawn on the device;
3. ``sync_parts()`` / ``read(values)`` — device values it wants back ride on the
   iteration's one host sync (a model's catch-up trace, say), in that order;
4. ``accept(it, steps)`` — after the sync: what each row accepted and emitted
   (``accounting.RowStep``), to update its state (roll a cache back to the accepted prefix,
   extend an index) and to add to each row's step what it learned (``unproposed``,
   ``shadow``);

and ``select(keep, index)`` when rows leave, ``finish(stats)`` per row at the end,
``release()`` always. A proposer whose proposals are a deterministic function of the context
(a lookup) returns ``q = None``: the rejection rule then uses a one-hot q, which keeps the
output the target's exactly. Adding a proposer is a module with its class and an entry in
``PROPOSERS``; the step never names one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Block", "Proposer", "PROPOSERS", "HostBlocks", "HostLookup"]


@dataclass
class Block:
    """A proposer's block for every row of the batch."""

    tokens: torch.Tensor  # [B, k] proposed tokens (anything past a row's length)
    q: torch.Tensor | None  # [B, k, V] the distribution each was drawn from; None: one-hot
    lengths: torch.Tensor | None  # [B] each row's length (0: not served); None: k everywhere
    covers_all: bool = False  # it served every row (a model); lookups overlay their rows on it
    host_lengths: list[int] | None = None  # each row's length, as the host knows it


class HostBlocks:
    """Blocks a lookup proposer builds in host memory, on their way to the device: one
    non-blocking copy per iteration it proposes in, from a staging buffer reused by every
    iteration (pinned on a GPU; the iteration's sync has completed the previous copy before
    the buffer is rewritten), never a blocking copy of a Python list. On the CPU the block
    is the buffer itself, valid for its iteration (nothing reads it after; the next block
    rewrites it). Row b's column 0 holds its length, then its tokens."""

    def __init__(self, batch):
        stage = torch.zeros(len(batch.rows), batch.k_max + 1, dtype=torch.long)
        if batch.device.type == "cuda":
            stage = stage.pin_memory()
        self.device = batch.device
        self.stage, self.host = stage, stage.numpy()  # numpy: writes with no torch op

    def block(self, rows: int, k: int, blocks: dict[int, list[int]]) -> Block:
        """The block, k wide, of ``rows`` rows where row b proposes ``blocks[b]`` (at most k
        tokens; the other rows nothing)."""
        host = self.host
        if len(blocks) < rows:  # rows it does not serve: nothing
            host[:rows, : k + 1] = 0
        sizes = [0] * rows
        for b, toks in blocks.items():  # a served row in one write: length, tokens, zeros
            sizes[b] = n = len(toks)
            host[b, : k + 1] = [n, *toks, *(0,) * (k - n)]
        block = self.stage[:rows, : k + 1]
        if self.device.type != "cpu":
            block = block.to(self.device, non_blocking=True)
        return Block(tokens=block[:, 1:], q=None, lengths=block[:, 0], host_lengths=sizes)


class HostLookup:
    """What a lookup proposer in host memory has by default: nothing to read back with the
    sync, nothing on the device to release, and its blocks staged by ``HostBlocks``."""

    def __init__(self, batch):
        self.batch = batch
        self.staging = HostBlocks(batch)

    def sync_parts(self) -> list[torch.Tensor]:
        return []

    def read(self, values: list[int]) -> None:
        pass

    def release(self) -> None:
        pass


class Proposer(Protocol):
    name: str

    def matches(self) -> list[int]: ...  # a lookup proposer

    def gaps(self) -> list[int]: ...  # a model proposer

    def propose(self, it, rows: list[int], lengths: list[int]) -> Block: ...

    def sync_parts(self) -> list[torch.Tensor]: ...

    def read(self, values: list[int]) -> None: ...

    def accept(self, it, steps) -> None: ...

    def select(self, keep: list[int], index: torch.Tensor) -> None: ...

    def finish(self, row: int, stats) -> None: ...

    def release(self) -> None: ...


def _draft_model(batch):
    from .draft_model import DraftModel

    return DraftModel(batch)


def _prompt_lookup(batch):
    from .prompt_lookup import PromptLookup

    return PromptLookup(batch)


def _suffix(batch):
    from .suffix import SuffixLookup

    return SuffixLookup(batch)


# name → factory(batch); the names are the ones policies choose by (``policies.Choice``)
PROPOSERS = {"draft": _draft_model, "ngram": _prompt_lookup, "suffix": _suffix}
