// GGUF's quantized blocks decoded to float32, 16 weights at a time, in column order.
//
// One definition of every block format's values, used by both float32-activation paths of
// linear.cpp: a decode or verify step multiplies each group of 16 weights into every row of x
// while it is in a register (no float32 copy of the row is written), a prefill stores the
// groups into a dequantised copy (dequantize_row, at the end). Both see the same 16 floats per
// group, so they compute the same products; bf16_linear.cpp rounds the same floats to bfloat16. The values are gguf-py's bit for bit (tests/test_kernels.py): every product
// below is exact in float32 (a float16 scale, times a scale of at most 6 bits, times a
// quantized value of at most 8 bits, needs more than 24 significant bits only for Q6_K's
// product, which is then rounded once as numpy rounds it).
//
// Where the values of a block are at most 4 bits (Q4_0, Q4_1, Q4_K), the 16 possible weights
// of a (sub-)block are computed once into a table and each weight is a table lookup of its
// nibble (one permute instead of a mask, a conversion and a multiply-add): the same float
// for the same nibble, as the formula gives it. (On AVX2 alone every format uses the formula:
// a lookup there takes two permutes and a blend per 8 lanes.)
//
// Blocks<FORMAT>::decode<R>(blocks, use) calls use(g, w) for g = 0, 1, ... (the groups of 16
// columns of a block, in order) with w[r] the group's 16 weights in blocks[r].
#pragma once

#include <type_traits>

#include "formats.h"
#include "lattice.h"
#include "message.h"

// Decoders and the loops they feed are one function to the compiler (its inliner otherwise
// gives up on the larger ones, and the accumulators then live in memory: measured 2x slower).
#define DRAFTWISE_ALWAYS_INLINE inline __attribute__((always_inline))
#define DRAFTWISE_INLINE_LAMBDA __attribute__((always_inline))

namespace draftwise {

// 16 unsigned bytes -> 16 int32 lanes. Spelled with intrinsics where they exist: GCC lowers
// __builtin_convertvector(uint8 x 16 -> int32 x 16) to scalar code (measured: 4x slower).
inline vi16 widen(const uint8_t* p) {
  vi16 out;
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &v, sizeof out);
#elif defined(__AVX2__)
  out = join(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
             _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
#else
  for (int i = 0; i < 16; ++i) out[i] = p[i];
#endif
  return out;
}
// 16 signed bytes -> 16 int32 lanes.
inline vi16 widen_signed(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  vi16 out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#elif defined(__AVX2__)
  return join(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
              _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
#else
  return (widen(reinterpret_cast<const uint8_t*>(p)) ^ 128) - 128;
#endif
}
inline v16 to_float(vi16 v) { return convert<v16>(v); }

// table[q & 15] per lane (only the low 4 bits of each lane of q are read).
inline v16 lookup(v16 table, vi16 q) {
#if defined(__AVX512F__)
  __m512 t;
  __m512i i;
  std::memcpy(&t, &table, sizeof t);
  std::memcpy(&i, &q, sizeof i);
  const __m512 out = _mm512_permutexvar_ps(i, t);
  v16 w;
  std::memcpy(&w, &out, sizeof w);
  return w;
#elif defined(__AVX2__)
  // Two 8-entry permutes (each reads the low 3 bits of an index), then bit 3 of the index (moved
  // to the sign bit) picks the upper table's entry: the same float as table[q & 15].
  const __m256 low = half_of(table, 0), high = half_of(table, 1);
  const auto pick = [&](__m256i i) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, i), _mm256_permutevar8x32_ps(high, i),
                            _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
  };
  return join(pick(half_of(q, 0)), pick(half_of(q, 1)));
#else
  v16 w;
  for (int l = 0; l < 16; ++l) w[l] = table[q[l] & 15];
  return w;
#endif
}

#if defined(DRAFTWISE_V16_PAIR)
inline const v16 kIota = {v8{0, 1, 2, 3, 4, 5, 6, 7}, v8{8, 9, 10, 11, 12, 13, 14, 15}};
inline const vi16 kLanes = {vi8{0, 1, 2, 3, 4, 5, 6, 7}, vi8{8, 9, 10, 11, 12, 13, 14, 15}};
#else
inline const v16 kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
inline const vi16 kLanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#endif

// The float16 at p, as a float32 in all 16 lanes: broadcast from HalfTable's entry, a load
// alone (SmolLM2's one-row Q4_1 products: see HalfTable).
inline v16 splat_half(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_set1_ps(half_value(p));
  v16 out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#elif defined(DRAFTWISE_V16_PAIR) && defined(__AVX__)  // a v16 of two 256-bit halves (join)
  const __m256 half = _mm256_broadcast_ss(&half_value(p));
  return join(half, half);
#else
  return v16{} + half_value(p);
#endif
}

