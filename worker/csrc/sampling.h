// The device sampler's passes over a rank's vocabulary shard of the logits (worker/device_sampler.py):
// one call per pass where MindSpore's CPU backend runs TopK, ReduceMax, ArgMax, Exp, ReduceSum and
// CumSum over the whole row apiece (about 10x the time of these loops at a vocabulary of 49,152).
// Rows are shared among the pool's threads. x holds R shards' rows one shard after another
// ([R * M, P]; R = 1 in a worker), of which shard r has cols[r] real columns (the rest pad the
// last shard of a vocabulary that tp does not divide); the per-row parameters are per row of a
// shard ([M, k]). Columns are the shard's; the caller adds its offset.

#pragma once

#include <limits>

#include "common.h"

namespace {

constexpr float kOff = -1e30f;   // a threshold that keeps everything (device_sampler.OFF)

// A row's greedy column: the first of the largest among its n real columns (a NaN is never
// larger; column 0 when n is 0). stats_row's column for C = 1 and GreedyRows' token. It checks
// 1024 values at a time against the best (blocks of 64 took 1.4-1.7x the time).
inline int32_t greedy_row(const float* r, int64_t n) {
  if (n <= 0) return 0;
  constexpr int64_t kBlock = 1024;
  float best = r[0];
  int64_t at = 0, j = 1;
  for (; j + kBlock <= n; j += kBlock) {
    float most = r[j];
#pragma omp simd reduction(max : most) simdlen(16)
    for (int64_t l = 1; l < kBlock; ++l) most = r[j + l] > most ? r[j + l] : most;
    if (most <= best) continue;                      // (a NaN max: the block one by one)
    for (int64_t l = 0; l < kBlock; ++l)
      if (r[j + l] > best) best = r[j + l], at = j + l;
  }
  for (; j < n; ++j)
    if (r[j] > best) best = r[j], at = j;
  return static_cast<int32_t>(at);
}

// One row r of n real columns: o [4 + 2C] = max, its column (the first), sum exp(x - max) (0
// unless with_sum), sum exp((x - max) / t) (0 unless t > 0), the C largest values in descending
// order (ties: lower column first; -1e30 past the row's real columns), their columns.
// The C largest are kept in a min-heap while the row streams by; a block of 64 values whose max
// is not above the heap's least is skipped after one vector max, so a row costs about one read.
inline void stats_row(const float* r, int64_t n, int64_t C, bool with_sum, float t, float* o) {
  std::vector<std::pair<float, int64_t>> heap;   // (value, column): the least value, then the last column, on top
  heap.reserve(C);
  auto above = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  auto offer = [&](int64_t j) {
    if (static_cast<int64_t>(heap.size()) < C) {
      heap.emplace_back(r[j], j);
      std::push_heap(heap.begin(), heap.end(), above);
    } else if (r[j] > heap.front().first) {
      std::pop_heap(heap.begin(), heap.end(), above);
      heap.back() = {r[j], j};
      std::push_heap(heap.begin(), heap.end(), above);
    }
  };
  if (C == 1 && n > 0) {                           // the largest alone: greedy_row's scan
    const int64_t at = greedy_row(r, n);
    heap.emplace_back(r[at], at);
  } else {
    constexpr int64_t kBlock = 64;
    int64_t j = 0;
    for (; j < std::min(n, C); ++j) offer(j);
    for (; j + kBlock <= n; j += kBlock) {
      float most = r[j];
#pragma omp simd reduction(max : most)
      for (int64_t l = 1; l < kBlock; ++l) most = r[j + l] > most ? r[j + l] : most;
      if (most <= heap.front().first) continue;
      for (int64_t l = 0; l < kBlock; ++l) offer(j + l);
    }
    for (; j < n; ++j) offer(j);
  }
  if (heap.empty()) heap.emplace_back(kOff, 0);     // a shard of padding alone
  std::sort(heap.begin(), heap.end(), above);
  const float m = heap.front().first;
  float sum = 0.f, sum_t = 0.f;
  if (with_sum) {
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < n; ++k) sum += expf(r[k] - m);
  }
  if (t > 0.f) {
#pragma omp simd reduction(+ : sum_t)
    for (int64_t k = 0; k < n; ++k) sum_t += expf((r[k] - m) / t);
  }
  o[0] = m;
  o[1] = static_cast<float>(heap.front().second);
  o[2] = sum;
  o[3] = sum_t;
  for (int64_t k = 0; k < C; ++k) {
    const bool has = k < static_cast<int64_t>(heap.size());
    o[4 + k] = has ? heap[k].first : kOff;
    o[4 + C + k] = has ? static_cast<float>(heap[k].second) : 0.f;
  }
}

