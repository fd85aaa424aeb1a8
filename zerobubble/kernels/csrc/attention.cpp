// Paged attention for decode and verification rows and short prompts (rows of up to the caller's
// max_query_len queries; zerobubble/kernels/attention.py sends longer prefill chunks to SDPA).

#include "common.h"

#include <type_traits>

namespace zerobubble {
namespace {
// ---------------------------------------------------------------------------------------------
// paged attention, one query token at a time

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
// scores over the visible context, their softmax in float32, the weighted sums of values. With
// `sinks` (the heads' own, or null) each head's sink logit joins the softmax's denominator
// (gpt-oss): one more key, with no value. Each key and value row is read and widened once for
// all of them, and the G heads' sums are independent chains held in registers (G is fixed at
// compile time; heads past `num_heads` have zero queries and are not stored). Keys are stored
// [blocks, kv_heads, head_dim, block_size] and values [blocks, kv_heads, block_size, head_dim]
// (zerobubble.kernels.attention.new_kv_cache). BS and D, when not 0, fix the block size and head
// dim at compile time, so that the inner loops are whole vector operations.
template <typename T, int BS, int D, int G>
void attend_heads(const T* q, int64_t num_heads, const T* keys, const T* values, const int32_t* table,
                  int64_t query_pos, int64_t kv_head, const float* sinks, const AttentionShape& s,
                  std::vector<float>& scores, T* out) {
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
  for (int64_t h = 0; h < num_heads; ++h) {  // heads past num_heads are never stored
    float* sc = scores.data() + h * span;
    // Sixteen partial maxima and sums, so that both loops are vector operations.
    float maxima[16], sums[16] = {};
    std::fill(maxima, maxima + 16, -INFINITY);
    int64_t j = first;
    for (; j + 16 <= num_keys; j += 16) {
      for (int l = 0; l < 16; ++l) maxima[l] = std::max(maxima[l], sc[j + l]);
    }
    for (; j < num_keys; ++j) maxima[0] = std::max(maxima[0], sc[j]);
    float max_score = *std::max_element(maxima, maxima + 16);
    if (sinks != nullptr) max_score = std::max(max_score, sinks[h]);
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
    const float sink_share = sinks != nullptr ? std::exp(sinks[h] - max_score) : 0.0f;
    totals[h] = std::accumulate(sums, sums + 16, 0.0f) + sink_share;
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
  using Fn = void (*)(const T*, int64_t, const T*, const T*, const int32_t*, int64_t, int64_t, const float*,
                      const AttentionShape&, std::vector<float>&, T*);
  if (group <= 1) return static_cast<Fn>(&attend_heads<T, BS, D, 1>);
  if (group == 2) return static_cast<Fn>(&attend_heads<T, BS, D, 2>);
  if (group == 3) return static_cast<Fn>(&attend_heads<T, BS, D, 3>);
  if (group == 4) return static_cast<Fn>(&attend_heads<T, BS, D, 4>);
  return static_cast<Fn>(&attend_heads<T, BS, D, 8>);
}

template <typename T>
auto attend_for(const AttentionShape& s, int64_t group) {
  // float32 models run the torch ops (the Hugging Face-exact path): the kernel's float32 form,
  // for tests and direct calls, is compiled for any geometry only.
  if constexpr (!std::is_same_v<T, float>) {
    if (s.block_size == 16 && s.head_dim == 64) return attend_for_group<T, 16, 64>(group);
    if (s.block_size == 16 && s.head_dim == 128) return attend_for_group<T, 16, 128>(group);
    if (s.block_size == 32 && s.head_dim == 64) return attend_for_group<T, 32, 64>(group);
    if (s.block_size == 32 && s.head_dim == 128) return attend_for_group<T, 32, 128>(group);
  }
  return attend_for_group<T, 0, 0>(group);
}

// The tokens to attend: (token, its row, its position), and how their heads split into items.
struct AttentionItems {
  const std::vector<int64_t>& token;
  const std::vector<int64_t>& row;
  const std::vector<int64_t>& pos;
  int64_t group, chunks, num_items, grain;
};

// Every item (one token's query heads of one KV head, at most kMaxGroup of them), across threads.
template <typename T>
void attend_items(const Tensor& q, const Tensor& key_storage, const Tensor& value_storage, const Tensor& block_tables,
                  const float* sinks, const AttentionShape& s, const AttentionItems& items, Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* keys = key_storage.data_ptr<T>();
  const T* values = value_storage.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t group = items.group, chunks = items.chunks;
  const auto attend = attend_for<T>(s, std::min(group, kMaxGroup));
  at::parallel_for(0, items.num_items, items.grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / (s.num_kv_heads * chunks), kv_head = item / chunks % s.num_kv_heads;
      const int64_t first_head = kv_head * group + item % chunks * kMaxGroup, t = items.token[i];
      const int64_t num_heads = std::min(kMaxGroup, (kv_head + 1) * group - first_head);
      attend(qp + t * s.q_token_stride + first_head * s.q_head_stride, num_heads, keys, values,
             tables + items.row[i] * s.table_stride, items.pos[i], kv_head,
             sinks != nullptr ? sinks + first_head : nullptr, s, scores,
             op + (t * s.num_q_heads + first_head) * s.head_dim);
    }
  });
}

Tensor paged_attention(const Tensor& q, const Tensor& key_storage, const Tensor& value_storage,
                       const Tensor& query_start_loc, const Tensor& seq_lens, const Tensor& block_tables,
                       int64_t max_query_len, double scale, int64_t window, const std::optional<Tensor>& sinks) {
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
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->numel() == s.num_q_heads),
              "sinks must be float32 [num_q_heads], contiguous");
  const float* sink_ptr = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
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
  // float, bfloat16 and half (not double): each variant of the attention loop costs build time.
  const AttentionItems items{token, row, pos, group, chunks, num_items, grain};
  const Tensor &keys = key_storage, &values = value_storage, &tables = block_tables;
  switch (q.scalar_type()) {
    case at::kFloat: attend_items<float>(q, keys, values, tables, sink_ptr, s, items, out); break;
    case at::kBFloat16: attend_items<c10::BFloat16>(q, keys, values, tables, sink_ptr, s, items, out); break;
    case at::kHalf: attend_items<c10::Half>(q, keys, values, tables, sink_ptr, s, items, out); break;
    default: TORCH_CHECK(false, "paged_attention supports float32, bfloat16 and float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace
}  // namespace zerobubble

TORCH_LIBRARY_IMPL(zerobubble_cpu, CPU, m) {
  m.impl("paged_attention", &zerobubble::paged_attention);
}
