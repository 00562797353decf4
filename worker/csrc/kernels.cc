// The CPU kernels of msinfer's network, MindSpore AOT custom operators (mindspore.ops.Custom,
// func_type="aot"), built on first use by worker/cpu.py. Each takes float32 or float16 and
// computes in float32:
//   PagedAttention  rotary embedding, the new K/V rows into the cache, then softmax(q K^T /
//                   sqrt(D)) V over each token's context, read through the block tables straight
//                   from the KV cache (no gathered copy, no mask)
//   Linear          x w^T over a weight packed in column panels (every matmul of the network), or
//                   over a bfloat16 weight in AMX tiles, at float32 accuracy (see amx_rows)
//   LinearGlu       silu(x gate^T) * (x up^T), the MLP's first half, over gate and up packed together
//   Embed           rows of a packed embedding table
//   Rows            rows of a matrix by index, zeros for an index out of range (padding)
//   RmsNorm         x * rsqrt(mean(x^2) + eps) * w over the last dimension
//   SiluMul         silu(gate) * up of a merged [gate | up] projection
//   MoeExperts      a mixture-of-experts layer's experts, each over the tokens routed to it
// One kernel call replaces the 5-10 MindSpore operators of each, which on the CPU cost a launch
// apiece, an explicit broadcast (see worker/ops.py) and a compile step per graph.
//
// Work is shared by a small pool of threads that spin briefly, then sleep, between calls
// (SetThreads sets how many, the caller's included): OpenMP's long-spinning workers would steal
// the cores from the MindSpore kernels that run next (a decode step was 45% slower with them).
//
// PagedAttention, inputs in order:
//   qkv      [N, (H + 2 KV) D]  the tokens' q, k, v projections, before any norm or rotary
//   q_norm   [D], k_norm [D]    RMSNorm weights of q and k heads (Qwen3), used if norm[1] != 0
//   norm     [2] float32        eps, and whether to norm q and k heads before the rotary
//   cos, sin [N, D/2]           each token's rotary table
//   k_cache  [S * KV, D]        the layer's cache, row slot * KV + kv_head (written in place)
//   v_cache  [S * KV, D]
//   slots    [N] int32          the cache slot each token's K/V row goes to (padding: a scratch slot)
//   tables   [M, MB] int32      block table of each sequence in the step
//   rows     [N] int32          which table row (sequence) each token belongs to
//   lens     [N] int32          how many positions of its sequence each token sees (0: padding)
//   meta     [2] int32          block size, KV heads
// Output:
//   out      [N, H D]           softmax(q K^T / sqrt(D)) V, zeros for padding tokens
// First every token's rotated K and its V go to the cache and its rotated q to `out`; then each
// token attends, reading its q back from `out`. The cache is written here rather than by a
// scatter operator in the graph: one pass instead of three operators a layer, and no other
// operator reads the cache, so the order is this kernel's own.
// Query heads sharing a KV head (grouped-query attention) are computed together, so each K/V row
// is read once per token and KV head.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

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

namespace {

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

int g_threads = 1;

// fn(i) for i in [0, n) on up to g_threads threads, one more thread per `grain` indices (smaller
// calls are not worth waking a helper for). The threads claim `grain` consecutive indices at a
// time: a claim is an atomic add on a line both cores write, ~0.1 us, as long as a row of RmsNorm.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t)>& fn) {
  const int threads = static_cast<int>(std::min<int64_t>(g_threads, std::max<int64_t>(1, n / grain)));
  if (grain <= 1) return Pool::get().run(n, threads, fn);
  Pool::get().run((n + grain - 1) / grain, threads, [&](int64_t c) {
    for (int64_t i = c * grain; i < std::min(n, (c + 1) * grain); ++i) fn(i);
  });
}

// Softmax over each of `rows` score rows of length len (row r at s + r * len), in place.
inline void softmax_rows(float* s, int64_t rows, int64_t len) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * len;
    float m = sr[0];
#pragma omp simd reduction(max : m)
    for (int64_t j = 1; j < len; ++j) m = sr[j] > m ? sr[j] : m;   // (std::max stays scalar: 4 cycles a score)
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < len; ++j) {
      sr[j] = expf(sr[j] - m);
      sum += sr[j];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) sr[j] *= inv;
  }
}

// A decode token's K/V rows are scattered over the cache (one per position, KV heads apart), too
// irregular for the hardware prefetcher: ask for the row kAhead positions on. Into L2 (locality
// 1): the fill buffers of L1 are few, and a batch-64 decode layer's attention took ~1.11 ms this
// way against ~1.22 ms into L1.
constexpr int64_t kAhead = 8;

inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 1);
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

inline v16 loadv(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline v16 loadv(const _Float16* p) { return __builtin_convertvector(*reinterpret_cast<const h16u*>(p), v16); }
inline void storev(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline void storev(_Float16* p, v16 x) { *reinterpret_cast<h16u*>(p) = __builtin_convertvector(x, h16); }

// Lane i of the result is the sum of the lanes of x[i]: four rounds of pairwise shuffles and
// adds (15 of each) instead of 16 horizontal sums.
inline v16 sum16(const v16* x) {
  static constexpr v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  static constexpr v16i hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  static constexpr v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  static constexpr v16i hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  static constexpr v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  static constexpr v16i hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  static constexpr v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  static constexpr v16i hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo1) + __builtin_shuffle(x[2 * i], x[2 * i + 1], hi1);
  for (int i = 0; i < 4; ++i) b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi2);
  for (int i = 0; i < 2; ++i) c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo3) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi3);
  return __builtin_shuffle(c[0], c[1], lo4) + __builtin_shuffle(c[0], c[1], hi4);
}

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

// f(std::integral_constant<int, n>{}) for a run-time n in [1, Max]: a count of rows, heads or
// vectors becomes the compile-time size of a kernel's register block.
template <int Max, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (Max > 0) {
    if (n == Max) return f(std::integral_constant<int, Max>{});
    with_count<Max - 1>(n, f);
  }
}

