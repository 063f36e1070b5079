// A Llama-family decoder's layers run in one call (decoder.cpp); models/llama.py builds one per
// model from its own tensors and module.cpp binds it.
#pragma once

#include "kernels.h"

#include <vector>

namespace draftwise {

class Decoder {
 public:
  // scale: attention's score scale (0: head_dim ** -0.5); window: the sliding window of the layers
  // added as local (0: none); gelu: the MLP gates with GELU's tanh approximation instead of SiLU.
  Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale = 0.0,
          int64_t window = 0, bool gelu = false);

  // One layer: its input norm's weights (empty: the layer reads x as it is, as an EAGLE head's
  // does) and its MLP's input norm's (Llama's post_attention_layernorm, Gemma's
  // pre_feedforward_layernorm), then per linear in the order q, k, v, o, gate, up, down:
  // the weight's bytes, GGML format and column count, what its input is rounded to (0: nothing,
  // float32; 1: int8; 2: bfloat16, with the weights' values), and its bias (an empty tensor: none).
  // Gemma 3's extras, each empty for none: the per-head norms of queries and keys (before the
  // rotary embedding), the norms of the attention's and the MLP's outputs (before each joins the
  // residual stream); local: the layer attends within the window, rotated by forward's local
  // tables. The tensors are referenced, not copied.
  void add_layer(const at::Tensor& input_norm, const at::Tensor& mlp_norm,
                 const std::vector<at::Tensor>& weights, const std::vector<int64_t>& formats,
                 const std::vector<int64_t>& columns, const std::vector<int64_t>& activations,
                 const std::vector<at::Tensor>& biases, const at::Tensor& q_norm, const at::Tensor& k_norm,
                 const at::Tensor& attention_output_norm, const at::Tensor& mlp_output_norm, bool local);

  // x [N, hidden]: every sequence's new rows, flattened; cos / sin [N, head_dim]. Sequence s owns
  // rows first_rows[s] .. + num_rows[s], writes their keys and values to its cache (keys[s],
  // values[s]: [layers, 1, kv_heads, capacity, head_dim]) at slots starts[s].., and attends over
  // its cache under masks[s] ([T, T] bool among its new rows; empty: causal; or [T, W] over its
  // last W slots, the rows before its new ones included: attention() in rowwise.cpp). Returns the
  // residual stream after the last layer, then after each layer listed in saved_layers. local_cos /
  // local_sin [N, head_dim]: the local layers' rotary tables (empty: cos and sin).
  std::vector<at::Tensor> forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                  const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                  const std::vector<int64_t>& starts, const std::vector<int64_t>& first_rows,
                                  const std::vector<int64_t>& num_rows, const std::vector<at::Tensor>& masks,
                                  const std::vector<int64_t>& saved_layers, const at::Tensor& local_cos,
                                  const at::Tensor& local_sin) const;

 private:
  struct Linear {
    at::Tensor data;
    int64_t format, columns;
    int64_t activations;  // 0 float32, 1 int8, 2 bfloat16, 3 bfloat16 on AMX tiles, 4 int16
    at::Tensor bias;  // undefined: none
    at::Tensor operator()(const at::Tensor& x) const;
  };
  struct Layer {
    at::Tensor input_norm, mlp_norm;
    Linear q, k, v, o, gate, up, down;
    at::Tensor q_norm, k_norm, attention_output_norm, mlp_output_norm;  // empty: none
    bool local;
  };
  // Linears that read the same x (q, k, v; gate, up): one amx_linears call where all of them run
  // on AMX tiles (x rounded once, one parallel region), each its own call otherwise; the same bits.
  static std::vector<at::Tensor> shared_input(const std::vector<const Linear*>& linears, const at::Tensor& x);

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t window_;
  bool gelu_;
  std::vector<Layer> layers_;
};

}  // namespace draftwise
