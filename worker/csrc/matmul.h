// Matmuls over packed weights: float32/float16 column panels, bfloat16 AMX tiles, the embedding
// lookups over the same tables, and the rows-by-index gather.

#pragma once

#include <immintrin.h>

#include "common.h"

namespace {

// ---- Linear: y [M, N] = x [M, K] w^T ------------------------------------------------------
// w keeps its [N, K] shape but is stored panel-major (worker/cpu.py CpuOps.pack): the columns
// p*32 .. p*32+31 of y come from panel p, K rows of 32 weights ([K][width] for a last, narrower
// panel). A micro-kernel keeps kRows x 32 outputs in registers (28 of the 32 vector registers)
// over the whole of K: per k, two panel loads and kRows broadcasts of x feed 2 * kRows FMAs.
// Rows are taken kRowBlock at a time so that their x stays in cache while every panel passes.
// kRows is what the CPU's vector registers hold: 14 rows x 2 accumulators on AVX-512 (32 zmm);
// with AVX2's 16 ymm a 16-lane vector takes two, and 3 rows (12 ymm of accumulators, 4 for the
// panel) is the most that stays in registers (14 spilled: a 2,048-token prefill of the demo
// model took 127 s instead of a few). On AVX2 a matmul of more than 3 rows takes each panel in
// halves instead (micro_half).
#ifdef __AVX512F__
constexpr int64_t kRows = 14;
constexpr int kHalves = 1;
#else
constexpr int64_t kRows = 3;
constexpr int kHalves = 2;      // (for more than kRows rows: micro_half)
#endif
constexpr int64_t kPanel = 32, kRowBlock = 9 * kRows;

constexpr int kVecs = kPanel / kLanes;   // per panel row
// a vector's 32-bit words (bfloat16 pairs, split or widened by shifts and masks)
typedef uint32_t vregw __attribute__((vector_size(sizeof(vreg))));
typedef uint32_t vregwu __attribute__((vector_size(sizeof(vreg)), aligned(4)));

// A bfloat16 panel row on AVX-512 as one 64-byte load: a 32-bit lane j holds columns 2j (low
// half) and 2j+1, so a shift by 16 gives the even columns as float32 and an AND the odd ones.
// Against two 32-byte loads each widened by vpmovzxwd and a shift, that is two vector
// operations a k step instead of four: on a Zen 4 core (512-bit operations in two halves) an
// 8-row micro-kernel over a panel in L1 went from 105 to 112 GFLOP/s (117 the FMAs' peak), 14
// rows from 112 to 115. The accumulators then hold even and odd columns, put back in order as
// the tile leaves the registers (store_tile).
template <typename B>
constexpr bool kSplitPairs = sizeof(vreg) == 64 && std::is_same_v<B, uint16_t> && kPanel == 32;
#ifdef __AVX512F__
inline void load_split(const uint16_t* p, vreg& even, vreg& odd) {
  const __m512i w = _mm512_loadu_si512(p);
  even = (vreg)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = (vreg)_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// even and odd columns [16 + 16] back to columns 0-15 and 16-31
inline void merge_split(vreg even, vreg odd, vreg& lo, vreg& hi) {
  const __m512i to_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i to_hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  lo = (vreg)_mm512_permutex2var_ps((__m512)even, to_lo, (__m512)odd);
  hi = (vreg)_mm512_permutex2var_ps((__m512)even, to_hi, (__m512)odd);
}
#else
inline void load_split(const uint16_t*, vreg&, vreg&) {}
inline void merge_split(vreg, vreg, vreg&, vreg&) {}
#endif

// The order of a k step's multiply-adds. Row by row, after loading the whole panel row: each
// broadcast of x is used at once, so the registers hold the accumulators, the panel row and one
// broadcast. Vector by vector (the panel row a vector at a time, every row's x against it): the
// kRows broadcasts stay in registers across the vectors. On AVX-512, 14 broadcasts and 28
// accumulators are more than 32 registers: GCC spilled accumulators to the stack in the inner
// loop, and row by row took a 512 x 576 x 3072 matmul from 136 to 201 GFLOP/s (2 threads). On
// AVX2 the whole panel row is 4 registers, 17 in all with 12 accumulators and a broadcast, one
// too many, and vector by vector is the faster (143 against 88 GFLOP/s, bfloat16 panels).
constexpr int kRegisters = sizeof(vreg) == 64 ? 32 : 16;
constexpr bool kPanelFirst = kRows * kVecs + kVecs + 1 <= kRegisters;

// A row of a panel's 32 results t into c's row o: as they are, or with Glu (columns 0-15 gate,
// 16-31 up) silu(gate) * up in 16 columns.
template <typename T, bool Glu>
inline void store_row(const float* t, T* o) {
  if constexpr (Glu) {
#pragma omp simd
    for (int j = 0; j < kPanel / 2; ++j) o[j] = silu_times(static_cast<T>(t[j]), static_cast<T>(t[j + kPanel / 2]));
  } else {
#pragma omp simd
    for (int j = 0; j < kPanel; ++j) o[j] = static_cast<T>(t[j]);
  }
}

// A micro-kernel's prefetches at step k: the share of the next panel at pf + k * pf_step, and,
// with `cached`, the panel (see micro). With ToL2 the next panel goes into L2 only (prefetcht2), for
// the kernels whose weight stream bounds them (VDPBF16PS and VPDPBUSD do twice and four times a
// float32 FMA's work a byte); otherwise into L1 (prefetcht0). The 120 linear layers of a step
// from memory, Zen 4, L2 against L1: pairs at 16 rows 11.0-12.8 ms against 12.7-12.8, at 1 row
// 6.7-7.0 against 7.7-7.9, at 64 rows the same; VNNI at 16 rows 6.7-7.9 against 7.2-8.8. The
// float32 panels' whole steps gained nothing from it (scripts/roofline.py, 1 and 16 sequences).
// A share of more than 64 bytes a step (one group of rows reading a panel of 4-byte words: 128
// bytes a k) is asked for a line at a time, both lines; with one prefetch a step every other line
// of the next panel came from memory as the micro-kernel read it. Zen 4, the 120 layers from
// memory, both libraries in one process, 6 alternating rounds (medians): pairs at 4 rows 8.80 ms
// against 9.92, 8 rows 8.80 against 11.14, 12 rows 9.70 against 13.91; float32 panels at 1 row
// 11.15 against 11.92, 4 rows 14.29 against 18.06, 8 rows 18.14 against 21.98; 16 rows and more,
// whose groups' shares are a line or less a step, and bfloat16 panels (64 bytes a k) the same.
// A single row of pairs (BothLines false) keeps one line a step: with two it lost 5% (8.25 ms against
// 7.83), its micro-kernel running far enough ahead of its loads for the core's own prefetchers.
// Always inlined: as a function, GCC split its `cached` branch off (partial inlining) into a
// function of prefetches alone, and the compiled micro, micro_pairs and micro_dot had neither a
// call to it nor its prefetches (objdump): none of them asked for its panel into L1.
template <bool ToL2 = false, bool BothLines = true, typename B>
__attribute__((always_inline)) inline void prefetch_step(const char* pf, int64_t k, int64_t pf_step, bool cached,
                                                         const B* bk) {
  const char* at = pf + k * pf_step;
  __builtin_prefetch(at, 0, ToL2 ? 1 : 3);
  if constexpr (BothLines && kPanel * sizeof(B) > 64) {
    if (pf_step > 64) __builtin_prefetch(at + 64, 0, ToL2 ? 1 : 3);
  }
  if (cached) {                  // the panel itself, from L2 into L1, 16 rows ahead
    __builtin_prefetch(bk + 16 * kPanel);
    __builtin_prefetch(bk + 16 * kPanel + 16);
  }
}

// Rows 0..R-1 of a tile's accumulators into c (row stride ldc), scaled by the 32 column scales
// `scale` where given. Split: the accumulators hold the even and the odd columns (load_split).
template <typename T, int R, bool Glu, bool Split = false>
inline void store_tile(const vreg (&acc)[R][kVecs], T* c, int64_t ldc, const float* scale) {
  for (int i = 0; i < R; ++i) {
    alignas(64) float t[kPanel];
    if constexpr (Split) {
      vreg lo, hi;
      merge_split(acc[i][0], acc[i][1], lo, hi);
      storer(t, lo);
      storer(t + kLanes, hi);
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) storer(t + j * kLanes, acc[i][j]);
    }
    if (scale != nullptr) {
#pragma omp simd
      for (int j = 0; j < kPanel; ++j) t[j] *= scale[j];
    }
    store_row<T, Glu>(t, c + i * ldc);
  }
}

// c[R][32] (row stride ldc) = a[R][K] (row stride lda) times a full panel b [K][32]. Meanwhile
// the bytes pf + k * pf_step (k < K) are asked for: weights stream from memory once a step, and
// the hardware prefetcher alone leaves the FMAs waiting on them. When several row groups read
// the panel (`cached`: it was asked for during the previous panel's groups and is in L2), it
// is also asked for into L1, 16 rows ahead (+4% at 64 and 512 rows when it was measured; on Zen 4
// at 16 to 256 rows, against none, the same within the rounds); with one group it is still
// coming from memory, and asking again only takes fill buffers (batch-1 decode step 41 -> 37 ms).
// Kept out of line: inlined into the `with_count` dispatch, the 512-row matmuls measured a few
// percent slower. B, the panel's element: x's own type, or int8_t, whose products are scaled by
// `scale` (the panel's 32 column scales) as they leave the registers.
template <typename T, typename B, int R, bool Glu = false>
__attribute__((noinline)) void micro(const float* a, int64_t lda, const B* b, int64_t K, T* c, int64_t ldc,
                                     const char* pf, int64_t pf_step, bool cached, const float* scale) {
  vreg acc[R][kVecs];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) acc[i][j] = vreg{};
  for (int64_t k = 0; k < K; ++k) {
    const B* bk = b + k * kPanel;
    prefetch_step(pf, k, pf_step, cached, bk);
    float s[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) s[i] = a[i * lda + k];
    if constexpr (kPanelFirst) {
      vreg bv[kVecs];
      if constexpr (kSplitPairs<B>) {
        load_split(bk, bv[0], bv[1]);
      } else {
#pragma GCC unroll 4
        for (int j = 0; j < kVecs; ++j) bv[j] = loadr(bk + j * kLanes);
      }
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < kVecs; ++j) acc[i][j] += s[i] * bv[j];
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) {
        const vreg bj = loadr(bk + j * kLanes);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) acc[i][j] += s[i] * bj;
      }
    }
  }
  store_tile<T, R, Glu, kSplitPairs<B> && kPanelFirst>(acc, c, ldc, scale);
}