// Q4_K's 12 scale bytes -> 8 six-bit scales (bytes 0..7) and 8 six-bit mins (8..15), as two
// 64-bit words (little-endian: byte i of the 16 is byte i % 8 of word i / 8): scale j < 4 is the
// low 6 bits of byte j, min j < 4 those of byte j + 4; for j >= 4 the low 4 bits come from byte
// j + 4 (scale: low nibble, min: high nibble) and the top 2 bits from the top of byte j - 4
// (scale) or byte j (min). Done on 32-bit words, 4 values at a time.
struct ScaleBytes { uint64_t low, high; };
inline ScaleBytes q4k_scale_bytes(const uint8_t* packed) {
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  const uint32_t scales_low = w[0] & six;                                       // scales 0..3
  const uint32_t scales_high = (w[2] & four) | (((w[0] >> 6) & two) << 4);     // scales 4..7
  const uint32_t mins_low = w[1] & six;                                         // mins 0..3
  const uint32_t mins_high = ((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4);  // mins 4..7
  return {scales_low | uint64_t(scales_high) << 32, mins_low | uint64_t(mins_high) << 32};
}
inline void q4k_scales(const uint8_t* packed, uint8_t* out) {
  const ScaleBytes bytes = q4k_scale_bytes(packed);
  std::memcpy(out, &bytes.low, 8);
  std::memcpy(out + 8, &bytes.high, 8);
}
#if defined(__x86_64__)
// The same 16 bytes in a register, never through memory: a 16-byte load of bytes just written by
// two 8-byte stores cannot take them from the store buffer and waits until both reach the cache
// (perf, Qwen2.5-Coder-1.5B's one-token forward on AMX tiles: 42% of the Q4_K rounding's samples
// on the instruction after that load). With SSSE3, by two byte shuffles of the block's bytes
// instead of q4k_scale_bytes' ~25 scalar instructions: packed must be a block's scale bytes
// (block + 4), as the 16-byte load reads the 4 bytes after them. On AVX2 the scalar unpacking was
// a fifth of a Q4_K one-row product's time (perf, AMD EPYC Zen 3).
inline __m128i q4k_scales_register(const uint8_t* packed) {
#if defined(__SSSE3__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  // Bytes 0..3 scales 0..3 (6 bits), 4..7 scales 4..7's low nibbles (bytes 8..11), 8..11 mins
  // 0..3 (bytes 4..7), 12..15 mins 4..7's low nibbles (the high nibbles of bytes 8..11).
  const __m128i low = _mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  // Scales 4..7 and mins 4..7 take their top two bits from the top of bytes 0..3 and 4..7.
  const __m128i top = _mm_shuffle_epi8(bytes, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i six = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
  const __m128i upper = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
  return _mm_or_si128(_mm_or_si128(_mm_and_si128(low, six), _mm_and_si128(_mm_srli_epi16(low, 4), upper)),
                      _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
#else
  const ScaleBytes bytes = q4k_scale_bytes(packed);
  return _mm_set_epi64x(int64_t(bytes.high), int64_t(bytes.low));
#endif
}
#endif

// A Q4_K block's d * scale_j (out[0..7]) and dmin * min_j (out[8..15]), j = its 8 sub-blocks:
// each sub-block's weights are scale * q - min, so a table of them is one multiply-add with
// broadcast operands.
DRAFTWISE_ALWAYS_INLINE void q4k_scaled(const uint8_t* block, float* out) {
  const v16 d = splat_half(block), dmin = splat_half(block + 2);
#if defined(DRAFTWISE_V16_PAIR)
  const v16 both = {d.lo, dmin.hi};
#else
  const v16 both = __builtin_shufflevector(d, dmin, 0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26, 27, 28, 29, 30, 31);
#endif
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu8_epi32(q4k_scales_register(block + 4));
  vi16 scales;
  std::memcpy(&scales, &wide, sizeof scales);
  store16(out, to_float(scales) * both);
#elif defined(DRAFTWISE_V16_PAIR)
  const __m128i packed = q4k_scales_register(block + 4);
  const vi16 scales = join(_mm256_cvtepu8_epi32(packed), _mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)));
  store16(out, to_float(scales) * both);
#else
  alignas(16) uint8_t scales[16];
  q4k_scales(block + 4, scales);
  store16(out, to_float(widen(scales)) * both);
#endif
}
// Sub-block j's 16 possible weights, from q4k_scaled's out: d * scale_j * q - dmin * min_j for
// q = 0..15 (the product exact, so one rounding, fused or not).
DRAFTWISE_ALWAYS_INLINE v16 q4k_table(const float* scaled, int j) { return fmsub(kIota, scaled[j], scaled[8 + j]); }
// The same for R blocks, left in memory (in_memory): the tables' operands are then broadcasts.
template <int R>
DRAFTWISE_ALWAYS_INLINE void q4k_scaled(const uint8_t* const* block, float (&out)[R][16]) {
  for (int r = 0; r < R; ++r) q4k_scaled(block[r], out[r]);
  in_memory(out);
}

template <int64_t FORMAT>
struct Blocks;

// Each decode below takes R blocks (one per weight row, R a compile-time count) and calls
// use(g, w) with w[r] the 16 weights of group g of block r: the rows advance in step, so a
// caller multiplying several rows keeps several independent sums in flight.

// Q4_0 / Q4_1: d (, m) (float16), 16 bytes of nibbles (the low ones are columns 0..15);
// w = d * (q - 8), or d * q + m.
template <bool WITH_MIN>
struct Blocks4 {
  static constexpr int64_t WEIGHTS = 32, BYTES = WITH_MIN ? 20 : 18;
  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
    v16 w[R];
    vi16 q[R];
    for (int r = 0; r < R; ++r) q[r] = widen(block[r] + (WITH_MIN ? 4 : 2));
#if defined(DRAFTWISE_V16_PAIR)
    // AVX2: each weight by the formula from its nibble (a conversion and a multiply-add per 8
    // lanes), the table entry's own arithmetic, so the same float. The table's 8-lane lookup
    // (two permutes and a blend) made SmolLM2's one-row Q4_1 products 1.3-1.5x slower and its
    // greedy decoding 1.25-1.3x slower (AMD EPYC Zen 3, 2026-11-26).
    v16 d[R], m[R];
    for (int r = 0; r < R; ++r) {
      d[r] = splat_half(block[r]);
      if constexpr (WITH_MIN) m[r] = splat_half(block[r] + 2);
    }
    const auto weights = [&](int r, vi16 nibbles) DRAFTWISE_INLINE_LAMBDA {
      if constexpr (WITH_MIN) return fmadd(d[r], to_float(nibbles), m[r]);
      else return d[r] * to_float(nibbles - 8);
    };
    for (int r = 0; r < R; ++r) w[r] = weights(r, q[r] & 15);
    use(0, w);
    for (int r = 0; r < R; ++r) w[r] = weights(r, q[r] >> 4);
    use(1, w);
#else
    v16 table[R];
    for (int r = 0; r < R; ++r) {
      if constexpr (WITH_MIN) {
        table[r] = fmadd(splat_half(block[r]), kIota, splat_half(block[r] + 2));
      } else {
        table[r] = splat_half(block[r]) * (kIota - 8.0f);
      }
    }
    for (int r = 0; r < R; ++r) w[r] = lookup(table[r], q[r]);
    use(0, w);
    for (int r = 0; r < R; ++r) w[r] = lookup(table[r], q[r] >> 4);
    use(1, w);
#endif
  }
};
template <>
struct Blocks<Q4_0> : Blocks4<false> {};
template <>
struct Blocks<Q4_1> : Blocks4<true> {};

