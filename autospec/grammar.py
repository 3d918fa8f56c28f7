"""Structured output: a grammar or JSON-schema constraint as a logits processor whose output is a
function of the prefix alone, so that the speculative loop serves it exactly.

``Grammar`` is a transformers ``LogitsProcessor``: pass it to ``generate`` (wrapped or not) in
``logits_processor=[...]``. At each position it allows only the tokens the grammar allows after
the tokens generated so far (the prefix after the prompt) and masks the rest to −inf. The
grammar engine is xgrammar (``pip install autospec[structured]``): it runs on the CPU, compiles
JSON schemas and EBNF grammars against a tokenizer's vocabulary, and rolls its matcher back by
any number of tokens, which is what the loop needs — it scores a block of drafted positions,
then keeps only the accepted ones.

How the prefix is followed: the first call for a sequence marks where its prompt ends; a matcher
then follows that sequence's generated tokens. A later call whose sequence extends a followed one
is answered from the masks already computed along it (the loop asks for earlier positions
again), or after rolling the matcher back to where the two part and forward over the new tokens
(a rejected draft). A prefix holding a token the grammar forbids gets its scores unchanged: the
loop never uses such a position (verification rejected that token before it), and ``generate``
never produces one. So, as for xgrammar's own processor, use one ``Grammar`` per ``generate``
call: a new request whose prompt extends an earlier request's output would be taken for its
continuation.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import torch
from transformers import LogitsProcessor

__all__ = ["Grammar", "from_xgrammar"]


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError("structured output needs xgrammar: pip install 'autospec[structured]'"
                          ) from e
    return xgrammar


class _Track:
    """One sequence followed: its prompt, the generated tokens its matcher has accepted, and the
    bitmask for the position after each accepted prefix (``masks[i]``: after ``ids[:i]``)."""

    __slots__ = ("start", "ids", "matcher", "masks")

    def __init__(self, start: int, matcher):
        self.start, self.ids, self.matcher, self.masks = start, [], matcher, []


class Grammar(LogitsProcessor):
    """A constraint on the generated tokens, applied as ``generate`` applies a logits processor,
    exactly under speculation (``prefix_only``: its output depends only on the prefix)."""

    prefix_only = True

    def __init__(self, compiled_grammar, *, max_sequences: int = 256):
        self.compiled = compiled_grammar
        self.vocab = compiled_grammar.tokenizer_info.vocab_size
        self.max_sequences = max_sequences
        # (prompt length, the prompt's tokens) → the track following it, least recent first
        self._tracks: OrderedDict[tuple[int, tuple[int, ...]], _Track] = OrderedDict()
        self._starts: dict[int, int] = {}  # prompt length → how many tracks have it

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema, tokenizer, *, vocab_size: int | None = None,
                    any_whitespace: bool = False, **options) -> Grammar:
        """Output that is one JSON value valid under ``schema`` (a dict, its JSON text or a
        pydantic model), then the tokenizer's EOS. tokenizer: the model's (or an
        ``xgrammar.TokenizerInfo``); vocab_size: the model's output size where it exceeds the
        tokenizer's (ids past the tokenizer are never allowed); any_whitespace False: the
        layout ``separators`` gives (xgrammar's default ", " and ": "), no free whitespace;
        options: the rest of xgrammar's ``compile_json_schema`` (``separators``, ``indent``,
        ``strict_mode``, ``max_whitespace_cnt``)."""
        xgr = _xgr()
        if isinstance(schema, dict):
            schema = json.dumps(schema)
        compiler = xgr.GrammarCompiler(_tokenizer_info(tokenizer, vocab_size))
        return cls(compiler.compile_json_schema(schema, any_whitespace=any_whitespace,
                                                **options))

    @classmethod
    def ebnf(cls, grammar: str, tokenizer, *, vocab_size: int | None = None,
             root: str = "root") -> Grammar:
        """Output in the language of an EBNF grammar (xgrammar's GBNF dialect), then EOS."""
        xgr = _xgr()
        compiler = xgr.GrammarCompiler(_tokenizer_info(tokenizer, vocab_size))
        return cls(compiler.compile_grammar(grammar, root_rule_name=root))

    # -- the processor -----------------------------------------------------------------------
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        xgr = _xgr()
        for b in range(input_ids.shape[0]):
            mask = self._mask(input_ids[b].tolist())
            if mask is None:
                continue
            row = scores[b : b + 1]
            if row.device.type not in ("cpu", "cuda"):
                row = row.cpu()
            xgr.apply_token_bitmask_inplace(row, mask.to(row.device),
                                            vocab_size=min(self.vocab, row.shape[-1]))
            if scores.shape[-1] > self.vocab:  # ids past the tokenizer: never allowed
                row[:, self.vocab :] = float("-inf")
            scores[b : b + 1] = row
        return scores

    def reset(self) -> None:
        """Forget every sequence followed (a new generate call may reuse the processor)."""
        self._tracks.clear()
        self._starts.clear()

    def _mask(self, seq: list[int]):
        """The bitmask for the position after ``seq`` ([1, words]); None where the prefix holds
        a forbidden token or has ended (EOS accepted)."""
        track = self._track(seq)
        gen = seq[track.start :]
        ids = track.ids
        same = 0
        limit = min(len(ids), len(gen))
        while same < limit and ids[same] == gen[same]:
            same += 1
        if same == len(gen):  # a prefix of what the track has seen
            return track.masks[same] if same < len(track.masks) else None
        if same < len(ids):  # the sequences part: back to where they agree
            track.matcher.rollback(len(ids) - same)
            del ids[same:]
            del track.masks[same + 1 :]
        for tok in gen[same:]:
            if track.matcher.is_terminated() or not track.matcher.accept_token(tok):
                return None
            ids.append(tok)
            track.masks.append(self._fill(track.matcher))
        return track.masks[len(gen)]

    def _fill(self, matcher):
        if matcher.is_terminated():
            return None
        mask = _xgr().allocate_token_bitmask(1, self.vocab)
        matcher.fill_next_token_bitmask(mask)
        return mask

    def _track(self, seq: list[int]) -> _Track:
        """The track whose prompt ``seq`` starts with (the longest such prompt), else a new one
        with ``seq`` as its prompt."""
        for start in sorted(self._starts, reverse=True):
            if start <= len(seq):
                key = (start, tuple(seq[:start]))
                track = self._tracks.get(key)
                if track is not None:
                    self._tracks.move_to_end(key)
                    return track
        xgr = _xgr()
        track = _Track(len(seq), xgr.GrammarMatcher(self.compiled))
        track.masks.append(self._fill(track.matcher))
        key = (len(seq), tuple(seq))
        self._tracks[key] = track
        self._starts[len(seq)] = self._starts.get(len(seq), 0) + 1
        while len(self._tracks) > self.max_sequences:
            (start, _), _old = self._tracks.popitem(last=False)
            self._starts[start] -= 1
            if not self._starts[start]:
                del self._starts[start]
        return track


def _tokenizer_info(tokenizer, vocab_size):
    xgr = _xgr()
    if isinstance(tokenizer, xgr.TokenizerInfo):
        return tokenizer
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


def from_xgrammar(processor):
    """xgrammar's own transformers processor (``xgrammar.contrib.hf.LogitsProcessor``), not yet
    used, as a ``Grammar`` over its one grammar; None where it is not one or cannot be (already
    used, or a grammar per row)."""
    try:
        from xgrammar.contrib.hf import LogitsProcessor as XgrProcessor
    except ImportError:
        return None
    if not isinstance(processor, XgrProcessor) or processor.matchers:
        return None
    grammars = processor.compiled_grammars
    if any(g is not grammars[0] for g in grammars):
        return None
    return Grammar(grammars[0])