// Work items are runs of about kRun panels over one block of rows, taken run by run: the threads
// work on the same panels at once, each on its own rows, so a panel comes from memory once and
// the other thread finds it in L3 (+4% at 512 rows against block by block). While a panel's row
// groups are computed, the next panel of the run is prefetched, a share per group; the run's
// first panel is prefetched ahead of its own first group only, so it comes late. Rows that fit
// one block (a decode step) are therefore one run per thread: the 120 linear layers of a
// 16-row step, Zen 5, medians of 8 alternating rounds, float32 panels 7.84 ms in runs of 8
// against 7.44, pairs with VDPBF16PS 5.68 against 5.40 (docs/benchmarks.md, Nov 30). A thread
// that ends its run then takes the other runs' last panels, one at a time: the two halves of a
// 16-row bfloat16 matmul ended 7-10 us apart on average (of ~110 us, Zen 4, either thread last
// as often), 3.6 us with the panels taken; the step 2.6% faster (docs/benchmarks.md, Dec 3).
constexpr int64_t kRun = 8;

// The work items above for a matmul of M rows over `panels` column panels, each panel `steps`
// steps of `step_bytes` (the micro-kernel's k, or group of k) from w: for each of an item's
// panels p below `full` and each group of its rows m..m+r-1 (r <= Rows, the groups of equal
// size), group(p, m, r, pf, pf_step, cached), the prefetch as `micro` takes it; then
// tail(m0, m1, p1) for the item's rows and the end of its run (the panels from `full` on).
// With Halves 2, each half h of a panel is taken by every group before the next half:
// group(p, m, r, pf, pf_step, cached, h), the next panel's prefetch shared by all those calls.
template <int64_t Rows, int64_t RowBlock, int Halves = 1, typename Group, typename Tail>
void panel_items(int64_t M, int64_t panels, int64_t full, int64_t steps, int64_t step_bytes, const char* w,
                 Group&& group, Tail&& tail) {
  const int64_t blocks = (M + RowBlock - 1) / RowBlock;
  // The panels are split into runs of near-equal length, as many as the threads can share evenly
  // and about kRun long: three runs of 8, 8 and 2 panels would leave one thread idle for 6.
  const int64_t threads = threads_now();
  const int64_t runs = blocks == 1 ? threads : std::max<int64_t>(1, (panels + kRun - 1) / kRun / threads) * threads;
  const int64_t panel_bytes = steps * step_bytes;
  // The runs one panel longer come first: the threads claim runs in order, so each takes as many
  // of those as the others (30 panels in runs of 8, 8, 7, 7: 15 each; in 7, 8, 7, 8 one thread
  // took 16 and the other waited for it).
  const int64_t base = panels / runs, longer = panels % runs;
  auto run_start = [&](int64_t run) { return run * base + std::min(run, longer); };
  // Panel p over rows m0..m1 (groups of them): `next` the panel whose shares its groups ask for
  // (nullptr: none), `first` where nothing asked for p itself (its first group asks for its rows
  // 4 KB ahead).
  auto panel = [&](int64_t m0, int64_t m1, int64_t p, const char* next, bool first) {
    const int64_t groups = (m1 - m0 + Rows - 1) / Rows;
    const int64_t share = (panel_bytes + groups * Halves - 1) / (groups * Halves);
    const char* b = w + p * panel_bytes;
    for (int h = 0; h < Halves; ++h) {
      for (int64_t m = m0, g = 0; m < m1; ++g) {
        const int64_t r = (m1 - m0) / groups + (g < (m1 - m0) % groups);   // groups of equal size
        const char* pf = (next ? next : b + panel_bytes) + (h * groups + g) * share;   // the next panel's share
        int64_t step = next ? (share + steps - 1) / steps : 0;
        if (first && h == 0 && g == 0) pf = b + 4096, step = step_bytes;
        if constexpr (Halves == 1) {
          group(p, m, r, pf, step, groups > 1);
        } else {
          group(p, m, r, pf, step, groups > 1, h);
        }
        m += r;
      }
    }
  };
  if (blocks == 1 && runs > 1) {
    // One run per thread (a decode step): a thread that ends its run takes the others' last
    // panels (runs_taken). Nothing asked for a panel taken first from another run.
    runs_taken(runs, [&](int64_t r) { return std::pair{run_start(r), std::min(run_start(r + 1), full)}; },
               [&](int64_t r, int64_t p, int64_t next, bool first) {
                 panel(0, M, p, next >= 0 ? w + next * panel_bytes : nullptr, first);
               },
               [&](int64_t r) { tail(0, M, run_start(r + 1)); });
    return;
  }
  parallel_for(blocks * runs, 1, [&](int64_t item) {
    const int64_t m0 = item % blocks * RowBlock, m1 = std::min(M, m0 + RowBlock);
    const int64_t p0 = run_start(item / blocks), p1 = run_start(item / blocks + 1);
    for (int64_t p = p0; p < std::min(p1, full); ++p)
      panel(m0, m1, p, p + 1 < std::min(p1, full) ? w + (p + 1) * panel_bytes : nullptr, p == p0);
    tail(m0, m1, p1);
  });
}