// Q5_0 / Q5_1: d (, m), 32 high bits, 16 bytes of nibbles; w = d * (q - 16) or d * q + m.
template <bool WITH_MIN>
struct Blocks5 {
  static constexpr int64_t WEIGHTS = 32, BYTES = WITH_MIN ? 24 : 22;
  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
    const vi16 lane = kLanes;
    v16 w[2][R];
    for (int r = 0; r < R; ++r) {
      const float d = half_to_float(block[r]);
      uint32_t qh;
      std::memcpy(&qh, block[r] + (WITH_MIN ? 4 : 2), 4);
      const vi16 qs = widen(block[r] + (WITH_MIN ? 8 : 6));
      const vi16 high_bits = vi16{} + int32_t(qh);
      const vi16 low = (qs & 15) | ((high_bits >> lane) & 1) << 4;
      const vi16 high = (qs >> 4) | ((high_bits >> (lane + 16)) & 1) << 4;
      if constexpr (WITH_MIN) {
        const float m = half_to_float(block[r] + 2);
        w[0][r] = fmadd(to_float(low), d, m);
        w[1][r] = fmadd(to_float(high), d, m);
      } else {
        w[0][r] = d * to_float(low - 16);
        w[1][r] = d * to_float(high - 16);
      }
    }
    use(0, w[0]);
    use(1, w[1]);
  }
};
template <>
struct Blocks<Q5_0> : Blocks5<false> {};
template <>
struct Blocks<Q5_1> : Blocks5<true> {};

// Q8_0: d, 32 int8 values; w = d * q.
template <>
struct Blocks<Q8_0> {
  static constexpr int64_t WEIGHTS = 32, BYTES = 34;
  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
    v16 w[R];
    for (int half = 0; half < 2; ++half) {
      for (int r = 0; r < R; ++r) {
        const int8_t* q = reinterpret_cast<const int8_t*>(block[r] + 2);
        w[r] = to_float(widen_signed(q + 16 * half)) * splat_half(block[r]);
      }
      use(half, w);
    }
  }
};

// IQ4_NL's and IQ4_XS's 16 values, what a nibble stands for (gguf-py's kvalues): a grid denser
// near zero than Q4_0's even one.
alignas(16) inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                      1,    13,   25,  38,  53,  69,  89,  113};

#if defined(__AVX512F__)
inline const v16 kIQ4Floats = to_float(widen_signed(kIQ4Values));
#endif

// 16 bytes of nibbles -> the 32 values of an IQ4 (sub-)block in column order: out[l] the value of
// p[l]'s low nibble, out[16 + l] of its high one. One byte shuffle per 16 with SSSE3.
DRAFTWISE_ALWAYS_INLINE void iq4_values(const uint8_t* p, int8_t* out) {
#if defined(__SSSE3__)
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)), nibble = _mm_set1_epi8(15);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_shuffle_epi8(table, _mm_and_si128(bytes, nibble)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16),
                   _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble)));
#else
  for (int l = 0; l < 16; ++l) {
    out[l] = kIQ4Values[p[l] & 15];
    out[16 + l] = kIQ4Values[p[l] >> 4];
  }
#endif
}

#if defined(__AVX2__)
// Two IQ4 sub-blocks' 32 bytes of nibbles -> their values in two registers: lane t (128 bits) of
// low holds sub-block t's columns 0..15, of high its columns 16..31 (iq4_values' two halves).
DRAFTWISE_ALWAYS_INLINE void iq4_pair_values(const uint8_t* nibbles, __m256i& low, __m256i& high) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles));
  low = _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, nibble));
  high = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble));
}
#endif

// IQ4_NL (an IQ4_XS file's format where a row is not whole 256-weight blocks): d (float16), 16
// bytes of nibbles (the low ones are columns 0..15); w = d * kIQ4Values[q], exact in float32 (11
// significant bits times 7), so a table of the block's 16 weights and the formula agree.
template <>
struct Blocks<IQ4_NL> {
  static constexpr int64_t WEIGHTS = 32, BYTES = 18;
  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
    v16 w[R];
#if defined(__AVX512F__)
    // As Blocks4: the block's 16 weights in a register, one permute per 16 columns.
    v16 table[R];
    vi16 q[R];
    for (int r = 0; r < R; ++r) {
      table[r] = splat_half(block[r]) * kIQ4Floats;
      q[r] = widen(block[r] + 2);
    }
    for (int r = 0; r < R; ++r) w[r] = lookup(table[r], q[r]);
    use(0, w);
    for (int r = 0; r < R; ++r) w[r] = lookup(table[r], q[r] >> 4);
    use(1, w);
#else
    // The values by byte shuffles, then Q8_0's product (a lookup of floats costs two permutes and
    // a blend per 8 lanes on AVX2).
    alignas(64) int8_t q[R][32];
    for (int r = 0; r < R; ++r) iq4_values(block[r] + 2, q[r]);
    for (int half = 0; half < 2; ++half) {
      for (int r = 0; r < R; ++r) w[r] = to_float(widen_signed(q[r] + 16 * half)) * splat_half(block[r]);
      use(half, w);
    }
#endif
  }
};

