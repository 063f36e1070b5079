// y = x @ W.T with W stored as shipped: float32, float16, bfloat16 or GGUF's quantized blocks
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS), x and y float32.
//
// On block formats no float32 copy of W is ever kept: each block is decoded 16 weights at a
// time in registers (blocks.h) and multiplied into up to 8 rows of x at once, several weight
// rows in step, with the next rows prefetched. A decode or verify step (up to 11 rows; on AVX2
// up to 4, and 5 to 12 on 32-weight blocks through decoded_pairs, which decodes two weight rows
// into floats in L1 for all of them: block_tile_min_rows) runs all its rows against each weight
// row. From 12 rows on (a long verify, a prefill) a tile of
// weight rows (32 rows x 2048 columns) is decoded into float32 in cache once per 96 rows of x
// and 6 x 4 register blocks run over it (Qwen2.5-1.5B, 256 rows: 60 -> 77 GMAC/s against
// decoding each block per 8 rows in registers).
// Float-format weights are read in groups of 4 rows for a decode step; a prefill on them
// converts W to float32 once and runs a blocked product over it.
//
// Batch invariance: y[m, n] is always the same arithmetic: 16-lane partial sums over K in
// order (one fused multiply-add per lane per 16 columns), one fixed horizontal sum, then the
// K % 16 tail in order. Every path below keeps exactly that sequence per output on the same
// weight values, so a row of y is bit-identical whether x has 1 row, 9, or 2000, and whatever
// threads split the work. Dequantisation reproduces the GGUF reference (gguf-py) bit for bit.
#include "blocks.h"
#include "kernels.h"
#include "message.h"
#include "tiles.h"


#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace draftwise {
namespace {

// Weight rows and x rows per register block: 4 x 6 = 24 accumulators + 4 weights in AVX-512's
// 32 registers; 2 x 3 = 6 accumulators + 2 weights where a v16 takes two of AVX2's 16 (AMD EPYC
// 7003, 1536x576 Q4_1 at 64 rows: 6 x 4 blocks 3 GMAC/s, 2 x 3 18.6).
constexpr int ROWS_OF_W = kVectorRegisters == 32 ? 4 : 2;
constexpr int ROWS_OF_X = kVectorRegisters == 32 ? 6 : 3;
constexpr int64_t SKINNY_MAX_ROWS = 32;  // float-format weights, more rows than this: the prefill path

// acc[m][r] for the K % 16 tail and the final sum: shared by both paths, so they agree.
inline float finish(v16 acc, const float* x, const float* w, int64_t k_vec, int64_t K) {
  float sum = horizontal_sum(acc);
  for (int64_t k = k_vec; k < K; ++k) sum = fmadd(x[k], w[k], sum);
  return sum;
}

#if defined(DRAFTWISE_V16_PAIR)
template <int H>
inline v8& half(v16& v) {
  if constexpr (H == 0) return v.lo; else return v.hi;
}

// One half (lanes 0-7 or 8-15) of micro's 16-column step on AVX2, where a v16 is two registers:
// the weight rows' halves in NUM_W registers, each x row's half in one, so NUM_X x NUM_W = 6
// accumulators (12 registers) + 2 + 1 fit AVX2's 16. Left to itself GCC kept x in registers and
// read every weight from memory once per x row: 18 loads per 12 multiply-adds where 10 do. Each
// lane's multiply-adds are the same, in the same order (lanes 0-7 of a step, then 8-15: no lane
// depends on another), so the bits are micro's.
template <int H, int NUM_X, int NUM_W>
inline void pair_half_step(v16 (&acc)[NUM_X][NUM_W], const float* x, int64_t x_stride, const float* w,
                           int64_t w_stride) {
  static_assert(NUM_W <= 2, "two weight rows at most: their halves are named registers");
  // Named variables, not an array: GCC kept an array's registers and stored it to the stack too.
  v8 w0 = v8(_mm256_loadu_ps(w + 8 * H)), w1{};
  asm("" : "+x"(w0));  // one load, kept for every x row
  if constexpr (NUM_W == 2) {
    w1 = v8(_mm256_loadu_ps(w + w_stride + 8 * H));
    asm("" : "+x"(w1));
  }
#pragma GCC unroll 8
  for (int i = 0; i < NUM_X; ++i) {
    v8 xs = v8(_mm256_loadu_ps(x + i * x_stride + 8 * H));
    asm("" : "+x"(xs));  // one load, kept for every weight row
    half<H>(acc[i][0]) = fmadd(xs, w0, half<H>(acc[i][0]));
    if constexpr (NUM_W == 2) half<H>(acc[i][1]) = fmadd(xs, w1, half<H>(acc[i][1]));
  }
}
#endif

// partial[i * cols + j] (16 lanes) += x row i . w row j over `columns` columns (a multiple of
// 16), for NUM_X <= 6 x rows (stride x_stride) and NUM_W <= 4 weight rows (stride w_stride) held
// in 24 registers: one fused multiply-add per lane per 16 columns, in column order. Every path
// below runs every output through this loop (or fused_slice's, the same sequence), then the
// same horizontal sum: they agree bit for bit by construction.
template <int NUM_X, int NUM_W>
inline void micro(const float* x, int64_t x_stride, const float* w, int64_t w_stride, v16* partial, int64_t columns,
                  int64_t cols, Ends ends = {}) {
  v16 acc[NUM_X][NUM_W];
#pragma GCC unroll 8
  for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NUM_W; ++j) acc[i][j] = ends.from_zero ? v16{} : partial[i * cols + j];
#if defined(DRAFTWISE_V16_PAIR)
  if constexpr (NUM_W <= 2 && NUM_X * NUM_W <= 6) {
    for (int64_t k = 0; k < columns; k += 16) {
      pair_half_step<0>(acc, x + k, x_stride, w + k, w_stride);
      pair_half_step<1>(acc, x + k, x_stride, w + k, w_stride);
    }
  } else
#endif
  for (int64_t k = 0; k < columns; k += 16) {
    v16 weights[NUM_W];
#pragma GCC unroll 8
    for (int j = 0; j < NUM_W; ++j) weights[j] = load16(w + j * w_stride + k);
#pragma GCC unroll 8
    for (int i = 0; i < NUM_X; ++i) {
      const v16 xs = in_register(load16(x + i * x_stride + k));  // one load per row of x
#pragma GCC unroll 8
      for (int j = 0; j < NUM_W; ++j) acc[i][j] = fmadd(xs, weights[j], acc[i][j]);
    }
  }
  if (ends.y != nullptr) return store_sums<NUM_X, NUM_W>(acc, ends.y, ends.y_stride);
#pragma GCC unroll 8
  for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NUM_W; ++j) partial[i * cols + j] = acc[i][j];
}

