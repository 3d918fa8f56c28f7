"""A small random-weight Llama pair on disk that a serving engine can load: the closed loop's
stand-in for a real pair (``scripts/engine_loop.sh``), no downloads.

The shape is the smallest vLLM's CPU attention runs (head size 64), the output head is
sharpened so greedy decoding follows peaked distributions, and the draft is the target's
weights plus Gaussian noise, so acceptance is neither 0 nor 1. A word-level tokenizer over
``w4 … w{V-1}`` (with the usual specials) is saved beside each, so prompts are words. Llama,
not Qwen2: transformers loads a Qwen2 checkpoint's tokenizer as its own byte-level class, which
does not read a word-level tokenizer back.
"""

from __future__ import annotations

import logging
import random
import zlib
from pathlib import Path

import torch

log = logging.getLogger(__name__)

__all__ = ["save_small_pair", "small_prompts", "small_prompt_of"]

VOCAB = 512


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "<unk>": 2, "</s>": 3}
    words.update({f"w{i}": i for i in range(4, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   unk_token="<unk>", eos_token="</s>")


def save_small_pair(root: str | Path, *, seed: int = 0, sharpen: float = 30.0,
                    noise: float = 0.15) -> tuple[str, str]:
    """(target directory, draft directory) under ``root``, written once (kept if present)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(root)
    dirs = root / "small-target", root / "small-draft"
    if all((d / "config.json").is_file() for d in dirs):
        return str(dirs[0]), str(dirs[1])
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=4096, tie_word_embeddings=False,
                     bos_token_id=1, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(sharpen)
    draft = LlamaForCausalLM(cfg).eval()
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    tok = _tokenizer(VOCAB)
    for model, d in zip((target, draft), dirs):
        model.to(torch.bfloat16).save_pretrained(d)
        tok.save_pretrained(d)
    log.info("small pair saved to %s and %s", *dirs)
    return str(dirs[0]), str(dirs[1])


def small_prompts(n: int, *, seed: int = 0, length: int = 24) -> list[str]:
    """``n`` prompts of words, each with a repeated stretch (prompt lookup has matches)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [f"w{rng.randrange(4, VOCAB)}" for _ in range(length // 2)]
        out.append(" ".join(words + words[: length - len(words)]))
    return out


def small_prompt_of(text: str, max_words: int = 256) -> str:
    """A text prompt (a packaged prompt set's) in the small pair's vocabulary: each
    whitespace-separated word mapped to one of its words by a stable hash, so a prompt that
    repeats itself still does (what prompt lookup finds) and each category keeps its own
    words; at most ``max_words`` words."""
    return " ".join(f"w{4 + zlib.crc32(word.encode()) % (VOCAB - 4)}"
                    for word in text.split()[:max_words])
