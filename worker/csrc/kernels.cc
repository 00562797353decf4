// The CPU kernels of msinfer's network, MindSpore AOT custom operators (mindspore.ops.Custom,
// func_type="aot"), built on first use by worker/ops.py. Each takes float32 or float16 and
// computes in float32:
//   PagedAttention  softmax(q K^T / sqrt(D)) V over each token's context, read through the block
//                   tables straight from the KV cache (no gathered copy, no mask)
//   RmsNorm         x * rsqrt(mean(x^2) + eps) * w over the last dimension
//   Rotary          rotate_half rotary embedding (the Hugging Face, non-interleaved layout)
//   SiluMul         silu(gate) * up of a merged [gate | up] projection
// One kernel call replaces the 5-10 MindSpore operators of each, which on the CPU cost a launch
// apiece, an explicit broadcast (see worker/ops.py) and a compile step per graph.
//
// Work is shared by a small pool of threads that sleep between calls (SetThreads sets how many,
// the caller's included): OpenMP's spinning workers would steal the cores from the MindSpore
// kernels that run next (a decode step was 45% slower with them).
//
// PagedAttention, inputs in order:
//   q        [N, H, D]       query heads of N tokens (float32 or float16)
//   k_cache  [S * KV, D]     the layer's cache, row slot * KV + kv_head
//   v_cache  [S * KV, D]
//   tables   [M, MB] int32   block table of each sequence in the step
//   rows     [N] int32       which table row (sequence) each token belongs to
//   lens     [N] int32       how many positions of its sequence each token sees (0: padding)
//   meta     [2] int32       block size, KV heads
// Output:
//   out      [N, H, D]       softmax(q K^T / sqrt(D)) V, zeros for padding tokens
// Query heads sharing a KV head (grouped-query attention) are computed together, so each K/V row
// is read once per token and KV head.
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

// glibc's vector expf (libmvec), which math.h declares only under -ffast-math; with this the
// exp loops below vectorize.
#pragma omp declare simd notinbranch
extern "C" float expf(float);

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

int g_threads = 1;

// fn(i) for i in [0, n) on up to g_threads threads, one more thread per `grain` items (smaller
// calls are not worth waking a helper for).
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t)>& fn) {
  Pool::get().run(n, static_cast<int>(std::min<int64_t>(g_threads, std::max<int64_t>(1, n / grain))), fn);
}

// Softmax over each of `rows` score rows of length len (row r at s + r * len), in place.
inline void softmax_rows(float* s, int64_t rows, int64_t len) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * len;
    float m = sr[0];
    for (int64_t j = 1; j < len; ++j) m = std::max(m, sr[j]);
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
// irregular for the hardware prefetcher: ask for the row kAhead positions on.
constexpr int64_t kAhead = 8;

inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}

typedef float v16 __attribute__((vector_size(64)));   // 16 float lanes (GCC vector extension)

template <typename T>
inline v16 load16(const T* p) {
  v16 x;
  for (int u = 0; u < 16; ++u) x[u] = static_cast<float>(p[u]);
  return x;
}

inline void store16(float* o, v16 x) { std::memcpy(o, &x, sizeof(x)); }

template <typename T>
struct PagedAttention {
  static constexpr int64_t QT = 16;   // query tokens of one sequence computed together (a prefill tile)

  const T *q, *kc, *vc;
  const int32_t *tables, *rows, *lens;
  T* out;
  int64_t N, H, D, KV, MB, bs, G;
  float scale;