// y[m, r] for m < NUM_X, r < NUM_W over the whole of K: x rows stride K, w rows stride K,
// y rows stride N. The partial sums never leave registers (the array is a compile-time shape).
template <int NUM_X, int NUM_W>
inline void block(const float* x, const float* w, float* y, int64_t K, int64_t N) {
  const int64_t k_vec = K / 16 * 16;
  v16 partial[NUM_X * NUM_W] = {};
  micro<NUM_X, NUM_W>(x, K, w, K, partial, k_vec, NUM_W);
  for (int m = 0; m < NUM_X; ++m)
    for (int r = 0; r < NUM_W; ++r) y[m * N + r] = finish(partial[m * NUM_W + r], x + m * K, w + r * K, k_vec, K);
}

template <int NUM_W>
void all_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += ROWS_OF_X) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    switch (std::min<int64_t>(ROWS_OF_X, M - m0)) {
      case 1: block<1, NUM_W>(xm, w, ym, K, N); break;
      case 2: block<2, NUM_W>(xm, w, ym, K, N); break;
      case 3: block<3, NUM_W>(xm, w, ym, K, N); break;
      case 4: block<4, NUM_W>(xm, w, ym, K, N); break;
      case 5: block<5, NUM_W>(xm, w, ym, K, N); break;
      default: block<6, NUM_W>(xm, w, ym, K, N); break;
    }
  }
}

// Few rows on float formats (F32, F16, BF16): each thread takes whole groups of 4 weight rows,
// converts them to float32 once (F16, BF16) and runs every x row against them.
void skinny(const float* x, const uint8_t* w, int64_t format, float* y, int64_t M, int64_t K, int64_t N,
            int64_t row_bytes) {
  const int64_t num_blocks = (N + ROWS_OF_W - 1) / ROWS_OF_W;
  at::parallel_for(0, num_blocks, 8, [&](int64_t b0, int64_t b1) {
    float* buffer = format == F32 ? nullptr : thread_buffer(ROWS_OF_W * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * ROWS_OF_W, rows = std::min<int64_t>(ROWS_OF_W, N - n);
      const float* rows_f32 = reinterpret_cast<const float*>(w + n * row_bytes);
      if (format != F32) {
        for (int64_t r = 0; r < rows; ++r) dequantize_row(format, w + (n + r) * row_bytes, buffer + r * K, K);
        rows_f32 = buffer;
      }
      if (rows == ROWS_OF_W) {
        all_rows<ROWS_OF_W>(x, rows_f32, y + n, M, K, N);
      } else {
        for (int64_t r = 0; r < rows; ++r) all_rows<1>(x, rows_f32 + r * K, y + n + r, M, K, N);
      }
    }
  });
}