// Scores of a prefill tile for GC query heads of one KV group: s[g][j] (16 token lanes) =
// sum_d qt[g][d] k_j[d], eight keys at a time: per d, GC query loads and eight key broadcasts
// feed 8 GC FMAs (24 accumulators for GC = 3).
template <typename T, int GC>
void tile_scores(const v16* qt, int64_t D, const T* const* krow, int64_t len, v16* s, int64_t ld) {
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    v16 acc[GC][8] = {};
    const T* const* k = krow + j;
    for (int64_t d = 0; d < D; ++d) {
      v16 q[GC];
#pragma GCC unroll 4
      for (int g = 0; g < GC; ++g) q[g] = qt[g * D + d];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const float kv = static_cast<float>(k[t][d]);
#pragma GCC unroll 4
        for (int g = 0; g < GC; ++g) acc[g][t] += q[g] * kv;
      }
    }
    for (int g = 0; g < GC; ++g)
      for (int t = 0; t < 8; ++t) s[g * ld + j + t] = acc[g][t];
  }
  for (; j < len; ++j) {
    v16 acc[GC] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float kv = static_cast<float>(krow[j][d]);
      for (int g = 0; g < GC; ++g) acc[g] += qt[g * D + d] * kv;
    }
    for (int g = 0; g < GC; ++g) s[g * ld + j] = acc[g];
  }
}

// P V of a prefill tile for R of its tokens (lanes i0.. of p[j]) over 16 C consecutive values of
// D (the caller offsets voff and a): a[r][:] = sum_{j < len} p[j][i0 + r] v_j[:]. Per key, C V
// loads and R broadcasts feed R C FMAs (28 accumulators for R = 7, C = 4). p is zero past a
// token's own keys, so the tokens share one loop over the longest of their lengths.
template <typename T, int R, int C>
void tile_pv(const v16* p, int64_t i0, const T* const* krow, std::ptrdiff_t voff, int64_t len, float* a,
             int64_t lda) {
  v16 acc[R][C] = {};
  for (int64_t j = 0; j < len; ++j) {
    const T* v = krow[j] + voff;
    v16 vv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) vv[c] = loadv(v + 16 * c);
    const float* pj = reinterpret_cast<const float*>(p + j) + i0;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float w = pj[r];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] += w * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) storev(a + r * lda + 16 * c, acc[r][c]);
}

template <typename T>
struct PagedAttention {
  static constexpr int64_t QT = 16;   // query tokens of one sequence computed together (a prefill tile)

  const T *q, *kc, *vc;               // q: the rotated queries, in `out` (see write())
  const int32_t *tables, *rows, *lens;
  T* out;
  int64_t N, H, D, KV, MB, bs, G;
  float scale;

  // Each token's rotated K (normed first if qn) and its V into the cache at its slot, its
  // rotated q into `out`.
  static void write(const T* qkv, const T* qn, const T* kn, float eps, const T* cos, const T* sin, T* kc, T* vc,
                    const int32_t* slots, T* out, int64_t N, int64_t H, int64_t KV, int64_t D) {
    parallel_for(N, 16, [&](int64_t n) {
      const T* c = cos + n * D / 2;
      const T* s = sin + n * D / 2;
      const T* q = qkv + n * (H + 2 * KV) * D;
      const T* k = q + H * D;
      const T* v = k + KV * D;
      T* qo = out + n * H * D;
      const int64_t row = static_cast<int64_t>(slots[n]) * KV * D;
      T* ko = kc + row;
      if (qn) {
        for (int64_t h = 0; h < H; ++h) norm_row(q + h * D, qn, eps, qo + h * D, D);
        for (int64_t h = 0; h < KV; ++h) norm_row(k + h * D, kn, eps, ko + h * D, D);
        q = qo;
        k = ko;
      }
      rotate(q, H, D, c, s, qo);
      rotate(k, KV, D, c, s, ko);
      std::copy(v, v + KV * D, vc + row);
    });
  }

