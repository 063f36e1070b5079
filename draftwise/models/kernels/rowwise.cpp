// Row-wise ops of the decoder (RMSNorm, SiLU-gated product, attention over the KV cache), each
// computing a token's row with the same arithmetic however many tokens the forward holds: a
// prefill chunk, a draft, a tree, or one token.
#include "kernels.h"
#include "message.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#define DRAFTWISE_AMX_SCORES 1
#endif

namespace draftwise {
namespace {

std::atomic<bool> amx_scores_allowed{true};  // use_amx_scores(): off compares with float32 scores

#if defined(DRAFTWISE_AMX_SCORES)
struct ScoreTiles {  // ldtilecfg's 64-byte layout
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// The raw scores (before the scale) of an item's queries with the cache's keys at slots
// 0 .. end - 1, on AMX tiles: out[query * row + slot] = the tile's sum of bf16(query) x key
// (a bfloat16 cache's keys, as stored), 32 dimensions a step in order from zero. Each element is
// the hardware's per-element sum of its key row and its query column, whatever else the tiles
// hold (amx_linear.cpp relies on the same property, measured), so a query's score for a key is
// the same bits whatever other queries and keys share the forward. queries[q]: q's D floats;
// out has room for a multiple of 16 query rows and 16 slots past end. Slots before `first` (a
// sliding window's start: no query here sees them) are not scored.
void amx_scores(const float* const* queries, int64_t num_queries, const uint16_t* K, int64_t first, int64_t end,
                int64_t total, int64_t D, float* out, int64_t row) {
  ScoreTiles config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
  const int64_t steps = D / 32, groups = (num_queries + 15) / 16;
  // B tiles: per group of 16 queries and step, row r holds each query's bfloat16 pair 2r, 2r + 1
  // of the step's 32 dimensions (zeros for missing queries).
  static thread_local std::vector<uint32_t> b;
  static thread_local std::vector<uint16_t> rounded;
  static thread_local std::vector<uint16_t> tail;
  static thread_local std::vector<float> c;
  b.assign(groups * steps * 256, 0u);
  rounded.resize(D);
  tail.resize(16 * D);
  c.resize(4 * 256);
  for (int64_t q = 0; q < num_queries; ++q) {
    round_to_bf16(queries[q], rounded.data(), D);
    const int64_t g = q / 16, column = q % 16;
    for (int64_t step = 0; step < steps; ++step)
      for (int64_t r = 0; r < 16; ++r) {
        uint32_t pair;
        std::memcpy(&pair, rounded.data() + step * 32 + 2 * r, 4);
        b[(g * steps + step) * 256 + r * 16 + column] = pair;
      }
  }
  for (int64_t j0 = first / 16 * 16; j0 < end; j0 += 16) {
    const uint16_t* keys = K + j0 * D;
    // The hardware prefetchers do not follow a tile's rows (amx_linear.cpp's pair_products): ask
    // for the keys two blocks ahead (a forward's cache is read from memory, not from L2).
    if (j0 + 48 <= total)
      for (int64_t line = 0; line < 16 * D * 2; line += 64) __builtin_prefetch(reinterpret_cast<const char*>(keys + 32 * D) + line);
    if (j0 + 16 > total) {  // the last rows of the cache's filled part: read no slot past it
      std::fill(tail.begin(), tail.end(), uint16_t(0));
      std::memcpy(tail.data(), keys, (total - j0) * D * sizeof(uint16_t));
      keys = tail.data();
    }
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
      const int64_t n = std::min<int64_t>(4, groups - g0);
      _tile_zero(4);
      if (n > 1) _tile_zero(5);
      if (n > 2) _tile_zero(6);
      if (n > 3) _tile_zero(7);
      for (int64_t step = 0; step < steps; ++step) {
        _tile_loadd(0, keys + step * 32, D * 2);
        const uint32_t* bs = b.data() + step * 256;
        _tile_loadd(1, bs + g0 * steps * 256, 64);
        _tile_dpbf16ps(4, 0, 1);
        if (n > 1) {
          _tile_loadd(2, bs + (g0 + 1) * steps * 256, 64);
          _tile_dpbf16ps(5, 0, 2);
        }
        if (n > 2) {
          _tile_loadd(3, bs + (g0 + 2) * steps * 256, 64);
          _tile_dpbf16ps(6, 0, 3);
        }
        if (n > 3) {
          _tile_loadd(1, bs + (g0 + 3) * steps * 256, 64);
          _tile_dpbf16ps(7, 0, 1);
        }
      }
      _tile_stored(4, c.data(), 64);
      if (n > 1) _tile_stored(5, c.data() + 256, 64);
      if (n > 2) _tile_stored(6, c.data() + 512, 64);
      if (n > 3) _tile_stored(7, c.data() + 768, 64);
      // c[group][key][query] -> out[query * row + j0 + key]
      for (int64_t g = 0; g < n; ++g)
        for (int64_t column = 0; column < 16 && (g0 + g) * 16 + column < num_queries; ++column) {
          float* o = out + ((g0 + g) * 16 + column) * row + j0;
          for (int64_t key = 0; key < 16; ++key) o[key] = c[g * 256 + key * 16 + column];
        }
    }
  }
  // No _tile_release here: the decoder's next linear loads its own configuration (amx_linear
  // releases at the end of its parallel region); releasing and reloading per work item cost a
  // 1-row forward more than the tiles saved.
}
#endif

// Sum of x[0..n) in a fixed order for a given n: 16 lanes, then the horizontal sum, then the tail.
inline float ordered_sum_of_squares(const float* x, int64_t n) {
  v16 acc{};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const v16 v = load16(x + k);
    acc = fmadd(v, v, acc);
  }
  float sum = horizontal_sum(acc);
  for (; k < n; ++k) sum = fmadd(x[k], x[k], sum);
  return sum;
}

// Cache rows are read in short runs (a few hundred slots of one head): the hardware prefetcher
// barely ramps up before a run ends, so the rows PREFETCH_ROWS ahead are asked for early
// (SmolLM2, 16 sequences x 1 token over 1,500-slot bfloat16 caches: 62-64 -> 50-56 ms a
// forward; one sequence over 3,800 slots: 19-20 -> 17-18.5 ms; AMX Xeon).
constexpr int64_t PREFETCH_ROWS = 16;
template <typename E>
inline void prefetch_row(const E* row, int64_t D) {
  for (int64_t byte = 0; byte < D * int64_t(sizeof(E)); byte += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + byte);
}

// Rows [first, last) of a bfloat16 cache head, widened to float32 into out (row first at out).
inline void widen_rows(const uint16_t* rows, int64_t first, int64_t last, int64_t D, float* out) {
  for (int64_t r = first; r < last; ++r)
    for (int64_t d = 0; d < D; d += 16) store16(out + (r - first) * D + d, load16(rows + r * D + d));
}

// b: float32 or bfloat16 (a KV cache's keys); either way the products and sums are float32.
template <typename E>
__attribute__((always_inline)) inline float dot(const float* a, const E* b, int64_t D) {  // D % 16 == 0
  v16 acc = load16(a) * load16(b);
  for (int64_t d = 16; d < D; d += 16) acc = fmadd(load16(a + d), load16(b + d), acc);
  return horizontal_sum(acc);
}

// dot() of each of NQ queries a[q] with NK rows b + k0 * D, b + (k0 + 1) * D, ... at once, each
// bit-identical to dot(): the same 16-lane products in the same order, then horizontal_sum's tree
// (horizontal_sums4 is that tree four times over, its instructions shared). The queries (a
// group's heads for one position) share every load of the keys. out[h][k0 + r]: query h, key r.
// Always inlined: called through attend's lambdas, GCC otherwise makes dot4<3, float> a call per
// four keys (SmolLM2's prefill over bfloat16 caches: 21% of its time in the call).
template <int NQ, int NK, typename E>
__attribute__((always_inline)) inline void dot_block(const float* const* a, const E* b, int64_t D, float* const* out,
                                                     int k0) {
  v16 acc[NQ][NK];
#pragma GCC unroll 4
  for (int r = 0; r < NK; ++r) {
    const v16 key = load16(b + (k0 + r) * D);
#pragma GCC unroll 4
    for (int h = 0; h < NQ; ++h) acc[h][r] = load16(a[h]) * key;
  }
  for (int64_t d = 16; d < D; d += 16) {
    v16 query[NQ];
#pragma GCC unroll 4
    for (int h = 0; h < NQ; ++h) query[h] = in_register(load16(a[h] + d));
#pragma GCC unroll 4
    for (int r = 0; r < NK; ++r) {
      const v16 key = load16(b + (k0 + r) * D + d);
#pragma GCC unroll 4
      for (int h = 0; h < NQ; ++h) acc[h][r] = fmadd(query[h], key, acc[h][r]);
    }
  }
  if constexpr (NK == 4) {  // each query's four sums together
#pragma GCC unroll 4
    for (int h = 0; h < NQ; ++h) {
      const v4 sums = horizontal_sums4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
      std::memcpy(out[h] + k0, &sums, sizeof sums);
    }
  } else {
    static_assert(NQ * NK == 4, "dot_block: four sums a block");
    const v16* all = &acc[0][0];  // [h][r] in order
    const v4 sums = horizontal_sums4(all[0], all[1], all[2], all[3]);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) out[s / NK][k0 + s % NK] = sums[s];
  }
}

