// y = x @ W.T with both x and W's values rounded to bfloat16 (round to nearest even) and the
// products summed in float32: `--activations bf16`.
//
// Why: a verify forward of 5-16 tokens and a prefill are bound by multiply-adds, and AVX-512
// BF16's dot product (vdpbf16ps) does 32 of them an instruction where a float32 FMA does 16,
// at the same rate (measured on Zen 4: 3.6 G instructions a second a core for either). The
// weights are the format's own values (blocks.h, the float32 path's) rounded once more, to 8
// significant bits; on a 4-bit file that rounding is far below the 4-bit quantisation itself.
//
// Batch invariance: y[m, n] is always the same arithmetic: for each 32 columns in order, lane i
// adds x[2i+1] * w[2i+1], then x[2i] * w[2i] (each product exact in float32, each sum rounded:
// vdpbf16ps's definition, and what the portable path below does on CPUs without the
// instruction); then horizontal_sum's fixed tree over the 16 lanes. Every row of x goes through
// the same register blocks whatever the number of rows, so a row of y is bit-identical whether
// x has 1 row, 9, or 2000. Zeros pad K to a multiple of 32 (they add +0 to every lane).
//
// How: x's rows are rounded once per call. Up to FUSED_MAX_ROWS rows (a decode or short verify
// step) meet each weight row decoded in registers, as linear.cpp's fused path does; more rows
// go through tiles: each work item, TILE_M rows of x by TILE_N weight rows, rounds its weight
// rows TILE_K columns at a time into a bfloat16 tile in L2 and runs 6 x 4 register blocks over
// it. SmolLM2's linears, 2 threads, against float32 activations: 1 row 1.05x the time, 4 rows
// 0.9x, 9 / 16 / 64 / 256 rows 0.75 / 0.65 / 0.65 / 0.6x.
#include "bf16.h"
#include "blocks.h"
#include "kernels.h"
#include "message.h"
#include "tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace draftwise {
namespace {

constexpr int64_t COLUMNS = 32;  // bfloat16 values per step: one 512-bit register
// Register blocks: 4 weight rows x 6 rows of x, 24 accumulators in AVX-512's 32 registers; 2 x 3
// where a v16 takes two registers (AVX2) or four (SSE, NEON), as linear.cpp's: 24 there spilled to
// the stack on every step, and compiling the spills made this file the portable build's longest
// (x86-64-v2 on the AMX Xeon model 207: 220-280 s of GCC, 138 s with these blocks; the whole
// build 4.7 -> 2.9 minutes). The AVX2 build's products measured the same either way (SmolLM2,
// 4 / 8 / 16 rows, min of three alternating runs: 0.9-1.07x).
constexpr int ROWS_OF_W = kVectorRegisters == 32 ? 4 : 2, ROWS_OF_X = kVectorRegisters == 32 ? 6 : 3;
constexpr int64_t TILE_M = 96, TILE_N = 32, TILE_K = 2048;  // a 128 KB weight tile

typedef uint16_t vb32 __attribute__((vector_size(64)));  // 32 bfloat16 values

// Two groups of 16 floats (columns 0..15 in low, 16..31 in high) -> 32 bfloat16 values,
// rounded to nearest even.
inline vb32 round32(v16 low, v16 high) {
  vb32 out;
#if defined(__AVX512BF16__)
  __m512 l, h;
  std::memcpy(&l, &low, 64);
  std::memcpy(&h, &high, 64);
  const __m512bh v = _mm512_cvtne2ps_pbh(h, l);
  std::memcpy(&out, &v, 64);
#else
  for (int i = 0; i < 32; ++i) {
    uint32_t bits;
    const float value = i < 16 ? low[i] : high[i - 16];
    std::memcpy(&bits, &value, 4);
    out[i] = uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
  }
#endif
  return out;
}
inline void round32(const float* in, uint16_t* out) {
  const vb32 v = round32(load16(in), load16(in + 16));
  std::memcpy(out, &v, 64);
}
inline vb32 load32(const uint16_t* p) { vb32 v; std::memcpy(&v, p, 64); return v; }

// acc (16 lanes) += the 32 products of x and w, lane i taking pair i, the odd column first.
inline v16 dot_pairs(v16 acc, vb32 x, vb32 w) {
#if defined(__AVX512BF16__)
  __m512 sums;
  __m512bh xs, ws;
  std::memcpy(&sums, &acc, 64);
  std::memcpy(&xs, &x, 64);
  std::memcpy(&ws, &w, 64);
  sums = _mm512_dpbf16_ps(sums, xs, ws);
  std::memcpy(&acc, &sums, 64);
  return acc;
#else
  vi16 xb, wb;
  std::memcpy(&xb, &x, 64);
  std::memcpy(&wb, &w, 64);
  const vi16 high = vi16{} + int32_t(0xffff0000u);
  const vi16 x_odd = xb & high, w_odd = wb & high, x_even = xb << 16, w_even = wb << 16;
  v16 a, b, c, d;
  std::memcpy(&a, &x_odd, 64);
  std::memcpy(&b, &w_odd, 64);
  std::memcpy(&c, &x_even, 64);
  std::memcpy(&d, &w_even, 64);
  acc = fmadd(a, b, acc);  // exact products: fused or not, one rounding per sum
  return fmadd(c, d, acc);
#endif
}
inline v16 dot_pairs(v16 acc, const uint16_t* x, const uint16_t* w) { return dot_pairs(acc, load32(x), load32(w)); }

// A block format's weights rounded to bfloat16, 32 columns at a time: Rounded<B>::decode<R>
// calls use(s, w) for s = 0, 1, ... (the block's 32-column steps, in order) with w[r] the 32
// rounded weights of blocks[r]. By default blocks.h's float32 values, rounded in pairs of
// groups: the values the float32 path multiplies, rounded once.
template <typename B>
struct Rounded {
  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
    v16 low[R];
    B::template decode<R>(block, [&](int g, const v16* weights) DRAFTWISE_INLINE_LAMBDA {
      if (g % 2 == 0) {
        for (int r = 0; r < R; ++r) low[r] = weights[r];
        return;
      }
      vb32 rounded[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) rounded[r] = round32(low[r], weights[r]);
      use(g / 2, rounded);
    });
  }
};