// Q4_K: d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (32 bytes
// per pair of 32-column sub-blocks: the first in the low nibbles); w = d * scale_j * q - dmin *
// min_j in sub-block j.
template <>
struct Blocks<Q4_K> {
  static constexpr int64_t WEIGHTS = 256, BYTES = 144;
  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
    alignas(64) float scaled[R][16];
    q4k_scaled(block, scaled);
#pragma GCC unroll 4
    for (int pair = 0; pair < 4; ++pair) {
      v16 w[R];
      vi16 first[R], second[R];
      for (int r = 0; r < R; ++r) {
        first[r] = widen(block[r] + 16 + 32 * pair);
        second[r] = widen(block[r] + 32 + 32 * pair);
      }
#if defined(DRAFTWISE_V16_PAIR)
      // AVX2: the formula, as Blocks4 does: q4k_table's own multiply-add with the nibble in
      // place of the table's index, so the same float.
      const auto weights = [&](int r, int j, vi16 nibbles) DRAFTWISE_INLINE_LAMBDA {
        return fmsub(to_float(nibbles), scaled[r][j], scaled[r][8 + j]);
      };
      for (int r = 0; r < R; ++r) w[r] = weights(r, 2 * pair, first[r] & 15);
      use(4 * pair, w);
      for (int r = 0; r < R; ++r) w[r] = weights(r, 2 * pair, second[r] & 15);
      use(4 * pair + 1, w);
      for (int r = 0; r < R; ++r) w[r] = weights(r, 2 * pair + 1, first[r] >> 4);
      use(4 * pair + 2, w);
      for (int r = 0; r < R; ++r) w[r] = weights(r, 2 * pair + 1, second[r] >> 4);
      use(4 * pair + 3, w);
#else
      v16 table[R];
      for (int r = 0; r < R; ++r) table[r] = q4k_table(scaled[r], 2 * pair);
      for (int r = 0; r < R; ++r) w[r] = lookup(table[r], first[r]);
      use(4 * pair, w);
      for (int r = 0; r < R; ++r) w[r] = lookup(table[r], second[r]);
      use(4 * pair + 1, w);
      for (int r = 0; r < R; ++r) table[r] = q4k_table(scaled[r], 2 * pair + 1);
      for (int r = 0; r < R; ++r) w[r] = lookup(table[r], first[r] >> 4);
      use(4 * pair + 2, w);
      for (int r = 0; r < R; ++r) w[r] = lookup(table[r], second[r] >> 4);
      use(4 * pair + 3, w);
#endif
    }
  }
#if defined(DRAFTWISE_V16_PAIR)
  // AVX2, the rows of a decode step: decode's weights, the rows taking turns by quarter block
  // (64 columns) instead of by whole block; use(r, g, w) with w group g of row r. scaled[r]:
  // q4k_scaled's 16 values for row r's block, computed ahead by the caller (fused_slice).
  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode_by_turns(const uint8_t* const* block, const float* const* scaled,
                                                      Use use) {
#pragma GCC unroll 4
    for (int pair = 0; pair < 4; ++pair) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const vi16 first = widen(block[r] + 16 + 32 * pair), second = widen(block[r] + 32 + 32 * pair);
        const auto weights = [&](int j, vi16 nibbles) DRAFTWISE_INLINE_LAMBDA {
          return fmsub(to_float(nibbles), scaled[r][j], scaled[r][8 + j]);
        };
        use(r, 4 * pair, weights(2 * pair, first & 15));
        use(r, 4 * pair + 1, weights(2 * pair, second & 15));
        use(r, 4 * pair + 2, weights(2 * pair + 1, first >> 4));
        use(r, 4 * pair + 3, weights(2 * pair + 1, second >> 4));
      }
    }
  }
#endif
};

// 16 bytes -> their low nibbles into low[0..15], their high nibbles into high[0..15].
inline void nibbles(const uint8_t* in, uint8_t* low, uint8_t* high) {
#if defined(__SSE2__)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  const __m128i mask = _mm_set1_epi8(15);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(low), _mm_and_si128(v, mask));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(high), _mm_and_si128(_mm_srli_epi16(v, 4), mask));
#else
  for (int i = 0; i < 16; ++i) {
    low[i] = in[i] & 15;
    high[i] = in[i] >> 4;
  }
#endif
}

// Q6_K: 64 low-nibble bytes and 32 two-bit bytes -> 128 six-bit values in column order:
// value l + 32 s (s = 0..3) = nibble (s / 2) of ql[l + 32 (s % 2)] | bits (2 s) of qh[l] << 4.
inline void six_bits(const uint8_t* ql, const uint8_t* qh, uint8_t* out) {
#if defined(__SSE2__)
  const __m128i low_mask = _mm_set1_epi8(15), high_mask = _mm_set1_epi8(0x30);
  for (int l = 0; l < 32; l += 16) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + l));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 32 + l));
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + l));
    const __m128i values[4] = {
        _mm_or_si128(_mm_and_si128(a, low_mask), _mm_and_si128(_mm_slli_epi16(h, 4), high_mask)),
        _mm_or_si128(_mm_and_si128(b, low_mask), _mm_and_si128(_mm_slli_epi16(h, 2), high_mask)),
        _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low_mask), _mm_and_si128(h, high_mask)),
        _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b, 4), low_mask), _mm_and_si128(_mm_srli_epi16(h, 2), high_mask))};
    for (int s = 0; s < 4; ++s) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * s + l), values[s]);
  }
