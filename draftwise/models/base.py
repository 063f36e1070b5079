"""The interface every target and draft model implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from draftwise.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str  # registry name or path, for messages and metrics
    vocab_size: int
    max_context: int  # the longest sequence the model's positions support
    eos_token_ids: tuple[int, ...]


@dataclass(slots=True)
class Segment:
    """One sequence's share of a batched forward: T new tokens scored after its own cache."""

    tokens: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T] rotary positions
    cache: KVCache  # this sequence's cache; the forward appends the T tokens to it
    attn_mask: torch.Tensor | None = None  # [T, T] bool among the new tokens; None = causal
    num_logits: int | None = None  # score only the last num_logits tokens (a prefill needs 1, a chunk 0)


def forward_each(model: "CausalLM", segments: list[Segment], hidden_layers: tuple[int, ...] = ()) -> list:
    """forward_batch for a model without a batched forward: one forward per segment."""
    return [model.forward(s.tokens, s.positions, s.cache, s.attn_mask, s.num_logits, hidden_layers=hidden_layers)
            if hidden_layers else model.forward(s.tokens, s.positions, s.cache, s.attn_mask, s.num_logits)
            for s in segments]


def forward_segments(model: "CausalLM", segments: list[Segment], hidden_layers: tuple[int, ...] = ()) -> list:
    """model.forward_batch(segments), or one forward per segment for a model without it (a
    CausalLM of the user's may lack it)."""
    batched = getattr(model, "forward_batch", None)
    return batched(segments, hidden_layers) if batched is not None else forward_each(model, segments, hidden_layers)


class CausalLM(Protocol):
    info: ModelInfo

    def new_cache(self, max_length: int) -> KVCache:
        """A cache sized for max_length tokens, in the model's dtype."""
        ...

    def forward(
        self,
        tokens: torch.Tensor,  # [T] token ids
        positions: torch.Tensor,  # [T] positions for the rotary embedding
        cache: KVCache,
        attn_mask: torch.Tensor | None = None,  # [T, T] bool among the new tokens; None = causal
        num_logits: int | None = None,  # score only the last num_logits tokens
        hidden_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Score T new tokens appended after cache.length cached ones; advances cache.length by T.
        Returns logits [num_logits or T, vocab] float32; with hidden_layers, also the hidden
        states of all T tokens at those layers, concatenated: [T, len(hidden_layers) * hidden].
        Layer i < num_layers is the residual stream after decoder layer i; i = num_layers is the
        final norm's output (what the LM head reads)."""
        ...

    def forward_batch(self, segments: list[Segment], hidden_layers: tuple[int, ...] = ()) -> list:
        """forward() for several sequences at once, each after its own cache: one result per
        segment, exactly what forward() would return for it alone (batch invariance)."""
        ...
