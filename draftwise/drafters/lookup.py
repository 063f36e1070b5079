"""Prompt lookup inside a head's tree: what followed the latest earlier occurrence of the
context's last tokens (NgramDrafter's match) joins the tree as one more path from its root.

A head guesses what is new; the lookup copies what repeats (a name, a quoted phrase, a list's
pattern, the source sentence a translation follows), and costs no forward. EagleDrafter and
MedusaDrafter both merge it (their `lookup`); the draft-length policy then keeps the copied
nodes as it keeps the head's, by score.
"""

from __future__ import annotations

import math

import torch

from draftwise.drafters.ngram import NgramDrafter
from draftwise.errors import ConfigError

# The copied tokens' path probability per step, and the shortest match of the context's last
# tokens that counts. Per step 0.4 / 0.6 / 0.8 / 0.9 gave EagleDrafter 1.59x / 1.77x / 1.81-1.87x
# / 1.90x plain on chat, translation, code edits and RAG (2 prompts each, 96 tokens, one process
# per value, AMX Xeon, 2026-11-26); 0.9 and 0.6 over all six categories 1.73x and 1.72x: 0.8,
# the middle of the plateau.
LOOKUP_LOG_PROBABILITY = math.log(0.8)
LOOKUP_MIN_N = 2


class TreeLookup:
    """Up to `length` tokens copied by prompt lookup, merged into a candidate tree."""

    def __init__(self, length: int) -> None:
        self.ngram = NgramDrafter(min_n=LOOKUP_MIN_N)
        self.length = length

    @classmethod
    def optional(cls, length: int) -> "TreeLookup | None":
        """A drafter's `lookup` argument: a TreeLookup of that length, None for 0; negative refused."""
        if length < 0:
            raise ConfigError(f"lookup={length}: the most tokens copied by prompt lookup must be 0 (none) or more.")
        return cls(length) if length > 0 else None

    def merge(self, context: torch.Tensor, tokens: list[int], parents: list[int], scores: list[float],
              depths: list[int]) -> None:
        """Merge, in place, the lookup's continuation of `context` into the tree (merge_path)."""
        merge_path(self.ngram.propose(context, self.length).tokens.tolist(), tokens, parents, scores, depths)


def merge_path(path: list[int], tokens: list[int], parents: list[int], scores: list[float], depths: list[int],
               log_probability: float = LOOKUP_LOG_PROBABILITY) -> None:
    """Merge, in place, a path of tokens from the root into a candidate tree (target token ids,
    parent per node, log path probabilities, depths): along the tree's own nodes where they spell
    it, then as new nodes. Each step of the path scores its parent's score plus log_probability,
    or the tree's own score where that is higher, so scores never rise from parent to child."""
    child_of = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens))}
    node, score, depth = -1, 0.0, 0
    for token in path:
        score, depth = score + log_probability, depth + 1
        if (node, token) in child_of:
            node = child_of[(node, token)]
            scores[node] = score = max(scores[node], score)
            continue
        tokens.append(token)
        parents.append(node)
        scores.append(score)
        depths.append(depth)
        node = child_of[(parents[-1], token)] = len(tokens) - 1
