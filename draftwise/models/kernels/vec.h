// Vector helpers shared by draftwise's kernels (GCC/Clang vector extensions: the compiler lowers
// v16 to one AVX-512 register, two AVX2 ones or four NEON ones, whatever -march it builds for).
//
// Batch invariance rests on one rule here: every reduction (a dot product, a softmax sum) runs
// over its own row in one fixed order that depends only on that row's length, never on how many
// rows are computed beside it or on how threads split the work.
#pragma once

// ATen alone, not torch/extension.h: that header costs ~40 s of compile per file; only
// module.cpp (the bindings) needs pybind.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace draftwise {

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));

#if defined(__AVX2__) && !defined(__AVX512F__)
#define DRAFTWISE_V16_PAIR 1
// AVX2 without AVX-512: 16 lanes are a pair of 256-bit vectors. GCC keeps a 64-byte vector
// extension type, having no 64-byte register here, in memory: every multiply-add of a register
// block then loaded and stored its accumulator and values moved through general registers
// (SmolLM2's 1536x576 Q4_1 at 1-3 GMAC/s on an AMD EPYC 7003 core). A pair of 256-bit vectors
// stays in registers. Lane l of a Pair is lane l of the 16 (lo: 0..7, hi: 8..15), and every
// operator below is the same operation lane by lane, so each lane's arithmetic (and thus each
// kernel's rounding) is what the 64-byte type computes.
template <typename H>
using Lane = std::remove_cv_t<std::remove_reference_t<decltype(H{}[0])>>;
template <typename H>
struct Pair {
  H lo, hi;
  Lane<H> operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
  Lane<H>& operator[](int i) { return reinterpret_cast<Lane<H>*>(this)[i]; }
};
#define DRAFTWISE_PAIR_OPERATOR(op)                                                                              \
  template <typename H>                                                                                         \
  inline Pair<H> operator op(Pair<H> a, Pair<H> b) { return {a.lo op b.lo, a.hi op b.hi}; }                     \
  template <typename H, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>                       \
  inline Pair<H> operator op(Pair<H> a, S b) { return {a.lo op Lane<H>(b), a.hi op Lane<H>(b)}; }                                  \
  template <typename H, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>                       \
  inline Pair<H> operator op(S a, Pair<H> b) { return {Lane<H>(a) op b.lo, Lane<H>(a) op b.hi}; }                                  \
  template <typename H, typename T>                                                                             \
  inline Pair<H>& operator op##=(Pair<H>& a, T b) { return a = a op b; }
DRAFTWISE_PAIR_OPERATOR(+)
DRAFTWISE_PAIR_OPERATOR(-)
DRAFTWISE_PAIR_OPERATOR(*)
DRAFTWISE_PAIR_OPERATOR(/)
DRAFTWISE_PAIR_OPERATOR(&)
DRAFTWISE_PAIR_OPERATOR(|)
DRAFTWISE_PAIR_OPERATOR(^)
DRAFTWISE_PAIR_OPERATOR(<<)
DRAFTWISE_PAIR_OPERATOR(>>)
#undef DRAFTWISE_PAIR_OPERATOR
#define DRAFTWISE_PAIR_COMPARISON(op)                                                                            \
  template <typename H>                                                                                         \
  inline auto operator op(Pair<H> a, Pair<H> b) { return Pair<decltype(a.lo op b.lo)>{a.lo op b.lo, a.hi op b.hi}; } \
  template <typename H, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>                       \
  inline auto operator op(Pair<H> a, S b) { return Pair<decltype(a.lo < a.lo)>{a.lo op Lane<H>(b), a.hi op Lane<H>(b)}; }
DRAFTWISE_PAIR_COMPARISON(<)
DRAFTWISE_PAIR_COMPARISON(>)
DRAFTWISE_PAIR_COMPARISON(<=)
DRAFTWISE_PAIR_COMPARISON(>=)
DRAFTWISE_PAIR_COMPARISON(==)
DRAFTWISE_PAIR_COMPARISON(!=)
#undef DRAFTWISE_PAIR_COMPARISON
template <typename H>
inline Pair<H> operator-(Pair<H> a) { return {-a.lo, -a.hi}; }