  // Cache rows (K; V at the same offset) of positions 0..len-1 of token n's sequence, KV head h.
  void key_rows(int64_t n, int64_t h, int64_t len, std::vector<const T*>& krow) const {
    const int32_t* table = tables + static_cast<int64_t>(rows[n]) * MB;
    krow.resize(len);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t slot = static_cast<int64_t>(table[j / bs]) * bs + j % bs;
      krow[j] = kc + (slot * KV + h) * D;
    }
  }

  // One token (a decode step's), all its H query heads over its `len` positions. The KV heads
  // of a position are one contiguous [KV][D] row block, so K and V are each read in one pass.
  void one(int64_t n) const {
    thread_local std::vector<float> qv, acc, s;
    thread_local std::vector<const T*> krow;
    T* o = out + n * H * D;
    const int64_t len = lens[n];
    if (len <= 0) {
      std::fill(o, o + H * D, T(0));
      return;
    }
    qv.resize(H * D);
    acc.assign(H * D, 0.f);
    s.resize(H * len);
    for (int64_t i = 0; i < H * D; ++i) qv[i] = static_cast<float>(q[n * H * D + i]) * scale;
    key_rows(n, 0, len, krow);
    const int64_t block_bytes = KV * D * static_cast<int64_t>(sizeof(T));
    const std::ptrdiff_t voff = vc - kc;
    for (int64_t t = 0; t < std::min<int64_t>(16, len); ++t) {   // the loops below prefetch 16 ahead
      prefetch(krow[t], block_bytes);
      prefetch(krow[t] + voff, block_bytes);
    }
    int64_t j = 0;
    if (D % 16 == 0) {            // 16 positions at a time: 16 dot products, summed lane-wise
      for (; j + 16 <= len; j += 16) {
        for (int64_t hq = 0; hq < H; ++hq) {
          for (int64_t t = 16 + hq * 16 / H; t < 16 + (hq + 1) * 16 / H && j + t < len; ++t)
            prefetch(krow[j + t], block_bytes);      // the next 16 positions, a share per head
          const float* qh = qv.data() + hq * D;
          const int64_t off = hq / G * D;
          v16 acc[16] = {};
          for (int64_t d = 0; d < D; d += 16) {
            const v16 qd = loadv(qh + d);
#pragma GCC unroll 16
            for (int t = 0; t < 16; ++t) acc[t] += qd * loadv(krow[j + t] + off + d);
          }
          storev(s.data() + hq * len + j, sum16(acc));
        }
      }
    }
    for (; j < len; ++j) {
      const T* k = krow[j];
      if (j + kAhead < len) prefetch(krow[j + kAhead], block_bytes);
      for (int64_t hq = 0; hq < H; ++hq) {
        const float* qh = qv.data() + hq * D;
        const T* kh = k + hq / G * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * static_cast<float>(kh[d]);
        s[hq * len + j] = dot;
      }
    }
    softmax_rows(s.data(), H, len);
    j = 0;
    if (D % 16 == 0) {            // 16 positions at a time, each head's sums held in registers
      for (; j + 16 <= len; j += 16)
        for (int64_t hq = 0; hq < H; ++hq) {
          for (int64_t t = 16 + hq * 16 / H; t < 16 + (hq + 1) * 16 / H && j + t < len; ++t)
            prefetch(krow[j + t] + voff, block_bytes);
          const float* p = s.data() + hq * len + j;
          const int64_t off = voff + hq / G * D;
          float* a = acc.data() + hq * D;
          for (int64_t d = 0; d < D; d += 16) {
            v16 e = loadv(a + d), f = {};
#pragma GCC unroll 16
            for (int t = 0; t < 16; t += 2) {
              e += p[t] * loadv(krow[j + t] + off + d);
              f += p[t + 1] * loadv(krow[j + t + 1] + off + d);
            }
            storev(a + d, e + f);
          }
        }
    }
    for (; j < len; ++j) {
      const T* v = krow[j] + voff;
      if (j + kAhead < len) prefetch(krow[j + kAhead] + voff, block_bytes);
      for (int64_t hq = 0; hq < H; ++hq) {
        const float w = s[hq * len + j];
        const T* vh = v + hq / G * D;
        float* a = acc.data() + hq * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<float>(vh[d]);
      }
    }
    for (int64_t i = 0; i < H * D; ++i) o[i] = static_cast<T>(acc[i]);
  }

  // count (<= QT) consecutive tokens n0.. of one sequence at consecutive positions (a prefill
  // chunk), KV head h: each K row is read once for all of them, and the scores accumulate
  // across the tokens (16 lanes of one vector) rather than along D, so no horizontal sums.
  void tile(int64_t n0, int64_t count, int64_t h) const {
    thread_local std::vector<v16> qt, s;            // qt [g][d], s [g][j]: 16 tokens a vector
    thread_local std::vector<const T*> krow;
    const int64_t len = lens[n0 + count - 1];        // the last token sees the most
    static_assert(QT == 16, "a tile's tokens are the 16 lanes of a vector");
    int64_t tok_len[QT];
    v16i lane_len;
    for (int64_t i = 0; i < QT; ++i) lane_len[i] = static_cast<int32_t>(tok_len[i] = i < count ? lens[n0 + i] : 0);
    qt.assign(G * D, v16{});
    for (int64_t i = 0; i < count; ++i) {            // each token's query rows, read in order
      const T* qi = q + ((n0 + i) * H + h * G) * D;
      for (int64_t e = 0; e < G * D; ++e) qt[e][i] = static_cast<float>(qi[e]) * scale;
    }
    key_rows(n0, h, len, krow);
    s.resize(G * len);
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
      const v16* qg = qt.data() + g0 * D;
      v16* sg = s.data() + g0 * len;
      with_count<3>(std::min<int64_t>(3, G - g0),
                    [&](auto gc) { tile_scores<T, gc>(qg, D, krow.data(), len, sg, len); });
    }
    for (int64_t g = 0; g < G; ++g) {
      v16* sg = s.data() + g * len;
      // softmax of each token (lane) over its own keys j < tok_len[i], 16 lanes a vector
      v16 m = v16{} - 3.0e38f, sum = {};
      for (int64_t jj = 0; jj < len; ++jj) {
        const v16i seen = (v16i{} + static_cast<int32_t>(jj)) < lane_len;
        m = seen ? (sg[jj] > m ? sg[jj] : m) : m;
      }
      for (int64_t jj = 0; jj < len; ++jj) {
        const v16i seen = (v16i{} + static_cast<int32_t>(jj)) < lane_len;
        alignas(64) float e[QT];
        storev(e, seen ? sg[jj] - m : v16{});   // unseen lanes: exp(0), not an overflow (slow path)
#pragma omp simd simdlen(16)   // one 16-lane expf: two 8-lane halves would stall the load below
        for (int64_t i = 0; i < QT; ++i) e[i] = expf(e[i]);
        sg[jj] = seen ? loadv(e) : v16{};
        sum += sg[jj];
      }
      const v16 inv = sum > 0.f ? 1.f / sum : v16{};
      for (int64_t jj = 0; jj < len; ++jj) sg[jj] *= inv;
    }
    // P V in groups of up to 7 tokens: 64 values of D at a time held in registers, the last
    // D mod 16 (an odd head size) one value at a time
    const std::ptrdiff_t voff = vc - kc;
    const int64_t D16 = D / 16 * 16, groups = (count + 6) / 7;
    thread_local std::vector<float> a;
    a.resize(7 * D);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i0 = 0, k = 0; k < groups; ++k) {
        const int64_t r = count / groups + (k < count % groups), n = tok_len[i0 + r - 1];
        const v16* p = s.data() + g * len;
        for (int64_t c = 0; c < D16; c += 64)
          with_count<7>(r, [&](auto rows) {
            with_count<4>(std::min<int64_t>(4, (D16 - c) / 16), [&](auto vecs) {
              tile_pv<T, rows, vecs>(p, i0, krow.data(), voff + c, n, a.data() + c, D);
            });
          });
        for (int64_t t = 0; t < r; ++t)
          for (int64_t e = D16; e < D; ++e) {
            float sum = 0.f;
            for (int64_t j = 0; j < tok_len[i0 + t]; ++j) sum += p[j][i0 + t] * static_cast<float>(krow[j][voff + e]);
            a[t * D + e] = sum;
          }
        for (int64_t t = 0; t < r; ++t) {
          T* o = out + ((n0 + i0 + t) * H + h * G + g) * D;
          for (int64_t e = 0; e < D; ++e) o[e] = static_cast<T>(a[t * D + e]);
        }
        i0 += r;
      }
  }

  void run() const {
    // Work items: runs of 4 to QT consecutive tokens of one sequence at consecutive positions
    // (prefill tiles), one item per KV head, and single tokens, one item for all heads.
    // The longest items go first (their cost, positions read times query heads), so that the
    // threads finish together: in index order a long sequence's item could come last.
    struct Item {
      int64_t n0, count, h, cost;
    };
    std::vector<Item> items;
    for (int64_t n = 0, end; n < N; n = end) {
      for (end = n + 1; end < N && end - n < QT && lens[end] > 1 && rows[end] == rows[n] &&
                        lens[end] == lens[end - 1] + 1;)
        ++end;
      if (end - n >= 4 && lens[n] > 0) {
        for (int64_t h = 0; h < KV; ++h) items.push_back({n, end - n, h, lens[end - 1] * (end - n) * G});
      } else {
        for (int64_t i = n; i < end; ++i) items.push_back({i, 1, -1, lens[i] * H});
      }
    }
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    parallel_for(static_cast<int64_t>(items.size()), 1, [&](int64_t i) {
      const Item& it = items[i];
      if (it.h >= 0) {
        tile(it.n0, it.count, it.h);
      } else {
        one(it.n0);
      }
    });
  }
};

