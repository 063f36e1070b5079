// y = x @ W.T on int16 activations: each row of x rounded to 15 bits (a sign and 14) per 256 columns,
// then exact integer dot products against a K-quant file's blocks (Q4_K, Q5_K, Q6_K: what a
// Q4_K_M or Q5_K_M file holds; Q3_K: a Q3_K_S/M/L file's) and IQ4_XS's.
//
// Why: with float32 activations every 4- or 6-bit weight becomes a float before it is multiplied
// (a conversion and a multiply-add per 8 weights, then the product's own multiply-add), and a CPU
// without AVX-512 BF16 has no cheaper float arithmetic (bf16_linear's runs slower than float32
// there). With 16-bit activations a weight's value times its sub-block's scale is an exact int16,
// and one instruction (AVX2's vpmaddwd) multiplies 16 of them by 16 activations and adds them in
// pairs. The price is rounding x, to 15 bits per 256 values (d = amax / 16383): 128 times finer
// than int8_linear's 8 bits, and finer than bfloat16's 8 significant bits for every value above
// 1/64 of its block's largest (linear.py and docs/weight-formats.md state how close).
//
// Per row m of x, weight row n and super-block b (256 columns):
//   w16[c]  = q[c] * scale_j, sub-block j's scale times column c's value (Q4_K: 4 bits times 6,
//             Q5_K: 5 times 6, Q6_K: (q - 32) times a signed 8-bit scale, IQ4_XS: a value in
//             -127..113 times scale - 32, Q3_K: q in -4..3 times scale - 32: |w16| <= 4096)
//   I       = 8 int32 lanes, lane l the sum over the super-block's 16-column groups of
//             w16[c] x16[c] for the group's columns 2l and 2l + 1 (32 products a lane, each at
//             most 4096 * 16383: the sum stays below 2^31, so I is exact)
//   acc     = fmadd(float(I), d_b * dx_b, acc);  then for Q4_K and Q5_K
//   acc     = fmadd(coef_b, sum_b, acc)   coef_b[j] = -dmin * min_j, sum_b[j] = dx_b * the sum of
//             x16 over sub-block j
// (8 float lanes, from zero), and y[m, n] = horizontal_sum(acc).
//
// Batch invariance: y[m, n] is that arithmetic in that order whatever the number of rows of x
// and however threads share the work: the decode path below multiplies each weight in registers
// as it unpacks it, the tile path unpacks rows of weights into int16 first, and both give every
// lane the same integer (integer sums are exact in any order), then the same float steps. The
// portable loops compute the same integers as the AVX2 ones.
#include "blocks.h"
#include "kernels.h"
#include "message.h"
#include "tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace draftwise {
namespace {

constexpr int64_t SUPER = 256;   // columns of a super-block, and of an activation block
constexpr float X_LIMIT = 16383.0f;  // |x16| at most this: 32 products of |w16| <= 4096 fit an int32 lane
// Rows of x a decode or verify step multiplies in registers, in groups of at most DECODE_GROUP;
// more go through the tile path. Qwen2.5-Coder-1.5B's matrices at 9 rows (kernel_cost.py, AMD EPYC
// Zen 3, 2 threads): gate 2919 / down 2826 / lm_head 41030 us in groups against 3638 / 3737 /
// 53604 on the tiles; at 16 rows the tiles were faster (gate 5865 against 6237 us). With AVX-512
// VNNI's 32 registers a group takes 12 rows, and groups beat the tiles up to 24 (Intel Xeon with
// AMX, family 6 model 167, 2 threads, the 1.5B's forwards side by side: 9 rows as one group 139
// against 184 ms as 5 + 4; 20 / 24 rows 367 / 437 against 431 / 491 ms on the tiles; 32 rows in
// three groups 662 against 613).
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int64_t DECODE_MAX_ROWS = 24;
constexpr int DECODE_GROUP = 12;
#else
constexpr int64_t DECODE_MAX_ROWS = 12;
constexpr int DECODE_GROUP = 8;
#endif
constexpr int64_t TILE_ROWS_OF_W = 16;  // weight rows a work item of the tile path unpacks
constexpr int64_t TILE_COLUMNS = 512;   // columns of a tile step: its x and weight rows stay in L1

// Formats whose super-block is 16 groups of 16 columns, each an int8 scale times int8 values, no
// mins: Q6_K (q - 32, 16 scales), Q3_K (q in -4..3, 16 six-bit scales less 32) and IQ4_XS (its
// table's values; a 32-column sub-block's scale less 32 in both of its groups).
constexpr bool scaled_groups(int64_t format) { return format == Q6_K || format == Q3_K || format == IQ4_XS; }
constexpr bool has_min(int64_t format) { return !scaled_groups(format); }

// Where a Q6_K or Q3_K super-block keeps its float16 d (IQ4_XS: at 0).
constexpr int64_t group_d_at(int64_t format) { return format == Q6_K ? 208 : 108; }

// A scaled-groups super-block's 16 group scales; returns its d.
inline float group_scales(int64_t format, const uint8_t* block, int8_t* scales) {
  if (format == Q6_K) {
    std::memcpy(scales, block + 192, 16);
    return half_value(block + group_d_at(format));
  }
  if (format == Q3_K) {
    Blocks<Q3_K>::scales(block, scales);
    return half_value(block + group_d_at(format));
  }
  Blocks<IQ4_XS>::scales(block, scales);
  return half_value(block);
}
// A Q6_K or Q3_K super-block's 16 int8 group scales for the register unpacks: Q6_K's read
// straight from the block (through a stack copy its decode ran different instructions: 813eb69),
// Q3_K's unpacked into `unpacked` first.
template <int64_t FORMAT>
DRAFTWISE_ALWAYS_INLINE const int8_t* group_scale_bytes(const uint8_t* block, int8_t* unpacked) {
  if constexpr (FORMAT == Q6_K) {
    return reinterpret_cast<const int8_t*>(block + 192);
  } else {
    Blocks<Q3_K>::scales(block, unpacked);
    return unpacked;
  }
}
// Half h (128 columns) of a scaled-groups super-block -> its 128 int8 values.
inline void group_values(int64_t format, const uint8_t* block, int half, int8_t* q) {
  if (format == Q6_K)
    Blocks<Q6_K>::values(block, half, q);
  else if (format == Q3_K)
    Blocks<Q3_K>::values(block, half, q);
  else
    Blocks<IQ4_XS>::values(block, half, q);
}

// ---- activations ----------------------------------------------------------------------------

struct Rounded16 {  // M rows of x, K columns
  std::vector<int16_t> q;  // [M, K]: round(x / d), |q| <= 16383
  std::vector<float> d;    // [M, K / 256]: amax / 16383 per block
  std::vector<float> sum;  // [M, K / 32]: d * the sum of q over each 32 columns (a Q4_K sub-block)
};

// One row: per 256 columns d = amax / 16383, q = x * (16383 / amax) rounded to the nearest integer
// (ties to even; no fused multiply-add, so the rounding is the float32 product's).
void round_row16(const float* x, int64_t K, int16_t* q, float* d_out, float* sum) {
  for (int64_t b = 0; b < K / SUPER; ++b, x += SUPER, q += SUPER, sum += SUPER / 32) {
    const float top = largest_magnitude(x, SUPER);
    const float d = top / X_LIMIT, inverse = top > 0.0f ? X_LIMIT / top : 0.0f;
    d_out[b] = d;
    for (int64_t k = 0; k < SUPER; k += 32) {
      int total = 0;
      for (int64_t c = k; c < k + 32; ++c) {
        const float r = std::clamp(__builtin_rintf(x[c] * inverse), -X_LIMIT, X_LIMIT);
        q[c] = int16_t(r);
        total += q[c];
      }
      sum[k / 32] = d * float(total);
    }
  }
}

Rounded16 round_rows16(const float* x, int64_t M, int64_t K) {
  Rounded16 a{std::vector<int16_t>(M * K), std::vector<float>(M * K / SUPER), std::vector<float>(M * K / 32)};
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      round_row16(x + m * K, K, a.q.data() + m * K, a.d.data() + m * K / SUPER, a.sum.data() + m * K / 32);
  });
  return a;
}

