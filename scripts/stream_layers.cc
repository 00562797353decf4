// The demo model's 120 linear layers at M rows (scripts/measure_bf16.py's shapes) through the
// kernel library's own pair micro-kernel (micro_dot, VDPBF16PS) and its prefetches, with none of
// the library's glue: two threads, each held to its run of panels of every matmul, a spin barrier
// after each matmul, x rounded once and read by both. What the micro-kernel reaches over the
// weights' stream on this machine, for scripts/measure_bf16.py's Linear calls to be set against.
// Built and run by scripts/measure_stream.py.
//
//   stream_layers ROWS ROUNDS
//
// Each round: the weights from memory in 2 MB pages (each kind's 30 layers one stack, as the
// workers' DecoderStack holds them), the same in 4 KB pages, and one layer's weights for all 30
// (in cache); the best of 5 passes each, in ms and GFLOP/s.
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "../worker/csrc/matmul.h"

namespace {

#ifdef MSINFER_BF16_DOT
constexpr int64_t kLayers = 30;
// N, K of qkv, o, gate/up (its activation left out: its product alone) and down
constexpr int64_t kShapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};

struct Matmul {
  const uint32_t* w;       // [N / 32 panels][K2][32] words
  int64_t panels, K2;
};

// Rows a thread's run of panels of m: the groups of rows and the prefetches as panel_items takes
// them (the next panel's share a group, the run's first panel asked for 4 KB ahead by its first
// group), into c [M][32] (the results are not kept).
void run(const Matmul& m, int t, const uint32_t* x, int64_t M, float* c) {
  const int64_t panel_bytes = m.K2 * kPanel * 4, groups = (M + kRowsPairs - 1) / kRowsPairs;
  const int64_t p0 = m.panels * t / 2, p1 = m.panels * (t + 1) / 2;
  const int64_t share = (panel_bytes + groups - 1) / groups;
  for (int64_t p = p0; p < p1; ++p) {
    const uint32_t* b = m.w + p * m.K2 * kPanel;
    const char* bytes = reinterpret_cast<const char*>(b);
    for (int64_t r0 = 0, g = 0; r0 < M; ++g) {
      const int64_t r = M / groups + (g < M % groups);
      const char* pf = bytes + panel_bytes + g * share;
      int64_t step = (share + m.K2 - 1) / m.K2;
      if (p + 1 >= p1) step = 0;
      if (p == p0 && g == 0) pf = bytes + 4096, step = kPanel * 4;
      with_count<kRowsPairs>(r, [&](auto rows) {
        micro_dot<float, rows, false>(x + r0 * m.K2, m.K2, b, m.K2, c + r0 * kPanel, kPanel, pf, step, groups > 1);
      });
      r0 += r;
    }
  }
}

// Seconds of the best of `passes` passes over `matmuls`, both threads.
double timed(const std::vector<Matmul>& matmuls, const uint32_t* x, int64_t M, int passes) {
  std::atomic<int> arrived{0}, phase{0};
  auto barrier = [&](int& mine) {
    mine ^= 1;
    if (arrived.fetch_add(1) == 1) {
      arrived.store(0);
      phase.store(mine);
    } else {
      while (phase.load() != mine) _mm_pause();
    }
  };
  double best = 1e30;
  int phases[2] = {0, 0};                 // each thread's side of the barrier, kept from pass to pass
  for (int pass = 0; pass < passes; ++pass) {
    double seconds = 0;
    // timed by thread 0 from a first barrier (the helper started) to the last matmul's
    auto work = [&](int t) {
      std::vector<float> c(M * kPanel);
      int& mine = phases[t];
      barrier(mine);
      const auto t0 = std::chrono::steady_clock::now();
      for (const Matmul& m : matmuls) {
        run(m, t, x, M, c.data());
        barrier(mine);
      }
      if (t == 0) seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    std::thread helper(work, 1);
    work(0);
    helper.join();
    best = std::min(best, seconds);
  }
  return best;
}
#endif

}  // namespace

int main(int argc, char** argv) {
#ifndef MSINFER_BF16_DOT
  std::fprintf(stderr, "stream_layers: this CPU (or -march) has no AVX512-BF16: nothing to measure\n");
  return 2;
#else
  const int64_t M = argc > 1 ? std::atoll(argv[1]) : 16;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  if (M < 1 || M > kRowBlockPairs || rounds < 1) {
    std::fprintf(stderr, "stream_layers: ROWS must be 1 to %ld and ROUNDS 1 or more\n", static_cast<long>(kRowBlockPairs));
    return 2;
  }
  // the stacks, in memory advised into 2 MB pages and in memory advised against them
  int64_t words = 0;
  for (const auto& s : kShapes) words += kLayers * s[0] * ((s[1] + 1) / 2);
  const size_t bytes = (words * 4 + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  std::vector<Matmul> layers[2], cached;
  for (int small = 0; small < 2; ++small) {
    auto* w = static_cast<uint32_t*>(std::aligned_alloc(2 << 20, bytes));
    if (w == nullptr || madvise(w, bytes, small ? MADV_NOHUGEPAGE : MADV_HUGEPAGE) != 0) {
      std::fprintf(stderr, "stream_layers: no memory for the weights, or Linux refused the advice on its pages\n");
      return 1;
    }
    uint32_t v = 1;                       // small bfloat16 pairs, as a checkpoint's weights are
    for (int64_t i = 0; i < words; ++i) v = v * 1664525u + 1013904223u, w[i] = (v & 0x807f807fu) | 0x3c003c00u;
    int64_t at[4], off = 0;
    for (int k = 0; k < 4; ++k) at[k] = off, off += kLayers * kShapes[k][0] * ((kShapes[k][1] + 1) / 2);
    for (int64_t l = 0; l < kLayers; ++l)
      for (int k = 0; k < 4; ++k) {
        const int64_t N = kShapes[k][0], K2 = (kShapes[k][1] + 1) / 2;
        layers[small].push_back({w + at[k] + l * N * K2, N / kPanel, K2});
      }
  }
  for (int64_t l = 0; l < kLayers; ++l)
    for (int k = 0; k < 4; ++k) cached.push_back(layers[0][k]);
  std::vector<uint32_t> x(M * 768, 0x3c003c00u);
  double flops = 0;
  for (const auto& s : kShapes) flops += 2.0 * M * s[0] * s[1] * kLayers;
  std::printf("%ld rows, 2 threads, the library's micro_dot without its glue\n", static_cast<long>(M));
  for (int r = 0; r < rounds; ++r) {
    const double huge = timed(layers[0], x.data(), M, 5), small = timed(layers[1], x.data(), M, 5),
                 cache = timed(cached, x.data(), M, 5);
    std::printf("round %d: from memory in 2 MB pages %.2f ms (%.0f GFLOP/s), in 4 KB pages %.2f ms (%.0f), "
                "in cache %.2f ms (%.0f)\n", r + 1, huge * 1e3, flops / huge / 1e9, small * 1e3, flops / small / 1e9,
                cache * 1e3, flops / cache / 1e9);
  }
  return 0;
#endif
}
