// What every kernel of the library shares: the thread pool (parallel_for), 16-lane vectors, and the
// row-wise pieces (RMSNorm, rotary, softmax, silu * up).
//
// The library is two translation units compiled at once (kernels.cc and linear.cc, worker/build.py
// kernel_library), each with its own copy of the kernels (an anonymous namespace). What they must
// share is in namespace msinfer_shared, with external linkage (inline): the thread pool and its
// size, and the switches and counters kernels.cc's entry points set for linear.cc's.

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define MSINFER_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// glibc's vector expf (libmvec), which math.h declares only under -ffast-math; with this the
// exp loops below vectorize.
#pragma omp declare simd notinbranch
extern "C" float expf(float);

namespace msinfer_shared {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// fn(i) for i in [0, n) on `threads` threads, the caller's among them. Helpers are started on
// first need and kept. A call never waits for a helper to wake (in a virtual machine that takes
// ~140 us, more than most kernels): items are claimed from one atomic word that also names the
// call, so a helper that wakes late finds them all taken, and the caller waits only for items
// in progress. After its last item a helper spins kSpin before sleeping, so that the next call,
// a few microseconds later in the same step, finds it awake.
class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }

  void run(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> call(call_);
    const int helpers = static_cast<int>(std::min<int64_t>(threads, n)) - 1;
    if (helpers <= 0 || n > kMaxItems) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    while (static_cast<int>(workers_.size()) < helpers) {
      const int id = static_cast<int>(workers_.size());
      workers_.emplace_back([this, id] { loop(id); });
    }
    task_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    wanted_.store(helpers, std::memory_order_relaxed);
    const uint64_t gen = (next_.load(std::memory_order_relaxed) >> kGenShift) + 1;
    // Sequentially consistent, like the helper's sleeping_ increment and its check of next_
    // before it sleeps: with release/acquire this load may be done before the store is seen,
    // and a helper going to sleep just then would miss the call (and sleep until the next).
    next_.store(gen << kGenShift | static_cast<uint64_t>(n) << kCountShift);
    if (sleeping_.load()) {
      std::lock_guard<std::mutex> lock(m_);
      wake_.notify_all();
    }
    const int64_t mine = work(gen);
    while (done_.load(std::memory_order_acquire) != n - mine) cpu_relax();
  }

  ~Pool() {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lock(m_);
      wake_.notify_all();
    }
    for (auto& t : workers_) t.join();
  }

 private:
  // next_: generation (bits 40-63) | item count (20-39) | next item (0-19)
  static constexpr int kGenShift = 40, kCountShift = 20;
  static constexpr int64_t kMaxItems = (1 << 20) - 1;
  static constexpr auto kSpin = std::chrono::microseconds(50);

  // Claims and runs items of generation gen until none is left; returns how many it ran.
  int64_t work(uint64_t gen) {
    int64_t ran = 0;
    uint64_t v = next_.load(std::memory_order_acquire);
    for (;;) {
      const int64_t i = static_cast<int64_t>(v & kMaxItems), n = static_cast<int64_t>(v >> kCountShift & kMaxItems);
      if ((v >> kGenShift) != gen || i >= n) return ran;
      if (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
      (*task_)(i);
      ++ran;
      v = next_.load(std::memory_order_acquire);
    }
  }

  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen = next_.load(std::memory_order_acquire) >> kGenShift;
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (gen == seen && !stop_.load(std::memory_order_relaxed) && std::chrono::steady_clock::now() < until) {
        cpu_relax();
        gen = next_.load(std::memory_order_acquire) >> kGenShift;
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(m_);
        sleeping_.fetch_add(1);
        wake_.wait(lock, [&] { return stop_.load() || (next_.load() >> kGenShift) != seen; });
        sleeping_.fetch_sub(1);
        gen = next_.load(std::memory_order_acquire) >> kGenShift;
      }
      if (stop_.load()) return;
      seen = gen;
      if (id >= wanted_.load(std::memory_order_relaxed)) continue;
      const int64_t ran = work(gen);
      if (ran) done_.fetch_add(ran, std::memory_order_release);
    }
  }

  std::mutex call_, m_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* task_ = nullptr;
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> wanted_{0}, sleeping_{0};
  std::atomic<bool> stop_{false};
};

inline int g_threads = 1;        // SetThreads

// runs_taken: a thread that ends its run takes the others' last items, unless SetSteal(0)
// (MSINFER_STEAL=0; scripts/measure_steps.py --switch SetSteal=0,1 compares the two).
inline bool g_steal = true;
inline std::atomic<int64_t> g_stolen{0};      // the items taken so (StolenItems, for tests)

