// The linear products: bfloat16 and int8 weights in blocks, plain int8 codes for a few rows.

#include "blocks.h"

namespace zerobubble {
namespace {
// ---------------------------------------------------------------------------------------------
// weight-only int8 product for a few rows (a decode step of one or a few requests)

// The dot products of float32 x [in] with four int8 weight rows. The weights are widened by
// instruction, 16 at a time with AVX-512 and 8 with AVX2 (the compiler's own vectorization of
// this loop is several times slower); elsewhere a plain loop.
constexpr int64_t kPrefetchQuads = 1;

inline void dot4_int8(const float* x, const int8_t* w0, const int8_t* w1, const int8_t* w2, const int8_t* w3,
                      int64_t in, float* sums) {
  int64_t k = 0;
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const int8_t* rows[4] = {w0, w1, w2, w3};
  const int64_t ahead = kPrefetchQuads * 4 * in;
#if defined(__AVX512F__)
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (; k + 16 <= in; k += 16) {
    const __m512 xv = _mm512_loadu_ps(x + k);
    for (int r = 0; r < 4; ++r) {
      if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k + ahead), _MM_HINT_T0);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + k));
      acc[r] = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(packed)), acc[r]);
    }
  }
  for (int r = 0; r < 4; ++r) a[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; k + 8 <= in; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (int r = 0; r < 4; ++r) {
      if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k + ahead), _MM_HINT_T0);
      const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[r] + k));
      acc[r] = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(packed)), acc[r]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    a[r] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
  }
#else
  (void)rows;
  (void)ahead;
#endif
  for (; k < in; ++k) {
    a[0] += x[k] * static_cast<float>(w0[k]);
    a[1] += x[k] * static_cast<float>(w1[k]);
    a[2] += x[k] * static_cast<float>(w2[k]);
    a[3] += x[k] * static_cast<float>(w3[k]);
  }
  std::copy(a, a + 4, sums);
}

// y[m, n] = scale[n] * sum_k x[m, k] w[n, k], summed in float32 and rounded once, as torch's
// int8 weight-only product does. Four weight rows at a time, so four independent sums hide the
// multiply-add latency and each activation load serves four rows; the weight streams from
// memory once, which is what bounds a decode step.
template <typename T>
void int8_rows(const Tensor& x, const Tensor& weight, const Tensor& scale, Tensor& out) {
  const int64_t rows = x.size(0), in = x.size(1), outs = weight.size(0);
  std::vector<float> xf(static_cast<size_t>(rows * in));
  const T* xp = x.data_ptr<T>();
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k = 0; k < in; ++k) xf[m * in + k] = to_f32(xp[m * x.stride(0) + k]);
  }
  const int8_t* w = weight.data_ptr<int8_t>();
  const T* sp = scale.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, (outs + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t quad = begin; quad < end; ++quad) {
      const int64_t n = quad * 4, count = std::min<int64_t>(4, outs - n);
      // A short last quad repeats its first row; only `count` results are stored.
      const int8_t* w0 = w + n * in;
      const int8_t* w1 = w + (n + (count > 1 ? 1 : 0)) * in;
      const int8_t* w2 = w + (n + (count > 2 ? 2 : 0)) * in;
      const int8_t* w3 = w + (n + (count > 3 ? 3 : 0)) * in;
      for (int64_t m = 0; m < rows; ++m) {
        float sums[4];
        dot4_int8(xf.data() + m * in, w0, w1, w2, w3, in, sums);
        for (int64_t i = 0; i < count; ++i) op[m * outs + n + i] = static_cast<T>(sums[i] * to_f32(sp[n + i]));
      }
    }
  });
}

Tensor int8_linear(const Tensor& x, const Tensor& weight, const Tensor& scale) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in] with unit stride along in");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(1) == x.size(1),
              "weight must be a contiguous int8 [out, in]");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == weight.size(0) && scale.scalar_type() == x.scalar_type(),
              "scale must be [out] in x's dtype");
  Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear",
                                  [&] { int8_rows<scalar_t>(x, weight, scale, out); });
  return out;
}

