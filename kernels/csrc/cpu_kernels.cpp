// CPU kernels of the decode path: the residual add + RMSNorm, q/k norm + RoPE, SiLU·up, the
// paged KV write, paged attention for short query rows, the bfloat16 product and the weight-only
// int8 products, each one pass over its data.
//
// Run one aten op at a time, these steps cost some thirty dispatches a layer (a few microseconds
// each, whatever the size), which at a decode batch's few rows is as long as the layer's matmuls.
// Each kernel reproduces its torch twin in zerobubble/kernels (fused.py, attention.py): values are
// computed in float32 and rounded to the tensor dtype exactly where the twin rounds, so 16-bit
// results agree with the twin to within one rounding step (reductions sum in another order).
// Registered as torch operators in the `zerobubble_cpu` namespace (zerobubble/kernels/cpu.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}

// bfloat16 -> float is a shift; spelled out so that loops over it vectorize.
template <>
inline float to_f32<c10::BFloat16>(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Rounds to the tensor dtype (round to nearest even, as torch's casts do).
template <typename T>
inline float round_to(float v) {
  return to_f32<T>(static_cast<T>(v));
}

// exp(x), x clamped to [-87, 88] (the normal floats): 2^n * 2^f with n the nearest integer to
// x log2(e) and 2^f, |f| <= 1/2, from its degree-6 Taylor polynomial (relative error below 2e-7).
// A plain loop over it vectorizes, which std::exp's library call does not.
inline float fast_exp(float x) {
  float t = std::min(std::max(x, -87.0f), 88.0f) * 1.4426950408889634f;
  float n = std::nearbyint(t);
  float f = t - n;
  float p = 1.5403530393381608e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Asks for `bytes` at `p` to be brought into the cache ahead of use: a paged cache's next block
// lies anywhere in memory, where the hardware's stream prefetcher cannot guess it.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

template <typename T>
inline float inverse_rms(const T* x, int64_t n, double eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float v = to_f32(x[i]);
    sum += v * v;
  }
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
}

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// ---------------------------------------------------------------------------------------------
// residual add + RMSNorm

template <typename T, typename R>
void add_rms_norm_rows(const Tensor& x, const R* residual, int64_t residual_stride, const Tensor& weight,
                       double eps, Tensor& out, Tensor& summed) {
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* sp = summed.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = xp + t * x_stride;
      float* s = sp + t * hidden;
      if (residual != nullptr) {
        const R* r = residual + t * residual_stride;
        for (int64_t i = 0; i < hidden; ++i) s[i] = to_f32(r[i]) + to_f32(row[i]);
      } else {
        for (int64_t i = 0; i < hidden; ++i) s[i] = to_f32(row[i]);
      }
      const float inv = inverse_rms(s, hidden, eps);
      T* o = op + t * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = static_cast<T>(to_f32(w[i]) * round_to<T>(s[i] * inv));
    }
  });
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const std::optional<Tensor>& residual,
                                        const Tensor& weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, hidden] with unit stride along hidden");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  Tensor out = at::empty(x.sizes(), x.options());
  Tensor summed = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    if (!residual.has_value()) {
      add_rms_norm_rows<scalar_t, float>(x, nullptr, 0, weight, eps, out, summed);
      return;
    }
    const Tensor& r = *residual;
    TORCH_CHECK(r.sizes() == x.sizes() && r.stride(1) == 1, "residual must be shaped like x");
    if (r.scalar_type() == at::kFloat) {
      add_rms_norm_rows<scalar_t, float>(x, r.data_ptr<float>(), r.stride(0), weight, eps, out, summed);
    } else {
      TORCH_CHECK(r.scalar_type() == x.scalar_type(), "residual must be float32 or x's dtype");
      add_rms_norm_rows<scalar_t, scalar_t>(x, r.data_ptr<scalar_t>(), r.stride(0), weight, eps, out, summed);
    }
  });
  return {out, summed};
}

// ---------------------------------------------------------------------------------------------
// per-head q/k norm + RoPE (half-split layout; cos holds (cos, cos), sin holds (-sin, sin))

