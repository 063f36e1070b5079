// The Python bindings of draftwise's kernels (built by draftwise/models/kernels.py).
#include <torch/csrc/utils/pybind.h>  // pybind11 with at::Tensor casters: a third of torch/extension.h

#include <pybind11/stl.h>

#include "decoder.h"
#include "lattice.h"

namespace {

// Which vector code the compiler built (vec.h): what a report or a test states beside a number.
const char* vector_paths() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(DRAFTWISE_V16_PAIR)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("blocked_linear", &draftwise::blocked_linear, "x [M, K] float32 @ W.T, W in a GGUF block format");
  m.def("int8_linear", &draftwise::int8_linear, "x [M, K] rounded to int8 @ W.T, W in a GGUF block format");
  m.def("int16_linear", &draftwise::int16_linear, "x [M, K] rounded to int16 per 256 columns @ W.T, W in a K-quant format");
  m.def("int16_dot_in_hardware", &draftwise::int16_dot_in_hardware, "whether int16_linear runs on AVX2");
  m.def("int8_dot_in_hardware", &draftwise::int8_dot_in_hardware, "whether int8_linear runs on AVX-512 VNNI");
  m.def("bf16_linear", &draftwise::bf16_linear, "x [M, K] rounded to bfloat16 @ W.T rounded to bfloat16");
  m.def("amx_linear", &draftwise::amx_linear, "x [M, K] rounded to bfloat16 @ W.T rounded to bfloat16, on AMX tiles");
  m.def("amx_in_hardware", &draftwise::amx_in_hardware, "whether amx_linear can run here (AMX-BF16, OS permission)");
  m.def("bf16_dot_in_hardware", &draftwise::bf16_dot_in_hardware, "whether bf16_linear runs on AVX-512 BF16");
  m.def("vector_paths", &vector_paths,
        "the vector code this build compiled: avx512, avx2 (pairs of 256-bit vectors) or generic");
  m.def("dequantize_rows", &draftwise::dequantize_rows, "rows of a blocked weight as float32");
  m.def("set_lattice_grid", &draftwise::set_lattice_grid, "a lattice format's codebook (gguf-py's), float32 [entries, width]");
  m.def("set_lattice_signs", &draftwise::set_lattice_signs, "the 128 bytes that turn 7 sign bits into 8 (gguf-py's ksigns)");
  m.def("rms_norm", &draftwise::rms_norm, "RMSNorm, row by row");
  m.def("argmax_rows", &draftwise::argmax_rows, "each row's argmax (the first of equal maxima, NaN the largest)");
  m.def("silu_mul", &draftwise::silu_mul, "silu(gate) * up");
  m.def("gelu_tanh_mul", &draftwise::gelu_tanh_mul, "gelu(gate) * up, GELU's tanh approximation");
  m.def("rotary", &draftwise::rotary, "rotary position embedding of x [T, H, D], in place");
  m.def("attention", &draftwise::attention, "attention of new queries over the KV cache (chain or tree mask)",
        pybind11::arg("queries"), pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("start"),
        pybind11::arg("mask"), pybind11::arg("scale"), pybind11::arg("amx_scores") = false,
        pybind11::arg("window") = 0);
  m.def("use_amx_scores", &draftwise::use_amx_scores, "attention scores on AMX tiles (where asked and available) or not");
  m.def("amx_scores_enabled", &draftwise::amx_scores_enabled, "whether attention may compute scores on AMX tiles");
  pybind11::class_<draftwise::Decoder>(m, "Decoder", "a decoder's layers run in one call (see decoder.h)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, int64_t, bool>(), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale") = 0.0,
           pybind11::arg("window") = 0, pybind11::arg("gelu") = false)
      .def("add_layer", &draftwise::Decoder::add_layer, pybind11::arg("input_norm"), pybind11::arg("mlp_norm"),
           pybind11::arg("weights"), pybind11::arg("formats"), pybind11::arg("columns"), pybind11::arg("activations"),
           pybind11::arg("biases"), pybind11::arg("q_norm") = at::empty({0}), pybind11::arg("k_norm") = at::empty({0}),
           pybind11::arg("attention_output_norm") = at::empty({0}), pybind11::arg("mlp_output_norm") = at::empty({0}),
           pybind11::arg("local") = false)
      // The whole forward runs without the GIL (the arguments are converted before it is let
      // go): the server's HTTP thread keeps answering while a long verify forward computes.
      .def("forward", &draftwise::Decoder::forward, pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("starts"), pybind11::arg("first_rows"),
           pybind11::arg("num_rows"), pybind11::arg("masks"), pybind11::arg("saved_layers"),
           pybind11::arg("local_cos") = at::empty({0}), pybind11::arg("local_sin") = at::empty({0}),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
