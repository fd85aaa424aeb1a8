// Prompt lookup (n-gram drafts) over the paged token history: the twin is _ngram_torch in
// zerobubble/kernels/ngram.py. The torch form is some forty whole-batch ops over every held
// token (0.3 ms for one row of 400 tokens, 3 ms for 64 rows on two cores); here each row is one
// scan of its own tokens, comparing the last few only where the last token recurs.

#include "common.h"

namespace zerobubble {
namespace {

// Row r's drafts: its sequence x (history through its block table, then the last sampled
// token) of length L; the end e <= L - 2 whose common suffix with x is longest (capped at
// max_n), the latest among equals; its continuation when that length reaches min_n.
void ngram_row(int64_t slot, const int32_t* seq_len, const int32_t* last_token, const int32_t* tables,
               int64_t table_stride, const int32_t* history, int64_t block_size, int64_t min_n, int64_t max_n,
               int64_t k, std::vector<int32_t>& x, int32_t* drafts, int32_t* num_drafts) {
  const int64_t held = seq_len[slot], length = held + 1;
  const int32_t* table = tables + slot * table_stride;
  x.resize(static_cast<size_t>(length));
  for (int64_t p = 0; p < held; ++p) {
    x[p] = history[static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size];
  }
  x[held] = last_token[slot];
  int64_t best_n = 0, best_end = length - 1;
  const int32_t last = x[held];
  for (int64_t e = 0; e + 2 <= length; ++e) {
    if (x[e] != last) continue;
    int64_t n = 1;
    while (n < max_n && e - n >= 0 && x[e - n] == x[held - n]) ++n;
    if (n >= best_n) {
      best_n = n;
      best_end = e;
    }
  }
  const int64_t first = best_end + 1;
  const int64_t num = best_n >= min_n ? std::min(length - first, k) : 0;
  for (int64_t c = 0; c < k; ++c) drafts[c] = c < num ? x[first + c] : -1;
  *num_drafts = static_cast<int32_t>(num);
}

std::tuple<Tensor, Tensor> ngram_propose(const Tensor& req_slots, const Tensor& seq_len, const Tensor& last_token,
                                         const Tensor& block_table, const Tensor& history, int64_t block_size,
                                         int64_t min_n, int64_t max_n, int64_t k) {
  for (const Tensor* t : {&req_slots, &seq_len, &last_token, &block_table, &history}) {
    check_cpu(*t, "ngram_propose's tensors");
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "ngram_propose's tensors must be contiguous int32");
  }
  TORCH_CHECK(block_table.dim() == 2 && block_size >= 1 && 1 <= min_n && min_n <= max_n && k >= 1,
              "ngram_propose: block_table [slots, blocks], block_size >= 1, 1 <= min_n <= max_n, k >= 1");
  const int64_t num_rows = req_slots.numel();
  Tensor drafts = at::empty({num_rows, k}, seq_len.options());
  Tensor num_drafts = at::empty({num_rows}, seq_len.options());
  const int32_t* slots = req_slots.data_ptr<int32_t>();
  const int32_t* lens = seq_len.data_ptr<int32_t>();
  int64_t tokens = 0;
  for (int64_t r = 0; r < num_rows; ++r) tokens += lens[slots[r]] + 1;
  // A few thousand tokens scan in microseconds: a second thread is worth it only past that.
  const int64_t grain = tokens < (1 << 15) ? std::max<int64_t>(num_rows, 1) : 1;
  at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> x;
    for (int64_t r = begin; r < end; ++r) {
      ngram_row(slots[r], lens, last_token.data_ptr<int32_t>(), block_table.data_ptr<int32_t>(),
                block_table.stride(0), history.data_ptr<int32_t>(), block_size, min_n, max_n, k, x,
                drafts.data_ptr<int32_t>() + r * k, num_drafts.data_ptr<int32_t>() + r);
    }
  });
  return {drafts, num_drafts};
}

}  // namespace
}  // namespace zerobubble

TORCH_LIBRARY_IMPL(zerobubble_cpu, CPU, m) {
  m.impl("ngram_propose", &zerobubble::ngram_propose);
}
