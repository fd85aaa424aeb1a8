// The exchange of the shared-memory collectives (zerobubble/worker_svc/shm_collectives.py): copy
// this rank's part into its slot, publish the sequence number, wait for every rank's, then sum
// the slots in rank order (all-reduce) or copy them out side by side (all-gather). From Python
// those steps cost some fifty microseconds of slicing, copies and dispatch per exchange, two
// exchanges a layer; here they are a memcpy, an atomic store and a spin.
//
// The segment: `slots` [2, world, slot_bytes] (uint8; two sets that alternate with the sequence
// number's parity), `counters` [world] (int64, one per rank, each on a cache line of its own: a
// strided view). The torch twin is SharedMemoryCollectives' Python path, the same protocol on the
// same segment, which the tests run against this one.

#include "common.h"

#include <sched.h>

#include <atomic>
#include <chrono>

namespace zerobubble {
namespace {

// Spins between yields while waiting: ranks on cores of their own answer within a few spins;
// more ranks than cores need the yield to let the awaited rank run at all (the Python path's
// _SPINS_PER_YIELD).
constexpr int kSpinsPerYield = 32;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

struct Segment {
  uint8_t* set;  // this exchange's slot set: world slots of slot_bytes
  int64_t slot_bytes;
  int64_t* counters;
  int64_t counter_stride;  // in int64s
  int64_t world;
};

Segment segment(const Tensor& slots, const Tensor& counters, int64_t rank, int64_t seq, int64_t nbytes) {
  TORCH_CHECK(slots.scalar_type() == at::kByte && slots.dim() == 3 && slots.size(0) == 2 && slots.is_contiguous(),
              "slots must be the segment's [2, world, slot_bytes] uint8 view");
  TORCH_CHECK(counters.scalar_type() == at::kLong && counters.dim() == 1 && counters.size(0) == slots.size(1),
              "counters must be the segment's [world] int64 view");
  TORCH_CHECK(rank >= 0 && rank < slots.size(1), "rank out of range");
  TORCH_CHECK(nbytes <= slots.size(2), "the part (", nbytes, " bytes) is larger than a slot (", slots.size(2), ")");
  const int64_t world = slots.size(1), slot_bytes = slots.size(2);
  return {slots.data_ptr<uint8_t>() + (seq & 1) * world * slot_bytes, slot_bytes, counters.data_ptr<int64_t>(),
          counters.stride(0), world};
}

// Copies `nbytes` of `src` into this rank's slot and publishes `seq` (the release store orders
// the copy before it: a rank that reads `seq` there sees the slot), then spins until every rank
// has published `seq` (the acquire loads order every slot's reads after them; and this rank's
// next writes into the other set after every rank's reads of it, which came before their
// publishing `seq`). False after `timeout_s` without every rank, counted from the first yield.
bool publish_and_wait(const Segment& s, const void* src, int64_t nbytes, int64_t rank, int64_t seq,
                      double timeout_s) {
  std::memcpy(s.set + rank * s.slot_bytes, src, nbytes);
  __atomic_store_n(s.counters + rank * s.counter_stride, seq, __ATOMIC_RELEASE);
  using Clock = std::chrono::steady_clock;
  Clock::time_point deadline{};
  int64_t spins = 0;
  for (int64_t r = 0; r < s.world; ++r) {
    const int64_t* counter = s.counters + r * s.counter_stride;
    while (__atomic_load_n(counter, __ATOMIC_ACQUIRE) < seq) {
      cpu_relax();
      if (++spins % kSpinsPerYield != 0) continue;
      sched_yield();
      const Clock::time_point now = Clock::now();
      if (deadline == Clock::time_point{}) {
        deadline = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
      } else if (now > deadline) {
        return false;
      }
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  return true;
}

// out = slot 0 + slot 1, rounded to T, + slot 2, rounded, ...: the additions and roundings of
// torch's `slots[0] + slots[1]` then `+= slots[r]` (16-bit adds go through float32 and round to
// nearest even), so every rank, and the Python path, ends with the same bits.
template <typename T>
void sum_slots(const Segment& s, T* out, int64_t n) {
  const T* first = reinterpret_cast<const T*>(s.set);
  if (s.world == 1) {
    std::memcpy(out, first, n * sizeof(T));
    return;
  }
  const T* second = reinterpret_cast<const T*>(s.set + s.slot_bytes);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(to_f32(first[i]) + to_f32(second[i]));
  for (int64_t r = 2; r < s.world; ++r) {
    const T* slot = reinterpret_cast<const T*>(s.set + r * s.slot_bytes);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(to_f32(out[i]) + to_f32(slot[i]));
  }
}

bool shm_all_reduce(Tensor x, const Tensor& slots, const Tensor& counters, int64_t rank, int64_t seq,
                    double timeout_s) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  const at::ScalarType dtype = x.scalar_type();
  // Checked before publishing: a rank that fails after it would leave the others a wrong sum.
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "shm_all_reduce sums float32, bfloat16 and float16, not ", dtype);
  const int64_t nbytes = x.numel() * x.element_size();
  const Segment s = segment(slots, counters, rank, seq, nbytes);
  if (!publish_and_wait(s, x.data_ptr(), nbytes, rank, seq, timeout_s)) return false;
  if (dtype == at::kFloat) {
    sum_slots(s, x.data_ptr<float>(), x.numel());
  } else if (dtype == at::kBFloat16) {
    sum_slots(s, x.data_ptr<c10::BFloat16>(), x.numel());
  } else {
    sum_slots(s, x.data_ptr<c10::Half>(), x.numel());
  }
  return true;
}

// out[r] = rank r's x, for every rank: `out` is [world, ...] with each out[r] contiguous (a column
// of pieces of a larger stack may stride between ranks).
bool shm_all_gather(const Tensor& x, const Tensor& slots, const Tensor& counters, Tensor out, int64_t rank,
                    int64_t seq, double timeout_s) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.dim() >= 1 && out.size(0) == slots.size(1) &&
                  out.numel() == x.numel() * out.size(0),
              "out must be [world, *x.shape] in x's dtype");
  int64_t expected_stride = 1;
  for (int64_t d = out.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(out.size(d) == 1 || out.stride(d) == expected_stride, "each out[r] must be contiguous");
    expected_stride *= out.size(d);
  }
  const int64_t nbytes = x.numel() * x.element_size();
  const Segment s = segment(slots, counters, rank, seq, nbytes);
  if (!publish_and_wait(s, x.data_ptr(), nbytes, rank, seq, timeout_s)) return false;
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t rank_stride = out.stride(0) * out.element_size();
  for (int64_t r = 0; r < s.world; ++r) std::memcpy(dst + r * rank_stride, s.set + r * s.slot_bytes, nbytes);
  return true;
}

}  // namespace
}  // namespace zerobubble

TORCH_LIBRARY_IMPL(zerobubble_cpu, CPU, m) {
  m.impl("shm_all_reduce", &zerobubble::shm_all_reduce);
  m.impl("shm_all_gather", &zerobubble::shm_all_gather);
}