typedef Pair<v8> v16;
typedef Pair<vi8> vi16;
typedef Pair<vu8> vu16;

// mask ? a : b per lane (mask: a comparison's result).
template <typename M, typename T>
inline T select(M mask, T a, T b) { return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi}; }
// Each lane converted (float <-> int32, as __builtin_convertvector: int32 -> float rounds to
// nearest, float -> int32 truncates).
template <typename To, typename From>
inline To convert(From v) {
  return {__builtin_convertvector(v.lo, decltype(To{}.lo)), __builtin_convertvector(v.hi, decltype(To{}.lo))};
}
// The same 64 bytes seen as another 16-lane type.
template <typename To, typename From>
inline To bitcast(From v) { return {(decltype(To{}.lo))v.lo, (decltype(To{}.lo))v.hi}; }
inline v16 join(__m256 low, __m256 high) { return {v8(low), v8(high)}; }
inline vi16 join(__m256i low, __m256i high) { return {vi8(low), vi8(high)}; }
inline __m256 half_of(v16 v, int h) { return __m256(h == 0 ? v.lo : v.hi); }
inline __m256i half_of(vi16 v, int h) { return __m256i(h == 0 ? v.lo : v.hi); }
inline v16 load16(const float* p) { return {v8(_mm256_loadu_ps(p)), v8(_mm256_loadu_ps(p + 8))}; }
inline void store16(float* p, v16 v) {
  _mm256_storeu_ps(p, __m256(v.lo));
  _mm256_storeu_ps(p + 8, __m256(v.hi));
}
#else
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));

template <typename M, typename T>
inline T select(M mask, T a, T b) { return mask ? a : b; }
template <typename To, typename From>
inline To convert(From v) { return __builtin_convertvector(v, To); }
template <typename To, typename From>
inline To bitcast(From v) { return (To)v; }
inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
#endif

// How many v16 values the CPU's vector registers hold: 32 with AVX-512 (a v16 is one of its 32
// registers), 8 elsewhere (AVX2's 16 256-bit registers, NEON's 32 128-bit ones). Register
// blocks are sized by it: a block of more accumulators than registers spills to the stack on
// every step (AVX2, SmolLM2's 1536x576 Q4_1 with 6 x 4 accumulators: 3 GMAC/s).
#if defined(__AVX512F__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 8;
#endif


// 16 bfloat16 values (a KV cache's keys or values, stored as their bits) -> float32, exactly:
// a bfloat16 is the top half of the float32 it came from.
inline v16 load16(const uint16_t* p) {
  vi16 bits;
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&bits, &v, sizeof bits);
#elif defined(__AVX2__)
  bits = join(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
              _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
#else
  for (int i = 0; i < 16; ++i) bits[i] = p[i];
#endif
  bits <<= 16;
  return bitcast<v16>(bits);
}

// x[0..n) -> bfloat16 bits, rounded to nearest even exactly as torch's .to(torch.bfloat16)
// (subnormals kept; NaN -> 0x7fc0), so a cache written here holds what Python would write.
inline void round_to_bf16(const float* x, uint16_t* out, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const v16 value = load16(x + k);
    const vu16 bits = bitcast<vu16>(value);
    const vu16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const vi16 nan = value != value;
    for (int i = 0; i < 16; ++i) out[k + i] = nan[i] ? uint16_t(0x7fc0) : uint16_t(rounded[i]);
  }
  for (; k < n; ++k) {
    uint32_t bits;
    std::memcpy(&bits, x + k, 4);
    out[k] = x[k] != x[k] ? uint16_t(0x7fc0) : uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
  }
}

// v, kept in a register: GCC would otherwise fold a load shared by several multiply-adds into
// each of them (one load per multiply-add instead of one in all; 1.2x slower in linear.cpp's
// micro-kernel). Values and rounding are untouched.
inline v16 in_register(v16 v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#endif
  return v;
}