template <typename T>
void attend(const T* qkv, const T* qn, const T* kn, float eps, const T* cos, const T* sin, T* kc, T* vc,
            const int32_t* slots, const int32_t* tables, const int32_t* rows, const int32_t* lens, T* out, int64_t N,
            int64_t H, int64_t D, int64_t KV, int64_t MB, int64_t bs) {
  PagedAttention<T>::write(qkv, qn, kn, eps, cos, sin, kc, vc, slots, out, N, H, KV, D);
  PagedAttention<T>{out, kc, vc, tables, rows, lens, out, N, H, D, KV, MB, bs, H / KV,
                    1.0f / std::sqrt(static_cast<float>(D))}.run();
}

template <typename T>
void rms_norm(const T* x, const T* w, float eps, T* out, int64_t rows, int64_t H) {
  parallel_for(rows, 64, [&](int64_t r) { norm_row(x + r * H, w, eps, out + r * H, H); });
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

// ---- Linear: y [M, N] = x [M, K] w^T ------------------------------------------------------
// w keeps its [N, K] shape but is stored panel-major (worker/cpu.py CpuOps.pack): the columns
// p*32 .. p*32+31 of y come from panel p, K rows of 32 weights ([K][width] for a last, narrower
// panel). A micro-kernel keeps kRows x 32 outputs in registers (28 of the 32 vector registers)
// over the whole of K: per k, two panel loads and kRows broadcasts of x feed 2 * kRows FMAs.
// Rows are taken kRowBlock at a time so that their x stays in cache while every panel passes.
constexpr int64_t kPanel = 32, kRows = 14, kRowBlock = 9 * kRows;

// c[R][32] (row stride ldc) = a[R][K] (row stride lda) times a full panel b [K][32]. Meanwhile
// the bytes pf + k * pf_step (k < K) are asked for: weights stream from memory once a step, and
// the hardware prefetcher alone leaves the FMAs waiting on them. When several row groups read
// the panel (`cached`: it was asked for during the previous panel's groups and is in L2), it
// is also asked for into L1, 16 rows ahead (+4% at 64 and 512 rows); with one group it is still
// coming from memory, and asking again only takes fill buffers (batch-1 decode step 41 -> 37 ms).
// Kept out of line: inlined into the `with_count` dispatch, the 512-row matmuls measured a few
// percent slower.
template <typename T, int R, bool Glu = false>
__attribute__((noinline)) void micro(const T* a, int64_t lda, const T* b, int64_t K, T* c, int64_t ldc,
                                     const char* pf, int64_t pf_step, bool cached) {
  v16 c0[R], c1[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) c0[i] = c1[i] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    const T* bk = b + k * kPanel;
    __builtin_prefetch(pf + k * pf_step);
    if (cached) {                  // the panel itself, from L2 into L1, 16 rows ahead
      __builtin_prefetch(bk + 16 * kPanel);
      __builtin_prefetch(bk + 16 * kPanel + 16);
    }
    const v16 b0 = loadv(bk), b1 = loadv(bk + 16);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const float s = static_cast<float>(a[i * lda + k]);
      c0[i] += s * b0;
      c1[i] += s * b1;
    }
  }
  if constexpr (Glu) {            // columns 0-15 gate, 16-31 up: c[R][16] = silu(gate) * up
    for (int i = 0; i < R; ++i) {
      alignas(64) float g[16], u[16];
      storev(g, c0[i]);
      storev(u, c1[i]);
      T* o = c + i * ldc;
#pragma omp simd
      for (int j = 0; j < 16; ++j) o[j] = silu_times(static_cast<T>(g[j]), static_cast<T>(u[j]));
    }
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      storev(c + i * ldc, c0[i]);
      storev(c + i * ldc + 16, c1[i]);
    }
  }
}

// Work items are runs of about kRun panels over one block of rows, taken run by run: the threads
// work on the same panels at once, each on its own rows, so a panel comes from memory once and
// the other thread finds it in L3 (+4% at 512 rows against block by block). While a panel's row
// groups are computed, the next panel of the run is prefetched, a share per group; the run's
// first panel is prefetched ahead of its own first group.
constexpr int64_t kRun = 8;

