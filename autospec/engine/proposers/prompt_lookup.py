"""Prompt lookup (the n-gram proposer) as a proposer: each row copies what followed the latest
earlier occurrence of its context's last tokens (``autospec.ngram.NgramIndex``), in host
memory, a few dictionary probes per row.

Its proposals are a function of the context, so its q is one-hot: a proposal x is accepted
with probability p(x), and on rejection the next token is drawn from p without x — the
target's law exactly. Its blocks are host data: they reach the device in one non-blocking
copy per iteration it proposes in, from a staging buffer reused by every iteration (pinned
on a GPU; the iteration's sync has completed the previous copy before the buffer is
rewritten), never by a blocking copy of a Python list.

Where a row had a match but another proposer (or nobody) drafted, the block it would have
proposed is compared with what was emitted: its *shadow*, free evidence of where it pays.

Its trace (``autospec.ngram.ngram_trace``), computed by the store's writer off the hot path
from the row's tokens and its settings: per generated position, its match length there and
how many of its proposed tokens equal the output. Its replay rule reads that (a block of k
from g accepts min(agreement, k)); engines: vLLM's ``ngram`` method, SGLang's NGRAM, llama.cpp's
``ngram-simple`` and TensorRT-LLM's NGram (``autospec.fleet.export``).
"""

from __future__ import annotations

import time
from array import array
from functools import partial

import torch

from autospec.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramIndex, agreement, ngram_trace
from autospec.traces import K_LIMIT, decode_trace_value, trace_length_problem

from . import Block, EngineSetting, HostLookup, LookupReplay

__all__ = ["PromptLookup"]


