// What the two bfloat16-activation products share (bf16_linear.cpp: AVX-512 BF16's dot product;
// amx_linear.cpp: AMX tiles): the same rounding of x and of the weights' values to bfloat16.
#pragma once

#include <cstdint>

namespace draftwise {

// x [M, K] float32 -> out [M, Kp] bfloat16 (round to nearest even), zeros past K; Kp a multiple of 32.
void round_x_rows(const float* x, int64_t M, int64_t K, int64_t Kp, uint16_t* out);
// Weight row `row` (K weights in format), columns [k0, k0 + columns) rounded to bfloat16 into
// out, zeros past K; k0 whole blocks, scratch holds `columns` floats.
void round_row(int64_t format, const uint8_t* row, int64_t K, int64_t k0, int64_t columns, float* scratch,
               uint16_t* out);

// Weight rows [0, rows) of w (row_bytes apart), columns [k0, k0 + columns), rounded as round_row
// does into out (row j at out + j * out_stride); block formats two rows abreast. k0 and columns are
// whole blocks (k0 + columns may pass K by the zeros of a float format's last 32 columns);
// scratch holds `columns` floats.
void round_rows(int64_t format, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K, int64_t k0,
                int64_t columns, float* scratch, uint16_t* out, int64_t out_stride);

}  // namespace draftwise