// dot() of NQ queries with 4 keys. AVX2: a v16 is two of its 16 registers, so NQ x 4
// accumulators (up to 32) spilled to the stack on every multiply-add: queries in pairs against
// two keys at a time (8 registers), a last odd query against all four. AVX-512 holds them all.
template <int NQ, typename E>
__attribute__((always_inline)) inline void dot4(const float* const* a, const E* b, int64_t D, float* const* out) {
#if defined(DRAFTWISE_V16_PAIR)
#pragma GCC unroll 2
  for (int h = 0; h + 2 <= NQ; h += 2) {
    dot_block<2, 2>(a + h, b, D, out + h, 0);
    dot_block<2, 2>(a + h, b, D, out + h, 2);
  }
  if constexpr (NQ % 2 == 1) dot_block<1, 4>(a + NQ - 1, b, D, out + NQ - 1, 0);
#else
  dot_block<NQ, 4>(a, b, D, out, 0);
#endif
}

// out[h][0..D) += weights[h][c] * v[0..D) for each key c in order, for NH queries (a group's
// heads for one position) sharing every load of the values, the sums in registers (D = 16 * N).
// Each query's sum is the same sequence of multiply-adds whatever NH is. PREFETCH: ask for the
// rows ahead (values read from the cache; a widened tile is in L1 already, where the requests
// took a fifth of attention's time on the Zen 3).
template <int N, int NH, bool PREFETCH, typename E>
inline void weighted_sum(const float* const* weights, const int32_t* keys, int64_t count, const E* V, int64_t D,
                         float* const* out) {
  v16 acc[NH][N];
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) acc[h][n] = load16(out[h] + 16 * n);
#if defined(DRAFTWISE_V16_PAIR)
#pragma GCC unroll 2  // two keys an iteration: the loop's own instructions were as many as its 8 multiply-adds
#endif
  for (int64_t c = 0; c < count; ++c) {
    const E* v = V + int64_t(keys[c]) * D;
    if (PREFETCH && c + PREFETCH_ROWS < count) prefetch_row(V + int64_t(keys[c + PREFETCH_ROWS]) * D, D);
    v16 weight[NH];
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) weight[h] = in_register(broadcast16(weights[h][c]));
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
      const v16 value = load16(v + 16 * n);
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) acc[h][n] = fmadd(weight[h], value, acc[h][n]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) store16(out[h] + 16 * n, acc[h][n]);
}

