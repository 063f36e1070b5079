// y = x @ W.T with W stored as shipped: float32, float16, bfloat16 or GGUF's quantized blocks
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K), x and y float32.
//
// A decode step (the last token plus its draft, up to a few dozen rows) is bound by the bytes
// of W it reads. Each group of 4 weight rows is read once, dequantised into a small float32
// buffer (L1/L2) and multiplied against every row of x while it sits there: 4-bit blocks are
// ~7x fewer bytes than float32. A prefill (many rows) dequantises W once and runs a blocked
// product over it.
//
// Batch invariance: y[m, n] is always the same arithmetic: 16-lane partial sums over K in
// order (one fused multiply-add per lane per 16 columns), one fixed horizontal sum, then the
// K % 16 tail in order. Both paths below keep exactly that sequence per output, so a row of y
// is bit-identical whether x has 1 row, 9, or 2000, and whatever threads split the work.
// Dequantisation reproduces the GGUF reference (gguf-py) bit for bit: products are rounded
// separately (no fused multiply-add), as numpy rounds them.
#include "formats.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace draftwise {
namespace {

constexpr int ROWS_OF_W = 4;  // weight rows per block: 4 x 6 = 24 accumulators + 4 weights
constexpr int ROWS_OF_X = 6;
constexpr int64_t SKINNY_MAX_ROWS = 32;  // more rows than this: the prefill path

// 16 unsigned bytes -> 16 int32 lanes. Spelled with intrinsics where they exist: GCC lowers
// __builtin_convertvector(uint8 x 16 -> int32 x 16) to scalar code (measured: 4x slower).
inline vi16 widen(const uint8_t* p) {
  vi16 out;
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &v, sizeof out);
#elif defined(__AVX2__)
  const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i high = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&out, &low, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &high, 32);
#else
  for (int i = 0; i < 16; ++i) out[i] = p[i];
#endif
  return out;
}
inline v16 to_float(vi16 v) { return __builtin_convertvector(v, v16); }

