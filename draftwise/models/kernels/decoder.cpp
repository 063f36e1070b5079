// The decoder's layers in one call: the kernels of models/llama.py's modules, called in the
// same order on the same tensors, so the results are bit-identical to the modules'; what goes
// away is the Python glue between them (about twenty calls a layer).
#include "decoder.h"
#include "message.h"

#include <ATen/ops/add.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace draftwise {

namespace {
bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }  // an optional argument given
}  // namespace

at::Tensor Decoder::Linear::operator()(const at::Tensor& x) const {
  at::Tensor y = activations == 1   ? int8_linear(x, data, format, columns)
                 : activations == 2 ? bf16_linear(x, data, format, columns)
                 : activations == 3 ? amx_linear(x, data, format, columns)
                 : activations == 4 ? int16_linear(x, data, format, columns)
                                    : blocked_linear(x, data, format, columns);
  return bias.defined() ? y.add_(bias) : y;  // BlockLinear.forward's out.add_(bias)
}

std::vector<at::Tensor> Decoder::shared_input(const std::vector<const Linear*>& linears, const at::Tensor& x) {
  bool tiles = true;
  for (const Linear* linear : linears)
    tiles = tiles && linear->activations == 3 && linear->columns == linears[0]->columns;
  std::vector<at::Tensor> ys;
  if (!tiles) {
    for (const Linear* linear : linears) ys.push_back((*linear)(x));
    return ys;
  }
  std::vector<at::Tensor> weights;
  std::vector<int64_t> formats;
  for (const Linear* linear : linears) {
    weights.push_back(linear->data);
    formats.push_back(linear->format);
  }
  ys = amx_linears(x, weights, formats, linears[0]->columns);
  for (size_t i = 0; i < linears.size(); ++i)
    if (linears[i]->bias.defined()) ys[i].add_(linears[i]->bias);  // Linear's y.add_(bias)
  return ys;
}

Decoder::Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t window,
                 bool gelu)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
      scale_(scale > 0 ? scale : std::pow(double(head_dim), -0.5)),  // Python's head_dim ** -0.5
      window_(window), gelu_(gelu) {
  TORCH_CHECK(window >= 0, say("Decoder: window ", window, " must be 0 (none) or positive"));
  TORCH_CHECK(head_dim % 16 == 0, say("Decoder: head_dim ", head_dim, " must be a multiple of 16"));
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, say("Decoder: ", num_heads,
                  " heads do not group over ", num_kv_heads, " key/value heads"));
}

void Decoder::add_layer(const at::Tensor& input_norm, const at::Tensor& mlp_norm,
                        const std::vector<at::Tensor>& weights, const std::vector<int64_t>& formats,
                        const std::vector<int64_t>& columns, const std::vector<int64_t>& activations,
                        const std::vector<at::Tensor>& biases, const at::Tensor& q_norm, const at::Tensor& k_norm,
                        const at::Tensor& attention_output_norm, const at::Tensor& mlp_output_norm, bool local) {
  TORCH_CHECK(!present(q_norm) || q_norm.numel() == head_dim_, say("Decoder.add_layer: q_norm must hold head_dim (",
              head_dim_, ") weights or none"));
  TORCH_CHECK(!present(k_norm) || k_norm.numel() == head_dim_, say("Decoder.add_layer: k_norm must hold head_dim (",
              head_dim_, ") weights or none"));
  TORCH_CHECK(weights.size() == 7 && formats.size() == 7 && columns.size() == 7 && activations.size() == 7 &&
              biases.size() == 7, "Decoder.add_layer: 7 linears (q, k, v, o, gate, up, down)");
  std::vector<Linear> linears;
  for (size_t i = 0; i < 7; ++i)
    linears.push_back(Linear{weights[i], formats[i], columns[i], activations[i],
                             biases[i].numel() ? biases[i] : at::Tensor()});
  layers_.push_back(Layer{input_norm, mlp_norm, linears[0], linears[1], linears[2], linears[3], linears[4],
                          linears[5], linears[6], q_norm, k_norm, attention_output_norm, mlp_output_norm, local});
}