// Glu: the panels hold 16 gate and 16 up columns each (CpuOps.pack_glu) and y [M, N/2] gets
// silu(gate) * up, computed as each tile leaves the registers.
template <typename T, bool Glu = false>
void linear_rows(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t out_cols = Glu ? kPanel / 2 : kPanel;       // of y, per panel
  const int64_t ldy = Glu ? N / 2 : N;
  const int64_t panels = (N + kPanel - 1) / kPanel, full = N / kPanel;
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  // The panels are split into runs of near-equal length, as many as the threads can share evenly
  // and about kRun long: three runs of 8, 8 and 2 panels would leave one thread idle for 6.
  const int64_t runs = std::max<int64_t>(1, (panels + kRun - 1) / kRun / g_threads) * g_threads;
  const int64_t panel_bytes = K * kPanel * static_cast<int64_t>(sizeof(T));
  parallel_for(blocks * runs, 1, [&](int64_t item) {
    const int64_t m0 = item % blocks * kRowBlock, m1 = std::min(M, m0 + kRowBlock);
    const int64_t p0 = item / blocks * panels / runs, p1 = (item / blocks + 1) * panels / runs;
    const int64_t groups = (m1 - m0 + kRows - 1) / kRows;
    const int64_t share = (panel_bytes + groups - 1) / groups;
    for (int64_t p = p0; p < std::min(p1, full); ++p) {
      const T* b = w + p * kPanel * K;
      const char* next = reinterpret_cast<const char*>(b + kPanel * K);
      for (int64_t m = m0, g = 0; m < m1; ++g) {
        const int64_t r = (m1 - m0) / groups + (g < (m1 - m0) % groups);   // groups of equal size
        const char* pf = next + g * share;
        int64_t step = (share + K - 1) / K;
        if (p + 1 >= std::min(p1, full)) step = 0;                  // no next panel in this run
        if (p == p0 && g == 0) pf = reinterpret_cast<const char*>(b) + 4096, step = kPanel * sizeof(T);
        with_count<kRows>(r, [&](auto rows) {
          micro<T, rows, Glu>(x + m * K, K, b, K, y + m * ldy + p * out_cols, ldy, pf, step, groups > 1);
        });
        m += r;
      }
    }
    if (Glu || p1 <= full) return;   // (Glu: N is a multiple of 32)
    // the last, narrower panel: padded to 32 columns, computed into a scratch tile
    const int64_t col = full * kPanel, width = N - col;
    const T* b = w + col * K;
    thread_local std::vector<T> pad, tile;
    pad.assign(K * kPanel, T(0));
    for (int64_t k = 0; k < K; ++k) std::copy(b + k * width, b + (k + 1) * width, pad.data() + k * kPanel);
    tile.resize(kRows * kPanel);
    for (int64_t m = m0; m < m1; m += kRows) {
      const int64_t r = std::min(kRows, m1 - m);
      with_count<kRows>(r, [&](auto rows) {
        micro<T, rows>(x + m * K, K, pad.data(), K, tile.data(), kPanel, reinterpret_cast<const char*>(pad.data()), 0,
                       false);
      });
      for (int64_t i = 0; i < r; ++i)
        std::copy(tile.data() + i * kPanel, tile.data() + i * kPanel + width, y + (m + i) * N + col);
    }
  });
}

// ---- Linear over bfloat16 weights, in AMX tiles ---------------------------------------------
// Most checkpoints store their weights in bfloat16, so a float32 network holds weights whose
// last 16 bits are zero. For such a weight (CpuOps.pack_weight checks), x w^T is computed with
// Intel AMX at the float32 result: each row of x is split into three bfloat16 parts, hi + mid +
// lo == x exactly (hi = x truncated to bfloat16, mid = the rest truncated, lo = what remains,
// at most 8 significant bits); every product of a part and a weight is exact in float32 (8 x 8
// significant bits), and TDPBF16PS sums them in float32. The result differs from a float32
// matmul only in the order of its float32 additions (3K terms instead of K). Three bfloat16
// passes on the tile unit take about half the time of one float32 pass on the vector units, and
// the weight is half the bytes.
//   w is stored as int16 [N, K], tiles [N/16][K/32][16][32]: tile (n, k) holds columns 16n..16n+15
// and k-pairs of 32k..32k+31, row i = (w[c][32k + 2i], w[c][32k + 2i + 1]) for each column c
// (the layout TDPBF16PS reads its second operand in). N and K are multiples of 32.
constexpr int64_t kTileBf16 = 16 * 32;      // elements of one tile

inline float bf16_value(uint16_t h) { return __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16); }

#ifdef MSINFER_AMX
// The process may use the tile registers once the kernel grants it (Linux 5.16 on).
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct TileConfig {                          // palette 1, eight tiles of 16 rows x 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) colsb[i] = 64, rows[i] = 16;
  }
};

// x [M, K] -> a[p][Mp/16][K/32][16][32], p = hi, mid, lo; rows M..Mp-1 zeros.
void split_bf16(const float* x, int64_t M, int64_t K, int64_t Mp, uint16_t* a) {
  const int64_t KB = K / 32, part = Mp * K;
  parallel_for(Mp, 16, [&](int64_t m) {
    uint16_t* t = a + m / 16 * KB * kTileBf16 + m % 16 * 32;
    const uint32_t* r = reinterpret_cast<const uint32_t*>(x + m * K);
    for (int64_t kb = 0; kb < KB; ++kb, t += kTileBf16, r += 32) {
      if (m >= M) {
        for (int p = 0; p < 3; ++p) std::fill(t + p * part, t + p * part + 32, uint16_t(0));
        continue;
      }
      for (int i = 0; i < 32; i += 16) {
        const v16u32 u = *reinterpret_cast<const v16u32u*>(r + i), hi = u & 0xffff0000u;
        const v16 rest = reinterpret_cast<const v16&>(u) - reinterpret_cast<const v16&>(hi);     // exact
        const v16u32 mid = reinterpret_cast<const v16u32&>(rest) & 0xffff0000u;
        const v16 lo = rest - reinterpret_cast<const v16&>(mid);                                // exact
        *reinterpret_cast<v16u16u*>(t + i) = __builtin_convertvector(hi >> 16, v16u16);
        *reinterpret_cast<v16u16u*>(t + part + i) = __builtin_convertvector(mid >> 16, v16u16);
        *reinterpret_cast<v16u16u*>(t + 2 * part + i) =
            __builtin_convertvector(reinterpret_cast<const v16u32&>(lo) >> 16, v16u16);
      }
    }
  });
}

constexpr int64_t kAheadTiles = 4;

