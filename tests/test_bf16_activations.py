"""`--activations bf16` (kernels/bf16_linear.cpp): x and the weights' values rounded to
bfloat16, the products summed in float32 in vdpbf16ps's order. Checked bit for bit against that
arithmetic written out in PyTorch, row by row whatever the rows beside, close to float32
activations. Greedy speculation equal to plain decoding on the real models with bf16
activations: tests/test_batch_invariance.py."""

from __future__ import annotations

import pytest
import torch

from draftwise.errors import ConfigError
from draftwise.models.linear import BlockLinear, BlockWeight, WeightFormat, use_activations
from tests.test_kernels import CASES, kernels, synthetic_blocks  # noqa: F401 (a fixture)


def dot_pairs_reference(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weights [N, K].T as the kernel defines it: both rounded to bfloat16, K padded
    with zeros to a multiple of 32; per 32 columns, lane i adds x[2i+1] * w[2i+1], then
    x[2i] * w[2i] (each product exact in float32, each sum rounded); then the 16 lanes summed
    as horizontal_sum does ((i + i+8), (i + i+4), then (0 + 2) + (1 + 3))."""
    M, K = x.shape
    N = weights.shape[0]
    padded = (K + 31) // 32 * 32
    xs = torch.zeros(M, padded)
    ws = torch.zeros(N, padded)
    xs[:, :K] = x.bfloat16().float()
    ws[:, :K] = weights.bfloat16().float()
    lanes = torch.zeros(M, N, 16)
    for k in range(0, padded, 32):
        x_pairs = xs[:, k:k + 32].reshape(M, 1, 16, 2)
        w_pairs = ws[:, k:k + 32].reshape(1, N, 16, 2)
        lanes = lanes + x_pairs[..., 1] * w_pairs[..., 1]
        lanes = lanes + x_pairs[..., 0] * w_pairs[..., 0]
    eights = lanes[..., :8] + lanes[..., 8:]
    fours = eights[..., :4] + eights[..., 4:]
    return (fours[..., 0] + fours[..., 2]) + (fours[..., 1] + fours[..., 3])


@pytest.mark.parametrize("format, make", CASES, ids=[format.name for format, _ in CASES])
def test_bf16_activations_compute_the_rounded_products_in_the_dot_products_order(kernels, format, make):
    data, num_columns = make(format)
    weight = BlockWeight(data, format, num_columns)
    values = weight.rows(torch.arange(weight.num_rows))  # the format's own float32 values
    torch.manual_seed(int(format))
    x = torch.randn(40, num_columns) * 3
    reference = dot_pairs_reference(x, values)
    unrounded = x.double() @ values.double().T
    # weights decoded in registers up to 8 rows (two or four weight rows abreast; with AVX2 or the
    # portable code one at a time beyond 2 rows), bfloat16 tiles beyond
    for rows in (1, 2, 4, 5, 8, 9, 40):
        got = kernels.bf16_linear(x[:rows].contiguous(), data, int(format), num_columns)
        assert torch.equal(got, reference[:rows]), f"{rows} rows differ from the dot products' arithmetic"
        # bfloat16's 8 significant bits on both sides: well under 1% of the largest output here
        assert (got.double() - unrounded[:rows]).abs().max() < 0.01 * unrounded.abs().max()


@pytest.mark.parametrize("format", [WeightFormat.Q4_K, WeightFormat.Q6_K, WeightFormat.Q3_K, WeightFormat.Q2_K,
                                    WeightFormat.IQ4_XS, WeightFormat.IQ4_NL, WeightFormat.Q4_1, WeightFormat.F32])
def test_bf16_rows_are_bit_identical_whatever_rows_are_beside_them(kernels, format):
    # Q4_K / Q6_K (Q3_K, Q2_K, IQ4_XS, IQ4_NL: re-quantised from Q4_K): the real tensors have 4864 columns, more than one
    # 2048-column tile step
    data, num_columns = dict(CASES)[format](format) if format != WeightFormat.F32 else synthetic_blocks(format, 37, 600)
    weight = BlockWeight(data, format, num_columns)
    weight.activations = "bf16"
    torch.manual_seed(1)
    x = torch.randn(200, num_columns)
    alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(200)])
    # 8: the most in registers; 97, 120: two tiles of rows, 200: three (at most 96 rows, cut evenly)
    for group in (3, 8, 9, 16, 97, 120, 200):
        together = torch.cat([weight.matmul(x[i:i + group]) for i in range(0, 200, group)])
        assert torch.equal(together, alone), f"rows differ when computed {group} at a time"


def test_bf16_activations_run_float_weights_and_refuse_unknown_settings(kernels):
    layer = BlockLinear(BlockWeight.from_float(torch.randn(8, 64), WeightFormat.F32))
    use_activations(layer, "bf16")  # any format: no block weights needed, unlike int8
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), dot_pairs_reference(x, layer.weight.rows(torch.arange(8))))
    with pytest.raises(ConfigError, match="use one of auto, float32, int8, bf16"):
        use_activations(layer, "fp8")
