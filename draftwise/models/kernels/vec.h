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

namespace draftwise {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t vi16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// v, kept in a register: GCC would otherwise fold a load shared by several multiply-adds into
// each of them (one load per multiply-add instead of one in all; 1.2x slower in linear.cpp's
// micro-kernel). Values and rounding are untouched.
inline v16 in_register(v16 v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#endif
  return v;
}

inline float horizontal_sum(v16 v) {
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// e^x for x <= 0 (softmax after subtracting the maximum, SiLU's e^-|x|): Cephes' range
// reduction and degree-6 polynomial, about 2 ulp. Our own, so every CPU and every row runs the
// same instructions (no library picks a different path for a tail).
inline v16 exp16(v16 x) {
  const v16 lo = v16{} - 87.0f;
  x = x < lo ? lo : x;  // e^-87 ~ 1.6e-38: still a normal float
  const v16 magic = v16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  v16 n = (x * 1.44269504088896341f + magic) - magic;
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;  // 2^n
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace draftwise