#if defined(__AVX512BW__)
// Q4_K: a 32-column sub-block holds 16 possible weights (d * scale * q - dmin * min, q = 0..15),
// so round the two 16-entry tables of a pair of sub-blocks once, into one register (words 0..15:
// the first sub-block's, 16..31: the second's), and pick each weight's rounded value with a word
// permute of its nibble (the second sub-block's nibbles offset by 16). Rounding a table entry is
// rounding the weight it stands for: the same bits as the default, in three quarters of its
// instructions (the two float32 lookups per 16 weights and the per-pair rounding go).
template <>
struct Rounded<Blocks<Q4_K>> {
  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
    alignas(64) float scaled[R][16];
    q4k_scaled(block, scaled);
    const __m512i nibble = _mm512_set1_epi16(15), second = _mm512_set1_epi16(16);
#pragma GCC unroll 4
    for (int pair = 0; pair < 4; ++pair) {
      __m512i tables[R], bytes[R];
      for (int r = 0; r < R; ++r) {
        const vb32 table = round32(q4k_table(scaled[r], 2 * pair), q4k_table(scaled[r], 2 * pair + 1));
        std::memcpy(&tables[r], &table, 64);
        bytes[r] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[r] + 16 + 32 * pair)));
      }
      vb32 w[R];
      for (int r = 0; r < R; ++r) {
        const __m512i v = _mm512_permutexvar_epi16(_mm512_and_si512(bytes[r], nibble), tables[r]);
        std::memcpy(&w[r], &v, 64);
      }
      use(2 * pair, w);
      for (int r = 0; r < R; ++r) {
        const __m512i index = _mm512_or_si512(_mm512_srli_epi16(bytes[r], 4), second);
        const __m512i v = _mm512_permutexvar_epi16(index, tables[r]);
        std::memcpy(&w[r], &v, 64);
      }
      use(2 * pair + 1, w);
    }
  }
};
#endif