// ---- a super-block's scales -----------------------------------------------------------------

struct Scales {
  uint8_t scale[16];  // Q4_K, Q5_K: 8 six-bit scales then 8 six-bit mins; Q6_K, IQ4_XS: 16 int8 scales
  float d;            // the super-block's float16 scale
  float coef[8];      // Q4_K, Q5_K: -dmin * min_j
};

#if defined(__AVX2__)
// Q4_K's and Q5_K's coefficients -dmin * min_j from q4k_scales_register's bytes (mins at 8..15).
inline __m256 q4k_coefficients(__m128i packed, float dmin) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))), _mm256_set1_ps(-dmin));
}
#endif

inline Scales scales_of(int64_t format, const uint8_t* block) {
  Scales s;
  if (scaled_groups(format)) {
    s.d = group_scales(format, block, reinterpret_cast<int8_t*>(s.scale));
    std::fill(s.coef, s.coef + 8, 0.0f);
  } else {
    s.d = half_value(block);
    const float dmin = half_value(block + 2);
#if defined(__AVX2__)
    const __m128i packed = q4k_scales_register(block + 4);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(s.scale), packed);
    _mm256_storeu_ps(s.coef, q4k_coefficients(packed, dmin));
#else
    q4k_scales(block + 4, s.scale);
    for (int j = 0; j < 8; ++j) s.coef[j] = float(s.scale[8 + j]) * -dmin;
#endif
  }
  return s;
}

