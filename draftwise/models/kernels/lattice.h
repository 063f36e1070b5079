// GGUF's lattice formats, the IQ quants below 4 bits (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
// IQ3_XXS, IQ3_S: the main formats of IQ1/IQ2/IQ3 files): each group of 4 or 8 weights is one
// point of a codebook (a "grid" of small integers: 8 / 25 / 43 for IQ2, 4..62 or 1..15 for IQ3,
// -1 / 0 / 1 for IQ1) named by an 8-11-bit index, with its signs stored apart (a byte of sign
// bits, or 7 bits whose eighth is the parity of the others: `ksigns`) and a scale per 16 or 32
// weights under the block's float16 d.
//
// The codebooks are gguf-py's own (gguf.quants, which reads and writes GGUF files for
// transformers and llama.cpp alike): Python hands them to the kernels once
// (set_lattice_grid / set_lattice_signs, from models/kernels.py), so the tables live in one place.
//
// dequantize_lattice_row writes a row's float32 values with the float32 operations of gguf-py's
// dequantize_blocks in the same order (a scale, then the grid value, then the sign), so every
// path that decodes a row into floats (linear.cpp's float32 products, bf16_linear.cpp's and
// amx_linear.cpp's rounding) computes exactly the weights `--dtype float32` would dequantise, from
// 1.6-3.4 bits a weight instead of 32.
#pragma once

#include "formats.h"
#include "message.h"
#include "vec.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace draftwise {

struct LatticeTables {
  std::vector<float> grid[32];  // by format id: entries x width floats
  uint8_t ksigns[128] = {};
  bool have_signs = false;
};

// A format's codebook size: {entries, values an entry}; the decoders index exactly this far.
struct CodebookShape { int64_t entries; int64_t width; };
inline CodebookShape codebook_shape(int64_t format) {
  switch (format) {
    case IQ2_XXS: return {256, 8};
    case IQ2_XS: return {512, 8};
    case IQ2_S: return {1024, 8};
    case IQ3_XXS: return {256, 4};
    case IQ3_S: return {512, 4};
    case IQ1_S:
    case IQ1_M: return {2048, 8};
  }
  TORCH_CHECK(false, say("draftwise kernels: format ", format, " is not a lattice format"));
}

inline LatticeTables& lattice_tables() {
  static LatticeTables tables;
  return tables;
}

// grid: gguf-py's codebook of `format`, float32 [entries, width] as codebook_shape says.
inline void set_lattice_grid(int64_t format, const at::Tensor& grid) {
  const CodebookShape shape = codebook_shape(format);
  TORCH_CHECK(grid.dim() == 2 && grid.scalar_type() == at::kFloat && grid.size(0) == shape.entries &&
                  grid.size(1) == shape.width,
              say("set_lattice_grid: format ", format, "'s codebook must be float32 [", shape.entries, ", ", shape.width,
                  "], not ", grid.sizes()));
  const at::Tensor values = grid.contiguous();
  lattice_tables().grid[format].assign(values.data_ptr<float>(), values.data_ptr<float>() + values.numel());
}

// ksigns: the 128 bytes that turn 7 sign bits into 8 (the eighth: the parity of the seven).
inline void set_lattice_signs(const at::Tensor& ksigns) {
  TORCH_CHECK(ksigns.dim() == 1 && ksigns.scalar_type() == at::kByte && ksigns.numel() == 128,
              "set_lattice_signs: ksigns must be uint8 [128]");
  LatticeTables& tables = lattice_tables();
  std::memcpy(tables.ksigns, ksigns.contiguous().data_ptr<uint8_t>(), 128);
  tables.have_signs = true;
}

