"""The accept/reject rule of speculative sampling (Leviathan et al. 2022; Chen et al. 2023).

Vocabulary, as in the papers and vLLM: for a block of k draft tokens the output is
``accepted + one more``: the accepted draft tokens, then either a *recovered* token (sampled
from the residual distribution at the first rejection) or, when all k were accepted, a *bonus*
token sampled from the target's distribution after the last draft token. Variable names follow
the papers: p is the target's distribution, q the draft's.
"""

from __future__ import annotations

import torch

from autospec.engine.sampling import sample

__all__ = ["rejection_sample", "greedy_verify", "quantize_beta"]


def rejection_sample(
    target_probs: torch.Tensor,  # [B, k+1, V] p at each draft position plus the bonus position
    draft_probs: torch.Tensor,  # [B, k, V]   q the draft tokens were sampled from
    draft_tokens: torch.Tensor,  # [B, k]     the draft's proposals
    *,
    generator: torch.Generator | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (num_accepted [B], next_token [B]) with outputs distributed exactly as p.

    Draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)). At the first
    rejection the next token is sampled from normalise(max(0, p_i − q_i)); if all k are
    accepted it is sampled from p_{k+1}. Uses ``generator`` (or torch's global RNG, so that
    ``torch.manual_seed`` governs it as it governs ``generate``).

    lengths [B]: rows whose block is shorter than k (a proposer with fewer tokens for that
    row): nothing past ``lengths[b]`` is accepted, and ``draft_probs[b]`` must be zero there,
    so that the next token at the block's end is drawn from p itself (the bonus position).
    """
    B, k1, V = target_probs.shape
    k = k1 - 1
    if draft_probs.shape != (B, k, V) or draft_tokens.shape != (B, k):
        raise ValueError(
            f"shape mismatch: target_probs {tuple(target_probs.shape)}, draft_probs "
            f"{tuple(draft_probs.shape)}, draft_tokens {tuple(draft_tokens.shape)}; expected "
            "[B, k+1, V], [B, k, V], [B, k]"
        )
    device = target_probs.device
    if k == 0:  # a plain step: the next token is drawn from p itself
        return (torch.zeros(B, dtype=torch.int64, device=device),
                sample(target_probs[:, 0], generator))
    rows = torch.arange(B, device=device)
    idx = draft_tokens[..., None]
    p = target_probs[:, :k].gather(-1, idx).squeeze(-1)  # [B, k]
    q = draft_probs.gather(-1, idx).squeeze(-1)  # [B, k]
    u = torch.rand((B, k), generator=generator, device=device, dtype=p.dtype)
    # q >= p: accept with probability p/q; q < p: always accept (u < 1 <= p/q).
    accepted = u * q < p  # [B, k]
    if lengths is not None:
        accepted &= torch.arange(k, device=device) < lengths[:, None]
    # number of leading accepts: a rejection stops the block
    num_accepted = accepted.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]
    # residual at the first rejection; at the bonus position (n == k) q counts as 0
    at = num_accepted.clamp(max=k - 1)
    q_n = draft_probs[rows, at] * (num_accepted < k).to(draft_probs.dtype)[:, None]  # [B, V]
    p_n = target_probs[rows, num_accepted]  # [B, V]
    residual = (p_n - q_n).clamp_min(0)
    # Not normalised: the draw (multinomial's exponential race, argmax of weight / E) is the
    # same for any positive scale of the weights. p == q up to rounding leaves no residual
    # mass; rejection then had probability ~0 and p_n itself is the right fallback.
    residual = torch.where(residual.amax(dim=-1, keepdim=True) > 0, residual, p_n)
    next_token = sample(residual, generator)  # [B]; multinomial's draw, without its host sync
    return num_accepted, next_token


def greedy_verify(
    target_tokens: torch.Tensor,  # [B, k+1] the target's argmax at each position
    draft_tokens: torch.Tensor,  # [B, k]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample`` with one-hot p and q, without building V-wide tensors.

    Accept while the draft's token equals the target's argmax; the next token is the target's
    argmax at the first mismatch (or the bonus position).
    """
    k = draft_tokens.shape[1]
    match = (draft_tokens == target_tokens[:, :k]).to(torch.int64)
    num_accepted = match.cumprod(dim=-1).sum(dim=-1)  # [B]
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return num_accepted, next_token


def quantize_beta(beta: torch.Tensor) -> torch.Tensor:
    """β in [0, 1] → int in 0 … 254 (255 is reserved for unobserved, which NaN becomes)."""
    return (beta.clamp(0, 1) * 254).round().nan_to_num(255).to(torch.int64)