#if defined(__AVX2__)
// Q4_K's sub-blocks 2 pair and 2 pair + 1 (columns 64 pair .. 64 pair + 63) as four vectors of
// 16 w16 in column order: one load of their 32 bytes of nibbles; scale_low and scale_high hold
// the two sub-blocks' scales in every int16 lane.
inline void q4k_pair(const uint8_t* block, int pair, __m256i scale_low, __m256i scale_high, __m256i (&w)[4]) {
  // Each 16 bytes widened to int16 lanes as they are loaded: the low nibble is then a mask away,
  // the high one a shift (three instructions a 32 weights; bytes first took 4.5).
  const __m256i mask = _mm256_set1_epi16(15);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* nibbles = block + 16 + 32 * pair + 16 * half;
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles)));
    w[half] = _mm256_mullo_epi16(_mm256_and_si256(bytes, mask), scale_low);
    w[2 + half] = _mm256_mullo_epi16(_mm256_srli_epi16(bytes, 4), scale_high);
  }
}
// Q5_K's sub-blocks 2 pair and 2 pair + 1 as q4k_pair's four vectors: Q4_K's nibbles (from byte
// 48) with each value's fifth bit put above them. fifth[half] holds qh's 16 bytes of that half
// (columns 16 half .. 16 half + 15 of every sub-block) widened to int16 and shifted left by 4, so
// sub-block j's bit of column l sits at bit 4 + j of lane l, and a shift right by j and a mask
// bring it to bit 4.
inline void q5k_pair(const uint8_t* block, int pair, const __m256i (&fifth)[2], __m256i scale_low, __m256i scale_high,
                     __m256i (&w)[4]) {
  const __m256i mask = _mm256_set1_epi16(15), bit = _mm256_set1_epi16(16);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* nibbles = block + nibbles_at(Q5_K) + 32 * pair + 16 * half;
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles)));
    const __m256i low = _mm256_or_si256(_mm256_and_si256(bytes, mask),
                                        _mm256_and_si256(_mm256_srli_epi16(fifth[half], 2 * pair), bit));
    const __m256i high = _mm256_or_si256(_mm256_srli_epi16(bytes, 4),
                                         _mm256_and_si256(_mm256_srli_epi16(fifth[half], 2 * pair + 1), bit));
    w[half] = _mm256_mullo_epi16(low, scale_low);
    w[2 + half] = _mm256_mullo_epi16(high, scale_high);
  }
}
// Q5_K's qh (32 bytes from byte 16) as q5k_pair's fifth: each half widened and shifted left by 4.
inline void q5k_fifth_bits(const uint8_t* block, __m256i (&fifth)[2]) {
  for (int half = 0; half < 2; ++half)
    fifth[half] = _mm256_slli_epi16(
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 + 16 * half))), 4);
}
// Q6_K's 16-column group g of a half, from values()'s int8 q - 32 and the group's scale in every
// int16 lane: 16 w16.
inline __m256i q6k_group(const int8_t* values, int g, __m256i scale) {
  const __m256i q = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(values + 16 * g)));
  return _mm256_mullo_epi16(q, scale);
}
#endif

// Super-block `block` -> its 256 w16 values in column order.
inline void unpack_block(int64_t format, const uint8_t* block, const Scales& s, int16_t* w) {
  if (scaled_groups(format)) {
    alignas(64) int8_t q[128];
    for (int half = 0; half < 2; ++half) {
      group_values(format, block, half, q);
#if defined(__AVX2__)
      for (int g = 0; g < 8; ++g)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 128 * half + 16 * g),
                            q6k_group(q, g, _mm256_set1_epi16(int8_t(s.scale[8 * half + g]))));
#else
      for (int c = 0; c < 128; ++c) w[128 * half + c] = int16_t(q[c] * int8_t(s.scale[8 * half + c / 16]));
#endif
    }
    return;
  }
#if defined(__AVX2__)
  if (format == Q4_K || format == Q5_K) {
    __m256i fifth[2];
    if (format == Q5_K) q5k_fifth_bits(block, fifth);
    for (int pair = 0; pair < 4; ++pair) {
      __m256i values[4];
      const __m256i low = _mm256_set1_epi16(s.scale[2 * pair]), high = _mm256_set1_epi16(s.scale[2 * pair + 1]);
      if (format == Q5_K)
        q5k_pair(block, pair, fifth, low, high, values);
      else
        q4k_pair(block, pair, low, high, values);
      for (int v = 0; v < 4; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 64 * pair + 16 * v), values[v]);
    }
    return;
  }
#endif
  alignas(64) uint8_t q[SUPER];
  kquant_values(format, block, q);
  for (int c = 0; c < SUPER; ++c) w[c] = int16_t(q[c] * s.scale[c / 32]);
}

// ---- the float steps every path shares --------------------------------------------------------

// acc = fmadd(float(lanes), d * dx, acc), then the sub-blocks' mins where the format has them.
inline v8 finish_block(v8 acc, vi8 lanes, float d, float dx, const float* coef, const float* sum, bool min) {
  acc = fmadd(__builtin_convertvector(lanes, v8), v8{} + d * dx, acc);
  if (min) {
    v8 c, s;
    std::memcpy(&c, coef, sizeof c);
    std::memcpy(&s, sum, sizeof s);
    acc = fmadd(c, s, acc);
  }
  return acc;
}

