"""Q5_K blocks made from float weights, for tests: gguf-py reads Q5_K but cannot write it, and none
of the packaged models holds any (a Q5_K_M file's main format)."""

from __future__ import annotations

import numpy as np

BLOCK_BYTES = 176  # per 256 weights: d, dmin (float16), 12 bytes of scales and mins, 32 of high bits, 128 of nibbles


def even_grids(x: np.ndarray, levels: int, scale_levels: int):
    """x [blocks, groups, columns] -> each group's even grid of levels + 1 values from its minimum
    (at most 0) to its maximum, its step and offset as multiples (0..scale_levels) of the block's
    float16 d and dmin: (d, scales, dmin, mins, q), q [blocks, groups, columns] uint8 in 0..levels.
    The K-quants with mins (Q2_K, Q4_K, Q5_K) store their groups so."""
    low, high = np.minimum(x.min(-1), 0.0), np.maximum(x.max(-1), 0.0)
    step, offset = (high - low) / levels, -low

    def multiples_of_unit(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [n, groups] -> float16 [n], multiples
        unit = (values.max(-1) / scale_levels).astype(np.float16)
        unit32 = unit.astype(np.float32)[:, None]
        multiples = np.round(np.divide(values, unit32, out=np.zeros_like(values), where=unit32 > 0))
        return unit, multiples.clip(0, scale_levels).astype(np.uint8)

    d, scales = multiples_of_unit(step)
    dmin, mins = multiples_of_unit(offset)
    grid = d.astype(np.float32)[:, None] * scales
    shift = dmin.astype(np.float32)[:, None] * mins
    q = np.round(np.divide(x + shift[..., None], grid[..., None], out=np.zeros_like(x), where=grid[..., None] > 0))
    return d, scales, dmin, mins, q.clip(0, levels).astype(np.uint8)


def quantize_q5_k(weight: np.ndarray) -> np.ndarray:
    """float [rows, columns] (columns a multiple of 256) -> Q5_K blocks, uint8 [rows, columns / 256 * 176].
    Each 32-column sub-block gets an even 5-bit grid from its minimum (at most 0) to its maximum,
    its step and offset stored in 6 bits under the block's float16 d and dmin. llama.cpp searches
    for better grids; any valid blocks serve a test of how they are read."""
    rows, columns = weight.shape
    assert columns % 256 == 0, f"{columns} columns are not whole Q5_K blocks of 256"
    x = np.asarray(weight, dtype=np.float32).reshape(-1, 8, 32)
    num_blocks = x.shape[0]
    d, scales, dmin, mins, q = even_grids(x, 31, 63)

    packed = np.empty((num_blocks, 12), dtype=np.uint8)  # as gguf-py's Q4_K.get_scale_min unpacks them
    packed[:, 0:4] = (scales[:, :4] & 63) | (scales[:, 4:] >> 4) << 6
    packed[:, 4:8] = (mins[:, :4] & 63) | (mins[:, 4:] >> 4) << 6
    packed[:, 8:12] = (scales[:, 4:] & 15) | (mins[:, 4:] & 15) << 4
    high_bits = np.zeros((num_blocks, 32), dtype=np.uint8)  # bit j of byte l: the fifth bit of sub-block j's value l
    for j in range(8):
        high_bits |= ((q[:, j] >> 4) & 1) << j
    nibbles = np.empty((num_blocks, 128), dtype=np.uint8)  # sub-blocks 2p and 2p + 1 share 32 bytes
    for pair in range(4):
        nibbles[:, 32 * pair:32 * pair + 32] = (q[:, 2 * pair] & 15) | (q[:, 2 * pair + 1] & 15) << 4
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed,
                             high_bits, nibbles], axis=1)
    return blocks.reshape(rows, -1)
