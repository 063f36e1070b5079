"""The Drafter interface: anything that can guess the target's next tokens cheaply."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

import torch

from draftwise.config import SamplingParams


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: torch.Tensor  # [n] proposed token ids, 0 <= n <= k (an empty draft is allowed)
    probs: torch.Tensor | None  # [n, vocab] distributions the tokens were drawn from; None = point mass
    # What kind of draft this is, for the draft-length policy's acceptance statistics (the
    # n-gram drafter gives its match length); drafts of one kind should be alike in quality.
    key: Hashable = None

    def trimmed(self, num_tokens: int) -> "Draft":
        """The first num_tokens draft tokens."""
        probs = None if self.probs is None else self.probs[:num_tokens]
        return Draft(self.tokens[:num_tokens], probs, self.key)


class Drafter(Protocol):
    """Proposes draft tokens for one request at a time. The engine owns the loop: it calls
    begin() once, then propose() and rollback() once per step."""

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
        """Only the first num_valid tokens of the last context + draft were kept: forget the rest."""
        ...


def empty_draft() -> Draft:
    return Draft(torch.empty(0, dtype=torch.long), None)