// Few rows of x on block formats: weight rows are decoded 16 weights at a time (blocks.h) and
// every row of x (up to 8 at once) is multiplied into the 16 weights while they are in a
// register; 2 or 4 weight rows advance in step (on AVX2 each row's block decoded in turn, or for
// Q4_K each quarter block: see fused_slice), so a one-token step keeps 4 independent sums in
// flight. Per output the same fused multiply-adds, in the same column order, on the same floats
// as block<> over a dequantised row, so the two agree bit for bit (the tests check it).
// The work goes in slices of K whose rows of x stay in L1 (about 16 KB), each thread keeping
// the 16-lane partial sums of its weight rows between slices.
constexpr int FUSED_ROWS_OF_X = kVectorRegisters == 32 ? 8 : 4;
constexpr int64_t FUSED_ROWS_OF_W = 8;  // weight rows a thread carries through the slices
constexpr int64_t FUSED_X_BYTES = 16 * 1024;

// partial[j * stride + i] (16 lanes) += x row i . weight row j over `columns` columns.
// ahead: bytes from a block to the one the next call will read (prefetched here: the hardware
// prefetchers lose track of several short row streams read in step; measured 2x slower).
template <typename B, int NUM_X, int NUM_W>
inline void fused_slice(const float* x, const uint8_t* const* rows, v16* partial, int64_t stride, int64_t columns,
                        int64_t K, int64_t ahead) {
  v16 acc[NUM_X][NUM_W];
  const uint8_t* block[NUM_W];
  for (int j = 0; j < NUM_W; ++j) {
    block[j] = rows[j];
    for (int i = 0; i < NUM_X; ++i) acc[i][j] = partial[j * stride + i];
  }
#if defined(DRAFTWISE_V16_PAIR)
  // Q4_K on AVX2: every block's d * scale_j and dmin * min_j (q4k_scaled) first, in a loop of
  // their own, then the blocks' weights. Computed inside the loop below, per block, each block's
  // scales waited on its own bit unpacking and the product ran at a lower rate (perf: a fifth of
  // its samples there); ahead, the blocks' scales are independent work. The same values, so the
  // same bits. AMD EPYC Zen 3, Qwen2.5-Coder-1.5B's 8960 x 1536 gate at one row, one thread, best
  // of alternating processes: 1320-1392 -> 1075-1107 us. A slice holds at most FUSED_X_BYTES / 4
  // columns (one row of x), so AHEAD_BLOCKS blocks.
  constexpr int64_t AHEAD_BLOCKS = kDecodesByTurns<B> ? FUSED_X_BYTES / 4 / B::WEIGHTS : 1;
  alignas(64) float scaled[NUM_W][AHEAD_BLOCKS][16];
  if constexpr (kDecodesByTurns<B>) {
    TORCH_CHECK(columns <= AHEAD_BLOCKS * B::WEIGHTS, say("fused_slice: a slice of ", columns, " columns"));
    for (int j = 0; j < NUM_W; ++j)
      for (int64_t b = 0; b < columns / B::WEIGHTS; ++b) q4k_scaled(rows[j] + b * B::BYTES, scaled[j][b]);
    in_memory(scaled);
  }
#endif
  for (int64_t b = 0; b < columns / B::WEIGHTS; ++b) {
    const float* xb = x + b * B::WEIGHTS;
    for (int j = 0; j < NUM_W; ++j)
      for (int64_t line = 0; line < B::BYTES; line += 64) __builtin_prefetch(block[j] + ahead + line);
#if defined(DRAFTWISE_V16_PAIR)
    // AVX2: one weight row's block at a time (x re-read from L1 for each): decoding the rows in
    // step kept both rows' values, scales and partial sums live at once, more than AVX2's 16
    // registers, and GCC parked a partial sum on the stack inside the loop (perf, SmolLM2's
    // Q4_1 at one row: the store and reload on that sum's chain of multiply-adds bounded the loop).
    // Each partial sum gets the same multiply-adds in the same order. Q4_K's 256-weight blocks
    // hold a chain of 16 multiply-adds per sum: there the rows take turns every 64 columns, so
    // both rows' chains run at once (Qwen2.5-Coder-1.5B's 8960 x 1536 gate at one row, one
    // thread, AMD EPYC Zen 3: 1558 -> 1345 us, min over alternating processes).
    if constexpr (kDecodesByTurns<B>) {
      const float* block_scaled[NUM_W];
      for (int j = 0; j < NUM_W; ++j) block_scaled[j] = scaled[j][b];
      B::template decode_by_turns<NUM_W>(block, block_scaled, [&](int j, int g, v16 w) DRAFTWISE_INLINE_LAMBDA {
#pragma GCC unroll 8
        for (int i = 0; i < NUM_X; ++i) acc[i][j] = fmadd(load16(xb + i * K + 16 * g), w, acc[i][j]);
      });
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < NUM_W; ++j)
        B::template decode<1>(&block[j], [&](int g, const v16* w) DRAFTWISE_INLINE_LAMBDA {
#pragma GCC unroll 8
          for (int i = 0; i < NUM_X; ++i) acc[i][j] = fmadd(load16(xb + i * K + 16 * g), w[0], acc[i][j]);
        });
    }
#else
    B::template decode<NUM_W>(block, [&](int g, const v16* w) DRAFTWISE_INLINE_LAMBDA {
#pragma GCC unroll 8
      for (int i = 0; i < NUM_X; ++i) {
        const v16 xs = load16(xb + i * K + 16 * g);
#pragma GCC unroll 4
        for (int j = 0; j < NUM_W; ++j) acc[i][j] = fmadd(xs, w[j], acc[i][j]);
      }
    });
#endif
    for (int j = 0; j < NUM_W; ++j) block[j] += B::BYTES;
  }
  for (int j = 0; j < NUM_W; ++j)
    for (int i = 0; i < NUM_X; ++i) partial[j * stride + i] = acc[i][j];
}