class PromptLookup(HostLookup):
    name = "ngram"
    code = 1
    title = "prompt lookup"

    def __init__(self, call):
        super().__init__(call)
        self.factory = call.options.get(self.name) or NgramIndex
        self.indices = self.by_row = None  # built once the prompts are on the host
        self._matches: list[int] = []

    def matches(self) -> list[int]:
        """Each row's match length now (0: none, or no index yet)."""
        if self.indices is None:
            self._build()
        self._matches = ([idx.match()[0] for idx in self.indices] if self.indices is not None
                         else [0] * len(self.call.rows))
        return self._matches

    def sizes(self) -> list[int]:
        """Its block is as long as asked (the output of the match is there or not)."""
        return [K_LIMIT] * len(self.call.rows)

    def propose(self, it, rows: list[int], lengths: list[int]) -> Block:
        t0 = time.perf_counter()
        blocks = {b: self.indices[b].propose(lengths[b])[0] for b in rows}
        it.spend(self.name, time.perf_counter() - t0)
        return self.staging.block(len(self.indices), max(lengths[b] for b in rows), blocks)

    def accept(self, it, steps) -> None:
        """Each row's index learns what was emitted; every row's step gets the match the
        iteration started from, rows it did not draft its shadow."""
        if self.indices is None:
            self._build()  # a device prompt: the index starts once the first sync brought it
        matches = self._matches
        for b, (idx, step) in enumerate(zip(self.indices, steps)):
            match = matches[b] if matches else 0
            step.matches[self.name] = match
            if step.proposer != self.name and match:
                step.shadows[self.name] = (agreement(idx.propose(len(step.new))[0],
                                                     step.new[: step.emitted]), step.emitted)
            idx.extend(step.new[: step.emitted])

    def _build(self) -> None:
        if self.indices is None and self.call.rows[0].tokens is not None:
            self.indices = [self.factory(list(r.tokens[: r.L])) for r in self.call.rows]
            self.by_row = {r.index: idx for r, idx in zip(self.call.rows, self.indices)}

    def select(self, keep: list[int], index: torch.Tensor) -> None:
        if self.indices is not None:
            self.indices = [self.indices[b] for b in keep]

    def finish(self, row, stats) -> None:
        """Its trace, for the store's writer to compute off the hot path, and its settings
        (a custom index without the host list leaves none: no trace rather than a guess)."""
        idx = self.by_row[row.index] if self.by_row is not None else None
        tokens = getattr(idx, "tokens", None)
        max_n = int(getattr(idx, "max_n", DEFAULT_MAX_N))
        min_n = int(getattr(idx, "min_n", DEFAULT_MIN_N))
        stats.extras[self.name] = {"max_n": max_n, "min_n": min_n}
        if isinstance(tokens, list) and len(tokens) >= row.n:  # cut back to its batch's end
            stats.traces[self.name] = partial(ngram_trace, array("q", tokens[: row.n]), row.L,
                                              max_n=max_n, min_n=min_n)

    @classmethod
    def trace_problem(cls, trace: bytes, positions: int) -> str | None:
        """One byte per position (``autospec.ngram.ngram_trace``), or none at all."""
        return trace_length_problem(trace, positions, 1)

    @classmethod
    def replay(cls, record) -> LookupReplay | None:
        trace = (getattr(record, "traces", None) or {}).get(cls.name)
        if not trace:
            return None

        def read(g: int):
            if g >= len(trace):
                return None
            v = decode_trace_value(trace[g])
            return None if v is None else (v[0], v[1], K_LIMIT)

        return LookupReplay(read)

    @classmethod
    def export(cls, engine: str, plan) -> EngineSetting:
        """Prompt lookup in each engine, its suffix lengths the requests' logged ones
        (``plan.settings``; autospec.ngram's defaults where none): vLLM's ``ngram`` method
        (``prompt_lookup_max``/``_min``); TensorRT-LLM's NGram (``max_matching_ngram_size`` =
        max_n, the newest occurrence); SGLang's NGRAM (a chain: BFS breadth 1; it takes no
        suffix bounds); llama.cpp's ``ngram-simple`` (one suffix length, max_n)."""
        settings = plan.settings or {}
        max_n = int(settings.get("max_n") or DEFAULT_MAX_N)
        min_n = int(settings.get("min_n") or min(DEFAULT_MIN_N, max_n))
        k = plan.k
        if k <= 0:
            return EngineSetting()
        if engine == "vllm":
            return EngineSetting(
                {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": max_n,
                 "prompt_lookup_min": min_n},
                notes=["vLLM's ngram drafts from the earliest occurrence of the longest "
                       "matched suffix, autospec's prompt lookup (whose traces price this) "
                       "from the latest: on copy-heavy traffic expect vLLM to accept far "
                       "less. autospec's custom_class proposer runs autospec's rule inside "
                       "vLLM (docs/fleet.md, \"autospec inside vLLM\")"], traced=False)
        if engine == "trtllm":
            return EngineSetting({"decoding_type": "NGram", "max_draft_len": k,
                                  "max_matching_ngram_size": max_n, "is_keep_all": True,
                                  "is_use_oldest": False, "is_public_pool": False})
        if engine == "sglang":
            return EngineSetting(
                flags=["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                       str(k + 1), "--speculative-ngram-min-bfs-breadth", "1",
                       "--speculative-ngram-max-bfs-breadth", "1"],
                notes=["a chain of k tokens (BFS breadth 1), as autospec drafts; "
                       "--speculative-num-draft-tokens counts the verified token too (k + 1)",
                       f"SGLang matches suffixes in a trie of n-grams (up to "
                       f"--speculative-ngram-max-trie-depth tokens), not autospec's "
                       f"{max_n}-to-{min_n}-token suffixes: it takes no suffix bounds, so "
                       f"expect other matches than measured"])
        return EngineSetting(
            flags=["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(max_n),
                   "--spec-ngram-simple-size-m", str(k)],
            notes=[f"llama.cpp's ngram-simple matches one suffix length (n = {max_n}) and "
                   f"does not fall back to shorter ones as autospec's lookup does: expect "
                   f"fewer matches than measured"])

    @classmethod
    def describe(cls, settings) -> str:
        settings = settings or {}
        max_n = int(settings.get("max_n") or DEFAULT_MAX_N)
        min_n = int(settings.get("min_n") or min(DEFAULT_MIN_N, max_n))
        return (f"prompt lookup (no draft model), suffixes of {max_n} down to {min_n} tokens "
                f"(the requests' logged settings)")