// 16 w16 as one value: a register where AVX2 has one.
#if defined(__AVX2__)
using W16 = __m256i;
inline W16 load_w16(const int16_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
#else
struct W16 { int16_t v[16]; };
inline W16 load_w16(const int16_t* w) {
  W16 out;
  std::memcpy(out.v, w, sizeof out.v);
  return out;
}
#endif

// lanes += the pairwise products of 16 w16 and 16 x16 (lane l: columns 2l and 2l + 1).
inline vi8 multiply_add(vi8 lanes, W16 w, const int16_t* x) {
#if defined(__AVX2__)
  return lanes + (vi8)_mm256_madd_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
#else
  for (int l = 0; l < 8; ++l) lanes[l] += int32_t(w.v[2 * l]) * x[2 * l] + int32_t(w.v[2 * l + 1]) * x[2 * l + 1];
  return lanes;
#endif
}

// ---- the decode path: a few rows of x, each super-block's weights multiplied as they are unpacked

// y[(m + i) * N] for NUM_X rows of x against one weight row: each super-block unpacked into L1
// (unpack_block) and multiplied at once. Any format, any CPU.
template <int NUM_X>
void decode_row(const Rounded16& a, int64_t m, int64_t format, const uint8_t* row, float* y, int64_t K, int64_t N) {
  const int64_t blocks = K / SUPER, block_bytes = layout(format).bytes;
  const bool min = has_min(format);
  v8 acc[NUM_X] = {};
  alignas(64) int16_t w[SUPER];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * block_bytes;
    const Scales s = scales_of(format, block);
    unpack_block(format, block, s, w);
    vi8 lanes[NUM_X] = {};
    for (int64_t k = 0; k < SUPER; k += 16)
      for (int i = 0; i < NUM_X; ++i)
        lanes[i] = multiply_add(lanes[i], load_w16(w + k), a.q.data() + (m + i) * K + b * SUPER + k);
    for (int i = 0; i < NUM_X; ++i)
      acc[i] = finish_block(acc[i], lanes[i], s.d, a.d[(m + i) * blocks + b], s.coef,
                            a.sum.data() + (m + i) * K / 32 + b * 8, min);
  }
  for (int i = 0; i < NUM_X; ++i) y[(m + i) * N] = horizontal_sum(acc[i]);
}

#if defined(__AVX2__)
// Lane `lane` (0..7) of a vector of 8 int16 scales held twice (both 128-bit halves), in all 16 lanes.
inline __m256i broadcast_scale(__m256i scales_twice, int lane) {
  return _mm256_shuffle_epi8(scales_twice, _mm256_set1_epi16(int16_t((2 * lane + 1) << 8 | 2 * lane)));
}

// The weights of a Q4_K, Q5_K, Q6_K, Q3_K or IQ4_XS super-block as int16 vectors, for decode_row_vector: AVX2's
// 16 a register (vpmaddwd, then vpaddd) and AVX-512 VNNI's 32 (vpdpwssd). `unpack` calls add(k, w)
// for each vector w of columns k.. of the block, fills Q4_K's and Q5_K's coefficients, and returns d.

struct Avx2Words {
  using Lanes = __m256i;
  static DRAFTWISE_ALWAYS_INLINE Lanes zero() { return _mm256_setzero_si256(); }
  static DRAFTWISE_ALWAYS_INLINE Lanes multiply_add(Lanes lanes, Lanes w, const int16_t* x) {
    return _mm256_add_epi32(lanes, _mm256_madd_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
  }
  static DRAFTWISE_ALWAYS_INLINE vi8 fold(Lanes lanes) { return (vi8)lanes; }

  template <int64_t FORMAT, class Add>
  static DRAFTWISE_ALWAYS_INLINE float unpack(const uint8_t* block, float* coef, Add&& add) {
    if constexpr (FORMAT == Q4_K || FORMAT == Q5_K) {
      const __m128i packed = q4k_scales_register(block + 4);  // scales 0..7, mins 8..15
      const __m256i scales = _mm256_cvtepu8_epi16(packed);
      const __m256i scales_twice = _mm256_permute2x128_si256(scales, scales, 0x00);
      __m256i fifth[2];
      if constexpr (FORMAT == Q5_K) q5k_fifth_bits(block, fifth);
#pragma GCC unroll 4
      for (int pair = 0; pair < 4; ++pair) {
        __m256i values[4];
        const __m256i low = broadcast_scale(scales_twice, 2 * pair), high = broadcast_scale(scales_twice, 2 * pair + 1);
        if constexpr (FORMAT == Q5_K)
          q5k_pair(block, pair, fifth, low, high, values);
        else
          q4k_pair(block, pair, low, high, values);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) add(64 * pair + 16 * v, values[v]);
      }
      _mm256_store_ps(coef, q4k_coefficients(packed, half_value(block + 2)));
      return half_value(block);
    } else if constexpr (FORMAT == IQ4_XS) {  // every value in a register, no pass through memory
      alignas(16) int8_t group_scale[16];  // sub-block j's scale at 2 j (and 2 j + 1)
      const float d = group_scales(FORMAT, block, group_scale);
#pragma GCC unroll 4
      for (int pair = 0; pair < 4; ++pair) {
        __m256i low, high;  // sub-blocks 2 pair and 2 pair + 1
        iq4_pair_values(block + 8 + 32 * pair, low, high);
#pragma GCC unroll 2
        for (int t = 0; t < 2; ++t) {
          const __m256i scale = _mm256_set1_epi16(group_scale[2 * (2 * pair + t)]);
          const auto lane = [&](__m256i v) { return t == 0 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1); };
          add(64 * pair + 32 * t, _mm256_mullo_epi16(_mm256_cvtepi8_epi16(lane(low)), scale));
          add(64 * pair + 32 * t + 16, _mm256_mullo_epi16(_mm256_cvtepi8_epi16(lane(high)), scale));
        }
      }
      return d;
    } else {  // Q6_K, Q3_K: 16 int8 group scales (Q6_K's in the block, Q3_K's unpacked first)
      alignas(16) int8_t unpacked[16];
      const int8_t* scale_bytes = group_scale_bytes<FORMAT>(block, unpacked);
      const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale_bytes)));
      const __m256i halves[2] = {_mm256_permute2x128_si256(scales, scales, 0x00),
                                 _mm256_permute2x128_si256(scales, scales, 0x11)};
      alignas(64) int8_t q[128];
      for (int half = 0; half < 2; ++half) {
        Blocks<FORMAT>::values(block, half, q);
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g) add(128 * half + 16 * g, q6k_group(q, g, broadcast_scale(halves[half], g)));
      }
      return half_value(block + group_d_at(FORMAT));
    }
  }
};

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// On 512-bit registers with AVX-512 VNNI a register holds 32 w16, one Q4_K sub-block (or two of
// Q6_K's 16-column groups), and vpdpwssd multiplies and adds in one instruction what AVX2 does in
// two. Lane l of a register sums columns 2l and 2l + 1 of each 32-column group; its two halves
// added (lanes l and l + 8) are AVX2's lane l, columns 2l and 2l + 1 of each 16-column group: the
// same exact integers, then the same float steps.
inline vi8 folded(__m512i lanes) {
  return (vi8)_mm256_add_epi32(_mm512_castsi512_si256(lanes), _mm512_extracti64x4_epi64(lanes, 1));
}

