// y = x @ W.T with x and W's values rounded to bfloat16 (bf16_linear.cpp's rounding, the same
// values) and the products summed by AMX tiles (Intel Xeon since Sapphire Rapids): `--activations
// amx`.
//
// Why: a tile multiply (tdpbf16ps) does 16 x 16 x 32 multiply-adds an instruction, so once the
// weights are decoded the products cost next to nothing, for one row of x or sixteen: a verify
// forward of up to 16 tokens costs about what the decoding of the weights costs, and a prefill
// decodes the weights once per block of up to 512 rows of x.
//
// Arithmetic: tdpbf16ps does not sum like vdpbf16ps (measured on this project's AMX Xeon: its
// results match neither order of sequential float32 sums, nor one rounding per pair or per
// instruction, in 62-79% of random outputs), so this is an arithmetic of its own, not
// bf16_linear's. It is still batch-invariant: y[m, n] is the hardware's per-element sum of x row
// m with weight row n, 32 columns an instruction in column order from zero, whatever else the
// tiles hold (measured: every element of 1, 3 and 9 rows of x equals its element among 16).
// Every row count takes the same path here, so a row of y is bit-identical whether x has 1 row,
// 9, or 2000.
//
// How: A = 16 weight rows, decoded and rounded once per call into a buffer (row-major, as decoded),
// B = 16 rows of x laid out in pairs of columns (the layout tdpbf16ps reads its second operand in),
// C[n][m] = their products, written to y through a register transpose. Two layouts by rows of
// x: up to 16 (a decode or verify step) one B tile against four groups of weight rows; more (a
// long draft, a tree, a batch, a prefill) pairs of B tiles against pairs of groups, a prefill in
// blocks of at most 512 rows of x. Each C element's sum is the same in every layout.
//
// What bounds a prefill here is loading tiles, not multiplying them: on this project's AMX Xeon a
// core ran tdpbf16ps at ~1,750 G multiply-adds a second with its operands in tiles, but at ~450
// when every product loaded a 1 KB tile, even from L1 (measured, 2026-11-26). A 2 x 2 layout
// loads one tile per product, a 1 x 6 layout (its predecessor here) 7/6; with the next steps'
// tiles prefetched, Qwen2.5-Coder-1.5B prefills 10-20% faster (1,024 tokens: 262 -> 311 tok/s).
#include "bf16.h"
#include "formats.h"
#include "kernels.h"
#include "message.h"
#include "tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DRAFTWISE_AMX 1
#endif

namespace draftwise {

#if defined(DRAFTWISE_AMX)
namespace {

constexpr int64_t ROWS = 16;     // weight rows in an A tile; rows of x in a B tile
constexpr int64_t COLUMNS = 32;  // bfloat16 columns per tdpbf16ps
constexpr int64_t SEGMENT = 2048;  // columns decoded at a time for up to 16 rows of x (whole K-quant blocks)
constexpr int64_t BLOCK = 512;     // rows of x per pass over the weights (amx_linear)

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 and 1: 16 rows of 64 bytes (A: 16 weight rows x 32 columns). Tiles 2..7 (B and C):
// 16 rows of `width` x 4 bytes, width = the rows of x a B tile holds (16, or M below 16: a decode
// step's B tile then holds no zeros, and its sums are the same bits, each element its own).
void configure_tiles(int64_t width) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = ROWS;
    config.bytes_per_row[t] = t < 2 ? 64 : width * 4;
  }
  _tile_loadconfig(&config);
}

// Linux hands out the tile registers' state on request, once per process.
bool tiles_permitted() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return permitted;
}