template <typename B, int NUM_W, int NUM_X = FUSED_ROWS_OF_X>
inline void fused_slice_rows(int64_t num_x, const float* x, const uint8_t* const* rows, v16* partial, int64_t stride,
                             int64_t columns, int64_t K, int64_t ahead) {
  if constexpr (NUM_X > 1) {
    if (num_x < NUM_X) return fused_slice_rows<B, NUM_W, NUM_X - 1>(num_x, x, rows, partial, stride, columns, K, ahead);
  }
  fused_slice<B, NUM_X, NUM_W>(x, rows, partial, stride, columns, K, ahead);
}

template <int NUM_W>
inline void micro_rows(int64_t num_x, const float* x, int64_t x_stride, const float* w, int64_t w_stride,
                       v16* partial, int64_t columns, int64_t cols, Ends ends);

#if defined(DRAFTWISE_V16_PAIR)
// AVX2, 5 to 12 rows of x on 32-weight blocks (a tree's verify): two weight rows at a time are
// decoded into floats in L1 (dequantize_row: the values every path multiplies), then micro<3, 2>
// (or <2, 2>) runs every group of x rows against the pair: 12 (or 8) independent chains of
// multiply-adds, 10 loads to 12 of them, where decoding in registers holds one weight row for at
// most 4 rows of x (6-8 chains, one decode per group). Per output the same fused multiply-adds
// in the same column order, so the same bits (micro is every path's loop). The work goes in
// slices of K whose rows of x stay in L1 (PAIR_X_BYTES), each thread keeping the partial sums of
// PAIR_CHUNK weight rows between slices. AMD EPYC Zen 3, SmolLM2 forwards after a 300-token
// prompt, best of 40 in alternating processes (2026-11-29): 5 / 6 / 8 / 9 / 12 tokens 17.9-18.4
// / 19.7-20.3 / 24.6-27.5 / 26.7-30.4 / 35.6-37.5 ms against 21.8-27.5 / 23.9-31.2 /
// 30.2-37.1 / 33.9-43.5 / 44.3-53.4 on the fused path (one group of x rows per decode); at 3 and 4
// rows no faster than that path, at 16 and 24 no faster than the tiles; Qwen2.5-Coder-1.5B's
// Q4_K / Q6_K forwards at 9 and 12 tokens 1.1x slower than the tiles, so they keep those.
constexpr int64_t PAIR_X_BYTES = 24 * 1024;
constexpr int64_t PAIR_CHUNK = 8;
constexpr int64_t PAIR_MIN_ROWS = 5;