// Set on a thread that runs a share of a call's tokens by itself (DecoderStack): its kernels
// then take no helper, and their work is split as for one thread.
inline thread_local bool t_alone = false;
inline int threads_now() { return t_alone ? 1 : g_threads; }

// fn(i) for i in [0, n) on up to threads_now() threads, one more thread per `grain` indices (smaller
// calls are not worth waking a helper for). The threads claim `grain` consecutive indices at a
// time: a claim is an atomic add on a line both cores write, ~0.1 us, as long as a row of RmsNorm.
// On one thread, the caller's loop (a thread alone may be a pool task: it must not call the pool).
inline void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t)>& fn) {
  const int threads = static_cast<int>(std::min<int64_t>(threads_now(), std::max<int64_t>(1, n / grain)));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  if (grain <= 1) return Pool::get().run(n, threads, fn);
  Pool::get().run((n + grain - 1) / grain, threads, [&](int64_t c) {
    for (int64_t i = c * grain; i < std::min(n, (c + 1) * grain); ++i) fn(i);
  });
}

// One run of items a thread, run r its items k in [bounds(r).first, bounds(r).second): each
// thread runs its own run's items in order, then own(r); then it takes the other runs' last
// items, one at a time from the back, so that a thread that ends early does not wait for the
// others' last items (a decode step's matmul halves ended 7-10 us apart of ~110 on average, a
// thread's start or its memory slower at times; worker/csrc/matmul.h panel_items). fn(r, k,
// next, first): next the item of run r this thread may take after k (k + 1 for the run's own
// thread, k - 1 for another; -1 if none is left), so that it can ask for its data ahead; first
// where k is the first this thread takes of run r. Each run's claims are one word (front | back
// << 32) on a line of its own: a claim is an uncontended atomic, but where the threads meet.
template <typename Bounds, typename Fn, typename Own>
void runs_taken(int64_t runs, Bounds&& bounds, Fn&& fn, Own&& own) {
  struct alignas(64) Claim {
    std::atomic<uint64_t> word;
  };
  thread_local std::vector<Claim> claims_of_caller;
  if (static_cast<int64_t>(claims_of_caller.size()) < runs) claims_of_caller = std::vector<Claim>(runs);
  Claim* claims = claims_of_caller.data();
  for (int64_t r = 0; r < runs; ++r) {
    const auto [from, to] = bounds(r);
    claims[r].word.store(static_cast<uint64_t>(from) | static_cast<uint64_t>(std::max(from, to)) << 32,
                         std::memory_order_relaxed);
  }
  // the front (or the back) item of run r, and the other end as it was; -1 if none is left
  auto take = [claims](int64_t r, bool front, int64_t& other) -> int64_t {
    std::atomic<uint64_t>& word = claims[r].word;
    uint64_t v = word.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = static_cast<int64_t>(v & 0xffffffffu), b = static_cast<int64_t>(v >> 32);
      if (f >= b) return -1;
      if (word.compare_exchange_weak(v, front ? v + 1 : v - (uint64_t{1} << 32), std::memory_order_relaxed)) {
        other = front ? b : f;
        return front ? f : b - 1;
      }
    }
  };
  const bool steal = g_steal;
  parallel_for(runs, 1, [&](int64_t run) {
    int64_t k, other;
    for (bool first = true; (k = take(run, true, other)) >= 0; first = false)
      fn(run, k, k + 1 < other ? k + 1 : -1, first);
    own(run);
    for (int64_t o = 1; steal && o < runs; ++o) {
      const int64_t r = (run + o) % runs;
      for (bool first = true; (k = take(r, false, other)) >= 0; first = false) {
        fn(r, k, k - 1 >= other ? k - 1 : -1, first);
        g_stolen.fetch_add(1, std::memory_order_relaxed);
      }
    }
  });
}

// linear_pairs: VDPBF16PS where the library has it, unless SetBf16Dot(0) (MSINFER_BF16_DOT=0).
inline bool g_bf16_dot = true;

// Tells int4_rows' calls apart, so that a thread's dequantized panel is never one of an earlier
// call's (whose weights may since have been freed and others put at the same address).
inline std::atomic<uint64_t> g_int4_calls{0};

}  // namespace msinfer_shared