// One row chunk of x (up to 16 rows: a decode or verify step) against `groups` (<= 4) groups of 16
// weight rows: C tiles 4..7, one per group, so that four independent sums are in flight (one
// tile's chain of tdpbf16ps waits on its latency); A alternates between tiles 0 and 1.
void wide_products(const uint16_t* a, int64_t a_stride, const uint16_t* b, int64_t width, int64_t steps,
                   int64_t groups) {
  const int64_t group_stride = ROWS * a_stride;
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(2, b + s * ROWS * 2 * width, width * 4);
    const uint16_t* as = a + s * COLUMNS;
    _tile_loadd(0, as, a_stride * 2);
    _tile_dpbf16ps(4, 0, 2);
    if (groups > 1) {
      _tile_loadd(1, as + group_stride, a_stride * 2);
      _tile_dpbf16ps(5, 1, 2);
    }
    if (groups > 2) {
      _tile_loadd(0, as + 2 * group_stride, a_stride * 2);
      _tile_dpbf16ps(6, 0, 2);
    }
    if (groups > 3) {
      _tile_loadd(1, as + 3 * group_stride, a_stride * 2);
      _tile_dpbf16ps(7, 1, 2);
    }
  }
}

// out[m * out_stride + j] = tile[j * in_stride + m] for a whole 16 x 16 block of 32-bit values: a
// register transpose (unpack pairs, then quads, then 128-bit lanes twice), so that each row of y
// is written as one 64-byte line instead of sixteen scattered floats, and 16 rows of x become a B
// tile (their bfloat16 pairs moved as 32-bit units: shuffles move bits, never round them).
void store_transposed(const float* tile, float* out, int64_t out_stride, int64_t in_stride = 16) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(tile + in_stride * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);      // per lane: a0 b0 a1 b1
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);  // a2 b2 a3 b3
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);  // a0 b0 c0 d0
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);  // a1 b1 c1 d1
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);  // a2 b2 c2 d2
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);  // a3 b3 c3 d3
  }
  // r[4q + c] holds, for rows 4q..4q+3, columns c, c + 4, c + 8, c + 12 in its four lanes.
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);        // columns c, c + 8 of rows 0..7
    t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);    // columns c + 4, c + 12 of rows 0..7
    t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);   // columns c, c + 8 of rows 8..15
    t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);  // columns c + 4, c + 12 of rows 8..15
  }
  for (int c = 0; c < 8; ++c) {
    _mm512_storeu_ps(out + c * out_stride, _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88));        // column c
    _mm512_storeu_ps(out + (c + 8) * out_stride, _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD));  // column c + 8
  }
}

