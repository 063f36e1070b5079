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

    @property
    def model(self) -> torch.nn.Module:
        """The weights this drafter's forks share (draftwise.step groups requests by it and drafts
        for them together: propose_together)."""
        return self.heads

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        return MedusaDrafter.propose_together([self], [context], [num_draft_tokens])[0]

    @staticmethod
    @torch.inference_mode()
    def propose_together(drafters: list["MedusaDrafter"], contexts: list[torch.Tensor],
                         budgets: list[int]) -> list[Draft]:
        """Trees for several requests whose drafters are forks of one (a batch): one pass of the
        heads over every request's last hidden state, so their matrices are read once for all.
        The heads compute each row alike whatever rows are beside it, so each request's tree is
        the one it grows alone; propose() is this with one request."""
        drafts = [empty_draft() for _ in drafters]
        ready = [index for index, drafter in enumerate(drafters) if budgets[index] and drafter.last_hidden is not None]
        if not ready:
            return drafts
        hidden = torch.stack([drafters[index].last_hidden for index in ready])  # [R, features]
        logprobs = torch.log_softmax(drafters[0].heads(hidden), dim=-1)  # [heads, R, draft vocab]
        best = logprobs.topk(drafters[0].top_k, dim=-1)
        values, ids = best.values.tolist(), best.indices.tolist()  # [heads][R][top_k]
        for row, index in enumerate(ready):
            candidates = [(values[head][row], ids[head][row]) for head in range(len(values))]
            drafts[index] = drafters[index]._tree(contexts[index], candidates, budgets[index])
        return drafts

    def _tree(self, context: torch.Tensor, candidates: list[tuple[list[float], list[int]]], num_nodes: int) -> Draft:
        """The tree from each head's (log-probabilities, draft ids) of its top_k candidates."""
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
        return best_tree_draft(tokens, parents, scores, depths, num_nodes, key="medusa")
