// Row-wise ops of the decoder (RMSNorm, SiLU-gated product, attention over the KV cache), each
// computing a token's row with the same arithmetic however many tokens the forward holds: a
// prefill chunk, a draft, a tree, or one token.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace draftwise {
namespace {

// Sum of x[0..n) in a fixed order for a given n: 16 lanes, then the horizontal sum, then the tail.
inline float ordered_sum_of_squares(const float* x, int64_t n) {
  v16 acc{};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const v16 v = load16(x + k);
    acc += v * v;
  }
  float sum = horizontal_sum(acc);
  for (; k < n; ++k) sum = __builtin_fmaf(x[k], x[k], sum);
  return sum;
}

inline float dot(const float* a, const float* b, int64_t D) {  // D % 16 == 0
  v16 acc = load16(a) * load16(b);
  for (int64_t d = 16; d < D; d += 16) acc += load16(a + d) * load16(b + d);
  return horizontal_sum(acc);
}

// e^(x - max) in place for x[0..n), returns their sum (fixed order for a given n).
inline float exp_and_sum(float* x, int64_t n, float max) {
  v16 total{};
  for (int64_t k = 0; k < n; k += 16) {
    float lanes[16];
    const int64_t valid = std::min<int64_t>(16, n - k);
    for (int i = 0; i < 16; ++i) lanes[i] = i < valid ? x[k + i] : max;
    v16 e = exp16(load16(lanes) - max);
    store16(lanes, e);
    for (int i = 0; i < 16; ++i) lanes[i] = i < valid ? lanes[i] : 0.0f;  // padding adds nothing
    std::memcpy(x + k, lanes, valid * sizeof(float));
    total += load16(lanes);
  }
  return horizontal_sum(total);
}

std::vector<float>& scratch() {
  static thread_local std::vector<float> buffer;
  return buffer;
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "rms_norm: x must be [T, H] float32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == torch::kFloat &&
              weight.is_contiguous(), "rms_norm: weight must be [H] float32");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = xp + t * H;
      const float inverse = 1.0f / std::sqrt(ordered_sum_of_squares(row, H) / float(H) + float(eps));
      for (int64_t k = 0; k < H; ++k) op[t * H + k] = wp[k] * (row[k] * inverse);
    }
  });
  return out;
}

torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == torch::kFloat && up.scalar_type() == torch::kFloat &&
              gate.is_contiguous() && up.is_contiguous(), "silu_mul: gate and up must be contiguous float32 of one shape");
  auto out = torch::empty_like(gate);
  const int64_t n = gate.numel();
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // Every element, tail included, goes through the same vector code.
  at::parallel_for(0, (n + 15) / 16, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float gs[16] = {}, us[16] = {}, os[16];
      const int64_t k = c * 16, valid = std::min<int64_t>(16, n - k);
      std::memcpy(gs, g + k, valid * sizeof(float));
      std::memcpy(us, u + k, valid * sizeof(float));
      const v16 x = load16(gs);
      const v16 e = exp16(x < 0 ? x : -x);  // e^-|x|, never overflows
      const v16 silu = x < 0 ? x * e / (1.0f + e) : x / (1.0f + e);
      store16(os, silu * load16(us));
      std::memcpy(o + k, os, valid * sizeof(float));
    }
  });
  return out;
}