// x [M, K] as the micro-kernels read it, float32: a float16 x is widened once here, not in their
// k loop, where GCC converted the rows' values ahead of their FMAs and spilled more accumulators
// to the stack (a float16 512 x 576 x 3072 matmul, 2 threads, AVX-512: 67 -> 91 GFLOP/s;
// float32's 200). The widened rows are this thread's buffer until its next call.
template <typename T>
const float* float32_rows(const T* x, int64_t M, int64_t K) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    thread_local std::vector<float> widened;
    float* to = scratch(widened, M * K);        // (this thread's buffer: the helpers write into it)
    parallel_for(M, 16, [&](int64_t m) {
      for (int64_t k = 0; k < K; ++k) to[m * K + k] = static_cast<float>(x[m * K + k]);
    });
    return to;
  }
}

// The last, narrower panel of w (width columns of `steps` rows, from b) padded to 32 columns
// [steps][32] with zeros, in this thread's buffer until its next call.
template <typename B>
const B* padded_panel(const B* b, int64_t steps, int64_t width) {
  thread_local std::vector<B> pad;
  pad.assign(steps * kPanel, B(0));
  for (int64_t k = 0; k < steps; ++k) std::copy(b + k * width, b + (k + 1) * width, pad.data() + k * kPanel);
  return pad.data();
}

// Rows m0..m1-1 of y [., N], columns col.. (the last, narrower panel): times(m, r, tile) computes
// rows m..m+r-1 (r <= Rows) of that panel padded to 32 columns into the scratch tile [r][32],
// whose first N - col columns are then copied.
template <int64_t Rows = kRows, typename T, typename Times>
void narrow_rows(T* y, int64_t m0, int64_t m1, int64_t N, int64_t col, Times&& times) {
  thread_local std::vector<T> tile;
  tile.resize(Rows * kPanel);
  for (int64_t m = m0; m < m1; m += Rows) {
    const int64_t r = std::min(Rows, m1 - m);
    times(m, r, tile.data());
    for (int64_t i = 0; i < r; ++i)
      std::copy(tile.data() + i * kPanel, tile.data() + i * kPanel + N - col, y + (m + i) * N + col);
  }
}

// narrow_rows of xa's rows times `pad`, that panel padded to 32 columns [K][32] (B as micro takes
// it, scaled by `scale` where given).
template <typename T, typename B>
void narrow_panel(const float* xa, const B* pad, const float* scale, T* y, int64_t m0, int64_t m1, int64_t K,
                  int64_t N, int64_t col) {
  narrow_rows(y, m0, m1, N, col, [&](int64_t m, int64_t r, T* tile) {
    with_count<kRows>(r, [&](auto rows) {
      micro<T, B, rows>(xa + m * K, K, pad, K, tile, kPanel, reinterpret_cast<const char*>(pad), 0, false, scale);
    });
  });
}