std::vector<at::Tensor> Decoder::forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                         const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                         const std::vector<int64_t>& starts, const std::vector<int64_t>& first_rows,
                                         const std::vector<int64_t>& num_rows, const std::vector<at::Tensor>& masks,
                                         const std::vector<int64_t>& saved_layers, const at::Tensor& local_cos,
                                         const at::Tensor& local_sin) const {
  const size_t spans = keys.size();
  TORCH_CHECK(values.size() == spans && starts.size() == spans && first_rows.size() == spans &&
              num_rows.size() == spans && masks.size() == spans,
              "Decoder.forward: one key, value, start, first row, row count and mask per sequence");
  const int64_t N = x.size(0), H = num_heads_, H_kv = num_kv_heads_, D = head_dim_;
  for (size_t s = 0; s < spans; ++s) {  // [layers, 1, kv_heads, capacity, D] float32 or bfloat16, rows contiguous
    for (const at::Tensor* cache : {&keys[s], &values[s]})
      TORCH_CHECK(cache->dim() == 5 && cache->scalar_type() == keys[s].scalar_type() &&
                      (cache->scalar_type() == at::kFloat || cache->scalar_type() == at::kBFloat16) && cache->size(2) == H_kv &&
                      cache->size(4) == D && cache->stride(4) == 1 && cache->stride(3) == D &&
                      cache->size(0) >= int64_t(layers_.size()),
                  say("Decoder.forward: a cache must be float32 or bfloat16 [layers, 1, ", H_kv, ", capacity, ", D,
                      "] (keys and values alike) with contiguous rows"));
    TORCH_CHECK(starts[s] >= 0 && starts[s] + num_rows[s] <= keys[s].size(3) && num_rows[s] >= 0 &&
                    first_rows[s] >= 0 && first_rows[s] + num_rows[s] <= N,
                say("Decoder.forward: sequence ", s, "'s rows or cache slots are out of range"));
    TORCH_CHECK(masks[s].numel() == 0 || (masks[s].dim() == 2 && masks[s].size(0) == num_rows[s] &&
                                          masks[s].size(1) >= num_rows[s] && masks[s].size(1) <= starts[s] + num_rows[s] &&
                                          masks[s].scalar_type() == at::kBool && masks[s].is_contiguous()),
                say("Decoder.forward: sequence ", s,
                    "'s mask must be a contiguous bool [T, W], T <= W <= start + T, or empty"));
  }
  const bool own_local_tables = present(local_cos);
  TORCH_CHECK(own_local_tables == present(local_sin) && (!own_local_tables || (local_cos.sizes() == cos.sizes() &&
                                                                                local_sin.sizes() == sin.sizes())),
              "Decoder.forward: local_cos and local_sin must both be empty or shaped as cos");
  std::vector<at::Tensor> results(1);
  for (size_t index = 0; index < layers_.size(); ++index) {
    const Layer& layer = layers_[index];
    // Attention (llama.py's Attention.forward).
    at::Tensor h = layer.input_norm.numel() ? rms_norm(x, layer.input_norm, eps_) : x;  // empty: no norm (a draft head's layer)
    const std::vector<at::Tensor> qkv = shared_input({&layer.q, &layer.k, &layer.v}, h);
    at::Tensor q = qkv[0].view({N, H, D});
    at::Tensor k = qkv[1].view({N, H_kv, D});
    at::Tensor v = qkv[2].view({N, H_kv, D});
    if (present(layer.q_norm)) q = rms_norm(q.view({N * H, D}), layer.q_norm, eps_).view({N, H, D});  // each head's row
    if (present(layer.k_norm)) k = rms_norm(k.view({N * H_kv, D}), layer.k_norm, eps_).view({N, H_kv, D});
    const bool local_rotation = layer.local && own_local_tables;
    rotary(q, local_rotation ? local_cos : cos, local_rotation ? local_sin : sin);
    rotary(k, local_rotation ? local_cos : cos, local_rotation ? local_sin : sin);
    // Each sequence's new keys and values into its cache (layer `index`, slots start..), then
    // attention over every sequence in one parallel region (attention_spans: the same arithmetic
    // as a call of attention() per sequence, without a call and a join per sequence).
    at::Tensor attended = at::empty({N, H, D}, x.options());
    std::vector<AttentionSpan> work(spans);
    const float* k_rows = k.data_ptr<float>();
    const float* v_rows = v.data_ptr<float>();
    for (size_t s = 0; s < spans; ++s) {
      const int64_t first = first_rows[s], rows = num_rows[s], start = starts[s];
      const bool bf16 = keys[s].scalar_type() == at::kBFloat16;  // rounded as Python's KVCache.write rounds them
      const int64_t element = keys[s].element_size();
      char* cached_keys = static_cast<char*>(keys[s].data_ptr()) + int64_t(index) * keys[s].stride(0) * element;  // [kv_heads, capacity, D]
      char* cached_values = static_cast<char*>(values[s].data_ptr()) + int64_t(index) * values[s].stride(0) * element;
      const int64_t k_stride = keys[s].stride(2), v_stride = values[s].stride(2);
      for (int64_t h = 0; h < H_kv; ++h)
        for (int64_t r = 0; r < rows; ++r) {
          const float* key = k_rows + ((first + r) * H_kv + h) * D;
          const float* value = v_rows + ((first + r) * H_kv + h) * D;
          char* key_slot = cached_keys + (h * k_stride + (start + r) * D) * element;
          char* value_slot = cached_values + (h * v_stride + (start + r) * D) * element;
          if (bf16) {
            round_to_bf16(key, reinterpret_cast<uint16_t*>(key_slot), D);
            round_to_bf16(value, reinterpret_cast<uint16_t*>(value_slot), D);
          } else {
            std::memcpy(key_slot, key, D * 4);
            std::memcpy(value_slot, value, D * 4);
          }
        }
      work[s] = AttentionSpan{q.data_ptr<float>() + first * H * D, cached_keys, cached_values, bf16, k_stride, v_stride,
                              masks[s].numel() ? masks[s].data_ptr<bool>() : nullptr,
                              attended.data_ptr<float>() + first * H * D, rows, start, masks[s].numel() ? masks[s].size(1) : 0,
                              layer.q.activations == 3,  // llama.py's amx_scores (attend decides)
                              layer.local ? window_ : 0};
    }
    attention_spans(work, H, H_kv, D, scale_);
    at::Tensor attention_out = layer.o(attended.reshape({N, H * D}));
    if (present(layer.attention_output_norm)) attention_out = rms_norm(attention_out, layer.attention_output_norm, eps_);
    x = at::add(x, attention_out);  // Python's x + y
    // The gated MLP (llama.py's MLP.forward).
    h = rms_norm(x, layer.mlp_norm, eps_);
    const std::vector<at::Tensor> gate_up = shared_input({&layer.gate, &layer.up}, h);
    at::Tensor mlp_out = layer.down(gelu_ ? gelu_tanh_mul(gate_up[0], gate_up[1]) : silu_mul(gate_up[0], gate_up[1]));
    if (present(layer.mlp_output_norm)) mlp_out = rms_norm(mlp_out, layer.mlp_output_norm, eps_);
    x = at::add(x, mlp_out);
    if (std::find(saved_layers.begin(), saved_layers.end(), int64_t(index)) != saved_layers.end())
      results.push_back(x);
  }
  results[0] = x;
  return results;
}

}  // namespace draftwise