// x in all 8 lanes, exactly (see broadcast16).
inline v8 broadcast8(const float& x) {
#if defined(__AVX__)
  return v8(_mm256_set1_ps(x));
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = x;
  return out;
#endif
}

// x in all 16 lanes, exactly. On AVX-512 one broadcast from memory (a load, no arithmetic
// port); `v16{} + x` made GCC add x to zero as a scalar and then shuffle it across the lanes:
// two more instructions on the ports the multiply-adds need, per key and head in attention.
inline v16 broadcast16(const float& x) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_set1_ps(x);
  v16 out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#elif defined(DRAFTWISE_V16_PAIR)
  const v8 half = v8(_mm256_set1_ps(x));
  return {half, half};
#else
  v16 out;
  for (int i = 0; i < 16; ++i) out[i] = x;
  return out;
#endif
}

// a * b + c, lane by lane, rounded once (a fused multiply-add) where the CPU has the instruction,
// twice (product, then sum) where it has none. The kernels are compiled with -ffp-contract=off
// and spell every fused multiply-add they mean with fmadd: then the source alone fixes each
// output's roundings, and every path computing the same output (a decode step's registers, a
// prefill's dequantised tile, a tree node's attention or the same query alone) rounds alike
// whatever the compiler. Left to contract products and sums itself, GCC 13.3 fused them in some
// inlined copies of a loop and not in others (a Q4_0 product's two paths an ulp apart).
#if defined(__FMA__) || defined(__AVX512F__) || defined(__ARM_FEATURE_FMA)
#define DRAFTWISE_HARDWARE_FMA 1
#endif
inline float fmadd(float a, float b, float c) {
#if defined(DRAFTWISE_HARDWARE_FMA)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
// fmadd lane by lane, for a vector width with no instruction of its own here.
template <typename V>
inline V fmadd_lanes(V a, V b, V c) {
  for (int i = 0; i < int(sizeof(V) / sizeof(float)); ++i) c[i] = fmadd(a[i], b[i], c[i]);
  return c;
}
inline v8 fmadd(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return v8(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(c)));
#else
  return fmadd_lanes(a, b, c);
#endif
}
inline v16 fmadd(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return v16(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(c)));
#elif defined(DRAFTWISE_V16_PAIR)
  return {fmadd(a.lo, b.lo, c.lo), fmadd(a.hi, b.hi, c.hi)};
#else
  return fmadd_lanes(a, b, c);
#endif
}
// a * b - c, rounded as fmadd(a, b, -c) (one instruction where fused: no negation of c first).
inline v16 fmsub(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return v16(_mm512_fmsub_ps(__m512(a), __m512(b), __m512(c)));
#elif defined(DRAFTWISE_V16_PAIR) && defined(__FMA__)
  return {v8(_mm256_fmsub_ps(__m256(a.lo), __m256(b.lo), __m256(c.lo))),
          v8(_mm256_fmsub_ps(__m256(a.hi), __m256(b.hi), __m256(c.hi)))};
#else
  return fmadd(a, b, -c);
#endif
}
// A scalar operand stands for itself in every lane.
inline v16 fmadd(v16 a, float b, v16 c) { return fmadd(a, broadcast16(b), c); }
inline v16 fmadd(float a, v16 b, v16 c) { return fmadd(broadcast16(a), b, c); }
inline v16 fmadd(v16 a, v16 b, float c) { return fmadd(a, b, broadcast16(c)); }
inline v16 fmadd(v16 a, float b, float c) { return fmadd(a, broadcast16(b), broadcast16(c)); }
inline v16 fmsub(v16 a, float b, float c) { return fmsub(a, broadcast16(b), broadcast16(c)); }

// values, read from memory from here on: GCC would otherwise keep an array of scales it has
// just stored in a register and broadcast each one with a lane permute (one more instruction
// per 16 weights) instead of a multiply's broadcast operand from memory (free). Values are
// untouched.
template <typename T>
inline void in_memory(T& values) {
  asm("" : "+m"(values));
}

