// What the blocked products share (linear.cpp, bf16_linear.cpp): per-thread scratch memory and
// where a register block's sums start and end.
#pragma once

#include "vec.h"

#include <vector>

namespace draftwise {

// A per-thread scratch buffer of at least size floats, aligned to 64 bytes (v16 loads).
inline float* thread_buffer(int64_t size) {
  static thread_local std::vector<float> buffer;
  if (int64_t(buffer.size()) < size + 16) buffer.resize(size + 16);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((address + 63) & ~uintptr_t(63));
}

// Where a register block's sums start and end: from `partial` or from zero (a first column
// step), and back into `partial` or, after the last column step, straight into y as finished
// sums (horizontal_sum's, four at a time): no zeroing pass, no parking, no reloading.
struct Ends {
  bool from_zero = false;
  float* y = nullptr;  // non-null: finish into y[i * y_stride + j] instead of parking in partial
  int64_t y_stride = 0;
};

}  // namespace draftwise