namespace {

using msinfer_shared::g_bf16_dot;
using msinfer_shared::g_int4_calls;
using msinfer_shared::g_threads;
using msinfer_shared::threads_now;
using msinfer_shared::parallel_for;
using msinfer_shared::runs_taken;

// A decode token's K/V rows read position by position (PagedAttention::one_by_rows, a head size
// that is not a multiple of 16) are scattered over the cache, too irregular for the hardware
// prefetcher: ask for the row kAhead positions on. Into L2 (locality
// 1): the fill buffers of L1 are few, and a batch-64 decode layer's attention took ~1.11 ms this
// way against ~1.22 ms into L1.
constexpr int64_t kAhead = 8;

// `bytes` from p asked for into L2 (Locality 1), or L1 (3)
template <int Locality = 1>
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, Locality);
}

typedef float v16 __attribute__((vector_size(64)));   // 16 float lanes (GCC vector extension)

typedef _Float16 h16 __attribute__((vector_size(32)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef _Float16 h16u __attribute__((vector_size(32), aligned(2)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef uint32_t v16u32u __attribute__((vector_size(64), aligned(4)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint16_t v16u16u __attribute__((vector_size(32), aligned(2)));

// A thread's scratch buffer of at least n elements: grown, never shrunk. std::vector::resize
// value-initializes what it adds, so a buffer sized to each call's rows would be zeroed again
// whenever a call follows a smaller one (the layers' K alternate 576, 1536, 576: a memset of up
// to 64 x 1536 values a call, 1.3% of a bfloat16 decode step's samples at batch 64).
template <typename T>
T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

inline float bf16_value(uint16_t h) { return __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16); }

// f rounded to the nearest bfloat16, ties to even: its 16 bits. A NaN stays a quiet NaN, and a
// denormal becomes a zero of its sign, as VDPBF16PS reads a denormal input (so the FMA way, which
// would not, sees the same values). Branch-free, so that a row's loop vectorizes.
inline uint16_t bf16_rounded(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f), a = u & 0x7fffffffu;
  const uint32_t nearest = (u + 0x7fffu + (u >> 16 & 1u)) >> 16, nan = u >> 16 | 0x40u, zero = u >> 16 & 0x8000u;
  return static_cast<uint16_t>(a > 0x7f800000u ? nan : a < 0x00800000u ? zero : nearest);
}

// A bfloat16 value held as its 16 bits (MindSpore's uint16): an element of the KV cache of a job
// computing in bfloat16, read widened to float32 and written rounded (`bf16_rounded`).
struct Bf16 {
  uint16_t bits;
  explicit operator float() const { return bf16_value(bits); }
};

inline v16 loadv(const float* p) { return *reinterpret_cast<const v16u*>(p); }
// (GCC turns the generic widening of 16 uint16 into two 8-lane halves and an insert: the
// attention of 16 decode tokens at context 1024 over a bfloat16 cache in the CPU's caches took
// 30-44 ms for the demo model's 30 layers that way, 22-26 ms with the one AVX-512 widening load.)
inline v16 loadv(const Bf16* p) {
#ifdef __AVX512F__
  return (v16)_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  const v16u32 w = __builtin_convertvector(*reinterpret_cast<const v16u16u*>(p), v16u32) << 16;
  return reinterpret_cast<const v16&>(w);
#endif
}
inline v16 loadv(const _Float16* p) { return __builtin_convertvector(*reinterpret_cast<const h16u*>(p), v16); }
inline void storev(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline void storev(_Float16* p, v16 x) { *reinterpret_cast<h16u*>(p) = __builtin_convertvector(x, h16); }

// The kernels' vectors in their inner loops (the matmuls' micro-kernels, attention's) are the
// CPU's own registers: 16 lanes on AVX-512, 8 on AVX2. GCC keeps a 16-lane vector extension type
// in memory where no register holds it (AVX2: every matmul accumulator went through the stack,
// 3.7 GFLOP/s against numpy's 90; attention, see attention.h).
#ifdef __AVX512F__
typedef v16 vreg;
typedef v16u vregu;
typedef h16u hregu;
#else
typedef float vreg __attribute__((vector_size(32)));
typedef float vregu __attribute__((vector_size(32), aligned(4)));
typedef _Float16 hregu __attribute__((vector_size(16), aligned(2)));
#endif
constexpr int kLanes = sizeof(vreg) / sizeof(float);
inline vreg loadr(const float* p) { return *reinterpret_cast<const vregu*>(p); }
inline vreg loadr(const _Float16* p) { return __builtin_convertvector(*reinterpret_cast<const hregu*>(p), vreg); }
// int8 lanes widened by one instruction each way (GCC turns __builtin_convertvector from a
// vector of 8 int8 into 8 scalar conversions: the int8 panels ran 4-6x slower than float32's)
#ifdef __AVX512F__
inline vreg loadr(const int8_t* p) {
  return (vreg)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
inline vreg loadr(const int8_t* p) {
  return (vreg)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif
// bfloat16 lanes (a bfloat16 checkpoint's weights in panels, CpuOps.pack_weight) widened to the
// float32 they are exactly: the products and sums are the float32 panels' own, from half the bytes.
#ifdef __AVX512F__
inline vreg loadr(const uint16_t* p) {
  return (vreg)_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#else
inline vreg loadr(const uint16_t* p) {
  return (vreg)_mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif
inline void storer(float* p, vreg x) { *reinterpret_cast<vregu*>(p) = x; }
inline vreg loadr(const Bf16* p) { return loadr(reinterpret_cast<const uint16_t*>(p)); }

// Softmax over each of `rows` score rows of length len (row r at s + r * len), in place. With
// `max` and `sum` given, each row is left as exp(score - its max), and its max and sum go there
// (a part of a row, whose parts are put together later). The max, the sum and the scaling run
// on whole vectors (the CPU's own, vreg: in 16-lane vectors an AVX2 build kept them on the
// stack, and a decode step's attention of 16 sequences at context 64, the demo model's 30
// layers from memory, took 6.15 ms against 5.63, Zen 3; the sum in 16 partial sums either way,
// so the same bits), the rest of a row after them; the exponentials are one vectorized loop
// (omp simd: the C library's vector expf). As one loop with its reduction, GCC summed the
// exponentials one float at a time through the stack: ~17% of a decode step's attention at
// context 64.
inline void softmax_rows(float* s, int64_t rows, int64_t len, float* max = nullptr, float* sum = nullptr) {
  constexpr int HALVES = 16 / kLanes;
  const int64_t whole = len / 16 * 16;
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * len;
    vreg mv = vreg{} - std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < whole; j += kLanes) {
      const vreg x = loadr(sr + j);
      mv = x > mv ? x : mv;
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < kLanes; ++i) m = mv[i] > m ? mv[i] : m;
    for (int64_t j = whole; j < len; ++j) m = sr[j] > m ? sr[j] : m;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) sr[j] = expf(sr[j] - m);
    vreg tv[HALVES] = {};       // 16 partial sums, lane by lane as 16 columns of the row
    for (int64_t j = 0; j < whole; j += 16)
      for (int h = 0; h < HALVES; ++h) tv[h] += loadr(sr + j + h * kLanes);
    float total = 0.f;
    for (int h = 0; h < HALVES; ++h)
      for (int i = 0; i < kLanes; ++i) total += tv[h][i];
    for (int64_t j = whole; j < len; ++j) total += sr[j];
    if (max != nullptr) {
      max[r] = m, sum[r] = total;
      continue;
    }
    const float inv = 1.f / total;
    for (int64_t j = 0; j < whole; j += kLanes) storer(sr + j, loadr(sr + j) * inv);
    for (int64_t j = whole; j < len; ++j) sr[j] *= inv;
  }
}

// The lane orders of sum8's rounds: round k's lo and hi take alternate runs of 8 >> (k - 1) lanes
// from a pair of vectors, so that lo + hi halves the partial sums each vector holds.
constexpr v16i kSumLo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
constexpr v16i kSumHi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
constexpr v16i kSumLo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
constexpr v16i kSumHi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
constexpr v16i kSumLo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
constexpr v16i kSumHi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
constexpr v16i kSumLo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
constexpr v16i kSumHi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

// s[t] = the sum of x[t]'s lanes for t < P (at most 8): rounds of pairwise shuffles and adds over
// 8 vectors (those past P zero), the last within one vector, whose lanes 0-7 then hold the 8
// sums; 3 to 4 operations a sum instead of a horizontal sum's 8.
template <int P>
__attribute__((always_inline)) inline void sum8(const v16 (&x)[P], float* s) {
  v16 y[8], a[4], b[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) y[i] = i < P ? x[i < P ? i : 0] : v16{};
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shuffle(y[2 * i], y[2 * i + 1], kSumLo1) + __builtin_shuffle(y[2 * i], y[2 * i + 1], kSumHi1);
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], kSumLo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], kSumHi2);
  const v16 c = __builtin_shuffle(b[0], b[1], kSumLo3) + __builtin_shuffle(b[0], b[1], kSumHi3);
  const v16 d = __builtin_shuffle(c, c, kSumLo4) + __builtin_shuffle(c, c, kSumHi4);
#pragma GCC unroll 8
  for (int t = 0; t < P; ++t) s[t] = d[t];
}

#ifndef __AVX512F__
typedef int32_t vregi __attribute__((vector_size(32)));
// The same for the 8-lane vreg of a CPU without AVX-512 (attention's decode scores): three rounds
// of pairwise shuffles (in-lane or half swaps, one instruction each) over 8 vectors, which leave
// the sums in lanes 0, 4, 1, 5, 2, 6, 3, 7 of the last.
template <int P>
__attribute__((always_inline)) inline void sum8(const vreg (&x)[P], float* s) {
  constexpr vregi lo1 = {0, 1, 2, 3, 8, 9, 10, 11}, hi1 = {4, 5, 6, 7, 12, 13, 14, 15};
  constexpr vregi lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
  constexpr vregi lo3 = {0, 2, 8, 10, 4, 6, 12, 14}, hi3 = {1, 3, 9, 11, 5, 7, 13, 15};
  constexpr int lane[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  vreg y[8], a[4], b[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) y[i] = i < P ? x[i < P ? i : 0] : vreg{};
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shuffle(y[2 * i], y[2 * i + 1], lo1) + __builtin_shuffle(y[2 * i], y[2 * i + 1], hi1);
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi2);
  const vreg c = __builtin_shuffle(b[0], b[1], lo3) + __builtin_shuffle(b[0], b[1], hi3);
#pragma GCC unroll 8
  for (int t = 0; t < P; ++t) s[t] = c[lane[t]];
}
#endif

// x * rsqrt(mean(x^2) + eps) * w over one row of H, rounded to T before the weight as Hugging
// Face does. o may be x.
template <typename T>
inline void norm_row(const T* x, const T* w, float eps, T* o, int64_t H) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i)
    o[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * inv)));
}