// Two row chunks of x against up to two groups of 16 weight rows: B tiles 2 and 3, C tiles 4..7 =
// (group 0, chunk 0), (group 0, chunk 1), (group 1, chunk 0), (group 1, chunk 1): again four sums
// in flight. PREFETCH: fetch the tiles of two steps ahead (a prefill's A buffer and B tiles are
// too big for L1, and the hardware prefetchers do not follow a tile's 16 strided rows).
template <bool PREFETCH = false>
void pair_products(const uint16_t* a, int64_t a_stride, const uint16_t* b, int64_t b_chunk_stride, int64_t steps,
                   int64_t groups) {
  const int64_t group_stride = ROWS * a_stride;
  for (int64_t s = 0; s < steps; ++s) {
    if (PREFETCH && s + 2 < steps) {
      const char* next_b = reinterpret_cast<const char*>(b + (s + 2) * ROWS * COLUMNS);
      for (int64_t line = 0; line < 1024; line += 64) {
        __builtin_prefetch(next_b + line);
        __builtin_prefetch(next_b + 2 * b_chunk_stride + line);
      }
      for (int64_t r = 0; r < groups * ROWS; ++r) __builtin_prefetch(a + r * a_stride + (s + 2) * COLUMNS);
    }
    _tile_loadd(2, b + s * ROWS * COLUMNS, 64);
    _tile_loadd(3, b + b_chunk_stride + s * ROWS * COLUMNS, 64);
    const uint16_t* as = a + s * COLUMNS;
    _tile_loadd(0, as, a_stride * 2);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if (groups > 1) {
      _tile_loadd(1, as + group_stride, a_stride * 2);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
}

// The four C tiles (4..7) of wide_products and pair_products.
void zero_sums() {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
}

void store_sums(float* sums) {  // sums [4 tiles][16 weight rows][16 rows of x]
  _tile_stored(4, sums, 64);
  _tile_stored(5, sums + 1 * ROWS * ROWS, 64);
  _tile_stored(6, sums + 2 * ROWS * ROWS, 64);
  _tile_stored(7, sums + 3 * ROWS * ROWS, 64);
}

}  // namespace

bool amx_in_hardware() { return tiles_permitted(); }

// One weight of a product that shares its x: N rows of row_bytes in `format`; its y rows (N floats
// each) start at out.
struct Part {
  const uint8_t* w;
  int64_t N, row_bytes, format;
  float* out;
};

// For each part, y rows = x rows (M of them) @ W.T: the whole product for a block of rows of x (see
// amx_linear for why blocks). Several parts (a layer's q, k and v, or gate and up) share x's
// rounding and B tiles and one parallel region; their work items are the same as alone.
void amx_rows(const float* x, int64_t M, const std::vector<Part>& parts, int64_t K) {
  const int64_t Kp = (K + COLUMNS - 1) / COLUMNS * COLUMNS, steps = Kp / COLUMNS;
  std::unique_ptr<uint16_t[]> x_rounded(new uint16_t[M * Kp]);  // every entry written by round_x_rows
  round_x_rows(x, M, K, Kp, x_rounded.get());
  // B tiles: chunk c (rows 16c..16c+15 of x, zeros past M), step s -> [16 column pairs][width rows][2];
  // width = M for a decode step (every entry written), else 16.
  const int64_t num_chunks = (M + ROWS - 1) / ROWS, width = std::min(M, ROWS);
  const int64_t chunk_stride = steps * ROWS * 2 * width;
  std::unique_ptr<uint16_t[]> b(new uint16_t[num_chunks * chunk_stride]);
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      uint16_t* chunk = b.get() + c * chunk_stride;
      if (width == ROWS && (c + 1) * ROWS <= M) {  // 16 rows: each step's tile is a 16 x 16 transpose of pairs
        for (int64_t s = 0; s < steps; ++s)
          store_transposed(reinterpret_cast<const float*>(x_rounded.get() + c * ROWS * Kp + s * COLUMNS),
                           reinterpret_cast<float*>(chunk + s * ROWS * COLUMNS), ROWS, Kp / 2);
        continue;
      }
      if (width == ROWS) std::fill(chunk, chunk + chunk_stride, uint16_t(0));  // the last chunk's missing rows
      for (int64_t m = c * ROWS; m < std::min(M, (c + 1) * ROWS); ++m)
        for (int64_t s = 0; s < steps; ++s)
          for (int64_t pair = 0; pair < COLUMNS / 2; ++pair) {
            uint16_t* out = chunk + (s * ROWS + pair) * 2 * width + (m % ROWS) * 2;
            std::memcpy(out, x_rounded.get() + m * Kp + s * COLUMNS + 2 * pair, 4);
          }
    }
  });
  // A work item: up to 4 groups of 16 weight rows (the C tiles of a decode step), decoded and
  // rounded once into a buffer; fewer where that splits the groups more evenly over the threads
  // (SmolLM2's 192-row projections are 12 groups: 3 items of 4 would leave one thread twice the work).
  const int64_t threads = at::get_num_threads();
  // Two chunks of x (17-32 rows) take two groups an item: their four C tiles are (group, chunk) pairs.
  const int64_t most_groups = num_chunks == 2 ? 2 : 4;
  auto num_items = [&](int64_t per_item) {
    int64_t items = 0;
    for (const Part& part : parts) items += ((part.N + ROWS - 1) / ROWS + per_item - 1) / per_item;
    return items;
  };
  int64_t groups_per_item = most_groups;
  auto busiest = [&](int64_t per_item) { return (num_items(per_item) + threads - 1) / threads * per_item; };
  for (int64_t per_item = most_groups - 1; per_item >= 1; --per_item)
    if (busiest(per_item) < busiest(groups_per_item)) groups_per_item = per_item;
  struct Item {
    const Part* part;
    int64_t n0;
  };
  std::vector<Item> items;
  for (const Part& part : parts)
    for (int64_t n0 = 0; n0 < part.N; n0 += groups_per_item * ROWS) items.push_back({&part, n0});
  // The A buffer's rows: a decode step's segment or all of K, plus 64 bytes, so that 16 rows a
  // power of two apart (2048 columns: 4 KB) do not all fall in one set of the L1 cache.
  const int64_t a_stride = (num_chunks <= 2 ? std::min(SEGMENT, Kp) : Kp) + COLUMNS;
  at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
    configure_tiles(width);
    // the A buffer (64 rounded weight rows), one row's floats, the C tiles' sums
    float* buffer = thread_buffer(4 * ROWS * a_stride / 2 + Kp + 4 * ROWS * ROWS);
    uint16_t* a = reinterpret_cast<uint16_t*>(buffer);
    float* scratch = buffer + 4 * ROWS * a_stride / 2;
    float* sums = scratch + Kp;
    for (int64_t item = i0; item < i1; ++item) {
      const Part& part = *items[item].part;
      const uint8_t* w = part.w;
      const int64_t N = part.N, row_bytes = part.row_bytes, format = part.format, n0 = items[item].n0;
      const int64_t rows = std::min(groups_per_item * ROWS, N - n0);
      float* out = part.out;
      const int64_t groups = (rows + ROWS - 1) / ROWS;
      // y[m, n0 + 16 g + j] = tiles[(i * 16 + j) * 16 + m % 16] for chunk i of x, group g
      auto write = [&](const float* tiles, int64_t g, int64_t first_chunk, int64_t chunks) {
        const int64_t group_rows = std::min(ROWS, rows - g * ROWS);
        for (int64_t i = 0; i < chunks; ++i) {
          const int64_t m0 = (first_chunk + i) * ROWS;
          if (group_rows == ROWS && m0 + ROWS <= M) {
            store_transposed(tiles + i * ROWS * ROWS, out + m0 * N + n0 + g * ROWS, N);
            continue;
          }
          for (int64_t m = m0; m < std::min(M, m0 + ROWS); ++m)
            for (int64_t j = 0; j < group_rows; ++j)
              out[m * N + n0 + g * ROWS + j] = tiles[(i * ROWS + j) * ROWS + m % ROWS];
        }
      };
      if (num_chunks <= 2) {
        // Up to 32 rows of x: decode SEGMENT columns of the item's weight rows at a time (256 KB
        // at most, in L2) and multiply them; the C tiles carry the sums across segments.
        zero_sums();
        for (int64_t k0 = 0; k0 < Kp; k0 += SEGMENT) {
          const int64_t columns = std::min(SEGMENT, Kp - k0);
          round_rows(format, w + n0 * row_bytes, row_bytes, rows, K, k0, columns, scratch, a, a_stride);
          std::fill(a + rows * a_stride, a + groups * ROWS * a_stride, uint16_t(0));  // the last group's missing rows
          if (num_chunks == 1)
            wide_products(a, a_stride, b.get() + k0 / COLUMNS * ROWS * 2 * width, width, columns / COLUMNS, groups);
          else
            pair_products(a, a_stride, b.get() + k0 / COLUMNS * ROWS * COLUMNS, chunk_stride, columns / COLUMNS, groups);
        }
        store_sums(sums);
        // group g's tiles (one per chunk of x) follow one another: 4 + g, or 4 + 2g and 5 + 2g
        for (int64_t g = 0; g < groups; ++g) write(sums + num_chunks * g * ROWS * ROWS, g, 0, num_chunks);
        continue;
      }
      round_rows(format, w + n0 * row_bytes, row_bytes, rows, K, 0, Kp, scratch, a, a_stride);
      std::fill(a + rows * a_stride, a + groups * ROWS * a_stride, uint16_t(0));
      // Pairs of chunks of x against pairs of groups of weight rows (pair_products: each step loads
      // two A and two B tiles for four products, where a 1 x 6 layout loaded seven tiles for six:
      // tile loads, not products, bound this loop), the chunk pairs outermost, so that a pair's B
      // tiles serve all the item's groups while they are in cache.
      for (int64_t c = 0; c + 1 < num_chunks; c += 2)
        for (int64_t g = 0; g < groups; g += 2) {
          const int64_t pair_groups = std::min<int64_t>(2, groups - g);
          zero_sums();
          pair_products<true>(a + g * ROWS * a_stride, a_stride, b.get() + c * chunk_stride, chunk_stride, steps,
                              pair_groups);
          store_sums(sums);
          for (int64_t i = 0; i < pair_groups; ++i) write(sums + 2 * i * ROWS * ROWS, g + i, c, 2);
        }
      if (num_chunks % 2) {  // the last chunk alone, against all the item's groups
        zero_sums();
        wide_products(a, a_stride, b.get() + (num_chunks - 1) * chunk_stride, ROWS, steps, groups);
        store_sums(sums);
        for (int64_t g = 0; g < groups; ++g) write(sums + g * ROWS * ROWS, g, num_chunks - 1, 1);
      }
    }
    _tile_release();
  });
}