// The weighted sums of heads h0..h0+nh of one position, NH_MAX at a time, the rest together
// (a group of 3 heads shares its value loads too).
template <int N, int NH_MAX, bool PREFETCH, typename E>
inline void weighted_sums(int64_t nh, const float* const* weights, const int32_t* keys, int64_t count, const E* V,
                          int64_t D, float* const* out) {
  int64_t h = 0;
  for (; h + NH_MAX <= nh; h += NH_MAX) weighted_sum<N, NH_MAX, PREFETCH>(weights + h, keys, count, V, D, out + h);
  if constexpr (NH_MAX > 1) {
    if (h < nh) weighted_sums<N, NH_MAX - 1, PREFETCH>(nh - h, weights + h, keys, count, V, D, out + h);
  }
}

// x[0..n) *= scale in place; returns their maximum.
inline float scale_and_max(float* x, int64_t n, float scale) {
  v16 top = v16{} - __builtin_inff();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const v16 v = load16(x + k) * scale;
    store16(x + k, v);
    top = select(v > top, v, top);
  }
  float max = -__builtin_inff();
  for (int i = 0; i < 16; ++i) max = std::max(max, top[i]);
  for (; k < n; ++k) {
    x[k] *= scale;
    max = std::max(max, x[k]);
  }
  return max;
}

// e^(x - max) in place for x[0..n), returns their sum (fixed order for a given n).
inline float exp_and_sum(float* x, int64_t n, float max) {
  v16 total{};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {  // whole vectors: what the masked step below computes when all 16 are valid
    const v16 e = exp16(load16(x + k) - max);
    store16(x + k, e);
    total += e;
  }
  for (; k < n; k += 16) {
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

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "rms_norm: x must be [T, H] float32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous(), "rms_norm: weight must be [H] float32");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = at::empty_like(x);
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

// One row's argmax. Each of the 16 lanes keeps its largest value and where it first saw it
// (only a larger value moves it, so ties keep the earlier index); the row's answer is the
// smallest such index among the lanes holding the overall maximum, then the tail. NaN compares
// false with everything, so a NaN never becomes a lane's maximum: rows holding one are found by
// a mask and answered by a scan for the first NaN. Greedy verification takes a step's argmaxes:
// torch's max(dim=-1) took 56 us a row over SmolLM2's 49,152 logits (AMX Xeon, 2 threads, torch
// 2.13), this loop a few.
static int64_t argmax_row(const float* x, int64_t V) {
  v16 top = v16{} - __builtin_inff();
  vi16 at{}, nan{};
  vi16 index;
  for (int i = 0; i < 16; ++i) index[i] = i;
  int64_t k = 0;
  for (; k + 16 <= V; k += 16, index += 16) {
    const v16 v = load16(x + k);
    const auto larger = v > top;
    top = select(larger, v, top);
    at = select(larger, index, at);
    nan |= select(v != v, vi16{} + 1, vi16{});
  }
  bool any_nan = false;
  for (int i = 0; i < 16; ++i) any_nan = any_nan || nan[i] != 0;
  for (int64_t t = k; t < V; ++t) any_nan = any_nan || x[t] != x[t];
  if (any_nan) {
    for (int64_t t = 0; t < V; ++t)
      if (x[t] != x[t]) return t;
  }
  float best = x[0];  // a row shorter than one step starts from its first value
  int64_t best_at = 0, tail = 1;
  if (k > 0) {
    for (int i = 0; i < 16; ++i) best = std::max(best, top[i]);
    best_at = V;
    for (int i = 0; i < 16; ++i)
      if (top[i] == best) best_at = std::min<int64_t>(best_at, at[i]);
    tail = k;
  }
  for (int64_t t = tail; t < V; ++t)
    if (x[t] > best) {
      best = x[t];
      best_at = t;
    }
  return best_at;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) > 0,
              "argmax_rows: logits must be contiguous float32 [N, V], V > 0");
  const int64_t N = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({N}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(x + r * V, V);
  });
  return out;
}