// One row: the sum of exp((x - g) / t) over the columns where (x - g) / t >= tau.
inline float kept_row(const float* r, int64_t n, float g, float t, float tau) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < n; ++k) {
    const float y = (r[k] - g) / t;          // as the sampler computes the threshold: a division
    sum += y >= tau ? expf(y) : 0.f;
  }
  return sum;
}

// One row: the first column where the running sum of the kept weights exp((x - g) / t) (those
// with (x - g) / t >= tau) exceeds target, or the last column with a positive kept weight when
// none does (rounding at the very end), or 0 when none has one. The sums go 16 columns at a time
// and only the block that crosses the target is walked one column at a time.
inline int64_t draw_row(const float* r, int64_t n, float g, float t, float tau, float target) {
  auto weight = [&](int64_t k) {
    const float y = (r[k] - g) / t;
    return y >= tau ? expf(y) : 0.f;
  };
  float run = 0.f;
  int64_t found = -1, last = -1, j = 0;
  for (; j + 16 <= n && found < 0; j += 16) {
    float w[16], block = 0.f;
#pragma omp simd reduction(+ : block)
    for (int l = 0; l < 16; ++l) {
      w[l] = weight(j + l);
      block += w[l];
    }
    if (run + block <= target) {
      run += block;
      for (int l = 15; l >= 0; --l) {
        if (w[l] > 0.f) {
          last = j + l;
          break;
        }
      }
      continue;
    }
    for (int l = 0; l < 16 && found < 0; ++l) {
      run += w[l];
      if (w[l] > 0.f) last = j + l;
      if (run > target) found = j + l;
    }
  }
  for (; j < n && found < 0; ++j) {
    const float w = weight(j);
    run += w;
    if (w > 0.f) last = j;
    if (run > target) found = j;
  }
  return found >= 0 ? found : std::max<int64_t>(last, 0);
}