void decoded_pairs(const float* x, const uint8_t* w, int64_t format, float* y, int64_t M, int64_t K, int64_t N,
                   int64_t row_bytes) {
  TORCH_CHECK(M <= 24, say("decoded_pairs: ", M, " rows of x; it takes at most 24 (the tiles take more)"));
  const Layout blocks = layout(format);
  int64_t group_start[8], group_size[8];  // x rows in groups of 3, then 2s (7 -> 3 + 2 + 2), never 1
  int num_groups = 0;
  for (int64_t m = 0; m < M; m += group_size[num_groups++]) {
    const int64_t left = M - m;
    group_start[num_groups] = m;
    group_size[num_groups] = left == 4 || left == 2 ? 2 : std::min<int64_t>(3, left);
  }
  // Slices of equal whole blocks, as long as PAIR_X_BYTES of x allows (K = 576, 9 rows: one).
  const int64_t x_columns = std::max<int64_t>(PAIR_X_BYTES / 4 / M / blocks.weights, 1) * blocks.weights;
  const int64_t num_slices = (K + x_columns - 1) / x_columns;
  const int64_t slice = (K / blocks.weights + num_slices - 1) / num_slices * blocks.weights;
  const int64_t chunks = (N + PAIR_CHUNK - 1) / PAIR_CHUNK;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    v16* partial = reinterpret_cast<v16*>(thread_buffer(PAIR_CHUNK * M * 16 + 2 * slice));  // [M][PAIR_CHUNK]
    float* pair_values = reinterpret_cast<float*>(partial + PAIR_CHUNK * M);  // [2][slice]
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * PAIR_CHUNK, rows = std::min(PAIR_CHUNK, N - n0);
      for (int64_t k0 = 0; k0 < K; k0 += slice) {
        const int64_t columns = std::min(slice, K - k0);
        const bool first = k0 == 0, last = k0 + columns == K;
        for (int64_t r = 0; r < rows; r += 2) {
          const int64_t pair = std::min<int64_t>(2, rows - r);
          for (int64_t j = 0; j < pair; ++j) {
            const uint8_t* row = w + (n0 + r + j) * row_bytes;
            if (r + j + 2 < rows) prefetch_slice(format, row + 2 * row_bytes, k0, columns);
            dequantize_row(format, row + k0 / blocks.weights * blocks.bytes, pair_values + j * slice, columns);
          }
          for (int g = 0; g < num_groups; ++g) {
            const int64_t m = group_start[g];
            const Ends ends{first, last ? y + m * N + n0 + r : nullptr, N};  // the last slice finishes into y
            v16* sums = partial + m * PAIR_CHUNK + r;
            if (pair == 2) {
              micro_rows<2>(group_size[g], x + m * K + k0, K, pair_values, slice, sums, columns, PAIR_CHUNK, ends);
            } else {
              micro_rows<1>(group_size[g], x + m * K + k0, K, pair_values, 0, sums, columns, PAIR_CHUNK, ends);
            }
          }
        }
      }
    }
  });
}
#endif

void fused(const float* x, const uint8_t* w, int64_t format, float* y, int64_t M, int64_t K, int64_t N,
           int64_t row_bytes) {
  // Rows of x in even groups of at most 8 (9 -> 5 + 4); weight rows 4 abreast for one or two
  // rows of x, 2 abreast for more (at most 16 accumulators). With AVX2's 16 registers, groups of
  // at most 4 rows, weight rows 2 abreast for one or two rows of x, else one at a time.
  const int64_t groups = (M + FUSED_ROWS_OF_X - 1) / FUSED_ROWS_OF_X, per_group = (M + groups - 1) / groups;
  const int64_t abreast = kVectorRegisters == 32 ? (per_group <= 2 ? 4 : 2) : (per_group <= 2 ? 2 : 1);
  with_blocks(format, [&](auto blocks) {
    using B = decltype(blocks);
    const int64_t x_columns = FUSED_X_BYTES / 4 / per_group / B::WEIGHTS * B::WEIGHTS;
    const int64_t slice = std::clamp<int64_t>(x_columns, B::WEIGHTS, K);
    const int64_t chunks = (N + FUSED_ROWS_OF_W - 1) / FUSED_ROWS_OF_W;
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      v16* partial = reinterpret_cast<v16*>(thread_buffer(FUSED_ROWS_OF_W * M * 16));
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t n0 = c * FUSED_ROWS_OF_W, rows = std::min(FUSED_ROWS_OF_W, N - n0);
        for (int64_t i = 0; i < rows * M; ++i) partial[i] = v16{};
        for (int64_t k0 = 0; k0 < K; k0 += slice) {
          const int64_t columns = std::min(slice, K - k0);
          const uint8_t* row[FUSED_ROWS_OF_W];
          for (int64_t r = 0; r < rows; ++r) row[r] = w + (n0 + r) * row_bytes + k0 / B::WEIGHTS * B::BYTES;
          for (int64_t m = 0; m < M; m += per_group) {
            const int64_t num_x = std::min(per_group, M - m);
            const float* xm = x + m * K + k0;
            const int64_t next = abreast * row_bytes;  // what the next call reads: the next rows
            int64_t r = 0;
            if (abreast == 4) {
              for (; r + 4 <= rows; r += 4)
                fused_slice_rows<B, 4, 2>(num_x, xm, row + r, partial + r * M + m, M, columns, K, next);
            } else if (abreast == 2) {
              for (; r + 2 <= rows; r += 2)
                fused_slice_rows<B, 2>(num_x, xm, row + r, partial + r * M + m, M, columns, K, next);
            }
            for (; r < rows; ++r) fused_slice_rows<B, 1>(num_x, xm, row + r, partial + r * M + m, M, columns, K, next);
          }
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t m = 0; m < M; ++m) y[m * N + n0 + r] = horizontal_sum(partial[r * M + m]);
      }
    });
  });
}