struct Avx512Words {
  using Lanes = __m512i;
  static DRAFTWISE_ALWAYS_INLINE Lanes zero() { return _mm512_setzero_si512(); }
  static DRAFTWISE_ALWAYS_INLINE Lanes multiply_add(Lanes lanes, Lanes w, const int16_t* x) {
    return _mm512_dpwssd_epi32(lanes, w, _mm512_loadu_si512(x));
  }
  static DRAFTWISE_ALWAYS_INLINE vi8 fold(Lanes lanes) { return folded(lanes); }

  template <int64_t FORMAT, class Add>
  static DRAFTWISE_ALWAYS_INLINE float unpack(const uint8_t* block, float* coef, Add&& add) {
    if constexpr (FORMAT == Q4_K || FORMAT == Q5_K) {
      const __m128i packed = q4k_scales_register(block + 4);  // scales 0..7, mins 8..15
      // the 8 scales as int16 in every 128-bit quarter; a byte shuffle puts scale j in all lanes
      const __m512i scales = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(packed));
      const __m512i mask = _mm512_set1_epi16(15);
      // Q5_K: qh's 32 bytes widened and shifted left by 4, sub-block j's fifth bits at bit 4 + j
      // (q5k_pair's, 32 columns a register)
      __m512i fifth = _mm512_setzero_si512();
      if constexpr (FORMAT == Q5_K)
        fifth = _mm512_slli_epi16(
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16))), 4);
#pragma GCC unroll 4
      for (int pair = 0; pair < 4; ++pair) {
        // sub-blocks 2 pair and 2 pair + 1: the low and the high nibbles of the same 32 bytes
        const __m512i bytes = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + nibbles_at(FORMAT) + 32 * pair)));
        const auto scale = [&](int j) {
          return _mm512_shuffle_epi8(scales, _mm512_set1_epi16(int16_t((2 * j + 1) << 8 | 2 * j)));
        };
        __m512i low = _mm512_and_si512(bytes, mask), high = _mm512_srli_epi16(bytes, 4);
        if constexpr (FORMAT == Q5_K) {
          const __m512i bit = _mm512_set1_epi16(16);
          low = _mm512_or_si512(low, _mm512_and_si512(_mm512_srli_epi16(fifth, 2 * pair), bit));
          high = _mm512_or_si512(high, _mm512_and_si512(_mm512_srli_epi16(fifth, 2 * pair + 1), bit));
        }
        add(64 * pair, _mm512_mullo_epi16(low, scale(2 * pair)));
        add(64 * pair + 32, _mm512_mullo_epi16(high, scale(2 * pair + 1)));
      }
      _mm256_store_ps(coef, q4k_coefficients(packed, half_value(block + 2)));
      return half_value(block);
    } else if constexpr (FORMAT == IQ4_XS) {  // a sub-block a register, no pass through memory
      alignas(16) int8_t group_scale[16];  // sub-block j's scale at 2 j (and 2 j + 1)
      const float d = group_scales(FORMAT, block, group_scale);
#pragma GCC unroll 4
      for (int pair = 0; pair < 4; ++pair) {
        __m256i low, high;  // sub-blocks 2 pair and 2 pair + 1
        iq4_pair_values(block + 8 + 32 * pair, low, high);
        add(64 * pair, _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm256_permute2x128_si256(low, high, 0x20)),
                                          _mm512_set1_epi16(group_scale[4 * pair])));
        add(64 * pair + 32, _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm256_permute2x128_si256(low, high, 0x31)),
                                               _mm512_set1_epi16(group_scale[4 * pair + 2])));
      }
      return d;
    } else {  // Q6_K, Q3_K: 16 int8 group scales (Q6_K's in the block, Q3_K's unpacked first)
      alignas(16) int8_t unpacked[16];
      const __m128i scale_bytes =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(group_scale_bytes<FORMAT>(block, unpacked)));
      alignas(64) int8_t q[128];
      for (int half = 0; half < 2; ++half) {
        // this half's 8 scales as int16 in every 128-bit quarter
        const __m512i half_scales =
            _mm512_broadcast_i32x4(_mm_cvtepi8_epi16(half == 0 ? scale_bytes : _mm_srli_si128(scale_bytes, 8)));
        Blocks<FORMAT>::values(block, half, q);
#pragma GCC unroll 4
        for (int g = 0; g < 8; g += 2) {
          // groups g and g + 1: scale g in the low 256 bits, scale g + 1 in the high
          const auto lane = [](int j) { return int16_t((2 * j + 1) << 8 | 2 * j); };  // int16 lane j's two bytes
          const __m512i pick = _mm512_inserti64x4(_mm512_set1_epi16(lane(g)), _mm256_set1_epi16(lane(g + 1)), 1);
          const __m512i values = _mm512_cvtepi8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(q + 16 * g)));
          add(128 * half + 16 * g, _mm512_mullo_epi16(values, _mm512_shuffle_epi8(half_scales, pick)));
        }
      }
      return half_value(block + group_d_at(FORMAT));
    }
  }
};
using DecodeWords = Avx512Words;
#else
using DecodeWords = Avx2Words;
#endif

