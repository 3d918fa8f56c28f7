"""A target/draft pair with a chosen greedy acceptance α, at any size, every layer at full cost.

Random weights make acceptance meaningless: a random draft almost never agrees with a random
target, so a benchmark on random models of real sizes measures costs but not speedups. This
module builds random models of any shape whose greedy next token is a known function of the
current token, and a draft that agrees with it on a chosen fraction of tokens:

- embeddings E: rows drawn from N(0, 1);
- every residual branch is scaled down (``o_proj`` and ``down_proj`` times ``branch_scale``):
  each layer still runs its full matmuls, so costs are those of the real shape, but adds
  almost nothing, and the final (normalised) hidden state is ≈ √d · Ê[t] for the current
  token t (Ê: the unit-norm row);
- the head maps t to its successor: row v is ``head_scale`` · Ê[pred(v)], so the logit of
  succ(t) is ≈ √d · head_scale and every other logit ≈ N(0, head_scale²) — a margin of about
  √d standard deviations (30 at d = 896; 8 at the tests' d = 64);
- succ is one cycle through the whole vocabulary (a random order, each token followed by the
  next), so greedy output walks the cycle without repeating for V tokens;
- the draft uses the same successor map except on a random set R of round((1 − α) · V) tokens,
  where it names another member of R's successor (a cyclic shift within R). Its guess after
  token t is right exactly when t ∉ R, so along the target's greedy path each position is
  accepted with probability α, independently of k (a random subset of the cycle: positions
  behave like Bernoulli(α) draws, and a full cycle holds exactly the chosen fraction).

``measure_acceptance`` runs the speculative loop and reads α back from the acceptance traces,
which is how the tests check a construction on the CPU and how the GPU benchmark reports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

__all__ = ["QWEN2_SHAPES", "qwen2_config", "build_model", "controlled_pair", "make_controlled",
           "measure_acceptance", "Acceptance"]

# dimensions of real models (Qwen2.5 family); "tiny" is the tests' shape. Vocabularies are
# 152064 for all (the 0.5B/1.5B have 151936 rows: one size keeps transformers' assisted
# generation, which compares sizes, usable on the pair).
QWEN2_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=97),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=152064),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=152064),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
}


def qwen2_config(shape: str = "tiny", **overrides):
    """A Qwen2Config of a named shape; the head is never tied to the embeddings (the
    construction needs them different; reading a V × d head costs the same either way)."""
    from transformers import Qwen2Config

    dims = dict(QWEN2_SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                eos_token_id=None, pad_token_id=0, use_sliding_window=False)
    dims.update(overrides)
    return Qwen2Config(**dims)


def build_model(config, *, dtype=torch.float32, device="cpu"):
    """A random-weight causal LM built directly on ``device`` in ``dtype`` (no CPU copy of a
    7B model on the way to a GPU)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # the cycle never ends: no EOS
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def make_controlled(model, pred: torch.Tensor, *, seed: int, branch_scale: float = 1e-3,
                    head_scale: float = 1.0) -> None:
    """Rewrite ``model`` in place so that its greedy successor of token t is the v with
    pred[v] = t (pred: [V] long, a permutation)."""
    emb = model.get_input_embeddings().weight  # [V, d]
    head = model.get_output_embeddings().weight  # [V, d]
    if head.data_ptr() == emb.data_ptr():
        raise ValueError("the construction needs an untied head (tie_word_embeddings=False)")
    if pred.shape[0] != emb.shape[0]:
        raise ValueError(f"pred has {pred.shape[0]} entries for {emb.shape[0]} embeddings")
    gen = torch.Generator(device=emb.device).manual_seed(seed)
    rows = torch.empty(emb.shape, dtype=torch.float32, device=emb.device)
    rows.normal_(0.0, 1.0, generator=gen)
    emb.copy_(rows)
    unit = rows / rows.norm(dim=-1, keepdim=True)
    head.copy_(unit[pred.to(emb.device)] * head_scale)
    del rows, unit
    for name, p in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            p.mul_(branch_scale)