// Many rows: W dequantised once into float32, then a product blocked over M, N and K so that
// the x and W tiles stay in L2. The 16-lane partial sums are parked in `partial` between K
// blocks: per output, the same sequence of fused multiply-adds as block<> above.
constexpr int64_t TILE_M = 48, TILE_N = 64, TILE_K = 1024;

template <int NUM_W>
inline void micro_rows(int64_t num_x, const float* x, int64_t x_stride, const float* w, int64_t w_stride,
                       v16* partial, int64_t columns, int64_t cols, Ends ends) {
  switch (num_x) {
    case 1: micro<1, NUM_W>(x, x_stride, w, w_stride, partial, columns, cols, ends); break;
    case 2: micro<2, NUM_W>(x, x_stride, w, w_stride, partial, columns, cols, ends); break;
    case 3: micro<3, NUM_W>(x, x_stride, w, w_stride, partial, columns, cols, ends); break;
    case 4: micro<4, NUM_W>(x, x_stride, w, w_stride, partial, columns, cols, ends); break;
    case 5: micro<5, NUM_W>(x, x_stride, w, w_stride, partial, columns, cols, ends); break;
    default: micro<6, NUM_W>(x, x_stride, w, w_stride, partial, columns, cols, ends); break;
  }
}

// partial (rows x cols outputs, 16 lanes each) += x rows . w rows over `columns` columns, in
// 6 x 4 register blocks; x rows stride x_stride, w rows stride w_stride. ends: for the whole
// tile (its y, when given, is output [0, 0] of the tile).
void tile_step(const float* x, int64_t x_stride, const float* w, int64_t w_stride, v16* partial, int64_t rows,
               int64_t cols, int64_t columns, Ends ends = {}) {
  for (int64_t r = 0; r < rows; r += ROWS_OF_X) {  // 6 rows of x stay in L1 while the weight rows pass
    const int64_t num_x = std::min<int64_t>(ROWS_OF_X, rows - r);
    const float* xr = x + r * x_stride;
    for (int64_t c = 0; c < cols; c += ROWS_OF_W) {
      const int64_t num_w = std::min<int64_t>(ROWS_OF_W, cols - c);
      v16* pr = partial + r * cols + c;
      Ends block_ends = ends;
      if (ends.y != nullptr) block_ends.y = ends.y + r * ends.y_stride + c;
      if (num_w == ROWS_OF_W) {
        micro_rows<ROWS_OF_W>(num_x, xr, x_stride, w + c * w_stride, w_stride, pr, columns, cols, block_ends);
      } else {
        for (int64_t j = 0; j < num_w; ++j) {
          Ends row_ends = block_ends;
          if (row_ends.y != nullptr) row_ends.y += j;
          micro_rows<1>(num_x, xr, x_stride, w + (c + j) * w_stride, w_stride, pr + j, columns, cols, row_ends);
        }
      }
    }
  }
}

