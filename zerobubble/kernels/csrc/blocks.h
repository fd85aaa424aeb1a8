// The bfloat16 block product's inner routines (linear.cpp's block_linear, moe.cpp's routed
// experts): a weight in pairs-of-inputs blocks times a few bfloat16 rows, one group of three
// output blocks at a time.

#pragma once

#include "common.h"

namespace zerobubble {
namespace {
// ---------------------------------------------------------------------------------------------
// bfloat16 activations times a weight in pairs-of-inputs blocks (bfloat16, or int8 with scales)

// The weight is laid out once, at load time, as [out / 16][in / 2][16][2] (`pack_blocks` in
// zerobubble/kernels/linear.py; the block count padded with zeros to a multiple of 3): for 16
// outputs, each pair of inputs' 32 values is one vector, so one AVX-512 BF16 instruction multiplies it exactly by an input row's pair (broadcast) and adds
// into 16 float32 sums, one per output; no sums need folding across lanes at the end. Three
// blocks are read together, each triple of weight vectors serving up to 8 input rows from
// registers. int8 weights (weight-only quantization, a scale per output) are widened to bfloat16
// as they are read, exactly (|q| <= 127 needs 7 bits), and the sums scaled at the end. Without
// AVX-512 BF16 a plain loop does the same sums (correct, not fast: callers use this product only
// where `block_linear_is_native()` says the instructions were compiled in).
#if defined(__AVX512BF16__)
constexpr bool kNativeBf16 = true;
#else
constexpr bool kNativeBf16 = false;
#endif
constexpr int64_t kBlockLanes = 16;       // outputs per block
constexpr int kBlockMaxTileRows = 8;      // input rows sharing the weight vectors in registers
constexpr int kBlockGroupBlocks = 3;  // blocks read together: 8 x 3 sums, 3 weight vectors

#if defined(__AVX512BF16__)
inline __m512bh load_pairs(const c10::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}
inline __m512bh load_pairs(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}
#endif

template <typename W>
struct BlockTile {
  const c10::BFloat16* const* x;  // R input rows
  const W* w;                     // the first block's first pair
  int64_t block_stride;           // elements from one block to the next
  int64_t pairs;                  // in / 2
  int64_t ahead;                  // elements to prefetch ahead of the weight read (0: none)
  const c10::BFloat16* scale;     // at the first block's first output, or null (no scales)
  const c10::BFloat16* bias;      // at the first block's first output, or null
  c10::BFloat16* out;             // at (first row, first block's first output)
  int64_t out_stride;
  int64_t count;                  // outputs to store from the first block on (B blocks hold up to 16 B)
};

// out[r][b * 16 + lane] for R rows and B blocks: float32 sums, scaled, bias added, rounded once.
template <typename W, int R, int B>
void block_tile(const BlockTile<W>& t) {
#if defined(__AVX512BF16__)
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  }
  for (int64_t kk = 0; kk < t.pairs; ++kk) {
    __m512bh wv[B];
    for (int b = 0; b < B; ++b) {
      const W* wp = t.w + b * t.block_stride + kk * 2 * kBlockLanes;
      if (t.ahead != 0) _mm_prefetch(reinterpret_cast<const char*>(wp + t.ahead), _MM_HINT_T0);
      wv[b] = load_pairs(wp);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, t.x[r] + 2 * kk, sizeof(pair));
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  float sums[R][B * kBlockLanes];
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(sums[r] + b * kBlockLanes, acc[r][b]);
  }
#else
  float sums[R][B * kBlockLanes] = {};
  for (int64_t kk = 0; kk < t.pairs; ++kk) {
    for (int b = 0; b < B; ++b) {
      const W* wp = t.w + b * t.block_stride + kk * 2 * kBlockLanes;
      for (int r = 0; r < R; ++r) {
        const float x0 = to_f32(t.x[r][2 * kk]), x1 = to_f32(t.x[r][2 * kk + 1]);
        for (int64_t lane = 0; lane < kBlockLanes; ++lane) {
          sums[r][b * kBlockLanes + lane] += x0 * to_f32(wp[2 * lane]) + x1 * to_f32(wp[2 * lane + 1]);
        }
      }
    }
  }
#endif
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < t.count; ++j) {
      const float scale = t.scale == nullptr ? 1.0f : to_f32(t.scale[j]);
      const float bias = t.bias == nullptr ? 0.0f : to_f32(t.bias[j]);
      t.out[r * t.out_stride + j] = static_cast<c10::BFloat16>(sums[r][j] * scale + bias);
    }
  }
}

template <typename W>
void block_tile_rows(int rows, const BlockTile<W>& t) {
  constexpr int B = kBlockGroupBlocks;
  switch (rows) {
    case 1: return block_tile<W, 1, B>(t);
    case 2: return block_tile<W, 2, B>(t);
    case 3: return block_tile<W, 3, B>(t);
    case 4: return block_tile<W, 4, B>(t);
    case 5: return block_tile<W, 5, B>(t);
    case 6: return block_tile<W, 6, B>(t);
    case 7: return block_tile<W, 7, B>(t);
    default: return block_tile<W, 8, B>(t);
  }
}

// One group of three output blocks (`w`: its first block) for `rows` input rows at `x` (row
// stride `x_stride`), in tiles of up to 8 rows as even as the row count allows (12 rows: 6 + 6,
// not 8 + 4); `ahead`: elements past `w` to prefetch during the first tile (0: none), the next
// group the caller will read.
template <typename W>
void block_group_rows(const c10::BFloat16* x, int64_t x_stride, int64_t rows, const W* w, int64_t block_stride,
                      int64_t pairs, int64_t ahead, const c10::BFloat16* scale, const c10::BFloat16* bias,
                      c10::BFloat16* out, int64_t out_stride, int64_t count) {
  const int64_t num_tiles = (rows + kBlockMaxTileRows - 1) / kBlockMaxTileRows;
  const c10::BFloat16* xr[kBlockMaxTileRows];
  for (int64_t tile = 0, m = 0; tile < num_tiles; ++tile) {
    const int64_t tile_rows = (rows - m) / (num_tiles - tile);
    for (int64_t r = 0; r < tile_rows; ++r) xr[r] = x + (m + r) * x_stride;
    const BlockTile<W> t{xr, w, block_stride, pairs, tile == 0 ? ahead : 0, scale, bias, out + m * out_stride,
                         out_stride, count};
    block_tile_rows<W>(static_cast<int>(tile_rows), t);
    m += tile_rows;
  }
}

}  // namespace
}  // namespace zerobubble
