// y = x @ W.T on int8 activations: each row of x rounded to 8 bits per 32 columns, then exact
// integer dot products against GGUF's quantized blocks (AVX-512 VNNI where the CPU has it).
//
// Why: with float32 activations every 4-bit weight must become a float before it is multiplied
// (several instructions per weight); with 8-bit activations one VNNI instruction multiplies and
// adds 64 byte pairs, so a decode step runs at the speed the weights' bytes arrive, as llama.cpp
// does. The price is rounding x: the result is dot(W, round8(x)) where round8 keeps 8 bits per
// 32 values (one float scale per block, amax / 127), not dot(W, x). linear.py and docs/weight-formats.md
// state how close (benchmarks/numerics.py measures it).
//
// Two layouts, one per family of formats (both in the file's own column order):
//
// 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). A weight row is unpacked into
//   u      [K] unsigned bytes, the block's quantized values (Q8_0's int8 values + 128),
//   scale  [K/4] floats, one per 4 columns (a lane of the dot product below): the block's scale,
//   coef   [K/16] floats, one per 16 columns: w = scale * u + coef (min, or -offset * scale),
// an activation row (rounded per 32 columns) into q [K] int8, scale [K/4] floats (d per lane),
// sum [K/16] floats (d * the sum of q over each 16 columns), and
//   dot(w, round8(x)) = sum over 64-column chunks of float(P) * (w.scale * x.scale)
//                       + sum over 16-column groups of w.coef * x.sum,
// where P (16 int32 lanes, 4 byte products each) is exact.
//
// 256-weight super-blocks (Q4_K, Q6_K: a Q4_K_M file's weights; Q5_K: a Q5_K_M file's, Q4_K's
// layout with a fifth bit per value). Each super-block has one float
// scale d and small integer scales per 32 (Q4_K, Q5_K) or 16 (Q6_K) columns, so with activations
// rounded per 256 columns (one scale dx) a super-block's whole dot product is one exact integer
// I = sum of sub-scale * (u . q), computed 32 or 64 columns at a time by a byte multiply into
// int16 pairs and an int16 multiply-add by the sub-scales into int32 lanes, kept as 8 lanes
// (lane i: columns 4i .. 4i + 3 of each 32). Then, per super-block b, in an 8-lane float
// accumulator,
//   acc += float(I_b) * (d_b * dx_b);  acc += w.coef_b * x.sum_b   (8 coefficients at a time)
// where a coefficient stands for a group of columns (a Q4_K or Q5_K sub-block's 32: -dmin * its
// min; a Q6_K sub-block's 16: -32 d * its scale) and x.sum for dx * the sum of q over the same
// group, and dot(w, round8(x)) = the horizontal sum of acc. Two float multiply-adds per 256
// columns (three for Q6_K); what is left per row of x is two integer multiplies per 64 weights.
// (Before 2026-11-29 the accumulator had 16 lanes and the coefficients one per 16 columns, Q4_K's
// min twice: four multiply-adds a super-block and row pair, ~40% of AVX2's prefill tile.)
//
// Batch invariance: y[m, n] is that arithmetic in that order (16- or 8-lane float accumulator in
// column order, one fixed horizontal sum, then the coefficient sum), whatever the number of
// rows of x and however threads split the work. The integer parts are exact, so every
// instruction set below (AVX-512 VNNI, AVX-512BW, portable C++) computes the same integers.
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

constexpr int64_t CHUNK = 64;  // columns per integer step: 16 int32 lanes x 4 bytes
constexpr int64_t FUSED_MAX_ROWS = 16;  // at most this many rows of x: weights decoded in registers
// 32-weight blocks: rows of x per call, 8 x 2 accumulators in AVX-512's 32 registers, 4 x 2 in
// AVX2's 16 (a v16 is two of them).
constexpr int FUSED_ROWS_OF_X_BLOCK32 = kVectorRegisters == 32 ? 8 : 4;
constexpr int64_t SUPER = 256;  // columns of a K-quant super-block


inline int64_t padded(int64_t K) { return (K + CHUNK - 1) / CHUNK * CHUNK; }
// Columns that share one coefficient (see the top of the file): a Q4_K or Q5_K sub-block's
// min, a Q6_K sub-block's offset (-32 times its scale), half a 32-weight block's offset.
inline constexpr int64_t coefficient_group(int64_t format) { return format == Q4_K || format == Q5_K ? 32 : 16; }

template <typename T>
inline void fill(T* out, int count, T value) {
  for (int i = 0; i < count; ++i) out[i] = value;
}

// ---- activations ----------------------------------------------------------------------------

// One row of K activations -> q [K] int8 = round(x / d) per block of `block` columns
// (d = amax / 127), d per block into scale [K / block], d * (sum of q) per `group` columns (16,
// or 32: Q4_K's and Q5_K's sub-blocks) into sum [K / group], and where q_sum is given the sums
// of q themselves there too (Q6_K's).
void round_row(const float* x, int64_t K, int64_t block, int64_t group, int8_t* q, float* scale, float* sum,
               int16_t* q_sum) {
  const v16 limit = v16{} + 127.0f;
  for (int64_t b = 0; b < K / block; ++b, x += block, q += block, sum += block / group) {
    const float top = largest_magnitude(x, block);
    const float d = top / 127.0f, inverse = top > 0.0f ? 127.0f / top : 0.0f;
    scale[b] = d;
    int total = 0;
    for (int64_t k = 0; k < block; k += 16) {
      // x / d rounded to float32, then to the nearest integer (ties to even): no fused
      // multiply-add here, so the rounding is that of the float32 quotient (what numpy or torch
      // computes as round(x * (127 / amax))).
      const v16 product = load16(x + k) * inverse;
      v16 r;
      for (int i = 0; i < 16; ++i) r[i] = __builtin_rintf(product[i]);
      r = select(r > limit, limit, r);
      r = select(r < -limit, -limit, r);
      const vi16 values = convert<vi16>(r);
      for (int i = 0; i < 16; ++i) {
        q[k + i] = int8_t(values[i]);
        total += values[i];
      }
      if ((k + 16) % group == 0) {
        sum[k / group] = d * float(total);
        if (q_sum != nullptr) q_sum[b * (block / group) + k / group] = int16_t(total);
        total = 0;
      }
    }
  }
}

struct Activations {  // M rounded rows of Kp columns
  std::vector<int8_t> q;
  std::vector<float> scale;  // per block (K-quants) or per 4 columns (32-weight blocks)
  std::vector<float> sum;    // per group of columns (coefficient_group), Kp / 16 a row
  std::vector<int16_t> q_sum;  // Q6_K: the sums of q per 16 columns, K / 16 a row
};

// Every row of x rounded once; zeros pad K up to Kp (they add exact zeros).
Activations round_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int64_t format) {
  const int64_t block = layout(format).weights, group = coefficient_group(format);
  Activations a{std::vector<int8_t>(M * Kp, 0), std::vector<float>(M * Kp / 4, 0.0f),
                std::vector<float>(M * Kp / 16, 0.0f), std::vector<int16_t>(format == Q6_K ? M * K / 16 : 0)};
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    std::vector<float> per_block(K / block);
    for (int64_t m = m0; m < m1; ++m) {
      round_row(x + m * K, K, block, group, a.q.data() + m * Kp, per_block.data(), a.sum.data() + m * Kp / 16,
                format == Q6_K ? a.q_sum.data() + m * K / 16 : nullptr);
      if (block == SUPER) {
        std::copy(per_block.begin(), per_block.end(), a.scale.data() + m * (Kp / SUPER));
      } else {  // one scale per int32 lane of the 32-weight-block product
        for (int64_t b = 0; b < K / block; ++b) fill(a.scale.data() + m * Kp / 4 + b * 8, 8, per_block[b]);
      }
    }
  });
  return a;
}