// partial[i * cols + j] += x row i . w row j over `columns` columns (a multiple of 32), for
// NUM_X <= 6 rows of x and NUM_W <= 4 weight rows, in registers.
template <int NUM_X, int NUM_W>
inline void micro(const uint16_t* x, int64_t x_stride, const uint16_t* w, v16* partial, int64_t columns,
                  int64_t cols, Ends ends) {
  v16 acc[NUM_X][NUM_W];
#pragma GCC unroll 8
  for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NUM_W; ++j) acc[i][j] = ends.from_zero ? v16{} : partial[i * cols + j];
  for (int64_t k = 0; k < columns; k += COLUMNS) {
#pragma GCC unroll 8
    for (int i = 0; i < NUM_X; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < NUM_W; ++j) acc[i][j] = dot_pairs(acc[i][j], x + i * x_stride + k, w + j * TILE_K + k);
    }
  }
  if (ends.y != nullptr) return store_sums<NUM_X, NUM_W>(acc, ends.y, ends.y_stride);
#pragma GCC unroll 8
  for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NUM_W; ++j) partial[i * cols + j] = acc[i][j];
}

// micro for min(num_x, ROWS_OF_X) rows of x.
template <int NUM_W, int NUM_X = ROWS_OF_X>
inline void micro_rows(int64_t num_x, const uint16_t* x, int64_t x_stride, const uint16_t* w, v16* partial,
                       int64_t columns, int64_t cols, Ends ends) {
  if constexpr (NUM_X > 1) {
    if (num_x < NUM_X) return micro_rows<NUM_W, NUM_X - 1>(num_x, x, x_stride, w, partial, columns, cols, ends);
  }
  micro<NUM_X, NUM_W>(x, x_stride, w, partial, columns, cols, ends);
}

// One column step of a tile: rows x rows (stride x_stride) against cols weight rows of `tile`, in
// linear.cpp's tile_step order (its float32 twin; sharing one walker measured 2-3% slower there).
void tile_step(const uint16_t* x, int64_t x_stride, const uint16_t* tile, v16* partial, int64_t rows,
               int64_t cols, int64_t columns, Ends ends) {
  for (int64_t r = 0; r < rows; r += ROWS_OF_X) {
    const int64_t num_x = std::min<int64_t>(ROWS_OF_X, rows - r);
    for (int64_t c = 0; c < cols; c += ROWS_OF_W) {
      const int64_t num_w = std::min<int64_t>(ROWS_OF_W, cols - c);
      v16* block = partial + r * cols + c;
      Ends block_ends = ends;
      if (ends.y != nullptr) block_ends.y = ends.y + r * ends.y_stride + c;
      if (num_w == ROWS_OF_W) {
        micro_rows<ROWS_OF_W>(num_x, x + r * x_stride, x_stride, tile + c * TILE_K, block, columns, cols, block_ends);
        continue;
      }
      for (int64_t j = 0; j < num_w; ++j) {
        Ends row_ends = block_ends;
        if (row_ends.y != nullptr) row_ends.y += j;
        micro_rows<1>(num_x, x + r * x_stride, x_stride, tile + (c + j) * TILE_K, block + j, columns, cols, row_ends);
      }
    }
  }
}

}  // namespace

