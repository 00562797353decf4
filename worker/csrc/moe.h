// A mixture of experts' routed experts (the MoeExperts, MoeUp and MoeDown kernels), over the
// matmuls of matmul.h.

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
// Either weight may instead be bfloat16 AMX tiles (T float32, see amx_rows), the gate and up
// columns of w13 then interleaved as LinearGlu's tiles are, or int8 panels, or int4 levels, or
// bfloat16 pairs (T float32, the rows rounded to bfloat16 as linear_pairs rounds them) (Pack).
//   Experts whose inputs are quantized per token (W8A8) run in two calls, so that a row of
// silu(gate) * up split over tensor-parallel ranks can be quantized with its maximum over them in
// between: moe_up gives each pair's row of silu(gate x) * up x [N k, I] (row n k + j; zeros for
// pairs not held here), moe_down takes those rows through down and sums each token's. With
// int8 weights (CpuOps.pack_vnni, a scale per output channel, VNNI) each call quantizes its rows
// as linear_vnni does; with weights held otherwise the caller quantizes them (to the levels and
// back).
// How an expert's weight [N, K] is held: panels of x's dtype, bfloat16 AMX tiles (int16; x
// float32), int8 panels with their N column scales before them (CpuOps.pack_int8: a weight-only
// int8 checkpoint's experts, or W8A8 ones on a CPU without VNNI), or int4 levels two a byte
// (CpuInt4Linear.pack: a W4A16 checkpoint's experts, on AVX-512) with a scale per group of inputs,
// or bfloat16 pairs (uint32 [N, ceil(K/2)], CpuOps.pack_pairs: model.dtype bfloat16 on the CPU).
enum class Pack { Panels, Tiles, Int8, Int4, Pairs };

// The bytes of one expert's weight [N, K] held as `pack` (x's element of `size` bytes).
inline int64_t expert_bytes(Pack pack, int64_t N, int64_t K, int64_t size) {
  switch (pack) {
    case Pack::Int8: return N * (K + 4);
    case Pack::Int4: return N * K / 2;
    case Pack::Tiles: return N * K * 2;
    case Pack::Pairs: return N * ((K + 1) / 2) * 4;
    default: return N * K * size;
  }
}

// The experts' stacked weight [E, N, K] as held, and with Pack::Int4 its group scales [E, N,
// groups] float32 (CpuInt4Linear.scales' order, expert by expert).
struct Held {
  const void* w;
  Pack pack;
  const float* scales = nullptr;
  int64_t groups = 0;
};

// y = x times expert e's weight of `held` ([N, K]) for m rows of x.
template <typename T, bool Glu>
void project(const T* x, const Held& held, int64_t e, T* y, int64_t m, int64_t K, int64_t N) {
  const void* w = static_cast<const char*>(held.w) + e * expert_bytes(held.pack, N, K, sizeof(T));
  if constexpr (std::is_same_v<T, float>) {
    if (held.pack == Pack::Pairs) return linear_pairs<Glu>(x, static_cast<const uint32_t*>(w), y, m, K, N);
#ifdef MSINFER_AMX
    if (held.pack == Pack::Tiles) return amx_rows<Glu>(x, static_cast<const uint16_t*>(w), y, m, K, N);
#endif
  }
#ifdef MSINFER_INT4
  if (held.pack == Pack::Int4)
    return int4_rows<T, Glu>(x, static_cast<const uint8_t*>(w), held.scales + e * N * held.groups, y, m, K, N,
                             K / held.groups);
#endif
  if (held.pack == Pack::Int8) return linear_rows<T, Glu, int8_t>(x, static_cast<const int8_t*>(w), y, m, K, N);
  linear_rows<T, Glu>(x, static_cast<const T*>(w), y, m, K, N);
}

// The (token, expert) pairs of the held experts whose `live(n, j)` holds, grouped by expert: the
// rows of expert e are start[e] .. start[e + 1] - 1, row r is pair pair[r] (n k + j), and pos[n k +
// j] is the pair's row (-1: not routed here).
struct Routing {
  std::vector<int64_t> start, pair, pos;
  int64_t rows() const { return start.back(); }
};

template <typename Live>
Routing route(const int32_t* ids, int64_t N, int64_t K, int64_t E, int64_t first, Live live) {
  Routing r{std::vector<int64_t>(E + 1, 0), {}, std::vector<int64_t>(N * K, -1)};
  auto local = [&](int64_t p) {
    const int64_t e = static_cast<int64_t>(ids[p]) - first;
    return e >= 0 && e < E && live(p / K, p % K) ? e : -1;
  };
  for (int64_t p = 0; p < N * K; ++p)
    if (const int64_t e = local(p); e >= 0) ++r.start[e + 1];
  for (int64_t e = 0; e < E; ++e) r.start[e + 1] += r.start[e];
  r.pair.resize(r.rows());
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  for (int64_t p = 0; p < N * K; ++p) {
    if (const int64_t e = local(p); e >= 0) {
      r.pos[p] = fill[e];
      r.pair[fill[e]++] = p;
    }
  }
  return r;
}