template <typename T>
void qk_norm_rope_rows(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const T* norm, int64_t num_heads,
                       int64_t head_dim, double eps, Tensor& out) {
  const int64_t num_tokens = qkv.size(0), half = head_dim / 2;
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, num_tokens * num_heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> x(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / num_heads, h = item % num_heads;
      const T* in = src + t * qkv.stride(0) + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) x[d] = to_f32(in[d]);
      if (norm != nullptr) {
        const float inv = inverse_rms(in, head_dim, eps);
        const T* w = norm + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) x[d] = round_to<T>(to_f32(w[d]) * round_to<T>(x[d] * inv));
      }
      const T* c = cp + t * cos.stride(0);
      const T* s = sp + t * sin.stride(0);
      T* o = op + item * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        const float partner = x[d < half ? d + half : d - half];
        o[d] = static_cast<T>(round_to<T>(x[d] * to_f32(c[d])) + round_to<T>(partner * to_f32(s[d])));
      }
    }
  });
}

Tensor qk_norm_rope(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const std::optional<Tensor>& norm_weight,
                    int64_t num_heads, int64_t head_dim, double eps) {
  check_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= num_heads * head_dim && head_dim % 2 == 0,
              "qkv must be [T, >= num_heads * head_dim] with unit stride along its columns");
  for (const Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == qkv.size(0) && t->size(1) == head_dim && t->stride(1) == 1 &&
                    t->scalar_type() == qkv.scalar_type(),
                "cos and sin must be [T, head_dim] in qkv's dtype");
  }
  Tensor out = at::empty({qkv.size(0), num_heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "qk_norm_rope", [&] {
    const scalar_t* norm = nullptr;
    if (norm_weight.has_value()) {
      TORCH_CHECK(norm_weight->is_contiguous() && norm_weight->numel() == num_heads * head_dim &&
                      norm_weight->scalar_type() == qkv.scalar_type(),
                  "norm_weight must be [num_heads, head_dim] in qkv's dtype");
      norm = norm_weight->data_ptr<scalar_t>();
    }
    qk_norm_rope_rows<scalar_t>(qkv, cos, sin, norm, num_heads, head_dim, eps, out);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// SiLU(gate) * up

Tensor silu_mul(const Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2 I] with unit stride along its columns");
  const int64_t num_tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  Tensor out = at::empty({num_tokens, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    using T = scalar_t;
    const T* src = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, num_tokens, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* gate = src + t * stride;
        const T* up = gate + inter;
        T* o = op + t * inter;
        for (int64_t i = 0; i < inter; ++i) {
          const float g = to_f32(gate[i]);
          o[i] = static_cast<T>(round_to<T>(g / (1.0f + fast_exp(-g))) * to_f32(up[i]));
        }
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// paged KV write

template <typename I>
inline int64_t index_at(const Tensor& t, int64_t i) {
  return static_cast<int64_t>(t.data_ptr<I>()[i * t.stride(0)]);
}

void write_kv_cache(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache, const Tensor& slot_mapping) {
  check_cpu(k, "k");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k, v must be [T, kv_heads, head_dim] and the caches [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k, v and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "slot_mapping must be int32 or int64");
  const int64_t num_tokens = k.size(0), heads = k.size(1), dim = k.size(2), block_size = k_cache.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache", [&] {
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slot_mapping.scalar_type() == at::kLong ? index_at<int64_t>(slot_mapping, t)
                                                                   : index_at<int32_t>(slot_mapping, t);
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (auto [src, cache] : {std::pair<const Tensor*, Tensor*>{&k, &k_cache}, {&v, &v_cache}}) {
        const scalar_t* in = src->data_ptr<scalar_t>() + t * src->stride(0);
        scalar_t* dst = cache->data_ptr<scalar_t>() + block * cache->stride(0) + offset * cache->stride(1);
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t d = 0; d < dim; ++d) {
            dst[h * cache->stride(2) + d * cache->stride(3)] = in[h * src->stride(1) + d * src->stride(2)];
          }
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// paged attention for short query rows

struct AttentionShape {
  int64_t num_q_heads, num_kv_heads, head_dim, block_size, table_stride;
  int64_t q_token_stride, q_head_stride;
  float scale;
  int64_t window;  // 0: none
};

// Query heads attended together: the heads of one grouped-query KV head, at most this many.
constexpr int64_t kMaxGroup = 8;

// Sixteen values of a cache row as float32 in one vector.
#if defined(__AVX512F__)
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// scores[h * span + j] = qs[h] . key j of one cache block (stored [head_dim, block_size]) for G
// heads. With AVX-512 and a block size fixed at a multiple of 16, each key row is widened once
// and the G heads' sums stay in registers; otherwise a plain loop.
template <typename T, int BS, int G>
inline void block_scores(const T* kb, int64_t bs, int64_t dim, const float* qs, int64_t q_stride, float* scores,
                         int64_t span, float* row_f32) {
#if defined(__AVX512F__)
  if constexpr (BS != 0 && BS % 16 == 0) {
    // Even and odd dimensions sum apart: twice the independent chains to hide the latency.
    constexpr int C = BS / 16;
    __m512 acc[2][G][C];
    for (int e = 0; e < 2; ++e) {
      for (int h = 0; h < G; ++h) {
        for (int c = 0; c < C; ++c) acc[e][h][c] = _mm512_setzero_ps();
      }
    }
    const auto add_dim = [&](int64_t d, __m512(&into)[G][C]) {
      __m512 row[C];
      for (int c = 0; c < C; ++c) row[c] = load16(kb + d * BS + c * 16);
      for (int h = 0; h < G; ++h) {
        const __m512 qd = _mm512_set1_ps(qs[h * q_stride + d]);
        for (int c = 0; c < C; ++c) into[h][c] = _mm512_fmadd_ps(qd, row[c], into[h][c]);
      }
    };
    int64_t d = 0;
    for (; d + 2 <= dim; d += 2) {
      add_dim(d, acc[0]);
      add_dim(d + 1, acc[1]);
    }
    if (d < dim) add_dim(d, acc[0]);
    for (int h = 0; h < G; ++h) {
      for (int c = 0; c < C; ++c) {
        _mm512_storeu_ps(scores + h * span + c * 16, _mm512_add_ps(acc[0][h][c], acc[1][h][c]));
      }
    }
    return;
  }
#endif
  for (int h = 0; h < G; ++h) std::fill(scores + h * span, scores + h * span + bs, 0.0f);
  for (int64_t d = 0; d < dim; ++d) {
    for (int64_t j = 0; j < bs; ++j) row_f32[j] = to_f32(kb[d * bs + j]);
    for (int h = 0; h < G; ++h) {
      const float qd = qs[h * q_stride + d];
      for (int64_t j = 0; j < bs; ++j) scores[h * span + j] += qd * row_f32[j];
    }
  }
}

// One query token's heads that share KV head `kv_head` (`num_heads` <= G of them, consecutive):
// scores over the visible context, their softmax in float32, the weighted sums of values. Each
// key and value row is read and widened once for all of them, and the G heads' sums are
// independent chains held in registers (G is fixed at compile time; heads past `num_heads` have
// zero queries and are not stored). Keys are stored [blocks, kv_heads, head_dim, block_size] and
// values [blocks, kv_heads, block_size, head_dim] (zerobubble.kernels.attention.new_kv_cache). BS
// and D, when not 0, fix the block size and head dim at compile time, so that the inner loops are
// whole vector operations.
template <typename T, int BS, int D, int G>
void attend_heads(const T* q, int64_t num_heads, const T* keys, const T* values, const int32_t* table,
                  int64_t query_pos, int64_t kv_head, const AttentionShape& s, std::vector<float>& scores, T* out) {
  const int64_t bs = BS ? BS : s.block_size, dim = D ? D : s.head_dim;
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, query_pos - s.window + 1) : 0;
  const int64_t num_keys = query_pos + 1, num_blocks = (num_keys + bs - 1) / bs, span = num_blocks * bs;
  scores.resize(static_cast<size_t>(G * span));
  const int64_t head_block = dim * bs;  // one KV head's part of a block, keys or values
  float qs[G][D ? D : 1024] = {};
  for (int64_t h = 0; h < num_heads; ++h) {
    for (int64_t d = 0; d < dim; ++d) qs[h][d] = to_f32(q[h * s.q_head_stride + d]) * s.scale;
  }
  float row_f32[D ? std::max(BS, D) : 1024];
  const auto block_of = [&](const T* storage, int64_t b) {
    return storage + (static_cast<int64_t>(table[b]) * s.num_kv_heads + kv_head) * head_block;
  };
  for (int64_t b = first / bs; b < num_blocks; ++b) {
    const T* kb = block_of(keys, b);
    if (b + 1 < num_blocks) prefetch_bytes(block_of(keys, b + 1), head_block * sizeof(T));
    block_scores<T, BS, G>(kb, bs, dim, qs[0], D ? D : 1024, scores.data() + b * bs, span, row_f32);
  }
  float totals[G];
  for (int h = 0; h < G; ++h) {
    float* sc = scores.data() + h * span;
    // Sixteen partial maxima and sums, so that both loops are vector operations.
    float maxima[16], sums[16] = {};
    std::fill(maxima, maxima + 16, -INFINITY);
    int64_t j = first;
    for (; j + 16 <= num_keys; j += 16) {
      for (int l = 0; l < 16; ++l) maxima[l] = std::max(maxima[l], sc[j + l]);
    }
    for (; j < num_keys; ++j) maxima[0] = std::max(maxima[0], sc[j]);
    const float max_score = *std::max_element(maxima, maxima + 16);
    for (j = first; j + 16 <= num_keys; j += 16) {
      for (int l = 0; l < 16; ++l) {
        sc[j + l] = fast_exp(sc[j + l] - max_score);
        sums[l] += sc[j + l];
      }
    }
    for (; j < num_keys; ++j) {
      sc[j] = fast_exp(sc[j] - max_score);
      sums[0] += sc[j];
    }
    totals[h] = std::accumulate(sums, sums + 16, 0.0f);
  }
  float acc[G][D ? D : 1024] = {};
  for (int64_t b = first / bs; b < num_blocks; ++b) {
    const T* vb = block_of(values, b);
    if (b + 1 < num_blocks) prefetch_bytes(block_of(values, b + 1), head_block * sizeof(T));
    const int64_t lo = std::max<int64_t>(first - b * bs, 0), hi = std::min(bs, num_keys - b * bs);
    for (int64_t j = lo; j < hi; ++j) {
      for (int64_t d = 0; d < dim; ++d) row_f32[d] = to_f32(vb[j * dim + d]);
      for (int h = 0; h < G; ++h) {
        const float p = scores[h * span + b * bs + j];
        for (int64_t d = 0; d < dim; ++d) acc[h][d] += p * row_f32[d];
      }
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    const float inv_total = 1.0f / totals[h];
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = static_cast<T>(acc[h][d] * inv_total);
  }
}

// The attend_heads for this cache geometry and group size: compiled for the common block sizes
// and head dims, and for groups of 1, 2, 3, 4 and 8 heads (5-7 run as 8).
template <typename T, int BS, int D>
auto attend_for_group(int64_t group) {
  using Fn = void (*)(const T*, int64_t, const T*, const T*, const int32_t*, int64_t, int64_t, const AttentionShape&,
                      std::vector<float>&, T*);
  if (group <= 1) return static_cast<Fn>(&attend_heads<T, BS, D, 1>);
  if (group == 2) return static_cast<Fn>(&attend_heads<T, BS, D, 2>);
  if (group == 3) return static_cast<Fn>(&attend_heads<T, BS, D, 3>);
  if (group == 4) return static_cast<Fn>(&attend_heads<T, BS, D, 4>);
  return static_cast<Fn>(&attend_heads<T, BS, D, 8>);
}

template <typename T>
auto attend_for(const AttentionShape& s, int64_t group) {
  if (s.block_size == 16 && s.head_dim == 64) return attend_for_group<T, 16, 64>(group);
  if (s.block_size == 16 && s.head_dim == 128) return attend_for_group<T, 16, 128>(group);
  if (s.block_size == 32 && s.head_dim == 64) return attend_for_group<T, 32, 64>(group);
  if (s.block_size == 32 && s.head_dim == 128) return attend_for_group<T, 32, 128>(group);
  return attend_for_group<T, 0, 0>(group);
}

// The tokens to attend: (token, its row, its position), and how their heads split into items.
struct AttentionItems {
  const std::vector<int64_t>& token;
  const std::vector<int64_t>& row;
  const std::vector<int64_t>& pos;
  int64_t group, chunks, grain;
};

// Every item (one token's query heads of one KV head, at most kMaxGroup of them), across threads.
template <typename T>
void attend_items(const Tensor& q, const Tensor& key_storage, const Tensor& value_storage, const Tensor& block_tables,
                  const AttentionShape& s, const AttentionItems& items, Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* keys = key_storage.data_ptr<T>();
  const T* values = value_storage.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t group = items.group, chunks = items.chunks;
  const auto attend = attend_for<T>(s, std::min(group, kMaxGroup));
  const int64_t num_items = static_cast<int64_t>(items.token.size()) * s.num_kv_heads * chunks;
  at::parallel_for(0, num_items, items.grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / (s.num_kv_heads * chunks), kv_head = item / chunks % s.num_kv_heads;
      const int64_t first_head = kv_head * group + item % chunks * kMaxGroup, t = items.token[i];
      const int64_t num_heads = std::min(kMaxGroup, (kv_head + 1) * group - first_head);
      attend(qp + t * s.q_token_stride + first_head * s.q_head_stride, num_heads, keys, values,
             tables + items.row[i] * s.table_stride, items.pos[i], kv_head, s, scores,
             op + (t * s.num_q_heads + first_head) * s.head_dim);
    }
  });
}

Tensor paged_attention(const Tensor& q, const Tensor& key_storage, const Tensor& value_storage,
                       const Tensor& query_start_loc, const Tensor& seq_lens, const Tensor& block_tables,
                       int64_t max_query_len, double scale, int64_t window) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, heads, head_dim] with unit stride along head_dim");
  TORCH_CHECK(key_storage.is_contiguous() && value_storage.is_contiguous() && key_storage.dim() == 4 &&
                  value_storage.dim() == 4,
              "key_storage must be [blocks, kv_heads, head_dim, block_size] and value_storage "
              "[blocks, kv_heads, block_size, head_dim], both contiguous");
  TORCH_CHECK(key_storage.scalar_type() == q.scalar_type() && value_storage.scalar_type() == q.scalar_type(),
              "the caches must be in q's dtype");
  for (const Tensor* t : {&query_start_loc, &seq_lens, &block_tables}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1, "the metadata tensors must be int32, unit stride");
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= seq_lens.size(0), "block_tables must be [R, blocks]");
  const int64_t num_tokens = q.size(0), num_rows = seq_lens.size(0);
  AttentionShape s{q.size(1), key_storage.size(1), q.size(2), key_storage.size(3), block_tables.stride(0),
                   q.stride(0), q.stride(1), static_cast<float>(scale), window};
  TORCH_CHECK(s.num_q_heads % s.num_kv_heads == 0 && key_storage.size(2) == s.head_dim,
              "q's heads must be a multiple of the caches' and head_dim must match");
  TORCH_CHECK(s.head_dim <= 1024 && s.block_size <= 1024, "head_dim and block_size must be at most 1024");
  Tensor out = at::empty({num_tokens, s.num_q_heads, s.head_dim}, q.options());
  // (token, its row, its position) for the tokens of rows no longer than max_query_len.
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<int64_t> token, row, pos;
  int64_t context = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r];
    if (q_len == 0 || q_len > max_query_len) continue;
    for (int64_t i = 0; i < q_len; ++i) {
      token.push_back(qsl[r] + i);
      row.push_back(r);
      pos.push_back(lens[r] - q_len + i);
      context += lens[r];
    }
  }
  // An item: one token's query heads of one KV head, at most kMaxGroup of them.
  const int64_t group = s.num_q_heads / s.num_kv_heads, chunks = (group + kMaxGroup - 1) / kMaxGroup;
  const int64_t num_items = static_cast<int64_t>(token.size()) * s.num_kv_heads * chunks;
  // Below ~64k multiply-adds a second thread costs more to wake than it saves.
  const int64_t work = context * s.num_q_heads * s.head_dim * 2;
  const int64_t grain = work < (1 << 16) ? std::max<int64_t>(num_items, 1) : 1;
  // float, bfloat16 and half (not double): each dtype compiles 25 variants of the attention loop.
  const AttentionItems items{token, row, pos, group, chunks, grain};
  switch (q.scalar_type()) {
    case at::kFloat: attend_items<float>(q, key_storage, value_storage, block_tables, s, items, out); break;
    case at::kBFloat16: attend_items<c10::BFloat16>(q, key_storage, value_storage, block_tables, s, items, out); break;
    case at::kHalf: attend_items<c10::Half>(q, key_storage, value_storage, block_tables, s, items, out); break;
    default: TORCH_CHECK(false, "paged_attention supports float32, bfloat16 and float16, not ", q.scalar_type());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// weight-only int8 product for a few rows (a decode step of one or a few requests)

// The dot products of float32 x [in] with four int8 weight rows. With AVX-512 the weights are
// widened 16 at a time by instruction (the compiler's own vectorization of this loop is several
// times slower); elsewhere a plain loop.
constexpr int64_t kPrefetchQuads = 1;

inline void dot4_int8(const float* x, const int8_t* w0, const int8_t* w1, const int8_t* w2, const int8_t* w3,
                      int64_t in, float* sums) {
  int64_t k = 0;
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(__AVX512F__)
  const int8_t* rows[4] = {w0, w1, w2, w3};
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const int64_t ahead = kPrefetchQuads * 4 * in;
  for (; k + 16 <= in; k += 16) {
    const __m512 xv = _mm512_loadu_ps(x + k);
    for (int r = 0; r < 4; ++r) {
      if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k + ahead), _MM_HINT_T0);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + k));
      acc[r] = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(packed)), acc[r]);
    }
  }
  for (int r = 0; r < 4; ++r) a[r] = _mm512_reduce_add_ps(acc[r]);
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
// bfloat16 activations times a weight in pairs-of-inputs blocks (bfloat16, or int8 with scales)