#else
  for (int s = 0; s < 4; ++s)
    for (int l = 0; l < 32; ++l)
      out[32 * s + l] = uint8_t(((ql[l + 32 * (s % 2)] >> (4 * (s / 2))) & 15) | ((qh[l] >> (2 * s)) & 3) << 4);
#endif
}

// A K-quant super-block's 256 values in column order, unsigned: Q4_K's nibbles (0..15), Q5_K's
// nibbles with their fifth bits (0..31: bit j of qh[l] for column l of sub-block j), Q6_K's six
// bits (0..63, the weight's q - 32 plus 32). The integer kernels' unpacked rows (int8_linear) and
// portable loops (int16_linear) read them; the scales stay where each kernel wants them.
inline void kquant_values(int64_t format, const uint8_t* block, uint8_t* q) {
  if (format == Q6_K) {
    six_bits(block, block + 128, q);
    six_bits(block + 64, block + 160, q + 128);
    return;
  }
  const uint8_t* qs = block + nibbles_at(format);
  for (int pair = 0; pair < 4; ++pair) {  // 32 bytes: sub-block 2 pair in the low nibbles, 2 pair + 1 in the high
    nibbles(qs + 32 * pair, q + 64 * pair, q + 64 * pair + 32);
    nibbles(qs + 32 * pair + 16, q + 64 * pair + 16, q + 64 * pair + 48);
  }
  if (format == Q5_K) {
    const uint8_t* qh = block + 16;
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) q[32 * j + l] |= ((qh[l] >> j) & 1) << 4;
  }
}

// Q5_K (Q5_K_M files' main format): Q4_K's d, dmin and 12 bytes of 6-bit scales and mins, then
// 32 bytes of high bits, then Q4_K's 128 bytes of nibbles; the value of column l of sub-block j is
// its nibble | bit j of qh[l] << 4, and w = d * scale_j * q - dmin * min_j. By the formula on
// every instruction set (a 5-bit value has 32 possible weights a sub-block, two registers of table):
// q4k_table's multiply-add with the value in place of the index, exact but for its one rounding,
// as gguf-py's d * q - dm rounds it.
template <>
struct Blocks<Q5_K> {
  static constexpr int64_t WEIGHTS = 256, BYTES = 176;
  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
    alignas(64) float scaled[R][16];
    q4k_scaled(block, scaled);
    vi16 high[R][2];  // qh[0..15], qh[16..31]: bit j of each is the fifth bit of sub-block j
    for (int r = 0; r < R; ++r) {
      high[r][0] = widen(block[r] + 16);
      high[r][1] = widen(block[r] + 32);
    }
#pragma GCC unroll 4
    for (int pair = 0; pair < 4; ++pair) {
      v16 w[R];
      vi16 first[R], second[R];
      for (int r = 0; r < R; ++r) {
        first[r] = widen(block[r] + 48 + 32 * pair);
        second[r] = widen(block[r] + 64 + 32 * pair);
      }
      const int j = 2 * pair;
      const auto weights = [&](int r, int sub, vi16 nibbles, vi16 bits) DRAFTWISE_INLINE_LAMBDA {
        return fmsub(to_float(nibbles | ((bits >> sub) & 1) << 4), scaled[r][sub], scaled[r][8 + sub]);
      };
      for (int r = 0; r < R; ++r) w[r] = weights(r, j, first[r] & 15, high[r][0]);
      use(4 * pair, w);
      for (int r = 0; r < R; ++r) w[r] = weights(r, j, second[r] & 15, high[r][1]);
      use(4 * pair + 1, w);
      for (int r = 0; r < R; ++r) w[r] = weights(r, j + 1, first[r] >> 4, high[r][0]);
      use(4 * pair + 2, w);
      for (int r = 0; r < R; ++r) w[r] = weights(r, j + 1, second[r] >> 4, high[r][1]);
      use(4 * pair + 3, w);
    }
  }
};

// The decode of a format whose 256-weight blocks are 16 groups of 16 columns, each group a float
// scale times int8 values (Q2_K, Q3_K, Q6_K): B::group_scales(block, out) gives the 16 scales as
// floats, B::values(block, half, out) a half's 128 values; w = scale * float(value), one rounding,
// and where B::OFFSETS (Q2_K's mins) w = scale * float(value) - offset (B::group_offsets), the
// product exact, so one rounding again.
template <typename B, int R, typename Use>
DRAFTWISE_ALWAYS_INLINE void decode_scaled_groups(const uint8_t* const* block, Use use) {
  alignas(64) float scale[R][16], offset[B::OFFSETS ? R : 1][16];
  for (int r = 0; r < R; ++r) {
    B::group_scales(block[r], scale[r]);
    if constexpr (B::OFFSETS) B::group_offsets(block[r], offset[r]);
  }
  in_memory(scale);
  if constexpr (B::OFFSETS) in_memory(offset);
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    alignas(64) int8_t q[R][128];
    for (int r = 0; r < R; ++r) B::values(block[r], half, q[r]);
#if defined(DRAFTWISE_V16_PAIR)
    // AVX2: through memory, so each 8 values widen in one load-and-extend. Left in registers
    // (GCC's choice) every 8 took a byte shift or lane extract and an extend, both on the
    // two shuffle pipes (AMD EPYC Zen 3: Qwen2.5-Coder-1.5B's Q6_K 1536 x 8960 down_proj at one
    // row, one thread, 1942 -> 1543 us; min over alternating processes).
    in_memory(q);
#endif
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {  // columns 16 g .. 16 g + 15 of the half
      v16 w[R];
      for (int r = 0; r < R; ++r) {
        if constexpr (B::OFFSETS)
          w[r] = fmsub(to_float(widen_signed(q[r] + 16 * g)), scale[r][8 * half + g], offset[r][8 * half + g]);
        else
          w[r] = scale[r][8 * half + g] * to_float(widen_signed(q[r] + 16 * g));
      }
      use(8 * half + g, w);
    }
  }
}

