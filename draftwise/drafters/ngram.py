"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
context's last n tokens, trying the longest n first. Free to run, and strong whenever the
output copies from the prompt (code edits, summaries, RAG answers)."""

from __future__ import annotations

import torch

from draftwise.config import SamplingParams
from draftwise.drafters.base import Draft, empty_draft


class NgramDrafter:
    sequential = False  # see Drafter.sequential

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def begin(self, params: SamplingParams, generator: torch.Generator, max_length: int) -> None:
        pass  # stateless: each proposal reads the whole context

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        length = context.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = context[length - n:]
            # Windows starting at 0 .. length-n-1, i.e. every earlier occurrence, not the suffix itself.
            windows = context[:-1].unfold(0, n, 1)  # [length - n, n]
            starts = (windows == suffix).all(dim=1).nonzero().flatten()
            if starts.numel() == 0:
                continue
            follow = int(starts[-1]) + n  # latest match: its continuation is always non-empty
            return Draft(context[follow:follow + num_draft_tokens].clone(), None, key=n)
        return empty_draft()

    def rollback(self, num_valid: int) -> None:
        pass  # stateless: nothing to forget
