// Paged attention (the PagedAttention kernel): rotary, the cache write, and each token's attention
// over its sequence's cached K/V, read through the block tables.

#pragma once

#include "common.h"

namespace {

// Attention's inner loops run in the kernels' vector (vreg, common.h): a v16 with AVX-512; with
// AVX2 8 lanes, one ymm register. A v16 there is a pair of them, and GCC kept those loops' v16 arrays on the
// stack, moved them through general registers and built each broadcast of a weight lane by lane
// (Haswell kernels on a Zen 4, 3 alternating rounds: the decode attention of 16 sequences at
// context 512 of the demo model's 30 layers, scripts/measure_attention.py, took 71-89 ms over a
// float32 cache and 76-85 over a bfloat16 one, against 20-26 and 14-19 in 8 lanes; a 1024-token
// prefill 7.5-8.3 s against 2.2-2.3; kernels.cc for Haswell compiled in 35 s against 13).
//
// The register blocks, which with AVX2 fit its 16 registers:
//   a prefill tile's   kScoreHeads query heads by kScoreKeys keys (tile_scores; 16 token lanes,
//                      with AVX2 in two halves), kPvRows tokens by kPvVecs vectors of D (tile_pv):
//                      24 and 28 accumulators with AVX-512, 12 and 12 with AVX2 (tile_pv there
//                      6 tokens by 2 vectors: 3 by 4 took 17 registers with its 4 V vectors and
//                      a broadcast, and GCC kept an accumulator on the stack, its FMA waiting on
//                      a store and a load every key; the demo model's prefill of one 512-token
//                      prompt, Zen 3, 3 alternating rounds: 793.6-839.6 ms against 837.2-893.3,
//                      1024 tokens 2024-2155 against 2129-2343)
//   a decode token's   kDecodeKeys positions by 3 query heads (block_scores), and up to kShared
//                      query heads by kValueChunk values of D (block_values; with AVX2 16
//                      values, 2 vectors: with 32, a bfloat16 cache's 4 widened vectors, 12 or 16
//                      accumulators and a broadcast left one or more accumulators on the stack;
//                      the demo model's 30 layers, 16 sequences at context 2048, 8 alternating
//                      passes, Zen 3: bfloat16 cache 98.9 ms against 104.5, float32 198.4
//                      against 212.9)
#ifdef __AVX512F__
constexpr int kScoreHeads = 3, kScoreKeys = 8, kPvRows = 7, kPvVecs = 4;
constexpr int kDecodeKeys = 8, kValueChunk = 64;
#else
constexpr int kScoreHeads = 3, kScoreKeys = 4, kPvRows = 6, kPvVecs = 2;
constexpr int kDecodeKeys = 4, kValueChunk = 16;
#endif

// Scores of a prefill tile for GC query heads of one KV group: s[g][j] (16 token lanes) =
// sum_d qt[g][d] k_j[d], kScoreKeys keys at a time: per d, GC query loads and kScoreKeys key
// broadcasts feed kScoreKeys GC FMAs. In vreg vectors: with AVX2 the tile's 16 lanes in two
// halves, one after the other (the keys read again, from the cache).
template <typename T, int GC>
void tile_scores(const v16* qt, int64_t D, const T* const* krow, int64_t len, v16* s, int64_t ld) {
  constexpr int KEYS = kScoreKeys, HALVES = 16 / kLanes;
  const vreg* qv = reinterpret_cast<const vreg*>(qt);
  vreg* sv = reinterpret_cast<vreg*>(s);
  for (int hf = 0; hf < HALVES; ++hf) {
    int64_t j = 0;
    for (; j + KEYS <= len; j += KEYS) {
      vreg acc[GC][KEYS] = {};
      const T* const* k = krow + j;
      for (int64_t d = 0; d < D; ++d) {
        vreg q[GC];
#pragma GCC unroll 4
        for (int g = 0; g < GC; ++g) q[g] = qv[(g * D + d) * HALVES + hf];
#pragma GCC unroll 8
        for (int t = 0; t < KEYS; ++t) {
          const float kv = static_cast<float>(k[t][d]);
#pragma GCC unroll 4
          for (int g = 0; g < GC; ++g) acc[g][t] += q[g] * kv;
        }
      }
      for (int g = 0; g < GC; ++g)
        for (int t = 0; t < KEYS; ++t) sv[(g * ld + j + t) * HALVES + hf] = acc[g][t];
    }
    for (; j < len; ++j) {
      vreg acc[GC] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float kv = static_cast<float>(krow[j][d]);
        for (int g = 0; g < GC; ++g) acc[g] += qv[(g * D + d) * HALVES + hf] * kv;
      }
      for (int g = 0; g < GC; ++g) sv[(g * ld + j) * HALVES + hf] = acc[g];
    }
  }
}

