"""Pure verification: target and draft distributions in, accepted count and next token out.

Speculative sampling as in Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding" (ICML 2023) and Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling" (2023): draft token i is accepted with probability
min(1, target_probs_i / draft_probs_i); at the first rejection a token is drawn from the
residual norm(max(0, target_probs - draft_probs)); when all k are accepted a bonus token is
drawn from the target's next distribution. Every emitted token then follows the target
distribution exactly. No function here calls a model.

Trees (several candidates per position, `draftwise.tree`) use multi-draft rejection sampling
as in SpecInfer (Miao et al., "SpecInfer: Accelerating Large Language Model Serving with
Tree-based Speculative Inference and Verification", ASPLOS 2024) and EAGLE (Li et al. 2024):
at a node, its children are tried in turn, each against the residual the rejected siblings
left; the first accepted child becomes the new node; when all are rejected the residual itself
is sampled.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from draftwise.models.kernels import loaded_kernels
from draftwise.sampling import sample
from draftwise.tree import children_lists


class Verdict(NamedTuple):
    num_accepted: int  # accepted draft tokens, 0..k
    next_token: int  # recovered token (after a rejection) or bonus token (all accepted)
    path: tuple[int, ...] | None = None  # the accepted tree nodes, root first; None: a chain's first num_accepted

    def accepted_nodes(self) -> list[int]:
        """Indices of the accepted draft nodes, in order (for a chain, 0..num_accepted-1)."""
        return list(range(self.num_accepted)) if self.path is None else list(self.path)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[n, vocab] -> [n]: each row's argmax, the first of equal maxima (NaN counting as the
    largest), as torch.argmax gives it. Every greedy step pays it: on the kernels' argmax_rows
    where a model has loaded them (SmolLM2's 49,152 logits, 2 threads, AMX Xeon model 207: 6 /
    34 / 270 us for 1 / 10 / 64 rows), else through max() (54 / 261 / 1,682 us; argmax itself
    is slower still: 62 / 308 us for 1 / 10 rows on the model 167 Xeon)."""
    kernels = loaded_kernels()
    if kernels is not None and logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_contiguous() \
            and logits.device.type == "cpu" and logits.shape[1] > 0:
        return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Keep the longest prefix of the draft that equals the target's argmax.

    draft_tokens: [k]; target_logits: [k + 1, vocab], row i scoring the token after draft i-1.
    """
    target_tokens = argmax_rows(target_logits)  # [k + 1]
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


def verify_tree_greedy(draft_tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Keep the longest root-to-node path whose every token is the target's argmax after its
    parent. draft_tokens, parents: [n]; target_logits: [1 + n, vocab], row 0 the root's
    (the last committed token), row 1 + i node i's."""
    target_tokens = argmax_rows(target_logits).tolist()  # one sync per step: the walk needs them
    tokens = draft_tokens.tolist()
    children = children_lists(parents)
    path: list[int] = []
    row = 0
    while True:
        wanted = target_tokens[row]
        match = next((child for child in children[row] if tokens[child] == wanted), None)
        if match is None:
            return Verdict(len(path), wanted, tuple(path))
        path.append(match)
        row = match + 1


def verify_tree_rejection(
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Lossless multi-draft rejection sampling over a tree (SpecInfer, EAGLE).

    At the current node (the root first) with target distribution p, children are tried in draft
    order: child x drawn from q is accepted with probability min(1, p(x) / q(x)); a rejection
    replaces p by the residual norm(max(0, p - q)) for the next sibling. An accepted child becomes
    the current node; when every child is rejected (or there is none) the next token is drawn
    from p as it stands. Each emitted token then follows the target distribution exactly when
    siblings are independent draws from their (shared) draft_probs row, or, with draft_probs
    None, for any fixed distinct sibling tokens (each a point mass: acceptance with probability
    p(x), rejection removes x from p), which is how top-k trees are verified.

    draft_tokens, parents: [n]; draft_probs: [n, vocab] (row i: the distribution node i was drawn
    from) or None; target_probs: [1 + n, vocab], row 0 the root's, row 1 + i node i's.
    """
    tokens = draft_tokens.tolist()
    children = children_lists(parents)
    path: list[int] = []
    row = 0
    while True:
        residual = target_probs[row]  # [vocab]
        for child in children[row]:
            token = tokens[child]
            draft_prob = 1.0 if draft_probs is None else float(draft_probs[child, token])
            # u < p/q written as u * q < p, as in verify_rejection.
            if float(torch.rand(1, generator=generator)) * draft_prob < float(residual[token]):
                path.append(child)
                row = child + 1
                break
            if draft_probs is None:
                left = residual.clone()
                left[token] = 0.0
            else:
                left = (residual - draft_probs[child]).clamp_min(0.0)
            total = left.sum()
            # A zero residual means the rejection was impossible and only rounding got here.
            residual = left / total if total > 0 else residual
        else:
            return Verdict(len(path), int(sample(residual, generator)), tuple(path))