#if defined(__AVX2__)
// Bits 2 s and 2 s + 1 of each of 32 bytes (s = 0..3): Q2_K's and Q3_K's two low bits of a half's
// columns 32 s .. 32 s + 31 (16-bit shifts, then a byte mask keeps each byte's own bits).
inline __m256i two_bits(__m256i bytes, int s) {
  return _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * s), _mm256_set1_epi8(3));
}
#endif

// Q2_K (Q2_K files' main format): 16 bytes of scales (a group's scale in the low nibble, its min
// in the high), 64 bytes of 2-bit values (qs), d and dmin (float16); w = d * scale_g * q - dmin *
// min_g for the 16 columns of group g, q = 0..3. In half h (128 columns), value l + 32 s = bits
// 2 s of qs[32 h + l] (Q3_K's low bits). As gguf-py: d * scale_g and dmin * min_g (each exact,
// 11 bits times 4), then q times the first (exact) less the second, one rounding.
template <>
struct Blocks<Q2_K> {
  static constexpr int64_t WEIGHTS = 256, BYTES = 84;
  static constexpr bool OFFSETS = true;

  // Half h (128 columns) of a block -> its 128 values q as int8, in column order.
  static DRAFTWISE_ALWAYS_INLINE void values(const uint8_t* block, int half, int8_t* out) {
    const uint8_t* qs = block + 16 + 32 * half;
#if defined(__AVX2__)
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * s), two_bits(low, s));
#else
    for (int s = 0; s < 4; ++s)
      for (int l = 0; l < 32; ++l) out[32 * s + l] = int8_t((qs[l] >> (2 * s)) & 3);
#endif
  }

  // The 16 groups' d * scale_g, and dmin * min_g.
  static DRAFTWISE_ALWAYS_INLINE void group_scales(const uint8_t* block, float* out) {
    store16(out, splat_half(block + 80) * to_float(widen(block) & 15));
  }
  static DRAFTWISE_ALWAYS_INLINE void group_offsets(const uint8_t* block, float* out) {
    store16(out, splat_half(block + 82) * to_float(widen(block) >> 4));
  }

  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
    decode_scaled_groups<Blocks<Q2_K>, R>(block, use);
  }
};

// Q3_K (Q3_K_S/M/L files' main format): 32 bytes of high bits (hmask), 64 bytes of 2-bit lows
// (qs), 12 bytes of sixteen 6-bit scales, d (float16); w = d * (scale_g - 32) * q for the 16
// columns of group g, q = the low 2 bits, less 4 where the high bit is clear (-4..3). In half h
// (128 columns), value l + 32 s (s = 0..3) = bits 2 s of qs[32 h + l], high bit 4 h + s of
// hmask[l]. As gguf-py: (d * (scale - 32)) rounded once, then times q (Q6_K's two steps).
template <>
struct Blocks<Q3_K> {
  static constexpr int64_t WEIGHTS = 256, BYTES = 110;
  static constexpr bool OFFSETS = false;

  // Half h (128 columns) of a block -> its 128 values q as int8, in column order.
  static DRAFTWISE_ALWAYS_INLINE void values(const uint8_t* block, int half, int8_t* out) {
    const uint8_t* hmask = block;
    const uint8_t* qs = block + 32 + 32 * half;
#if defined(__AVX2__)
    // 32 values (one s) per register; 16-bit shifts, then byte masks keep each byte's own bits.
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hmask));
    const __m256i one = _mm256_set1_epi8(1);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      const __m256i q = two_bits(low, s);
      const __m256i clear = _mm256_andnot_si256(_mm256_srli_epi16(high, 4 * half + s), one);  // 1: subtract 4
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * s), _mm256_sub_epi8(q, _mm256_slli_epi16(clear, 2)));
    }
#else
    for (int s = 0; s < 4; ++s)
      for (int l = 0; l < 32; ++l)
        out[32 * s + l] = int8_t(((qs[l] >> (2 * s)) & 3) - (((hmask[l] >> (4 * half + s)) & 1) ? 0 : 4));
#endif
  }

  // The 16 scales, scale_g - 32: low 4 bits of g from byte g (g < 8) or the high nibble of byte
  // g - 8, top 2 bits from bits 2 (g / 4) of byte 8 + g % 4.
  static DRAFTWISE_ALWAYS_INLINE void scales(const uint8_t* block, int8_t* out) {
    const uint8_t* packed = block + 96;
#if defined(__SSE2__)
    // Bytes 0..7 and their high nibbles side by side; the top bits as four words, word m holding
    // bits 2 m of bytes 8..11 (scales 4 m .. 4 m + 3). Loads stay inside the block's 110 bytes.
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed)), nibble = _mm_set1_epi8(15);
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(bytes, nibble), _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    uint32_t top;
    std::memcpy(&top, packed + 8, 4);
    const uint32_t two = 0x03030303;
    const __m128i high = _mm_setr_epi32(int(top & two), int((top >> 2) & two), int((top >> 4) & two), int((top >> 6) & two));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32)));