def _cycle(vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One cycle through all tokens: succ[t] and pred[t] (both [V] long)."""
    order = torch.randperm(vocab, generator=gen)
    succ = torch.empty(vocab, dtype=torch.long)
    succ[order] = order.roll(-1)
    pred = torch.empty(vocab, dtype=torch.long)
    pred[succ] = torch.arange(vocab)
    return succ, pred


def controlled_pair(target_config, draft_config, alpha: float, *, dtype=torch.float32,
                    device="cpu", seed: int = 0, branch_scale: float = 1e-3, target=None):
    """(target, draft) with greedy acceptance ``alpha`` (see the module docstring).

    target: an existing controlled target (built with the same seed) to pair another draft
    with, so that an α sweep builds the large model once. Returns (target, draft, info) where
    info holds the successor map and the set R of tokens the draft gets wrong.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    vocab = target_config.vocab_size
    if draft_config.vocab_size != vocab:
        raise ValueError("target and draft configs must have the same vocab_size")
    gen = torch.Generator().manual_seed(seed)
    succ, pred = _cycle(vocab, gen)
    if target is None:
        target = build_model(target_config, dtype=dtype, device=device)
        make_controlled(target, pred, seed=seed + 1, branch_scale=branch_scale)
    # R: the tokens after which the draft guesses wrong; it names the successor of the next
    # member of R instead (m >= 2, so a shift always moves; m = 1 would be a fixed point)
    m = round((1.0 - alpha) * vocab)
    if m == 1:
        m = 0 if alpha > 0.5 else 2
    wrong = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 2))[:m]
    shift = torch.arange(vocab)
    shift[wrong] = wrong.roll(-1)
    d_succ = succ[shift]  # the draft's successor of t
    d_pred = torch.empty(vocab, dtype=torch.long)
    d_pred[d_succ] = torch.arange(vocab)
    draft = build_model(draft_config, dtype=dtype, device=device)
    make_controlled(draft, d_pred, seed=seed + 3, branch_scale=branch_scale)
    info = {"alpha": alpha, "exact_alpha": 1.0 - m / vocab, "succ": succ, "wrong": wrong}
    return target, draft, info


@dataclass
class Acceptance:
    alpha: float  # per-position greedy acceptance read from the traces
    positions: int  # trace positions observed
    outputs_equal: bool | None  # every output equalled target.generate's (None: not checked)
    mean_accepted_length: float


def measure_acceptance(target, draft, *, prompts: int = 4, prompt_len: int = 16,
                       max_new_tokens: int = 64, k: int = 4, seed: int = 0,
                       check_generate: bool = False, **loop_options) -> Acceptance:
    """Greedy acceptance of ``draft`` against ``target`` on random prompts, read from the
    acceptance traces (k-independent for greedy decoding)."""
    from autospec.engine.loop import speculative_generate
    from autospec.engine.sampling import SamplingConfig
    from autospec.policies import FixedK
    from autospec.store.record import UNOBSERVED

    device = next(target.parameters()).device
    vocab = target.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    hits = seen = drafts = accepted = 0
    equal = True if check_generate else None
    for _ in range(prompts):
        ids = torch.randint(0, vocab, (1, prompt_len), generator=gen).to(device)
        res = speculative_generate(target, draft, ids, sampling=SamplingConfig(),
                                   policy=FixedK(k), max_new_tokens=max_new_tokens,
                                   **loop_options)
        bits = [b for b in res.stats.trace if b != UNOBSERVED]
        hits, seen = hits + sum(bits), seen + len(bits)
        drafts, accepted = drafts + res.stats.drafts, accepted + res.stats.accepted
        if check_generate:
            ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens)
            equal = equal and torch.equal(ref, res.sequences)
    return Acceptance(alpha=hits / seen if seen else float("nan"), positions=seen,
                      outputs_equal=equal,
                      mean_accepted_length=1.0 + accepted / drafts if drafts else 1.0)