// queries [T, H, D]: T new tokens at cache slots start..start+T-1 (their keys and values are
// already written); keys / values [H_kv, capacity, D] (rows contiguous); mask [T, T] bool among
// the new tokens (True = may attend), or an empty tensor for causal order. Every query sees
// slots 0..start-1. -> [T, H, D].
//
// Each (query, head) gathers the scores of exactly the keys it may see, in slot order, into a
// compact row; the softmax and the weighted sum of values run over that row. A masked-out key
// is skipped, not added as zero weight, so a token of a tree or a draft gets the arithmetic it
// gets when decoded alone.
torch::Tensor attention(const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
                        int64_t start, const torch::Tensor& mask, double scale) {
  TORCH_CHECK(queries.dim() == 3 && queries.scalar_type() == torch::kFloat && queries.is_contiguous(),
              "attention: queries must be contiguous float32 [T, H, D]");
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && keys.scalar_type() == torch::kFloat &&
              values.scalar_type() == torch::kFloat && keys.stride(2) == 1 && values.stride(2) == 1 &&
              keys.stride(1) == keys.size(2) && values.stride(1) == values.size(2),
              "attention: keys and values must be float32 [H_kv, capacity, D] with contiguous rows");
  const int64_t T = queries.size(0), H = queries.size(1), D = queries.size(2), H_kv = keys.size(0);
  TORCH_CHECK(keys.size(2) == D && D % 16 == 0, "attention: head_dim ", D, " must match and be a multiple of 16");
  TORCH_CHECK(H % H_kv == 0, "attention: ", H, " heads do not group over ", H_kv, " key/value heads");
  TORCH_CHECK(start >= 0 && start + T <= keys.size(1), "attention: slots ", start, "+", T, " exceed the cache");
  const bool causal = mask.numel() == 0;
  TORCH_CHECK(causal || (mask.dim() == 2 && mask.size(0) == T && mask.size(1) == T &&
                         mask.scalar_type() == torch::kBool && mask.is_contiguous()),
              "attention: mask must be a contiguous bool [T, T] or empty");
  auto out = torch::empty_like(queries);
  const float* q = queries.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const bool* mp = causal ? nullptr : mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t group = H / H_kv, total = start + T;
  constexpr int64_t QUERIES = 8;  // queries per work item: each key row is loaded once for all of them
  const int64_t chunks = (T + QUERIES - 1) / QUERIES;
  at::parallel_for(0, H * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t h = item % H, t0 = (item / H) * QUERIES, nt = std::min(QUERIES, T - t0);
      const float* K = kp + (h / group) * keys.stride(0);
      const float* V = vp + (h / group) * values.stride(0);
      // Causal: no query of this chunk sees past its last token.
      const int64_t end = causal ? start + t0 + nt : total;
      auto visible = [&](int64_t i, int64_t j) {
        if (j < start) return true;
        const int64_t t = t0 + i, new_j = j - start;
        return causal ? new_j <= t : mp[t * T + new_j];
      };
      std::vector<float>& buffer = scratch();
      const int64_t row = end + 16;
      if (int64_t(buffer.size()) < QUERIES * (row + D)) buffer.resize(QUERIES * (row + D));
      float* scores = buffer.data();                 // [QUERIES][row]
      float* acc = buffer.data() + QUERIES * row;    // [QUERIES][D]
      int64_t count[QUERIES] = {};
      for (int64_t j = 0; j < end; ++j)
        for (int64_t i = 0; i < nt; ++i)
          if (visible(i, j)) scores[i * row + count[i]++] = dot(q + ((t0 + i) * H + h) * D, K + j * D, D) * float(scale);
      float total_weight[QUERIES];
      for (int64_t i = 0; i < nt; ++i) {
        float max = scores[i * row];
        for (int64_t c = 1; c < count[i]; ++c) max = std::max(max, scores[i * row + c]);
        total_weight[i] = exp_and_sum(scores + i * row, count[i], max);
        std::fill(acc + i * D, acc + (i + 1) * D, 0.0f);
      }
      int64_t used[QUERIES] = {};
      for (int64_t j = 0; j < end; ++j) {
        const float* v = V + j * D;
        for (int64_t i = 0; i < nt; ++i) {
          if (!visible(i, j)) continue;
          const float weight = scores[i * row + used[i]++];
          for (int64_t d = 0; d < D; d += 16) store16(acc + i * D + d, load16(acc + i * D + d) + weight * load16(v + d));
        }
      }
      for (int64_t i = 0; i < nt; ++i) {
        const float inverse = 1.0f / total_weight[i];
        float* o = op + ((t0 + i) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[i * D + d] * inverse;
      }
    }
  });
  return out;
}

}  // namespace draftwise
