"""Prefix caching: a request whose prompt starts with tokens an earlier request already ran
starts from that request's keys and values instead of prefilling them again. A chat's next turn
resends the whole conversation; a server's requests share a system prompt.

Exact by batch invariance, draftwise's contract: a token's keys, values and hidden states are
the same bits whichever forward computed them (a prefill chunk, a verify, a one-token step), so
the copied entries give the logits a fresh prefill gives. The prompt's last token is always
prefilled (its logits choose the first output token).

Finished requests leave their valid entries here (copied to their exact size), newest last; an
entry whose tokens extend an older one's replaces it (the same conversation, one turn on), and
the least recently used go once the total passes the budget.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from draftwise.kv_cache import KVCache, shared_prefix_length
from draftwise.sequence import Sequence

# `draftwise serve` and `draftwise chat`'s --prefix-cache-mb: SmolLM2-135M's bf16 keys and values
# take 23 KB a token, Qwen2.5-Coder-1.5B's 28 KB, so 512 MB hold ~18-22k tokens of prompts.
DEFAULT_PREFIX_CACHE_MB = 512


@dataclass(eq=False, slots=True)
class _Entry:
    tokens: torch.Tensor  # [n] token ids whose keys and values are stored
    keys: torch.Tensor  # [layers, 1, kv_heads, n, head_dim], KVCache's layout
    values: torch.Tensor
    hidden: torch.Tensor | None  # [n, features]: the rows a hidden-state drafter observed, if it reads them

    @property
    def num_bytes(self) -> int:
        stored = [self.keys, self.values] + ([self.hidden] if self.hidden is not None else [])
        return sum(tensor.numel() * tensor.element_size() for tensor in stored)


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        """max_bytes: what the stored entries may take in all (keys, values and drafter rows)."""
        self.max_bytes = max_bytes
        self._entries: list[_Entry] = []  # least recently used first
        self._lock = threading.Lock()  # the server's scheduler thread and a caller's may both use it

    @property
    def num_bytes(self) -> int:
        return sum(entry.num_bytes for entry in self._entries)

    def start(self, seq: Sequence) -> int:
        """Fill a new sequence's cache with the longest stored prefix of its prompt (at most all
        but its last token) and mark those tokens prefilled; a drafter that reads hidden states
        observes their rows. Returns the number of tokens reused (0: none)."""
        if not isinstance(seq.cache, KVCache) or seq.cache.length:
            return 0
        prompt = seq.context  # [prompt tokens]
        reads_hidden = seq.hidden_rows is not None
        with self._lock:
            best, reused = None, 0
            for entry in self._entries:
                if reads_hidden and entry.hidden is None:
                    continue  # its drafter's rows were not kept: reusing would leave this drafter blind to them
                common = shared_prefix_length(entry.tokens, prompt[:-1])
                if common > reused:
                    best, reused = entry, common
            if best is None:
                return 0
            self._entries.remove(best)
            self._entries.append(best)  # most recently used
        seq.cache.fill(best.keys[:, :, :, :reused], best.values[:, :, :, :reused])
        if best.hidden is not None and reads_hidden:
            seq.observe(best.hidden[:reused])
        seq.num_prefilled = reused
        seq.metrics.num_cached_prompt_tokens = reused
        return reused

    def keep(self, seq: Sequence) -> None:
        """Store a finished sequence's valid entries: its context's tokens that the cache holds."""
        if not isinstance(seq.cache, KVCache):
            return
        num_valid = min(seq.cache.length, seq.context.shape[0])
        if num_valid < 2:
            return
        hidden = None
        if seq.hidden_rows is not None:
            rows = torch.cat(seq.hidden_rows) if seq.hidden_rows else torch.empty(0)
            hidden = rows[:num_valid].clone() if rows.shape[0] >= num_valid else None
        entry = _Entry(seq.context[:num_valid].clone(), seq.cache.keys[:, :, :, :num_valid].clone(),
                       seq.cache.values[:, :, :, :num_valid].clone(), hidden)
        if entry.num_bytes > self.max_bytes:
            return
        with self._lock:
            # Entries this one extends (an earlier turn of the same conversation) say nothing more.
            self._entries = [old for old in self._entries
                             if not (shared_prefix_length(old.tokens, entry.tokens) == old.tokens.shape[0]
                                     and (old.hidden is None or entry.hidden is not None))]
            self._entries.append(entry)
            while self.num_bytes > self.max_bytes:
                self._entries.pop(0)

