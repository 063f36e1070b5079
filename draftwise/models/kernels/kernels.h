// draftwise's CPU kernels; each computes a row of its output with the same arithmetic whatever
// the other rows (see vec.h).
#pragma once

#include "vec.h"

#include <vector>

namespace draftwise {

// x [M, K] float32 @ W.T, W [N, bytes per row] uint8 holding N rows of K weights in `format`
// (a GGML type id: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
// IQ4_NL, IQ4_XS) -> [M, N] float32.
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t K);
// The same product with each row of x rounded to 8 bits per 32 columns and exact integer dot
// products (quantized block formats only); see int8_linear.cpp. int8_dot_in_hardware: whether
// this build has AVX-512 VNNI's one-instruction byte dot product (AVX2 takes three to its one).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t K);
bool int8_dot_in_hardware();
// The same product with each row of x rounded to 15 bits (a sign and 14) per 256 columns and exact
// integer dot products (K-quant formats: Q4_K, Q5_K, Q6_K); see int16_linear.cpp.
at::Tensor int16_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t K);
// Whether this build multiplies int16 activations with vector instructions (AVX2's vpmaddwd, or
// AVX-512 VNNI's vpdpwssd where the build has it; the
// portable loops compute the same integers, much slower).
bool int16_dot_in_hardware();
// The same product with x and W's values rounded to bfloat16, products summed in float32 (any
// format); see bf16_linear.cpp. bf16_dot_in_hardware: whether this build has AVX-512 BF16's
// dot product (otherwise the same arithmetic runs in float32 instructions, slower).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t K);
bool bf16_dot_in_hardware();
// The same rounding of x and W to bfloat16, the products summed by AMX tiles (an arithmetic of
// its own, batch-invariant too); see amx_linear.cpp. amx_in_hardware: whether this build has AMX-
// BF16 and the OS lets this process use its tiles (amx_linear raises otherwise).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t K);
// amx_linear of one x with several weights (a layer's q, k and v; gate and up) in one call: x is
// rounded and laid out once, the weights' work items share one parallel region; the same bits.
std::vector<at::Tensor> amx_linears(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                    const std::vector<int64_t>& formats, int64_t K);
bool amx_in_hardware();
// rows ids [T] of W, dequantised -> [T, K] float32 (an embedding lookup on quantized weights).
at::Tensor dequantize_rows(const at::Tensor& weight, int64_t format, int64_t K, const at::Tensor& ids);
// x [T, H] -> x / sqrt(mean(x^2) + eps) * weight, row by row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// logits [N, V] float32 -> [N] int64: each row's argmax, the first of equal maxima, a NaN counting
// as the largest (its first one): what torch's max(dim=-1).indices gives.
at::Tensor argmax_rows(const at::Tensor& logits);
// silu(gate) * up, elementwise, [T, I].
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);
// gelu(gate) * up with GELU's tanh approximation (PyTorch's approximate="tanh"), elementwise, [T, I].
at::Tensor gelu_tanh_mul(const at::Tensor& gate, const at::Tensor& up);
// Rotary position embedding of x [T, H, D] in place, cos / sin [T, D]; bit for bit PyTorch's
// x * cos + rotate_half(x) * sin.
void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// Attention of new queries over a cache; see rowwise.cpp.
at::Tensor attention(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                        int64_t start, const at::Tensor& mask, double scale, bool amx_scores = false,
                        int64_t window = 0);
// One sequence's share of a batched forward's attention: its T new queries [T, H, D] (their keys
// and values already at cache slots start..start+T-1), its cache's keys and values [H_kv,
// capacity, D] (rows contiguous; k_stride / v_stride elements from one head to the next), float32
// or, where bf16, bfloat16 (uint16_t bits), its mask [T, T] (nullptr: causal) and where its
// output rows [T, H, D] go.
struct AttentionSpan {
  const float* queries;
  const void* keys;
  const void* values;
  bool bf16;
  int64_t k_stride, v_stride;
  const bool* mask;
  float* out;
  int64_t T, start;
  // The mask's columns: the span's last mask_width slots (its T new rows and the mask_width - T
  // slots before them; 0: T). Every query sees the slots before those.
  int64_t mask_width = 0;
  // A bfloat16 cache's scores on AMX tiles, the queries rounded to bfloat16 (the model's linears
  // run on AMX tiles too): see rowwise.cpp's amx_scores. Ignored for a float32 cache, a head_dim
  // that is not a multiple of 32, without AMX, or after use_amx_scores(false).
  bool amx_scores = false;
  // A sliding window (Gemma 3's local layers), 0 for none: each query sees only the last `window`
  // keys of those it would see without one (its own included): positions p - window + 1 .. p.
  int64_t window = 0;
};
// attention() for every span at once, in one parallel region: each query's arithmetic is
// attention()'s, so the bits are the same.
void attention_spans(const std::vector<AttentionSpan>& spans, int64_t H, int64_t H_kv, int64_t D, double scale);
// Whether attention over a bfloat16 cache computes its scores on AMX tiles where asked
// (AttentionSpan.amx_scores): this build and CPU have AMX and use_amx_scores(false) was not
// called (benchmarks/attention_scores.py compares both in one process).
bool amx_scores_enabled();
void use_amx_scores(bool on);

}  // namespace draftwise