// One row of K weights from its blocks into out, 16 lanes at a time. The result is gguf-py's
// dequantisation bit for bit: every product below is exact in float32 (a float16 scale, times
// a scale of at most 6 bits, times a quantized value of at most 8 bits, needs at most 25
// significant bits only for Q6_K, which adds nothing after it), so a fused multiply-add
// rounds exactly as numpy's separate multiply and add do.
void dequantize_row(int64_t format, const uint8_t* row, float* out, int64_t K) {
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
    case Q4_0:
    case Q4_1: {
      const bool with_min = format == Q4_1;
      const int64_t bytes = with_min ? 20 : 18;
      for (int64_t b = 0; b < K / 32; ++b, row += bytes, out += 32) {
        const float d = half_to_float(row);
        const vi16 qs = widen(row + (with_min ? 4 : 2));
        if (with_min) {
          const float m = half_to_float(row + 2);
          store16(out, d * to_float(qs & 15) + m);
          store16(out + 16, d * to_float(qs >> 4) + m);
        } else {
          store16(out, d * to_float((qs & 15) - 8));
          store16(out + 16, d * to_float((qs >> 4) - 8));
        }
      }
      return;
    }
    case Q5_0:
    case Q5_1: {
      const bool with_min = format == Q5_1;
      const int64_t bytes = with_min ? 24 : 22;
      const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      for (int64_t b = 0; b < K / 32; ++b, row += bytes, out += 32) {
        const float d = half_to_float(row);
        uint32_t qh;
        std::memcpy(&qh, row + (with_min ? 4 : 2), 4);
        const vi16 qs = widen(row + (with_min ? 8 : 6));
        const vi16 high_bits = vi16{} + int32_t(qh);
        const vi16 low = (qs & 15) | ((high_bits >> lane) & 1) << 4;
        const vi16 high = (qs >> 4) | ((high_bits >> (lane + 16)) & 1) << 4;
        if (with_min) {
          const float m = half_to_float(row + 2);
          store16(out, d * to_float(low) + m);
          store16(out + 16, d * to_float(high) + m);
        } else {
          store16(out, d * to_float(low - 16));
          store16(out + 16, d * to_float(high - 16));
        }
      }
      return;
    }
    case Q8_0:
      for (int64_t b = 0; b < K / 32; ++b, row += 34, out += 32) {
        const float d = half_to_float(row);
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          const vi16 values = (widen(row + 2 + 16 * half) ^ 128) - 128;  // int8 -> int32
          store16(out + 16 * half, to_float(values) * d);
        }
      }
      return;
    case Q4_K:
      for (int64_t b = 0; b < K / 256; ++b, row += 144, out += 256) {
        const float d = half_to_float(row), dmin = half_to_float(row + 2);
        const uint8_t* sc = row + 4;  // 12 bytes: 8 six-bit scales and 8 six-bit mins
        const uint8_t* qs = row + 16;
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const int scale = j < 4 ? sc[j] & 63 : (sc[j + 4] & 15) | (sc[j - 4] >> 6) << 4;
          const int min = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | (sc[j] >> 6) << 4;
          const float d1 = d * float(scale), m1 = dmin * float(min);
          const int shift = (j % 2) * 4;
#pragma GCC unroll 2
          for (int half = 0; half < 2; ++half) {
            const vi16 q = widen(qs + (j / 2) * 32 + 16 * half);
            store16(out + j * 32 + 16 * half, d1 * to_float((q >> shift) & 15) - m1);
          }
        }
      }
      return;
    case Q6_K:
      for (int64_t b = 0; b < K / 256; ++b, row += 210, out += 256) {
        const uint8_t* ql = row;
        const uint8_t* qh = row + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
        const float d = half_to_float(row + 208);
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
#pragma GCC unroll 8
          for (int l = 0; l < 128; l += 16) {  // 16 weights sharing one scale
            const vi16 low = (widen(ql + half * 64 + l % 64) >> (4 * (l / 64))) & 15;
            const vi16 high = (widen(qh + half * 32 + l % 32) >> (2 * (l / 32))) & 3;
            const float scale = d * float(sc[(half * 128 + l) / 16]);
            store16(out + half * 128 + l, scale * to_float((low | high << 4) - 32));
          }
        }
      }
      return;
  }
  TORCH_CHECK(false, "draftwise kernels: cannot dequantise weight format ", format);
}

// acc[m][r] for the K % 16 tail and the final sum: shared by both paths, so they agree.
inline float finish(v16 acc, const float* x, const float* w, int64_t k_vec, int64_t K) {
  float sum = horizontal_sum(acc);
  for (int64_t k = k_vec; k < K; ++k) sum = __builtin_fmaf(x[k], w[k], sum);
  return sum;
}

