"""Blocks of GGUF's lattice formats (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) for
tests: gguf-py reads them but cannot write them, and none of the packaged models holds any.

Every bit pattern of these formats is a valid block once its float16 d is finite: grid indices,
sign bits and sub-block scales may take any value. So a block here is random bytes with d set to
a chosen scale, which exercises every index, sign and scale bit of the decoders (and gguf-py's
dequantisation is the reference they are compared with)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as WeightFormat
from gguf import quants

LATTICE_FORMATS = (WeightFormat.IQ2_XXS, WeightFormat.IQ2_XS, WeightFormat.IQ2_S, WeightFormat.IQ3_XXS,
                   WeightFormat.IQ3_S, WeightFormat.IQ1_S, WeightFormat.IQ1_M)


def _set_d(blocks: np.ndarray, format: WeightFormat, d: np.ndarray) -> None:
    """Write float16 d [n] into blocks [n, bytes] (IQ1_M keeps its d in the top nibbles of its
    last four uint16s; the others in their first two bytes)."""
    bits = d.astype(np.float16).view(np.uint16)
    if format == WeightFormat.IQ1_M:
        scales = blocks[:, 48:56].copy().view(np.uint16)  # [n, 4]
        for i, shift in enumerate((0, 4, 8, 12)):  # word i holds bits 4i..4i+3 of d
            scales[:, i] = (scales[:, i] & 0x0FFF) | (((bits >> shift) & 0xF) << 12)
        blocks[:, 48:56] = scales.view(np.uint8)
    else:
        blocks[:, :2] = bits.reshape(-1, 1).view(np.uint8)


def random_blocks(format: WeightFormat, rows: int, columns: int, rng: np.random.Generator,
                  d: float = 0.01) -> np.ndarray:
    """uint8 [rows, columns / 256 * bytes]: random blocks of `format`, each block's d = d."""
    block_weights, block_bytes = quants.GGML_QUANT_SIZES[format]
    assert columns % block_weights == 0, f"{columns} columns are not whole {format.name} blocks"
    blocks = rng.integers(0, 256, size=(rows * columns // block_weights, block_bytes), dtype=np.uint8)
    _set_d(blocks, format, np.full(blocks.shape[0], d, dtype=np.float32))
    return blocks.reshape(rows, -1)


def random_blocks_like(weight: np.ndarray, format: WeightFormat, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `format` for float weights [rows, columns] whose every 256-weight block has
    the root mean square of the weights it replaces (d scaled to it): random lattice points at a
    real matrix's scale, for a model test of how the blocks are read."""
    rows, columns = weight.shape
    blocks = random_blocks(format, rows, columns, rng, d=1.0).reshape(-1, quants.GGML_QUANT_SIZES[format][1])
    values = quants.dequantize(blocks, format).reshape(-1, 256)
    unit = np.sqrt((values.astype(np.float64) ** 2).mean(-1))
    target = np.sqrt((weight.reshape(-1, 256).astype(np.float64) ** 2).mean(-1))
    _set_d(blocks, format, (target / np.maximum(unit, 1e-12)).astype(np.float32))
    return blocks.reshape(rows, -1)