// ---------------------------------------------------------------------------------------------
// bfloat16 activations times a weight in pairs-of-inputs blocks (blocks.h)

// Threads take groups of three output blocks; each streams from memory once and serves every
// input row, up to 8 at a time, from the cache.
template <typename W>
void block_rows(const Tensor& x, const Tensor& blocks, int64_t out_features, const c10::BFloat16* scale,
                const c10::BFloat16* bias, Tensor& out) {
  const int64_t rows = x.size(0), pairs = blocks.size(1), num_blocks = blocks.size(0);
  const int64_t block_stride = pairs * 2 * kBlockLanes;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const W* wp = blocks.data_ptr<W>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, num_blocks / kBlockGroupBlocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      const int64_t block = group * kBlockGroupBlocks, first_out = block * kBlockLanes;
      // Every group holds outputs: the padding is less than one group (block_linear checks it).
      block_group_rows<W>(xp, x.stride(0), rows, wp + block * block_stride, block_stride, pairs,
                          group + 1 < end ? kBlockGroupBlocks * block_stride : 0,
                          scale == nullptr ? nullptr : scale + first_out, bias == nullptr ? nullptr : bias + first_out,
                          op + first_out, out_features,
                          std::min(kBlockGroupBlocks * kBlockLanes, out_features - first_out));
    }
  });
}

// y = (x w^T) * scale (+ bias) for bfloat16 x [rows, in] and w packed by `pack_blocks`:
// bfloat16 weights (no scale; float32 sums rounded once, as oneDNN's bfloat16 product does) or
// int8 ones with a scale per output (as torch's weight-only int8 product, the bias in the same
// rounding).
Tensor block_linear(const Tensor& x, const Tensor& blocks, int64_t out_features, const std::optional<Tensor>& scale,
                    const std::optional<Tensor>& bias) {
  check_cpu(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x must be bfloat16 [rows, in] with an even `in` and unit stride along it");
  const bool is_int8 = blocks.scalar_type() == at::kChar;
  TORCH_CHECK((is_int8 || blocks.scalar_type() == at::kBFloat16) && blocks.is_contiguous() && blocks.dim() == 4 &&
                  blocks.size(0) % kBlockGroupBlocks == 0 && blocks.size(0) * kBlockLanes >= out_features &&
                  (blocks.size(0) - kBlockGroupBlocks) * kBlockLanes < out_features && blocks.size(1) * 2 == x.size(1) &&
                  blocks.size(2) == kBlockLanes && blocks.size(3) == 2,
              "blocks must be a contiguous bfloat16 or int8 [out / 16 (padded to a multiple of 3), in / 2, 16, 2] "
              "weight for x");
  TORCH_CHECK(is_int8 == scale.has_value(), "scale must be given for int8 blocks, and only for them");
  for (const auto* t : {&scale, &bias}) {
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kBFloat16 && (*t)->is_contiguous() &&
                                    (*t)->numel() == out_features),
                "scale and bias must be bfloat16 [out_features]");
  }
  Tensor out = at::empty({x.size(0), out_features}, x.options());
  const c10::BFloat16* sp = scale.has_value() ? scale->data_ptr<c10::BFloat16>() : nullptr;
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  if (is_int8) {
    block_rows<int8_t>(x, blocks, out_features, sp, bp, out);
  } else {
    block_rows<c10::BFloat16>(x, blocks, out_features, sp, bp, out);
  }
  return out;
}

bool block_linear_is_native() { return kNativeBf16; }

}  // namespace
}  // namespace zerobubble

TORCH_LIBRARY_IMPL(zerobubble_cpu, CPU, m) {
  m.impl("int8_linear", &zerobubble::int8_linear);
  m.impl("block_linear", &zerobubble::block_linear);
}

TORCH_LIBRARY_IMPL(zerobubble_cpu, CompositeExplicitAutograd, m) {
  m.impl("block_linear_is_native", &zerobubble::block_linear_is_native);
}
