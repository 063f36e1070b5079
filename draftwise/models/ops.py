"""The decoder's row-wise ops, on draftwise's kernels where they are built (kernels/rowwise.cpp:
each token's row computed the same way whatever else the forward holds), else on PyTorch's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftwise.models.kernels import native_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, H]
    kernels = native_kernels(progress=False)
    if kernels is not None:
        return kernels.rms_norm(x.contiguous(), weight, eps)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [T, I]
    kernels = native_kernels(progress=False)
    if kernels is not None:
        return kernels.silu_mul(gate.contiguous(), up.contiguous())
    return F.silu(gate) * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [T, I]
    """gelu(gate) * up, GELU's tanh approximation (Gemma's MLP)."""
    kernels = native_kernels(progress=False)
    if kernels is not None:
        return kernels.gelu_tanh_mul(gate.contiguous(), up.contiguous())
    return F.gelu(gate, approximate="tanh") * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by its positions' angles, cos / sin [T, 1, head_dim]:
    x * cos + rotate_half(x) * sin, in place on the kernels (one call instead of eight ops; the
    same bits)."""
    kernels = native_kernels(progress=False)
    if kernels is not None and x.is_contiguous():
        rows = x.shape[0]
        kernels.rotary(x, cos.reshape(rows, -1), sin.reshape(rows, -1))
        return x
    return x * cos + rotate_half(x) * sin


def attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
              tree_mask: torch.Tensor | None, amx_scores: bool = False, scale: float | None = None,
              window: int = 0) -> torch.Tensor:
    """queries [T, heads, head_dim] of T new tokens whose keys/values are already in the cache at
    slots start..start+T-1; keys / values [kv_heads, capacity, head_dim], the cache's buffers;
    tree_mask [T, T] bool among the new tokens (None: causal), or [T, W] over the last W slots
    (W - T slots before the new ones, e.g. a drafter's earlier tree levels; every slot before
    those is seen). amx_scores: over a bfloat16 cache, the scores on AMX tiles with the queries
    rounded to bfloat16 (where the CPU has them; the kernels' rowwise.cpp). scale: the scores'
    scale (None: head_dim ** -0.5); window > 0: each query sees only the last `window` of the
    keys it would see otherwise, its own included (Gemma 3's sliding-window layers). -> [T, heads, head_dim]."""
    num_tokens, _, head_dim = queries.shape
    scale = head_dim ** -0.5 if scale is None else scale
    kernels = native_kernels(progress=False)
    if kernels is not None and head_dim % 16 == 0:
        mask = torch.empty(0, dtype=torch.bool) if tree_mask is None else tree_mask.contiguous()
        return kernels.attention(queries.contiguous(), keys, values, start, mask, scale, amx_scores, window)
    end = start + num_tokens
    mask = None
    if num_tokens > 1 or tree_mask is not None or window:
        among_new = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril() if tree_mask is None else tree_mask
        mask = torch.cat((torch.ones(num_tokens, end - among_new.shape[1], dtype=torch.bool), among_new), dim=1)
        if window:  # the last `window` visible keys of each row
            mask &= mask.flip(-1).cumsum(-1).flip(-1) <= window
    keys, values = keys[:, :end].float(), values[:, :end].float()  # a bfloat16 cache's entries, widened exactly
    out = F.scaled_dot_product_attention(queries.transpose(0, 1)[None], keys[None], values[None],
                                         attn_mask=mask, enable_gqa=True, scale=scale)  # [1, heads, T, head_dim]
    return out[0].transpose(0, 1)