  // Cache rows (K; V at the same offset) of positions 0..len-1 of token n's sequence, KV head h.
  void key_rows(int64_t n, int64_t h, int64_t len, std::vector<const T*>& krow) const {
    const int32_t* table = tables + static_cast<int64_t>(rows[n]) * MB;
    krow.resize(len);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t slot = static_cast<int64_t>(table[j / bs]) * bs + j % bs;
      krow[j] = kc + (slot * KV + h) * D;
    }
  }

  // One token (a decode step's): its G query heads of KV head h over its `len` positions.
  void one(int64_t n, int64_t h) const {
    thread_local std::vector<float> qv, acc, s;
    thread_local std::vector<const T*> krow;
    T* o = out + (n * H + h * G) * D;
    const int64_t len = lens[n];
    if (len <= 0) {
      std::fill(o, o + G * D, T(0));
      return;
    }
    qv.resize(G * D);
    acc.assign(G * D, 0.f);
    s.resize(G * len);
    for (int64_t i = 0; i < G * D; ++i) qv[i] = static_cast<float>(q[(n * H + h * G) * D + i]) * scale;
    key_rows(n, h, len, krow);
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
    for (int64_t j = 0; j < len; ++j) {
      const T* k = krow[j];
      if (j + kAhead < len) prefetch(krow[j + kAhead], row_bytes);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qv.data() + g * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(k[d]);
        s[g * len + j] = dot;
      }
    }
    softmax_rows(s.data(), G, len);
    const std::ptrdiff_t voff = vc - kc;
    for (int64_t j = 0; j < len; ++j) {
      const T* v = krow[j] + voff;
      if (j + kAhead < len) prefetch(krow[j + kAhead] + voff, row_bytes);
      for (int64_t g = 0; g < G; ++g) {
        const float w = s[g * len + j];
        float* a = acc.data() + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<float>(v[d]);
      }
    }
    for (int64_t i = 0; i < G * D; ++i) o[i] = static_cast<T>(acc[i]);
  }

  // count (<= QT) consecutive tokens n0.. of one sequence at consecutive positions (a prefill
  // chunk), KV head h: each K row is read once for all of them, and the scores accumulate
  // across the tokens (16 lanes of one vector) rather than along D, so no horizontal sums.
  void tile(int64_t n0, int64_t count, int64_t h) const {
    thread_local std::vector<v16> qt, s;            // qt [g][d], s [g][j]: 16 tokens a vector
    thread_local std::vector<const T*> krow;
    const int64_t len = lens[n0 + count - 1];        // the last token sees the most
    int64_t tok_len[QT];
    for (int64_t i = 0; i < QT; ++i) tok_len[i] = i < count ? lens[n0 + i] : 0;
    qt.assign(G * D, v16{});
    for (int64_t i = 0; i < count; ++i) {            // each token's query rows, read in order
      const T* qi = q + ((n0 + i) * H + h * G) * D;
      for (int64_t e = 0; e < G * D; ++e) qt[e][i] = static_cast<float>(qi[e]) * scale;
    }
    key_rows(n0, h, len, krow);
    s.resize(G * len);
    for (int64_t g = 0; g < G; ++g) {
      const v16* qg = qt.data() + g * D;
      v16* sg = s.data() + g * len;
      int64_t j = 0;
      for (; j + 4 <= len; j += 4) {                 // four keys: four independent FMA chains
        v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
        const T *k0 = krow[j], *k1 = krow[j + 1], *k2 = krow[j + 2], *k3 = krow[j + 3];
        for (int64_t d = 0; d < D; ++d) {
          a0 += qg[d] * static_cast<float>(k0[d]);
          a1 += qg[d] * static_cast<float>(k1[d]);
          a2 += qg[d] * static_cast<float>(k2[d]);
          a3 += qg[d] * static_cast<float>(k3[d]);
        }
        sg[j] = a0;
        sg[j + 1] = a1;
        sg[j + 2] = a2;
        sg[j + 3] = a3;
      }
      for (; j < len; ++j) {
        v16 a0 = {};
        for (int64_t d = 0; d < D; ++d) a0 += qg[d] * static_cast<float>(krow[j][d]);
        sg[j] = a0;
      }
      // softmax of each token (lane) over its own keys j < tok_len[i]
      float m[QT], sum[QT];
      for (int64_t i = 0; i < QT; ++i) m[i] = -3.0e38f, sum[i] = 0.f;
      for (int64_t jj = 0; jj < len; ++jj)
        for (int64_t i = 0; i < QT; ++i)
          if (jj < tok_len[i]) m[i] = std::max(m[i], sg[jj][i]);
      for (int64_t jj = 0; jj < len; ++jj) {
        float e[QT];
#pragma omp simd
        for (int64_t i = 0; i < QT; ++i) e[i] = jj < tok_len[i] ? expf(sg[jj][i] - m[i]) : 0.f;
        for (int64_t i = 0; i < QT; ++i) {
          sg[jj][i] = e[i];
          sum[i] += e[i];
        }
      }
      for (int64_t i = 0; i < count; ++i) sum[i] = 1.f / sum[i];
      for (int64_t jj = 0; jj < len; ++jj)
        for (int64_t i = 0; i < count; ++i) sg[jj][i] *= sum[i];
    }
    // P V, token by token over its own keys only, 32 output lanes at a time held in registers
    const std::ptrdiff_t voff = vc - kc;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < count; ++i) {
        const v16* p = s.data() + g * len;
        T* o = out + ((n0 + i) * H + h * G + g) * D;
        for (int64_t c = 0; c < D; c += 32) {
          const int64_t width = std::min<int64_t>(32, D - c);
          alignas(64) float a[32] = {};
          if (width == 32) {                         // even and odd keys: four FMA chains
            v16 e0 = {}, e1 = {}, o0 = {}, o1 = {};
            int64_t j = 0;
            for (; j + 2 <= tok_len[i]; j += 2) {
              const T* v = krow[j] + voff + c;
              const T* u = krow[j + 1] + voff + c;
              e0 += p[j][i] * load16(v);
              e1 += p[j][i] * load16(v + 16);
              o0 += p[j + 1][i] * load16(u);
              o1 += p[j + 1][i] * load16(u + 16);
            }
            if (j < tok_len[i]) {
              const T* v = krow[j] + voff + c;
              e0 += p[j][i] * load16(v);
              e1 += p[j][i] * load16(v + 16);
            }
            store16(a, e0 + o0);
            store16(a + 16, e1 + o1);
          } else {
            for (int64_t j = 0; j < tok_len[i]; ++j) {
              const T* v = krow[j] + voff + c;
              for (int64_t u = 0; u < width; ++u) a[u] += p[j][i] * static_cast<float>(v[u]);
            }
          }
          for (int64_t u = 0; u < width; ++u) o[c + u] = static_cast<T>(a[u]);
        }
      }
  }

  void run() const {
    // Work items: runs of up to QT consecutive tokens of one sequence at consecutive positions
    // (tiles), or single tokens, each with one KV head.
    std::vector<int64_t> start;
    for (int64_t n = 0; n < N; ++n) {
      const bool joins = n > 0 && lens[n] > 1 && rows[n] == rows[n - 1] && lens[n] == lens[n - 1] + 1 &&
                         n - start.back() < QT;
      if (!joins) start.push_back(n);
    }
    start.push_back(N);
    const int64_t items = static_cast<int64_t>(start.size() - 1);
    parallel_for(items * KV, 1, [&](int64_t item) {
      const int64_t t = item / KV, h = item % KV, n0 = start[t], count = start[t + 1] - n0;
      if (count >= 4 && lens[n0] > 0) {
        tile(n0, count, h);
      } else {
        for (int64_t n = n0; n < n0 + count; ++n) one(n, h);
      }
    });
  }
};

