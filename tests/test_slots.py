"""The slot cache on its own (``engine/slots.py``), with no policy and no proposer: rows of
different lengths appended together, a row's rejected slots masked, rows selected, masked
slots repacked — and after every step each row's logits equal those of a plain forward over
that row's sequence alone. With full attention and with a sliding window shorter than the
sequences (where the window must span a row's tokens, not its holes)."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import autospec.engine.slots as slots_mod
from autospec.engine.checks import attention_layout
from autospec.engine.runners import EagerRunner
from autospec.engine.slots import SlotCache, kv_bytes_per_token

from conftest import tiny


def mistral(window: int = 4):
    cfg = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                        max_position_embeddings=256, pad_token_id=0, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return MistralForCausalLM(cfg).eval()


class Rows:
    """Each row's sequence on the host, and the cache under test."""

    def __init__(self, model, prompts: list[list[int]]):
        self.model, self.seqs = model, [list(p) for p in prompts]
        self.cache = SlotCache(EagerRunner(model), len(prompts), torch.device("cpu"),
                               attention_layout(model), kv_per_token=kv_bytes_per_token(model))

    def tokens(self) -> torch.Tensor:
        width = max(len(s) for s in self.seqs) + 8
        out = torch.zeros(len(self.seqs), width, dtype=torch.long)
        for b, s in enumerate(self.seqs):
            out[b, : len(s)] = torch.tensor(s)
        return out

    def feed(self, extra: list[list[int]] | None, keep: int,
             pending: list[list[int]] | None = None) -> torch.Tensor:
        """Catch up on each row's sequence (after adding ``pending`` to it: tokens the row
        has but the cache has not, as the engine's last accepted token), then append
        ``extra`` (one list per row)."""
        for s, p in zip(self.seqs, pending or []):
            s.extend(p)
        known = [len(s) for s in self.seqs]
        ext = None if extra is None else torch.tensor(extra)
        self.cache.mark()
        out = self.cache.feed(self.tokens(), known, torch.tensor(known), ext, keep)
        if extra is not None:
            for s, e in zip(self.seqs, extra):
                s.extend(e)
        return out

    def reference(self, keep: int) -> list[torch.Tensor]:
        """Each row alone: a forward over its whole sequence, the last ``keep`` logits."""
        with torch.no_grad():
            return [self.model(torch.tensor([s])).logits[0, -keep:] for s in self.seqs]

    def reject(self, drop: list[int]) -> None:
        self.cache.reject(drop, lambda: torch.tensor(drop))
        for s, d in zip(self.seqs, drop):
            del s[len(s) - d :]

    def check(self, out: torch.Tensor, keep: int) -> None:
        for b, ref in enumerate(self.reference(keep)):
            torch.testing.assert_close(out[b], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_every_row_sees_exactly_its_own_sequence(kind, monkeypatch):
    model = tiny("llama") if kind == "full" else mistral(window=4)
    g = torch.Generator().manual_seed(0)

    def draw(n):
        return torch.randint(4, 97, (n,), generator=g).tolist()

    rows = Rows(model, [draw(5), draw(9), draw(3)])
    with torch.no_grad():
        rows.check(rows.feed(None, 1), 1)  # ragged prompts: left padding inside the block
        assert rows.cache.slots == 9 and rows.cache.lens == [5, 9, 3]
        # each row's pending token, then a block per row
        rows.check(rows.feed([draw(3) for _ in range(3)], 4, [draw(1) for _ in range(3)]), 4)
        assert rows.cache.slots == 9 + 1 + 3 and rows.cache.lens == [9, 13, 7]
        rows.reject([2, 1, 3])  # ragged rejections: the common tail cropped, the rest masked
        assert rows.cache.slots == 12 and rows.cache.lens == [7, 12, 4]
        assert rows.cache.valid is not None and not rows.cache.contiguous
        # ragged catch-up (2, 1 and 0 tokens) before the block: padding inside the block
        rows.check(rows.feed([draw(2) for _ in range(3)], 2, [draw(2), draw(1), []]), 2)
        rows.cache.select([0, 2], torch.tensor([0, 2]))  # a row leaves
        rows.seqs = [rows.seqs[0], rows.seqs[2]]
        rows.check(rows.feed([draw(1) for _ in range(2)], 2, [draw(1), draw(1)]), 2)
        monkeypatch.setattr(slots_mod, "SLACK", 0)
        before = rows.cache.slots
        rows.cache.compact()  # holes gathered out
        assert rows.cache.repacks == 1 and rows.cache.slots < before
        assert rows.cache.slots == max(rows.cache.lens)
        rows.check(rows.feed([draw(3) for _ in range(2)], 4, [draw(1), draw(1)]), 4)


def test_one_row_is_cropped_and_fed_without_a_mask():
    model = tiny("llama")
    rows = Rows(model, [[5, 6, 7, 8]])
    with torch.no_grad():
        rows.check(rows.feed(None, 1), 1)
        rows.check(rows.feed([[9, 10, 11]], 4, [[20]]), 4)
        rows.reject([2])
        assert rows.cache.contiguous and rows.cache.lens_dev is None
        assert rows.cache.slots == rows.cache.lens[0] == 6
        rows.check(rows.feed([[12]], 2, [[21]]), 2)