// A CPU without AVX-512 takes each full panel of a matmul of more than kRows rows in two halves
// of 16 columns, kRowsHalf rows a group, every group of rows through the first half before the
// second (panel_items' Halves). A panel row there is 4 ymm, and `micro`'s 3 rows of it keep 12
// accumulators, so that each 64 bytes of a bfloat16 panel serve 12 FMAs a k, and each panel row
// is widened (vpmovzxwd and a shift a vector) for 3 rows only. A half with 6 rows: 12
// accumulators, the half's 2 vectors and a broadcast in the 16 ymm, 12 FMAs for 32 bytes, and a
// bfloat16 half is one 32-byte load split into its even and odd columns (a shift and an AND, as
// load_split on AVX-512, put back in order as the tile leaves the registers); a half of a panel
// of K 576 (18 KB) stays in L1 while the groups after the first read it. Each output's sum runs
// over k in the same order as `micro`'s: the same bits. The demo model's 120 linear layers from
// memory, 2 threads, Zen 3, against `micro` alone (alternating passes, medians): bfloat16
// panels at 16 rows 33.6 ms against 36.1 (faster in 18 of 20), at 64 rows 123.5 against 131.7;
// float32 panels at 16 rows 42.6 against 46.4, at 64 rows 133.5 against 154.7. The panel's own
// rows asked for into L1 16 ahead (`micro`'s `cached` prefetch) helped float32 halves and cost
// bfloat16's (at 16 rows 35.9 ms with it against 31.4 without), so only 4-byte panels keep it.
// At 1 to 3 rows one group reads the whole panel from memory either way, and the halves were no
// faster (1 row 18.1 ms against 17.2): those keep `micro`.
constexpr int64_t kRowsHalf = 6, kRowBlockHalf = 9 * kRowsHalf;

// c[R][16] (row stride ldc) = a[R][K] times half h of a full panel (b: the panel's first row,
// offset by the half's 16 columns), prefetching as `micro`; `scale` the half's 16 column scales
// where given. Glu: half 0 holds the gate (kept in c as T), half 1 the up projection, and c then
// gets silu(gate) * up, what store_row gives from the whole panel.
template <typename T, typename B, int R, bool Glu>
__attribute__((noinline)) void micro_half(const float* a, int64_t lda, const B* b, int64_t K, T* c, int64_t ldc,
                                          int h, const char* pf, int64_t pf_step, bool cached, const float* scale) {
  constexpr int V = kVecs / 2;
  constexpr bool split = std::is_same_v<B, uint16_t> && V == 2;
  vreg acc[R][V] = {};
  for (int64_t k = 0; k < K; ++k) {
    const B* bk = b + k * kPanel;
    __builtin_prefetch(pf + k * pf_step);
    if (sizeof(B) == 4 && cached) __builtin_prefetch(bk + 16 * kPanel);
    vreg bv[V];
    if constexpr (split) {       // lane j holds columns 2j (low half) and 2j + 1
      const vregw u = *reinterpret_cast<const vregwu*>(bk);
      const vregw even = u << 16, odd = u & 0xffff0000u;
      bv[0] = reinterpret_cast<const vreg&>(even);
      bv[1] = reinterpret_cast<const vreg&>(odd);
    } else {
#pragma GCC unroll 2
      for (int j = 0; j < V; ++j) bv[j] = loadr(bk + j * kLanes);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const float s = a[i * lda + k];
#pragma GCC unroll 2
      for (int j = 0; j < V; ++j) acc[i][j] += s * bv[j];
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(64) float t[kPanel / 2];
    if constexpr (split) {
      alignas(64) float even[kLanes], odd[kLanes];
      storer(even, acc[i][0]);
      storer(odd, acc[i][1]);
      for (int j = 0; j < kLanes; ++j) t[2 * j] = even[j], t[2 * j + 1] = odd[j];
    } else {
      for (int j = 0; j < V; ++j) storer(t + j * kLanes, acc[i][j]);
    }
    if (scale != nullptr) {
#pragma omp simd
      for (int j = 0; j < kPanel / 2; ++j) t[j] *= scale[j];
    }
    T* o = c + i * ldc;
    if (Glu && h == 1) {
#pragma omp simd
      for (int j = 0; j < kPanel / 2; ++j) o[j] = silu_times(o[j], static_cast<T>(t[j]));
    } else {
#pragma omp simd
      for (int j = 0; j < kPanel / 2; ++j) o[j] = static_cast<T>(t[j]);
    }
  }
}

// Glu: the panels hold 16 gate and 16 up columns each (CpuOps.pack_glu) and y [M, N/2] gets
// silu(gate) * up, computed as each tile leaves the registers.
// B int8_t (CpuOps.pack_int8): w holds the N column scales (float32), then the int8 panels.
template <typename T, bool Glu = false, typename B = T>
void linear_rows(const T* x, const B* w, T* y, int64_t M, int64_t K, int64_t N) {
  const float* scales = nullptr;
  if constexpr (std::is_same_v<B, int8_t>) {
    scales = reinterpret_cast<const float*>(w);
    w += N * static_cast<int64_t>(sizeof(float));
  }
  constexpr int64_t out_cols = Glu ? kPanel / 2 : kPanel;       // of y, per panel
  const int64_t ldy = Glu ? N / 2 : N;
  const int64_t panels = (N + kPanel - 1) / kPanel, full = N / kPanel;
  const float* xa = float32_rows(x, M, K);
  auto group = [&](int64_t p, int64_t m, int64_t r, const char* pf, int64_t step, bool cached) {
    with_count<kRows>(r, [&](auto rows) {
      micro<T, B, rows, Glu>(xa + m * K, K, w + p * kPanel * K, K, y + m * ldy + p * out_cols, ldy, pf, step, cached,
                             scales ? scales + p * kPanel : nullptr);
    });
  };
  auto tail = [&](int64_t m0, int64_t m1, int64_t p1) {
    if (Glu || p1 <= full) return;   // (Glu: N is a multiple of 32)
    // the last, narrower panel: padded to 32 columns
    const int64_t col = full * kPanel;
    float pad_scale[kPanel] = {};
    if (scales) std::copy(scales + col, scales + N, pad_scale);
    narrow_panel<T, B>(xa, padded_panel(w + col * K, K, N - col), scales ? pad_scale : nullptr, y, m0, m1, K, N, col);
  };
  const char* wb = reinterpret_cast<const char*>(w);
  if constexpr (kHalves == 2) {
    if (M > kRows) {
      auto half_group = [&](int64_t p, int64_t m, int64_t r, const char* pf, int64_t step, bool cached, int h) {
        constexpr int64_t half = kPanel / 2;
        with_count<kRowsHalf>(r, [&](auto rows) {
          micro_half<T, B, rows, Glu>(xa + m * K, K, w + p * kPanel * K + h * half, K,
                                      y + m * ldy + p * out_cols + (Glu ? 0 : h * half), ldy, h, pf, step, cached,
                                      scales ? scales + p * kPanel + h * half : nullptr);
        });
      };
      panel_items<kRowsHalf, kRowBlockHalf, 2>(M, panels, full, K, kPanel * sizeof(B), wb, half_group, tail);
      return;
    }
  }
  panel_items<kRows, kRowBlock>(M, panels, full, K, kPanel * sizeof(B), wb, group, tail);
}

// ---- Linear over int8 inputs and int8 weights, with AVX512-VNNI -----------------------------
// A W8A8 layer (int8 weights per output channel, inputs int8 per token) on a CPU with VNNI: the
// input rows are quantized here, as sharding.layers.PerTokenInt8 quantizes them (max|x| / divisor,
// halves to even or away from zero, clamped to -128..127), and VPDPBUSD sums four int8 products
// into an int32 lane per instruction: the sum is exact, then scaled once by the row's and the
// column's scale. VPDPBUSD multiplies unsigned by signed bytes, so the weight is stored as
// level + 128 (uint8) and each row's sum of 128 x its levels is taken off the result.
//   w [N, Kq] (CpuOps.pack_vnni; Kq = K rounded up to 4): panels of 32 columns, each [Kq/4][32][4]:
// per group of 4 k, the 4 bytes of column c at 4c, so one 64-byte load holds 16 columns' 4 k.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MSINFER_VNNI 1
#ifndef VROWS
#define VROWS 6
#endif
constexpr int64_t kRowsVnni = VROWS, kRowBlockVnni = 9 * kRowsVnni;

// 16 lanes of x from p (the first n), float32, the others zeros.
inline __m512 load16(const float* p, __mmask16 n) { return _mm512_maskz_loadu_ps(n, p); }
inline __m512 load16(const _Float16* p, __mmask16 n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(n, p)); }

