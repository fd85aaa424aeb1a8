// The routed experts of a mixture-of-experts layer in one call: every expert's gated MLP over its
// rows (zerobubble/kernels/moe.py, `expert_mlps`), each projection by the block product (blocks.h).
//
// A decode step of a MoE model runs 8 or more small experts a layer; as one linear product per
// projection each forks its own thread team and pays a dispatch, several thousand a step. Here one
// team shares the whole layer: the work items are (output group, expert) pairs, group-major so
// that an even split of the items gives each thread the same outputs of every expert whatever the
// experts' loads; an expert without rows has no items, so a decode row reads only its experts'
// weights. Three passes: gate/up, the activation, down.

#include "blocks.h"

namespace zerobubble {
namespace {

// The activations of `moe_experts` (`activation`): zerobubble/kernels/fused.py's twins.
constexpr int64_t kSwiGlu = 0;
constexpr int64_t kClampedSwiGlu = 1;

// A projection of every expert: [E, blocks, in / 2, 16, 2] blocks (bfloat16, or int8 codes with a
// scale per output), the outputs each, optional scales and biases [E, outputs].
struct Projection {
  const Tensor& blocks;
  int64_t outputs;
  const std::optional<Tensor>& scale;
  const std::optional<Tensor>& bias;
};

void check_projection(const Projection& p, int64_t experts, int64_t inputs, const char* name) {
  const Tensor& b = p.blocks;
  TORCH_CHECK((b.scalar_type() == at::kBFloat16 || b.scalar_type() == at::kChar) && b.is_contiguous() &&
                  b.dim() == 5 && b.size(0) == experts && b.size(1) % kBlockGroupBlocks == 0 &&
                  b.size(1) * kBlockLanes >= p.outputs && (b.size(1) - kBlockGroupBlocks) * kBlockLanes < p.outputs &&
                  b.size(2) * 2 == inputs && b.size(3) == kBlockLanes && b.size(4) == 2,
              name, " must be contiguous bfloat16 or int8 [experts, out / 16 (padded to a multiple of 3), in / 2, 16, 2] "
              "blocks");
  TORCH_CHECK((b.scalar_type() == at::kChar) == p.scale.has_value(), name,
              ": a scale must be given for int8 blocks, and only for them");
  for (const auto* t : {&p.scale, &p.bias}) {
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kBFloat16 && (*t)->is_contiguous() &&
                                    (*t)->dim() == 2 && (*t)->size(0) == experts && (*t)->size(1) == p.outputs),
                name, ": scales and biases must be bfloat16 [experts, outputs]");
  }
}

// out[rows of expert e] = x[rows of expert e] w_e^T (* scale_e), rounded once, then + bias_e rounded
// again (the twin's separate `x @ W + b`), for every expert with rows.
template <typename W>
void experts_product(const Tensor& x, const std::vector<int64_t>& bounds, const std::vector<int64_t>& active,
                     const Projection& p, Tensor& out) {
  const int64_t pairs = p.blocks.size(2), num_blocks = p.blocks.size(1), outputs = p.outputs;
  const int64_t block_stride = pairs * 2 * kBlockLanes, expert_stride = num_blocks * block_stride;
  const int64_t num_active = static_cast<int64_t>(active.size()), groups = num_blocks / kBlockGroupBlocks;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const W* wp = p.blocks.data_ptr<W>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const c10::BFloat16* scale = p.scale.has_value() ? p.scale->data_ptr<c10::BFloat16>() : nullptr;
  const c10::BFloat16* bias = p.bias.has_value() ? p.bias->data_ptr<c10::BFloat16>() : nullptr;
  const auto weights_of = [&](int64_t item) {
    const int64_t group = item / num_active, expert = active[item % num_active];
    return wp + expert * expert_stride + group * kBlockGroupBlocks * block_stride;
  };
  at::parallel_for(0, groups * num_active, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t group = item / num_active, expert = active[item % num_active];
      const int64_t first_out = group * kBlockGroupBlocks * kBlockLanes, start = bounds[expert];
      const int64_t rows = bounds[expert + 1] - start;
      const int64_t count = std::min(kBlockGroupBlocks * kBlockLanes, outputs - first_out);
      const W* w = weights_of(item);
      // The next item's weights (another expert's, or the next group) stream in meanwhile.
      const int64_t ahead = item + 1 < end ? weights_of(item + 1) - w : 0;
      const c10::BFloat16* s = scale == nullptr ? nullptr : scale + expert * outputs + first_out;
      c10::BFloat16* o = op + start * outputs + first_out;
      block_group_rows<W>(xp + start * x.stride(0), x.stride(0), rows, w, block_stride, pairs, ahead, s, nullptr, o,
                          outputs, count);
      if (bias == nullptr) continue;
      const c10::BFloat16* b = bias + expert * outputs + first_out;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < count; ++j) {
          o[r * outputs + j] = static_cast<c10::BFloat16>(to_f32(o[r * outputs + j]) + to_f32(b[j]));
        }
      }
    }
  });
}