// The answer of VocabSampler.sample for one row from every rank's stats_row (st: rank r's at
// st + r * stride, columns shifted by starts[r]), in the float32 steps the primitives take:
// prm [5] = (temperature (0: greedy), top_k (0: off), top_p (1: off), min_p (0: off), u);
// kept [tp] = each rank's sum of exp((x - g) / t) where (x - g) / t >= log(min_p), from a pass
// over the rows (kept_row), needed only where min_p is on and top_k off. o [2 + 2K + 5] = the
// token (-1: in a rank's shard, drawn by draw_row there), its log-probability (without the drawn
// logit when -1), the K most likely tokens' log-probabilities and their ids, and for a draw over
// the whole vocabulary (owner rank, target in its shard, g, t, tau), the arguments of draw_row.
//  - greedy: the largest logit's token, the first rank's in a tie (the lowest id).
//  - top_k or top_p on: the kept tokens are among the C global candidates: those with
//    y = (v - g) / t at or above top_k's k-th and log(min_p); top_p then keeps them, most likely
//    first, while the mass before them is under top_p of the mass min_p and top_k keep (that of
//    the candidates with top_k; of every rank's kept with min_p; otherwise sum exp((x - g) / t)
//    from the ranks' sums). The draw is the inverse CDF of u over them in token-id order.
//  - neither: the whole vocabulary above log(min_p) (or all of it); the rank whose part of the
//    cumulative kept sums (in rank order) holds u x their total owns the draw.
inline void merge_row(const float* st, int64_t stride, int64_t tp, int64_t C, const float* starts, const float* prm,
                      const float* kept, int64_t K, float* o) {
  const float t = prm[0], top_p = prm[2], min_p = prm[3], u = prm[4];
  const int64_t top_k = static_cast<int64_t>(prm[1]);
  auto rank = [&](int64_t r) { return st + r * stride; };
  int64_t best = 0;
  for (int64_t r = 1; r < tp; ++r)
    if (rank(r)[0] > rank(best)[0]) best = r;
  const float g = rank(best)[0];
  float z = 0.f;
  for (int64_t r = 0; r < tp; ++r) z += rank(r)[2] * expf(rank(r)[0] - g);
  const float log_z = g + logf(z);
  std::vector<std::pair<float, float>> cand;      // the global C largest (value, token), most likely first
  cand.reserve(tp * C);
  for (int64_t r = 0; r < tp; ++r)
    for (int64_t k = 0; k < C; ++k) cand.emplace_back(rank(r)[4 + k], rank(r)[4 + C + k] + starts[r]);
  std::stable_sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  cand.resize(C);
  for (int64_t k = 0; k < K; ++k) {
    o[2 + k] = cand[k].first - log_z;
    o[2 + K + k] = cand[k].second;
  }
  float* draw = o + 2 + 2 * K;                    // no draw from a shard: a target every column passes at once
  draw[0] = 0.f;
  draw[1] = -1.f;
  draw[2] = 0.f;
  draw[3] = 1.f;
  draw[4] = kOff;
  if (t <= 0.f) {
    o[0] = rank(best)[1] + starts[best];
    o[1] = g - log_z;
    return;
  }
  float tau = kOff;
  if (top_k > 0) tau = (cand[std::min(top_k, C) - 1].first - g) / t;
  const float tau_min_p = min_p > 0.f ? logf(std::max(min_p, 1e-30f)) : kOff;
  tau = std::max(tau, tau_min_p);
  std::vector<float> part(tp);                    // each rank's kept sum, over the whole vocabulary
  float total = 0.f;
  for (int64_t r = 0; r < tp; ++r) {
    part[r] = min_p > 0.f ? kept[r] : rank(r)[3] * expf((rank(r)[0] - g) / t);
    total += part[r];
  }
  if (top_k > 0 || top_p < 1.f) {
    std::vector<float> w(C);
    float mass = 0.f;
    for (int64_t k = 0; k < C; ++k) {
      const float y = (cand[k].first - g) / t;
      w[k] = y >= tau ? expf(y) : 0.f;
      mass += w[k];
    }
    if (top_p < 1.f) {
      const float limit = top_p * (top_k > 0 ? mass : total);
      float before = 0.f;
      for (int64_t k = 0; k < C; ++k) {
        const float wk = w[k];
        if (!(before < limit)) w[k] = 0.f;
        before += wk;
      }
    }
    std::vector<int64_t> order(C);               // the candidates in token-id order
    for (int64_t k = 0; k < C; ++k) order[k] = k;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cand[a].second < cand[b].second; });
    float sum = 0.f;
    for (int64_t k : order) sum += w[k];
    const float target = u * sum;
    float run = 0.f;
    int64_t found = -1, last = order[0];
    for (int64_t k : order) {
      run += w[k];
      if (w[k] > 0.f) last = k;
      if (run > target) {
        found = k;
        break;
      }
    }
    const int64_t k = found >= 0 ? found : last;
    o[0] = cand[k].second;
    o[1] = cand[k].first - log_z;
    return;
  }
  const float target = u * total;
  float run = 0.f;
  int64_t owner = -1, last = 0;
  for (int64_t r = 0; r < tp && owner < 0; ++r) {
    if (part[r] > 0.f) last = r;
    if (run + part[r] > target) owner = r;
    else run += part[r];
  }
  if (owner < 0) {                               // rounding at the very end: the last rank with mass
    owner = last;
    run = 0.f;
    for (int64_t r = 0; r < last; ++r) run += part[r];
  }
  o[0] = -1.f;
  o[1] = -log_z;
  draw[0] = static_cast<float>(owner);
  draw[1] = target - run;
  draw[2] = g;
  draw[3] = t;
  draw[4] = tau_min_p;
}

