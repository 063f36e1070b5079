// What the blocked products share (linear.cpp, bf16_linear.cpp, int8_linear.cpp): per-thread
// scratch memory, how rows of x are cut into tiles, where a register block's sums start and end,
// and how they are finished into y.
#pragma once

#include "vec.h"

#include <algorithm>
#include <vector>

namespace draftwise {

// A per-thread scratch buffer of at least size floats, aligned to 64 bytes (v16 loads).
inline float* thread_buffer(int64_t size) {
  static thread_local std::vector<float> buffer;
  if (int64_t(buffer.size()) < size + 16) buffer.resize(size + 16);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((address + 63) & ~uintptr_t(63));
}

// The height of the row tiles that cut M rows of x into equal parts of at most max_rows, rounded
// up to a multiple of `multiple` (a register block's rows) but never past max_rows. Work items
// walk the weight tiles fastest, so the threads split the row tiles between them: a 128-token
// prefill chunk cut as 96 + 32 rows gave one of two threads three times the other's work (the
// other waiting in libgomp: 23% of a SmolLM2 prefill's samples on a Zen 3). A tile's height
// changes no output's arithmetic: each output's multiply-adds run along its own columns.
inline int64_t even_tile_rows(int64_t M, int64_t max_rows, int64_t multiple = 1) {
  const int64_t tiles = (M + max_rows - 1) / max_rows;
  const int64_t rows = (M + tiles - 1) / tiles;
  return std::min(max_rows, (rows + multiple - 1) / multiple * multiple);
}

// The largest |x[k]| of count values (a multiple of 16): the scale of a block of rounded
// activations (int8_linear.cpp, int16_linear.cpp). A maximum is exact in any order.
inline float largest_magnitude(const float* x, int64_t count) {
  v16 amax = {};
  for (int64_t k = 0; k < count; k += 16) {
    const v16 v = load16(x + k);
    const v16 magnitude = select(v < 0, -v, v);
    amax = select(magnitude > amax, magnitude, amax);
  }
  float top = 0.0f;
  for (int i = 0; i < 16; ++i) top = std::max(top, amax[i]);
  return top;
}

// Where a register block's sums start and end: from `partial` or from zero (a first column
// step), and back into `partial` or, after the last column step, straight into y as finished
// sums (horizontal_sum's, four at a time): no zeroing pass, no parking, no reloading.
struct Ends {
  bool from_zero = false;
  float* y = nullptr;  // non-null: finish into y[i * y_stride + j] instead of parking in partial
  int64_t y_stride = 0;
};


// y[i * y_stride + j] = horizontal_sum(acc[i][j]) for NUM_X x NUM_W sums, four at a time where
// a row has four (horizontal_sums4: the same tree, so the same bits).
template <int NUM_X, int NUM_W>
inline void store_sums(v16 (&acc)[NUM_X][NUM_W], float* y, int64_t y_stride) {
#pragma GCC unroll 16
  for (int i = 0; i < NUM_X; ++i) {
    float* out = y + i * y_stride;
    if constexpr (NUM_W == 4) {
      const v4 sums = horizontal_sums4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      std::memcpy(out, &sums, sizeof sums);
    } else {
      for (int j = 0; j < NUM_W; ++j) out[j] = horizontal_sum(acc[i][j]);
    }
  }
}

}  // namespace draftwise
