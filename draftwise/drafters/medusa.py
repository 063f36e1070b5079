"""The Medusa drafter: heads on the target's last hidden state propose a tree of candidates.

The engine hands over the final hidden state of every committed row; the last one (the row
whose logits chose the newest committed token) is all the heads read. Head k's top candidates
fill depth k of the tree; a node's score is the product of its path's head probabilities
(the heads are independent given the hidden state), and the tree grows best-first, keeping at
most `beam` nodes per depth, then the best nodes overall, as many as the engine allows. What
prompt lookup copies joins the tree as one more path from its root (`lookup`, as EagleDrafter's).
Tokens are fixed guesses (point masses), verified losslessly in both greedy and sampling modes.

The heads draft from one row, so their cost is the bytes of their matrices: they run from Q8_0
copies (eagle.compact_copy), and all heads' inputs meet the shared LM head in one product
(MedusaHeads.forward).
"""

from __future__ import annotations

import torch

from draftwise.config import SamplingParams
from draftwise.drafters.base import Draft, best_tree_draft, empty_draft
from draftwise.drafters.eagle import compact_copy
from draftwise.drafters.lookup import TreeLookup
from draftwise.heads import check_target
from draftwise.heads.medusa import MedusaHeads


class MedusaDrafter:
    sequential = False

    def __init__(self, heads: MedusaHeads, target_model, top_k: int = 6, beam: int = 12, lookup: int = 8) -> None:
        """top_k: candidates per head; beam: the most nodes kept per depth; lookup: up to this many
        tokens copied by prompt lookup join the tree as a path from its root (0: none)."""
        check_target(heads.config, target_model)
        self.heads = compact_copy(heads)
        self.to_target = heads.draft_to_target.tolist()  # draft-vocabulary id -> target id
        self.hidden_layers = heads.config.hidden_layers
        self.top_k = top_k
        self.beam = beam
        self.lookup = TreeLookup.optional(lookup)

    def begin(self, params: SamplingParams, generator: torch.Generator, max_length: int) -> None:
        self.last_hidden: torch.Tensor | None = None

    def observe(self, hidden: torch.Tensor) -> None:
        self.last_hidden = hidden[-1]

    def rollback(self, num_valid: int) -> None:
        pass  # stateless between steps but for the last hidden state, which observe() replaces

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        if num_draft_tokens == 0 or self.last_hidden is None:
            return empty_draft()
        logprobs = torch.log_softmax(self.heads(self.last_hidden[None])[:, 0], dim=-1)  # [heads, draft vocab]
        best = logprobs.topk(self.top_k, dim=-1)
        candidates = list(zip(best.values.tolist(), best.indices.tolist()))  # per head: (values, ids)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        frontier = [(-1, 0.0)]  # (node, log path probability)
        for depth, (values, ids) in enumerate(candidates, start=1):
            children = sorted(((score + value, parent, token) for parent, score in frontier
                               for value, token in zip(values, ids)), reverse=True)[: self.beam]
            frontier = []
            for score, parent, token in children:
                tokens.append(self.to_target[token])
                parents.append(parent)
                scores.append(score)
                depths.append(depth)
                frontier.append((len(tokens) - 1, score))
        if self.lookup:
            self.lookup.merge(context, tokens, parents, scores, depths)
        # The best nodes overall; a node's ancestors score at least as well (log-probabilities <= 0).
        return best_tree_draft(tokens, parents, scores, depths, num_draft_tokens, key="medusa")
