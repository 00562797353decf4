// The all-reduce and all-gather of a tensor-parallel group whose ranks are processes of one node,
// through a shared-memory segment every rank maps (worker/device.py join_node_group) instead of
// MCCL's TCP connections: on a CPU, where MCCL's threads, the loopback's system calls and their
// wake-ups took more of a decode step than its kernels (docs/benchmarks.md).
//
// The segment: a line of 64 bytes per rank (its Post: the last step whose values it has written,
// each buffer's call-site tag, whether it sleeps), then two buffers of `world` slots. A call is
// one or more steps of at most a slot's bytes; every rank runs the same steps in the same order.
// At step s a rank copies its values into its slot of buffer s % 2, publishes s, waits until every
// rank has published s, and sums the slots in rank order (or copies them, to gather), so every
// rank gets the same bits. One
// wait a step is enough with two buffers: a rank writes buffer s % 2 again at step s + 2, after
// every rank has published s + 1, which each did after reading step s.
//
// A rank waits by spinning a little, then on a futex (the ranks may share fewer cores than they
// are: 3 ranks on 2 cores must give a core up rather than spin on it). A rank that does not come
// within the group's timeout, or comes from another call site (the tag: the ranks' graphs ran
// their collectives in different orders), fails the call instead of mixing the wrong values.

#pragma once

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MSINFER_NODE_GROUP 1
#else
#define FUTEX_WAIT 0
#define FUTEX_WAKE 1
#endif

#include <climits>
#include <ctime>

#include "common.h"

namespace {

constexpr int kNodeMaxRanks = 64;   // a node group's ranks at most (worker/device.py NODE_GROUP_MAX_RANKS)

struct alignas(64) Post {
  std::atomic<uint32_t> step;       // the last step this rank has written
  std::atomic<int32_t> tag[2];      // the call site of the step in each buffer
  std::atomic<uint32_t> sleeping;   // the rank waits on a futex
};
static_assert(sizeof(Post) == 64, "a rank's post is one cache line");

struct NodeGroup {
  char* base = nullptr;             // the mapped segment, or null: no group attached
  int rank = 0, world = 0;
  int64_t slot_bytes = 0, timeout_ns = 0;
  uint32_t step = 0;                // this rank's steps so far

  Post* post(int r) const { return reinterpret_cast<Post*>(base) + r; }
  char* slot(uint32_t s, int r) const {
    return base + header_bytes(world) + (static_cast<int64_t>(s & 1u) * world + r) * slot_bytes;
  }
  static int64_t header_bytes(int world) { return (static_cast<int64_t>(world) * 64 + 4095) / 4096 * 4096; }
};

NodeGroup g_node;

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}

// A wait on (FUTEX_WAIT) or a wake of (FUTEX_WAKE) the ranks' shared word; elsewhere than Linux,
// where NodeGroupAttach refuses every group, a short sleep.
long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
#ifdef MSINFER_NODE_GROUP
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
#else
  if (timeout != nullptr) std::this_thread::sleep_for(std::chrono::microseconds(50));
  return 0;
#endif
}

// Pauses before a waiting rank sleeps (a few microseconds): 3 ranks on 2 cores ran a decode step of
// the demo model in 35.1-36.1 ms with 200, 39.6-39.8 with 2,000 (docs/benchmarks.md).
constexpr int kSpin = 200;

// The bytes of one element of a MindSpore dtype (the collectives move, DecoderStack slices), 0 for
// another.
inline int64_t element_bytes(const char* dtype) {
  for (const char* d : {"float32", "int32", "uint32"})
    if (std::strcmp(dtype, d) == 0) return 4;
  for (const char* d : {"float16", "bfloat16", "int16", "uint16"})
    if (std::strcmp(dtype, d) == 0) return 2;
  for (const char* d : {"float64", "int64", "uint64"})
    if (std::strcmp(dtype, d) == 0) return 8;
  for (const char* d : {"int8", "uint8", "bool"})
    if (std::strcmp(dtype, d) == 0) return 1;
  return 0;
}

