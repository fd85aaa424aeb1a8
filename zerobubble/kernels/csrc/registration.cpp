// The operators of the compiled CPU kernels (zerobubble/kernels/cpu.py loads them); each
// source of this folder registers its CPU implementations.

#include <torch/library.h>

TORCH_LIBRARY(zerobubble_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "qk_norm_rope(Tensor qkv, Tensor cos, Tensor sin, Tensor? norm_weight, int num_heads, int head_dim, "
      "float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor q, Tensor key_storage, Tensor value_storage, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_tables, int max_query_len, float scale, int window, Tensor? sinks) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("block_linear(Tensor x, Tensor blocks, int out_features, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("block_linear_is_native() -> bool");
  m.def(
      "ngram_propose(Tensor req_slots, Tensor seq_len, Tensor last_token, Tensor block_table, Tensor history, "
      "int block_size, int min_n, int max_n, int k) -> (Tensor, Tensor)");
  m.def(
      "moe_experts(Tensor rows, Tensor offsets, Tensor gate_up, int gate_up_outputs, Tensor? gate_up_scale, "
      "Tensor? gate_up_bias, Tensor down, int down_outputs, Tensor? down_scale, Tensor? down_bias, int activation, "
      "float alpha, float limit, Tensor? tokens, Tensor? weights, int num_tokens) -> Tensor");
  m.def(
      "shm_all_reduce(Tensor(a!) x, Tensor slots, Tensor counters, int rank, int seq, float timeout_s) -> bool");
  m.def(
      "shm_all_gather(Tensor x, Tensor slots, Tensor counters, Tensor(a!) out, int rank, int seq, "
      "float timeout_s) -> bool");
}
