// Paged attention for the CPU: each query token attends over the first `len` positions of its
// sequence, read straight from the KV cache through the sequence's block table. No gathered copy
// of K/V, no mask tensor: the work is what the real context costs.
//
// A MindSpore AOT custom operator (mindspore.ops.Custom, func_type="aot"). Inputs, in order:
//   q        [N, H, D]       query heads of N tokens (float32 or float16)
//   k_cache  [S * KV, D]     the layer's cache, row slot * KV + kv_head
//   v_cache  [S * KV, D]
//   tables   [M, MB] int32   block table of each sequence in the step
//   rows     [N] int32       which table row (sequence) each token belongs to
//   lens     [N] int32       how many positions of its sequence each token sees (0: padding)
//   meta     [3] int32       block size, KV heads, threads (0: every core)
// Output:
//   out      [N, H, D]       softmax(q K^T / sqrt(D)) V, zeros for padding tokens
// Query heads sharing a KV head (grouped-query attention) are computed together, so each K/V row
// is read once per token and KV head. Work items (token, KV head) are shared by a small pool of
// threads that sleep between calls: OpenMP's spinning workers would steal the cores from the
// MindSpore kernels that run next (a decode step was 45% slower with them).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// fn(i) for i in [0, n) on `threads` threads, the caller's among them. Helpers are started on
// first need and kept; between calls they wait on a condition variable.
class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }

  void run(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> call(call_);
    const int helpers = static_cast<int>(std::min<int64_t>(threads, n)) - 1;
    if (helpers <= 0) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::unique_lock<std::mutex> lock(m_);
    while (static_cast<int>(workers_.size()) < helpers) {
      const int id = static_cast<int>(workers_.size());
      workers_.emplace_back([this, id] { loop(id); });
    }
    task_ = &fn;
    n_ = n;
    next_ = 0;
    wanted_ = helpers;
    finished_ = 0;
    ++generation_;
    lock.unlock();
    wake_.notify_all();
    drain();
    lock.lock();
    done_.wait(lock, [this] { return finished_ == wanted_; });
    task_ = nullptr;
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  void drain() {
    for (int64_t i; (i = next_.fetch_add(1)) < n_;) (*task_)(i);
  }

  void loop(int id) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || (generation_ != seen && id < wanted_); });
      if (stop_) return;
      seen = generation_;
      lock.unlock();
      drain();
      lock.lock();
      if (++finished_ == wanted_) done_.notify_one();
    }
  }

  std::mutex call_, m_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* task_ = nullptr;
  std::atomic<int64_t> next_{0};
  int64_t n_ = 0;
  uint64_t generation_ = 0;
  int wanted_ = 0, finished_ = 0;
  bool stop_ = false;
};

template <typename T>
void attend(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* rows,
            const int32_t* lens, T* out, int64_t N, int64_t H, int64_t D, int64_t KV, int64_t MB,
            int64_t bs, int threads) {
  const int64_t G = H / KV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  Pool::get().run(N * KV, threads, [&](int64_t item) {
    thread_local std::vector<float> qv, acc, s;
    thread_local std::vector<const T*> krow;
    qv.resize(G * D);
    acc.resize(G * D);
    const int64_t n = item / KV, h = item % KV;
    T* o = out + (n * H + h * G) * D;
    const int64_t len = lens[n];
    if (len <= 0) {
      std::fill(o, o + G * D, T(0));
      return;
    }
    const int32_t* table = tables + static_cast<int64_t>(rows[n]) * MB;
    for (int64_t i = 0; i < G * D; ++i) qv[i] = static_cast<float>(q[(n * H + h * G) * D + i]) * scale;
    s.resize(G * len);
    krow.resize(len);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t slot = static_cast<int64_t>(table[j / bs]) * bs + j % bs;
      krow[j] = kc + (slot * KV + h) * D;   // the V row has the same offset in v_cache
    }
    for (int64_t j = 0; j < len; ++j) {
      const T* k = krow[j];
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qv.data() + g * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(k[d]);
        s[g * len + j] = dot;
      }
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s.data() + g * len;
      float m = sg[0];
      for (int64_t j = 1; j < len; ++j) m = std::max(m, sg[j]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < len; ++j) {
        sg[j] = std::exp(sg[j] - m);
        sum += sg[j];
      }
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) sg[j] *= inv;
    }
    const std::ptrdiff_t voff = vc - kc;
    for (int64_t j = 0; j < len; ++j) {
      const T* v = krow[j] + voff;
      for (int64_t g = 0; g < G; ++g) {
        const float w = s[g * len + j];
        float* a = acc.data() + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<float>(v[d]);
      }
    }
    for (int64_t i = 0; i < G * D; ++i) o[i] = static_cast<T>(acc[i]);
  });
}

}  // namespace

extern "C" int PagedAttention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                              void* stream, void* extra) {
  if (nparam != 8 || ndims[0] != 3 || ndims[1] != 2 || ndims[3] != 2 || shapes[6][0] != 3) return 1;
  const int64_t N = shapes[0][0], H = shapes[0][1], D = shapes[0][2], MB = shapes[3][1];
  const int32_t* meta = static_cast<const int32_t*>(params[6]);
  const int64_t bs = meta[0], KV = meta[1];
  const int threads = meta[2] > 0 ? meta[2] : static_cast<int>(std::thread::hardware_concurrency());
  if (bs <= 0 || KV <= 0 || H % KV != 0 || shapes[1][1] != D) return 2;
  const auto* tables = static_cast<const int32_t*>(params[3]);
  const auto* rows = static_cast<const int32_t*>(params[4]);
  const auto* lens = static_cast<const int32_t*>(params[5]);
  if (std::strcmp(dtypes[0], "float16") == 0) {
    using T = _Float16;
    attend(static_cast<const T*>(params[0]), static_cast<const T*>(params[1]), static_cast<const T*>(params[2]),
           tables, rows, lens, static_cast<T*>(params[7]), N, H, D, KV, MB, bs, threads);
  } else {
    using T = float;
    attend(static_cast<const T*>(params[0]), static_cast<const T*>(params[1]), static_cast<const T*>(params[2]),
           tables, rows, lens, static_cast<T*>(params[7]), N, H, D, KV, MB, bs, threads);
  }
  return 0;
}