inline float coefficient_sum(const float* coef, const float* sum, int64_t groups) {
  v16 acc = {};
  int64_t g = 0;
  for (; g + 16 <= groups; g += 16) acc = fmadd(load16(coef + g), load16(sum + g), acc);
  float total = horizontal_sum(acc);
  for (; g < groups; ++g) total = fmadd(coef[g], sum[g], total);
  return total;
}

template <typename T>
T* thread_scratch(int64_t count) {
  static thread_local std::vector<T> buffer;
  if (int64_t(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

// ---- 32-weight blocks -----------------------------------------------------------------------

// A 32-weight block's coefficient: w = d * u + coef, u its unsigned values (d its scale).
inline float block32_coef(int64_t format, const uint8_t* block, float d) {
  if (format == Q8_0) return -128.0f * d;  // u = v + 128
  if (format == Q4_1 || format == Q5_1) return half_to_float(block + 2);  // the block's min
  return -float(format == Q5_0 ? 16 : 8) * d;
}

// One weight row of K columns -> u [K], scale [K/4], coef [K/16] (see the top of the file).
void unpack_block32_row(int64_t format, const uint8_t* row, int64_t K, uint8_t* u, float* scale, float* coef) {
  const bool with_min = format == Q4_1 || format == Q5_1, five_bits = format == Q5_0 || format == Q5_1;
  const int64_t bytes = layout(format).bytes;
  for (int64_t b = 0; b < K / 32; ++b, row += bytes, u += 32, scale += 8, coef += 2) {
    const float d = half_to_float(row);
    fill(scale, 8, d);
    fill(coef, 2, block32_coef(format, row, d));
    if (format == Q8_0) {
      for (int i = 0; i < 32; ++i) u[i] = row[2 + i] ^ 128;  // int8 v -> v + 128
      continue;
    }
    nibbles(row + (with_min ? 4 : 2) + (five_bits ? 4 : 0), u, u + 16);
    if (five_bits) {
      uint32_t high;
      std::memcpy(&high, row + (with_min ? 4 : 2), 4);
      for (int i = 0; i < 32; ++i) u[i] |= ((high >> i) & 1) << 4;
    }
  }
}

#if defined(DRAFTWISE_V16_PAIR)
// AVX2's byte multiply-add (unsigned x signed bytes, pairs summed into saturating int16) for 8
// lanes of 4 products, exact for any unsigned u and q in [-127, 127] (round_row's range):
// u q = (u - 128) q + 128 q, and each half's int16 pairs stay within 2 x 128 x 127 = 32512.
// (u - 128) q is |u - 128| times q with the sign of u - 128 (|-128| is 128 as an unsigned byte).
inline __m256i dot_lanes8(__m256i u, __m256i q) {
  const __m256i centred = _mm256_xor_si256(u, _mm256_set1_epi8(-128)), ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(q, centred));
  const __m256i high = _mm256_maddubs_epi16(_mm256_set1_epi8(-128), q);
  return _mm256_add_epi32(_mm256_madd_epi16(low, ones), _mm256_madd_epi16(high, ones));
}
#endif

// 16 lanes of 4 byte products each, exact: lane i = sum_j u[4i + j] * q[4i + j].
inline vi16 dot_lanes(const uint8_t* u, const int8_t* q) {
  vi16 out;
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(u), _mm512_loadu_si512(q));
  std::memcpy(&out, &p, sizeof out);
#elif defined(DRAFTWISE_V16_PAIR)
  out = join(dot_lanes8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
             dot_lanes8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32)),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32))));
#else
  for (int i = 0; i < 16; ++i) {
    int32_t lane = 0;
    for (int j = 0; j < 4; ++j) lane += int32_t(u[4 * i + j]) * int32_t(q[4 * i + j]);
    out[i] = lane;
  }
#endif
  return out;
}

struct Block32Rows {  // unpacked weight rows (u, scale, coef) or rounded activations (q, scale, sum)
  const uint8_t* bytes;
  const float* scale;
  const float* extra;
};

template <int NUM_X, int NUM_W>
inline void block32_micro(Block32Rows x, Block32Rows w, float* y, int64_t Kp, int64_t N) {
  v16 acc[NUM_X][NUM_W] = {};
  for (int64_t k = 0; k < Kp; k += CHUNK) {
#pragma GCC unroll 16
    for (int i = 0; i < NUM_X; ++i) {
      const int8_t* q = reinterpret_cast<const int8_t*>(x.bytes) + i * Kp + k;
      const v16 x_scale = load16(x.scale + i * (Kp / 4) + k / 4);
#pragma GCC unroll 16
      for (int j = 0; j < NUM_W; ++j) {
        const vi16 p = dot_lanes(w.bytes + j * Kp + k, q);
        acc[i][j] = fmadd(convert<v16>(p), load16(w.scale + j * (Kp / 4) + k / 4) * x_scale, acc[i][j]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NUM_W; ++j)
      y[i * N + j] = horizontal_sum(acc[i][j]) +
                     coefficient_sum(w.extra + j * (Kp / 16), x.extra + i * (Kp / 16), Kp / 16);
}

// ---- 256-weight super-blocks (K-quants) -----------------------------------------------------

// One weight row -> u [K] bytes, sub-scales [K/2] int16 (one per byte pair, the int16 lanes
// of the product), d [K/256], and Q4_K's and Q5_K's coef [K/32] or Q6_K's offset [K/16] (see the
// top of the file).
void unpack_kquant_row(int64_t format, const uint8_t* row, int64_t K, uint8_t* u, int16_t* sub, float* d,
                       float* coef, int16_t* offset) {
  const int64_t block_bytes = layout(format).bytes;
  for (int64_t b = 0; b < K / SUPER; ++b, u += SUPER, sub += SUPER / 2, coef += 8, offset += 16) {
    kquant_values(format, row, u);
    if (format == Q4_K || format == Q5_K) {
      const float dmin = half_to_float(row + 2);
      d[b] = half_to_float(row);
      const uint8_t* sc = row + 4;  // 8 six-bit scales and 8 six-bit mins
      uint8_t scales[16];
      q4k_scales(sc, scales);
      for (int j = 0; j < 8; ++j) {
        fill<int16_t>(sub + 16 * j, 16, int16_t(scales[j]));
        coef[j] = -dmin * float(scales[8 + j]);
      }
      row += block_bytes;
    } else {  // Q6_K
      const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
      d[b] = half_to_float(row + 208);
      for (int g = 0; g < 16; ++g) {
        fill<int16_t>(sub + 8 * g, 8, int16_t(sc[g]));
        offset[g] = int16_t(32 * sc[g]);
      }
      row += block_bytes;
    }
  }
}

// acc lanes += sub-scaled byte products, exact: int16 pair p = u[2p] q[2p] + u[2p+1] q[2p+1]
// (at most 2 * 63 * 127: no saturation), lane i += pair(2i) * sub[2i] + pair(2i+1) * sub[2i+1].
inline vi16 scaled_dot(vi16 acc, const uint8_t* u, const int8_t* q, const int16_t* sub) {
#if defined(__AVX512BW__)
  __m512i a;
  std::memcpy(&a, &acc, sizeof a);
  const __m512i pairs = _mm512_maddubs_epi16(_mm512_loadu_si512(u), _mm512_loadu_si512(q));
#if defined(__AVX512VNNI__)
  a = _mm512_dpwssd_epi32(a, pairs, _mm512_loadu_si512(sub));
#else
  a = _mm512_add_epi32(a, _mm512_madd_epi16(pairs, _mm512_loadu_si512(sub)));
#endif
  std::memcpy(&acc, &a, sizeof a);
#elif defined(DRAFTWISE_V16_PAIR)
  for (int h = 0; h < 2; ++h) {  // 32 bytes, 8 lanes: the same pairs and sums as above
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32 * h)),
                                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * h)));
    const __m256i sum = _mm256_add_epi32(half_of(acc, h),
                                         _mm256_madd_epi16(pairs, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sub + 16 * h))));
    (h == 0 ? acc.lo : acc.hi) = vi8(sum);
  }