// The weight is laid out once, at load time, as [out / 16][in / 2][16][2] (`pack_blocks` in
// zerobubble/kernels/linear.py; the block count padded with zeros to a multiple of 3): for 16 outputs, each pair of inputs' 32 values is one vector, so
// one AVX-512 BF16 instruction multiplies it exactly by an input row's pair (broadcast) and adds
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
  // Tiles of up to 8 rows, as even as the row count allows (12 rows: 6 + 6, not 8 + 4).
  const int64_t num_tiles = (rows + kBlockMaxTileRows - 1) / kBlockMaxTileRows;
  at::parallel_for(0, num_blocks / kBlockGroupBlocks, 4, [&](int64_t begin, int64_t end) {
    const c10::BFloat16* xr[kBlockMaxTileRows];
    for (int64_t group = begin; group < end; ++group) {
      const int64_t block = group * kBlockGroupBlocks, first_out = block * kBlockLanes;
      for (int64_t tile = 0, m = 0; tile < num_tiles; ++tile) {
        const int64_t tile_rows = (rows - m) / (num_tiles - tile);
        for (int64_t r = 0; r < tile_rows; ++r) xr[r] = xp + (m + r) * x.stride(0);
        const BlockTile<W> t{xr, wp + block * block_stride, block_stride, pairs,
                             tile == 0 && group + 1 < end ? kBlockGroupBlocks * block_stride : 0,
                             scale == nullptr ? nullptr : scale + first_out,
                             bias == nullptr ? nullptr : bias + first_out, op + m * out_features + first_out,
                             out_features, std::min(kBlockGroupBlocks * kBlockLanes, out_features - first_out)};
        if (t.count > 0) block_tile_rows<W>(static_cast<int>(tile_rows), t);
        m += tile_rows;
      }
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

TORCH_LIBRARY(zerobubble_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "qk_norm_rope(Tensor qkv, Tensor cos, Tensor sin, Tensor? norm_weight, int num_heads, int head_dim, "
      "float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor q, Tensor key_storage, Tensor value_storage, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_tables, int max_query_len, float scale, int window) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("block_linear(Tensor x, Tensor blocks, int out_features, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("block_linear_is_native() -> bool");
}

TORCH_LIBRARY_IMPL(zerobubble_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("paged_attention", &paged_attention);
  m.impl("int8_linear", &int8_linear);
  m.impl("block_linear", &block_linear);
}

TORCH_LIBRARY_IMPL(zerobubble_cpu, CompositeExplicitAutograd, m) {
  m.impl("block_linear_is_native", &block_linear_is_native);
}