// decode_row for Q4_K, Q5_K, Q6_K, Q3_K and IQ4_XS with every value in a register: the block's scales broadcast from
// a register (a byte shuffle each) instead of through the stack, the weights multiplied as they
// are unpacked (Words::unpack: unpack_block's values), the sums named. The same integers as
// decode_row's, and the same float steps (scales_of's d and coefficients, computed alike): perf
// showed decode_row's sums and scales spilled to the stack on AVX2.
template <int64_t FORMAT, int NUM_X, class Words>
void decode_row_vector(const Rounded16& a, int64_t m, const uint8_t* row, float* y, int64_t K, int64_t N) {
  const int64_t blocks = K / SUPER;
  const int16_t* x[NUM_X];
  const float* dx[NUM_X];
  const float* sum[NUM_X];
  v8 acc[NUM_X];
  for (int i = 0; i < NUM_X; ++i) {
    x[i] = a.q.data() + (m + i) * K;
    dx[i] = a.d.data() + (m + i) * blocks;
    sum[i] = a.sum.data() + (m + i) * K / 32;
    acc[i] = v8{};
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * Blocks<FORMAT>::BYTES;
    prefetch_ahead(block, Blocks<FORMAT>::BYTES);
    typename Words::Lanes lanes[NUM_X];
    for (int i = 0; i < NUM_X; ++i) lanes[i] = Words::zero();
    // fully unrolled for every group size (an `unroll 8` left groups of 9-12 rows in memory)
    const auto add = [&](int64_t k, typename Words::Lanes w16) DRAFTWISE_INLINE_LAMBDA {
#pragma GCC unroll 16
      for (int i = 0; i < NUM_X; ++i) lanes[i] = Words::multiply_add(lanes[i], w16, x[i] + b * SUPER + k);
    };
    alignas(32) float coef[8] = {};
    const float d = Words::template unpack<FORMAT>(block, coef, add);
#pragma GCC unroll 16
    for (int i = 0; i < NUM_X; ++i)
      acc[i] = finish_block(acc[i], Words::fold(lanes[i]), d, dx[i][b], coef, sum[i] + b * 8, has_min(FORMAT));
  }
  for (int i = 0; i < NUM_X; ++i) y[(m + i) * N] = horizontal_sum(acc[i]);
}
#endif

// Rows of x in even groups of at most DECODE_GROUP (9 -> 5 + 4): each group meets every weight
// row once, its super-blocks unpacked in registers for all the group's rows.
template <int NUM_X = DECODE_GROUP>
void decode_group(int64_t rows, const Rounded16& a, int64_t m, int64_t format, const uint8_t* row, float* y, int64_t K,
                  int64_t N) {
  if constexpr (NUM_X > 1) {
    if (rows < NUM_X) return decode_group<NUM_X - 1>(rows, a, m, format, row, y, K, N);
  }
#if defined(__AVX2__)
  if (format == Q4_K) return decode_row_vector<Q4_K, NUM_X, DecodeWords>(a, m, row, y, K, N);
  if (format == Q5_K) return decode_row_vector<Q5_K, NUM_X, DecodeWords>(a, m, row, y, K, N);
  if (format == Q6_K) return decode_row_vector<Q6_K, NUM_X, DecodeWords>(a, m, row, y, K, N);
  if (format == Q3_K) return decode_row_vector<Q3_K, NUM_X, DecodeWords>(a, m, row, y, K, N);
  if (format == IQ4_XS) return decode_row_vector<IQ4_XS, NUM_X, DecodeWords>(a, m, row, y, K, N);
#endif
  decode_row<NUM_X>(a, m, format, row, y, K, N);
}

