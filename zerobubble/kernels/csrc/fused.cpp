// The decode path's elementwise steps, one pass each: the residual add + RMSNorm, q/k norm +
// RoPE, SiLU·up and the paged KV write. Run one aten op at a time, these steps cost some thirty
// dispatches a layer (a few microseconds each, whatever the size), which at a decode batch's few
// rows is as long as the layer's matmuls.

#include "common.h"

namespace zerobubble {
namespace {
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
    // Pointers and strides read once: a prefill writes thousands of tokens, each a few hundred values.
    const bool long_slots = slot_mapping.scalar_type() == at::kLong;
    const void* slots = slot_mapping.data_ptr();
    const int64_t slot_stride = slot_mapping.stride(0);
    const std::pair<const Tensor*, Tensor*> pairs[2] = {{&k, &k_cache}, {&v, &v_cache}};
    const scalar_t* src[2];
    scalar_t* dst[2];
    int64_t src_stride[2][3], dst_stride[2][4];
    for (int i = 0; i < 2; ++i) {
      src[i] = pairs[i].first->data_ptr<scalar_t>();
      dst[i] = pairs[i].second->data_ptr<scalar_t>();
      for (int j = 0; j < 3; ++j) src_stride[i][j] = pairs[i].first->stride(j);
      for (int j = 0; j < 4; ++j) dst_stride[i][j] = pairs[i].second->stride(j);
    }
    at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t slot = long_slots ? static_cast<const int64_t*>(slots)[t * slot_stride]
                                        : static_cast<const int32_t*>(slots)[t * slot_stride];
        const int64_t block = slot / block_size, offset = slot % block_size;
        for (int i = 0; i < 2; ++i) {
          const scalar_t* in = src[i] + t * src_stride[i][0];
          scalar_t* out = dst[i] + block * dst_stride[i][0] + offset * dst_stride[i][1];
          for (int64_t h = 0; h < heads; ++h) {
            for (int64_t d = 0; d < dim; ++d) {
              out[h * dst_stride[i][2] + d * dst_stride[i][3]] = in[h * src_stride[i][1] + d * src_stride[i][2]];
            }
          }
        }
      }
    });
  });
}

}  // namespace
}  // namespace zerobubble

TORCH_LIBRARY_IMPL(zerobubble_cpu, CPU, m) {
  m.impl("add_rms_norm", &zerobubble::add_rms_norm);
  m.impl("qk_norm_rope", &zerobubble::qk_norm_rope);
  m.impl("silu_mul", &zerobubble::silu_mul);
  m.impl("write_kv_cache", &zerobubble::write_kv_cache);
}