// Whether a row of length n is all zeros.
template <typename T>
bool zero_row(const T* r, int64_t n) {
  return std::all_of(r, r + n, [](T v) { return v == T(0); });
}

// out [N, H]: each token's routed rows ys [R, H] weighted by wts and summed in float32, in the order
// of its ids.
template <typename T>
void combine(const Routing& r, const T* ys, const T* wts, T* out, int64_t N, int64_t K, int64_t H) {
  parallel_for(N, 16, [&](int64_t n) {
    T* o = out + n * H;
    std::vector<float> acc(H, 0.f);
    for (int64_t j = 0; j < K; ++j) {
      const int64_t row = r.pos[n * K + j];
      if (row < 0) continue;
      const float w = static_cast<float>(wts[n * K + j]);
      const T* y = ys + row * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) acc[h] += w * static_cast<float>(y[h]);
    }
    for (int64_t h = 0; h < H; ++h) o[h] = static_cast<T>(acc[h]);
  });
}

// The rows of src [*, n] that the routing's pairs read (row_of(pair)), gathered into dst [R, n].
template <typename T, typename RowOf>
void gather_rows(const Routing& r, const T* src, T* dst, int64_t n, RowOf row_of) {
  parallel_for(r.rows(), 16, [&](int64_t i) {
    const T* s = src + row_of(r.pair[i]) * n;
    std::copy(s, s + n, dst + i * n);
  });
}

// The pairs of x's rows that are not zeros (a step's padding is) with the held experts, and those
// rows gathered, a copy per pair: xs [R, H].
template <typename T>
Routing route_rows(const T* x, const int32_t* ids, int64_t N, int64_t K, int64_t H, int64_t E, int64_t first,
                   std::vector<T>& xs) {
  std::vector<char> live(N);
  for (int64_t n = 0; n < N; ++n) live[n] = !zero_row(x + n * H, H);
  Routing r = route(ids, N, K, E, first, [&](int64_t n, int64_t) { return live[n]; });
  xs.resize(r.rows() * H);
  gather_rows(r, x, xs.data(), H, [&](int64_t p) { return p / K; });
  return r;
}

// An expert's silu(gate) * up for its m rows -> hs [m, I], from `proj(y, glu)`, its gate|up
// projection into y: [m, I] with the activation where glu (std::true_type), else [m, 2I].
template <typename T, typename Proj>
void gate_up(T* hs, int64_t m, int64_t I, bool glu, Proj proj) {
  if (glu) return proj(hs, std::true_type{});
  std::vector<T> gu(m * 2 * I);
  proj(gu.data(), std::false_type{});
  silu_mul(gu.data(), hs, m, I);
}

// Expert e's gate|up (its weight of the experts' w13) over its m rows xs -> hs [m, I]: silu(gate)
// * up.
template <typename T>
void gate_up(const T* xs, const Held& w13, int64_t e, T* hs, int64_t m, int64_t H, int64_t I, bool glu) {
  gate_up(hs, m, I, glu, [&](T* y, auto g) { project<T, decltype(g)::value>(xs, w13, e, y, m, H, 2 * I); });
}

// Expert e's down (its weight of the experts' w2) over its m rows hs -> ys [m, H].
template <typename T>
void down(const T* hs, const Held& w2, int64_t e, T* ys, int64_t m, int64_t H, int64_t I) {
  project<T, false>(hs, w2, e, ys, m, I, H);
}

template <typename T>
void moe(const T* x, const int32_t* ids, const T* wts, const Held& w13, const Held& w2, T* out, int64_t N, int64_t K,
         int64_t H, int64_t E, int64_t I, int64_t first, bool glu) {
  std::vector<T> xs;
  const Routing r = route_rows(x, ids, N, K, H, E, first, xs);
  const int64_t R = r.rows();
  std::vector<T> hs(R * I), ys(R * H);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = r.start[e], m = r.start[e + 1] - s;
    if (m == 0) continue;
    gate_up(xs.data() + s * H, w13, e, hs.data() + s * I, m, H, I, glu);
    down(hs.data() + s * I, w2, e, ys.data() + s * H, m, H, I);
  }
  combine(r, ys.data(), wts, out, N, K, H);
}