// rows of x [M, K] -> q [M, Kq] (zeros past K), each row's scale s and 128 x the sum of its levels.
// amax: each row's max|x| as the caller took it (a row split over ranks), or nullptr. The
// quotient x / s is IEEE division, as PerTokenInt8's, so the levels are the same.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t Kq, float divisor, bool away, const float* amax,
                   int8_t* q, float* s, int32_t* comp) {
  parallel_for(M, 16, [&](int64_t m) {
    const T* r = x + m * K;
    auto lanes = [&](int64_t k) { return static_cast<__mmask16>(k + 16 <= K ? 0xffff : (1u << (K - k)) - 1); };
    float a;
    if (amax != nullptr) {
      a = amax[m];
    } else {
      __m512 mx = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(r + k, lanes(k))));
      a = _mm512_reduce_max_ps(mx);
    }
    float sc = a / divisor;
    if (sc == 0.f) sc = std::numeric_limits<float>::epsilon();
    const __m512 vs = _mm512_set1_ps(sc), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
    const __m512 half = _mm512_set1_ps(0.5f), sign = _mm512_set1_ps(-0.f);
    __m512i sum = _mm512_setzero_si512();
    int8_t* o = q + m * Kq;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 n = lanes(k);
      const __m512 v = _mm512_div_ps(load16(r + k, n), vs);
      __m512 l;
      if (away) {   // sign(v) * floor(|v| + 0.5)
        l = _mm512_roundscale_ps(_mm512_add_ps(_mm512_abs_ps(v), half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        l = _mm512_or_ps(l, _mm512_and_ps(v, sign));
      } else {      // halves to even
        l = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      }
      const __m512i li = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, l)));
      sum = _mm512_add_epi32(sum, li);
      _mm_mask_storeu_epi8(o + k, n, _mm512_cvtepi32_epi8(li));
    }
    std::fill(o + K, o + Kq, int8_t(0));
    s[m] = sc;
    comp[m] = 128 * _mm512_reduce_add_epi32(sum);
  });
}

// c[R][32] = rows a[R][Kq] (int8, row stride lda) times a panel b [Kq/4][32][4] (uint8), scaled by
// each row's s and each column's scale; prefetching as `micro` does.
template <typename T, int R, bool Glu>
__attribute__((noinline)) void micro_vnni(const int8_t* a, int64_t lda, const uint8_t* b, int64_t KQ, T* c,
                                          int64_t ldc, const char* pf, int64_t pf_step, bool cached,
                                          const float* scale, const float* s, const int32_t* comp) {
  __m512i acc[R][2];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
  for (int64_t g = 0; g < KQ; ++g) {
    const uint8_t* bg = b + g * 128;
    __builtin_prefetch(pf + g * pf_step, 0, 1);           // into L2 (prefetch_step)
    if (cached) {
      __builtin_prefetch(bg + 16 * 128);
      __builtin_prefetch(bg + 16 * 128 + 64);
    }
    const __m512i b0 = _mm512_loadu_si512(bg), b1 = _mm512_loadu_si512(bg + 64);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      int32_t four;
      std::memcpy(&four, a + i * lda + 4 * g, 4);
      const __m512i ai = _mm512_set1_epi32(four);
      acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], b0, ai);
      acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], b1, ai);
    }
  }
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
  for (int i = 0; i < R; ++i) {
    const __m512i off = _mm512_set1_epi32(comp[i]);
    const __m512 si = _mm512_set1_ps(s[i]);
    alignas(64) float t[kPanel];
    _mm512_store_ps(t, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][0], off)), si), s0));
    _mm512_store_ps(t + 16, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][1], off)), si), s1));
    store_row<T, Glu>(t, c + i * ldc);
  }
}

// y [M, N] (Glu: [M, N/2]) from the quantized rows (q [M, Kq], s, comp) and w (CpuOps.pack_vnni),
// N a multiple of 32; work shared as linear_rows shares it.
template <typename T, bool Glu>
void vnni_rows(const int8_t* q, const float* s, const int32_t* comp, const uint8_t* w, const float* scales, T* y,
               int64_t M, int64_t Kq, int64_t N) {
  constexpr int64_t out_cols = Glu ? kPanel / 2 : kPanel;
  const int64_t ldy = Glu ? N / 2 : N, KQ = Kq / 4, panels = N / kPanel;
  panel_items<kRowsVnni, kRowBlockVnni>(
      M, panels, panels, KQ, 4 * kPanel, reinterpret_cast<const char*>(w),
      [&](int64_t p, int64_t m, int64_t r, const char* pf, int64_t step, bool cached) {
        with_count<kRowsVnni>(r, [&](auto rows) {
          micro_vnni<T, rows, Glu>(q + m * Kq, Kq, w + p * Kq * kPanel, KQ, y + m * ldy + p * out_cols, ldy, pf, step,
                                   cached, scales + p * kPanel, s + m, comp + m);
        });
      },
      [](int64_t, int64_t, int64_t) {});
}