// Weight row `row` (K weights in format), columns [k0, k0 + columns) rounded into out, zeros
// past K. k0 is a multiple of TILE_K, so whole blocks. Block formats are rounded as they are
// decoded (the values fused_rows rounds); the others go through a row of floats.
void round_row(int64_t format, const uint8_t* row, int64_t K, int64_t k0, int64_t columns, float* scratch,
               uint16_t* out) {
  const Layout blocks = layout(format);
  const uint8_t* start = row + k0 / blocks.weights * blocks.bytes;
  if (is_block_format(format)) {
    with_blocks(format, [&](auto b) {
      using B = decltype(b);
      for (int64_t k = 0; k < columns; k += B::WEIGHTS, start += B::BYTES)
        Rounded<B>::template decode<1>(&start, [&](int step, const vb32* rounded) DRAFTWISE_INLINE_LAMBDA {
          std::memcpy(out + k + COLUMNS * step, rounded, 64);
        });
    });
    return;
  }
  const int64_t present = std::min(columns, K - k0);
  if (format == F32) {
    std::memcpy(scratch, start, present * 4);
  } else {
    dequantize_row(format, start, scratch, present);
  }
  std::fill(scratch + present, scratch + columns, 0.0f);
  for (int64_t k = 0; k < columns; k += COLUMNS) round32(scratch + k, out + k);
}

// Two rows abreast: for Qwen2.5-Coder-1.5B's Q4_K / Q6_K MLP matrices on an AMX Xeon (one row of
// x, 2 threads), 806-809 / 854-893 us a matrix, against 932-953 / 943-988 with four and 1075 /
// 1133 with one.
constexpr int ROWS_ABREAST = 2;
// How far ahead round_rows prefetches: whole pairs of rows, about 4 KB on, at least the next
// pair. Short rows need more than the next pair's lead (SmolLM2's 576-column Q4_1 rows, one row
// of x on the AMX Xeon, model 207: one-token forward, min of 300, 9.5-10.7 -> 8.6-9.1 ms with
// four pairs ahead instead of one); long ones keep the next pair (Qwen2.5-Coder-1.5B's
// 8960-column rows are 5 KB each).
constexpr int64_t PREFETCH_BYTES = 4096;

void round_rows(int64_t format, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K, int64_t k0,
                int64_t columns, float* scratch, uint16_t* out, int64_t out_stride) {
  int64_t abreast = 0;  // rows rounded abreast; the rest one at a time
  if (is_block_format(format)) {  // rows abreast: the decoders' independent work overlaps
    with_blocks(format, [&](auto b) {
      using B = decltype(b);
      // Copies of what this lambda reads by reference: the rounded values are stored through
      // memcpy, which may alias anything, so each store reloaded them (perf: an imul of the
      // stride from memory per 32 stored weights).
      const int64_t stride = out_stride, bytes = row_bytes, width = columns, offset = k0 / B::WEIGHTS * B::BYTES;
      const uint8_t* const weights = w;
      uint16_t* const rounded_out = out;
      const int64_t pair = ROWS_ABREAST * bytes, ahead = std::max<int64_t>(1, PREFETCH_BYTES / pair) * pair;
      int64_t j = 0;
      for (; j + ROWS_ABREAST <= rows; j += ROWS_ABREAST) {
        const uint8_t* block[ROWS_ABREAST];
        uint16_t* dst[ROWS_ABREAST];
        for (int r = 0; r < ROWS_ABREAST; ++r) {
          block[r] = weights + (j + r) * bytes + offset;
          dst[r] = rounded_out + (j + r) * stride;
        }
        for (int64_t k = 0; k < width; k += B::WEIGHTS) {
          for (int r = 0; r < ROWS_ABREAST; ++r)  // rows ahead, as fused_rows does: the prefetchers lose short streams
            for (int64_t line = 0; line < B::BYTES; line += 64) __builtin_prefetch(block[r] + ahead + line);
          Rounded<B>::template decode<ROWS_ABREAST>(block, [&](int step, const vb32* rounded) DRAFTWISE_INLINE_LAMBDA {
            for (int r = 0; r < ROWS_ABREAST; ++r) std::memcpy(dst[r] + COLUMNS * step, &rounded[r], 64);
          });
          for (int r = 0; r < ROWS_ABREAST; ++r) {
            block[r] += B::BYTES;
            dst[r] += B::WEIGHTS;
          }
        }
      }
      abreast = j;
    });
  }
  for (int64_t j = abreast; j < rows; ++j) round_row(format, w + j * row_bytes, K, k0, columns, scratch, out + j * out_stride);
}