#else
    for (int g = 0; g < 16; ++g) {
      const int low = g < 8 ? packed[g] & 15 : packed[g - 8] >> 4;
      const int high = (packed[8 + g % 4] >> (2 * (g / 4))) & 3;
      out[g] = int8_t((low | high << 4) - 32);
    }
#endif
  }

  // The 16 groups' d * (scale_g - 32).
  static DRAFTWISE_ALWAYS_INLINE void group_scales(const uint8_t* block, float* out) {
    alignas(16) int8_t sc[16];
    scales(block, sc);
    store16(out, splat_half(block + 108) * to_float(widen_signed(sc)));
  }

  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
    decode_scaled_groups<Blocks<Q3_K>, R>(block, use);
  }
};

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d (float16);
// w = d * scale_g * (q - 32) for the 16 columns of group g. In each half of 128 columns, value
// l + 32 s (s = 0..3) = nibble (s / 2) of ql[l + 32 (s % 2)] | bits (2 s) of qh[l] << 4.
template <>
struct Blocks<Q6_K> {
  static constexpr int64_t WEIGHTS = 256, BYTES = 210;
  static constexpr bool OFFSETS = false;

  // Half h (128 columns) of a block -> its 128 values q - 32 as int8, in column order.
  static DRAFTWISE_ALWAYS_INLINE void values(const uint8_t* block, int half, int8_t* out) {
    const uint8_t* ql = block + 64 * half;
    const uint8_t* qh = block + 128 + 32 * half;
#if defined(__AVX512BW__)
    // Bytes 0..31 of a 64-byte vector are s = 0 (or 2), bytes 32..63 s = 1 (or 3).
    const __m512i low = _mm512_loadu_si512(ql), nibble = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
    const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)));
    const __m512i shift01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    const __m512i bias = _mm512_set1_epi8(32);
    const __m512i v01 = _mm512_or_si512(_mm512_and_si512(low, nibble),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(high, shift01), two), 4));
    const __m512i v23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), nibble),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(high, shift23), two), 4));
    _mm512_storeu_si512(out, _mm512_sub_epi8(v01, bias));
    _mm512_storeu_si512(out + 64, _mm512_sub_epi8(v23, bias));
#elif defined(__AVX2__)
    // 32 values (one s) per 256-bit register; 16-bit shifts, then byte masks keep each byte's own bits.
    const __m256i low[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql)),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32))};
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    const __m256i nibble = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      const __m256i value = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi16(low[s % 2], 4 * (s / 2)), nibble),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * s), two), 4));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * s), _mm256_sub_epi8(value, bias));
    }
#else
    for (int s = 0; s < 4; ++s)
      for (int l = 0; l < 32; ++l)
        out[32 * s + l] = int8_t((((ql[l + 32 * (s % 2)] >> (4 * (s / 2))) & 15) | ((qh[l] >> (2 * s)) & 3) << 4) - 32);
#endif
  }

  // The 16 groups' d * scale_g.
  static DRAFTWISE_ALWAYS_INLINE void group_scales(const uint8_t* block, float* out) {
    store16(out, splat_half(block + 208) * to_float(widen_signed(reinterpret_cast<const int8_t*>(block) + 192)));
  }

  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
    decode_scaled_groups<Blocks<Q6_K>, R>(block, use);
  }
};

// IQ4_XS (IQ4_XS files' main format): d (float16), the top 2 bits of eight 6-bit scales
// (scales_h, 16 bits, sub-block j's at bits 2 j), their low 4 bits (scales_l, 4 bytes, sub-block
// j's in nibble j % 2 of byte j / 2), 128 bytes of nibbles (16 per 32-column sub-block, as
// IQ4_NL's); w = d * (scale_j - 32) * kIQ4Values[q] in sub-block j. As gguf-py: d * (scale - 32)
// once (exact), then times the value (exact again: at most 24 significant bits).
template <>
struct Blocks<IQ4_XS> {
  static constexpr int64_t WEIGHTS = 256, BYTES = 136;
  static constexpr bool OFFSETS = false;

  // Half h (128 columns: sub-blocks 4 h .. 4 h + 3) -> its 128 values, in column order.
  static DRAFTWISE_ALWAYS_INLINE void values(const uint8_t* block, int half, int8_t* out) {
    const uint8_t* qs = block + 8 + 64 * half;
#if defined(__AVX2__)
    // Two sub-blocks a register (one a 128-bit lane), stored 32 bytes at a time: the integer
    // kernels read them back 32 bytes at a time (int16_linear's AVX-512 groups), and a load
    // spanning two 16-byte stores waits for both to reach the cache (its one-row IQ4_XS product
    // took 3x float32 activations' time with iq4_values' 16-byte stores).
#pragma GCC unroll 2
    for (int s = 0; s < 4; s += 2) {
      __m256i low, high;
      iq4_pair_values(qs + 16 * s, low, high);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * s), _mm256_permute2x128_si256(low, high, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * s + 32), _mm256_permute2x128_si256(low, high, 0x31));
    }
