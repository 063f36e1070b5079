// y = x @ w.T for a few rows of x (a decode step: the last token plus its draft), float32.
//
// MKL's sgemm reads the weight once for up to 3 rows and again for every 3 more, so verifying
// a 10-token draft cost 2.1x a one-token step on this project's CPU. This kernel reads each
// weight row once from memory for any number of rows: it takes R weight rows at a time and
// runs every x row against them while they sit in L1/L2. Its rows are dot products over the
// whole of K in one fixed order, so row m of y is bit-identical whatever the number of rows
// alongside it (a verified token gets exactly the logits plain decoding would give it).
//
// Written with GCC/Clang vector extensions, not intrinsics: the compiler lowers v16 to one
// AVX-512 register, two AVX2 ones or four NEON ones, whatever the -march it is built for.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

constexpr int ROWS_OF_W = 4;  // weight rows per block: 4 rows x up to 6 x-rows = 24 accumulators
constexpr int ROWS_OF_X = 6;  // x rows per pass over a block (registers: 24 acc + 4 weights)

inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, sizeof v); return v; }

inline float horizontal_sum(v16 v) {
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// y[m, n + r] for m < NUM_X, r < NUM_W: x [NUM_X rows of K], w [NUM_W rows of K] from row n.
template <int NUM_X, int NUM_W>
inline void block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n) {
  const int64_t k_vec = K / 16 * 16;
  v16 acc[NUM_X][NUM_W];
#pragma GCC unroll 8
  for (int m = 0; m < NUM_X; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < NUM_W; ++r) acc[m][r] = v16{};
  for (int64_t k = 0; k < k_vec; k += 16) {
    v16 weights[NUM_W];
#pragma GCC unroll 8
    for (int r = 0; r < NUM_W; ++r) weights[r] = load16(w + (n + r) * K + k);
#pragma GCC unroll 8
    for (int m = 0; m < NUM_X; ++m) {
      const v16 xs = load16(x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < NUM_W; ++r) acc[m][r] += xs * weights[r];
    }
  }
  for (int m = 0; m < NUM_X; ++m)
    for (int r = 0; r < NUM_W; ++r) {
      float sum = horizontal_sum(acc[m][r]);
      for (int64_t k = k_vec; k < K; ++k) sum += x[m * K + k] * w[(n + r) * K + k];
      y[m * N + n + r] = sum;
    }
}

// Every row of x against NUM_W weight rows from row n, ROWS_OF_X x-rows per pass.
template <int NUM_W>
void all_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n) {
  for (int64_t m0 = 0; m0 < M; m0 += ROWS_OF_X) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    switch (std::min<int64_t>(ROWS_OF_X, M - m0)) {
      case 1: block<1, NUM_W>(xm, w, ym, K, N, n); break;
      case 2: block<2, NUM_W>(xm, w, ym, K, N, n); break;
      case 3: block<3, NUM_W>(xm, w, ym, K, N, n); break;
      case 4: block<4, NUM_W>(xm, w, ym, K, N, n); break;
      case 5: block<5, NUM_W>(xm, w, ym, K, N, n); break;
      default: block<6, NUM_W>(xm, w, ym, K, N, n); break;
    }
  }
}

}  // namespace

// x [M, K] float32 contiguous, weight [N, K] float32 contiguous -> [M, N].
torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "skinny_linear: shapes ",
              x.sizes(), " and ", weight.sizes(), " do not multiply");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "skinny_linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "skinny_linear: contiguous tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t num_blocks = N / ROWS_OF_W;
  // Threads split the weight rows: each streams its own contiguous part of the weight.
  at::parallel_for(0, num_blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) all_rows<ROWS_OF_W>(xp, wp, yp, M, K, N, b * ROWS_OF_W);
  });
  for (int64_t n = num_blocks * ROWS_OF_W; n < N; ++n) all_rows<1>(xp, wp, yp, M, K, N, n);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "y = x @ weight.T for a few rows of x, float32");
}
