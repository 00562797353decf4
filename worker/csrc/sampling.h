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

// Per row of x [Q, P]: out [Q, 3 + 2C] = max, its column (the first), sum exp(x - max) (0 unless
// with_sum), the C largest values in descending order (ties: lower column first; -1e30 past the
// row's real columns), their columns.
// The C largest are kept in a min-heap while the row streams by; a block of 64 values whose max
// is not above the heap's least is skipped after one vector max, so a row costs about one read.
inline void sample_stats(const float* x, const int32_t* cols, float* out, int64_t Q, int64_t R, int64_t P, int64_t C,
                         bool with_sum) {
  parallel_for(Q, 1, [&](int64_t q) {
    const float* r = x + q * P;
    const int64_t n = cols[q / (Q / R)];
    float* o = out + q * (3 + 2 * C);
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
    if (heap.empty()) heap.emplace_back(-1e30f, 0);     // a shard of padding alone
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
      o[3 + k] = has ? heap[k].first : -1e30f;
      o[3 + C + k] = has ? static_cast<float>(heap[k].second) : 0.f;
    }
  });
}

// Per row of x [Q, P] with prm [M, 3] = (g, t, tau): the sum of exp((x - g) / t) over the columns
// where (x - g) / t >= tau.
inline void kept_mass(const float* x, const float* prm, const int32_t* cols, float* out, int64_t Q, int64_t R,
                      int64_t P) {
  const int64_t M = Q / R;
  parallel_for(Q, 1, [&](int64_t q) {
    const float* r = x + q * P;
    const float* p = prm + 3 * (q % M);
    const float g = p[0], t = p[1], tau = p[2];
    const int64_t n = cols[q / M];
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < n; ++k) {
      const float y = (r[k] - g) / t;          // as the sampler computes the threshold: a division
      sum += y >= tau ? expf(y) : 0.f;
    }
    out[q] = sum;
  });
}

// Per row of x [Q, P] with prm [M, 3] = (g, t, tau) and target [Q]: out [Q, 2] = (the first column
// where the running sum of the kept weights exp((x - g) / t) (those with (x - g) / t >= tau)
// exceeds target, or the last column with a positive kept weight when none does (rounding at the
// very end), or 0 when none has one; x at that column). The sums go 16 columns at a time and only
// the block that crosses the target is walked one column at a time.
inline void draw_column(const float* x, const float* prm, const float* targets, const int32_t* cols, float* out,
                        int64_t Q, int64_t R, int64_t P) {
  const int64_t M = Q / R;
  parallel_for(Q, 1, [&](int64_t q) {
    const float* r = x + q * P;
    const float* p = prm + 3 * (q % M);
    const float g = p[0], t = p[1], tau = p[2], target = targets[q];
    const int64_t n = cols[q / M];
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
    const int64_t col = found >= 0 ? found : std::max<int64_t>(last, 0);
    out[2 * q] = static_cast<float>(col);
    out[2 * q + 1] = r[col];
  });
}

}  // namespace