// ProcessRows: the logits as the sampling parameters that change them leave them
// (worker.sampler.Adjustments): x [Q, P] (R shards of M rows, shard r from column starts[r], of
// which cols[r] are real) -> out [Q, P]: where the row's bit in mask [M, W] (bit t % 32 of word
// t / 32 of the whole vocabulary) is clear, -inf (no mask: every bit set); then per entry
// (row, token, add, r, sub) of entries [E, 5] whose token is in the shard, v = x + add,
// x = (v > 0 ? v / r : v * r) + sub. Entries with row < 0 pad a static shape.
inline void process_rows(const float* x, const float* entries, const int32_t* mask, const int32_t* starts,
                         const int32_t* cols, float* out, int64_t Q, int64_t R, int64_t P, int64_t E, int64_t W) {
  const int64_t M = Q / R;
  const float inf = std::numeric_limits<float>::infinity();
  parallel_for(Q, 1, [&](int64_t q) {
    const float* r = x + q * P;
    float* o = out + q * P;
    const int64_t shard = q / M, row = q % M, start = starts[shard];
    if (mask == nullptr) {
      std::copy(r, r + P, o);
    } else {
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(mask + row * W);
      for (int64_t j = 0; j < P; ++j) {
        const int64_t t = start + j, w = t >> 5;
        o[j] = (j < cols[shard] && w < W && ((bits[w] >> (t & 31)) & 1u)) ? r[j] : -inf;
      }
    }
  });
  for (int64_t e = 0; e < E; ++e) {           // few entries a step: one thread
    const float* en = entries + 5 * e;
    const int64_t row = static_cast<int64_t>(en[0]), t = static_cast<int64_t>(en[1]);
    if (row < 0 || row >= M) continue;
    for (int64_t shard = 0; shard < R; ++shard) {
      const int64_t j = t - starts[shard];
      if (j < 0 || j >= cols[shard]) continue;
      float& v = out[(shard * M + row) * P + j];
      const float a = v + en[2];
      v = (a > 0.f ? a / en[3] : a * en[3]) + en[4];
    }
  }
}

// x [Q, P] holds R shards' rows (M = Q / R per shard); shard r has cols[r] real columns.
// SampleStats: out [Q, 4 + 2C], stats_row of each row, with t per row of a shard (t: null, none).
inline void sample_stats(const float* x, const float* t, const int32_t* cols, float* out, int64_t Q, int64_t R,
                         int64_t P, int64_t C, bool with_sum) {
  const int64_t M = Q / R;
  parallel_for(Q, 1, [&](int64_t q) {
    stats_row(x + q * P, cols[q / M], C, with_sum, t ? t[q % M] : 0.f, out + q * (4 + 2 * C));
  });
}

// GreedyRows: each row's greedy_row, so that a greedy step's graph ends in one operator.
inline void greedy_rows(const float* x, int64_t n, int32_t* out, int64_t M, int64_t P) {
  parallel_for(M, 1, [&](int64_t q) { out[q] = greedy_row(x + q * P, n); });
}

// KeptMass: with prm [M, 3] = (g, t, tau) per row of a shard, out [Q] = kept_row of each row.
inline void kept_mass(const float* x, const float* prm, const int32_t* cols, float* out, int64_t Q, int64_t R,
                      int64_t P) {
  const int64_t M = Q / R;
  parallel_for(Q, 1, [&](int64_t q) {
    const float* p = prm + 3 * (q % M);
    out[q] = kept_row(x + q * P, cols[q / M], p[0], p[1], p[2]);
  });
}