void decode_product(const Rounded16& a, int64_t format, const uint8_t* w, int64_t row_bytes, float* y, int64_t M,
                    int64_t K, int64_t N) {
  const int64_t groups = (M + DECODE_GROUP - 1) / DECODE_GROUP, per_group = (M + groups - 1) / groups;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; m += per_group)
        decode_group(std::min(per_group, M - m), a, m, format, w + n * row_bytes, y + n, K, N);
  });
}

// ---- the tile path: weight rows unpacked into int16 first ------------------------------------

struct Unpacked {  // rows of weights as w16, with their super-blocks' d and coefficients
  int16_t* w;      // [rows, K]
  float* d;        // [rows, K / 256]
  float* coef;     // [rows, K / 32]
};

void unpack_rows(int64_t format, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K, const Unpacked& out) {
  const int64_t blocks = K / SUPER, block_bytes = layout(format).bytes;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = w + r * row_bytes + b * block_bytes;
      const Scales s = scales_of(format, block);
      unpack_block(format, block, s, out.w + r * K + b * SUPER);
      out.d[r * blocks + b] = s.d;
      std::copy(s.coef, s.coef + 8, out.coef + r * K / 32 + b * 8);
    }
  }
}

// acc[i][j] over columns [k0, k1) (whole super-blocks) for NUM_X rows of x and NUM_W unpacked
// weight rows; acc lives in `partial` ([i][j] at i * stride + j) between calls.
template <int NUM_X, int NUM_W>
void tile_step(const Rounded16& a, int64_t m, const Unpacked& u, int64_t n, v8* partial, int64_t stride, int64_t k0,
               int64_t k1, int64_t K, bool min) {
  v8 acc[NUM_X][NUM_W];
  for (int i = 0; i < NUM_X; ++i)
    for (int j = 0; j < NUM_W; ++j) acc[i][j] = partial[i * stride + j];
  for (int64_t b = k0 / SUPER; b < k1 / SUPER; ++b) {
    vi8 lanes[NUM_X][NUM_W] = {};
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    // 32 columns a step, lanes folded as Avx512Words::fold: the same integers
    __m512i wide[NUM_X][NUM_W];
    for (int i = 0; i < NUM_X; ++i)
      for (int j = 0; j < NUM_W; ++j) wide[i][j] = _mm512_setzero_si512();
    for (int64_t k = b * SUPER; k < (b + 1) * SUPER; k += 32) {
      __m512i w[NUM_W];
#pragma GCC unroll 4
      for (int j = 0; j < NUM_W; ++j) {
        w[j] = _mm512_loadu_si512(u.w + (n + j) * K + k);
        asm("" : "+v"(w[j]));
      }
#pragma GCC unroll 4
      for (int i = 0; i < NUM_X; ++i) {
        __m512i xs = _mm512_loadu_si512(a.q.data() + (m + i) * K + k);
        asm("" : "+v"(xs));
#pragma GCC unroll 4
        for (int j = 0; j < NUM_W; ++j) wide[i][j] = _mm512_dpwssd_epi32(wide[i][j], w[j], xs);
      }
    }
    for (int i = 0; i < NUM_X; ++i)
      for (int j = 0; j < NUM_W; ++j) lanes[i][j] = folded(wide[i][j]);
#else
    for (int64_t k = b * SUPER; k < (b + 1) * SUPER; k += 16) {
#if defined(__AVX2__)
      // Each weight vector and each x vector loaded once (an empty asm keeps it in its register:
      // left alone GCC reloaded the weights for every row of x, 12 loads to 6 multiplies).
      __m256i w[NUM_W];
#pragma GCC unroll 4
      for (int j = 0; j < NUM_W; ++j) {
        w[j] = load_w16(u.w + (n + j) * K + k);
        asm("" : "+x"(w[j]));
      }
#pragma GCC unroll 4
      for (int i = 0; i < NUM_X; ++i) {
        __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m + i) * K + k));
        asm("" : "+x"(xs));
#pragma GCC unroll 4
        for (int j = 0; j < NUM_W; ++j) lanes[i][j] += (vi8)_mm256_madd_epi16(w[j], xs);
      }
#else
      for (int i = 0; i < NUM_X; ++i)
        for (int j = 0; j < NUM_W; ++j)
          lanes[i][j] = multiply_add(lanes[i][j], load_w16(u.w + (n + j) * K + k), a.q.data() + (m + i) * K + k);
#endif
    }
#endif
    for (int i = 0; i < NUM_X; ++i)
      for (int j = 0; j < NUM_W; ++j)
        acc[i][j] = finish_block(acc[i][j], lanes[i][j], u.d[(n + j) * (K / SUPER) + b], a.d[(m + i) * (K / SUPER) + b],
                                 u.coef + (n + j) * K / 32 + b * 8, a.sum.data() + (m + i) * K / 32 + b * 8, min);
  }
  for (int i = 0; i < NUM_X; ++i)
    for (int j = 0; j < NUM_W; ++j) partial[i * stride + j] = acc[i][j];
}

