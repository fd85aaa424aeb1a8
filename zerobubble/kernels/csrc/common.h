// Shared by the CPU kernels of the decode path (fused.cpp, attention.cpp, linear.cpp): the
// conversions, rounding, exp and prefetch their loops are made of.
//
// Each kernel reproduces its torch twin in zerobubble/kernels (fused.py, attention.py, linear.py):
// values are computed in float32 and rounded to the tensor dtype exactly where the twin rounds, so
// 16-bit results agree with the twin to within one rounding step (reductions sum in another
// order). Registered as torch operators in the `zerobubble_cpu` namespace (registration.cpp,
// zerobubble/kernels/cpu.py); each source compiles apart, so a build runs them in parallel.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
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

namespace zerobubble {

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

inline void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

}  // namespace zerobubble