namespace {

// activation(gate) * up, elementwise: every element, tail included, goes through the same vector
// code, so an element's value never depends on how many rows the tensors hold.
template <typename Activation>
at::Tensor gated_product(const at::Tensor& gate, const at::Tensor& up, const char* name, Activation activation) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat &&
              gate.is_contiguous() && up.is_contiguous(),
              say(name, ": gate and up must be contiguous float32 of one shape"));
  auto out = at::empty_like(gate);
  const int64_t n = gate.numel();
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (n + 15) / 16, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float gs[16] = {}, us[16] = {}, os[16];
      const int64_t k = c * 16, valid = std::min<int64_t>(16, n - k);
      std::memcpy(gs, g + k, valid * sizeof(float));
      std::memcpy(us, u + k, valid * sizeof(float));
      store16(os, activation(load16(gs)) * load16(us));
      std::memcpy(o + k, os, valid * sizeof(float));
    }
  });
  return out;
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  return gated_product(gate, up, "silu_mul", [](v16 x) {
    const v16 e = exp16(select(x < 0, x, -x));  // e^-|x|, never overflows
    return select(x < 0, x * e / (1.0f + e), x / (1.0f + e));
  });
}

// gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), computed as x * sigmoid(2u)
// (the same function: 0.5 (1 + tanh(u)) = 1 / (1 + e^-2u)), with e^-|2u| so that nothing overflows.
at::Tensor gelu_tanh_mul(const at::Tensor& gate, const at::Tensor& up) {
  return gated_product(gate, up, "gelu_tanh_mul", [](v16 x) {
    const v16 twice_u = 1.5957691216057308f * (x + 0.044715f * (x * x * x));  // 2 sqrt(2 / pi) (x + 0.044715 x^3)
    const v16 e = exp16(select(twice_u < 0, twice_u, -twice_u));  // e^-|2u|
    return select(twice_u < 0, x * e / (1.0f + e), x / (1.0f + e));
  });
}

// One head's row of the rotary embedding. Its own function, never inlined, so that the
// attribute holds wherever it is called from (an OpenMP region is outlined into another function,
// which would not inherit it).
__attribute__((noinline, optimize("fp-contract=off"))) static void rotate_row(float* row, const float* c,
                                                                               const float* s, int64_t half) {
  for (int64_t d = 0; d < half; ++d) {
    const float low = row[d], high = row[d + half];
    const float out_low = low * c[d], rotated_low = -high * s[d];
    const float out_high = high * c[d + half], rotated_high = low * s[d + half];
    row[d] = out_low + rotated_low;
    row[d + half] = out_high + rotated_high;
  }
}

// Rotary position embedding, in place: x [T, H, D] (each row a head of a token), cos / sin
// [T, D]. Each element as PyTorch computes x * cos + rotate_half(x) * sin: both products rounded
// to float32, then their sum (no fused multiply-add: the same bits as the ops it replaces, so a
// model's logits do not change with it). rotate_half(x)[d] = -x[d + D/2] below D/2, x[d - D/2]
// above.
void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(2) % 2 == 0,
              "rotary: x must be contiguous float32 [T, H, D] with an even D");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->dim() == 2 && table->size(0) == T && table->size(1) == D && table->is_contiguous() &&
                    table->scalar_type() == at::kFloat,
                "rotary: cos and sin must be contiguous float32 [T, D]");
  float* data = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  at::parallel_for(0, T * H, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rotate_row(data + r * D, c + (r / H) * D, s + (r / H) * D, D / 2);
  });
}