// y = quantized x times w, for rows 0..M-1: rows after the last non-zero one (a step's padding)
// are zeros and not computed.
template <typename T, bool Glu>
void linear_vnni(const T* x, const uint8_t* w, const float* scales, float divisor, bool away, const float* amax,
                 T* y, int64_t M, int64_t K, int64_t N) {
  const int64_t W = Glu ? N / 2 : N, Kq = (K + 3) / 4 * 4;
  int64_t L = M;
  while (L > 0 && std::all_of(x + (L - 1) * K, x + L * K, [](T v) { return v == T(0); })) --L;
  std::fill(y + L * W, y + M * W, T(0));
  if (L == 0) return;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> s;
  thread_local std::vector<int32_t> comp;
  int8_t* qs = scratch(q, L * Kq);
  float* ss = scratch(s, L);
  int32_t* cs = scratch(comp, L);
  quantize_rows(x, L, K, Kq, divisor, away, amax, qs, ss, cs);
  vnni_rows<T, Glu>(qs, ss, cs, w, scales, y, L, Kq, N);
}
#endif

// ---- Linear over int4 weights in groups (W4A16), on AVX-512 -----------------------------------
// A W4A16 layer (int4 levels, symmetric, a scale per group of G inputs of each output) held as
// it is: an eighth of float32's bytes, which a decode step streams.
//   w [N, K/2] uint8 (CpuInt4Linear.pack): panels of 32 columns, each [K][16]: byte c of k holds
// column c in its low nibble and column c + 16 in its high one, each as level + 8; a last,
// narrower panel of W columns (W even) [K][W/2] the same way, column c + W/2 in the high nibble.
//   scales [N, K/G] float32: each panel's column scales group by group, [K/G][32] ([K/G][W]).
// Each k's row of 32 weights is widened to float32 and multiplied by its group's scales before
// the FMAs: the weight is then the dequantized weight's float32 value exactly (level x scale,
// one rounding, as the loader dequantizes it), so the result is the float32 panels' bit for bit.
#ifdef __AVX512F__
#define MSINFER_INT4 1
// 12 rows x 2 accumulators, the panel row's 2 vectors, its group's 2 scale vectors, a broadcast
// and the nibble mask: 31 of the 32 zmm (14 rows, the float kernel's, would spill).
constexpr int64_t kRowsInt4 = 12;

// A k's 16 bytes of a panel -> its 32 weights in float32 times their group's scales (s0: columns
// 0-15, s1: 16-31): the values the loader's dequantization gives.
inline void widen_int4(const uint8_t* bk, __m512 s0, __m512 s1, __m512& w0, __m512& w1) {
  const __m512i nibble = _mm512_set1_epi32(0x0F), eight = _mm512_set1_epi32(8);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bk)));
  w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(v, nibble), eight)), s0);
  w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight)), s1);
}

// c[R][32] = a[R][K] times a full int4 panel (b [K][16], its scales [K/G][32]), the panel streamed
// from memory once (one group of rows reads it: int4_rows), prefetching as `micro` does.
template <typename T, int R, bool Glu>
__attribute__((noinline)) void micro_int4(const float* a, int64_t lda, const uint8_t* b, int64_t K, int64_t G,
                                          const float* scale, T* c, int64_t ldc, const char* pf, int64_t pf_step) {
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
    const __m512 s0 = _mm512_loadu_ps(scale + g * kPanel), s1 = _mm512_loadu_ps(scale + g * kPanel + 16);
    for (int64_t k = k0; k < k0 + G; ++k) {
      __builtin_prefetch(pf + k * pf_step);
      __m512 b0, b1;
      widen_int4(b + k * (kPanel / 2), s0, s1, b0, b1);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m512 x = _mm512_set1_ps(a[i * lda + k]);
        acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(64) float t[kPanel];
    _mm512_store_ps(t, acc[i][0]);
    _mm512_store_ps(t + 16, acc[i][1]);
    store_row<T, Glu>(t, c + i * ldc);
  }
}

// A full panel's int4 weights (b [K][16], scales [K/G][32]) -> their float32 values d [K][32],
// as micro_int4 computes them.
inline void dequantize_int4(const uint8_t* b, const float* scale, int64_t K, int64_t G, float* d) {
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
    const __m512 s0 = _mm512_loadu_ps(scale + g * kPanel), s1 = _mm512_loadu_ps(scale + g * kPanel + 16);
    for (int64_t k = k0; k < k0 + G; ++k) {
      __m512 w0, w1;
      widen_int4(b + k * (kPanel / 2), s0, s1, w0, w1);
      _mm512_storeu_ps(d + k * kPanel, w0);
      _mm512_storeu_ps(d + k * kPanel + 16, w1);
    }
  }
}

// y [M, N] (Glu: [M, N/2]) = x [M, K] times the int4 weight w with its group scales (above), N
// even (Glu: a multiple of 32) and K a multiple of G; work shared as linear_rows shares it (row
// groups of up to kRows). A panel that one group of at most kRowsInt4 rows reads is widened as
// micro_int4 reads it; any other is widened once into this thread's float32 panel, which the
// float32 micro-kernel then reads for each group: widening it for each would cost as much as the
// FMAs (at 16 rows, 284 tok/s against 368 for bfloat16 panels). The last, narrower panel is
// dequantized into a float32 panel padded to 32 columns.
template <typename T, bool Glu>
void int4_rows(const T* x, const uint8_t* w, const float* scales, T* y, int64_t M, int64_t K, int64_t N, int64_t G) {
  const uint64_t call = ++g_int4_calls;
  constexpr int64_t out_cols = Glu ? kPanel / 2 : kPanel;
  const int64_t ldy = Glu ? N / 2 : N, full = N / kPanel, panels = (N + kPanel - 1) / kPanel;
  const float* xa = float32_rows(x, M, K);
  panel_items<kRows, kRowBlock>(
      M, panels, full, K, kPanel / 2, reinterpret_cast<const char*>(w),
      [&](int64_t p, int64_t m, int64_t r, const char* pf, int64_t step, bool cached) {
        const uint8_t* b = w + p * K * (kPanel / 2);
        const float* sc = scales + p * (K / G) * kPanel;
        if (!cached && r <= kRowsInt4) {
          return with_count<kRowsInt4>(r, [&](auto rows) {
            micro_int4<T, rows, Glu>(xa + m * K, K, b, K, G, sc, y + m * ldy + p * out_cols, ldy, pf, step);
          });
        }
        thread_local std::vector<float> panel;
        thread_local uint64_t panel_call = 0;
        thread_local const uint8_t* panel_of = nullptr;
        if (panel_call != call || panel_of != b) {
          panel.resize(K * kPanel);
          dequantize_int4(b, sc, K, G, panel.data());
          panel_call = call, panel_of = b;
        }
        with_count<kRows>(r, [&](auto rows) {
          micro<T, float, rows, Glu>(xa + m * K, K, panel.data(), K, y + m * ldy + p * out_cols, ldy, pf, step, true,
                                     nullptr);
        });
      },
      [&](int64_t m0, int64_t m1, int64_t p1) {
        if (Glu || p1 <= full) return;
        const int64_t col = full * kPanel, width = N - col, half = width / 2;
        const uint8_t* b = w + col * K / 2;
        const float* sc = scales + col * (K / G);
        thread_local std::vector<float> pad;
        pad.assign(K * kPanel, 0.f);
        for (int64_t k = 0; k < K; ++k)
          for (int64_t c = 0; c < half; ++c) {
            const uint8_t byte = b[k * half + c];
            pad[k * kPanel + c] = static_cast<float>((byte & 0x0F) - 8) * sc[k / G * width + c];
            pad[k * kPanel + c + half] = static_cast<float>((byte >> 4) - 8) * sc[k / G * width + c + half];
          }
        narrow_panel<T, float>(xa, pad.data(), nullptr, y, m0, m1, K, N, col);
      });
}
#endif

