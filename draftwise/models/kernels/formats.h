// GGUF's weight formats as the kernels see them: GGML type ids, what one block holds, float16
// scales, and the check every product runs on its weight bytes (linear.cpp, int8_linear.cpp).
#pragma once

#include "message.h"
#include "vec.h"

#include <c10/util/Half.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace draftwise {

// GGML type ids (the numbers in a GGUF file).
enum Format : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11,
                        Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19,
                        IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29, BF16 = 30 };

struct Layout { int64_t weights; int64_t bytes; };  // per block

inline Layout layout(int64_t format) {
  switch (format) {
    case F32: return {1, 4};
    case F16: return {1, 2};
    case BF16: return {1, 2};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q2_K: return {256, 84};
    case Q3_K: return {256, 110};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    case IQ4_NL: return {32, 18};
    case IQ4_XS: return {256, 136};
    // the lattice formats (lattice.h): decoded into floats a row at a time, not in registers
    case IQ2_XXS: return {256, 66};
    case IQ2_XS: return {256, 74};
    case IQ2_S: return {256, 82};
    case IQ3_XXS: return {256, 98};
    case IQ3_S: return {256, 110};
    case IQ1_S: return {256, 50};
    case IQ1_M: return {256, 56};
  }
  TORCH_CHECK(false, say("draftwise kernels: weight format ", format, " is not supported"));
}

// Asks for the bytes of weight row `row`'s columns [k0, k0 + columns) while the tiles round
// (bf16_linear.cpp) or dequantise (linear.cpp) the row before: a tile walks a slice of one row,
// then jumps to the next, and without this the first touch of each slice stalled on memory
// (perf, Qwen's 9-row bf16 verify: 20% of the tile fill's samples on a Q6_K block's first load).
inline void prefetch_slice(int64_t format, const uint8_t* row, int64_t k0, int64_t columns) {
  const Layout blocks = layout(format);
  const uint8_t* start = row + k0 / blocks.weights * blocks.bytes;
  const int64_t bytes = (columns + blocks.weights - 1) / blocks.weights * blocks.bytes;
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset);
}

// Asks for the `bytes` (a block or two) PREFETCH_AHEAD past p: a decode step that walks its weight
// rows block by block reads them this far ahead (int16_linear's and int8_linear's decode kernels).
// Without it an Intel Xeon's hardware prefetchers did not keep those row streams fed (perf,
// Qwen2.5-Coder-1.5B's one-token step: the block loads were the decode's hottest instructions;
// int16 on an AMD EPYC Zen 3, 60.5-62.7 -> 49.8-53 ms a token).
constexpr int64_t PREFETCH_AHEAD = 4096;
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + PREFETCH_AHEAD + line);
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; exact, as every float16 is a float32
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Every float16's float32 value, by its bits: a block's scale becomes a float32 broadcast
// straight from memory (a load, no shuffle), where the conversion in a vector register takes a
// word broadcast and vcvtph2ps, both on the port the decoders' permutes and conversions queue
// for (perf, SmolLM2's Q4_1 decode on an AMX Xeon). 256 KB, of which a model's scales touch a few
// lines. The same exact values as half_to_float.
struct HalfTable {
  alignas(64) float values[65536];
  HalfTable() {
    for (uint32_t bits = 0; bits < 65536; ++bits) {
      const uint16_t half = uint16_t(bits);
      values[bits] = half_to_float(reinterpret_cast<const uint8_t*>(&half));
    }
  }
};
inline const HalfTable kHalfTable;

// The float32 of the float16 at p, read from the table (see HalfTable).
inline const float& half_value(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return kHalfTable.values[bits];
}

// weight: N rows of K weights in format, as a contiguous uint8 tensor [N, bytes per row].
inline void check_weight(const at::Tensor& weight, int64_t format, int64_t K) {
  const Layout l = layout(format);
  TORCH_CHECK(K % l.weights == 0, say("draftwise kernels: ", K, " columns are not whole blocks of ", l.weights));
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "draftwise kernels: weights must be a contiguous uint8 tensor [rows, bytes per row]");
  TORCH_CHECK(weight.size(1) == K / l.weights * l.bytes, say("draftwise kernels: ", weight.size(1),
                  " bytes per row do not hold ", K, " weights of format ", format));
}

// The K-quant formats (256-weight super-blocks with sub-block scales): int8_linear's and
// int16_linear's integer paths take them apart from the 32-weight blocks.
// GGUF's lattice formats (the IQ quants below 4 bits: lattice.h).
inline bool is_lattice_format(int64_t format) {
  return format == IQ2_XXS || format == IQ2_XS || format == IQ2_S || format == IQ3_XXS || format == IQ3_S ||
         format == IQ1_S || format == IQ1_M;
}

inline bool is_kquant(int64_t format) { return format == Q4_K || format == Q5_K || format == Q6_K; }
// The formats int8_linear multiplies (the 32-weight blocks and the K-quants but Q2_K and Q3_K);
// any other would be read with a wrong layout, so it refuses them.
inline bool has_int8_path(int64_t format) {
  return format == Q4_0 || format == Q4_1 || format == Q5_0 || format == Q5_1 || format == Q8_0 || is_kquant(format);
}
// Where Q4_K's and Q5_K's 128 bytes of nibbles start (Q5_K's 32 bytes of fifth bits come first, at 16).
inline constexpr int64_t nibbles_at(int64_t format) { return format == Q5_K ? 48 : 16; }

// x: the rows a rounding kernel (int8_linear, int16_linear) takes, contiguous float32 [M, K].
inline void check_rows_of_x(const at::Tensor& x, int64_t K, const char* kernel) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && x.is_contiguous(),
              say(kernel, ": x must be contiguous float32 [M, ", K, "]"));
}

}  // namespace draftwise