// The quantization of a call's rows: int8 weights (VNNI) with their scales [E, rows of a weight]
// and the rows' arithmetic (PerTokenInt8's divisor and rounding); amax: each row's maximum as the
// caller took it over the ranks that split it, or nullptr.
struct Int8Weights {
  const float* scales;
  float divisor;
  bool away;
  const float* amax;
};

// h [N k, I] (moe_up): row n k + j is silu(gate x[n]) * up x[n] by expert ids[n][j] where it is
// held here and x[n] is not zeros; zeros elsewhere. q: the weights are int8 (VNNI), else held as
// w13 says and x's rows taken as they are.
template <typename T>
void moe_up(const T* x, const int32_t* ids, const Held& w13, const Int8Weights* q, T* h, int64_t N, int64_t K,
            int64_t H, int64_t E, int64_t I, int64_t first, bool glu) {
  std::vector<T> xs;
  const Routing r = route_rows(x, ids, N, K, H, E, first, xs);
  const int64_t R = r.rows();
  std::vector<T> hs(R * I);
  if (q == nullptr) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t s = r.start[e], m = r.start[e + 1] - s;
      if (m > 0) gate_up(xs.data() + s * H, w13, e, hs.data() + s * I, m, H, I, glu);
    }
  } else {
#ifdef MSINFER_VNNI
    const int64_t Hq = (H + 3) / 4 * 4;
    std::vector<int8_t> levels(R * Hq);
    std::vector<float> s(R);
    std::vector<int32_t> comp(R);
    quantize_rows(xs.data(), R, H, Hq, q->divisor, q->away, nullptr, levels.data(), s.data(), comp.data());
    for (int64_t e = 0; e < E; ++e) {
      const int64_t b = r.start[e], m = r.start[e + 1] - b;
      if (m == 0) continue;
      const uint8_t* w = static_cast<const uint8_t*>(w13.w) + e * 2 * I * Hq;
      gate_up(hs.data() + b * I, m, I, glu, [&](T* y, auto g) {
        vnni_rows<T, decltype(g)::value>(levels.data() + b * Hq, s.data() + b, comp.data() + b, w,
                                         q->scales + e * 2 * I, y, m, Hq, 2 * I);
      });
    }
#endif
  }
  parallel_for(N * K, 16, [&](int64_t p) {
    T* o = h + p * I;
    if (r.pos[p] < 0) return std::fill(o, o + I, T(0));
    const T* src = hs.data() + r.pos[p] * I;
    std::copy(src, src + I, o);
  });
}

// out [N, H] (moe_down): each token's rows of h [N k, I] (moe_up's) through down, weighted by wts
// and summed. Rows of zeros are not routed: down of zeros is zeros, quantized or not.
template <typename T>
void moe_down(const T* h, const int32_t* ids, const T* wts, const Held& w2, const Int8Weights* q, T* out, int64_t N,
              int64_t K, int64_t H, int64_t E, int64_t I, int64_t first) {
  const Routing r = route(ids, N, K, E, first, [&](int64_t n, int64_t j) { return !zero_row(h + (n * K + j) * I, I); });
  const int64_t R = r.rows();
  std::vector<T> hs(R * I), ys(R * H);
  gather_rows(r, h, hs.data(), I, [](int64_t p) { return p; });
  if (q == nullptr) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t s = r.start[e], m = r.start[e + 1] - s;
      if (m > 0) down(hs.data() + s * I, w2, e, ys.data() + s * H, m, H, I);
    }
  } else {
#ifdef MSINFER_VNNI
    const int64_t Iq = (I + 3) / 4 * 4;
    std::vector<int8_t> levels(R * Iq);
    std::vector<float> s(R), amax(q->amax ? R : 0);
    std::vector<int32_t> comp(R);
    for (int64_t i = 0; i < static_cast<int64_t>(amax.size()); ++i) amax[i] = q->amax[r.pair[i]];
    quantize_rows(hs.data(), R, I, Iq, q->divisor, q->away, q->amax ? amax.data() : nullptr, levels.data(), s.data(),
                  comp.data());
    for (int64_t e = 0; e < E; ++e) {
      const int64_t b = r.start[e], m = r.start[e + 1] - b;
      if (m > 0)
        vnni_rows<T, false>(levels.data() + b * Iq, s.data() + b, comp.data() + b,
                            static_cast<const uint8_t*>(w2.w) + e * H * Iq, q->scales + e * H, ys.data() + b * H, m, Iq,
                            H);
    }
#endif
  }
  combine(r, ys.data(), wts, out, N, K, H);
}

}  // namespace