std::vector<at::Tensor> amx_linears(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                    const std::vector<int64_t>& formats, int64_t K) {
  TORCH_CHECK(weights.size() == formats.size() && !weights.empty(), "amx_linears: one format per weight");
  for (size_t i = 0; i < weights.size(); ++i) check_weight(weights[i], formats[i], K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, say("amx_linear: x ", x.sizes(), " does not have ", K, " columns"));
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "amx_linear: x must be contiguous float32");
  TORCH_CHECK(tiles_permitted(), "amx_linear: this CPU or kernel gives no AMX tiles; use --activations bf16");
  const int64_t M = x.size(0);
  std::vector<at::Tensor> ys;
  for (const at::Tensor& weight : weights) ys.push_back(at::empty({M, weight.size(0)}, x.options()));
  if (M == 0) return ys;
  if (K == 0) {
    for (at::Tensor& y : ys) y.zero_();
    return ys;
  }
  // A long prefill runs in blocks of at most BLOCK rows of x, each decoding the weights again:
  // every work item streams all of its block's B tiles once per group of weight rows, and a
  // block of 512 rows stays in L2 where 2048 do not (Qwen2.5-Coder-1.5B, a 2,048-token prefill
  // in one forward: 205 -> 240 tok/s). Rows are computed alike in any block, so the bits do not
  // change.
  const int64_t blocks = (M + BLOCK - 1) / BLOCK, per_block = (M + blocks - 1) / blocks;
  for (int64_t m0 = 0; m0 < M; m0 += per_block) {
    std::vector<Part> parts;
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t N = weights[i].size(0);
      if (N) parts.push_back(Part{weights[i].data_ptr<uint8_t>(), N, weights[i].size(1), formats[i],
                                  ys[i].data_ptr<float>() + m0 * N});
    }
    if (!parts.empty()) amx_rows(x.data_ptr<float>() + m0 * K, std::min(per_block, M - m0), parts, K);
  }
  return ys;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t K) {
  return amx_linears(x, {weight}, {format}, K)[0];
}

#else

bool amx_in_hardware() { return false; }

at::Tensor amx_linear(const at::Tensor&, const at::Tensor&, int64_t, int64_t) {
  TORCH_CHECK(false, "amx_linear: these kernels were built for a CPU without AMX-BF16; use --activations bf16");
}

std::vector<at::Tensor> amx_linears(const at::Tensor&, const std::vector<at::Tensor>&, const std::vector<int64_t>&,
                                    int64_t) {
  TORCH_CHECK(false, "amx_linear: these kernels were built for a CPU without AMX-BF16; use --activations bf16");
}

#endif

}  // namespace draftwise
