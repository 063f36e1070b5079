// The text of a refusal (TORCH_CHECK's message) built without iostreams: `say("x has ", K,
// " columns")`. Numbers go through std::to_string, never through an ostream. On an NVIDIA H200
// machine's PyTorch 2.11+cu130 (Python 3.12, kernels built by its Ubuntu g++ 13.3, 2026-11-29)
// TORCH_CHECK's own formatting of an integer (c10::str -> ostream << long, compiled into this
// module) crashed the process with a segmentation fault inside the locale's number formatting,
// where a message of text alone came back as a RuntimeError; the CPU builds of PyTorch on the
// project's machines format either. A refusal must reach the user as an error, on any PyTorch.
#pragma once

#include <c10/util/ArrayRef.h>

#include <string>
#include <type_traits>

namespace draftwise {

inline void append(std::string& out, const char* text) { out += text; }

inline void append(std::string& out, c10::IntArrayRef sizes) {  // a tensor's shape, as "[2, 64]"
  out += '[';
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(sizes[i]);
  }
  out += ']';
}

template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& out, T value) {
  out += std::to_string(value);
}

template <typename... Parts>
std::string say(const Parts&... parts) {
  std::string out;
  (append(out, parts), ...);
  return out;
}

}  // namespace draftwise