namespace {

// Few rows of x on block formats: weight rows are decoded in registers (blocks.h), 32 weights
// at a time rounded to bfloat16 and multiplied into every row of x at once, NUM_W weight rows
// abreast: no tile is written. Per output the same dot_pairs over the same rounded values, in
// the same column order, then the same finish as the tiles, so the two agree bit for bit.
// Up to 8 rows this is faster than the tiles (SmolLM2's linears: 11.0-12.3 ms against 13.8-14.0
// for 8 rows); from 9 on the tiles are (14.0 against 17.1 ms; 16 rows 18.7 against 25.4):
// decoding a weight once for all rows beats overlapping its decoding with the products. Where a
// v16 takes several registers (AVX2, SSE, NEON), one weight row at a time for more than 2 rows of
// x (as linear.cpp's fused path): 2 abreast held up to 16 accumulators, twice AVX2's registers.
constexpr int64_t FUSED_MAX_ROWS = 8;
constexpr int PAIRED_MAX_ROWS = kVectorRegisters == 32 ? FUSED_MAX_ROWS : 2;  // rows of x for 2 weight rows abreast

template <typename B, int NUM_X, int NUM_W>
inline void fused_rows(const uint16_t* x, int64_t Kp, const uint8_t* w, int64_t row_bytes, float* y, int64_t N,
                       int64_t K) {
  v16 acc[NUM_X][NUM_W] = {};
  const uint8_t* block[NUM_W];
  for (int j = 0; j < NUM_W; ++j) block[j] = w + j * row_bytes;
  const int64_t ahead = NUM_W * row_bytes;  // the next call's rows (round_rows' farther lead measured slower here)
  for (int64_t b = 0; b < K / B::WEIGHTS; ++b) {
    const uint16_t* xb = x + b * B::WEIGHTS;
    for (int j = 0; j < NUM_W; ++j)
      for (int64_t line = 0; line < B::BYTES; line += 64) __builtin_prefetch(block[j] + ahead + line);
    Rounded<B>::template decode<NUM_W>(block, [&](int step, const vb32* rounded) DRAFTWISE_INLINE_LAMBDA {
#pragma GCC unroll 16
      for (int i = 0; i < NUM_X; ++i) {
        const vb32 xs = load32(xb + i * Kp + COLUMNS * step);
#pragma GCC unroll 4
        for (int j = 0; j < NUM_W; ++j) acc[i][j] = dot_pairs(acc[i][j], xs, rounded[j]);
      }
    });
    for (int j = 0; j < NUM_W; ++j) block[j] += B::BYTES;
  }
  store_sums<NUM_X, NUM_W>(acc, y, N);
}

template <typename B, int NUM_W, int NUM_X = FUSED_MAX_ROWS>
inline void fused_rows_of(int64_t num_x, const uint16_t* x, int64_t Kp, const uint8_t* w, int64_t row_bytes, float* y,
                          int64_t N, int64_t K) {
  if constexpr (NUM_X > 1) {
    if (num_x < NUM_X) return fused_rows_of<B, NUM_W, NUM_X - 1>(num_x, x, Kp, w, row_bytes, y, N, K);
  }
  fused_rows<B, NUM_X, NUM_W>(x, Kp, w, row_bytes, y, N, K);
}

void fused(const uint16_t* x, int64_t Kp, const uint8_t* w, int64_t format, float* y, int64_t M, int64_t K,
           int64_t N, int64_t row_bytes) {
  with_blocks(format, [&](auto blocks) {
    using B = decltype(blocks);
    constexpr int64_t ABREAST = 4;
    at::parallel_for(0, (N + ABREAST - 1) / ABREAST, 4, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t n0 = c * ABREAST;
        if constexpr (kVectorRegisters == 32) {
          if (M <= 4 && n0 + ABREAST <= N) {  // 4 weight rows abreast: 16 accumulators at most
            fused_rows_of<B, 4, 4>(M, x, Kp, w + n0 * row_bytes, row_bytes, y + n0, N, K);
            continue;
          }
        }
        for (int64_t n = n0; n < std::min(n0 + ABREAST, N);) {  // 2 abreast, then a last one
          if (n + 2 <= N && M <= PAIRED_MAX_ROWS) {
            fused_rows_of<B, 2, PAIRED_MAX_ROWS>(M, x, Kp, w + n * row_bytes, row_bytes, y + n, N, K);
            n += 2;
          } else {
            fused_rows_of<B, 1>(M, x, Kp, w + n * row_bytes, row_bytes, y + n, N, K);
            n += 1;
          }
        }
      }
    });
  });
}

}  // namespace