// Rotary embedding (rotate_half, the Hugging Face layout) of `heads` rows of D at x into o, with
// one token's tables c, s [D/2]; rounded to T as MindSpore's elementwise chain does.
template <typename T>
inline void rotate(const T* x, int64_t heads, int64_t D, const T* c, const T* s, T* o) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h, x += D, o += D) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
      const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
      o[i] = static_cast<T>(x1 * ci - x2 * si);
      o[i + half] = static_cast<T>(x2 * ci + x1 * si);
    }
  }
}

// f(T{}) with T the element type MindSpore names: float16 or float32.
template <typename F>
void with_dtype(const char* dtype, F&& f) {
  if (std::strcmp(dtype, "float16") == 0) {
    f(_Float16{});
  } else {
    f(float{});
  }
}

// The bytes of one element of the type with_dtype gives for `dtype`.
inline int64_t dtype_bytes(const char* dtype) {
  int64_t n = 0;
  with_dtype(dtype, [&](auto tag) { n = sizeof(tag); });
  return n;
}

// f(std::integral_constant<int, n>{}) for a run-time n in [1, Max]: a count of rows, heads or
// vectors becomes the compile-time size of a kernel's register block.
template <int Max, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (Max > 0) {
    if (n == Max) return f(std::integral_constant<int, Max>{});
    with_count<Max - 1>(n, f);
  }
}