namespace {

constexpr int64_t QUERIES = 8;  // positions per work item
constexpr int64_t TILE = 32;    // keys per tile: 16 KB of keys or values (D = 128), in L1 for every query

// Positions split into chunks of at most 8, as even as can be (9 -> 5 + 4, not 8 + 1: the threads
// share the work evenly). A query's arithmetic does not depend on its chunk.
int64_t num_chunks(int64_t T) { return (T + QUERIES - 1) / QUERIES; }

// The chunks of a forward's positions: at most QUERIES each (num_chunks). Where that makes few
// items that do not share out evenly over the threads (one sequence's 2-8 positions over
// SmolLM2's 3 key/value heads on 2 threads: one thread did two heads' work while the other did
// one), its positions go in more chunks, until they do. Which positions share an item only
// decides which loads they share, not any query's arithmetic. Measured (SmolLM2's attention over
// 300 / 1000 cached tokens, bf16 cache, 2 threads, AMX Xeon, 2026-11-26): 2 positions 19.5 ->
// 14.2 / 56 -> 40 us, 6 positions 47.6 -> 38.7 / 145 -> 119 us. One position's heads are not
// split: that cost 9.8 -> 11.0 / 25 -> 30 us, the key loads no longer shared by the group's heads.
int64_t balanced_chunks(int64_t T, int64_t H_kv, int64_t threads, bool alone) {
  const int64_t chunks = num_chunks(T);
  if (!alone || threads < 2 || H_kv * chunks % threads == 0 || H_kv * chunks >= 4 * threads) return chunks;
  for (int64_t more = chunks + 1; more <= T; ++more) {
    const int64_t per_chunk = (T + more - 1) / more, runs = (T + per_chunk - 1) / per_chunk;  // none empty
    if (H_kv * runs % threads == 0) return runs;
  }
  return chunks;
}

// Work item `item` of a span cut in `chunks` (0 .. H_kv * chunks): key/value head g and the
// positions t0 .. t0 + nt - 1; its group's heads x positions are the queries.
struct ItemRows {
  int64_t g, t0, nt;
};

ItemRows item_rows(const AttentionSpan& span, int64_t chunks, int64_t item) {
  const int64_t per_chunk = (span.T + chunks - 1) / chunks;
  const int64_t t0 = item % chunks * per_chunk;
  return {item / chunks, t0, std::min(per_chunk, span.T - t0)};
}

// One work item: each tile of keys, then of values, is read once for all of its queries. E: the
// cache's element, float (float32) or uint16_t (bfloat16 bits, widened exactly on load).
template <typename E>
void attend(const AttentionSpan& span, int64_t chunks, int64_t item, int64_t H, int64_t H_kv, int64_t D,
            double scale) {
  const int64_t T = span.T, start = span.start, group = H / H_kv, total = start + T;
  const bool causal = span.mask == nullptr;
  const bool* mp = span.mask;
  const int64_t width = span.mask_width ? span.mask_width : T, mask_first = total - width;  // the mask's slots
  // Plain variables, not a structured binding: the lambdas below capture them (clang < 16 cannot).
  const ItemRows share = item_rows(span, chunks, item);
  const int64_t g = share.g, t0 = share.t0, nt = share.nt;
  const E* K = static_cast<const E*>(span.keys) + g * span.k_stride;
  const E* V = static_cast<const E*>(span.values) + g * span.v_stride;
  const int64_t end = causal ? start + t0 + nt : total;  // no query here sees past slot end - 1
  const int64_t row = end + 16, num_queries = group * nt;
  std::vector<float>& buffer = scratch();
  const int64_t score_rows = (num_queries + 15) / 16 * 16;  // amx_scores writes whole groups of 16
  if (int64_t(buffer.size()) < score_rows * row + num_queries * (D + 1))
    buffer.resize(score_rows * row + num_queries * (D + 1));
  float* scores = buffer.data();                      // [query][row], query = head in group * nt + i
  float* acc = buffer.data() + score_rows * row;      // [query][D]
  float* sums = acc + num_queries * D;                // [query]: each softmax's total weight
  static thread_local std::vector<int32_t> key_buffer;
  if (int64_t(key_buffer.size()) < QUERIES * row) key_buffer.resize(QUERIES * row);
  int32_t* keys_of = key_buffer.data();  // [i][row]: the slots position t0 + i sees, in order (all heads alike)
  int64_t count[QUERIES] = {};
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t t = t0 + i;
    if (causal) {  // slots 0 .. start + t
      count[i] = start + t + 1;
      std::iota(keys_of + i * row, keys_of + i * row + count[i], int32_t(0));
      continue;
    }
    for (int64_t j = 0; j < mask_first; ++j) keys_of[i * row + count[i]++] = int32_t(j);
    for (int64_t j = 0; j < width; ++j)
      if (mp[t * width + j]) keys_of[i * row + count[i]++] = int32_t(mask_first + j);
  }
  // A sliding window keeps the last `window` keys of a list: its positions p - window + 1 .. p, since a
  // list holds one key per position 0 .. p in position order (a tree node's ancestors are in it as
  // the positions before its own). moved_from[i]: the first entry of list i whose slot may differ
  // from its index (the AMX scores below are computed by slot, then compacted from there).
  [[maybe_unused]] int64_t moved_from[QUERIES];
  int64_t first_slot = end;  // the lowest slot any query here sees
  for (int64_t i = 0; i < nt; ++i) {
    moved_from[i] = causal ? count[i] : mask_first;
    if (span.window > 0 && count[i] > span.window) {
      const int64_t drop = count[i] - span.window;
      std::memmove(keys_of + i * row, keys_of + i * row + drop, span.window * sizeof(int32_t));
      count[i] = span.window;
      moved_from[i] = 0;
    }
    if (count[i] > 0) first_slot = std::min<int64_t>(first_slot, keys_of[i * row]);
  }
  const int64_t first_tile = first_slot / TILE * TILE;  // tiles before it hold no key any query here sees
  // Scores, a tile of keys at a time (four adjacent keys share one reduction: dot4), up to
  // 4 of the group's heads at once sharing each key's loads. A bfloat16 cache's tile is widened
  // to float32 once where several positions read it (a prefill chunk, a draft): else each
  // position and each 4 heads would widen every key again (prefill 8-10% slower than over a
  // float32 cache). The widened values are exact, so the products are the same either way.
  const bool staged = std::is_same_v<E, uint16_t> && nt > 1;
  static thread_local std::vector<float> stage;
  if (staged && int64_t(stage.size()) < (TILE + 3) * D) stage.resize((TILE + 3) * D);
  auto widen_tile = [&](const E* rows, int64_t first, int64_t last) {  // rows [first, last) into stage
    if constexpr (std::is_same_v<E, uint16_t>)
      if (staged) widen_rows(rows, first, last, D, stage.data());
  };
  const int64_t head_chunks = (group + 3) / 4;
  static thread_local std::vector<int64_t> cursors;
  cursors.assign(head_chunks * QUERIES, 0);
  // Scores on tiles: asked for (the model's linears run there), a bfloat16 cache, whole 32-column
  // steps of the head (a tile step's width), and this CPU and use_amx_scores allow it.
  const bool amx = std::is_same_v<E, uint16_t> && span.amx_scores && D % 32 == 0 && amx_scores_enabled();
#if defined(DRAFTWISE_AMX_SCORES)
  if constexpr (std::is_same_v<E, uint16_t>) {
    if (amx) {
      // Every query's score with every slot before `end`, by slot; then each query's row is
      // compacted to the keys it sees (its list is ascending, so keys_of[c] >= c: in place).
      static thread_local std::vector<const float*> query_rows;
      query_rows.resize(num_queries);
      for (int64_t hh = 0; hh < group; ++hh)
        for (int64_t i = 0; i < nt; ++i) query_rows[hh * nt + i] = span.queries + ((t0 + i) * H + g * group + hh) * D;
      amx_scores(query_rows.data(), num_queries, K, first_tile, end, total, D, scores, row);
      for (int64_t hh = 0; hh < group; ++hh)
        for (int64_t i = 0; i < nt; ++i) {
          float* s = scores + (hh * nt + i) * row;
          const int32_t* keys_i = keys_of + i * row;
          for (int64_t c = moved_from[i]; c < count[i]; ++c) s[c] = s[keys_i[c]];
        }
    }
  }
#endif
  for (int64_t j1 = first_tile + TILE; j1 < (amx ? 0 : end + TILE); j1 += TILE) {
    const int64_t tile_start = j1 - TILE;
    widen_tile(K, tile_start, std::min(j1 + 3, total));  // + 3: a dot4 run may cross
    for (int64_t chunk = 0; chunk < head_chunks; ++chunk) {
      const int64_t h0 = chunk * 4, nh = std::min<int64_t>(4, group - h0);
      for (int64_t i = 0; i < nt; ++i) {
        const float* query[4];
        float* s[4];
        for (int64_t hh = 0; hh < nh; ++hh) {
          query[hh] = span.queries + ((t0 + i) * H + g * group + h0 + hh) * D;
          s[hh] = scores + ((h0 + hh) * nt + i) * row;
        }
        const int32_t* keys_i = keys_of + i * row;
        int64_t c = cursors[chunk * QUERIES + i];
        auto score = [&](auto key_at) {  // key_at(slot): that key's row, in the cache or the widened tile
          while (c < count[i] && keys_i[c] < j1) {
            if (c + 4 <= count[i] && keys_i[c + 3] == keys_i[c] + 3) {
              const auto* key = key_at(keys_i[c]);
              if (!staged && c + PREFETCH_ROWS + 4 <= count[i])
                for (int r = 0; r < 4; ++r) prefetch_row(K + int64_t(keys_i[c + PREFETCH_ROWS + r]) * D, D);
              float* at[4];
              for (int64_t hh = 0; hh < nh; ++hh) at[hh] = s[hh] + c;
              switch (nh) {
                case 1: dot4<1>(query, key, D, at); break;
                case 2: dot4<2>(query, key, D, at); break;
                case 3: dot4<3>(query, key, D, at); break;
                default: dot4<4>(query, key, D, at); break;
              }
              c += 4;
            } else {
              for (int64_t hh = 0; hh < nh; ++hh) s[hh][c] = dot(query[hh], key_at(keys_i[c]), D);
              c += 1;
            }
          }
        };
        if (staged)
          score([&](int64_t slot) { return stage.data() + (slot - tile_start) * D; });
        else
          score([&](int64_t slot) { return K + slot * D; });
        cursors[chunk * QUERIES + i] = c;
      }
    }
  }
  // Softmax per query.
  for (int64_t query = 0; query < num_queries; ++query) {
    const int64_t n = count[query % nt];
    float* s = scores + query * row;
    sums[query] = exp_and_sum(s, n, scale_and_max(s, n, float(scale)));
    std::fill(acc + query * D, acc + (query + 1) * D, 0.0f);
  }
  // Position i's weighted sums of keys c0..c1 of its list, whose rows are values + rows[c - c0] * D.
  auto weigh_values = [&](int64_t i, int64_t c0, int64_t c1, const int32_t* rows, const auto* values) {
    if (D == 128 || D == 64) {  // the group's heads together, sharing the value loads
      static thread_local std::vector<const float*> weights;
      static thread_local std::vector<float*> outs;
      weights.resize(group);
      outs.resize(group);
      for (int64_t hh = 0; hh < group; ++hh) {
        weights[hh] = scores + (hh * nt + i) * row + c0;
        outs[hh] = acc + (hh * nt + i) * D;
      }
#if defined(DRAFTWISE_V16_PAIR)
      // AVX2: 32 of the D columns at a time, two heads sharing the value loads (8 accumulator
      // registers; a whole row of 128, two registers a 16, spilled). Each column's sum is the
      // same multiply-adds in the same key order.
      static thread_local std::vector<float*> piece_outs;
      piece_outs.resize(group);
      for (int64_t piece = 0; piece < D; piece += 32) {
        for (int64_t hh = 0; hh < group; ++hh) piece_outs[hh] = outs[hh] + piece;
        if (piece == 0 && !staged) {  // the first piece asks for the whole rows ahead
          weighted_sums<2, 2, true>(group, weights.data(), rows, c1 - c0, values, D, piece_outs.data());
        } else {
          weighted_sums<2, 2, false>(group, weights.data(), rows, c1 - c0, values + piece, D, piece_outs.data());
        }
      }
#else
      if (D == 128) {
        if (staged) {
          weighted_sums<8, 2, false>(group, weights.data(), rows, c1 - c0, values, D, outs.data());
        } else {
          weighted_sums<8, 2, true>(group, weights.data(), rows, c1 - c0, values, D, outs.data());
        }
      } else {
        if (staged) {
          weighted_sums<4, 4, false>(group, weights.data(), rows, c1 - c0, values, D, outs.data());
        } else {
          weighted_sums<4, 4, true>(group, weights.data(), rows, c1 - c0, values, D, outs.data());
        }
      }
#endif
      return;
    }
    for (int64_t hh = 0; hh < group; ++hh) {  // other head sizes: the same sums, through memory
      const int64_t query = hh * nt + i;
      const float* w = scores + query * row + c0;
      float* a = acc + query * D;
      for (int64_t c = 0; c < c1 - c0; ++c) {
        const auto* v = values + int64_t(rows[c]) * D;
        for (int64_t d = 0; d < D; d += 16) store16(a + d, fmadd(w[c], load16(v + d), load16(a + d)));
      }
    }
  };
  // Weighted sums of values, a tile of values at a time, each query's sum in key order (a
  // bfloat16 tile widened once, as the keys were).
  int64_t cursor[QUERIES] = {};
  static thread_local std::vector<int32_t> tile_slots;  // the tile's slots, from its first
  if (staged) tile_slots.resize(TILE);
  for (int64_t j1 = first_tile + TILE; j1 < end + TILE; j1 += TILE) {
    const int64_t tile_start = j1 - TILE;
    widen_tile(V, tile_start, std::min(j1, total));
    for (int64_t i = 0; i < nt; ++i) {
      const int32_t* keys_i = keys_of + i * row;
      const int64_t c0 = cursor[i];
      int64_t c1 = c0;
      while (c1 < count[i] && keys_i[c1] < j1) ++c1;
      cursor[i] = c1;
      if (staged) {
        for (int64_t c = c0; c < c1; ++c) tile_slots[c - c0] = keys_i[c] - int32_t(tile_start);
        weigh_values(i, c0, c1, tile_slots.data(), stage.data());
      } else {
        weigh_values(i, c0, c1, keys_i + c0, V);
      }
    }
  }
  for (int64_t hh = 0; hh < group; ++hh)
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t query = hh * nt + i;
      const float inverse = 1.0f / sums[query];
      float* o = span.out + ((t0 + i) * H + g * group + hh) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[query * D + d] * inverse;
    }
}