// Rows m..m+16*Two-1 of x (split, at a) times column tiles b0, b1: into tiles 0, 1 (and 2, 3).
// Per k-tile the two weight tiles are loaded once for the three parts of both row tiles.
template <bool Two>
inline void amx_block(const uint16_t* a, int64_t part, const uint16_t* b0, const uint16_t* b1, int64_t KB) {
  _tile_zero(0);
  _tile_zero(1);
  if (Two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < KB; ++kb) {
    if (kb + kAheadTiles < KB)      // the weights come from memory for the first rows (and in a decode)
      for (int64_t line = 0; line < kTileBf16; line += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(b0 + (kb + kAheadTiles) * kTileBf16 + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b1 + (kb + kAheadTiles) * kTileBf16 + line), _MM_HINT_T0);
      }
    _tile_loadd(4, b0 + kb * kTileBf16, 64);
    _tile_loadd(5, b1 + kb * kTileBf16, 64);
    for (int p = 0; p < 3; ++p) {
      const uint16_t* ap = a + p * part + kb * kTileBf16;
      _tile_loadd(6, ap, 64);
      _tile_dpbf16ps(0, 6, 4);
      _tile_dpbf16ps(1, 6, 5);
      if (Two) {
        _tile_loadd(7, ap + KB * kTileBf16, 64);
        _tile_dpbf16ps(2, 7, 4);
        _tile_dpbf16ps(3, 7, 5);
      }
    }
  }
}

// y = x w^T for rows 0..M-1 (Glu: silu of the even column tiles times the odd ones, w packed
// with 16 gate and 16 up columns per pair of tiles). A work item is one pair of column tiles
// over one chunk of rows: the pair's weights stay in L1 while the chunk's rows pass.
template <bool Glu>
void amx_rows(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t Mp = (M + 15) / 16 * 16, KB = K / 32, part = Mp * K, ldy = Glu ? N / 2 : N;
  static thread_local std::vector<uint16_t> split;
  split.resize(3 * part);
  const uint16_t* a = split.data();
  split_bf16(x, M, K, Mp, split.data());
  // Rows are taken in chunks whose split parts (6 bytes an element) fit in L2 with room to spare,
  // all column pairs of a chunk before the next: the weights pass once a chunk, x's parts stay.
  const int64_t chunk = std::max<int64_t>(32, (1 << 20) / (6 * K) / 32 * 32), pairs = N / 32;
  parallel_for((Mp + chunk - 1) / chunk * pairs, 1, [&](int64_t item) {
    static const TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float tile[4][16 * 16];
    const int64_t c = item % pairs, m0 = item / pairs * chunk;
    const uint16_t* b0 = w + 2 * c * KB * kTileBf16;
    const uint16_t* b1 = b0 + KB * kTileBf16;
    for (int64_t m = m0; m < std::min(Mp, m0 + chunk); m += 32) {
      const bool two = m + 16 < Mp;
      const uint16_t* am = a + m / 16 * KB * kTileBf16;
      if (two) {
        amx_block<true>(am, part, b0, b1, KB);
      } else {
        amx_block<false>(am, part, b0, b1, KB);
      }
      const int64_t rows = std::min<int64_t>(M - m, two ? 32 : 16);
      if (!Glu && rows == 32) {                  // whole tiles straight into y
        float* o = y + m * ldy + 32 * c;
        _tile_stored(0, o, ldy * 4);
        _tile_stored(1, o + 16, ldy * 4);
        _tile_stored(2, o + 16 * ldy, ldy * 4);
        _tile_stored(3, o + 16 * ldy + 16, ldy * 4);
        continue;
      }
      _tile_stored(0, tile[0], 64);
      _tile_stored(1, tile[1], 64);
      if (two) {
        _tile_stored(2, tile[2], 64);
        _tile_stored(3, tile[3], 64);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* g = tile[r / 16 * 2] + r % 16 * 16;
        const float* u = tile[r / 16 * 2 + 1] + r % 16 * 16;
        if (Glu) {
          float* o = y + (m + r) * ldy + 16 * c;
#pragma omp simd
          for (int j = 0; j < 16; ++j) o[j] = silu_times(g[j], u[j]);
        } else {
          float* o = y + (m + r) * ldy + 32 * c;
          std::copy(g, g + 16, o);
          std::copy(u, u + 16, o + 16);
        }
      }
    }
    _tile_release();
  });
}
#endif

// Rows ids[n] of an embedding table in bfloat16 tiles (see above), as float32.
void embed_bf16(const uint16_t* w, const int32_t* ids, float* out, int64_t N, int64_t V, int64_t H) {
  const int64_t KB = H / 32;
  parallel_for(N, 64, [&](int64_t n) {
    float* o = out + n * H;
    const int64_t id = ids[n];
    if (id < 0 || id >= V) {
      std::fill(o, o + H, 0.f);
      return;
    }
    const uint16_t* b = w + id / 16 * KB * kTileBf16 + id % 16 * 2;
    for (int64_t k = 0; k < H; ++k) o[k] = bf16_value(b[k / 32 * kTileBf16 + k % 32 / 2 * 32 + k % 2]);
  });
}

// y = x w^T. Rows of x that are all zeros give zero rows and are not computed: the padding rows
// of a step (worker/runner.py pads with a token id whose embedding is zeros, and the operators
// of bias-free layers keep such rows zero) and of its logits (CpuOps.rows). Trailing zero rows,
// the usual case, are left off in place; zero rows among others are gathered out.
template <typename T, bool Glu, typename Rows>
void linear(const T* x, T* y, int64_t M, int64_t K, int64_t N, Rows&& rows_fn) {
  const int64_t W = Glu ? N / 2 : N;            // columns of y
  std::vector<int64_t> live;
  for (int64_t m = 0; m < M; ++m) {
    const T* r = x + m * K;
    if (std::any_of(r, r + K, [](T v) { return v != T(0); })) live.push_back(m);
  }
  const int64_t L = static_cast<int64_t>(live.size());
  if (L == 0 || live.back() == L - 1) {            // rows 0..L-1 live, the rest zeros
    if (L) rows_fn(x, y, L);
    std::fill(y + L * W, y + M * W, T(0));
    return;
  }
  std::vector<T> xs(L * K), ys(L * W);
  for (int64_t i = 0; i < L; ++i) std::copy(x + live[i] * K, x + (live[i] + 1) * K, xs.data() + i * K);
  rows_fn(xs.data(), ys.data(), L);
  std::fill(y, y + M * W, T(0));
  for (int64_t i = 0; i < L; ++i) std::copy(ys.data() + i * W, ys.data() + (i + 1) * W, y + live[i] * W);
}