#else
  for (int i = 0; i < 16; ++i) {
    int32_t lane = 0;
    for (int t = 0; t < 2; ++t) {
      const int p = 2 * i + t;
      lane += (int32_t(u[2 * p]) * q[2 * p] + int32_t(u[2 * p + 1]) * q[2 * p + 1]) * int32_t(sub[p]);
    }
    acc[i] += lane;
  }
#endif
  return acc;
}

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Q6_K's values are u - 32: the -32 times the sub-scales, exactly, as 8 int32 lanes to take off
// a super-block's integer sum (lane i: groups 2i and 2i + 1 of 16 columns): offset holds 32 x
// the 16 sub-scales, q_sum the sums of q over the same columns (|lane| < 2^25).
inline vi8 offset_lanes(const int16_t* offset, const int16_t* q_sum) {
#if defined(__AVX2__)
  return vi8(_mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset)),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q_sum))));
#else
  vi8 out;
  for (int i = 0; i < 8; ++i)
    out[i] = int32_t(offset[2 * i]) * q_sum[2 * i] + int32_t(offset[2 * i + 1]) * q_sum[2 * i + 1];
  return out;
#endif
}

// One super-block's contribution to a row's 8-lane float accumulator, in the one order every
// K-quant kernel uses (decode, verify, prefill): the exact integer lanes (Q6_K's offset taken
// off) times d * dx, then, for Q4_K and Q5_K, the 8 sub-blocks' coefficients (-dmin * min) times
// the activation sums of their 32 columns.
inline v8 super_block_step(v8 acc, vi8 total, float scale, const float* coef, const float* sum) {
  acc = fmadd(__builtin_convertvector(total, v8), broadcast8(scale), acc);
  if (coef != nullptr) acc = fmadd(load8(coef), load8(sum), acc);
  return acc;
}

// A 64-column chunk's 16 int32 lanes -> the 8 of super_block_step: lane i + lane i + 8, so lane
// i holds columns 4i .. 4i + 3 of each 32 (integers: exact in any order).
inline vi8 fold(vi16 total) {
#if defined(DRAFTWISE_V16_PAIR)
  return total.lo + total.hi;
#else
  return __builtin_shufflevector(total, total, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(total, total, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

struct KquantRows {  // unpacked weight rows
  const uint8_t* u;
  const int16_t* sub;
  const float* d;
  const float* coef;       // Q4_K, Q5_K: K / 32 a row (K / 16 apart); else nullptr
  const int16_t* offset;   // Q6_K: K / 16 a row; else nullptr
};
struct RoundedRows {  // activation rows rounded per super-block
  const int8_t* q;
  const float* d;
  const float* sum;        // K / 16 apart, the first K / coefficient_group used
  const int16_t* q_sum;    // Q6_K: K / 16 a row; else nullptr
};

// super_block_step in a decode kernel, for row i of x: the super-block's coefficients (Q4_K,
// Q5_K) or offsets (Q6_K), decoded from the block, as kquant_micro takes them unpacked.
template <int64_t FORMAT>
inline v8 decode_step(v8 acc, vi8 total, float scale, const float* coef, const int16_t* offset, RoundedRows x, int i,
                      int64_t b, int64_t K) {
  if constexpr (FORMAT == Q6_K) {
    const vi8 without_offset = total - offset_lanes(offset, x.q_sum + i * (K / 16) + b * 16);
    return super_block_step(acc, without_offset, scale, nullptr, nullptr);
  } else {
    return super_block_step(acc, total, scale, coef, x.sum + i * (K / 16) + b * 8);
  }
}

// decode_step in a prefill tile, for rows i of x and j of w, from the rows unpacked in memory.
// STEP is Q6_K (an offset) or Q4_K (coefficients: Q5_K's rows unpack as Q4_K's do), a template
// argument so that the tile's loop carries no test of the format.
template <int64_t STEP>
inline v8 tile_step(v8 acc, vi8 total, KquantRows w, RoundedRows x, int i, int j, int64_t b, int64_t K) {
  static_assert(STEP == Q6_K || STEP == Q4_K, "tile_step: Q6_K's step or Q4_K's");
  const float scale = w.d[j * (K / SUPER) + b] * x.d[i * (K / SUPER) + b];
  return STEP == Q6_K ? decode_step<STEP>(acc, total, scale, nullptr, w.offset + j * (K / 16) + b * 16, x, i, b, K)
                      : decode_step<STEP>(acc, total, scale, w.coef + j * (K / 16) + b * 8, nullptr, x, i, b, K);
}

#if defined(DRAFTWISE_V16_PAIR)
// AVX2's prefill tile: 6 rows of x against 2 weight rows, each pair's integer sum one 256-bit
// register (a super-block's 32-column pieces added into it: columns 4i .. 4i + 3 of each in
// lane i, as fold gives the other kernels'), so 12 sums, a weight register and its sub-scales
// fit AVX2's 16 registers. The same integers lane for lane (exact, in any order) and the float
// steps of super_block_step, so the bits are those of the other kernels.
// (Before 2026-11-29 the sums were 16 lanes, two registers a pair, summed one half after the
// other, and a super-block's float steps were four multiply-adds a pair with the coefficients
// in them: ~40% of this kernel's time (perf), now one.)
template <int NUM_X, int NUM_W, int64_t STEP>
inline void kquant_micro(RoundedRows x, KquantRows w, float* y, int64_t K, int64_t N) {
  const int64_t blocks = K / SUPER;
  v8 acc[NUM_X][NUM_W] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i total[NUM_X][NUM_W];
#pragma GCC unroll 16
    for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NUM_W; ++j) total[i][j] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int piece = 0; piece < SUPER / 32; ++piece) {
      const int64_t k = b * SUPER + 32 * piece;
#pragma GCC unroll 16
      for (int j = 0; j < NUM_W; ++j) {
        const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.u + j * K + k));
        const __m256i sub = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.sub + j * (K / 2) + k / 2));
