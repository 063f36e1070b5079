// A Llama-family decoder's layers run in one call (decoder.cpp); models/llama.py builds one per
// model from its own tensors and module.cpp binds it.
#pragma once

#include "kernels.h"

#include <vector>

namespace draftwise {

class Decoder {
 public:
  Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps);

  // One layer: its two norms' weights (an empty input norm: the layer reads x as it is, as an
  // EAGLE head's does), then per linear in the order q, k, v, o, gate, up, down:
  // the weight's bytes, GGML format and column count, what its input is rounded to (0: nothing,
  // float32; 1: int8; 2: bfloat16, with the weights' values), and its bias (an empty tensor: none). The tensors are referenced, not copied.
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_attention_norm,
                 const std::vector<at::Tensor>& weights, const std::vector<int64_t>& formats,
                 const std::vector<int64_t>& columns, const std::vector<int64_t>& activations,
                 const std::vector<at::Tensor>& biases);

  // x [N, hidden]: every sequence's new rows, flattened; cos / sin [N, head_dim]. Sequence s owns
  // rows first_rows[s] .. + num_rows[s], writes their keys and values to its cache (keys[s],
  // values[s]: [layers, 1, kv_heads, capacity, head_dim]) at slots starts[s].., and attends over
  // its cache under masks[s] ([T, T] bool among its new rows; empty: causal; or [T, W] over its
  // last W slots, the rows before its new ones included: attention() in rowwise.cpp). Returns the
  // residual stream after the last layer, then after each layer listed in saved_layers.
  std::vector<at::Tensor> forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                  const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                  const std::vector<int64_t>& starts, const std::vector<int64_t>& first_rows,
                                  const std::vector<int64_t>& num_rows, const std::vector<at::Tensor>& masks,
                                  const std::vector<int64_t>& saved_layers) const;

 private:
  struct Linear {
    at::Tensor data;
    int64_t format, columns;
    int64_t activations;  // 0 float32, 1 int8, 2 bfloat16, 3 bfloat16 on AMX tiles, 4 int16
    at::Tensor bias;  // undefined: none
    at::Tensor operator()(const at::Tensor& x) const;
  };
  struct Layer {
    at::Tensor input_norm, post_attention_norm;
    Linear q, k, v, o, gate, up, down;
  };
  // Linears that read the same x (q, k, v; gate, up): one amx_linears call where all of them run
  // on AMX tiles (x rounded once, one parallel region), each its own call otherwise; the same bits.
  static std::vector<at::Tensor> shared_input(const std::vector<const Linear*>& linears, const at::Tensor& x);

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  std::vector<Layer> layers_;
};

}  // namespace draftwise