void round_x_rows(const float* x, int64_t M, int64_t K, int64_t Kp, uint16_t* out) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    float padded[COLUMNS];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = 0; k < Kp; k += COLUMNS) {
        const int64_t present = std::min(COLUMNS, K - k);
        if (present == COLUMNS) {  // no padding: round straight from x
          round32(x + m * K + k, out + m * Kp + k);
          continue;
        }
        std::memcpy(padded, x + m * K + k, present * 4);
        std::fill(padded + present, padded + COLUMNS, 0.0f);
        round32(padded, out + m * Kp + k);
      }
  });
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t K) {
  check_weight(weight, format, K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, say("bf16_linear: x ", x.sizes(), " does not have ", K, " columns"));
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "bf16_linear: x must be contiguous float32");
  const int64_t M = x.size(0), N = weight.size(0), row_bytes = weight.size(1);
  const int64_t Kp = (K + COLUMNS - 1) / COLUMNS * COLUMNS;
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  std::vector<uint16_t> x_rounded(M * Kp);
  round_x_rows(x.data_ptr<float>(), M, K, Kp, x_rounded.data());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  if (is_block_format(format) && M <= FUSED_MAX_ROWS) {
    fused(x_rounded.data(), Kp, w, format, out, M, K, N, row_bytes);
    return y;
  }
  const int64_t tile_m = even_tile_rows(M, TILE_M, ROWS_OF_X);
  const int64_t tiles_m = (M + tile_m - 1) / tile_m, tiles_n = (N + TILE_N - 1) / TILE_N;
  at::parallel_for(0, tiles_m * tiles_n, 1, [&](int64_t t0, int64_t t1) {
    // partial sums (parked between column steps), the weight tile, one row's floats
    float* buffer = thread_buffer(TILE_M * TILE_N * 16 + TILE_N * TILE_K / 2 + TILE_K);
    v16* partial = reinterpret_cast<v16*>(buffer);
    uint16_t* tile = reinterpret_cast<uint16_t*>(buffer + TILE_M * TILE_N * 16);
    float* scratch = buffer + TILE_M * TILE_N * 16 + TILE_N * TILE_K / 2;
    for (int64_t t = t0; t < t1; ++t) {  // weight tiles advance fastest: a thread's x tile stays in cache
      const int64_t m0 = t / tiles_n * tile_m, n0 = t % tiles_n * TILE_N;
      const int64_t rows = std::min(tile_m, M - m0), cols = std::min(TILE_N, N - n0);
      for (int64_t k0 = 0; k0 < Kp; k0 += TILE_K) {
        const int64_t columns = std::min(TILE_K, Kp - k0);
        for (int64_t j = 0; j < cols; ++j) {
          if (j + 1 < cols) prefetch_slice(format, w + (n0 + j + 1) * row_bytes, k0, columns);
          round_row(format, w + (n0 + j) * row_bytes, K, k0, columns, scratch, tile + j * TILE_K);
        }
        const bool last = k0 + columns == Kp;
        tile_step(x_rounded.data() + m0 * Kp + k0, Kp, tile, partial, rows, cols, columns,
                  Ends{k0 == 0, last ? out + m0 * N + n0 : nullptr, N});
      }
    }
  });
  return y;
}

bool bf16_dot_in_hardware() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace draftwise