// P V of a prefill tile for R of its tokens (lanes i0.. of p[j]) over C vreg vectors of consecutive
// values of D (the caller offsets voff and a): a[r][:] = sum_{j < len} p[j][i0 + r] v_j[:]. Per
// key, C V loads and R broadcasts feed R C FMAs (up to kPvRows kPvVecs accumulators). p is zero
// past a token's own keys, so the tokens share one loop over the longest of their lengths.
template <typename T, int R, int C>
void tile_pv(const v16* p, int64_t i0, const T* const* krow, std::ptrdiff_t voff, int64_t len, float* a,
             int64_t lda) {
  vreg acc[R][C] = {};
  for (int64_t j = 0; j < len; ++j) {
    const T* v = krow[j] + voff;
    vreg vv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) vv[c] = loadr(v + kLanes * c);
    const float* pj = reinterpret_cast<const float*>(p + j) + i0;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float w = pj[r];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] += w * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) storer(a + r * lda + kLanes * c, acc[r][c]);
}

// T: the queries' and the output's element; C: the KV cache's, T or Bf16 (a job computing in
// bfloat16 on the CPU: K and V rounded as they are written, widened to float32 as they are read).
template <typename T, typename C = T>
struct PagedAttention {
  static constexpr int64_t QT = 16;   // query tokens of one sequence computed together (a prefill tile)
  static constexpr int kShared = 4;   // query heads of a KV head that weigh its values together
  // How many blocks ahead a decode token asks for its K and V blocks: 2 measured faster than 3
  // for a float32 cache (alternating rounds, scripts/measure_attention.py), 1 and 4 no faster.
  static constexpr int64_t kAheadBlocks = 2;

  const T* q;                         // the rotated queries, in `out` (see write())
  const C *kc, *vc;
  const int32_t *tables, *rows, *lens;
  T* out;
  int64_t N, H, D, KV, MB, bs, G;
  float scale;

  // n values of x into the cache at o: as they are, or rounded to bfloat16.
  static void to_cache(const T* x, C* o, int64_t n) {
    if constexpr (std::is_same_v<C, T>) {
      std::copy(x, x + n, o);
    } else {
      for (int64_t i = 0; i < n; ++i) o[i].bits = bf16_rounded(static_cast<float>(x[i]));
    }
  }

  // Each token's rotated K (normed first if qn) and its V into the cache at its slot, its
  // rotated q into `out`. A cache of another element takes K once rotated, from a row of T.
  struct Writer {
    const T *qkv, *qn, *kn;
    float eps;
    const T *cos, *sin;
    C *kc, *vc;
    const int32_t* slots;
    T* out;
    int64_t H, KV, D;

    void token(int64_t n) const {
      thread_local std::vector<T> k_row;
      const T* c = cos + n * D / 2;
      const T* s = sin + n * D / 2;
      const T* q = qkv + n * (H + 2 * KV) * D;
      const T* k = q + H * D;
      const T* v = k + KV * D;
      T* qo = out + n * H * D;
      const int64_t row = static_cast<int64_t>(slots[n]) * KV * D;
      T* ko;
      if constexpr (std::is_same_v<C, T>) {
        ko = kc + row;
      } else {
        k_row.resize(KV * D);
        ko = k_row.data();
      }
      if (qn) {
        for (int64_t h = 0; h < H; ++h) norm_row(q + h * D, qn, eps, qo + h * D, D);
        for (int64_t h = 0; h < KV; ++h) norm_row(k + h * D, kn, eps, ko + h * D, D);
        q = qo;
        k = ko;
      }
      rotate(q, H, D, c, s, qo);
      rotate(k, KV, D, c, s, ko);
      if constexpr (!std::is_same_v<C, T>) to_cache(ko, kc + row, KV * D);
      to_cache(v, vc + row, KV * D);
    }

    void all(int64_t N) const {
      parallel_for(N, 16, [&](int64_t n) { token(n); });
    }
  };