#else
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) iq4_values(qs + 16 * s, out + 32 * s);
#endif
  }

  // The 16 groups' scales less 32: group g is in sub-block g / 2.
  static DRAFTWISE_ALWAYS_INLINE void scales(const uint8_t* block, int8_t* out) {
    uint16_t high;
    std::memcpy(&high, block + 2, 2);
#if defined(__SSE2__)
    // Sub-block j's top 2 bits to byte j (three shift-or-mask steps), its low nibble beside them.
    uint64_t top = high;
    top = (top | top << 24) & 0x000000FF000000FFull;
    top = (top | top << 12) & 0x000F000F000F000Full;
    top = (top | top << 6) & 0x0303030303030303ull;
    uint32_t low;
    std::memcpy(&low, block + 4, 4);
    const __m128i bytes = _mm_cvtsi32_si128(int(low)), nibble = _mm_set1_epi8(15);
    const __m128i lows =
        _mm_unpacklo_epi8(_mm_and_si128(bytes, nibble), _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    const __m128i scale = _mm_sub_epi8(_mm_or_si128(lows, _mm_slli_epi16(_mm_cvtsi64_si128(int64_t(top)), 4)),
                                       _mm_set1_epi8(32));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi8(scale, scale));
#else
    for (int g = 0; g < 16; ++g) {
      const int j = g / 2;
      out[g] = int8_t((((block[4 + j / 2] >> (4 * (j % 2))) & 15) | ((high >> (2 * j)) & 3) << 4) - 32);
    }
#endif
  }

  // The 16 groups' d * (scale - 32).
  static DRAFTWISE_ALWAYS_INLINE void group_scales(const uint8_t* block, float* out) {
    alignas(16) int8_t sc[16];
    scales(block, sc);
    store16(out, splat_half(block) * to_float(widen_signed(sc)));
  }

  template <int R, typename Use>
  static DRAFTWISE_ALWAYS_INLINE void decode(const uint8_t* const* block, Use use) {
#if defined(__AVX512F__)
    // As Q4_K's: each sub-block's 16 possible weights in a register (its d * (scale - 32) times
    // the 16 values: exact, the formula's floats), then one permute per 16 columns.
    alignas(64) float scale[R][16];
    for (int r = 0; r < R; ++r) group_scales(block[r], scale[r]);
    in_memory(scale);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      v16 table[R], w[R];
      vi16 q[R];
      for (int r = 0; r < R; ++r) {
        table[r] = scale[r][2 * j] * kIQ4Floats;
        q[r] = widen(block[r] + 8 + 16 * j);
      }
      for (int r = 0; r < R; ++r) w[r] = lookup(table[r], q[r]);
      use(2 * j, w);
      for (int r = 0; r < R; ++r) w[r] = lookup(table[r], q[r] >> 4);
      use(2 * j + 1, w);
    }
#else
    decode_scaled_groups<Blocks<IQ4_XS>, R>(block, use);
#endif
  }
};

#if defined(DRAFTWISE_V16_PAIR)
// The formats whose decode step's rows take turns within a block on AVX2 (decode_by_turns;
// linear.cpp, fused_slice). Q6_K's did the same and measured no faster (1.00x at one row); tried
// again with its scales ahead (2026-11-29): 1.13x for one row on one thread, but no faster in
// whole two-thread forwards (docs/weight-formats.md, "Q4_K block scales ahead").
template <typename B>
constexpr bool kDecodesByTurns = std::is_same_v<B, Blocks<Q4_K>>;
#endif

// Calls body(Blocks<format>{}) for a block format's decoder (the format as a type, so that
// each caller's loop is compiled once per format).
template <typename Body>
inline void with_blocks(int64_t format, Body body) {
  switch (format) {
    case Q4_0: return body(Blocks<Q4_0>{});
    case Q4_1: return body(Blocks<Q4_1>{});
    case Q5_0: return body(Blocks<Q5_0>{});
    case Q5_1: return body(Blocks<Q5_1>{});
    case Q8_0: return body(Blocks<Q8_0>{});
    case Q2_K: return body(Blocks<Q2_K>{});
    case Q3_K: return body(Blocks<Q3_K>{});
    case Q4_K: return body(Blocks<Q4_K>{});
    case Q5_K: return body(Blocks<Q5_K>{});
    case Q6_K: return body(Blocks<Q6_K>{});
    case IQ4_NL: return body(Blocks<IQ4_NL>{});
    case IQ4_XS: return body(Blocks<IQ4_XS>{});
  }
  TORCH_CHECK(false, say("draftwise kernels: weight format ", format, " is not a block format"));
}

inline bool is_block_format(int64_t format) {
  return format == Q4_0 || format == Q4_1 || format == Q5_0 || format == Q5_1 || format == Q8_0 ||
         format == Q2_K || format == Q3_K || format == Q4_K || format == Q5_K || format == Q6_K || format == IQ4_NL ||
         format == IQ4_XS;
}

// One row of K weights from its format into out (float32), 16 at a time: blocks.h's values (the
// lattice formats' from lattice.h).
inline void dequantize_row(int64_t format, const uint8_t* row, float* out, int64_t K) {
  if (is_lattice_format(format)) return dequantize_lattice_row(format, row, out, K);
  switch (format) {
    case F16:
      for (int64_t k = 0; k < K; ++k) out[k] = half_to_float(row + 2 * k);
      return;
    case BF16:
      for (int64_t k = 0; k < K; ++k) {
        uint32_t bits = uint32_t(row[2 * k]) | uint32_t(row[2 * k + 1]) << 8;
        bits <<= 16;
        std::memcpy(out + k, &bits, 4);
      }
      return;
  }
  with_blocks(format, [&](auto blocks) {
    using B = decltype(blocks);
    // Local copies: the captured row, out and K live in the caller's frame, and every store16
    // (an intrinsic store, which may alias anything) made GCC reload and re-store them per
    // group (perf, AVX2 Q4_1: a third of the loop's instructions).
    const uint8_t* block = row;
    float* values = out;
    const int64_t blocks_in_row = K / B::WEIGHTS;
    for (int64_t b = 0; b < blocks_in_row; ++b, block += B::BYTES, values += B::WEIGHTS)
      B::template decode<1>(&block, [&](int g, const v16* w) DRAFTWISE_INLINE_LAMBDA { store16(values + 16 * g, w[0]); });
  });
}

}  // namespace draftwise