// partial[i * cols + j] (16 lanes) += x row i . w row j over columns k0..k1 (multiples of 16),
// for NUM_X <= 6 x rows and NUM_W <= 4 weight rows held in 24 registers: one fused
// multiply-add per lane per 16 columns, in column order. Both paths below run every output
// through this loop, then finish(): they agree bit for bit by construction.
template <int NUM_X, int NUM_W>
inline void micro(const float* x, const float* w, v16* partial, int64_t K, int64_t k0, int64_t k1, int64_t cols) {
  v16 acc[NUM_X][NUM_W];
#pragma GCC unroll 8
  for (int i = 0; i < NUM_X; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NUM_W; ++j) acc[i][j] = partial[i * cols + j];
  for (int64_t k = k0; k < k1; k += 16) {
    v16 weights[NUM_W];
#pragma GCC unroll 8
    for (int j = 0; j < NUM_W; ++j) weights[j] = load16(w + j * K + k);
#pragma GCC unroll 8
    for (int i = 0; i < NUM_X; ++i) {
      const v16 xs = load16(x + i * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < NUM_W; ++j) acc[i][j] += xs * weights[j];
    }
  }
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
  micro<NUM_X, NUM_W>(x, w, partial, K, 0, k_vec, NUM_W);
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

// A per-thread scratch buffer of at least size floats, aligned to 64 bytes (v16 loads).
float* thread_buffer(int64_t size) {
  static thread_local std::vector<float> buffer;
  if (int64_t(buffer.size()) < size + 16) buffer.resize(size + 16);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((address + 63) & ~uintptr_t(63));
}

// Few rows: each thread takes whole groups of 4 weight rows, dequantises them once and runs
// every x row against them.
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

// Many rows: W dequantised once into float32, then a product blocked over M, N and K so that
// the x and W tiles stay in L2. The 16-lane partial sums are parked in `partial` between K
// blocks: per output, the same sequence of fused multiply-adds as block<> above.
constexpr int64_t TILE_M = 48, TILE_N = 64, TILE_K = 256;

template <int NUM_W>
inline void micro_rows(int64_t num_x, const float* x, const float* w, v16* partial, int64_t K, int64_t k0,
                       int64_t k1, int64_t cols) {
  switch (num_x) {
    case 1: micro<1, NUM_W>(x, w, partial, K, k0, k1, cols); break;
    case 2: micro<2, NUM_W>(x, w, partial, K, k0, k1, cols); break;
    case 3: micro<3, NUM_W>(x, w, partial, K, k0, k1, cols); break;
    case 4: micro<4, NUM_W>(x, w, partial, K, k0, k1, cols); break;
    case 5: micro<5, NUM_W>(x, w, partial, K, k0, k1, cols); break;
    default: micro<6, NUM_W>(x, w, partial, K, k0, k1, cols); break;
  }
}

void tile_product(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                  int64_t m0, int64_t n0) {
  const int64_t rows = std::min(TILE_M, M - m0), cols = std::min(TILE_N, N - n0);
  const int64_t k_vec = K / 16 * 16;
  v16* partial = reinterpret_cast<v16*>(thread_buffer(TILE_M * TILE_N * 16));
  for (int64_t i = 0; i < rows * cols; ++i) partial[i] = v16{};
  for (int64_t k0 = 0; k0 < k_vec; k0 += TILE_K) {
    const int64_t k1 = std::min(k0 + TILE_K, k_vec);
    for (int64_t c = 0; c < cols; c += ROWS_OF_W) {
      const int64_t num_w = std::min<int64_t>(ROWS_OF_W, cols - c);
      for (int64_t r = 0; r < rows; r += ROWS_OF_X) {
        const int64_t num_x = std::min<int64_t>(ROWS_OF_X, rows - r);
        const float* xr = x + (m0 + r) * K;
        v16* pr = partial + r * cols + c;
        if (num_w == ROWS_OF_W) {
          micro_rows<ROWS_OF_W>(num_x, xr, w + (n0 + c) * K, pr, K, k0, k1, cols);
        } else {
          for (int64_t j = 0; j < num_w; ++j) micro_rows<1>(num_x, xr, w + (n0 + c + j) * K, pr + j, K, k0, k1, cols);
        }
      }
    }
  }
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

}  // namespace

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t K) {
  check_weight(weight, format, K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "blocked_linear: x ", x.sizes(), " does not have ", K, " columns");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "blocked_linear: x must be contiguous float32");
  const int64_t M = x.size(0), N = weight.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto run = M <= SKINNY_MAX_ROWS ? skinny : prefill;
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
    TORCH_CHECK(0 <= id[t] && id[t] < N, "dequantize_rows: row ", id[t], " out of range 0..", N - 1);
    if (format == F32) {
      std::memcpy(out.data_ptr<float>() + t * K, w + id[t] * row_bytes, K * 4);
    } else {
      dequantize_row(format, w + id[t] * row_bytes, out.data_ptr<float>() + t * K, K);
    }
  }
  return out;
}

}  // namespace draftwise