  // Cache rows (K; V at the same offset) of positions 0..len-1 of token n's sequence, KV head h.
  void key_rows(int64_t n, int64_t h, int64_t len, std::vector<const C*>& krow) const {
    const int32_t* table = tables + static_cast<int64_t>(rows[n]) * MB;
    krow.resize(len);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t slot = static_cast<int64_t>(table[j / bs]) * bs + j % bs;
      krow[j] = kc + (slot * KV + h) * D;
    }
  }

  // A decode token reads its cache rows block by block: the positions of a block are consecutive
  // slots, so their rows for one KV head lie `stride` = KV * D values apart and a loop over them
  // holds one pointer (through a pointer per position, as a prefill tile reads them, the decode
  // loops kept 16 of them in spilled registers).

  // Scores of GC query heads (q: their rows [GC][D], scaled) over P consecutive positions of a
  // block (k: the first's row of their KV head) into s[g * ls + t]: each K vector is read (and
  // widened from a bfloat16 cache) once for the GC heads.
  template <int P, int GC>
  static void block_scores(const float* q, int64_t D, const C* k, int64_t stride, float* s, int64_t ls) {
    vreg acc[GC][P];
#pragma GCC unroll 4
    for (int g = 0; g < GC; ++g)
#pragma GCC unroll 8
      for (int t = 0; t < P; ++t) acc[g][t] = vreg{};
    for (int64_t d = 0; d < D; d += kLanes) {
      vreg qd[GC];
#pragma GCC unroll 4
      for (int g = 0; g < GC; ++g) qd[g] = loadr(q + g * D + d);
#pragma GCC unroll 8
      for (int t = 0; t < P; ++t) {
        const vreg x = loadr(k + t * stride + d);
#pragma GCC unroll 4
        for (int g = 0; g < GC; ++g) acc[g][t] += qd[g] * x;
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GC; ++g) sum8<P>(acc[g], s + g * ls);
  }

  // R query heads add the values of a block's nb positions (v: the first's row of their KV head,
  // offset to 16 CV values of D) weighted by their scores (s: head r's at s + r * ls) to their
  // sums (acc: head r's at acc + r * D), which stay in registers over the block.
  template <int R, int CV>
  static void block_values(const float* s, int64_t ls, const C* v, int64_t stride, int64_t nb, float* acc,
                           int64_t D) {
    constexpr int NV = CV * 16 / kLanes;        // CV 16 values of D, in vectors
    vreg e[R][NV];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) e[r][c] = loadr(acc + r * D + kLanes * c);
    for (int64_t t = 0; t < nb; ++t) {
      vreg x[NV];
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) x[c] = loadr(v + t * stride + kLanes * c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const float w = s[r * ls + t];
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) e[r][c] += w * x[c];
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) storer(acc + r * D + kLanes * c, e[r][c]);
  }

  // Share `unit` (`per` lines each) of a block of `lines` lines, asked for into L2: each piece
  // of a block's work asks for a share of the block kAheadBlocks on (the hardware prefetcher
  // follows the rows within a block, not the jump to another). The callers divide once a block
  // (two divisions a share took ~7% of a decode token's attention at context 64).
  static void prefetch_share(const void* block, int64_t lines, int64_t per, int64_t unit) {
    if (block == nullptr) return;
    const int64_t from = unit * per, to = std::min(lines, from + per);
    prefetch(static_cast<const char*>(block) + from * 64, (to - from) * 64);
  }

  // With AVX2, a decode token's scores of positions t0.. for KV head h also ask for the next
  // kDecodeKeys positions' rows of that head into L1, and its values of D chunk c0 for the next
  // chunk's line of each position (the next head's first where c0 is the last): each comes from
  // L2, where prefetch_share put it, before the loop reaches it. The demo model's 30 layers from
  // memory, float32 cache, Zen 3, alternating passes: 16 sequences at context 64 5.39 ms against
  // 5.68 (32 of 40 faster), at 1024 71.3 against 75.4, 64 sequences at 64 18.4 against 19.6;
  // the scores' part alone (in a run at 6.07 ms against 5.62 for both) 5.80, the values' 5.86;
  // a bfloat16 cache the same (3.63 against 3.63). Not measured with AVX-512, which goes
  // without them.
  static constexpr bool kRowsIntoL1 = sizeof(vreg) == 32;
  static void rows_into_l1(const C* row, int64_t rows, int64_t stride, int64_t bytes) {
    for (int64_t t = 0; t < rows; ++t) prefetch<3>(row + t * stride, bytes);
  }

  // K block j of token `follow`'s sequence (nullptr past its blocks, or for no token, -1): what
  // a thread asks for at the end of a token when it knows the token it computes next.
  const C* follow_block(int64_t follow, int64_t j) const {
    if (follow < 0 || j >= (static_cast<int64_t>(lens[follow]) + bs - 1) / bs) return nullptr;
    const int32_t* table = tables + static_cast<int64_t>(rows[follow]) * MB;
    return kc + static_cast<int64_t>(table[j]) * bs * KV * D;
  }

  // One token (a decode step's), all its H query heads over its `len` positions: the scores
  // block by block, their softmax, then the values block by block. Each K and V row is read once.
  // A part (`part` given: run() splits a long sequence of a small step) reads blocks b0..b1-1
  // only and leaves in `part` each head's score max, its sum of exp(score - max) and its values
  // weighted by those [H][D], for run() to put together.
  void one(int64_t n, int64_t b0 = 0, int64_t b1 = -1, float* part = nullptr, int64_t follow = -1) const {
    thread_local std::vector<float> qv, acc, s;
    T* o = out + n * H * D;
    const int64_t len = lens[n];
    if (len <= 0) {
      std::fill(o, o + H * D, T(0));
      return;
    }
    const int64_t blocks = b1 < 0 ? (len + bs - 1) / bs : b1, from = b0 * bs;
    const int64_t count = std::min(len, blocks * bs) - from;           // the positions read
    qv.resize(H * D);
    acc.assign(H * D, 0.f);
    s.resize(H * count);
    for (int64_t i = 0; i < H * D; ++i) qv[i] = static_cast<float>(q[n * H * D + i]) * scale;
    if (D % 16 != 0) {
      one_by_rows(n, len, qv.data(), s.data(), acc.data());     // (every position: run() splits no such token)
    } else {
      const int32_t* table = tables + static_cast<int64_t>(rows[n]) * MB;
      const int64_t stride = KV * D;
      const int64_t lines = (bs * stride * static_cast<int64_t>(sizeof(C)) + 63) / 64;     // of a block
      auto block = [&](const C* cache, int64_t b) { return cache + static_cast<int64_t>(table[b]) * bs * stride; };
      for (int64_t b = b0; b < std::min(b0 + kAheadBlocks, blocks); ++b)
        prefetch_share(block(kc, b), lines, lines, 0);
      for (int64_t b = b0; b < blocks; ++b) {
        const int64_t j0 = b * bs - from, nb = std::min(bs, len - b * bs);
        const int64_t units = (nb + kDecodeKeys - 1) / kDecodeKeys * KV;
        const int64_t per = (lines + units - 1) / units;
        const C* kb = block(kc, b);
        const int64_t a = b + kAheadBlocks;
        const C* next = a < blocks ? block(kc, a) : b0 + a - blocks < blocks ? block(vc, b0 + a - blocks) : nullptr;
        for (int64_t t0 = 0, unit = 0; t0 < nb; t0 += kDecodeKeys)
          for (int64_t h = 0; h < KV; ++h, ++unit) {
            prefetch_share(next, lines, per, unit);
            if (kRowsIntoL1 && t0 + kDecodeKeys < nb)
              rows_into_l1(kb + (t0 + kDecodeKeys) * stride + h * D,
                           std::min<int64_t>(kDecodeKeys, nb - t0 - kDecodeKeys), stride,
                           D * static_cast<int64_t>(sizeof(C)));
            for (int64_t g0 = 0; g0 < G; g0 += 3)
              with_count<kDecodeKeys>(std::min<int64_t>(kDecodeKeys, nb - t0), [&](auto p) {
                with_count<3>(std::min<int64_t>(3, G - g0), [&](auto gc) {
                  block_scores<p, gc>(qv.data() + (h * G + g0) * D, D, kb + t0 * stride + h * D, stride,
                                      s.data() + (h * G + g0) * count + j0 + t0, count);
                });
              });
          }
      }
      softmax_rows(s.data(), H, count, part, part ? part + H : nullptr);
      const int64_t groups = (G + kShared - 1) / kShared, chunks = (D + kValueChunk - 1) / kValueChunk;
      const int64_t per = (lines + KV * groups * chunks - 1) / (KV * groups * chunks);
      for (int64_t b = b0; b < blocks; ++b) {
        const int64_t j0 = b * bs - from, nb = std::min(bs, len - b * bs);
        const C* vb = block(vc, b);
        const C* next = b + kAheadBlocks < blocks ? block(vc, b + kAheadBlocks)
                                                  : follow_block(follow, b + kAheadBlocks - blocks);
        for (int64_t h = 0, unit = 0; h < KV; ++h)
          for (int64_t g0 = 0; g0 < G; g0 += kShared)
            for (int64_t c0 = 0; c0 < D; c0 += kValueChunk, ++unit) {
              prefetch_share(next, lines, per, unit);
              if (kRowsIntoL1 && h * D + c0 + kValueChunk < stride)
                rows_into_l1(vb + h * D + c0 + kValueChunk, nb, stride, kValueChunk * static_cast<int64_t>(sizeof(C)));
              with_count<kShared>(std::min<int64_t>(kShared, G - g0), [&](auto r) {
                with_count<kValueChunk / 16>(std::min<int64_t>(kValueChunk / 16, (D - c0) / 16), [&](auto cv) {
                  block_values<r, cv>(s.data() + (h * G + g0) * count + j0, count, vb + h * D + c0, stride, nb,
                                      acc.data() + (h * G + g0) * D + c0, D);
                });
              });
            }
      }
    }
    if (part != nullptr) {
      std::copy(acc.begin(), acc.end(), part + 2 * H);
      return;
    }
    for (int64_t i = 0; i < H * D; ++i) o[i] = static_cast<T>(acc[i]);
  }

  // Token n's output from its `parts` parts (as `one` leaves them, one after another): each head's
  // values weighted by exp(score - the head's max over all parts), over their sum.
  void merge(int64_t n, const float* parts, int64_t count) const {
    const int64_t size = 2 * H + H * D;
    T* o = out + n * H * D;
    std::vector<float> sum(D);
    for (int64_t h = 0; h < H; ++h) {
      float m = parts[h];
      for (int64_t p = 1; p < count; ++p) m = std::max(m, parts[p * size + h]);
      float total = 0.f;
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t p = 0; p < count; ++p) {
        const float* part = parts + p * size;
        const float w = expf(part[h] - m);
        total += w * part[H + h];
        for (int64_t d = 0; d < D; ++d) sum[d] += w * part[2 * H + h * D + d];
      }
      for (int64_t d = 0; d < D; ++d) o[h * D + d] = static_cast<T>(sum[d] / total);
    }
  }

  // `one` for a head size that is not a multiple of 16: position by position, a vector loop
  // along D for each query head.
  void one_by_rows(int64_t n, int64_t len, const float* qv, float* s, float* acc) const {
    thread_local std::vector<const C*> krow;
    key_rows(n, 0, len, krow);
    const int64_t block_bytes = KV * D * static_cast<int64_t>(sizeof(C));
    const std::ptrdiff_t voff = vc - kc;
    for (int64_t j = 0; j < len; ++j) {
      const C* k = krow[j];
      if (j + kAhead < len) prefetch(krow[j + kAhead], block_bytes);
      for (int64_t hq = 0; hq < H; ++hq) {
        const float* qh = qv + hq * D;
        const C* kh = k + hq / G * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * static_cast<float>(kh[d]);
        s[hq * len + j] = dot;
      }
    }
    softmax_rows(s, H, len);
    for (int64_t j = 0; j < len; ++j) {
      const C* v = krow[j] + voff;
      if (j + kAhead < len) prefetch(krow[j + kAhead] + voff, block_bytes);
      for (int64_t hq = 0; hq < H; ++hq) {
        const float w = s[hq * len + j];
        const C* vh = v + hq / G * D;
        float* a = acc + hq * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<float>(vh[d]);
      }
    }
  }

  // count (<= QT) consecutive tokens n0.. of one sequence at consecutive positions (a prefill
  // chunk), KV head h: each K row is read once for all of them, and the scores accumulate
  // across the tokens (16 lanes of one vector) rather than along D, so no horizontal sums.
  void tile(int64_t n0, int64_t count, int64_t h) const {
    thread_local std::vector<v16> qt, s;            // qt [g][d], s [g][j]: 16 tokens a vector
    thread_local std::vector<const C*> krow;
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
    for (int64_t g0 = 0; g0 < G; g0 += kScoreHeads) {
      const v16* qg = qt.data() + g0 * D;
      v16* sg = s.data() + g0 * len;
      with_count<kScoreHeads>(std::min<int64_t>(kScoreHeads, G - g0),
                              [&](auto gc) { tile_scores<C, gc>(qg, D, krow.data(), len, sg, len); });
    }
    // softmax of each token (lane) over its own keys j < tok_len[i], in the CPU's own vectors:
    // with AVX2 the 16 lanes in two halves, as tile_scores computes them (in 16-lane vectors
    // GCC moved every one through the stack: a 512-token prompt's attention in the demo model's
    // 30 layers took 293.8 ms against 144.6, 1024 tokens 1157 against 543, Zen 3; the same bits)
    constexpr int HALVES = 16 / kLanes;
    typedef int32_t lanes_i __attribute__((vector_size(sizeof(vreg))));
    lanes_i half_lens[HALVES];
    for (int hf = 0; hf < HALVES; ++hf)
      for (int i = 0; i < kLanes; ++i) half_lens[hf][i] = lane_len[hf * kLanes + i];
    for (int64_t g = 0; g < G; ++g) {
      vreg* sg = reinterpret_cast<vreg*>(s.data() + g * len);
      for (int hf = 0; hf < HALVES; ++hf) {
        const lanes_i half_len = half_lens[hf];
        vreg m = vreg{} - 3.0e38f, sum = {};
        for (int64_t jj = 0; jj < len; ++jj) {
          const lanes_i seen = (lanes_i{} + static_cast<int32_t>(jj)) < half_len;
          const vreg x = sg[jj * HALVES + hf];
          m = seen ? (x > m ? x : m) : m;
        }
        for (int64_t jj = 0; jj < len; ++jj) {
          const lanes_i seen = (lanes_i{} + static_cast<int32_t>(jj)) < half_len;
          vreg& x = sg[jj * HALVES + hf];
          alignas(64) float e[kLanes];
          storer(e, seen ? x - m : vreg{});   // unseen lanes: exp(0), not an overflow (slow path)
#pragma omp simd simdlen(kLanes)   // one expf of the vector: in halves the load below stalled
          for (int i = 0; i < kLanes; ++i) e[i] = expf(e[i]);
          x = seen ? loadr(e) : vreg{};
          sum += x;
        }
        const vreg inv = sum > 0.f ? 1.f / sum : vreg{};
        for (int64_t jj = 0; jj < len; ++jj) sg[jj * HALVES + hf] *= inv;
      }
    }
    // P V in groups of up to kPvRows tokens: kPvVecs vectors of D at a time held in registers,
    // the last D mod 16 (an odd head size) one value at a time
    const std::ptrdiff_t voff = vc - kc;
    const int64_t D16 = D / 16 * 16, groups = (count + kPvRows - 1) / kPvRows;
    thread_local std::vector<float> a;
    a.resize(kPvRows * D);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i0 = 0, k = 0; k < groups; ++k) {
        const int64_t r = count / groups + (k < count % groups), n = tok_len[i0 + r - 1];
        const v16* p = s.data() + g * len;
        for (int64_t c = 0; c < D16; c += kLanes * kPvVecs)
          with_count<kPvRows>(r, [&](auto rows) {
            with_count<kPvVecs>(std::min<int64_t>(kPvVecs, (D16 - c) / kLanes), [&](auto vecs) {
              tile_pv<C, rows, vecs>(p, i0, krow.data(), voff + c, n, a.data() + c, D);
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

  // Whether no two tokens are of one sequence (row of the block tables); padding tokens (no
  // positions) read nothing.
  bool distinct_rows() const {
    std::vector<int32_t> r;
    for (int64_t n = 0; n < N; ++n)
      if (lens[n] > 0) r.push_back(rows[n]);
    std::sort(r.begin(), r.end());
    return std::adjacent_find(r.begin(), r.end()) == r.end();
  }

  // The step's attention after `writer` has written each token (a decode step's single tokens of
  // distinct sequences: each in its own run, just before its attention, so that its q and K/V
  // rows are still in the thread's cache and no pass over the step writes them first).
  void run(const Writer& writer) const {
    // Work items: runs of 4 to QT consecutive tokens of one sequence at consecutive positions
    // (prefill tiles), one item per KV head, and single tokens, one item for all heads. When
    // fewer single tokens than twice the threads would leave threads idle (a decode step of one
    // to a few sequences), a token of two or more blocks is split into parts of whole blocks,
    // an item each, put together once all are done (merge).
    // The longest items go first (their cost, positions read times query heads), so that the
    // threads finish together: in index order a long sequence's item could come last.
    struct Item {
      int64_t n0, count, h, cost, b0 = 0, b1 = -1, part = -1;
    };
    std::vector<Item> items;
    std::vector<int64_t> single;
    for (int64_t n = 0, end; n < N; n = end) {
      for (end = n + 1; end < N && end - n < QT && lens[end] > 1 && rows[end] == rows[n] &&
                        lens[end] == lens[end - 1] + 1;)
        ++end;
      if (end - n >= 4 && lens[n] > 0) {
        for (int64_t h = 0; h < KV; ++h) items.push_back({n, end - n, h, lens[end - 1] * (end - n) * G});
      } else {
        for (int64_t i = n; i < end; ++i) single.push_back(i);
      }
    }
    const int64_t threads = threads_now();
    const int64_t want = 2 * threads, singles = static_cast<int64_t>(single.size()), size = 2 * H + H * D;
    // parts a token (a step of prefill tiles alone has no single token to split)
    const int64_t share = singles > 0 && singles < want && D % 16 == 0 ? (want + singles - 1) / singles : 1;
    std::vector<std::pair<int64_t, int64_t>> split;          // (token, its parts), parts in order
    int64_t parts = 0;
    for (int64_t i : single) {
      const int64_t blocks = (std::max<int64_t>(lens[i], 0) + bs - 1) / bs, pieces = std::min(blocks, share);
      if (pieces < 2) {
        items.push_back({i, 1, -1, lens[i] * H});
        continue;
      }
      split.push_back({i, pieces});
      for (int64_t p = 0; p < pieces; ++p) {
        const int64_t b0 = blocks * p / pieces, b1 = blocks * (p + 1) / pieces;
        items.push_back({i, 1, -1, (b1 - b0) * bs * H, b0, b1, parts++});
      }
    }
    std::vector<float> held(parts * size);
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    const int64_t count = static_cast<int64_t>(items.size());
    if (parts == 0 && count == singles && count >= 2 * threads && D % 16 == 0 && distinct_rows()) {
      // Single tokens alone (a decode step): one run per thread, items r, r + runs, ... (the
      // longest first, dealt round), each token asking for its successor's first K blocks as it
      // finishes, so that a thread starts no token but its run's first on a cold cache; a thread
      // that ends its run takes the others' last tokens (runs_taken). A token reads no other
      // token's K/V (each is of its own sequence), so each is written as its attention begins.
      const int64_t runs = threads;
      runs_taken(runs, [&](int64_t r) { return std::pair<int64_t, int64_t>{0, (count - r + runs - 1) / runs}; },
                 [&](int64_t r, int64_t k, int64_t next, bool) {
                   const int64_t n = items[r + k * runs].n0;
                   writer.token(n);
                   one(n, 0, -1, nullptr, next >= 0 ? items[r + next * runs].n0 : -1);
                 },
                 [](int64_t) {});
      return;
    }
    writer.all(N);
    parallel_for(count, 1, [&](int64_t i) {
      const Item& it = items[i];
      if (it.h >= 0) {
        tile(it.n0, it.count, it.h);
      } else if (it.part >= 0) {
        one(it.n0, it.b0, it.b1, held.data() + it.part * size);
      } else {
        one(it.n0);
      }
    });
    for (int64_t k = 0, first = 0; k < static_cast<int64_t>(split.size()); first += split[k++].second)
      merge(split[k].first, held.data() + first * size, split[k].second);
  }
};

template <typename T, typename C = T>
void attend(const T* qkv, const T* qn, const T* kn, float eps, const T* cos, const T* sin, C* kc, C* vc,
            const int32_t* slots, const int32_t* tables, const int32_t* rows, const int32_t* lens, T* out, int64_t N,
            int64_t H, int64_t D, int64_t KV, int64_t MB, int64_t bs) {
  const typename PagedAttention<T, C>::Writer writer{qkv, qn, kn, eps, cos, sin, kc, vc, slots, out, H, KV, D};
  PagedAttention<T, C>{out, kc, vc, tables, rows, lens, out, N, H, D, KV, MB, bs, H / KV,
                       1.0f / std::sqrt(static_cast<float>(D))}.run(writer);
}

}  // namespace
