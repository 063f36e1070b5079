"""Pure verification: target and draft distributions in, accepted count and next token out.

Speculative sampling as in Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding" (ICML 2023) and Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling" (2023): draft token i is accepted with probability
min(1, target_probs_i / draft_probs_i); at the first rejection a token is drawn from the
residual norm(max(0, target_probs - draft_probs)); when all k are accepted a bonus token is
drawn from the target's next distribution. Every emitted token then follows the target
distribution exactly. No function here calls a model.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from draftwise.sampling import sample


class Verdict(NamedTuple):
    num_accepted: int  # accepted draft tokens, 0..k
    next_token: int  # recovered token (after a rejection) or bonus token (all accepted)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Keep the longest prefix of the draft that equals the target's argmax.

    draft_tokens: [k]; target_logits: [k + 1, vocab], row i scoring the token after draft i-1.
    """
    target_tokens = target_logits.argmax(dim=-1)  # [k + 1]
    matches = (draft_tokens == target_tokens[:-1]).int()  # [k]
    num_accepted = int(matches.cumprod(dim=0).sum())  # one sync per step: the engine needs it
    return Verdict(num_accepted, int(target_tokens[num_accepted]))


def verify_rejection(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Lossless rejection sampling, vectorised over the k draft positions.

    draft_tokens: [k]; draft_probs: [k, vocab] or None for a drafter without probabilities
    (n-gram), which is a point mass on its token; target_probs: [k + 1, vocab].
    """
    num_draft = draft_tokens.shape[0]
    positions = torch.arange(num_draft)
    target_token_probs = target_probs[positions, draft_tokens]  # [k]
    if draft_probs is None:
        draft_token_probs = torch.ones_like(target_token_probs)
    else:
        draft_token_probs = draft_probs[positions, draft_tokens]  # [k]
    uniforms = torch.rand(num_draft, generator=generator)
    # u < p/q written as u * q < p: no division, and q > 0 for any token the drafter sampled.
    accepted = (uniforms * draft_token_probs < target_token_probs).int()  # [k]
    num_accepted = int(accepted.cumprod(dim=0).sum())  # one sync per step: the engine needs it
    if num_accepted == num_draft:
        return Verdict(num_draft, int(sample(target_probs[num_draft], generator)))
    target_row = target_probs[num_accepted]
    if draft_probs is None:
        draft_row = torch.zeros_like(target_row)
        draft_row[draft_tokens[num_accepted]] = 1.0
    else:
        draft_row = draft_probs[num_accepted]
    residual = (target_row - draft_row).clamp_min(0.0)
    total = residual.sum()
    # A rejection has probability sum(max(0, q - p)) = sum(max(0, p - q)); if that is zero
    # the rejection was impossible, and only rounding got us here: fall back to p itself.
    residual = residual / total if total > 0 else target_row
    return Verdict(num_accepted, int(sample(residual, generator)))
