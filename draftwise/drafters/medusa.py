"""The Medusa drafter: heads on the target's last hidden state propose a tree of candidates.

The engine hands over the final hidden state of every committed row; the last one (the row
whose logits chose the newest committed token) is all the heads read. Head k's top candidates
fill depth k of the tree; a node's score is the product of its path's head probabilities
(the heads are independent given the hidden state), and the tree grows best-first, keeping at
most `beam` nodes per depth, then the best nodes overall, as many as the engine allows. Tokens
are fixed guesses (point masses), verified losslessly in both greedy and sampling modes.
"""

from __future__ import annotations

import torch

from draftwise.config import SamplingParams
from draftwise.drafters.base import Draft, empty_draft
from draftwise.heads import check_target
from draftwise.heads.medusa import MedusaHeads
from draftwise.tree import best_nodes


class MedusaDrafter:
    sequential = False

    def __init__(self, heads: MedusaHeads, target_model, top_k: int = 6, beam: int = 12) -> None:
        check_target(heads.config, target_model)
        self.heads = heads
        self.hidden_layers = heads.config.hidden_layers
        self.top_k = top_k
        self.beam = beam

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
                tokens.append(token)
                parents.append(parent)
                scores.append(score)
                depths.append(depth)
                frontier.append((len(tokens) - 1, score))
        # The best nodes overall; a node's ancestors score at least as well (log-probabilities <= 0).
        order, kept_parents = best_nodes(parents, scores, depths, num_draft_tokens)
        return Draft(
            tokens=self.heads.draft_to_target[torch.tensor([tokens[node] for node in order])],
            probs=None,
            key="medusa",
            parents=torch.tensor(kept_parents),
            scores=torch.tensor([scores[node] for node in order]).exp(),
        )