void tile_product(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                  int64_t m0, int64_t n0) {
  const int64_t rows = std::min(TILE_M, M - m0), cols = std::min(TILE_N, N - n0);
  const int64_t k_vec = K / 16 * 16;
  v16* partial = reinterpret_cast<v16*>(thread_buffer(TILE_M * TILE_N * 16));
  const bool no_tail = k_vec == K && K > 0;  // then the last column step finishes the sums in registers
  if (k_vec == 0)
    for (int64_t i = 0; i < rows * cols; ++i) partial[i] = v16{};  // no column step: the tail alone
  for (int64_t k0 = 0; k0 < k_vec; k0 += TILE_K) {
    const int64_t columns = std::min(TILE_K, k_vec - k0);
    const bool last = k0 + columns == k_vec;
    tile_step(x + m0 * K + k0, K, w + n0 * K + k0, K, partial, rows, cols, columns,
              Ends{k0 == 0, last && no_tail ? y + m0 * N + n0 : nullptr, N});
  }
  if (no_tail) return;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      y[(m0 + i) * N + n0 + j] = finish(partial[i * cols + j], x + (m0 + i) * K, w + (n0 + j) * K, k_vec, K);
}

void prefill(const float* x, const uint8_t* w, int64_t format, float* y, int64_t M, int64_t K, int64_t N,
             int64_t row_bytes) {
  std::vector<float> dequantised;
  const float* w_f32 = reinterpret_cast<const float*>(w);
  if (format != F32) {
    dequantised.resize(N * K);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) dequantize_row(format, w + n * row_bytes, dequantised.data() + n * K, K);
    });
    w_f32 = dequantised.data();
  }
  const int64_t tiles_m = (M + TILE_M - 1) / TILE_M, tiles_n = (N + TILE_N - 1) / TILE_N;
  at::parallel_for(0, tiles_m * tiles_n, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) tile_product(x, w_f32, y, M, K, N, (t % tiles_m) * TILE_M, (t / tiles_m) * TILE_N);
  });
}

// Many rows on block formats: each work item, a tile of BLOCK_TILE_M rows of x by BLOCK_TILE_N
// weight rows, decodes its weight rows BLOCK_TILE_K columns at a time into a float32 tile (in L2; the
// values dequantize_row writes) and runs the 6 x 4 register blocks over it, the partial sums
// parked between column steps. A weight is decoded once per BLOCK_TILE_M rows of x instead of
// once per 8 (the fused path's), and the multiply-adds read both operands from cache: per
// output, the same sequence of fused multiply-adds as fused_slice and block<>.
// Weight tiles advance fastest, so a thread's tile of x stays in cache while the weights stream.
// 2048 columns a step (a 256 KB tile): Qwen2.5-1.5B prefill of 1024 tokens 50 / 55-57 / 60-61 /
// 62 tok/s with 256 / 512-1024 / 1536-2048 / 4096+ (fewer parkings of the partial sums); the tile's
// 96 x 32 shape measured flat from 48 to 192 rows and 16 to 64 weight rows.
constexpr int64_t BLOCK_TILE_M = 96, BLOCK_TILE_N = 32, BLOCK_TILE_K = 2048;
// From this many rows of x on, block formats take the tiles (kernel_cost.py, SmolLM2's Q4_1 /
// Q8_0, 2 threads: 0.7x the fused path at 4 rows, even at 9, 1.1x at 16, 1.25x at 32; a whole
// 16-token forward measured the same either way, within noise). On AVX2, where the fused path
// re-decodes each weight for every group of 4 rows: from 9 rows for 32-weight blocks (AMD EPYC
// Zen 3, whole SmolLM2 forwards, min over alternating processes, fused against tiles: 5 / 6 / 7 /
// 8 tokens 1.27x / 1.15x / 1.12x / 1.08x, 9 / 12 / 16 tokens 0.93x / 0.92x / 0.85x; one matrix
// alone, warm in cache, had favoured the tiles from 5 rows), from 5 for Q4_K and Q6_K, whose
// decoding costs more (Qwen2.5-Coder-1.5B forwards at 5 and 8 tokens: fused 0.95x the tiles).
// On AVX2, 32-weight blocks take decoded_pairs up to 12 rows, which decodes each weight once for
// all of them (the tiles at 16 and 24 rows measured the same as decoded_pairs there).
inline int64_t block_tile_min_rows(int64_t format) {
  if (kVectorRegisters == 32) return 12;
  if (layout(format).weights == 256) return 5;  // the K-quants, IQ4_XS
#if defined(DRAFTWISE_V16_PAIR)
  return 13;
#else
  return 9;  // no decoded_pairs here: each group of the fused path decodes the row again
#endif
}

