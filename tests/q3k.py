"""Q3_K blocks made from float weights, for tests: gguf-py reads Q3_K but cannot write it, and none
of the packaged models holds any (a Q3_K_S/M/L file's main format)."""

from __future__ import annotations

import numpy as np

BLOCK_BYTES = 110  # per 256 weights: 32 bytes of high bits, 64 of 2-bit lows, 12 of scales, d (float16)


def signed_steps(x: np.ndarray, most_negative: int) -> np.ndarray:
    """x [..., columns] -> each group's grid step, signed so that its largest magnitude lands on the
    grid's most negative value (-most_negative steps)."""
    extreme = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    return -extreme / most_negative


def signed_scales(step: np.ndarray):
    """Steps [blocks, groups] -> each block's float16 d and the groups' signed 6-bit scales (-32..31,
    stored + 32) under it, with the grid steps they make, d * scale: (d, scales int8, grid float32).
    Q3_K and IQ4_XS store their groups so."""
    d = (np.abs(step).max(-1) / 31).astype(np.float16)  # scales -31..31 times d
    d32 = d.astype(np.float32)[:, None]
    scales = np.round(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)).clip(-32, 31).astype(np.int8)
    return d, scales, d32 * scales.astype(np.float32)


def quantize_q3_k(weight: np.ndarray) -> np.ndarray:
    """float [rows, columns] (columns a multiple of 256) -> Q3_K blocks, uint8 [rows, columns / 256 * 110].
    Each 16-column group gets a signed 6-bit scale under the block's float16 d and values -4..3,
    its largest magnitude at -4; llama.cpp searches for better scales; any valid blocks
    serve a test of how they are read."""
    rows, columns = weight.shape
    assert columns % 256 == 0, f"{columns} columns are not whole Q3_K blocks of 256"
    x = np.asarray(weight, dtype=np.float32).reshape(-1, 16, 16)  # [blocks, group, column]
    num_blocks = x.shape[0]
    d, scales, grid = signed_scales(signed_steps(x, 4))  # [blocks, 16]: the largest magnitude of a group at -4
    q = np.round(np.divide(x, grid[..., None], out=np.zeros_like(x), where=grid[..., None] != 0))
    q = q.clip(-4, 3).astype(np.int8).reshape(num_blocks, 256)  # column c = 16 g + l

    stored = (scales.astype(np.int16) + 32).astype(np.uint8)  # 0..63, as gguf-py unpacks them
    packed = np.empty((num_blocks, 12), dtype=np.uint8)
    packed[:, 0:8] = (stored[:, 0:8] & 15) | (stored[:, 8:16] & 15) << 4
    for k in range(4):  # byte 8 + k: the top 2 bits of scales k, k + 4, k + 8, k + 12 at bits 0, 2, 4, 6
        packed[:, 8 + k] = sum(((stored[:, k + 4 * m] >> 4) & 3) << (2 * m) for m in range(4))
    high = (q >= 0).astype(np.uint8)  # the high bit set: q = low bits; clear: q = low bits - 4
    low = (q + 4 * (1 - high)).astype(np.uint8)  # 0..3
    hmask = np.zeros((num_blocks, 32), dtype=np.uint8)  # bit c / 32 of byte c % 32
    qs = np.zeros((num_blocks, 64), dtype=np.uint8)  # column 128 h + 32 s + l: bits 2 s of byte 32 h + l
    for c in range(256):
        hmask[:, c % 32] |= high[:, c] << (c // 32)
        half, s, l = c // 128, (c % 128) // 32, c % 32
        qs[:, 32 * half + l] |= low[:, c] << (2 * s)
    blocks = np.concatenate([hmask, qs, packed, d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, -1)
