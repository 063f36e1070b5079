// draftwise's CPU kernels; each computes a row of its output with the same arithmetic whatever
// the other rows (see vec.h).
#pragma once

#include "vec.h"

namespace draftwise {

// x [M, K] float32 @ W.T, W [N, bytes per row] uint8 holding N rows of K weights in `format`
// (a GGML type id: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K) -> [M, N] float32.
torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t format, int64_t K);
// The same product with each row of x rounded to 8 bits per 32 columns and exact integer dot
// products (quantized block formats only); see int8_linear.cpp.
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t format, int64_t K);
// rows ids [T] of W, dequantised -> [T, K] float32 (an embedding lookup on quantized weights).
torch::Tensor dequantize_rows(const torch::Tensor& weight, int64_t format, int64_t K, const torch::Tensor& ids);
// x [T, H] -> x / sqrt(mean(x^2) + eps) * weight, row by row.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
// silu(gate) * up, elementwise, [T, I].
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);
// Attention of new queries over a cache; see attention.cpp.
torch::Tensor attention(const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
                        int64_t start, const torch::Tensor& mask, double scale);

}  // namespace draftwise