// act(gate) * up of gate_up [N, 2 I] (gate first), rounded where the twins round: SiLU as the
// compiled silu_mul (fused.cpp); gpt-oss's clamped SwiGLU op for op as `clamped_swiglu_mul_twin`.
void activation_mul(const Tensor& gate_up, int64_t activation, double alpha, double limit, Tensor& out) {
  using T = c10::BFloat16;
  const int64_t num_rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  const T* src = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float a = static_cast<float>(alpha), hi = round_to<T>(static_cast<float>(limit));
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = src + t * 2 * inter;
      const T* up = gate + inter;
      T* o = op + t * inter;
      if (activation == kSwiGlu) {
        for (int64_t i = 0; i < inter; ++i) {
          const float g = to_f32(gate[i]);
          o[i] = static_cast<T>(round_to<T>(g / (1.0f + fast_exp(-g))) * to_f32(up[i]));
        }
        continue;
      }
      for (int64_t i = 0; i < inter; ++i) {
        const float g = std::min(to_f32(gate[i]), hi), u = std::min(std::max(to_f32(up[i]), -hi), hi);
        const float sig = round_to<T>(1.0f / (1.0f + std::exp(-round_to<T>(g * a))));
        o[i] = static_cast<T>(round_to<T>(u + 1.0f) * round_to<T>(g * sig));
      }
    }
  });
}

// summed[tokens[j]] += float(out[j]) * weights[j] for the rows j in [begin, end), in row order (as
// the twin's index_add_ adds them: the same float32 sums, bit for bit); threads take columns. The
// product and the sum are rounded apart, as the twin's two ops round them: no fused multiply-add.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
void weighted_sum(const Tensor& out, const Tensor& tokens, const Tensor& weights, int64_t begin, int64_t end,
                  Tensor& summed) {
  const int64_t width = out.size(1), num_tokens = summed.size(0);
  const auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  float* sp = summed.data_ptr<float>();
  for (int64_t j = begin; j < end; ++j) {
    TORCH_CHECK(tp[j] >= 0 && tp[j] < num_tokens, "token ", tp[j], " out of range");
  }
  constexpr int64_t kColumns = 64;
  at::parallel_for(0, (width + kColumns - 1) / kColumns, 1, [&](int64_t first, int64_t last) {
    const int64_t lo = first * kColumns, hi = std::min(width, last * kColumns);
    for (int64_t j = begin; j < end; ++j) {
      const float w = wp[j];
      const c10::BFloat16* o = op + j * width;
      float* s = sp + tp[j] * width;
      for (int64_t c = lo; c < hi; ++c) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
        s[c] += to_f32(o[c]) * w;
      }
    }
  });
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

void run_experts_product(const Tensor& x, const std::vector<int64_t>& bounds, const std::vector<int64_t>& active,
                         const Projection& p, Tensor& out) {
  if (p.blocks.scalar_type() == at::kChar) {
    experts_product<int8_t>(x, bounds, active, p, out);
  } else {
    experts_product<c10::BFloat16>(x, bounds, active, p, out);
  }
}