// Rows idx[m] of x [N, H]; indices outside [0, N) give zeros.
template <typename T>
void rows_of(const T* x, const int32_t* idx, T* out, int64_t N, int64_t M, int64_t H) {
  for (int64_t m = 0; m < M; ++m) {
    if (idx[m] < 0 || idx[m] >= N) {
      std::fill(out + m * H, out + (m + 1) * H, T(0));
    } else {
      std::copy(x + idx[m] * H, x + (idx[m] + 1) * H, out + m * H);
    }
  }
}

// Rows ids[n] of a panel-major [V, H] table (an embedding that is also the LM head's weight);
// ids outside [0, V) (another rank's vocabulary) give zeros.
template <typename T>
void embed(const T* w, const int32_t* ids, T* out, int64_t N, int64_t V, int64_t H) {
  parallel_for(N, 64, [&](int64_t n) {
    T* o = out + n * H;
    const int64_t id = ids[n];
    if (id < 0 || id >= V) {
      std::fill(o, o + H, T(0));
      return;
    }
    const int64_t col = id / kPanel * kPanel, width = std::min(kPanel, V - col);
    const T* b = w + col * H + (id - col);
    for (int64_t k = 0; k < H; ++k) o[k] = b[k * width];
  });
}

// ---- Mixture of experts --------------------------------------------------------------------
// out [N, H] = sum over j < k of wts[n][j] * expert ids[n][j] (x[n]), over the E experts held
// here (ids first .. first + E - 1; any other id adds nothing). Expert e: y = down(silu(gate x) *
// up x) with w13[e] [2I, H] (LinearGlu panels of gate and up, or with !glu Linear panels of the
// gate rows then the up rows) and w2[e] [H, I] (Linear panels). The (token, expert) pairs are
// grouped by expert and each expert's rows gathered, so an expert's weights pass once for all its
// tokens and a step costs what its routed tokens cost. Zero rows of x (a step's padding) are not
// routed. Each token's k products are summed in float32 in the order of its ids, then rounded.
template <typename T>
void moe(const T* x, const int32_t* ids, const T* wts, const T* w13, const T* w2, T* out, int64_t N, int64_t K,
         int64_t H, int64_t E, int64_t I, int64_t first, bool glu) {
  std::vector<int64_t> start(E + 1, 0), pos(N * K, -1);
  auto local = [&](int64_t n, int64_t j) { return static_cast<int64_t>(ids[n * K + j]) - first; };
  std::vector<char> live(N);
  for (int64_t n = 0; n < N; ++n) {
    const T* r = x + n * H;
    live[n] = std::any_of(r, r + H, [](T v) { return v != T(0); });
    if (!live[n]) continue;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = local(n, j);
      if (e >= 0 && e < E) ++start[e + 1];
    }
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  const int64_t R = start[E];
  std::vector<int64_t> token(R), fill(start.begin(), start.end() - 1);
  for (int64_t n = 0; n < N; ++n) {
    if (!live[n]) continue;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = local(n, j);
      if (e < 0 || e >= E) continue;
      pos[n * K + j] = fill[e];
      token[fill[e]++] = n;
    }
  }
  std::vector<T> xs(R * H), hs(R * I), ys(R * H), gu(glu ? 0 : R * 2 * I);
  parallel_for(R, 16, [&](int64_t r) { std::copy(x + token[r] * H, x + (token[r] + 1) * H, xs.data() + r * H); });
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = start[e], m = start[e + 1] - s;
    if (m == 0) continue;
    const T* wg = w13 + e * 2 * I * H;
    if (glu) {
      linear_rows<T, true>(xs.data() + s * H, wg, hs.data() + s * I, m, H, 2 * I);
    } else {
      linear_rows<T, false>(xs.data() + s * H, wg, gu.data() + s * 2 * I, m, H, 2 * I);
      silu_mul(gu.data() + s * 2 * I, hs.data() + s * I, m, I);
    }
    linear_rows<T, false>(hs.data() + s * I, w2 + e * H * I, ys.data() + s * H, m, I, H);
  }
  parallel_for(N, 16, [&](int64_t n) {
    T* o = out + n * H;
    std::vector<float> acc(H, 0.f);
    for (int64_t j = 0; j < K; ++j) {
      const int64_t r = pos[n * K + j];
      if (r < 0) continue;
      const float w = static_cast<float>(wts[n * K + j]);
      const T* y = ys.data() + r * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) acc[h] += w * static_cast<float>(y[h]);
    }
    for (int64_t h = 0; h < H; ++h) o[h] = static_cast<T>(acc[h]);
  });
}

int64_t numel(int nd, const int64_t* shape) {
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) n *= shape[i];
  return n;
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

}  // namespace

extern "C" int PagedAttention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                              void* stream, void* extra) {
  if (nparam != 14 || ndims[0] != 2 || ndims[6] != 2 || ndims[9] != 2 || ndims[13] != 2 || shapes[12][0] != 2 ||
      shapes[3][0] != 2)
    return 1;
  const int32_t* meta = static_cast<const int32_t*>(params[12]);
  const float* norm = static_cast<const float*>(params[3]);
  const int64_t N = shapes[0][0], D = shapes[6][1], MB = shapes[9][1], bs = meta[0], KV = meta[1];
  const int64_t H = D > 0 ? shapes[13][1] / D : 0;
  if (bs <= 0 || KV <= 0 || H <= 0 || H % KV != 0 || shapes[0][1] != (H + 2 * KV) * D || shapes[4][1] * 2 != D)
    return 2;
  auto i32 = [&](int i) { return static_cast<const int32_t*>(params[i]); };
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    auto in = [&](int i) { return static_cast<T*>(params[i]); };
    attend<T>(in(0), norm[1] != 0.f ? in(1) : nullptr, in(2), norm[0], in(4), in(5), in(6), in(7), i32(8), i32(9),
              i32(10), i32(11), in(13), N, H, D, KV, MB, bs);
  });
  return 0;
}