// ---- Linear in bfloat16: bfloat16 inputs and weights, float32 sums ---------------------------
// For a job computing in bfloat16 on the CPU: each value of x is rounded to bfloat16 (to nearest,
// ties to even) and w holds bfloat16 values; every product is exact in float32 and the sums are
// float32, as a bfloat16 matmul on a card or in AMX tiles sums them. w is uint32 [N, K2], K2 =
// ceil(K / 2): word (c, j) holds w[c][2j] in its low 16 bits and w[c][2j + 1] in its high 16 bits
// (zero past K), in `pack`'s panels of 32 columns [K2][32] (the last [K2][N mod 32];
// CpuOps.pack_pairs). With AVX512-BF16, VDPBF16PS takes a word of x's pair, broadcast, against 16 columns'
// words: 32 multiply-adds an instruction where a float32 FMA does 16. Without it (or with
// SetBf16Dot(0)), FMAs over the widened halves add the same products in the same order: Intel
// defines VDPBF16PS as the high pair's product added, then the low pair's, each sum rounded to
// float32, with denormal inputs read as zero (x's are flushed when rounded, w's when packed), and
// tests/test_kernels.py holds the two paths to the same bits on a CPU that has both.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MSINFER_BF16_DOT 1
#endif

// The pairs' micro-kernel by FMAs keeps kRowsPairs rows of kPanel / kPairPasses columns in
// registers over the whole of K2, in kPairPasses passes over the panel. On AVX-512 that is
// `micro`'s 14 rows of the whole panel. On AVX2 a panel row is 4 vectors: 3 rows of it (12
// accumulators), the 4 vectors of a half and a broadcast are 17 of the 16 ymm, and GCC kept
// accumulators on the stack; so the panel is taken in two passes of 16 columns, 6 rows each (12
// accumulators, 2 vectors of a half, a broadcast). The 120 linear layers of a 16-row step from
// memory, Zen 3, 60 alternating passes: median 33.2 ms against 46.7, faster in 60 of 60.
// (`micro`'s own panels measured no faster with both passes in one call, as here: 43.0 against
// 42.1 ms for bfloat16 panels, 51.1 against 48.5 for float32's; they gain with each half a call
// of its own taken by every group of rows in turn, micro_half. The pairs measured the same that
// way, 33.7 against 33.6 ms at 16 rows and 119.4 against 118.4 at 64, and keep one call.)
#ifdef __AVX512F__
constexpr int64_t kRowsPairs = kRows;
constexpr int kPairPasses = 1;
#else
constexpr int64_t kRowsPairs = 6;
constexpr int kPairPasses = 2;
#endif
constexpr int64_t kRowBlockPairs = 9 * kRowsPairs;

// c[R][32] = a[R][2 K2] (float32 holding bfloat16 values, row stride lda) times a pair panel b
// [K2][32] with FMAs: per word the high halves' products first, then the low halves'. A pass's
// row of high halves is widened, then every row's accumulators take them (each broadcast used at
// once, as `micro` does on AVX-512), then the low halves (the row read again): the registers hold
// the accumulators, one half of the pass's row and a broadcast. Prefetching as `micro`, the next
// panel's share split between the passes.
template <typename T, int R, bool Glu>
__attribute__((noinline)) void micro_pairs(const float* a, int64_t lda, const uint32_t* b, int64_t K2, T* c,
                                           int64_t ldc, const char* pf, int64_t pf_step, bool cached) {
  constexpr int width = kPanel / kPairPasses, V = kVecs / kPairPasses;
  alignas(64) float t[R][kPanel];
  const int64_t step = (pf_step + kPairPasses - 1) / kPairPasses;
  for (int h = 0; h < kPairPasses; ++h) {
    vreg acc[R][V] = {};
    for (int64_t k = 0; k < K2; ++k) {
      const uint32_t* bk = b + k * kPanel + h * width;
      prefetch_step(pf + h * K2 * step, k, step, cached, bk);
      const vregwu* u = reinterpret_cast<const vregwu*>(bk);           // read again for the low halves
      vreg half[V];
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) {
        const vregw hi = u[j] & 0xffff0000u;
        half[j] = reinterpret_cast<const vreg&>(hi);
      }
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < V; ++j) acc[i][j] += a[i * lda + 2 * k + 1] * half[j];
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) {
        const vregw lo = u[j] << 16;
        half[j] = reinterpret_cast<const vreg&>(lo);
      }
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < V; ++j) acc[i][j] += a[i * lda + 2 * k] * half[j];
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) storer(t[i] + h * width + j * kLanes, acc[i][j]);
  }
  for (int i = 0; i < R; ++i) store_row<T, Glu>(t[i], c + i * ldc);
}

#ifdef MSINFER_BF16_DOT
// The same with VDPBF16PS: a [R][K2] words of x's bfloat16 pairs (row stride lda).
template <typename T, int R, bool Glu>
__attribute__((noinline)) void micro_dot(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t K2, T* c,
                                         int64_t ldc, const char* pf, int64_t pf_step, bool cached) {
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const uint32_t* bk = b + k * kPanel;
    prefetch_step<true, (R > 1)>(pf, k, pf_step, cached, bk);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bk), b1 = (__m512bh)_mm512_loadu_si512(bk + 16);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512bh s = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * lda + k]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], s, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], s, b1);
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(64) float t[kPanel];
    _mm512_store_ps(t, acc[i][0]);
    _mm512_store_ps(t + 16, acc[i][1]);
    store_row<T, Glu>(t, c + i * ldc);
  }
}
#endif

