"""A preallocated per-layer K/V cache. Rollback moves a length: nothing is copied or recomputed.

Slots [0, length) hold committed tokens. A forward writes its T new tokens into slots
[length, length + T) and advances length; the engine then rolls back what was rejected, and
the next forward simply overwrites those slots (the gpt-fast idea).
"""

from __future__ import annotations

import torch

from draftwise.errors import ConfigError, DraftwiseError

# --kv-cache: what a native model's caches store keys and values in. Attention's arithmetic is
# float32 either way (a bfloat16 entry widens to float32 exactly); bfloat16 halves the bytes a
# decode step reads per cached token, which is what bounds a batch of long sequences.
KV_CACHES = {"auto": None, "float32": torch.float32, "bf16": torch.bfloat16}


def check_kv_cache(kv_cache: str) -> None:
    """A ConfigError naming the choices for a --kv-cache that is not one."""
    if kv_cache not in KV_CACHES:
        raise ConfigError(f"kv_cache={kv_cache!r} is not supported: use one of {', '.join(KV_CACHES)}.")


def cache_dtype(kv_cache: str, activations: str) -> torch.dtype:
    """The dtype --kv-cache names; "auto": bfloat16 where the linears already round their input
    to 8 bits or bfloat16 (bf16, amx, int8 activations), float32 with float32 activations (float32
    throughout) and with int16 (whose 15-bit rounding a bfloat16 cache would outweigh)."""
    check_kv_cache(kv_cache)
    if kv_cache == "auto":
        return torch.float32 if activations in ("float32", "int16") else torch.bfloat16
    return KV_CACHES[kv_cache]


def kv_cache_name(dtype: torch.dtype) -> str:
    """The --kv-cache value that names dtype (the inverse of cache_dtype for a resolved choice)."""
    return next(name for name, named in KV_CACHES.items() if named == dtype)


def shared_prefix_length(ids: torch.Tensor, other: torch.Tensor) -> int:
    """How many leading token ids two id sequences [n], [m] share: how many entries a cache
    computed for one holds for the other."""
    length = min(ids.shape[0], other.shape[0])
    differ = (ids[:length] != other[:length]).nonzero()
    return int(differ[0]) if differ.numel() else length


def carry_entries(held: "CacheLength | None", cache: "CacheLength") -> bool:
    """Copy a cache's committed entries into the larger one replacing it; False (nothing copied)
    where either is not a KVCache (the transformers fallback's cache cannot be copied so)."""
    if not (isinstance(held, KVCache) and isinstance(cache, KVCache)):
        return False
    cache.fill(held.keys[:, :, :, :held.length], held.values[:, :, :, :held.length])
    return True


class CacheLength:
    """The bookkeeping every cache shares: slots [0, length) hold committed tokens, a forward
    claims the next ones, rollback forgets the last ones."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.length = 0

    def reserve(self, num_tokens: int) -> int:
        """Claim slots for num_tokens new tokens; return the first slot. Called once per forward."""
        start = self.length
        if start + num_tokens > self.max_length:
            raise DraftwiseError(
                f"KV cache overflow: {start} + {num_tokens} tokens > capacity {self.max_length}; "
                "lower max_new_tokens or the prompt length."
            )
        self.length = start + num_tokens
        return start

    def rollback(self, num_tokens: int) -> None:
        """Forget the last num_tokens tokens. Rolling back more than is cached is a bug: raise."""
        if not 0 <= num_tokens <= self.length:
            raise DraftwiseError(f"cannot roll back {num_tokens} tokens from a cache of {self.length}")
        if num_tokens:
            self._forget(num_tokens)
        self.length -= num_tokens

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (a no-op when the cache is already that short)."""
        self.rollback(max(0, self.length - length))

    def keep_path(self, first_slot: int, nodes: list[int]) -> None:
        """After a tree verify wrote draft node i at slot first_slot + i, keep the accepted
        nodes (a root-to-leaf path, increasing indices) at first_slot, first_slot + 1, ... and
        forget every later slot. Moves at most len(nodes) entries; recomputes nothing."""
        if any(later <= earlier for earlier, later in zip(nodes, nodes[1:])) or (nodes and nodes[0] < 0):
            raise DraftwiseError(f"keep_path needs increasing node indices, got {nodes}")
        if first_slot + (nodes[-1] + 1 if nodes else 0) > self.length:
            raise DraftwiseError(f"keep_path: node {nodes[-1]} at slot {first_slot + nodes[-1]} is not cached")
        moves = [(first_slot + node, first_slot + depth) for depth, node in enumerate(nodes) if node != depth]
        if moves:
            sources, targets = zip(*moves)
            self._move(list(sources), list(targets))
        self.truncate(first_slot + len(nodes))

    def _move(self, sources: list[int], targets: list[int]) -> None:
        """Copy the entries at slots sources to slots targets (targets[i] <= sources[i])."""
        raise DraftwiseError(f"{type(self).__name__} cannot keep a tree path: use a chain drafter.")

    def _forget(self, num_tokens: int) -> None:
        """Drop storage of the last num_tokens tokens; preallocated buffers need nothing."""


class KVCache(CacheLength):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(max_length)
        shape = (num_layers, 1, num_kv_heads, max_length, head_dim)  # batch of one sequence
        # Not zeroed: a slot is written before anything reads it (attention reads slots below
        # the forward's end, rollback and keep_path move committed ones), so slots past `length`
        # hold garbage nobody sees. Zeroing cost 29-58 ms per request for a 4k-token Qwen2.5-1.5B
        # cache (bf16 / float32), and touched every page of a capacity the request may never fill.
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)

    def fill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start from another cache's first entries, keys and values [layers, 1, kv_heads, n,
        head_dim]: slots [0, n) hold them and the length is n."""
        self.truncate(0)
        end = self.reserve(keys.shape[3]) + keys.shape[3]
        self.keys[:, :, :, :end] = keys
        self.values[:, :, :, :end] = values

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [1, kv_heads, T, head_dim] at slots start.. and return views of all
        slots up to the new end, [1, kv_heads, start + T, head_dim]."""
        end = start + keys.shape[2]
        self.keys[layer, :, :, start:end] = keys
        self.values[layer, :, :, start:end] = values
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def _move(self, sources: list[int], targets: list[int]) -> None:
        # Advanced indexing on the right copies first, so overlapping moves are safe.
        self.keys[:, :, :, targets] = self.keys[:, :, :, sources]
        self.values[:, :, :, targets] = self.values[:, :, :, sources]