namespace lattice {

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The i-th 4-bit field of bytes, low nibble first (sub-block scales, IQ1_M's index tops).
inline int nibble(const uint8_t* bytes, int i) { return (bytes[i / 2] >> (4 * (i % 2))) & 15; }

// Each byte of sign bits as 8 factors, +1 or -1 (bit j: value j): a group's 8 values are then one
// vector multiply of its codebook row, its scale and its signs' table row (a select per value,
// scalar, made a Qwen2.5-Coder-1.5B IQ3_M token take 2 s; 0.15 s now).
struct SignTable {
  alignas(32) float values[256][8];
  SignTable() {
    for (int byte = 0; byte < 256; ++byte)
      for (int j = 0; j < 8; ++j) values[byte][j] = (byte >> j) & 1 ? -1.0f : 1.0f;
  }
};
inline const SignTable kSignTable;

// 8 values: (scale * grid value) * sign, the grid values 4 of `first` and 4 of `second` (a
// 4-wide codebook's two rows, or an 8-wide row's halves), the signs bit j of `signs` for value j;
// scale: the group's scale in every lane.
inline void signed_points(v8 scale, const float* first, const float* second, uint8_t signs, float* out) {
#if defined(__AVX__)
  // one register from two 16-byte loads (two 16-byte stores read back as 32 bytes stall the load)
  const v8 point = v8(_mm256_set_m128(_mm_loadu_ps(second), _mm_loadu_ps(first)));
  v8 sign;
  std::memcpy(&sign, kSignTable.values[signs], 32);
  const v8 value = scale * point * sign;
  std::memcpy(out, &value, 32);
#else
  const float* sign = kSignTable.values[signs];
  for (int j = 0; j < 4; ++j) out[j] = scale[0] * first[j] * sign[j];
  for (int j = 0; j < 4; ++j) out[4 + j] = scale[0] * second[j] * sign[4 + j];
#endif
}

// 16 values, two groups of 8 under one scale: the 4-wide codebook rows q0..q3 in order (an 8-wide
// row is two of them), `first`'s sign bits for values 0-7 and `second`'s for 8-15. With AVX-512,
// one register: the signs a mask that flips the sign bit (an exact negation, -0 for +0 as a
// multiply by -1 gives), a quarter fewer instructions than two groups of 8.
inline void signed_points16(float scale, const float* q0, const float* q1, const float* q2, const float* q3,
                            uint8_t first, uint8_t second, float* out) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  __m512 points = _mm512_castps128_ps512(_mm_loadu_ps(q0));
  points = _mm512_insertf32x4(points, _mm_loadu_ps(q1), 1);
  points = _mm512_insertf32x4(points, _mm_loadu_ps(q2), 2);
  points = _mm512_insertf32x4(points, _mm_loadu_ps(q3), 3);
  const __m512 values = _mm512_mul_ps(_mm512_set1_ps(scale), points);
  const __mmask16 negative = __mmask16(first | second << 8);
  _mm512_storeu_ps(out, _mm512_mask_xor_ps(values, negative, values, _mm512_set1_ps(-0.0f)));
#else
  const v8 broadcast = broadcast8(scale);
  signed_points(broadcast, q0, q1, first, out);
  signed_points(broadcast, q2, q3, second, out + 8);
#endif
}

// IQ2_XXS: 8 groups of 32: two uint32s, the first four grid indices (a byte each), the second
// four 7-bit sign indices and a 4-bit scale; db = d * (0.5 + scale) * 0.25.
inline void iq2_xxs(const uint8_t* block, const float* grid, const uint8_t* ksigns, float* out) {
  const float d = half_value(block);
  for (int g = 0; g < 8; ++g) {
    const uint8_t* indices = block + 2 + 8 * g;
    const uint32_t aux = u32(indices + 4);
    const float db = d * (0.5f + float(aux >> 28)) * 0.25f;
    for (int l = 0; l < 4; l += 2) {
      const float *first = grid + 8 * indices[l], *second = grid + 8 * indices[l + 1];
      signed_points16(db, first, first + 4, second, second + 4, ksigns[(aux >> (7 * l)) & 127],
                      ksigns[(aux >> (7 * l + 7)) & 127], out + 32 * g + 8 * l);
    }
  }
}

// IQ2_XS: 32 uint16s (a 9-bit grid index, a 7-bit sign index), then 16 4-bit scales, one per 16
// weights (low nibble first); db = d * (0.5 + scale) * 0.25.
inline void iq2_xs(const uint8_t* block, const float* grid, const uint8_t* ksigns, float* out) {
  const float d = half_value(block);
  const uint8_t* scales = block + 66;
  for (int s = 0; s < 16; ++s) {
    const float db = d * (0.5f + float(nibble(scales, s))) * 0.25f;
    const uint16_t q0 = u16(block + 4 * s + 2), q1 = u16(block + 4 * s + 4);
    const float *first = grid + 8 * (q0 & 511), *second = grid + 8 * (q1 & 511);
    signed_points16(db, first, first + 4, second, second + 4, ksigns[q0 >> 9], ksigns[q1 >> 9], out + 16 * s);
  }
}

// IQ2_S: 32 low bytes of 10-bit grid indices, 32 sign bytes, 8 bytes of the indices' top two bits
// (four an byte, low first), 16 4-bit scales as IQ2_XS's.
inline void iq2_s(const uint8_t* block, const float* grid, float* out) {
  const float d = half_value(block);
  const uint8_t *low = block + 2, *signs = block + 34, *high = block + 66, *scales = block + 74;
  for (int s = 0; s < 16; ++s) {
    const float db = d * (0.5f + float(nibble(scales, s))) * 0.25f;
    const int i = 2 * s;  // indices i and i + 1: the same byte of top bits, bits 2 (i % 4) on
    const float* first = grid + 8 * (low[i] | ((high[i / 4] >> (2 * (i % 4))) & 3) << 8);
    const float* second = grid + 8 * (low[i + 1] | ((high[i / 4] >> (2 * (i % 4) + 2)) & 3) << 8);
    signed_points16(db, first, first + 4, second, second + 4, signs[i], signs[i + 1], out + 8 * i);
  }
}

// IQ3_XXS: 64 grid indices of 4 values, then 8 uint32s as IQ2_XXS's second word (sign indices
// and a scale); db = d * (0.5 + scale) * 0.5.
inline void iq3_xxs(const uint8_t* block, const float* grid, const uint8_t* ksigns, float* out) {
  const float d = half_value(block);
  const uint8_t* indices = block + 2;
  for (int g = 0; g < 8; ++g) {
    const uint32_t aux = u32(block + 66 + 4 * g);
    const float db = d * (0.5f + float(aux >> 28)) * 0.5f;
    const uint8_t* group = indices + 8 * g;
    for (int l = 0; l < 4; l += 2)
      signed_points16(db, grid + 4 * group[2 * l], grid + 4 * group[2 * l + 1], grid + 4 * group[2 * l + 2],
                      grid + 4 * group[2 * l + 3], ksigns[(aux >> (7 * l)) & 127], ksigns[(aux >> (7 * l + 7)) & 127],
                      out + 32 * g + 8 * l);
  }
}

// IQ3_S: 64 low bytes of 9-bit grid indices (4 values each), 8 bytes of their top bits, 32 sign
// bytes, 8 4-bit scales (one per 32 weights); db = d * (1 + 2 scale).
inline void iq3_s(const uint8_t* block, const float* grid, float* out) {
  const float d = half_value(block);
  const uint8_t *low = block + 2, *high = block + 66, *signs = block + 74, *scales = block + 106;
  for (int g = 0; g < 8; ++g) {
    const float db = d * float(1 + 2 * nibble(scales, g));
    const unsigned top = high[g];  // the ninth bits of the group's 8 indices, bit k for index 8g + k
    const uint8_t* group = low + 8 * g;
    auto row = [&](int k) { return grid + 4 * (group[k] | (top << (8 - k) & 256)); };  // index 8g + k's row
    for (int l = 0; l < 4; l += 2)
      signed_points16(db, row(2 * l), row(2 * l + 1), row(2 * l + 2), row(2 * l + 3), signs[4 * g + l],
                      signs[4 * g + l + 1], out + 32 * g + 8 * l);
  }
}

// 8 values: dl * (grid point + delta).
inline void shifted_points(v8 dl, const float* point, v8 delta, float* out) {
  v8 values;
  std::memcpy(&values, point, 32);
  values = dl * (values + delta);
  std::memcpy(out, &values, 32);
}

constexpr float IQ1_DELTA = 0.125f;

// IQ1_S: 32 low bytes of 11-bit grid indices (values -1, 0, 1), then 8 uint16s, one per 32
// weights: four 3-bit index tops, a 3-bit scale, the sign of the shift by delta.
inline void iq1_s(const uint8_t* block, const float* grid, float* out) {
  const float d = half_value(block);
  const uint8_t* low = block + 2;
  for (int g = 0; g < 8; ++g) {
    const uint16_t qh = u16(block + 34 + 2 * g);
    const v8 dl = broadcast8(d * float(2 * ((qh >> 12) & 7) + 1));
    const v8 delta = broadcast8(qh & 0x8000 ? -IQ1_DELTA : IQ1_DELTA);
    for (int l = 0; l < 4; ++l)
      shifted_points(dl, grid + 8 * (low[4 * g + l] | ((qh >> (3 * l)) & 7) << 8), delta, out + 32 * g + 8 * l);
  }
}

// IQ1_M: 32 low bytes of 11-bit grid indices, 16 bytes of nibbles (an index's three top bits and
// the sign of its shift, low nibble first), 4 uint16s: 3-bit scales (one per 16 weights) and,
// in their top nibbles, the float16 d.
inline void iq1_m(const uint8_t* block, const float* grid, float* out) {
  const uint8_t *low = block, *high = block + 32, *packed = block + 48;
  uint16_t s[4];
  for (int i = 0; i < 4; ++i) s[i] = u16(packed + 2 * i);
  const uint16_t d_bits = uint16_t((s[0] & 0xF000) >> 12 | (s[1] & 0xF000) >> 8 | (s[2] & 0xF000) >> 4 | (s[3] & 0xF000));
  const float d = half_value(reinterpret_cast<const uint8_t*>(&d_bits));
  for (int h = 0; h < 16; ++h) {  // 16 weights each
    const v8 dl = broadcast8(d * float(2 * ((s[h / 4] >> (3 * (h % 4))) & 7) + 1));
    for (int p = 0; p < 2; ++p) {
      const int i = 2 * h + p;
      const int top = nibble(high, i);  // index i's three top bits and its shift's sign
      const v8 delta = broadcast8(top & 8 ? -IQ1_DELTA : IQ1_DELTA);
      shifted_points(dl, grid + 8 * (low[i] | (top & 7) << 8), delta, out + 8 * i);
    }
  }
}

}  // namespace lattice