// y [M, N] (Glu: [M, N/2]) = x [M, K] rounded to bfloat16, times w in pair panels (above); a last
// panel narrower than 32 columns is padded to 32 (padded_panel, narrow_rows), as linear_rows does.
template <bool Glu>
void linear_pairs(const float* x, const uint32_t* w, float* y, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t out_cols = Glu ? kPanel / 2 : kPanel;
  const int64_t ldy = Glu ? N / 2 : N, K2 = (K + 1) / 2;
  const int64_t panels = (N + kPanel - 1) / kPanel, full = N / kPanel;
#ifdef MSINFER_BF16_DOT
  const bool dot = g_bf16_dot;
#else
  const bool dot = false;
#endif
  // x rounded, 2 K2 values a row: bfloat16 bits for VDPBF16PS, else the float32 they are
  thread_local std::vector<uint16_t> bits;
  thread_local std::vector<float> values;
  uint16_t* xb = dot ? scratch(bits, M * 2 * K2) : nullptr;
  float* xv = dot ? nullptr : scratch(values, M * 2 * K2);
  parallel_for(M, 16, [&](int64_t m) {
    const float* r = x + m * K;
    if (dot) {
      uint16_t* o = xb + m * 2 * K2;
      for (int64_t k = 0; k < K; ++k) o[k] = bf16_rounded(r[k]);
      if (K % 2) o[K] = 0;
    } else {
      float* o = xv + m * 2 * K2;
      for (int64_t k = 0; k < K; ++k) o[k] = bf16_value(bf16_rounded(r[k]));
      if (K % 2) o[K] = 0.f;
    }
  });
  // rows m.. (r of them) times panel b [K2][32] into c (row stride ldc)
  auto rows_times = [&](int64_t m, int64_t r, const uint32_t* b, float* c, int64_t ldc, const char* pf, int64_t step,
                        bool cached) {
    with_count<kRowsPairs>(r, [&](auto rows) {
#ifdef MSINFER_BF16_DOT
      if (dot) {
        micro_dot<float, rows, Glu>(reinterpret_cast<const uint32_t*>(xb) + m * K2, K2, b, K2, c, ldc, pf, step,
                                    cached);
        return;
      }
#endif
      micro_pairs<float, rows, Glu>(xv + m * 2 * K2, 2 * K2, b, K2, c, ldc, pf, step, cached);
    });
  };
  auto group = [&](int64_t p, int64_t m, int64_t r, const char* pf, int64_t step, bool cached) {
    rows_times(m, r, w + p * kPanel * K2, y + m * ldy + p * out_cols, ldy, pf, step, cached);
  };
  panel_items<kRowsPairs, kRowBlockPairs>(M, panels, full, K2, kPanel * sizeof(uint32_t),
                                          reinterpret_cast<const char*>(w), group,
                                          [&](int64_t m0, int64_t m1, int64_t p1) {
    if (Glu || p1 <= full) return;   // (Glu: N is a multiple of 32)
    const int64_t col = full * kPanel;
    const uint32_t* pad = padded_panel(w + col * K2, K2, N - col);
    narrow_rows<kRowsPairs>(y, m0, m1, N, col, [&](int64_t m, int64_t r, float* tile) {
      rows_times(m, r, pad, tile, kPanel, reinterpret_cast<const char*>(pad), 0, false);
    });
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

// The lookups' loop: row(id, o) fills out's row n (H values) for each ids[n] in [0, V); ids
// outside (another rank's vocabulary) give zeros.
template <typename T, typename Row>
void lookup_rows(const int32_t* ids, T* out, int64_t N, int64_t V, int64_t H, Row&& row) {
  parallel_for(N, 64, [&](int64_t n) {
    T* o = out + n * H;
    const int64_t id = ids[n];
    if (id < 0 || id >= V) {
      std::fill(o, o + H, T(0));
      return;
    }
    row(id, o);
  });
}

// Rows ids[n] of an embedding table in bfloat16 tiles (see above), as float32.
void embed_bf16(const uint16_t* w, const int32_t* ids, float* out, int64_t N, int64_t V, int64_t H) {
  const int64_t KB = H / 32;
  lookup_rows(ids, out, N, V, H, [&](int64_t id, float* o) {
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

inline float value_of(uint16_t bits) { return bf16_value(bits); }     // bfloat16 panels
template <typename T>
inline T value_of(T v) { return v; }

// Row `id` of a panel-major [V, H] table (column id of x w^T): where its first value lies, and
// the distance between its values (its panel's width).
template <typename W>
inline std::pair<const W*, int64_t> panel_row(const W* w, int64_t V, int64_t H, int64_t id) {
  const int64_t col = id / kPanel * kPanel, width = std::min(kPanel, V - col);
  return {w + col * H + (id - col), width};
}

// Rows ids[n] of a panel-major [V, H] table (an embedding that is also the LM head's weight), W
// the table's element (T, or uint16_t: bfloat16 for a float32 T); ids outside [0, V) (another
// rank's vocabulary) give zeros.
template <typename T, typename W = T>
void embed(const W* w, const int32_t* ids, T* out, int64_t N, int64_t V, int64_t H) {
  lookup_rows(ids, out, N, V, H, [&](int64_t id, T* o) {
    const auto [b, width] = panel_row(w, V, H, id);
    for (int64_t k = 0; k < H; ++k) o[k] = value_of(b[k * width]);
  });
}

// Rows ids[n] of a [V, H] table in bfloat16 pairs (CpuOps.pack_pairs, H even: [V, H/2] words in
// panels), as float32; ids outside [0, V) (another rank's vocabulary) give zeros.
void embed_pairs(const uint32_t* w, const int32_t* ids, float* out, int64_t N, int64_t V, int64_t H) {
  const int64_t H2 = H / 2;
  lookup_rows(ids, out, N, V, H, [&](int64_t id, float* o) {
    const int64_t col = id / kPanel * kPanel, width = std::min(kPanel, V - col);
    const uint32_t* b = w + col * H2 + (id - col);
    for (int64_t j = 0; j < H2; ++j) {
      const uint32_t word = b[j * width];
      o[2 * j] = __builtin_bit_cast(float, word << 16);
      o[2 * j + 1] = __builtin_bit_cast(float, word & 0xffff0000u);
    }
  });
}

}  // namespace