#pragma GCC unroll 16
        for (int i = 0; i < NUM_X; ++i) {
          const __m256i pairs = _mm256_maddubs_epi16(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i * K + k)));
          total[i][j] = _mm256_add_epi32(total[i][j], _mm256_madd_epi16(pairs, sub));
        }
        // x's rows are read again for the next weight row, from L1, as a multiply's operand:
        // kept from one weight row to the next instead, they took 6 registers and the sums spilled.
        asm volatile("" ::: "memory");
      }
      // Keep the sums in registers piece by piece: left free, GCC regrouped the additions
      // (integers: any order is exact) into products parked on the stack.
#pragma GCC unroll 16
      for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 16
        for (int j = 0; j < NUM_W; ++j) asm("" : "+x"(total[i][j]));
    }
#pragma GCC unroll 16
    for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NUM_W; ++j)
        acc[i][j] = tile_step<STEP>(acc[i][j], vi8(total[i][j]), w, x, i, j, b, K);
  }
#pragma GCC unroll 16
  for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NUM_W; ++j)
      y[i * N + j] = horizontal_sum(acc[i][j]);
}
#else
template <int NUM_X, int NUM_W, int64_t STEP>
inline void kquant_micro(RoundedRows x, KquantRows w, float* y, int64_t K, int64_t N) {
  const int64_t blocks = K / SUPER;
  v8 acc[NUM_X][NUM_W] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    vi16 total[NUM_X][NUM_W] = {};
    for (int64_t k = b * SUPER; k < (b + 1) * SUPER; k += CHUNK) {
#pragma GCC unroll 16
      for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 16
        for (int j = 0; j < NUM_W; ++j)
          total[i][j] = scaled_dot(total[i][j], w.u + j * K + k, x.q + i * K + k, w.sub + j * (K / 2) + k / 2);
    }
#pragma GCC unroll 16
    for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NUM_W; ++j)
        acc[i][j] = tile_step<STEP>(acc[i][j], fold(total[i][j]), w, x, i, j, b, K);
  }
#pragma GCC unroll 16
  for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NUM_W; ++j)
      y[i * N + j] = horizontal_sum(acc[i][j]);
}

#endif

#if defined(__AVX512BW__)
// In-lane byte-shuffle controls that give each 128-bit lane of a chunk's int16 lanes the
// sub-scale of the columns it holds, from a 16-byte table of int16 scales broadcast to every
// lane (a cross-lane word permute costs several times an in-lane shuffle here).
inline __m512i pick_words(int lane0, int lane1, int lane2, int lane3) {
  const auto word = [](int w) { return _mm_set1_epi16(int16_t(((2 * w + 1) << 8) | (2 * w))); };
  __m512i out = _mm512_castsi128_si512(word(lane0));
  out = _mm512_inserti32x4(out, word(lane1), 1);
  out = _mm512_inserti32x4(out, word(lane2), 2);
  return _mm512_inserti32x4(out, word(lane3), 3);
}

// The same product for a few rows of x (a decode or verify step), one weight row at a time,
// unpacked in registers as it is read: each chunk of weight bytes meets every row of x while it
// is in a register. x_d holds dx of super-block b for row i at [b * 16 + i]. Integer for integer
// and float for float the arithmetic of kquant_micro (super_block_step), so the two agree bit
// for bit (and the tests check it).
template <int64_t FORMAT, int NUM_X>
inline void kquant_decode(RoundedRows x, const float* x_d, const uint8_t* row, float* y, int64_t K, int64_t N) {
  const int64_t blocks = K / SUPER, block_bytes = layout(FORMAT).bytes;
  const __m512i low_nibble = _mm512_set1_epi8(15), two_bits = _mm512_set1_epi8(3), one_bit = _mm512_set1_epi8(1);
  // Per-lane shift counts: the chunk's lower 32 bytes take one nibble / bit pair, the upper the next.
  const __m512i q4_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  // Q4_K chunk c: lanes 0-1 hold sub-block 2c, lanes 2-3 sub-block 2c + 1. Q6_K chunk c: lane l
  // holds sub-block 4c + l, word 4 (c % 2) + l of the table of half c / 2 of the scales.
  const __m512i q4_pick[4] = {pick_words(0, 0, 1, 1), pick_words(2, 2, 3, 3), pick_words(4, 4, 5, 5),
                              pick_words(6, 6, 7, 7)};
  const __m512i q6_pick[2] = {pick_words(0, 1, 2, 3), pick_words(4, 5, 6, 7)};
  v8 acc[NUM_X] = {};
  alignas(32) float coef[8];       // the super-block's coefficients (Q4_K, Q5_K)
  alignas(32) int16_t offset[16];  // or its offsets (Q6_K)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * block_bytes;
    prefetch_ahead(block, block_bytes);
    __m512i table[2];  // int16 sub-scales, 8 to a 128-bit lane, broadcast to every lane
    float d;
    if constexpr (FORMAT == Q4_K || FORMAT == Q5_K) {
      d = half_to_float(block);
      const __m128i packed = q4k_scales_register(block + 4);
      table[0] = table[1] = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(packed));
      const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)));  // the 8 mins
      _mm256_storeu_ps(coef, _mm256_mul_ps(_mm256_set1_ps(-half_to_float(block + 2)), m));
    } else {
      d = half_to_float(block + 208);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
      table[0] = _mm512_broadcast_i32x4(_mm_cvtepi8_epi16(packed));
      table[1] = _mm512_broadcast_i32x4(_mm_cvtepi8_epi16(_mm_srli_si128(packed, 8)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(offset), _mm256_slli_epi16(_mm256_cvtepi8_epi16(packed), 5));
    }
    alignas(64) float scale[16];
    store16(scale, load16(x_d + b * 16) * d);
    vi16 total[NUM_X] = {};
#pragma GCC unroll 4
    for (int chunk = 0; chunk < 4; ++chunk) {
      __m512i u, sub;
      if constexpr (FORMAT == Q4_K || FORMAT == Q5_K) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
        const uint8_t* qs = block + nibbles_at(FORMAT) + 32 * chunk;
        const __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
        u = _mm512_and_si512(_mm512_srlv_epi16(bytes, q4_shift), low_nibble);
        if constexpr (FORMAT == Q5_K) {  // bit 2c of qh (lower 32 bytes), 2c + 1 (upper) as each value's fifth
          const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16)));
          const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16(2 * chunk), _mm256_set1_epi16(2 * chunk + 1), 1);
          u = _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift), one_bit), 4));
        }
        sub = _mm512_shuffle_epi8(table[0], q4_pick[chunk]);
      } else {  // Q6_K, chunk c: half c / 2, nibble c % 2 of its 64 ql bytes, bit pairs 2 (c % 2) * 2 + {0, 1}
        const int half = chunk / 2, odd = chunk % 2;
        const __m512i ql = _mm512_loadu_si512(block + 64 * half);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * half)));
        const __m512i high_shift = _mm512_inserti64x4(_mm512_set1_epi16(4 * odd), _mm256_set1_epi16(4 * odd + 2), 1);
        const __m512i low = _mm512_and_si512(_mm512_srli_epi16(ql, 4 * odd), low_nibble);
        const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(qh, high_shift), two_bits);
        u = _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
        sub = _mm512_shuffle_epi8(table[half], q6_pick[odd]);
      }