// One row of K weights (whole 256-weight blocks) of a lattice format into out (float32).
inline void dequantize_lattice_row(int64_t format, const uint8_t* row, float* out, int64_t K) {
  const LatticeTables& tables = lattice_tables();
  const float* grid = tables.grid[format].data();
  const bool reads_ksigns = format == IQ2_XXS || format == IQ2_XS || format == IQ3_XXS;
  TORCH_CHECK(!tables.grid[format].empty() && (tables.have_signs || !reads_ksigns),
              say("draftwise kernels: the codebook or sign table of weight format ", format,
                  " was not given (set_lattice_grid / set_lattice_signs)"));
  const int64_t bytes = layout(format).bytes;
  for (int64_t b = 0; b < K / 256; ++b, row += bytes, out += 256) {
    prefetch_ahead(row, bytes);  // the rows after this one: a matrix's rows lie one after another
    switch (format) {
      case IQ2_XXS: lattice::iq2_xxs(row, grid, tables.ksigns, out); break;
      case IQ2_XS: lattice::iq2_xs(row, grid, tables.ksigns, out); break;
      case IQ2_S: lattice::iq2_s(row, grid, out); break;
      case IQ3_XXS: lattice::iq3_xxs(row, grid, tables.ksigns, out); break;
      case IQ3_S: lattice::iq3_s(row, grid, out); break;
      case IQ1_S: lattice::iq1_s(row, grid, out); break;
      case IQ1_M: lattice::iq1_m(row, grid, out); break;
    }
  }
}

}  // namespace draftwise