// The item's share of the work, for splitting items over threads: its queries x the keys they see.
double attention_cost(const AttentionSpan& span, int64_t chunks, int64_t item) {
  const ItemRows rows = item_rows(span, chunks, item);
  int64_t seen = span.start + rows.t0 + rows.nt;
  if (span.window > 0) seen = std::min(seen, span.window);
  return double(rows.nt) * double(seen + 16);  // + 16: an item's fixed cost
}

}  // namespace

// queries [T, H, D]: T new tokens at cache slots start..start+T-1 (their keys and values are
// already written); keys / values [H_kv, capacity, D] (rows contiguous), float32 or bfloat16
// (widened exactly to float32 as they are read: the arithmetic is float32 either way); mask [T, T] bool among
// the new tokens (True = may attend), or an empty tensor for causal order. Every query sees
// slots 0..start-1. A mask may also be [T, W], W up to start + T: over slots start + T - W ..
// start + T - 1, every query then seeing the slots before those (a drafter's tree whose earlier
// levels are already in its cache). -> [T, H, D].
//
// Each (query, head) gathers the scores of exactly the keys it may see, in slot order, into a
// compact row; the softmax and the weighted sum of values run over that row. A masked-out key
// is skipped, not added as zero weight, so a token of a tree or a draft gets the arithmetic it
// gets when decoded alone. Four adjacent keys share one reduction tree (dot4, bit-identical to
// four dot() calls) and a query's weighted sum of values stays in registers. amx_scores (a
// bfloat16 cache, a head_dim that is a multiple of 32, where the CPU has AMX tiles and
// use_amx_scores did not turn them off): the
// scores come from amx_scores instead, each its own tile element, so the same holds. window > 0
// (Gemma 3's sliding-window layers): each query keeps the last `window` keys of its row, which are
// positions p - window + 1 .. p wherever its row came from (a tree node's row is its committed
// slots and then its ancestors, one key per position), so a window too gets the same arithmetic.
at::Tensor attention(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                        int64_t start, const at::Tensor& mask, double scale, bool amx_scores, int64_t window) {
  TORCH_CHECK(queries.dim() == 3 && queries.scalar_type() == at::kFloat && queries.is_contiguous(),
              "attention: queries must be contiguous float32 [T, H, D]");
  const bool bf16 = keys.scalar_type() == at::kBFloat16;
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && (bf16 || keys.scalar_type() == at::kFloat) &&
              values.scalar_type() == keys.scalar_type() && keys.stride(2) == 1 && values.stride(2) == 1 &&
              keys.stride(1) == keys.size(2) && values.stride(1) == values.size(2),
              "attention: keys and values must be float32 or bfloat16 [H_kv, capacity, D] with contiguous rows");
  const int64_t T = queries.size(0), H = queries.size(1), D = queries.size(2), H_kv = keys.size(0);
  TORCH_CHECK(keys.size(2) == D && D % 16 == 0, say("attention: head_dim ", D, " must match and be a multiple of 16"));
  TORCH_CHECK(H % H_kv == 0, say("attention: ", H, " heads do not group over ", H_kv, " key/value heads"));
  TORCH_CHECK(start >= 0 && start + T <= keys.size(1), say("attention: slots ", start, "+", T, " exceed the cache"));
  const bool causal = mask.numel() == 0;
  TORCH_CHECK(causal || (mask.dim() == 2 && mask.size(0) == T && mask.size(1) >= T && mask.size(1) <= start + T &&
                         mask.scalar_type() == at::kBool && mask.is_contiguous()),
              "attention: mask must be a contiguous bool [T, W], T <= W <= start + T, or empty");
  TORCH_CHECK(window >= 0, say("attention: window ", window, " must be 0 (none) or positive"));
  auto out = at::empty_like(queries);
  attention_spans({AttentionSpan{queries.data_ptr<float>(), keys.data_ptr(), values.data_ptr(), bf16,
                                 keys.stride(0), values.stride(0), causal ? nullptr : mask.data_ptr<bool>(),
                                 out.data_ptr<float>(), T, start, causal ? 0 : mask.size(1),
                                 amx_scores, window}},
                  H, H_kv, D, scale);
  return out;
}

