"""IQ4_NL and IQ4_XS blocks made from float weights, for tests: gguf-py reads them but cannot write
them, and none of the packaged models holds any (an IQ4_XS file's formats: IQ4_XS where a row is
whole 256-weight blocks, IQ4_NL where it is not, as in SmolLM2's 576-column matrices)."""

from __future__ import annotations

import numpy as np
from gguf import quants

from tests.q3k import signed_scales, signed_steps

VALUES = np.array(quants.IQ4_NL.kvalues, dtype=np.float32)  # the 16 values a nibble stands for, -127..113


def _nearest_values(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """x [..., columns] over grids of VALUES * step [..., 1] -> each column's nearest value's index (uint8)."""
    scaled = np.divide(x, step, out=np.zeros_like(x), where=step != 0)
    return np.searchsorted((VALUES[1:] + VALUES[:-1]) / 2, scaled).astype(np.uint8)  # a tie: the lower value


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [..., 32] indices -> 16 bytes: byte l holds column l (low nibble) and column l + 16 (high)."""
    return q[..., :16] | q[..., 16:] << 4


def quantize_iq4_nl(weight: np.ndarray) -> np.ndarray:
    """float [rows, columns] (columns a multiple of 32) -> IQ4_NL blocks, uint8 [rows, columns / 32 * 18]:
    per 32 columns a float16 d and 16 bytes of nibbles, w = d * VALUES[q]. llama.cpp searches for
    better scales; any valid blocks serve a test of how they are read."""
    rows, columns = weight.shape
    assert columns % 32 == 0, f"{columns} columns are not whole IQ4_NL blocks of 32"
    x = np.asarray(weight, dtype=np.float32).reshape(-1, 32)
    d = signed_steps(x, 127).astype(np.float16)  # the largest magnitude at -127
    q = _nearest_values(x, d.astype(np.float32)[:, None])
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), _nibbles(q)], axis=1).reshape(rows, -1)


def quantize_iq4_xs(weight: np.ndarray) -> np.ndarray:
    """float [rows, columns] (columns a multiple of 256) -> IQ4_XS blocks, uint8 [rows, columns / 256 * 136]:
    per 256 columns a float16 d, eight signed 6-bit scales (low 4 bits in scales_l, top 2 in
    scales_h) and 128 bytes of nibbles; w = d * (scale_j - 32) * VALUES[q] in sub-block j (32 columns)."""
    rows, columns = weight.shape
    assert columns % 256 == 0, f"{columns} columns are not whole IQ4_XS blocks of 256"
    x = np.asarray(weight, dtype=np.float32).reshape(-1, 8, 32)  # [blocks, sub-block, column]
    num_blocks = x.shape[0]
    d, scales, grid = signed_scales(signed_steps(x, 127))  # [blocks, 8]
    q = _nearest_values(x, grid[..., None])
    stored = (scales.astype(np.int16) + 32).astype(np.uint16)  # 0..63, as gguf-py unpacks them
    scales_high = sum((stored[:, j] >> 4) << (2 * j) for j in range(8)).astype(np.uint16)
    scales_low = (stored[:, 0::2] & 15) | (stored[:, 1::2] & 15) << 4
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), scales_high.view(np.uint8).reshape(-1, 2),
                             scales_low.astype(np.uint8), _nibbles(q).reshape(num_blocks, 128)], axis=1)
    return blocks.reshape(rows, -1)
