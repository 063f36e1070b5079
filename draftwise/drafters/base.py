"""The Drafter interface: anything that can guess the target's next tokens cheaply."""

from __future__ import annotations

import copy
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

import torch

from draftwise.config import SamplingParams
from draftwise.tree import best_nodes, check_parents


@dataclass(frozen=True, slots=True)
class Draft:
    """A chain of draft tokens, or a tree of them (draftwise.tree) when parents is given."""

    tokens: torch.Tensor  # [n] proposed token ids, 0 <= n <= k (an empty draft is allowed)
    # [n, vocab] distributions the tokens were drawn from (siblings in a tree: independent draws
    # from one shared row); None = point masses (fixed guesses, top-k trees)
    probs: torch.Tensor | None
    # What kind of draft this is, for the draft-length policy's acceptance statistics (the
    # n-gram drafter gives its match length); drafts of one kind should be alike in quality.
    key: Hashable = None
    parents: torch.Tensor | None = None  # [n] parent node per node, -1 = the last committed token; None = a chain
    # [n] the drafter's estimate that each node gets accepted (a tree drafter's path
    # probabilities), nodes sorted best first; the policy then chooses how many nodes to verify
    scores: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.parents is not None:
            check_parents(self.parents)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def trimmed(self, num_tokens: int) -> "Draft":
        """The first num_tokens draft nodes (parents precede children, so still a tree)."""
        def cut(tensor):
            return None if tensor is None else tensor[:num_tokens]
        return Draft(self.tokens[:num_tokens], cut(self.probs), self.key, cut(self.parents), cut(self.scores))


class Drafter(Protocol):
    """Proposes draft tokens for one request at a time. The engine owns the loop: it calls
    begin() once, then propose() and rollback() once per step.

    A drafter that reads the target's hidden states (EAGLE, Medusa) also has
    `hidden_layers: tuple[int, ...]` (which of the target's layer outputs it needs; see
    CausalLM.forward) and `observe(hidden)`: the engine calls it with the rows of every target
    forward that became committed context (the prompt's at prefill, then the last committed
    token's and the accepted nodes' after each step), [rows, len(hidden_layers) * hidden_size].

    A drafter that learns from whole answers (HistoryDrafter) has `end(context)`: the engine calls
    it once when its request finishes (EOS, a stop string or the length limit) with the request's
    committed tokens, prompt then output [n].

    The server decodes many requests at once, each with its own drafter: fork_drafter() makes
    them by a shallow copy (weights shared), which is right when begin() sets up all of a
    request's state. A drafter that reuses per-request buffers across begin() calls defines
    `fork()` returning a twin without them (draftwise.drafters.draft_model shows one).
    """

    # True when drafting costs about a model forward per token (a draft model): the engine
    # then decides the draft length BEFORE drafting; False (n-gram) drafts for free and trims.
    sequential: bool

    def begin(self, params: SamplingParams, generator: torch.Generator, max_length: int) -> None:
        """Prepare for a new request whose context will never exceed max_length tokens."""
        ...

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        """Guess up to num_draft_tokens tokens that follow context [n] (prompt + output so far)."""
        ...

    def rollback(self, num_valid: int) -> None:
        """Only the first num_valid tokens of the last context + draft were kept (for a tree: the
        context and the accepted path): forget the rest."""
        ...


def fork_drafter(drafter: Drafter) -> Drafter:
    """A drafter for one more concurrent request: the same weights, its own request state."""
    fork = getattr(drafter, "fork", None)
    return fork() if fork is not None else copy.copy(drafter)


def empty_draft() -> Draft:
    return Draft(torch.empty(0, dtype=torch.long), None)


def best_tree_draft(tokens: list[int], parents: list[int], scores: list[float], depths: list[int], num_nodes: int,
                    key: Hashable) -> Draft:
    """A tree drafter's candidate tree (target token ids, parent per node, log path probability
    per node, depth per node) cut to its num_nodes most probable nodes, best first, as a Draft
    whose scores are the path probabilities: what the draft-length policy trims by."""
    order, kept_parents = best_nodes(parents, scores, depths, num_nodes)
    return Draft(
        tokens=torch.tensor([tokens[node] for node in order], dtype=torch.long),
        probs=None,
        key=key,
        parents=torch.tensor(kept_parents, dtype=torch.long),
        scores=torch.tensor([scores[node] for node in order]).exp(),
    )