// CountAtLeast: with thresholds t [M] (per row of a shard), out [Q] = how many of the row's real
// columns are at or above its threshold: a scored token's rank, with its logit (VocabSampler.score).
inline void count_at_least(const float* x, const float* t, const int32_t* cols, float* out, int64_t Q, int64_t R,
                           int64_t P) {
  const int64_t M = Q / R;
  parallel_for(Q, 1, [&](int64_t q) {
    const float* r = x + q * P;
    const float v = t[q % M];
    const int64_t n = cols[q / M];
    int64_t count = 0;
#pragma omp simd reduction(+ : count)
    for (int64_t k = 0; k < n; ++k) count += r[k] >= v;
    out[q] = static_cast<float>(count);
  });
}

// DrawColumn: with prm [M, 3] = (g, t, tau) and target [Q], out [Q, 2] = (draw_row's column, x there).
inline void draw_column(const float* x, const float* prm, const float* targets, const int32_t* cols, float* out,
                        int64_t Q, int64_t R, int64_t P) {
  const int64_t M = Q / R;
  parallel_for(Q, 1, [&](int64_t q) {
    const float* r = x + q * P;
    const float* p = prm + 3 * (q % M);
    const int64_t col = draw_row(r, cols[q / M], p[0], p[1], p[2], targets[q]);
    out[2 * q] = static_cast<float>(col);
    out[2 * q + 1] = r[col];
  });
}

// SampleMerge: st [tp M, 4 + 2C] (every rank's stats_row, rank after rank), prm [M, 5], kept
// [tp M] (the ranks' kept_row under (g, t, log(min_p)), rank after rank) and starts [tp] ->
// out [M, 2 + 2K + 5], merge_row of each row.
inline void sample_merge(const float* st, const float* prm, const float* kept, const float* starts, float* out,
                         int64_t M, int64_t tp, int64_t C, int64_t K) {
  parallel_for(M, 1, [&](int64_t q) {
    std::vector<float> k(tp);
    for (int64_t r = 0; r < tp; ++r) k[r] = kept[r * M + q];
    merge_row(st + q * (4 + 2 * C), M * (4 + 2 * C), tp, C, starts, prm + 5 * q, k.data(), K,
              out + q * (2 + 2 * K + 5));
  });
}

// SampleRows, the whole of VocabSampler.sample for one shard holding the whole vocabulary (tp 1):
// x [M, P] with n real columns, prm [M, 5] -> out [M, 2 + 2K] = (token, its log-probability, the
// K most likely tokens' log-probabilities, their ids), C candidates: stats_row, the kept pass
// where min_p asks for it, merge_row, and the draw over the row where it is one.
inline void sample_rows(const float* x, const float* prm, int64_t n, float* out, int64_t M, int64_t P, int64_t C,
                        int64_t K) {
  parallel_for(M, 1, [&](int64_t q) {
    const float* r = x + q * P;
    const float* p = prm + 5 * q;
    std::vector<float> st(4 + 2 * C), o(2 + 2 * K + 5);
    stats_row(r, n, C, true, p[1] > 0.f ? 0.f : p[0], st.data());     // top_k: no sum over the row needed
    const float zero = 0.f;
    float kept = 0.f;
    if (p[0] > 0.f && p[1] <= 0.f && p[3] > 0.f) kept = kept_row(r, n, st[0], p[0], logf(std::max(p[3], 1e-30f)));
    merge_row(st.data(), 0, 1, C, &zero, p, &kept, K, o.data());
    if (o[0] < 0.f) {
      const float* d = o.data() + 2 + 2 * K;
      const int64_t col = draw_row(r, n, d[2], d[3], d[4], d[1]);
      o[0] = static_cast<float>(col);
      o[1] += r[col];
    }
    std::copy(o.begin(), o.begin() + 2 + 2 * K, out + q * (2 + 2 * K));
  });
}

}  // namespace