void prefill_blocks(const float* x, const uint8_t* w, int64_t format, float* y, int64_t M, int64_t K, int64_t N,
                    int64_t row_bytes) {
  const Layout blocks = layout(format);
  const int64_t tile_m = even_tile_rows(M, BLOCK_TILE_M, ROWS_OF_X);
  const int64_t tiles_m = (M + tile_m - 1) / tile_m, tiles_n = (N + BLOCK_TILE_N - 1) / BLOCK_TILE_N;
  at::parallel_for(0, tiles_m * tiles_n, 1, [&](int64_t t0, int64_t t1) {
    float* buffer = thread_buffer(BLOCK_TILE_M * BLOCK_TILE_N * 16 + BLOCK_TILE_N * BLOCK_TILE_K);
    v16* partial = reinterpret_cast<v16*>(buffer);
    float* tile = buffer + BLOCK_TILE_M * BLOCK_TILE_N * 16;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t / tiles_n * tile_m, n0 = t % tiles_n * BLOCK_TILE_N;
      const int64_t rows = std::min(tile_m, M - m0), cols = std::min(BLOCK_TILE_N, N - n0);
      for (int64_t k0 = 0; k0 < K; k0 += BLOCK_TILE_K) {
        const int64_t columns = std::min(BLOCK_TILE_K, K - k0);  // whole blocks: K is a multiple of a block
        for (int64_t j = 0; j < cols; ++j) {
          if (j + 1 < cols) prefetch_slice(format, w + (n0 + j + 1) * row_bytes, k0, columns);
          dequantize_row(format, w + (n0 + j) * row_bytes + k0 / blocks.weights * blocks.bytes, tile + j * BLOCK_TILE_K,
                         columns);
        }
        const bool last = k0 + columns == K;
        tile_step(x + m0 * K + k0, K, tile, BLOCK_TILE_K, partial, rows, cols, columns,
                  Ends{k0 == 0, last ? y + m0 * N + n0 : nullptr, N});
      }
    }
  });
}

// Which product M rows of x take on block weights: the tiles from block_tile_min_rows, below
// that decoded_pairs on AVX2's 32-weight blocks from PAIR_MIN_ROWS, else the fused decode.
using BlockProduct = void (*)(const float*, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t, int64_t);
inline BlockProduct block_product(int64_t format, int64_t M) {
  if (M >= block_tile_min_rows(format)) return prefill_blocks;
#if defined(DRAFTWISE_V16_PAIR)
  if (layout(format).weights == 32 && M >= PAIR_MIN_ROWS) return decoded_pairs;
#endif
  return fused;
}

}  // namespace

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t K) {
  check_weight(weight, format, K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, say("blocked_linear: x ", x.sizes(), " does not have ", K, " columns"));
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "blocked_linear: x must be contiguous float32");
  const int64_t M = x.size(0), N = weight.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  if (is_block_format(format)) {
    const auto run = block_product(format, M);
    run(x.data_ptr<float>(), weight.data_ptr<uint8_t>(), format, y.data_ptr<float>(), M, K, N, weight.size(1));
    return y;
  }
  // Float formats: the whole matrix dequantised for many rows of x. The lattice formats instead
  // decode a tile of weight rows at a time, as the block formats' tiles do (the same products):
  // dequantising all of an 8960 x 1536 IQ3_S matrix per call made 64 rows of x 5x slower than
  // float32 weights (31.9 against 6.3 ms).
  const auto run = M <= SKINNY_MAX_ROWS ? skinny : is_lattice_format(format) ? prefill_blocks : prefill;
  run(x.data_ptr<float>(), weight.data_ptr<uint8_t>(), format, y.data_ptr<float>(), M, K, N, weight.size(1));
  return y;
}

at::Tensor dequantize_rows(const at::Tensor& weight, int64_t format, int64_t K, const at::Tensor& ids) {
  check_weight(weight, format, K);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "dequantize_rows: ids must be int64 [T]");
  auto ids_c = ids.contiguous();
  const int64_t T = ids_c.size(0), N = weight.size(0), row_bytes = weight.size(1);
  auto out = at::empty({T, K}, at::kFloat);
  const int64_t* id = ids_c.data_ptr<int64_t>();
  const uint8_t* w = weight.data_ptr<uint8_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(0 <= id[t] && id[t] < N, say("dequantize_rows: row ", id[t], " out of range 0..", N - 1));
    if (format == F32) {
      std::memcpy(out.data_ptr<float>() + t * K, w + id[t] * row_bytes, K * 4);
    } else {
      dequantize_row(format, w + id[t] * row_bytes, out.data_ptr<float>() + t * K, K);
    }
  }
  return out;
}

}  // namespace draftwise
