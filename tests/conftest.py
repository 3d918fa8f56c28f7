"""Tiny random-weight models built from configs: no files, no downloads."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

# tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning
# OpenMP workers make every small op wait: one thread keeps the suite fast and steady
torch.set_num_threads(1)
# the user's cache directory, before the tests replace it: where the engines' checking
# environments are built (autospec export --build-checker), which the export checks use
from autospec.store.database import cache_dir as _cache_dir  # noqa: E402

USER_CACHE = _cache_dir()
# controllers log to the default store (autospec.db in the cache directory): keep that, and
# every other cached file, away from the user's real cache
os.environ["AUTOSPEC_CACHE"] = tempfile.mkdtemp(prefix="autospec-tests-")

VOCAB = 97
EOS = 3

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny(arch: str = "llama", *, layers: int = 2, vocab: int = VOCAB, seed: int = 0,
         sharpen: float = 1.0, max_pos: int = 256):
    """A small causal LM. ``sharpen`` scales the output head so distributions are peaked
    (random init gives near-uniform ones, which make weak statistical tests)."""
    cfg_cls, model_cls = ARCHS[arch]
    cfg = cfg_cls(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=EOS,
                  pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    if sharpen != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    model.generation_config.pad_token_id = 0
    return model


def noisy_copy(model, noise: float, seed: int = 1):
    """A draft that agrees with ``model`` partly: same weights plus Gaussian noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    return draft


@pytest.fixture(params=["llama", "qwen2"])
def arch(request):
    return request.param


@pytest.fixture
def pair(arch):
    target = tiny(arch, layers=2, seed=0, sharpen=30.0)
    draft = noisy_copy(target, 0.5)
    return target, draft


def prompt(length: int = 10, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (1, length), generator=g)


def tiny_tokenizer(vocab: int = VOCAB):
    """A word-level tokenizer over ``w4 … w{vocab-2}`` (+ ``abcdef``) with the usual specials, built in
    memory (no files): ids 0 pad, 1 bos, 2 unk, 3 eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "<unk>": 2, "</s>": 3}
    words.update({f"w{i}": i for i in range(4, vocab - 1)})
    # transformers' StopStringCriteria probes the vocabulary behind the prefix "abcdef"
    words["abcdef"] = vocab - 1
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   unk_token="<unk>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}w4{% endif %}")
    return fast