// The down outputs [N, H] of every expert's gated MLP over its rows offsets[e]:offsets[e + 1] of
// rows [N, H] (bfloat16, sorted by expert): gate/up, the activation, down, each rounded to
// bfloat16 as the per-expert path rounds them; rows outside the offsets are not written. With
// tokens and weights [N] (`Routing`): the weighted sum per token instead, float32 [num_tokens, H],
// of the rows within the offsets (under expert parallelism the others are other ranks').
Tensor moe_experts(const Tensor& rows, const Tensor& offsets, const Tensor& gate_up, int64_t gate_up_outputs,
                   const std::optional<Tensor>& gate_up_scale, const std::optional<Tensor>& gate_up_bias,
                   const Tensor& down, int64_t down_outputs, const std::optional<Tensor>& down_scale,
                   const std::optional<Tensor>& down_bias, int64_t activation, double alpha, double limit,
                   const std::optional<Tensor>& tokens, const std::optional<Tensor>& weights, int64_t num_tokens) {
  check_cpu(rows, "rows");
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16 && rows.dim() == 2 && rows.stride(1) == 1 && rows.size(1) % 2 == 0,
              "rows must be bfloat16 [rows, hidden] with an even hidden size and unit stride along it");
  const int64_t experts = gate_up.size(0);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.numel() == experts + 1,
              "offsets must be int64 [experts + 1]");
  TORCH_CHECK(gate_up_outputs % 2 == 0, "gate_up_outputs must be even (gate rows, then up rows)");
  TORCH_CHECK(activation == kSwiGlu || activation == kClampedSwiGlu, "unknown activation ", activation);
  const Projection first{gate_up, gate_up_outputs, gate_up_scale, gate_up_bias};
  const Projection second{down, down_outputs, down_scale, down_bias};
  check_projection(first, experts, rows.size(1), "gate_up");
  check_projection(second, experts, gate_up_outputs / 2, "down");
  const Tensor host_offsets = offsets.cpu().contiguous();
  const int64_t* off = host_offsets.data_ptr<int64_t>();
  std::vector<int64_t> bounds(off, off + experts + 1), active;
  // Under expert parallelism the offsets are a rank's slice of the router's: rows outside it are
  // other ranks' experts', left unwritten.
  TORCH_CHECK(bounds[0] >= 0 && bounds[experts] <= rows.size(0), "offsets must lie within the rows");
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(bounds[e + 1] >= bounds[e], "offsets must not decrease");
    if (bounds[e + 1] > bounds[e]) active.push_back(e);
  }
  const Tensor x = rows.stride(0) == rows.size(1) ? rows : rows.contiguous();
  Tensor hidden = at::empty({rows.size(0), gate_up_outputs}, rows.options());
  Tensor act = at::empty({rows.size(0), gate_up_outputs / 2}, rows.options());
  Tensor out = at::empty({rows.size(0), down_outputs}, rows.options());
  const bool sum = tokens.has_value();
  TORCH_CHECK(sum == weights.has_value(), "tokens and weights come together");
  if (sum) {
    TORCH_CHECK(tokens->scalar_type() == at::kLong && tokens->dim() == 1 && tokens->numel() == rows.size(0) &&
                    weights->scalar_type() == at::kFloat && weights->dim() == 1 && weights->numel() == rows.size(0),
                "tokens must be int64 [rows] and weights float32 [rows]");
  }
  if (!active.empty()) {
    run_experts_product(x, bounds, active, first, hidden);
    activation_mul(hidden, activation, alpha, limit, act);
    run_experts_product(act, bounds, active, second, out);
  }
  if (!sum) return out;
  Tensor summed = at::zeros({num_tokens, down_outputs}, rows.options().dtype(at::kFloat));
  weighted_sum(out, tokens->contiguous(), weights->contiguous(), bounds[0], bounds[experts], summed);
  return summed;
}

}  // namespace
}  // namespace zerobubble

TORCH_LIBRARY_IMPL(zerobubble_cpu, CPU, m) { m.impl("moe_experts", &zerobubble::moe_experts); }