#pragma GCC unroll 16
      for (int i = 0; i < NUM_X; ++i) {
        __m512i t;
        std::memcpy(&t, &total[i], sizeof t);
        const __m512i pairs = _mm512_maddubs_epi16(u, _mm512_loadu_si512(x.q + i * K + b * SUPER + chunk * CHUNK));
#if defined(__AVX512VNNI__)
        t = _mm512_dpwssd_epi32(t, pairs, sub);
#else
        t = _mm512_add_epi32(t, _mm512_madd_epi16(pairs, sub));
#endif
        std::memcpy(&total[i], &t, sizeof t);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < NUM_X; ++i)
      acc[i] = decode_step<FORMAT>(acc[i], fold(total[i]), scale[i], coef, offset, x, i, b, K);
  }
#pragma GCC unroll 16
  for (int i = 0; i < NUM_X; ++i) y[i * N] = horizontal_sum(acc[i]);
}
constexpr bool FUSED = true;
#elif defined(DRAFTWISE_V16_PAIR)
// In-lane byte-shuffle control that puts int16 word `first` of a 128-bit table in every word of
// a register's low lane and word `second` in its high lane.
inline __m256i pick_words(int first, int second) {
  const auto word = [](int w) { return _mm_set1_epi16(int16_t(((2 * w + 1) << 8) | (2 * w))); };
  return _mm256_set_m128i(word(second), word(first));
}

// AVX2: the same product with 256-bit registers, 32 columns each: one Q4_K sub-block (a 32-byte
// load: its low nibbles, then the next sub-block in its high ones) or two Q6_K ones, so each
// register's int16 pairs take one sub-scale (two for Q6_K, one per 128-bit lane), spread from
// the block's table of sub-scales by one in-lane shuffle. The lanes hold the columns they hold
// in kquant_micro and AVX-512's kquant_decode (a chunk's first 32 columns in lanes 0-7), the
// integers are exact and the float steps are super_block_step's, so the bits are the same.
// Before, AVX2 unpacked each weight row into memory first (a byte and an int16 sub-scale per
// weight, written and read back): int8 activations were no faster than float32 there.
template <int64_t FORMAT, int NUM_X>
inline void kquant_decode(RoundedRows x, const float* x_d, const uint8_t* row, float* y, int64_t K, int64_t N) {
  const int64_t blocks = K / SUPER, block_bytes = layout(FORMAT).bytes;
  const __m256i low_nibble = _mm256_set1_epi8(15), two_bits = _mm256_set1_epi8(3), one_bit = _mm256_set1_epi8(1);
  const auto load = [](const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); };
  // Register h of a super-block (columns 32 h .. 32 h + 31) takes Q4_K's sub-scale h in both
  // lanes, Q6_K's 2 h and 2 h + 1 (words 2 h % 8 and 2 h % 8 + 1 of the first or second 8).
  alignas(32) static const __m256i q4_pick[8] = {pick_words(0, 0), pick_words(1, 1), pick_words(2, 2), pick_words(3, 3),
                                                 pick_words(4, 4), pick_words(5, 5), pick_words(6, 6), pick_words(7, 7)};
  alignas(32) static const __m256i q6_pick[4] = {pick_words(0, 1), pick_words(2, 3), pick_words(4, 5), pick_words(6, 7)};
  v8 acc[NUM_X] = {};
  alignas(32) float coef[8];       // the super-block's coefficients (Q4_K, Q5_K)
  alignas(32) int16_t offset[16];  // or its offsets (Q6_K)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * block_bytes;
    prefetch_ahead(block, block_bytes);
    __m256i sub[8];  // the int16 sub-scales of columns 32 h .. 32 h + 31
    float d;
    if constexpr (FORMAT == Q4_K || FORMAT == Q5_K) {
      d = half_to_float(block);
      const __m128i packed = q4k_scales_register(block + 4);  // 8 scales, then 8 mins
      const __m256i table = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(packed));
      for (int h = 0; h < 8; ++h) sub[h] = _mm256_shuffle_epi8(table, q4_pick[h]);
      const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)));
      _mm256_storeu_ps(coef, _mm256_mul_ps(_mm256_set1_ps(-half_to_float(block + 2)), mins));
    } else {
      d = half_to_float(block + 208);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));  // 16 int8 scales
      const __m256i tables[2] = {_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(packed)),
                                 _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(packed, 8)))};
      for (int h = 0; h < 8; ++h) sub[h] = _mm256_shuffle_epi8(tables[h / 4], q6_pick[h % 4]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(offset), _mm256_slli_epi16(_mm256_cvtepi8_epi16(packed), 5));
    }
    vi8 total[NUM_X] = {};
#pragma GCC unroll 4
    for (int chunk = 0; chunk < 4; ++chunk) {
      __m256i u[2];  // the chunk's columns 0-31 and 32-63
      if constexpr (FORMAT == Q4_K || FORMAT == Q5_K) {
        const __m256i bytes = load(block + nibbles_at(FORMAT) + 32 * chunk);
        u[0] = _mm256_and_si256(bytes, low_nibble);
        u[1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibble);
        if constexpr (FORMAT == Q5_K) {  // bits 2c and 2c + 1 of qh: the two sub-blocks' fifth bits
          const __m256i qh = load(block + 16);
          for (int s = 0; s < 2; ++s)
            u[s] = _mm256_or_si256(u[s], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * chunk + s), one_bit), 4));
        }
      } else {  // Q6_K: half chunk / 2, nibble chunk % 2 of ql, bit pairs 4 (chunk % 2) + {0, 2} of qh
        const int half = chunk / 2, odd = chunk % 2;
        const __m256i qh = load(block + 128 + 32 * half);
        for (int s = 0; s < 2; ++s) {
          const __m256i low = _mm256_and_si256(_mm256_srli_epi16(load(block + 64 * half + 32 * s), 4 * odd), low_nibble);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 4 * odd + 2 * s), two_bits);
          u[s] = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < NUM_X; ++i) {
        const int8_t* q = x.q + i * K + b * SUPER + chunk * CHUNK;
        const __m256i first = _mm256_madd_epi16(_mm256_maddubs_epi16(u[0], load(q)), sub[2 * chunk]);
        const __m256i second = _mm256_madd_epi16(_mm256_maddubs_epi16(u[1], load(q + 32)), sub[2 * chunk + 1]);
        total[i] += vi8(first) + vi8(second);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < NUM_X; ++i)
      acc[i] = decode_step<FORMAT>(acc[i], total[i], x_d[b * 16 + i] * d, coef, offset, x, i, b, K);
  }
#pragma GCC unroll 16
  for (int i = 0; i < NUM_X; ++i) y[i * N] = horizontal_sum(acc[i]);
}
constexpr bool FUSED = true;
#else
constexpr bool FUSED = false;
#endif

