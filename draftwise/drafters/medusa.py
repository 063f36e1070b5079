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
        frontier = [(-1, 0.0)]  # (node, log path probability)
        for values, ids in candidates:
            children = sorted(((score + value, parent, token) for parent, score in frontier
                               for value, token in zip(values, ids)), reverse=True)[: self.beam]
            frontier = []
            for score, parent, token in children:
                tokens.append(token)
                parents.append(parent)
                scores.append(score)
                frontier.append((len(tokens) - 1, score))
        # Best nodes overall; a node's ancestors score at least as well (log-probabilities <= 0).
        order = sorted(range(len(tokens)), key=lambda node: -scores[node])[:num_draft_tokens]
        chosen = set(order)
        order = sorted((node for node in order if _ancestors_in(node, parents, chosen)), key=lambda node: -scores[node])
        order = _topological(order, parents)
        index_of = {node: index for index, node in enumerate(order)}
        return Draft(
            tokens=self.heads.draft_to_target[torch.tensor([tokens[node] for node in order])],
            probs=None,
            key="medusa",
            parents=torch.tensor([index_of[parents[node]] if parents[node] >= 0 else -1 for node in order]),
            scores=torch.tensor([scores[node] for node in order]).exp(),
        )


def _ancestors_in(node: int, parents: list[int], chosen: set[int]) -> bool:
    while parents[node] >= 0:
        node = parents[node]
        if node not in chosen:
            return False
    return True


def _topological(order: list[int], parents: list[int]) -> list[int]:
    """order, with any node that precedes its parent moved after it (equal scores can do that)."""
    placed: list[int] = []
    seen: set[int] = set()
    pending = list(order)
    while pending:
        for node in pending:
            if parents[node] < 0 or parents[node] in seen:
                placed.append(node)
                seen.add(node)
                pending.remove(node)
                break
    return placed
