"""Q2_K blocks made from float weights, for tests: gguf-py reads Q2_K but cannot write it, and none
of the packaged models holds any (a Q2_K file's main format)."""

from __future__ import annotations

import numpy as np

from tests.q5k import even_grids

BLOCK_BYTES = 84  # per 256 weights: 16 bytes of scales and mins, 64 of 2-bit values, d and dmin (float16)


def quantize_q2_k(weight: np.ndarray) -> np.ndarray:
    """float [rows, columns] (columns a multiple of 256) -> Q2_K blocks, uint8 [rows, columns / 256 * 84].
    Each 16-column group gets an even 2-bit grid from its minimum (at most 0) to its maximum, its
    step and offset stored in 4 bits under the block's float16 d and dmin. llama.cpp searches for
    better grids; any valid blocks serve a test of how they are read."""
    rows, columns = weight.shape
    assert columns % 256 == 0, f"{columns} columns are not whole Q2_K blocks of 256"
    x = np.asarray(weight, dtype=np.float32).reshape(-1, 16, 16)  # [blocks, group, column]
    num_blocks = x.shape[0]
    d, scales, dmin, mins, q = even_grids(x, 3, 15)
    q = q.reshape(num_blocks, 256)  # column c = 16 g + l

    qs = np.zeros((num_blocks, 64), dtype=np.uint8)  # column 128 h + 32 s + l: bits 2 s of byte 32 h + l
    for c in range(256):
        half, s, l = c // 128, (c % 128) // 32, c % 32
        qs[:, 32 * half + l] |= q[:, c] << (2 * s)
    blocks = np.concatenate([scales | mins << 4, qs, d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)],
                            axis=1)
    return blocks.reshape(rows, -1)