bool amx_scores_enabled() { return amx_scores_allowed.load(std::memory_order_relaxed) && amx_in_hardware(); }

void use_amx_scores(bool on) { amx_scores_allowed.store(on, std::memory_order_relaxed); }

void attention_spans(const std::vector<AttentionSpan>& spans, int64_t H, int64_t H_kv, int64_t D, double scale) {
  // Every span's work items, dealt to the threads by cost (largest first, each to the least
  // loaded thread: causal chunks cost more the later they are), in one parallel region: sixteen
  // one-token sequences over 2 threads were 16 calls of 3 items each (SmolLM2's 3 key/value
  // heads: 2 for one thread, 1 for the other, then a join).
  struct Item {
    int64_t span, item;
    double cost;
  };
  std::vector<int64_t> chunks;
  for (const AttentionSpan& span : spans)
    chunks.push_back(balanced_chunks(span.T, H_kv, at::get_num_threads(), spans.size() == 1));
  std::vector<Item> items;
  for (int64_t s = 0; s < int64_t(spans.size()); ++s)
    for (int64_t item = 0; item < H_kv * chunks[s]; ++item)
      items.push_back({s, item, attention_cost(spans[s], chunks[s], item)});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), int64_t(items.size())));
  std::vector<std::vector<Item>> shares(threads);
  std::vector<double> load(threads, 0.0);
  for (const Item& item : items) {
    const int64_t least = std::min_element(load.begin(), load.end()) - load.begin();
    shares[least].push_back(item);
    load[least] += item.cost;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (const Item& item : shares[t]) {
        const AttentionSpan& span = spans[item.span];
        if (span.bf16)
          attend<uint16_t>(span, chunks[item.span], item.item, H, H_kv, D, scale);
        else
          attend<float>(span, chunks[item.span], item.item, H, H_kv, D, scale);
      }
  });
}

}  // namespace draftwise