template <typename T>
void attend(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* rows,
            const int32_t* lens, T* out, int64_t N, int64_t H, int64_t D, int64_t KV, int64_t MB,
            int64_t bs) {
  PagedAttention<T>{q, kc, vc, tables, rows, lens, out, N, H, D, KV, MB, bs, H / KV,
                    1.0f / std::sqrt(static_cast<float>(D))}.run();
}

template <typename T>
void rms_norm(const T* x, const T* w, float eps, T* out, int64_t rows, int64_t H) {
  parallel_for(rows, 64, [&](int64_t r) {
    const T* xr = x + r * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    T* o = out + r * H;
#pragma omp simd
    for (int64_t i = 0; i < H; ++i)   // rounded to T before the weight, as Hugging Face does
      o[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(static_cast<float>(xr[i]) * inv)));
  });
}

template <typename T>
void rotary(const T* x, const T* cos, const T* sin, T* out, int64_t N, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  parallel_for(N, 64, [&](int64_t n) {
    const T* c = cos + n * half;
    const T* s = sin + n * half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + (n * heads + h) * D;
      T* o = out + (n * heads + h) * D;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = static_cast<float>(xr[i]), x2 = static_cast<float>(xr[i + half]);
        const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
        o[i] = static_cast<T>(x1 * ci - x2 * si);
        o[i + half] = static_cast<T>(x2 * ci + x1 * si);
      }
    }
  });
}

template <typename T>
void silu_mul(const T* x, T* out, int64_t N, int64_t I) {
  parallel_for(N, 16, [&](int64_t n) {
    const T* g = x + n * 2 * I;
    const T* u = g + I;
    T* o = out + n * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) {
      const float a = static_cast<float>(g[i]);
      o[i] = static_cast<T>(static_cast<float>(static_cast<T>(a / (1.f + expf(-a)))) * static_cast<float>(u[i]));
    }
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
  if (nparam != 8 || ndims[0] != 3 || ndims[1] != 2 || ndims[3] != 2 || shapes[6][0] != 2) return 1;
  const int64_t N = shapes[0][0], H = shapes[0][1], D = shapes[0][2], MB = shapes[3][1];
  const int32_t* meta = static_cast<const int32_t*>(params[6]);
  const int64_t bs = meta[0], KV = meta[1];
  if (bs <= 0 || KV <= 0 || H % KV != 0 || shapes[1][1] != D) return 2;
  const auto* tables = static_cast<const int32_t*>(params[3]);
  const auto* rows = static_cast<const int32_t*>(params[4]);
  const auto* lens = static_cast<const int32_t*>(params[5]);
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    attend(static_cast<const T*>(params[0]), static_cast<const T*>(params[1]), static_cast<const T*>(params[2]),
           tables, rows, lens, static_cast<T*>(params[7]), N, H, D, KV, MB, bs);
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

// x [N, heads, D], cos [N, D/2], sin [N, D/2] -> [N, heads, D]
extern "C" int Rotary(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                      void* extra) {
  if (nparam != 4 || ndims[0] != 3 || ndims[1] != 2 || shapes[1][1] * 2 != shapes[0][2]) return 1;
  const int64_t N = shapes[0][0], heads = shapes[0][1], D = shapes[0][2];
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    rotary(static_cast<const T*>(params[0]), static_cast<const T*>(params[1]), static_cast<const T*>(params[2]),
           static_cast<T*>(params[3]), N, heads, D);
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

// How many threads the kernels use, the caller's included (the worker's MindSpore thread count).
extern "C" void SetThreads(int threads) { g_threads = std::max(1, threads); }
