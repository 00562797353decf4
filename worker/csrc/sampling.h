// The device sampler's passes over a rank's vocabulary shard of the logits (worker/device_sampler.py):
// one call per pass where MindSpore's CPU backend runs TopK, ReduceMax, ArgMax, Exp, ReduceSum and
// CumSum over the whole row apiece (about 10x the time of these loops at a vocabulary of 49,152).
// Rows are shared among the pool's threads. x holds R shards' rows one shard after another
// ([R * M, P]; R = 1 in a worker), of which shard r has cols[r] real columns (the rest pad the
// last shard of a vocabulary that tp does not divide); the per-row parameters are per row of a
// shard ([M, k]). Columns are the shard's; the caller adds its offset.

#pragma once

#include "common.h"

namespace {

constexpr float kOff = -1e30f;   // a threshold that keeps everything (device_sampler.OFF)

// One row r of n real columns: o [3 + 2C] = max, its column (the first), sum exp(x - max) (0
// unless with_sum), the C largest values in descending order (ties: lower column first; -1e30
// past the row's real columns), their columns.
// The C largest are kept in a min-heap while the row streams by; a block of 64 values whose max
// is not above the heap's least is skipped after one vector max, so a row costs about one read.
inline void stats_row(const float* r, int64_t n, int64_t C, bool with_sum, float* o) {
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
  if (heap.empty()) heap.emplace_back(kOff, 0);     // a shard of padding alone
  std::sort(heap.begin(), heap.end(), above);
  const float m = heap.front().first;
  float sum = 0.f;
  if (with_sum) {
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < n; ++k) sum += expf(r[k] - m);
  }
  o[0] = m;
  o[1] = static_cast<float>(heap.front().second);
  o[2] = sum;
  for (int64_t k = 0; k < C; ++k) {
    const bool has = k < static_cast<int64_t>(heap.size());
    o[3 + k] = has ? heap[k].first : kOff;
    o[3 + C + k] = has ? static_cast<float>(heap[k].second) : 0.f;
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

// x [Q, P] holds R shards' rows (M = Q / R per shard); shard r has cols[r] real columns.
// SampleStats: out [Q, 3 + 2C], stats_row of each row.
inline void sample_stats(const float* x, const int32_t* cols, float* out, int64_t Q, int64_t R, int64_t P, int64_t C,
                         bool with_sum) {
  parallel_for(Q, 1, [&](int64_t q) { stats_row(x + q * P, cols[q / (Q / R)], C, with_sum, out + q * (3 + 2 * C)); });
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

// SampleRows, the whole of VocabSampler.sample for one shard holding the whole vocabulary (tp 1),
// in the same float32 steps: x [M, P] with n real columns, prm [M, 5] = (temperature (0: greedy),
// top_k (0: off), top_p (1: off), min_p (0: off), u) -> out [M, 2 + 2K] = (token, its
// log-probability, the K most likely tokens' log-probabilities, their ids), C candidates.
inline void sample_rows(const float* x, const float* prm, int64_t n, float* out, int64_t M, int64_t P, int64_t C,
                        int64_t K) {
  parallel_for(M, 1, [&](int64_t q) {
    const float* r = x + q * P;
    const float* p = prm + 5 * q;
    const float t = p[0], top_p = p[2], min_p = p[3], u = p[4];
    const int64_t top_k = static_cast<int64_t>(p[1]);
    std::vector<float> st(3 + 2 * C);
    stats_row(r, n, C, true, st.data());
    const float m = st[0], log_z = m + logf(st[2]);
    const float* v = st.data() + 3;
    float* o = out + q * (2 + 2 * K);
    if (t <= 0.f) {
      o[0] = st[1];
      o[1] = m - log_z;
    } else {
      float tau = kOff;
      if (top_k > 0) tau = (v[std::min(top_k, C) - 1] - m) / t;
      if (min_p > 0.f) tau = std::max(tau, logf(std::max(min_p, 1e-30f)));
      if (top_p < 1.f) {               // the candidates, most likely first, until top_p of the kept mass
        const float limit = top_p * kept_row(r, n, m, t, tau);
        float before = 0.f, tau_p = -kOff;
        for (int64_t k = 0; k < C; ++k) {
          const float y = (v[k] - m) / t;
          const float w = y >= tau ? expf(y) : 0.f;
          if (before < limit && w > 0.f) tau_p = std::min(tau_p, y);
          before += w;
        }
        tau = std::max(tau, tau_p);
      }
      const int64_t col = draw_row(r, n, m, t, tau, u * kept_row(r, n, m, t, tau));
      o[0] = static_cast<float>(col);
      o[1] = r[col] - log_z;
    }
    for (int64_t k = 0; k < K; ++k) {
      o[2 + k] = v[k] - log_z;
      o[2 + K + k] = st[3 + C + k];
    }
  });
}

}  // namespace
