// A mixture of experts' routed experts (the MoeExperts kernel), over the matmuls of matmul.h.

#pragma once

#include "matmul.h"

namespace {

// ---- Mixture of experts --------------------------------------------------------------------
// out [N, H] = sum over j < k of wts[n][j] * expert ids[n][j] (x[n]), over the E experts held
// here (ids first .. first + E - 1; any other id adds nothing). Expert e: y = down(silu(gate x) *
// up x) with w13[e] [2I, H] (LinearGlu panels of gate and up, or with !glu Linear panels of the
// gate rows then the up rows) and w2[e] [H, I] (Linear panels). The (token, expert) pairs are
// grouped by expert and each expert's rows gathered, so an expert's weights pass once for all its
// tokens and a step costs what its routed tokens cost. Zero rows of x (a step's padding) are not
// routed. Each token's k products are summed in float32 in the order of its ids, then rounded.
// Either weight may instead be bfloat16 AMX tiles (`tiles13`, `tiles2`; T float32, see amx_rows),
// the gate and up columns of w13 then interleaved as LinearGlu's tiles are.
template <typename T, bool Glu>
void project(const T* x, const void* w, bool tiles, T* y, int64_t m, int64_t K, int64_t N) {
#ifdef MSINFER_AMX
  if constexpr (std::is_same_v<T, float>) {
    if (tiles) return amx_rows<Glu>(x, static_cast<const uint16_t*>(w), y, m, K, N);
  }
#endif
  linear_rows<T, Glu>(x, static_cast<const T*>(w), y, m, K, N);
}

template <typename T>
void moe(const T* x, const int32_t* ids, const T* wts, const void* w13, bool tiles13, const void* w2, bool tiles2,
         T* out, int64_t N, int64_t K, int64_t H, int64_t E, int64_t I, int64_t first, bool glu) {
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
    const char* wg = static_cast<const char*>(w13) + e * 2 * I * H * (tiles13 ? 2 : sizeof(T));
    const char* wd = static_cast<const char*>(w2) + e * H * I * (tiles2 ? 2 : sizeof(T));
    if (glu) {
      project<T, true>(xs.data() + s * H, wg, tiles13, hs.data() + s * I, m, H, 2 * I);
    } else {
      project<T, false>(xs.data() + s * H, wg, tiles13, gu.data() + s * 2 * I, m, H, 2 * I);
      silu_mul(gu.data() + s * 2 * I, hs.data() + s * I, m, I);
    }
    project<T, false>(hs.data() + s * I, wd, tiles2, ys.data() + s * H, m, I, H);
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

}  // namespace