// 64 columns of a decode step on 32-weight blocks (two blocks' values, unsigned bytes, or a
// row of x's rounded values): one 512-bit register with AVX-512 VNNI, two 256-bit ones on AVX2.
// chunk_dot gives the 16 exact integer lanes of dot_lanes either way.
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define DRAFTWISE_BLOCK32_FUSED 1
using Chunk = __m512i;
inline Chunk join_chunk(__m256i first, __m256i second) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
}
inline Chunk load_chunk(const int8_t* q) { return _mm512_loadu_si512(q); }
template <int64_t FORMAT>
inline vi16 chunk_dot(Chunk u, Chunk x) {
  const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
  vi16 lanes;
  std::memcpy(&lanes, &p, sizeof lanes);
  return lanes;
}
// 32 bits -> 32 bytes, 16 where the bit is set.
inline __m256i fifth_bits(uint32_t high) { return _mm256_maskz_mov_epi8(_cvtu32_mask32(high), _mm256_set1_epi8(16)); }
// The two blocks' scales of a 64-column chunk in the int32 lanes they scale: [d0 x 8, d1 x 8]
// (d1 = 0 past the row's last block), converted in one instruction (exact, as half_to_float).
inline v16 pair_scales(const uint8_t* first, const uint8_t* second) {
  uint16_t h0, h1 = 0;
  std::memcpy(&h0, first, 2);
  if (second != nullptr) std::memcpy(&h1, second, 2);
  const __m512 scales = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(int16_t(h0))),
                                                                 _mm_set1_epi16(int16_t(h1)), 1));
  v16 out;
  std::memcpy(&out, &scales, sizeof out);
  return out;
}
#elif defined(DRAFTWISE_V16_PAIR)
#define DRAFTWISE_BLOCK32_FUSED 1
struct Chunk {
  __m256i first, second;
};
inline Chunk join_chunk(__m256i first, __m256i second) { return {first, second}; }
inline Chunk load_chunk(const int8_t* q) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32))};
}
// Values of at most 31 (Q4_x, Q5_x) times q never saturate the int16 pairs (2 x 31 x 127): one
// byte multiply-add; Q8_0's (up to 255) take dot_lanes8.
template <int64_t FORMAT>
inline vi16 chunk_dot(Chunk u, Chunk x) {
  if constexpr (FORMAT == Q8_0) {
    return join(dot_lanes8(u.first, x.first), dot_lanes8(u.second, x.second));
  } else {
    const __m256i ones = _mm256_set1_epi16(1);
    return join(_mm256_madd_epi16(_mm256_maddubs_epi16(u.first, x.first), ones),
                _mm256_madd_epi16(_mm256_maddubs_epi16(u.second, x.second), ones));
  }
}
inline __m256i fifth_bits(uint32_t high) {
  // byte i <- byte i / 8 of high, then its bit i % 8
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(high)),
                                            _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(16));
}
inline v16 pair_scales(const uint8_t* first, const uint8_t* second) {
  uint16_t h0, h1 = 0;
  std::memcpy(&h0, first, 2);
  if (second != nullptr) std::memcpy(&h1, second, 2);
  return join(_mm256_cvtph_ps(_mm_set1_epi16(int16_t(h0))), _mm256_cvtph_ps(_mm_set1_epi16(int16_t(h1))));
}
#endif

#if defined(DRAFTWISE_BLOCK32_FUSED)
// One 32-weight block -> its 32 unsigned values in column order, as unpack_block32_row writes
// them (Q8_0: v + 128; Q4_x: the nibbles; Q5_x: the nibbles plus the fifth bit as 16).
template <int64_t FORMAT>
inline __m256i block32_values(const uint8_t* block) {
  constexpr bool with_min = FORMAT == Q4_1 || FORMAT == Q5_1, five_bits = FORMAT == Q5_0 || FORMAT == Q5_1;
  if constexpr (FORMAT == Q8_0) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2)), _mm256_set1_epi8(-128));
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (with_min ? 4 : 2) + (five_bits ? 4 : 0)));
    const __m128i low_nibble = _mm_set1_epi8(15);
    __m256i u = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(qs, low_nibble)),
                                        _mm_and_si128(_mm_srli_epi16(qs, 4), low_nibble), 1);
    if constexpr (five_bits) {
      uint32_t high;
      std::memcpy(&high, block + (with_min ? 4 : 2), 4);
      u = _mm256_or_si256(u, fifth_bits(high));
    }
    return u;
  }
}