// 8 lanes summed in one fixed tree, the last two levels of horizontal_sum(v16)'s:
// lane i + lane i + 4, then (0 + 2) + (1 + 3).
inline float horizontal_sum(v8 a) {
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

#if defined(DRAFTWISE_V16_PAIR)
inline float horizontal_sum(v16 v) {
  const v8 a = v.lo + v.hi;  // lane i + lane i + 8, then as below
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
// The four sums, each the same tree as horizontal_sum's (lo + hi; lane i + lane i + 4; then
// (0 + 2) + (1 + 3)), four sums sharing the instructions: 15 instead of 4 x 7.
inline v4 horizontal_sums4(v16 a, v16 b, v16 c, v16 d) {
  const __m256 sa = __m256(a.lo + a.hi), sb = __m256(b.lo + b.hi), sc = __m256(c.lo + c.hi), sd = __m256(d.lo + d.hi);
  // [a's lane i + lane i + 4 | b's], [c's | d's]
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(sa, sb, 0x20), _mm256_permute2f128_ps(sa, sb, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(sc, sd, 0x20), _mm256_permute2f128_ps(sc, sd, 0x31));
  // per 128-bit half: [a 0 + 2, a 1 + 3, c 0 + 2, c 1 + 3] | the same for b and d
  const __m256 pairs = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  // [a, c, a, c | b, d, b, d]
  const v8 totals = v8(_mm256_add_ps(_mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1))));
  return v4{totals[0], totals[4], totals[1], totals[5]};
}
#else
inline float horizontal_sum(v16 v) {
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// {horizontal_sum(a), horizontal_sum(b), horizontal_sum(c), horizontal_sum(d)}, bit for bit:
// each sum is the same additions in the same tree (lane i + lane i + 8, then + 4, then
// (0 + 2) + (1 + 3)), four sums sharing every instruction (13 instead of 4 x 8).
inline v4 horizontal_sums4(v16 a, v16 b, v16 c, v16 d) {
  // [a[i] + a[i + 8] (8 lanes) | b's], and c's and d's
  const v16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // quarter q: that vector's 8 sums folded to 4 (i + (i + 4)), a's, b's, c's, d's
  const v16 quarters = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                       __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  // in each quarter: (0 + 2), (1 + 3), then their sum in lane 0
  const v16 pairs = quarters + __builtin_shufflevector(quarters, quarters, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const v16 total = pairs + __builtin_shufflevector(pairs, pairs, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return __builtin_shufflevector(total, total, 0, 4, 8, 12);
}
#endif

// e^x for x <= 0 (softmax after subtracting the maximum, SiLU's e^-|x|): Cephes' range
// reduction and degree-6 polynomial, about 2 ulp. Our own, so every CPU and every row runs the
// same instructions (no library picks a different path for a tail).
inline v16 exp16(v16 x) {
  const v16 lo = v16{} - 87.0f;
  x = select(x < lo, lo, x);  // e^-87 ~ 1.6e-38: still a normal float
  const v16 magic = v16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  v16 n = fmadd(x, 1.44269504088896341f, magic) - magic;
  v16 r = fmadd(n, -0.693359375f, x);
  r = fmadd(n, 2.12194440e-4f, r);
  v16 p = v16{} + 1.9875691500e-4f;
  p = fmadd(p, r, 1.3981999507e-3f);
  p = fmadd(p, r, 8.3334519073e-3f);
  p = fmadd(p, r, 4.1665795894e-2f);
  p = fmadd(p, r, 1.6666665459e-1f);
  p = fmadd(p, r, 5.0000001201e-1f);
  p = fmadd(p, r * r, r) + 1.0f;
  const vi16 bits = (convert<vi16>(n) + 127) << 23;  // 2^n
  return p * bitcast<v16>(bits);
}

}  // namespace draftwise
