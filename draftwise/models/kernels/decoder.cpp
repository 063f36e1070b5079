// The decoder's layers in one call: the kernels of models/llama.py's modules, called in the
// same order on the same tensors, so the results are bit-identical to the modules'; what goes
// away is the Python glue between them (about twenty calls a layer).
#include "decoder.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>

#include <algorithm>
#include <cmath>

namespace draftwise {

at::Tensor Decoder::Linear::operator()(const at::Tensor& x) const {
  at::Tensor y = activations == 1   ? int8_linear(x, data, format, columns)
                 : activations == 2 ? bf16_linear(x, data, format, columns)
                 : activations == 3 ? amx_linear(x, data, format, columns)
                                    : blocked_linear(x, data, format, columns);
  return bias.defined() ? y.add_(bias) : y;  // BlockLinear.forward's out.add_(bias)
}

Decoder::Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps) {
  TORCH_CHECK(head_dim % 16 == 0, "Decoder: head_dim ", head_dim, " must be a multiple of 16");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "Decoder: ", num_heads,
              " heads do not group over ", num_kv_heads, " key/value heads");
}

void Decoder::add_layer(const at::Tensor& input_norm, const at::Tensor& post_attention_norm,
                        const std::vector<at::Tensor>& weights, const std::vector<int64_t>& formats,
                        const std::vector<int64_t>& columns, const std::vector<int64_t>& activations,
                        const std::vector<at::Tensor>& biases) {
  TORCH_CHECK(weights.size() == 7 && formats.size() == 7 && columns.size() == 7 && activations.size() == 7 &&
              biases.size() == 7, "Decoder.add_layer: 7 linears (q, k, v, o, gate, up, down)");
  std::vector<Linear> linears;
  for (size_t i = 0; i < 7; ++i)
    linears.push_back(Linear{weights[i], formats[i], columns[i], activations[i],
                             biases[i].numel() ? biases[i] : at::Tensor()});
  layers_.push_back(Layer{input_norm, post_attention_norm, linears[0], linears[1], linears[2], linears[3],
                          linears[4], linears[5], linears[6]});
}

std::vector<at::Tensor> Decoder::forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                         const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                         const std::vector<int64_t>& starts, const std::vector<int64_t>& first_rows,
                                         const std::vector<int64_t>& num_rows, const std::vector<at::Tensor>& masks,
                                         const std::vector<int64_t>& saved_layers) const {
  const size_t spans = keys.size();
  TORCH_CHECK(values.size() == spans && starts.size() == spans && first_rows.size() == spans &&
              num_rows.size() == spans && masks.size() == spans,
              "Decoder.forward: one key, value, start, first row, row count and mask per sequence");
  const int64_t N = x.size(0), H = num_heads_, H_kv = num_kv_heads_, D = head_dim_;
  const double scale = std::pow(double(D), -0.5);  // Python's head_dim ** -0.5
  std::vector<at::Tensor> results(1);
  for (size_t index = 0; index < layers_.size(); ++index) {
    const Layer& layer = layers_[index];
    // Attention (llama.py's Attention.forward).
    at::Tensor h = rms_norm(x, layer.input_norm, eps_);
    at::Tensor q = layer.q(h).view({N, H, D});
    at::Tensor k = layer.k(h).view({N, H_kv, D});
    at::Tensor v = layer.v(h).view({N, H_kv, D});
    rotary(q, cos, sin);
    rotary(k, cos, sin);
    std::vector<at::Tensor> outputs;
    for (size_t s = 0; s < spans; ++s) {
      const int64_t first = first_rows[s], rows = num_rows[s], start = starts[s];
      at::Tensor cached_keys = keys[s].select(0, int64_t(index)).select(0, 0);  // [kv_heads, capacity, D]
      at::Tensor cached_values = values[s].select(0, int64_t(index)).select(0, 0);
      cached_keys.narrow(1, start, rows).copy_(k.narrow(0, first, rows).transpose(0, 1));
      cached_values.narrow(1, start, rows).copy_(v.narrow(0, first, rows).transpose(0, 1));
      outputs.push_back(attention(q.narrow(0, first, rows), cached_keys, cached_values, start, masks[s], scale));
    }
    at::Tensor attended = spans == 1 ? outputs[0] : at::cat(outputs);
    x = at::add(x, layer.o(attended.reshape({N, H * D})));  // Python's x + y
    // The gated MLP (llama.py's MLP.forward).
    h = rms_norm(x, layer.post_attention_norm, eps_);
    x = at::add(x, layer.down(silu_mul(layer.gate(h), layer.up(h))));
    if (std::find(saved_layers.begin(), saved_layers.end(), int64_t(index)) != saved_layers.end())
      results.push_back(x);
  }
  results[0] = x;
  return results;
}

}  // namespace draftwise