// The product of one weight row with a few rows of x (a decode or verify step), each pair of
// blocks decoded in registers as it is read (64 columns: one VNNI instruction per row of x),
// instead of unpacking the row into memory first. Integer for integer and float for float the
// arithmetic of block32_micro (the same lanes, the same scale products, the same
// coefficient_sum), so the two agree bit for bit; the int8 row-invariance tests check it.
// coef: scratch for the row's Kp / 16 coefficients.
template <int64_t FORMAT, int NUM_X>
inline void block32_decode(const int8_t* q, const float* x_scale, const float* x_sum, const uint8_t* row, float* coef,
                           float* y, int64_t K, int64_t Kp, int64_t N) {
  const int64_t bytes = layout(FORMAT).bytes;
  const int64_t blocks = K / 32;
  v16 acc[NUM_X] = {};
  for (int64_t k = 0, b = 0; k < Kp; k += CHUNK, b += 2) {
    const uint8_t* first = row + b * bytes;
    prefetch_ahead(first, 2 * bytes);
    // K = 32 (mod 64): the padding's values, scales and coefficients are zeros
    const uint8_t* second = b + 1 < blocks ? first + bytes : nullptr;
    const v16 scale = pair_scales(first, second);
    coef[k / 16] = coef[k / 16 + 1] = block32_coef(FORMAT, first, scale[0]);
    coef[k / 16 + 2] = coef[k / 16 + 3] = second != nullptr ? block32_coef(FORMAT, second, scale[8]) : 0.0f;
    const Chunk u = join_chunk(block32_values<FORMAT>(first),
                               second != nullptr ? block32_values<FORMAT>(second) : _mm256_setzero_si256());
#pragma GCC unroll 16
    for (int i = 0; i < NUM_X; ++i) {
      const vi16 lanes = chunk_dot<FORMAT>(u, load_chunk(q + i * Kp + k));
      acc[i] = fmadd(convert<v16>(lanes), scale * load16(x_scale + i * (Kp / 4) + k / 4), acc[i]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NUM_X; ++i)
    y[i * N] = horizontal_sum(acc[i]) + coefficient_sum(coef, x_sum + i * (Kp / 16), Kp / 16);
}

// block32_decode for two weight rows at once (up to 8 rows of x: each chunk of x is loaded once
// for both, and the two rows' sums are independent chains), the scales converted two blocks an
// instruction. Each output is block32_decode's arithmetic, operation for operation, so the bits
// are the same (tests/test_kernels.py: 1-16 rows at a time against the unpacked path). SmolLM2 with
// --activations int8 (benchmarks/forward_cost.py, AMX Xeon, 2 threads, 2026-11-26): forwards of
// 1 / 2 / 4 / 9 / 16 tokens 10 / 18 / 25 / 36 / 39 -> 10 / 12 / 16 / 28 / 38 ms.
template <int64_t FORMAT, int NUM_X>
inline void block32_decode_pair(const int8_t* q, const float* x_scale, const float* x_sum, const uint8_t* row0,
                                const uint8_t* row1, float* coef0, float* coef1, float* y, int64_t K, int64_t Kp,
                                int64_t N) {
  const int64_t bytes = layout(FORMAT).bytes;
  const int64_t blocks = K / 32;
  v16 acc[NUM_X][2] = {};
  for (int64_t k = 0, b = 0; k < Kp; k += CHUNK, b += 2) {
    const bool pair = b + 1 < blocks;
    Chunk u[2];
    v16 scale[2];
    const uint8_t* rows[2] = {row0, row1};
    float* coefs[2] = {coef0, coef1};
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) {
      const uint8_t* first = rows[j] + b * bytes;
      prefetch_ahead(first, 2 * bytes);
      const uint8_t* second = pair ? first + bytes : nullptr;
      scale[j] = pair_scales(first, second);
      coefs[j][k / 16] = coefs[j][k / 16 + 1] = block32_coef(FORMAT, first, scale[j][0]);
      coefs[j][k / 16 + 2] = coefs[j][k / 16 + 3] = pair ? block32_coef(FORMAT, second, scale[j][8]) : 0.0f;
      u[j] = join_chunk(block32_values<FORMAT>(first), pair ? block32_values<FORMAT>(second) : _mm256_setzero_si256());
    }
#pragma GCC unroll 16
    for (int i = 0; i < NUM_X; ++i) {
      const Chunk x = load_chunk(q + i * Kp + k);
      const v16 xs = load16(x_scale + i * (Kp / 4) + k / 4);
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) acc[i][j] = fmadd(convert<v16>(chunk_dot<FORMAT>(u[j], x)), scale[j] * xs, acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NUM_X; ++i) {
    y[i * N] = horizontal_sum(acc[i][0]) + coefficient_sum(coef0, x_sum + i * (Kp / 16), Kp / 16);
    y[i * N + 1] = horizontal_sum(acc[i][1]) + coefficient_sum(coef1, x_sum + i * (Kp / 16), Kp / 16);
  }
}

template <int64_t FORMAT, int NUM_X = FUSED_ROWS_OF_X_BLOCK32>
void block32_pair_rows(int64_t rows, const Activations& a, int64_t m, const uint8_t* row0, const uint8_t* row1,
                       float* coef0, float* coef1, float* y, int64_t K, int64_t Kp, int64_t N) {
  if constexpr (NUM_X > 1) {
    if (rows < NUM_X) return block32_pair_rows<FORMAT, NUM_X - 1>(rows, a, m, row0, row1, coef0, coef1, y, K, Kp, N);
  }
  block32_decode_pair<FORMAT, NUM_X>(a.q.data() + m * Kp, a.scale.data() + m * (Kp / 4), a.sum.data() + m * (Kp / 16),
                                     row0, row1, coef0, coef1, y, K, Kp, N);
}

template <int64_t FORMAT, int NUM_X = FUSED_ROWS_OF_X_BLOCK32>
void block32_rows(int64_t rows, const Activations& a, int64_t m, const uint8_t* row, float* coef, float* y, int64_t K,
                  int64_t Kp, int64_t N) {
  if constexpr (NUM_X > 1) {
    if (rows < NUM_X) return block32_rows<FORMAT, NUM_X - 1>(rows, a, m, row, coef, y, K, Kp, N);
  }
  block32_decode<FORMAT, NUM_X>(a.q.data() + m * Kp, a.scale.data() + m * (Kp / 4), a.sum.data() + m * (Kp / 16), row,
                                coef, y, K, Kp, N);
}

template <int64_t FORMAT>
void block32_product(const Activations& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t M, int64_t K,
                     int64_t Kp, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float* coef = thread_scratch<float>(2 * (Kp / 16));
    int64_t n = n0;
    for (; n + 1 < n1; n += 2)  // two weight rows at a time, up to 8 rows of x each
      for (int64_t m = 0; m < M; m += FUSED_ROWS_OF_X_BLOCK32)
        block32_pair_rows<FORMAT>(std::min<int64_t>(FUSED_ROWS_OF_X_BLOCK32, M - m), a, m, w + n * row_bytes,
                                  w + (n + 1) * row_bytes, coef, coef + Kp / 16, out + m * N + n, K, Kp, N);
    for (; n < n1; ++n)  // an odd last row
      for (int64_t m = 0; m < M; m += FUSED_ROWS_OF_X_BLOCK32)
        block32_rows<FORMAT>(std::min<int64_t>(FUSED_ROWS_OF_X_BLOCK32, M - m), a, m, w + n * row_bytes, coef,
                             out + m * N + n, K, Kp, N);
  });
}

// A decode or verify step on 32-weight blocks; false where this build has no such kernel.
bool block32_fused(const Activations& a, int64_t format, const uint8_t* w, int64_t row_bytes, float* out, int64_t M,
                   int64_t K, int64_t Kp, int64_t N) {
  switch (format) {
    case Q4_0: block32_product<Q4_0>(a, w, row_bytes, out, M, K, Kp, N); return true;
    case Q4_1: block32_product<Q4_1>(a, w, row_bytes, out, M, K, Kp, N); return true;
    case Q5_0: block32_product<Q5_0>(a, w, row_bytes, out, M, K, Kp, N); return true;
    case Q5_1: block32_product<Q5_1>(a, w, row_bytes, out, M, K, Kp, N); return true;
    case Q8_0: block32_product<Q8_0>(a, w, row_bytes, out, M, K, Kp, N); return true;
    default: return false;
  }
}
#else
bool block32_fused(const Activations&, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t, int64_t) {
  return false;
}
#endif

// ---- both -----------------------------------------------------------------------------------

constexpr int ROWS_OF_X = 4, ROWS_OF_W = 2;  // 8 int + 8 float accumulators in registers
#if defined(DRAFTWISE_V16_PAIR)
// A tile of x that fits a Zen 2/3 core's 512 KB L2 beside the weight rows (512 KB of it did
// not); not timed apart from the kernel above.
constexpr int64_t X_TILE_BYTES = 256 * 1024;
constexpr int KQUANT_ROWS_OF_X = 6;  // AVX2's kquant_micro: 12 half-width integer sums
#else
constexpr int64_t X_TILE_BYTES = 512 * 1024;
constexpr int KQUANT_ROWS_OF_X = ROWS_OF_X;
#endif

// y[m, n0..n0+NUM_W) for rows m0..m1 of x, in groups of MAX_X.
template <int MAX_X, typename Run>
void every_x(int64_t m0, int64_t m1, Run run) {
  for (int64_t m = m0; m < m1; m += MAX_X) {
    switch (std::min<int64_t>(MAX_X, m1 - m)) {
      case 1: run(std::integral_constant<int, 1>{}, m); break;
      case 2: run(std::integral_constant<int, 2>{}, m); break;
      case 3: run(std::integral_constant<int, 3>{}, m); break;
      case 4: run(std::integral_constant<int, std::min(4, MAX_X)>{}, m); break;
      case 5: run(std::integral_constant<int, std::min(5, MAX_X)>{}, m); break;
      default: run(std::integral_constant<int, MAX_X>{}, m); break;
    }
  }
}

// A decode or verify step on K-quants: one weight row at a time, unpacked in registers and run
// against up to 9 rows of x (a step of 8 draft tokens plus the last one) while it is there;
// 4 on AVX2, whose 16 registers hold 4 rows' integer sums (two registers each) beside the weights.
constexpr int FUSED_ROWS_OF_X = kVectorRegisters == 32 ? 9 : 4;