// Rank r's post reaches step s (step counts wrap: compared by their difference): true, or false
// past the deadline.
bool wait_post(Post* p, uint32_t s, int64_t deadline) {
  auto reached = [&] { return static_cast<int32_t>(p->step.load() - s) >= 0; };
  for (int i = 0; i < kSpin; ++i) {
    if (reached()) return true;
    msinfer_shared::cpu_relax();
  }
  while (!reached()) {
    const int64_t left = deadline - now_ns();
    if (left <= 0) return false;
    const timespec slice{0, static_cast<long>(std::min<int64_t>(left, 100000000))};
    p->sleeping.fetch_add(1);
    const uint32_t seen = p->step.load();
    if (static_cast<int32_t>(seen - s) < 0) futex(&p->step, FUTEX_WAIT, seen, &slice);
    p->sleeping.fetch_sub(1);
  }
  return true;
}

// One step: `bytes` (at most a slot's) of x into this rank's slot, published, then every rank's
// awaited. The step's number (its buffer: s % 2), or 0 with `code` 2: a rank did not come within
// the timeout, 3: a rank came from another call site (tag).
uint32_t exchange(const void* x, int64_t bytes, int32_t tag, int& code) {
  NodeGroup& g = g_node;
  const uint32_t s = ++g.step;
  Post* mine = g.post(g.rank);
  std::memcpy(g.slot(s, g.rank), x, bytes);
  mine->tag[s & 1u].store(tag);
  mine->step.store(s);
  if (mine->sleeping.load() > 0) futex(&mine->step, FUTEX_WAKE, INT_MAX, nullptr);
  const int64_t deadline = now_ns() + g.timeout_ns;
  for (int r = 0; r < g.world; ++r) {
    if (r == g.rank) continue;
    if (!wait_post(g.post(r), s, deadline)) return code = 2, 0;
    if (g.post(r)->tag[s & 1u].load() != tag) return code = 3, 0;
  }
  return s;
}

// out [world * bytes] = every rank's x [bytes], rank after rank (as MindSpore's AllGather
// concatenates along the first dimension). 0, or exchange's code.
int node_all_gather(const char* x, char* out, int64_t bytes, int32_t tag) {
  NodeGroup& g = g_node;
  for (int64_t at = 0; at < bytes; at += g.slot_bytes) {
    const int64_t len = std::min(g.slot_bytes, bytes - at);
    int code = 0;
    const uint32_t s = exchange(x + at, len, tag, code);
    if (code) return code;
    for (int r = 0; r < g.world; ++r) std::memcpy(out + r * bytes + at, g.slot(s, r), len);
  }
  return 0;
}

// out [n] = the sum over the group's ranks of x [n] (T: float, _Float16 or uint16_t bfloat16 bits),
// summed in float32 in rank order. 0, or exchange's code.
template <typename T>
int node_all_reduce(const T* x, T* out, int64_t n, int32_t tag) {
  NodeGroup& g = g_node;
  const int64_t per = g.slot_bytes / static_cast<int64_t>(sizeof(T));
  for (int64_t at = 0; at < n; at += per) {
    const int64_t len = std::min(per, n - at);
    int code = 0;
    const uint32_t s = exchange(x + at, len * static_cast<int64_t>(sizeof(T)), tag, code);
    if (code) return code;
    const T* slots[kNodeMaxRanks];
    for (int r = 0; r < g.world; ++r) slots[r] = reinterpret_cast<const T*>(g.slot(s, r));
    T* o = out + at;
    for (int64_t i = 0; i < len; i += 4096) {            // a slice at a time, the sums in a stack buffer
      const int64_t m = std::min<int64_t>(4096, len - i);
      float acc[4096];
      auto value = [](T v) {
        if constexpr (std::is_same_v<T, uint16_t>) return bf16_value(v);
        else return static_cast<float>(v);
      };
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) acc[j] = value(slots[0][i + j]);
      for (int r = 1; r < g.world; ++r) {
        const T* q = slots[r] + i;
#pragma omp simd
        for (int64_t j = 0; j < m; ++j) acc[j] += value(q[j]);
      }
      if constexpr (std::is_same_v<T, uint16_t>) {
#pragma omp simd
        for (int64_t j = 0; j < m; ++j) o[i + j] = bf16_rounded(acc[j]);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < m; ++j) o[i + j] = static_cast<T>(acc[j]);
      }
    }
  }
  return 0;
}

}  // namespace