template <typename T>
void rms_norm(const T* x, const T* w, float eps, T* out, int64_t rows, int64_t H) {
  parallel_for(rows, 64, [&](int64_t r) { norm_row(x + r * H, w, eps, out + r * H, H); });
}

// s = x + d rounded to T (the residual stream, as the network's add leaves it), then o =
// rms_norm(s): a layer's residual add and the next norm in one pass over the rows.
template <typename T>
void add_rms_norm(const T* x, const T* d, const T* w, float eps, T* s, T* o, int64_t rows, int64_t H) {
  parallel_for(rows, 64, [&](int64_t r) {
    const T* xr = x + r * H;
    const T* dr = d + r * H;
    T* sr = s + r * H;
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) sr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
    norm_row(sr, w, eps, o + r * H, H);
  });
}

// silu(g) * u, with silu's result in T before the product, as the network computes it
template <typename T>
inline T silu_times(T g, T u) {
  const float a = static_cast<float>(g);
  return static_cast<T>(static_cast<float>(static_cast<T>(a / (1.f + expf(-a)))) * static_cast<float>(u));
}

template <typename T>
void silu_mul(const T* x, T* out, int64_t N, int64_t I) {
  parallel_for(N, 16, [&](int64_t n) {
    const T* g = x + n * 2 * I;
    const T* u = g + I;
    T* o = out + n * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) o[i] = silu_times(g[i], u[i]);
  });
}

}  // namespace
