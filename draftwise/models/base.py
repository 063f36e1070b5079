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