// x [..., H], w [H], eps [1] float32 -> [..., H]
extern "C" int RmsNorm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                       void* extra) {
  if (nparam != 4 || ndims[0] < 1) return 1;
  const int64_t H = shapes[0][ndims[0] - 1], rows = numel(ndims[0], shapes[0]) / std::max<int64_t>(H, 1);
  const float eps = *static_cast<const float*>(params[2]);
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    rms_norm(static_cast<const T*>(params[0]), static_cast<const T*>(params[1]), eps, static_cast<T*>(params[3]),
             rows, H);
  });
  return 0;
}

// [N, 2I] (gate | up) -> [N, I]
extern "C" int SiluMul(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                       void* extra) {
  if (nparam != 2 || ndims[0] != 2 || shapes[0][1] % 2) return 1;
  const int64_t N = shapes[0][0], I = shapes[0][1] / 2;
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    silu_mul(static_cast<const T*>(params[0]), static_cast<T*>(params[1]), N, I);
  });
  return 0;
}

// The entry points of Linear and LinearGlu: params x [M, K], w [N, K], y. w is float32 or float16
// in panels, or int16: bfloat16 in AMX tiles (x float32).
template <bool Glu>
int linear_entry(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 2 || shapes[0][1] != shapes[1][1] || (Glu && shapes[1][0] % kPanel))
    return 1;
  const int64_t M = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  if (std::strcmp(dtypes[1], "int16") == 0) {
#ifdef MSINFER_AMX
    if (std::strcmp(dtypes[0], "float32") != 0 || K % 32 || N % 32 || !amx_permitted()) return 2;
    const uint16_t* w = static_cast<const uint16_t*>(params[1]);
    linear<float, Glu>(static_cast<const float*>(params[0]), static_cast<float*>(params[2]), M, K, N,
                       [&](const float* xs, float* ys, int64_t L) { amx_rows<Glu>(xs, w, ys, L, K, N); });
    return 0;
#else
    return 2;
#endif
  }
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    const T* w = static_cast<const T*>(params[1]);
    linear<T, Glu>(static_cast<const T*>(params[0]), static_cast<T*>(params[2]), M, K, N,
                   [&](const T* xs, T* ys, int64_t L) { linear_rows<T, Glu>(xs, w, ys, L, K, N); });
  });
  return 0;
}

// x [N, H], ids [N, k] int32, weights [N, k], w13 [E, 2I, H], w2 [E, H, I] (panels, see moe),
// meta [2] int32 (first expert held, glu) -> [N, H]
extern "C" int MoeExperts(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                          void* extra) {
  if (nparam != 7 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 3 || ndims[4] != 3) return 1;
  const int64_t N = shapes[0][0], H = shapes[0][1], K = shapes[1][1], E = shapes[3][0], I = shapes[4][2];
  const int32_t* meta = static_cast<const int32_t*>(params[5]);
  const bool glu = meta[1] != 0;
  if (shapes[1][0] != N || shapes[2][0] != N || shapes[2][1] != K || shapes[3][1] != 2 * I || shapes[3][2] != H ||
      shapes[4][0] != E || shapes[4][1] != H || (glu && (2 * I) % kPanel) || std::strcmp(dtypes[1], "int32") ||
      std::strcmp(dtypes[0], dtypes[3]) || std::strcmp(dtypes[0], dtypes[4]) || std::strcmp(dtypes[0], dtypes[2]))
    return 2;
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    auto in = [&](int i) { return static_cast<const T*>(params[i]); };
    moe<T>(in(0), static_cast<const int32_t*>(params[1]), in(2), in(3), in(4), static_cast<T*>(params[6]), N, K, H,
           E, I, meta[0], glu);
  });
  return 0;
}

// x [M, K], w [N, K] panel-major -> [M, N]
extern "C" int Linear(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                      void* extra) {
  return linear_entry<false>(nparam, params, ndims, shapes, dtypes);
}

// x [M, K], w [2I, K] panel-major with gate and up interleaved 16 columns at a time -> silu(x gate^T)
// * (x up^T) [M, I]: the MLP's gate/up projection and its activation in one pass
extern "C" int LinearGlu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                         void* extra) {
  return linear_entry<true>(nparam, params, ndims, shapes, dtypes);
}

// w [V, H] panel-major (or int16: bfloat16 tiles, giving float32), ids [N] int32 -> [N, H]
extern "C" int Embed(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                     void* extra) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 1) return 1;
  if (std::strcmp(dtypes[0], "int16") == 0) {                  // bfloat16 tiles -> float32
    if (shapes[0][0] % 32 || shapes[0][1] % 32) return 2;
    embed_bf16(static_cast<const uint16_t*>(params[0]), static_cast<const int32_t*>(params[1]),
               static_cast<float*>(params[2]), shapes[1][0], shapes[0][0], shapes[0][1]);
    return 0;
  }
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    embed(static_cast<const T*>(params[0]), static_cast<const int32_t*>(params[1]), static_cast<T*>(params[2]),
          shapes[1][0], shapes[0][0], shapes[0][1]);
  });
  return 0;
}

// x [N, H], idx [M] int32 -> [M, H]
extern "C" int Rows(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                    void* extra) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 1) return 1;
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    rows_of(static_cast<const T*>(params[0]), static_cast<const int32_t*>(params[1]), static_cast<T*>(params[2]),
            shapes[0][0], shapes[1][0], shapes[0][1]);
  });
  return 0;
}

// Whether Linear and Embed take bfloat16 weights in AMX tiles (int16): the library was built for a
// CPU with AMX and the kernel lets this process use it.
extern "C" int AmxReady() {
#ifdef MSINFER_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// How many threads the kernels use, the caller's included (the worker's MindSpore thread count).
extern "C" void SetThreads(int threads) { g_threads = std::max(1, threads); }