template <int NUM_W>
void tile_step_rows(int64_t rows, const Rounded16& a, int64_t m, const Unpacked& u, int64_t n, v8* partial,
                    int64_t stride, int64_t k0, int64_t k1, int64_t K, bool min) {
  switch (rows) {
    case 1: return tile_step<1, NUM_W>(a, m, u, n, partial, stride, k0, k1, K, min);
    case 2: return tile_step<2, NUM_W>(a, m, u, n, partial, stride, k0, k1, K, min);
    case 3: return tile_step<3, NUM_W>(a, m, u, n, partial, stride, k0, k1, K, min);
    default: return tile_step<4, NUM_W>(a, m, u, n, partial, stride, k0, k1, K, min);
  }
}

void tile_product(const Rounded16& a, int64_t format, const uint8_t* w, int64_t row_bytes, float* y, int64_t M,
                  int64_t K, int64_t N) {
  constexpr int64_t ROWS_OF_X = 4;  // a 4 x 2 register block (AVX-512: 4 x 4): 8 sums, 2 weight and 1 x vectors
  const int64_t tile_m = even_tile_rows(M, 96, ROWS_OF_X), tiles_m = (M + tile_m - 1) / tile_m;
  const int64_t tiles_n = (N + TILE_ROWS_OF_W - 1) / TILE_ROWS_OF_W;
  const int64_t step = std::min<int64_t>(K, TILE_COLUMNS / SUPER * SUPER);
  const bool min = has_min(format);
  at::parallel_for(0, tiles_m * tiles_n, 1, [&](int64_t t0, int64_t t1) {
    // Per-thread buffers kept between calls: allocated afresh, the 16 unpacked rows (up to 287 KB)
    // came from mmap and were faulted in again on every call.
    static thread_local std::vector<int16_t> w16;
    static thread_local std::vector<float> d, coef;
    static thread_local std::vector<v8> partial;
    w16.resize(std::max<size_t>(w16.size(), TILE_ROWS_OF_W * K));
    d.resize(std::max<size_t>(d.size(), TILE_ROWS_OF_W * K / SUPER));
    coef.resize(std::max<size_t>(coef.size(), TILE_ROWS_OF_W * K / 32));
    partial.resize(std::max<size_t>(partial.size(), tile_m * TILE_ROWS_OF_W));
    const Unpacked u{w16.data(), d.data(), coef.data()};
    for (int64_t t = t0; t < t1; ++t) {
      // Work items walk the weight tiles fastest: a thread unpacks each tile of weights once
      // per tile of x rows.
      const int64_t n0 = t % tiles_n * TILE_ROWS_OF_W, rows_w = std::min(TILE_ROWS_OF_W, N - n0);
      const int64_t m0 = t / tiles_n * tile_m, rows_x = std::min(tile_m, M - m0);
      unpack_rows(format, w + n0 * row_bytes, row_bytes, rows_w, K, u);
      std::fill(partial.begin(), partial.begin() + tile_m * TILE_ROWS_OF_W, v8{});
      for (int64_t k0 = 0; k0 < K; k0 += step) {
        const int64_t k1 = std::min(K, k0 + step);
        for (int64_t i = 0; i < rows_x; i += ROWS_OF_X) {
          const int64_t num_x = std::min(ROWS_OF_X, rows_x - i);
          int64_t j = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
          for (; j + 4 <= rows_w; j += 4)
            tile_step_rows<4>(num_x, a, m0 + i, u, j, partial.data() + i * TILE_ROWS_OF_W + j, TILE_ROWS_OF_W, k0, k1,
                              K, min);
#endif
          for (; j + 2 <= rows_w; j += 2)
            tile_step_rows<2>(num_x, a, m0 + i, u, j, partial.data() + i * TILE_ROWS_OF_W + j, TILE_ROWS_OF_W, k0, k1,
                              K, min);
          for (; j < rows_w; ++j)
            tile_step_rows<1>(num_x, a, m0 + i, u, j, partial.data() + i * TILE_ROWS_OF_W + j, TILE_ROWS_OF_W, k0, k1,
                              K, min);
        }
      }
      for (int64_t i = 0; i < rows_x; ++i)
        for (int64_t j = 0; j < rows_w; ++j) y[(m0 + i) * N + n0 + j] = horizontal_sum(partial[i * TILE_ROWS_OF_W + j]);
    }
  });
}

}  // namespace

bool int16_dot_in_hardware() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

at::Tensor int16_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t K) {
  TORCH_CHECK(is_kquant(format) || format == Q3_K || format == IQ4_XS, say("int16_linear: weight format ", format,
                  " has no int16 path (Q4_K, Q5_K, Q6_K, Q3_K and IQ4_XS have; others run blocked_linear)"));
  check_weight(weight, format, K);
  check_rows_of_x(x, K, "int16_linear");
  const int64_t M = x.size(0), N = weight.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const Rounded16 a = round_rows16(x.data_ptr<float>(), M, K);
  if (M <= DECODE_MAX_ROWS) {
    decode_product(a, format, weight.data_ptr<uint8_t>(), weight.size(1), y.data_ptr<float>(), M, K, N);
    return y;
  }
  tile_product(a, format, weight.data_ptr<uint8_t>(), weight.size(1), y.data_ptr<float>(), M, K, N);
  return y;
}

}  // namespace draftwise