template <int NUM_X = FUSED_ROWS_OF_X>
void fused_rows(int64_t rows, RoundedRows x, const float* x_d, int64_t format, const uint8_t* w, float* y,
                int64_t K, int64_t N) {
  if constexpr (NUM_X > 1) {
    if (rows < NUM_X) return fused_rows<NUM_X - 1>(rows, x, x_d, format, w, y, K, N);
  }
#if defined(__AVX512BW__) || defined(DRAFTWISE_V16_PAIR)
  if (format == Q4_K) {
    kquant_decode<Q4_K, NUM_X>(x, x_d, w, y, K, N);
  } else if (format == Q5_K) {
    kquant_decode<Q5_K, NUM_X>(x, x_d, w, y, K, N);
  } else {
    kquant_decode<Q6_K, NUM_X>(x, x_d, w, y, K, N);
  }
#endif
}

void fused_product(const Activations& a, int64_t format, const uint8_t* w, int64_t row_bytes, float* out, int64_t M,
                   int64_t K, int64_t N) {
  // The rows in groups of at most FUSED_ROWS_OF_X, as even as can be (AVX2: 9 rows as 3 + 3 + 3,
  // not 4 + 4 + 1), and dx of every super-block for each group, laid out [group][block][16] so
  // that one vector multiply gives d * dx for all the group's rows.
  const int64_t blocks = K / SUPER, groups = (M + FUSED_ROWS_OF_X - 1) / FUSED_ROWS_OF_X;
  const auto first_row = [&](int64_t g) { return g * M / groups; };
  std::vector<float> x_d(groups * blocks * 16, 0.0f);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t m = first_row(g); m < first_row(g + 1); ++m)
      for (int64_t b = 0; b < blocks; ++b) x_d[(g * blocks + b) * 16 + m - first_row(g)] = a.scale[m * blocks + b];
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t m = first_row(g);
        const RoundedRows xm{a.q.data() + m * K, a.scale.data() + m * blocks, a.sum.data() + m * K / 16,
                             format == Q6_K ? a.q_sum.data() + m * K / 16 : nullptr};
        fused_rows(first_row(g + 1) - m, xm, x_d.data() + g * blocks * 16, format, w + n * row_bytes,
                   out + m * N + n, K, N);
      }
    }
  });
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t K) {
  TORCH_CHECK(has_int8_path(format), say("int8_linear: weight format ", format,
                  " has no int8 path (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K have; others run blocked_linear)"));
  check_weight(weight, format, K);
  check_rows_of_x(x, K, "int8_linear");
  const int64_t M = x.size(0), N = weight.size(0), Kp = is_kquant(format) ? K : padded(K), row_bytes = weight.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const Activations a = round_rows(x.data_ptr<float>(), M, K, Kp, format);

  if (FUSED && is_kquant(format) && M <= FUSED_MAX_ROWS) {
    fused_product(a, format, weight.data_ptr<uint8_t>(), weight.size(1), y.data_ptr<float>(), M, K, N);
    return y;
  }
  if (!is_kquant(format) && M <= FUSED_MAX_ROWS &&
      block32_fused(a, format, weight.data_ptr<uint8_t>(), weight.size(1), y.data_ptr<float>(), M, K, Kp, N)) {
    return y;
  }
  // Each work item unpacks a few weight rows and runs a tile of x's rows against them; a tile
  // of x (about X_TILE_BYTES of rounded rows) stays in L2 while a thread walks the weight rows.
  const int64_t rows_per_item = M <= 16 ? 4 : 16;
  const int64_t weight_items = (N + rows_per_item - 1) / rows_per_item;
  const int64_t rows_of_x = is_kquant(format) ? KQUANT_ROWS_OF_X : ROWS_OF_X;
  const int64_t tile_m =
      even_tile_rows(M, std::clamp<int64_t>((X_TILE_BYTES / Kp) / rows_of_x * rows_of_x, 64, 512), rows_of_x);
  const int64_t items = weight_items * ((M + tile_m - 1) / tile_m);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    uint8_t* u = thread_scratch<uint8_t>(rows_per_item * Kp);
    float* floats = thread_scratch<float>(rows_per_item * (Kp / 4 + Kp / 16));  // scale | coef, or d | coef
    int16_t* sub = thread_scratch<int16_t>(is_kquant(format) ? rows_per_item * (Kp / 2 + Kp / 16) : 0);
    int16_t* offset = is_kquant(format) ? sub + rows_per_item * Kp / 2 : nullptr;  // Q6_K's
    float* scale = floats;
    float* coef = floats + rows_per_item * Kp / 4;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t n0 = item % weight_items * rows_per_item, rows = std::min(rows_per_item, N - n0);
      const int64_t m_begin = item / weight_items * tile_m, m_end = std::min(M, m_begin + tile_m);
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* row = w + (n0 + r) * row_bytes;
        if (is_kquant(format)) {
          unpack_kquant_row(format, row, K, u + r * K, sub + r * K / 2, scale + r * (K / SUPER), coef + r * K / 16,
                            offset + r * K / 16);
        } else {
          std::fill(u + r * Kp + K, u + (r + 1) * Kp, 0);
          std::fill(scale + r * Kp / 4 + K / 4, scale + (r + 1) * Kp / 4, 0.0f);
          std::fill(coef + r * Kp / 16 + K / 16, coef + (r + 1) * Kp / 16, 0.0f);
          unpack_block32_row(format, row, K, u + r * Kp, scale + r * Kp / 4, coef + r * Kp / 16);
        }
      }
      for (int64_t r = 0; r < rows; r += ROWS_OF_W) {
        const auto run_rows = [&](auto num_w, int64_t r0) {
          if (is_kquant(format)) {
            every_x<KQUANT_ROWS_OF_X>(m_begin, m_end, [&](auto num_x, int64_t m) {
              const KquantRows wr{u + r0 * K, sub + r0 * K / 2, scale + r0 * (K / SUPER),
                                  format == Q6_K ? nullptr : coef + r0 * K / 16,
                                  format == Q6_K ? offset + r0 * K / 16 : nullptr};
              const RoundedRows xr{a.q.data() + m * K, a.scale.data() + m * (K / SUPER), a.sum.data() + m * K / 16,
                                   format == Q6_K ? a.q_sum.data() + m * K / 16 : nullptr};
              if (format == Q6_K) {
                kquant_micro<decltype(num_x)::value, decltype(num_w)::value, Q6_K>(xr, wr, out + m * N + n0 + r0, K, N);
              } else {  // Q4_K, Q5_K
                kquant_micro<decltype(num_x)::value, decltype(num_w)::value, Q4_K>(xr, wr, out + m * N + n0 + r0, K, N);
              }
            });
          } else {
            every_x<ROWS_OF_X>(m_begin, m_end, [&](auto num_x, int64_t m) {
              const Block32Rows wr{u + r0 * Kp, scale + r0 * Kp / 4, coef + r0 * Kp / 16};
              const Block32Rows xr{reinterpret_cast<const uint8_t*>(a.q.data()) + m * Kp, a.scale.data() + m * Kp / 4,
                                   a.sum.data() + m * Kp / 16};
              block32_micro<decltype(num_x)::value, decltype(num_w)::value>(xr, wr, out + m * N + n0 + r0, Kp, N);
            });
          }
        };
        if (rows - r >= ROWS_OF_W) {
          run_rows(std::integral_constant<int, ROWS_OF_W>{}, r);
        } else {
          for (int64_t j = r; j < rows; ++j) run_rows(std::integral_constant<int, 1>{}, j);
        }
      }
    }
  });
  return y;
}

bool int8_dot_in_hardware() {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace draftwise
