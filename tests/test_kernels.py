"""draftwise's CPU kernels (models/kernels/*.cpp): GGUF blocks dequantised exactly as gguf-py
does, products against float64, rows bit-identical whatever rows are beside them, and a clean
fallback where the kernels cannot be built."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants
from hypothesis import given, settings
from hypothesis import strategies as st

from draftwise.models import kernels as kernels_module
from draftwise.models.gguf_index import read_index
from draftwise.models.linear import INT8_FORMATS, BlockLinear, BlockWeight, WeightFormat
from tests.iq4 import quantize_iq4_nl, quantize_iq4_xs
from tests.lattice import LATTICE_FORMATS, random_blocks_like
from tests.q2k import quantize_q2_k
from tests.q3k import quantize_q3_k
from tests.q5k import quantize_q5_k


@pytest.fixture(scope="module")
def kernels():
    built = kernels_module.native_kernels(progress=False)
    assert built is not None, "the kernels must build on the test machines (g++ and ninja are installed)"
    return built


@functools.cache
def _tensors(name: str) -> tuple[np.memmap, list]:
    # draftwise's own tensor table (tests/test_gguf_index.py checks it against gguf-py's reader,
    # which takes ~15 s to parse the 0.5B's metadata)
    from draftwise.models import loading

    loading.resolve(name, auto_fetch=True, progress=False)
    path = loading.gguf_source(name)
    return np.memmap(path, dtype=np.uint8, mode="r"), read_index(path)


@functools.cache
def real_blocks(format: WeightFormat, num_rows: int = 48):
    """Rows of a real tensor in format from the packaged GGUF files (SmolLM2: Q4_1, Q8_0;
    Qwen2.5-Coder-0.5B: Q5_0, Q4_K, Q6_K, Q8_0)."""
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b"):
        file, entries = _tensors(name)
        for entry in entries:
            if entry.format == format and len(entry.shape) == 2:
                row_bytes = entry.num_bytes // entry.shape[1]
                rows = file[entry.offset:entry.offset + num_rows * row_bytes].reshape(num_rows, row_bytes)
                return torch.from_numpy(np.array(rows)), int(entry.shape[0])
    raise AssertionError(f"no {format.name} tensor in the packaged models")


def synthetic_blocks(format: WeightFormat, num_rows: int = 48, num_columns: int = 512):
    torch.manual_seed(int(format))
    weight = torch.randn(num_rows, num_columns) * 0.05
    return BlockWeight.from_float(weight, format).data, num_columns


@functools.cache
def requantized_blocks(format: WeightFormat, num_rows: int = 48):
    """Q5_K, Q3_K, Q2_K, IQ4_XS or IQ4_NL blocks of real weights: Qwen2.5-Coder-0.5B's Q4_K tensor
    rows (4864 columns) dequantised and quantised again (tests/q5k.py, q3k.py, q2k.py, iq4.py), as
    none of the packaged files holds any."""
    quantize = {WeightFormat.Q5_K: quantize_q5_k, WeightFormat.Q3_K: quantize_q3_k,
                WeightFormat.Q2_K: quantize_q2_k, WeightFormat.IQ4_XS: quantize_iq4_xs,
                WeightFormat.IQ4_NL: quantize_iq4_nl}[format]
    data, num_columns = real_blocks(WeightFormat.Q4_K, num_rows)
    weight = quants.dequantize(data.numpy(), WeightFormat.Q4_K).reshape(num_rows, num_columns)
    return torch.from_numpy(quantize(weight)), num_columns


@functools.cache
def lattice_blocks(format: WeightFormat, num_rows: int = 48):
    """Blocks of a lattice format (IQ1_S .. IQ3_S) at a real matrix's scale: Qwen2.5-Coder-0.5B's
    Q4_K rows (4864 columns), each 256-weight block replaced by random lattice points of the same
    root mean square (tests/lattice.py: gguf-py cannot write these formats, and every bit pattern
    is a valid block, so random blocks reach every index, sign and scale the decoders read)."""
    data, num_columns = real_blocks(WeightFormat.Q4_K, num_rows)
    weight = quants.dequantize(data.numpy(), WeightFormat.Q4_K).reshape(num_rows, num_columns)
    return torch.from_numpy(random_blocks_like(weight, format, np.random.default_rng(int(format)))), num_columns


CASES = [(WeightFormat.Q4_1, real_blocks), (WeightFormat.Q8_0, real_blocks), (WeightFormat.Q5_0, real_blocks),
         (WeightFormat.Q4_K, real_blocks), (WeightFormat.Q6_K, real_blocks), (WeightFormat.Q5_K, requantized_blocks),
         (WeightFormat.Q3_K, requantized_blocks), (WeightFormat.Q2_K, requantized_blocks),
         (WeightFormat.IQ4_XS, requantized_blocks), (WeightFormat.IQ4_NL, requantized_blocks),
         (WeightFormat.Q4_0, synthetic_blocks), (WeightFormat.Q5_1, synthetic_blocks), (WeightFormat.BF16, synthetic_blocks),
         (WeightFormat.F16, synthetic_blocks), (WeightFormat.F32, synthetic_blocks)] + [
            (format, lattice_blocks) for format in LATTICE_FORMATS]


@pytest.mark.parametrize("format, make", CASES, ids=[format.name for format, _ in CASES])
def test_dequantisation_is_gguf_py_bit_for_bit(kernels, format, make):
    data, num_columns = make(format)
    reference = torch.from_numpy(np.ascontiguousarray(quants.dequantize(data.numpy(), format), dtype=np.float32))
    ids = torch.arange(data.shape[0])
    got = kernels.dequantize_rows(data, int(format), num_columns, ids)
    assert torch.equal(got, reference.reshape(got.shape))


@pytest.mark.parametrize("num_rows, num_columns", [(64, 576), (131, 1000), (7, 35), (257, 1536)])
def test_the_product_matches_float64(kernels, num_rows, num_columns):
    torch.manual_seed(num_rows)
    weight = torch.randn(num_rows, num_columns)
    x = torch.randn(70, num_columns)  # > 32 rows: the prefill path; 1..32: the decode path
    layer = BlockWeight.from_float(weight, WeightFormat.F32)
    reference = x.double() @ weight.double().T
    for rows in (1, 5, 32, 70):
        out = layer.matmul(x[:rows])
        assert (out.double() - reference[:rows]).abs().max() < 1e-4 * num_columns ** 0.5


# Float formats with a 16-column tail (600 columns) and without one (576: the prefill finishes
# its sums in registers; 2560: three column steps, the middle one parked); block formats have no
# tail (the real tensors: Q4_K and Q6_K come from 4864-column ones, three column steps of the
# block prefill; 4608 synthetic columns give 32-weight blocks three steps too).
INVARIANCE_CASES = [(WeightFormat.F32, 600), (WeightFormat.F32, 576), (WeightFormat.F32, 2560),
                    (WeightFormat.BF16, 600), (WeightFormat.BF16, 576), (WeightFormat.Q4_1, 4608),
                    (WeightFormat.Q8_0, 4608)] + [(format, None) for format in (
                        WeightFormat.Q2_K, WeightFormat.Q3_K, WeightFormat.Q4_K, WeightFormat.Q5_K, WeightFormat.Q6_K, WeightFormat.Q8_0,
                        WeightFormat.Q4_1, WeightFormat.IQ4_XS, WeightFormat.IQ4_NL,
                        WeightFormat.Q5_0, WeightFormat.Q4_0, WeightFormat.Q5_1, *LATTICE_FORMATS)]


@pytest.mark.parametrize("format, synthetic_columns", INVARIANCE_CASES,
                         ids=[f"{format.name}-{columns}" if columns else format.name
                              for format, columns in INVARIANCE_CASES])
def test_each_row_is_bit_identical_whatever_rows_are_beside_it(kernels, format, synthetic_columns):
    if synthetic_columns:  # None: the format's real tensor (CASES)
        data, num_columns = synthetic_blocks(format, 40, synthetic_columns)
    else:
        data, num_columns = dict(CASES)[format](format)
    weight = BlockWeight(data, format, num_columns)
    torch.manual_seed(0)
    x = torch.randn(200, num_columns)
    alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(200)])
    # decode and prefill paths, tails of every size; 97 and 200 rows: the prefill's row tiles (at
    # most 96 rows, cut evenly, rounded to register blocks: 51 + 46 and 69 + 69 + 62 on AVX2)
    for group in (2, 3, 5, 7, 9, 12, 16, 20, 33, 80, 97, 200):
        together = torch.cat([weight.matmul(x[i:i + group]) for i in range(0, 200, group)])
        assert torch.equal(together, alone), f"rows differ when computed {group} at a time"


BLOCK_CASES = [case for case in CASES if case[0] not in (WeightFormat.BF16, WeightFormat.F16, WeightFormat.F32)]


@pytest.mark.parametrize("format, make", BLOCK_CASES, ids=[format.name for format, _ in BLOCK_CASES])
def test_blocks_and_their_dequantised_float32_give_the_same_product(kernels, format, make):
    """The decode path multiplies each block's weights in registers as it decodes them; the
    float32 path multiplies stored floats: the same products in the same order, the same bits
    (45 weight rows: groups of 4, 2 and single rows; 1 to 32 rows of x; on AVX2, 5 to 12 rows of
    x on 32-weight blocks decode pairs of weight rows, and a lone last one, into floats first)."""
    data, num_columns = make(format)
    blocks = BlockWeight(data[:45].contiguous(), format, num_columns)
    dense = BlockWeight.from_float(blocks.rows(torch.arange(blocks.num_rows)), WeightFormat.F32)
    torch.manual_seed(1)
    for rows in (1, 2, 3, 5, 7, 8, 9, 12, 20, 32):
        x = torch.randn(rows, num_columns)
        assert torch.equal(blocks.matmul(x), dense.matmul(x)), f"{rows} rows of x"


INT8_CASES = [(WeightFormat.Q4_1, real_blocks), (WeightFormat.Q8_0, real_blocks), (WeightFormat.Q5_0, real_blocks),
              (WeightFormat.Q4_K, real_blocks), (WeightFormat.Q6_K, real_blocks), (WeightFormat.Q5_K, requantized_blocks),
              (WeightFormat.Q4_0, synthetic_blocks), (WeightFormat.Q5_1, synthetic_blocks)]


def rounded_per_block(x: torch.Tensor, block: int, levels: int = 127) -> torch.Tensor:
    """x with each block of columns rounded to integers of at most `levels` (scale amax / levels):
    8 bits as int8_linear does (127), or 15 per 256 columns as int16_linear does (16383)."""
    blocks = x.reshape(x.shape[0], -1, block)
    top = blocks.abs().amax(-1, keepdim=True)
    # levels / amax, correctly rounded to float32 as the kernel divides (torch's scalar-by-tensor
    # division multiplies by a reciprocal, one ulp off at times: enough to flip a tie)
    inverse = torch.where(top > 0, (levels / top.double().clamp_min(1e-30)).float(), torch.zeros_like(top))
    return ((blocks * inverse).round().clamp(-levels, levels) * (top / levels)).reshape(x.shape)


@pytest.mark.parametrize("format, make", INT8_CASES, ids=[format.name for format, _ in INT8_CASES])
def test_int8_activations_compute_the_blocks_times_the_rounded_input(kernels, format, make):
    data, num_columns = make(format)
    weight = BlockWeight(data, format, num_columns)
    dense = weight.rows(torch.arange(weight.num_rows)).double()
    torch.manual_seed(int(format))
    x = torch.randn(40, num_columns) * 3
    block = 256 if format in (WeightFormat.Q4_K, WeightFormat.Q5_K, WeightFormat.Q6_K) else 32
    reference = rounded_per_block(x, block).double() @ dense.T
    unrounded = x.double() @ dense.T
    for rows in (1, 9, 40):  # the decode kernel (weights unpacked in registers) and the prefill one
        got = kernels.int8_linear(x[:rows], data, int(format), num_columns).double()
        # exact integer dot products: only float32 rounding of the scales and the sums is left
        assert (got - reference[:rows]).abs().max() < 1e-5 * reference.abs().max()
        # and the rounding of x is what separates it from float32 activations (~1% here)
        assert (got - unrounded[:rows]).abs().max() < 0.05 * unrounded.abs().max()


@pytest.mark.parametrize("format", [WeightFormat.Q4_0, WeightFormat.Q4_1, WeightFormat.Q5_0, WeightFormat.Q5_1,
                                    WeightFormat.Q8_0], ids=lambda f: f.name)
@pytest.mark.parametrize("num_columns", [96, 576])  # 96: a last 64-column step with one block
def test_int8_rows_on_32_weight_blocks_are_the_same_bits_in_registers_and_unpacked(kernels, format, num_columns):
    """Up to 16 rows of x meet each weight row decoded in registers; more go through rows unpacked
    in memory. Both are the same arithmetic: every row the same bits either way."""
    data, _ = synthetic_blocks(format, num_rows=37, num_columns=num_columns)
    torch.manual_seed(2)
    x = torch.randn(34, num_columns)
    unpacked = kernels.int8_linear(x, data, int(format), num_columns)  # 34 rows: the unpacked path
    for group in (1, 2, 3, 4, 7, 8, 9, 16):  # up to 4: two weight rows at a time (block32_decode_pair)
        in_registers = torch.cat([kernels.int8_linear(x[i:i + group], data, int(format), num_columns)
                                  for i in range(0, 34, group)])
        assert torch.equal(in_registers, unpacked), f"{group} rows at a time differ from the unpacked rows"


def test_int8_activations_need_block_weights(kernels):
    from draftwise.errors import ConfigError
    from draftwise.models.linear import use_activations

    float_layer = BlockLinear(BlockWeight.from_float(torch.randn(8, 64), WeightFormat.F32))
    with pytest.raises(ConfigError, match="--quantize int8"):
        use_activations(float_layer, "int8")
    with pytest.raises(ConfigError, match="use one of auto, float32, int8"):
        use_activations(float_layer, "int4")
    with pytest.raises(RuntimeError, match="no int8 path"):
        kernels.int8_linear(torch.randn(2, 64), float_layer.weight.data, int(WeightFormat.F32), 64)
    for format in (WeightFormat.Q3_K, WeightFormat.Q2_K, WeightFormat.IQ4_NL):  # block formats without one
        data, num_columns = requantized_blocks(format, 4)
        with pytest.raises(RuntimeError, match="no int8 path"):  # not a product read with a wrong layout
            kernels.int8_linear(torch.randn(2, num_columns), data, int(format), num_columns)


INT16_CASES = [(WeightFormat.Q4_K, real_blocks), (WeightFormat.Q6_K, real_blocks),
               (WeightFormat.Q5_K, requantized_blocks), (WeightFormat.Q3_K, requantized_blocks),
               (WeightFormat.IQ4_XS, requantized_blocks)]


@pytest.mark.parametrize("format, make", INT16_CASES, ids=[format.name for format, _ in INT16_CASES])
def test_int16_activations_compute_the_blocks_times_the_rounded_input(kernels, format, make):
    data, num_columns = make(format)
    dense = BlockWeight(data, format, num_columns).rows(torch.arange(data.shape[0])).double()
    torch.manual_seed(int(format))
    x = torch.randn(40, num_columns) * 3
    reference = rounded_per_block(x, 256, levels=16383).double() @ dense.T
    unrounded = x.double() @ dense.T
    # int8's error, or for Q3_K and IQ4_XS (no int8 path) that of the same input rounded to 8 bits per 32
    int8 = kernels.int8_linear(x, data, int(format), num_columns) if format in INT8_FORMATS else \
        rounded_per_block(x, 32, levels=127).double() @ dense.T
    int8_error = (int8.double() - unrounded).abs().max()
    for rows in (1, 3, 40):  # the decode kernel (weights multiplied as they are unpacked) and the tile one
        got = kernels.int16_linear(x[:rows], data, int(format), num_columns).double()
        # exact integer dot products: only float32 rounding of the scales and the sums is left
        assert (got - reference[:rows]).abs().max() < 1e-5 * reference.abs().max()
        # 14 bits and a sign a value where int8 keeps 7: ~100x closer to float32 activations than
        # int8 (the step 16383 / 127 = 129x finer; the largest error here ~96x smaller)
        assert (got - unrounded[:rows]).abs().max() < 0.02 * int8_error


# The groups of rows of x that end on every path and every smaller tile of each integer kernel.
# int8: in registers up to 16 rows, in passes of at most 9 (AVX-512) or 4 (AVX2: 5 = 2 + 3,
# 7 = 3 + 4, 10 = 3 + 3 + 4); from 17 the unpacked path, whose tiles take 4 rows of x at a time
# (AVX2's K-quant tile: 6), so 17, 19, 21, 22 and 80 end on every smaller tile: 17 = 6 + 6 + 5,
# 19 = ... + 1, 21 = ... + 3, 22 = ... + 4, 80 = 13 x 6 + 2 (with 4: + 1, + 3, + 1, + 2, + 0);
# 80, 97 and 200 span several of its row tiles (at least 64 rows, cut evenly).
# int16: up to 12 rows (AVX-512 VNNI: 24) the decode path, in even groups of at most 8 (12; 9 =
# 5 + 4, 13 = 7 + 6; Q4_K, Q5_K, Q6_K, Q3_K and IQ4_XS in registers); beyond, the tile path, 4
# rows of x by 2 (AVX-512: 4, then 2, 1) weight rows at a time, in row tiles of at most 96: 13, 14,
# 15 (AVX-512: 25, 26, 27) end on every smaller block, 97 and 200 span several row tiles.
ROW_GROUPS = {"int8": (3, 5, 7, 9, 10, 16, 17, 19, 21, 22, 80, 97, 200),
              "int16": (2, 3, 5, 8, 9, 12, 13, 14, 15, 24, 25, 26, 27, 97, 200)}
INTEGER_ROW_CASES = [("int8", format) for format in (WeightFormat.Q4_K, WeightFormat.Q5_K, WeightFormat.Q6_K,
                                                     WeightFormat.Q4_1, WeightFormat.Q8_0)] + \
                    [("int16", format) for format in (WeightFormat.Q4_K, WeightFormat.Q5_K, WeightFormat.Q6_K,
                                                      WeightFormat.Q3_K, WeightFormat.IQ4_XS)]


@pytest.mark.parametrize("activations, format", INTEGER_ROW_CASES,
                         ids=[f"{activations}-{format.name}" for activations, format in INTEGER_ROW_CASES])
def test_integer_rows_are_bit_identical_whatever_rows_are_beside_them(kernels, activations, format):
    # 47 weight rows: the unpacked (int8) and tile (int16) paths' last item of 16 rows ends on a
    # lone weight row
    data, num_columns = dict(CASES)[format](format, 47)
    weight = BlockWeight(data, format, num_columns)
    weight.activations = activations
    torch.manual_seed(1)
    x = torch.randn(200, num_columns)
    alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(200)])
    for group in ROW_GROUPS[activations]:
        together = torch.cat([weight.matmul(x[i:i + group]) for i in range(0, 200, group)])
        assert torch.equal(together, alone), f"rows differ when computed {group} at a time"


def test_int16_activations_need_k_quant_blocks(kernels):
    from draftwise.errors import ConfigError
    from draftwise.models.linear import use_activations

    data, num_columns = synthetic_blocks(WeightFormat.Q4_1, num_rows=8, num_columns=64)
    layer = BlockLinear(BlockWeight(data, WeightFormat.Q4_1, num_columns))
    with pytest.raises(ConfigError, match="Q4_K_M"):
        use_activations(layer, "int16")
    with pytest.raises(RuntimeError, match="no int16 path"):
        kernels.int16_linear(torch.randn(2, 64), data, int(WeightFormat.Q4_1), 64)


@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 12, 128), (9, 2, 128), (40, 9, 64)])
def test_rotary_is_pytorchs_formula_bit_for_bit(kernels, tokens, heads, head_dim):
    # The kernel replaces x * cos + rotate_half(x) * sin in the decoder: it must not change a bit
    # (no fused multiply-add), or every model's logits would move with it.
    from draftwise.models.ops import rotate_half

    torch.manual_seed(tokens)
    x = torch.randn(tokens, heads, head_dim) * 4
    angles = torch.randn(tokens, 1, head_dim) * 50
    cos, sin = angles.cos(), angles.sin()
    expected = x * cos + rotate_half(x) * sin
    got = x.clone()
    kernels.rotary(got, cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim))
    assert torch.equal(got, expected)


# SmolLM2-135M's shape, Qwen2.5-1.5B's and Qwen2.5-0.5B's: groups of 3, 6 and 7 heads (run 4, 2 or
# 1 at a time) over head_dim 64 and 128; and head sizes with no register path (32, 96)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (12, 2, 128), (14, 2, 64), (4, 2, 32), (6, 3, 96)])
def test_attention_matches_sdpa_and_is_row_invariant(kernels, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    start, num_new = 50, 7
    keys, values = torch.randn(kv_heads, 100, head_dim), torch.randn(kv_heads, 100, head_dim)
    queries = torch.randn(num_new, heads, head_dim)
    causal = torch.empty(0, dtype=torch.bool)
    out = kernels.attention(queries, keys, values, start, causal, head_dim ** -0.5)
    mask = torch.cat((torch.ones(num_new, start, dtype=torch.bool), torch.ones(num_new, num_new, dtype=torch.bool).tril()), 1)
    reference = F.scaled_dot_product_attention(queries.transpose(0, 1)[None], keys[None, :, :start + num_new],
                                               values[None, :, :start + num_new], attn_mask=mask, enable_gqa=True)
    assert (out - reference[0].transpose(0, 1)).abs().max() < 1e-5
    alone = torch.cat([kernels.attention(queries[i:i + 1], keys, values, start + i, causal, head_dim ** -0.5)
                       for i in range(num_new)])
    assert torch.equal(out, alone)
    # A tree whose node 3 hangs off node 0: node 3 sees slots 0..start-1, node 0 and itself,
    # exactly what a lone query at slot start + 1 sees when slot start + 1 holds node 3's key.
    tree = torch.eye(num_new, dtype=torch.bool)
    tree[:, 0] = True
    out_tree = kernels.attention(queries, keys, values, start, tree, head_dim ** -0.5)
    moved_keys, moved_values = keys.clone(), values.clone()
    moved_keys[:, start + 1], moved_values[:, start + 1] = keys[:, start + 3], values[:, start + 3]
    node_3_alone = kernels.attention(queries[3:4], moved_keys, moved_values, start + 1, causal, head_dim ** -0.5)
    assert torch.equal(out_tree[3:4], node_3_alone)


# Gemma 3 270M's shape (4 heads over 1 key/value head of 256) and SmolLM2's; float32 and bfloat16
# caches (the bfloat16 one takes the AMX scores where the CPU has them)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 1, 256), (9, 3, 64)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_attention_within_a_sliding_window_matches_sdpa_and_is_row_invariant(kernels, heads, kv_heads, head_dim,
                                                                             cache_dtype):
    """window > 0: position p sees keys p - window + 1 .. p (transformers' sliding_window_overlay).
    A prefill chunk longer than the window, its rows alone, and a tree node whose window reaches
    back into the committed slots all get the arithmetic of a lone query at their position."""
    torch.manual_seed(5)
    window, start, num_new = 40, 70, 50  # the chunk's later rows no longer see its first ones
    keys = torch.randn(kv_heads, 160, head_dim).to(cache_dtype)
    values = torch.randn(kv_heads, 160, head_dim).to(cache_dtype)
    queries = torch.randn(num_new, heads, head_dim)
    causal = torch.empty(0, dtype=torch.bool)
    scale = 0.07
    out = kernels.attention(queries, keys, values, start, causal, scale, True, window)
    if cache_dtype == torch.float32:
        slot = torch.arange(start + num_new)
        position = torch.arange(start, start + num_new)[:, None]
        mask = (slot <= position) & (slot > position - window)
        reference = F.scaled_dot_product_attention(queries.transpose(0, 1)[None], keys[None, :, :start + num_new],
                                                   values[None, :, :start + num_new], attn_mask=mask, scale=scale,
                                                   enable_gqa=True)
        assert (out - reference[0].transpose(0, 1)).abs().max() < 1e-5
        without = kernels.attention(queries, keys, values, start, causal, scale, True)
        assert (out[-1] - without[-1]).abs().max() > 1e-3  # the window matters here
    alone = torch.cat([kernels.attention(queries[i:i + 1], keys, values, start + i, causal, scale, True, window)
                       for i in range(num_new)])
    assert torch.equal(out, alone)
    # A tree after `start` committed slots, node 3 a child of node 0: its window holds committed
    # slots start - window + 2 .. start - 1, node 0 and itself, as a lone query at slot start + 1
    # over a cache holding node 3's key there.
    tree = torch.eye(5, dtype=torch.bool)
    tree[:, 0] = True
    out_tree = kernels.attention(queries[:5], keys, values, start, tree, scale, True, window)
    moved_keys, moved_values = keys.clone(), values.clone()
    moved_keys[:, start + 1], moved_values[:, start + 1] = keys[:, start + 3], values[:, start + 3]
    node_3_alone = kernels.attention(queries[3:4], moved_keys, moved_values, start + 1, causal, scale, True, window)
    assert torch.equal(out_tree[3:4], node_3_alone)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (12, 2, 128), (6, 3, 96)])
def test_attention_over_a_bfloat16_cache_is_the_float32_arithmetic_on_its_values(kernels, heads, kv_heads, head_dim):
    # --kv-cache bf16: each entry widens to float32 exactly as it is read, so the result is
    # attention over the widened cache, bit for bit, and still the same for a row alone.
    torch.manual_seed(1)
    start, num_new = 40, 6
    keys = torch.randn(kv_heads, 64, head_dim).bfloat16()
    values = torch.randn(kv_heads, 64, head_dim).bfloat16()
    queries = torch.randn(num_new, heads, head_dim)
    causal = torch.empty(0, dtype=torch.bool)
    out = kernels.attention(queries, keys, values, start, causal, head_dim ** -0.5)
    assert torch.equal(out, kernels.attention(queries, keys.float(), values.float(), start, causal, head_dim ** -0.5))
    alone = torch.cat([kernels.attention(queries[i:i + 1], keys, values, start + i, causal, head_dim ** -0.5)
                       for i in range(num_new)])
    assert torch.equal(out, alone)
    # A tree (random ancestors): keys seen in runs that start anywhere, so four-key runs cross
    # the 32-key tiles a several-position item widens at a time.
    chain_beside_a_sibling = torch.eye(num_new, dtype=torch.bool)  # node 0 alone; 1 -> 2 -> ... -> 5
    for node in range(2, num_new):
        chain_beside_a_sibling[node, 1:node] = True  # at start 30, node 5 reads slots 31..34 in one run
    for start, tree in [(30, chain_beside_a_sibling)] + [
            (start, (torch.rand(num_new, num_new) < 0.5).tril() | torch.eye(num_new, dtype=torch.bool))
            for start in (29, 30, 31, 33)]:
        got = kernels.attention(queries, keys, values, start, tree, head_dim ** -0.5)
        assert torch.equal(got, kernels.attention(queries, keys.float(), values.float(), start, tree, head_dim ** -0.5))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.attention(queries, keys, values.float(), start, causal, head_dim ** -0.5)


# SmolLM2's groups of 3 heads (one tile of 16 queries for up to 5 positions), Qwen2.5-1.5B's 6 over
# head_dim 128 (4 steps of 32 dimensions), Qwen2.5-0.5B's 7 (56 queries: 4 tiles of them)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (12, 2, 128), (14, 2, 64)])
def test_attention_scores_on_amx_tiles_are_close_and_the_same_bits_for_a_row_alone(kernels, heads, kv_heads, head_dim):
    # amx_scores: a bfloat16 cache's scores on AMX tiles, the queries rounded to bfloat16 (the
    # default where the linears run there too). Not the float32 scores' bits, but each (query,
    # key) score is its own tile element, so a row alone, in a tree, or over any threads gets
    # the same bits. The cache holds exactly the filled slots: the last block of 16 keys is
    # partial and no slot past it may be read.
    torch.manual_seed(5)
    start, num_new, scale = 37, 9, head_dim ** -0.5
    keys = torch.randn(kv_heads, start + num_new, head_dim).bfloat16()
    values = torch.randn(kv_heads, start + num_new, head_dim).bfloat16()
    queries = torch.randn(num_new, heads, head_dim)
    causal = torch.empty(0, dtype=torch.bool)
    exact = kernels.attention(queries, keys, values, start, causal, scale)
    got = kernels.attention(queries, keys, values, start, causal, scale, True)
    if kernels.amx_scores_enabled():
        assert not torch.equal(got, exact) and (got - exact).abs().max() < 5e-3
    else:  # no AMX here: the request changes nothing
        assert torch.equal(got, exact)
    alone = torch.cat([kernels.attention(queries[i:i + 1], keys, values, start + i, causal, scale, True)
                       for i in range(num_new)])
    assert torch.equal(got, alone)
    tree = torch.eye(num_new, dtype=torch.bool)  # node 3 hangs off node 0, as in the float32 test above
    tree[:, 0] = True
    out_tree = kernels.attention(queries, keys, values, start, tree, scale, True)
    moved_keys, moved_values = keys.clone(), values.clone()
    moved_keys[:, start + 1], moved_values[:, start + 1] = keys[:, start + 3], values[:, start + 3]
    assert torch.equal(out_tree[3:4], kernels.attention(queries[3:4], moved_keys, moved_values, start + 1, causal,
                                                        scale, True))
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(kernels.attention(queries, keys, values, start, causal, scale, True), got)
            assert torch.equal(kernels.attention(queries, keys, values, start, tree, scale, True), out_tree)
    finally:
        torch.set_num_threads(threads)
    # A float32 cache has no bfloat16 keys to put in tiles: the flag changes nothing there.
    assert torch.equal(kernels.attention(queries, keys.float(), values.float(), start, causal, scale, True),
                       kernels.attention(queries, keys.float(), values.float(), start, causal, scale))


@pytest.mark.parametrize("head_dim", [16, 48, 80])
def test_attention_scores_stay_float32_for_heads_not_a_whole_number_of_tile_steps(kernels, head_dim):
    # A tile step is 32 dimensions: a head of 48 or 80 would leave its last 16 out of the scores,
    # so the request is ignored there, and the result is the float32 scores' exactly.
    torch.manual_seed(6)
    start, num_new, scale = 30, 4, head_dim ** -0.5
    keys = torch.randn(2, start + num_new, head_dim).bfloat16()
    values = torch.randn(2, start + num_new, head_dim).bfloat16()
    queries = torch.randn(num_new, 6, head_dim)
    causal = torch.empty(0, dtype=torch.bool)
    assert torch.equal(kernels.attention(queries, keys, values, start, causal, scale, True),
                       kernels.attention(queries, keys, values, start, causal, scale))


@pytest.mark.parametrize("num_new", range(1, 10))
def test_attention_bits_do_not_depend_on_how_threads_share_the_positions(kernels, num_new):
    # SmolLM2's 3 key/value heads over 2 threads: 2-8 positions go in more chunks than over 1
    # thread (rowwise.cpp's balanced_chunks), a tree's too; each query's bits must not move.
    torch.manual_seed(num_new)
    start, scale = 45, 64 ** -0.5
    keys, values = torch.randn(3, 64, 64).bfloat16(), torch.randn(3, 64, 64).bfloat16()
    queries = torch.randn(num_new, 9, 64)
    tree = (torch.rand(num_new, num_new) < 0.5).tril() | torch.eye(num_new, dtype=torch.bool)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append([kernels.attention(queries, keys, values, start, mask, scale)
                            for mask in (torch.empty(0, dtype=torch.bool), tree)])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (12, 2, 128)])
def test_a_mask_may_reach_back_over_slots_before_the_new_rows(kernels, heads, kv_heads, head_dim, cache_dtype):
    # An EAGLE drafter's tree: its earlier levels sit in its cache just before the new rows, and a
    # [T, W] mask says which of those W - T slots (and which new rows) each new row sees.
    torch.manual_seed(3)
    start, num_new, back, scale = 37, 4, 5, head_dim ** -0.5
    keys = torch.randn(kv_heads, 64, head_dim).to(cache_dtype)
    values = torch.randn(kv_heads, 64, head_dim).to(cache_dtype)
    queries = torch.randn(num_new, heads, head_dim)
    wide = torch.rand(num_new, back + num_new) < 0.5
    wide[:, back:] = (torch.rand(num_new, num_new) < 0.5).tril() | torch.eye(num_new, dtype=torch.bool)
    got = kernels.attention(queries, keys, values, start, wide, scale)
    seen = torch.cat((torch.ones(num_new, start - back, dtype=torch.bool), wide), 1)
    reference = F.scaled_dot_product_attention(
        queries.transpose(0, 1)[None], keys[None, :, :start + num_new].float(), values[None, :, :start + num_new].float(),
        attn_mask=seen, enable_gqa=True)
    assert (got - reference[0].transpose(0, 1)).abs().max() < 1e-5
    # Row by row, each alone at its own slot, the same bits.
    alone = torch.cat([kernels.attention(queries[i:i + 1], keys, values, start + i, wide[i:i + 1, :back + i + 1].contiguous(),
                                         scale) for i in range(num_new)])
    assert torch.equal(got, alone)
    # Reach-back columns all True: the [T, T] mask's bits.
    all_back = wide.clone()
    all_back[:, :back] = True
    assert torch.equal(kernels.attention(queries, keys, values, start, all_back, scale),
                       kernels.attention(queries, keys, values, start, wide[:, back:].contiguous(), scale))
    with pytest.raises(RuntimeError, match=r"\[T, W\], T <= W <= start \+ T"):
        kernels.attention(queries, keys, values, 2, wide, scale)  # reaches back past slot 0


def test_a_reaching_back_mask_without_the_kernels(monkeypatch, kernels):
    from draftwise.models import ops

    torch.manual_seed(4)
    keys, values = torch.randn(3, 32, 64), torch.randn(3, 32, 64)
    queries = torch.randn(3, 9, 64)
    wide = torch.rand(3, 7) < 0.5
    wide[:, 4:] = torch.eye(3, dtype=torch.bool)
    expected = kernels.attention(queries, keys, values, 20, wide, 64 ** -0.5)
    monkeypatch.setattr(kernels_module, "_BUILT", {})
    monkeypatch.setenv(kernels_module.DISABLE_ENV, "0")
    assert kernels_module.native_kernels(progress=False) is None
    assert (ops.attention(queries, keys, values, 20, wide) - expected).abs().max() < 1e-5


def test_row_wise_ops_match_pytorch(kernels):
    gate, up = torch.randn(5, 1539) * 4, torch.randn(5, 1539)
    assert (kernels.silu_mul(gate, up) - F.silu(gate) * up).abs().max() < 1e-5
    gate[0, :4] = torch.tensor([-30.0, 30.0, -1e4, 1e4])  # far tails: no overflow, no NaN
    gelu = kernels.gelu_tanh_mul(gate, up)
    assert (gelu - F.gelu(gate, approximate="tanh") * up).abs().max() < 1e-5
    # each element its own: a row alone gives the same bits as among five
    assert torch.equal(kernels.gelu_tanh_mul(gate[3:4].contiguous(), up[3:4].contiguous()), gelu[3:4])
    x, weight = torch.randn(6, 576), torch.randn(576)
    reference = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert (kernels.rms_norm(x, weight, 1e-5) - reference).abs().max() < 1e-5


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 70).flatmap(lambda width: st.lists(
    st.lists(st.sampled_from([-1.0, 0.0, -0.0, 2.0, 2.0, 3.0, 3.0, float("nan"), float("-inf"), float("inf")]),
             min_size=width, max_size=width), min_size=1, max_size=9)))
def test_argmax_rows_is_torch_argmax_with_ties_nans_and_tails(kernels, rows):
    """The kernel behind greedy verification: each row's first maximum, a NaN the largest,
    over widths that end inside and outside the 16-lane steps (the lanes each keep their own)."""
    logits = torch.tensor(rows)
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=-1))


def test_greedy_verification_takes_its_argmax_from_the_loaded_kernels(kernels, monkeypatch):
    """Over a real vocabulary's width, random and with planted ties (the first must win), the
    verifier's argmax_rows answers what torch does; and it runs the kernel once one is loaded,
    never starting a build itself."""
    from draftwise import verify

    logits = torch.randn(10, 49152)
    logits[3, 100] = logits[3, 100 + 16 * 2491] = logits[3].max() + 1.0  # one lane: its first must win
    logits[4, 7] = float("nan")
    calls = []
    monkeypatch.setattr(verify, "loaded_kernels", lambda: calls.append(1) or kernels)
    assert torch.equal(verify.argmax_rows(logits), logits.argmax(dim=-1))
    assert calls and int(verify.argmax_rows(logits)[3]) == 100
    monkeypatch.setattr(kernels_module, "_BUILT", {})
    monkeypatch.setattr(verify, "loaded_kernels", kernels_module.loaded_kernels)
    assert verify.loaded_kernels() is None  # nothing built in this process: max() answers
    assert torch.equal(verify.argmax_rows(logits), logits.argmax(dim=-1))


def test_a_lattice_codebook_of_the_wrong_shape_is_refused(kernels):
    """The decoders index a codebook as far as its format's indices reach: a table of another
    shape would be read past its end, so it is refused (and the one in use stays)."""
    with pytest.raises(RuntimeError, match=r"codebook must be float32 \[256, 8\]"):
        kernels.set_lattice_grid(int(WeightFormat.IQ2_XXS), torch.zeros(128, 8))
    with pytest.raises(RuntimeError, match="not a lattice format"):
        kernels.set_lattice_grid(int(WeightFormat.Q4_K), torch.zeros(256, 8))
    data, num_columns = lattice_blocks(WeightFormat.IQ2_XXS)
    reference = quants.dequantize(data.numpy(), WeightFormat.IQ2_XXS).reshape(data.shape[0], num_columns)
    assert torch.equal(kernels.dequantize_rows(data, int(WeightFormat.IQ2_XXS), num_columns, torch.arange(data.shape[0])),
                       torch.from_numpy(np.ascontiguousarray(reference, dtype=np.float32)))


def test_bad_shapes_are_refused_with_the_reason(kernels):
    data, num_columns = synthetic_blocks(WeightFormat.Q8_0)  # 512 columns: 16 blocks of 34 bytes
    with pytest.raises(RuntimeError, match=r"blocked_linear: x \[2, 513\] does not have 512 columns"):
        kernels.blocked_linear(torch.randn(2, num_columns + 1), data, int(WeightFormat.Q8_0), num_columns)
    with pytest.raises(RuntimeError, match="544 bytes per row do not hold 256 weights of format 8"):
        kernels.blocked_linear(torch.randn(2, 256), data, int(WeightFormat.Q8_0), 256)
    with pytest.raises(RuntimeError, match="weight format 99 is not supported"):
        kernels.blocked_linear(torch.randn(2, num_columns), data, 99, num_columns)


def test_the_kernels_refusals_format_no_number_through_an_ostream():
    """Every TORCH_CHECK in the kernels passes text alone, its numbers written by message.h's
    say(): on an H200 machine's CUDA build of PyTorch (2.11+cu130, g++ 13.3) a TORCH_CHECK that
    formatted an integer itself crashed the process with a segmentation fault instead of raising
    (the two refusal tests above died with their pytest workers), which no CPU build here shows."""
    import re

    def arguments(call: str) -> list[str]:
        call = re.sub(r'"(\\.|[^"\\])*"', '""', call)  # string literals, commas and brackets inside them out of the way
        parts, depth, current = [], 0, ""
        for char in call:
            depth += (char in "([{") - (char in ")]}")
            if char == "," and depth == 0:
                parts.append(current.strip())
                current = ""
            else:
                current += char
        return parts + [current.strip()]

    offenders = []
    for source in sorted(kernels_module.KERNEL_DIR.glob("*.[ch]*")):
        text = source.read_text()
        for match in re.finditer(r"TORCH_CHECK\(", text):
            end, depth = match.end(), 1
            while depth:
                depth += (text[end] == "(") - (text[end] == ")")
                end += 1
            message = arguments(text[match.end():end - 1])[1:]
            if not all(part == '""' or part.startswith("say(") for part in message):
                offenders.append(f"{source.name}: {text[match.start():end][:120]}")
    assert not offenders, "pass numbers through say(...), not TORCH_CHECK's own formatting:\n" + "\n".join(offenders)


def test_a_failed_build_warns_once_with_the_fix_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    data, num_columns = real_blocks(WeightFormat.Q4_K)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(kernels_module, "_BUILT", {})  # forget this process's build
    with pytest.warns(RuntimeWarning, match=r"c\+\+: command not found.*pip install ninja"):
        assert kernels_module.native_kernels(progress=False) is None
    fallback = BlockLinear(BlockWeight(data, WeightFormat.Q4_K, num_columns))
    assert fallback.weight.kernels is None
    x = torch.randn(3, num_columns)
    dense = torch.from_numpy(quants.dequantize(data.numpy(), WeightFormat.Q4_K)).reshape(-1, num_columns)
    assert (fallback(x) - x @ dense.T).abs().max() < 1e-4
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call must not warn again
        assert kernels_module.native_kernels(progress=False) is None


def test_a_failed_build_names_the_compilers_error_and_its_fix_not_the_command(monkeypatch):
    """PyTorch's message opens with the whole compile command; the warning gives the compiler's
    error line instead (clang without libomp-dev's headers, as met with clang 14)."""
    import torch.utils.cpp_extension as cpp_extension

    def no_openmp(*args, **kwargs):
        raise RuntimeError("Error building extension 'draftwise_kernels': [1/8] clang++-14 -MMD -MF linear.o.d "
                           "-O3 -ffp-contract=off -fopenmp -march=native -c linear.cpp -o linear.o\n"
                           "FAILED: linear.o\nIn file included from linear.cpp:4:\n"
                           "torch/include/ATen/ParallelOpenMP.h:12:10: fatal error: 'omp.h' file not found\n"
                           "1 error generated.")

    monkeypatch.setattr(cpp_extension, "load", no_openmp)
    monkeypatch.setattr(kernels_module, "_BUILT", {})
    with pytest.warns(RuntimeWarning) as caught:
        assert kernels_module.native_kernels(progress=False) is None
    message = str(caught[0].message)
    assert "fatal error: 'omp.h' file not found" in message and "libomp-dev" in message
    assert "-MMD" not in message


@pytest.mark.parametrize("machine, flags, march, portable", [
    ("x86_64", "flags\t: fpu sse4_2 avx avx2 fma avx512f", None, False),
    ("x86_64", "flags\t: fpu sse4_2 avx2 fma", None, False),
    ("x86_64", "flags\t: fpu sse4_2 popcnt", None, True),  # an x86 without AVX2
    ("aarch64", "", None, True),
    ("x86_64", "flags\t: fpu sse4_2 avx2 fma avx512f", "x86-64-v2", True),  # asked for below AVX2
    ("x86_64", "flags\t: fpu sse4_2 avx2 fma avx512f", "x86-64-v3", False),
])
def test_the_first_builds_message_says_how_long_it_takes_on_this_cpu(monkeypatch, tmp_path, capsys, machine, flags,
                                                                      march, portable):
    """Without AVX2 the build is the portable vector code: ~3 minutes on 2 cores, not the usual ~2,
    and slower products; the first build's message says so before the wait."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(kernels_module.platform, "machine", lambda: machine)
    monkeypatch.setattr(kernels_module, "_cpu_flags_line", lambda: flags)
    if march is None:
        monkeypatch.delenv(kernels_module.MARCH_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels_module.MARCH_ENV, march)
    monkeypatch.setattr(kernels_module, "_build_directory", lambda: tmp_path / "build")
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: "built")
    assert kernels_module._build(progress=True) == "built"
    message = capsys.readouterr().err
    assert kernels_module.builds_portable_code() is portable
    if portable:
        assert "about 3 minutes" in message and "without AVX2" in message and "slower" in message
    else:
        assert "about 2 minutes" in message and "AVX2" not in message


def test_a_new_build_removes_the_builds_nobody_loaded_for_a_month(monkeypatch, tmp_path):
    """Every upgrade, torch version or checkout makes its own build; a new one clears the others
    unused for STALE_AFTER_DAYS (by their last load, not their age), and nothing else."""
    import os
    import time

    import torch.utils.cpp_extension as cpp_extension

    root = tmp_path / "kernels"
    day = 86400.0
    now = time.time()

    def build(name: str, built_days_ago: float, loaded_days_ago: float | None) -> Path:
        folder = root / name
        folder.mkdir(parents=True)
        library = folder / "draftwise_kernels.so"
        library.write_bytes(b"")
        stamps = [library, folder]
        if loaded_days_ago is not None:
            (folder / kernels_module.USED_MARKER).touch()
            os.utime(folder / kernels_module.USED_MARKER, (now - loaded_days_ago * day,) * 2)
        for path in stamps:
            os.utime(path, (now - built_days_ago * day,) * 2)
        return folder

    old_unused = build("draftwise_kernels-aaaaaaaaaaaa", 90, 45)
    old_in_use = build("draftwise_kernels-bbbbbbbbbbbb", 90, 2)  # built long ago, loaded this week
    before_markers = build("draftwise_kernels-cccccccccccc", 40, None)  # a build from before the marker
    recent = build("draftwise_kernels-dddddddddddd", 3, None)
    not_a_build = root / "notes"
    not_a_build.mkdir()
    os.utime(not_a_build, (now - 90 * day,) * 2)

    new = root / "draftwise_kernels-eeeeeeeeeeee"
    monkeypatch.setattr(kernels_module, "_build_directory", lambda: new)

    def compile_it(**kwargs):
        (new / "draftwise_kernels.so").write_bytes(b"")
        return "built"

    monkeypatch.setattr(cpp_extension, "load", compile_it)
    assert kernels_module._build(progress=False) == "built"
    assert not old_unused.exists() and not before_markers.exists()
    assert old_in_use.exists() and recent.exists() and not_a_build.exists() and new.exists()
    assert time.time() - (new / kernels_module.USED_MARKER).stat().st_mtime < day

    # A later load of an existing build is not a new build: it only stamps its own use.
    os.utime(recent, (now - 60 * day,) * 2)
    os.utime(recent / "draftwise_kernels.so", (now - 60 * day,) * 2)
    assert kernels_module._build(progress=False) == "built"
    assert recent.exists()


def test_loading_a_build_stamps_it_as_used(monkeypatch, tmp_path):
    """The stamp is what keeps a build in use from another build's clean-up."""
    import os
    import time

    import torch.utils.cpp_extension as cpp_extension

    folder = tmp_path / "draftwise_kernels-ffffffffffff"
    folder.mkdir()
    (folder / "draftwise_kernels.so").write_bytes(b"")
    (folder / kernels_module.USED_MARKER).touch()
    for path in (folder / kernels_module.USED_MARKER, folder / "draftwise_kernels.so", folder):
        os.utime(path, (time.time() - 50 * 86400,) * 2)
    assert kernels_module._last_used(folder) < time.time() - 49 * 86400
    monkeypatch.setattr(kernels_module, "_build_directory", lambda: folder)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: "loaded")
    assert kernels_module._build(progress=False) == "loaded"
    assert time.time() - kernels_module._last_used(folder) < 60


@pytest.mark.parametrize("compiler", [("gcc", "12.2.0"), ("gcc", "13.3.0"), ("clang", "14.0.6"), ("", "")])
def test_no_compiler_fuses_products_and_sums_by_itself_and_each_compiler_has_its_own_build(monkeypatch, compiler):
    """GCC 13.3 contracted a Q4_0 product's decode and dequantised paths differently (an ulp
    apart: docs/weight-formats.md, "CPUs with AVX2 but no AVX-512, and compilers"); the kernels now spell every fused multiply-add (vec.h's fmadd)
    and build with contraction off whatever the compiler, and a build made by one compiler
    never answers for another."""
    monkeypatch.setattr(kernels_module, "_compiler", lambda: compiler)
    assert kernels_module._contraction_flags() == ["-ffp-contract=off"]
    directory = kernels_module._build_directory()
    monkeypatch.setattr(kernels_module, "_compiler", lambda: ("gcc", "12.3.0" if compiler[1] != "12.3.0" else "14.1.0"))
    assert kernels_module._build_directory() != directory


def test_an_instruction_set_asked_for_gets_its_own_build(monkeypatch):
    """DRAFTWISE_MARCH builds for another instruction set (the AVX2 paths on an AVX-512 CPU): its
    flag reaches the compiler, and its library never answers for this CPU's own build."""
    monkeypatch.delenv(kernels_module.MARCH_ENV, raising=False)
    native = kernels_module._build_directory()
    monkeypatch.setenv(kernels_module.MARCH_ENV, "x86-64-v3")
    assert kernels_module._arch_flags() == ["-march=x86-64-v3"]
    assert kernels_module._build_directory() != native


def test_an_optimisation_level_asked_for_gets_its_own_build_and_fast_math_is_refused(monkeypatch):
    """DRAFTWISE_KERNEL_OPT=-O1 (test_instruction_sets' portable build) builds apart; a level that
    may reorder float operations (-Ofast) is refused with a warning that names it, at -O3."""
    monkeypatch.delenv(kernels_module.OPT_ENV, raising=False)
    assert kernels_module._optimisation_flags() == ["-O3"]
    default = kernels_module._build_directory()
    monkeypatch.setenv(kernels_module.OPT_ENV, "-O1")
    assert kernels_module._optimisation_flags() == ["-O1"]
    assert kernels_module._build_directory() != default
    monkeypatch.setenv(kernels_module.OPT_ENV, "-Ofast")
    kernels_module._checked_level.cache_clear()  # its warning comes once a value, this process
    with pytest.warns(RuntimeWarning, match="-Ofast"):
        assert kernels_module._optimisation_flags() == ["-O3"]


def test_each_checkout_of_the_same_sources_has_its_own_build(monkeypatch, tmp_path):
    """PyTorch's builder writes the sources' paths into the build: a build shared by two checkouts
    was rebuilt whenever the other one loaded it."""
    import shutil

    directory = kernels_module._build_directory()
    copy = tmp_path / "kernels"
    shutil.copytree(kernels_module.KERNEL_DIR, copy)
    monkeypatch.setattr(kernels_module, "KERNEL_DIR", copy)
    copy_directory = kernels_module._build_directory()
    assert copy_directory != directory
    monkeypatch.setattr(kernels_module, "KERNEL_DIR", copy / ".." / "kernels")  # the same folder, spelled otherwise
    assert kernels_module._build_directory() == copy_directory


def test_attention_without_the_kernels_reads_a_bfloat16_cache(monkeypatch, kernels):
    from draftwise.models import ops

    torch.manual_seed(2)
    keys, values = torch.randn(3, 32, 64).bfloat16(), torch.randn(3, 32, 64).bfloat16()
    queries = torch.randn(4, 9, 64)
    expected = kernels.attention(queries, keys, values, 20, torch.empty(0, dtype=torch.bool), 64 ** -0.5)
    monkeypatch.setattr(kernels_module, "_BUILT", {})
    monkeypatch.setenv(kernels_module.DISABLE_ENV, "0")
    assert kernels_module.native_kernels(progress=False) is None
    assert (ops.attention(queries, keys, values, 20, None) - expected).abs().max() < 1e-5


def test_the_kernels_can_be_switched_off_without_a_warning(monkeypatch):
    monkeypatch.setattr(kernels_module, "_BUILT", {})
    monkeypatch.setenv(kernels_module.DISABLE_ENV, "0")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels_module.native_kernels(progress=False) is None
