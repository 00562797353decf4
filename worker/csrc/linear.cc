// The CPU kernels' entry points for the matmuls (MindSpore AOT custom operators, see kernels.cc's
// header for the library): Linear, LinearGlu, Embed, QuantRows and a mixture of experts'
// MoeExperts, MoeUp and MoeDown. A translation unit of its own so that the library's two halves
// compile at once (worker/build.py kernel_library): these hold most of its template instances.

#include "common.h"
#include "matmul.h"
#include "moe.h"
#include "sampling.h"

// x [N, K], meta [2] float32 (divisor, half away from zero) -> each row to int8 levels of
// max|x| / divisor, rounded (half to even, or away from zero), clamped to -128..127, and back:
// a W8A8 layer's input as sharding.layers.PerTokenInt8 computes it, in one pass a row.
extern "C" int QuantRows(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                         void* extra) {
  if (nparam != 3 || ndims[0] != 2 || std::strcmp(dtypes[1], "float32")) return 1;
  const int64_t N = shapes[0][0], K = shapes[0][1];
  const float divisor = static_cast<const float*>(params[1])[0];
  const bool away = static_cast<const float*>(params[1])[1] != 0.f;
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(params[0]);
    T* y = static_cast<T*>(params[2]);
    parallel_for(N, 16, [&](int64_t n) {
      const T* r = x + n * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(r[k])));
      float s = amax / divisor;
      if (s == 0.f) s = std::numeric_limits<float>::epsilon();
      for (int64_t k = 0; k < K; ++k) {
        const float v = static_cast<float>(r[k]) / s;
        const float q = away ? std::copysign(std::floor(std::fabs(v) + 0.5f), v) : std::nearbyint(v);
        y[n * K + k] = static_cast<T>(std::min(127.f, std::max(-128.f, q)) * s);
      }
    });
  });
  return 0;
}

// Whether a weight [N, K] in bfloat16 tiles (int16) can multiply activations of x_dtype here: x
// float32, N and K whole tiles, and a CPU and kernel that grant AMX.
static bool tiles_usable(const char* x_dtype, int64_t N, int64_t K) {
#ifdef MSINFER_AMX
  return std::strcmp(x_dtype, "float32") == 0 && K % 32 == 0 && N % 32 == 0 && amx_permitted();
#else
  return false;
#endif
}

// The entry points of Linear and LinearGlu: params x [M, K], w [N, K], y. w is float32 or float16
// in panels, or uint16: bfloat16 in panels (x float32), or int16: bfloat16 in AMX tiles (x
// float32), or int8 [N, K + 4]: the N column scales (float32), then int8 panels (CpuOps.pack_int8),
// or uint32 [N, ceil(K/2)]: bfloat16 pairs, x float32 rounded to bfloat16 (CpuOps.pack_pairs).
//   With 5 or 6 params, a W8A8 layer on a CPU with AVX512-VNNI (linear_vnni): x [M, K], w [N, Kq]
// int8 (CpuOps.pack_vnni), scales [N] float32, meta [2] float32 (divisor, half away from zero),
// and optionally amax [M, 1] float32 (each row's max|x| over the ranks that split it), then y.
template <bool Glu>
int linear_vnni_entry(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  const bool max_given = nparam == 6;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 1 || shapes[3][0] != 2 || std::strcmp(dtypes[1], "int8") ||
      std::strcmp(dtypes[2], "float32") || std::strcmp(dtypes[3], "float32"))
    return 1;
  const int64_t M = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  if (shapes[1][1] != (K + 3) / 4 * 4 || shapes[2][0] != N || N % kPanel ||
      (max_given && (shapes[4][0] != M || std::strcmp(dtypes[4], "float32"))))
    return 2;
#ifdef MSINFER_VNNI
  const float* meta = static_cast<const float*>(params[3]);
  const float* amax = max_given ? static_cast<const float*>(params[4]) : nullptr;
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    linear_vnni<T, Glu>(static_cast<const T*>(params[0]), static_cast<const uint8_t*>(params[1]),
                        static_cast<const float*>(params[2]), meta[0], meta[1] != 0.f, amax,
                        static_cast<T*>(params[nparam - 1]), M, K, N);
  });
  return 0;
#else
  return 3;
#endif
}

// With 4 params, a W4A16 layer (int4_rows): x [M, K], w [N, K/2] uint8 (CpuInt4Linear.pack),
// scales [N, K/G] float32 in the panels' order, then y.
template <bool Glu>
int linear_int4_entry(void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || std::strcmp(dtypes[1], "uint8") ||
      std::strcmp(dtypes[2], "float32"))
    return 1;
  const int64_t M = shapes[0][0], K = shapes[0][1], N = shapes[1][0], groups = shapes[2][1];
  if (shapes[1][1] * 2 != K || shapes[2][0] != N || N % 2 || (Glu && N % kPanel) || groups < 1 || K % groups)
    return 2;
#ifdef MSINFER_INT4
  const uint8_t* w = static_cast<const uint8_t*>(params[1]);
  const float* scales = static_cast<const float*>(params[2]);
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    linear<T, Glu>(static_cast<const T*>(params[0]), static_cast<T*>(params[3]), M, K, N,
                   [&](const T* xs, T* ys, int64_t L) { int4_rows<T, Glu>(xs, w, scales, ys, L, K, N, K / groups); });
  });
  return 0;
#else
  return 3;
#endif
}

template <bool Glu>
int linear_entry(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes) {
  if (nparam == 5 || nparam == 6) return linear_vnni_entry<Glu>(nparam, params, ndims, shapes, dtypes);
  if (nparam == 4) return linear_int4_entry<Glu>(params, ndims, shapes, dtypes);
  if (nparam == 3 && std::strcmp(dtypes[1], "uint32") == 0) {     // bfloat16 pairs, x rounded (linear_pairs)
    if (std::strcmp(dtypes[0], "float32") || ndims[0] != 2 || ndims[1] != 2) return 1;
    const int64_t M = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
    if (shapes[1][1] != (K + 1) / 2 || (Glu && N % kPanel)) return 2;
    const uint32_t* w = static_cast<const uint32_t*>(params[1]);
    linear<float, Glu>(static_cast<const float*>(params[0]), static_cast<float*>(params[2]), M, K, N,
                       [&](const float* xs, float* ys, int64_t L) { linear_pairs<Glu>(xs, w, ys, L, K, N); });
    return 0;
  }
  const bool int8 = std::strcmp(dtypes[1], "int8") == 0;
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 2 || shapes[0][1] + (int8 ? 4 : 0) != shapes[1][1] ||
      (Glu && shapes[1][0] % kPanel))
    return 1;
  const int64_t M = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  if (int8) {
    with_dtype(dtypes[0], [&](auto tag) {
      using T = decltype(tag);
      const int8_t* w = static_cast<const int8_t*>(params[1]);
      linear<T, Glu>(static_cast<const T*>(params[0]), static_cast<T*>(params[2]), M, K, N,
                     [&](const T* xs, T* ys, int64_t L) { linear_rows<T, Glu, int8_t>(xs, w, ys, L, K, N); });
    });
    return 0;
  }
  if (std::strcmp(dtypes[1], "uint16") == 0) {                 // bfloat16 panels, x float32
    if (std::strcmp(dtypes[0], "float32")) return 2;
    const uint16_t* w = static_cast<const uint16_t*>(params[1]);
    linear<float, Glu>(static_cast<const float*>(params[0]), static_cast<float*>(params[2]), M, K, N,
                       [&](const float* xs, float* ys, int64_t L) { linear_rows<float, Glu, uint16_t>(xs, w, ys, L, K, N); });
    return 0;
  }
  if (std::strcmp(dtypes[1], "int16") == 0) {
    if (!tiles_usable(dtypes[0], N, K)) return 2;
#ifdef MSINFER_AMX
    const uint16_t* w = static_cast<const uint16_t*>(params[1]);
    linear<float, Glu>(static_cast<const float*>(params[0]), static_cast<float*>(params[2]), M, K, N,
                       [&](const float* xs, float* ys, int64_t L) { amx_rows<Glu>(xs, w, ys, L, K, N); });
    return 0;
#else
    return 2;
#endif
  }
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    const T* w = static_cast<const T*>(params[1]);
    linear<T, Glu>(static_cast<const T*>(params[0]), static_cast<T*>(params[2]), M, K, N,
                   [&](const T* xs, T* ys, int64_t L) { linear_rows<T, Glu>(xs, w, ys, L, K, N); });
  });
  return 0;
}

// How the experts' weight [E, N, ...] (w_dtype, its shape) is held for x of x_dtype, N rows of K
// inputs each: panels of x's dtype [E, N, K]; int16: bfloat16 tiles [E, N, K] (x float32, where
// the CPU grants AMX); int8: int8 panels [E, N, K + 4] (CpuOps.pack_int8) or, with `vnni`, VNNI
// panels [E, N, Kq] (CpuOps.pack_vnni, N a multiple of 32); uint8: int4 levels [E, N, K/2]
// (CpuInt4Linear.pack, N and K even; where the library has int4_rows), whose group scales come
// apart (group_scales); uint32: bfloat16 pairs [E, N, ceil(K/2)] (CpuOps.pack_pairs, x float32).
// False: none of these.
static bool expert_pack(const char* x_dtype, const char* w_dtype, const int64_t* shape, int64_t N, int64_t K,
                        bool vnni, Pack* pack) {
  if (shape[1] != N) return false;
  *pack = Pack::Int8;
  if (vnni) return std::strcmp(w_dtype, "int8") == 0 && shape[2] == (K + 3) / 4 * 4 && N % kPanel == 0;
  if (std::strcmp(w_dtype, "int8") == 0) return shape[2] == K + 4;
  if (std::strcmp(w_dtype, "uint8") == 0) {
    *pack = Pack::Int4;
#ifdef MSINFER_INT4
    return shape[2] * 2 == K && N % 2 == 0;
#else
    return false;
#endif
  }
  if (std::strcmp(w_dtype, "uint32") == 0) {
    *pack = Pack::Pairs;
    return std::strcmp(x_dtype, "float32") == 0 && shape[2] == (K + 1) / 2;
  }
  if (std::strcmp(w_dtype, "int16") == 0) {
    *pack = Pack::Tiles;
    return shape[2] == K && tiles_usable(x_dtype, N, K);
  }
  *pack = Pack::Panels;
  return std::strcmp(w_dtype, x_dtype) == 0 && shape[2] == K;
}

// The group scales of int4 experts [E, N, groups] float32 (params[i]), for weights of K inputs:
// whether their shape is so (K whole groups); the Held they complete.
static bool group_scales(const char** dtypes, int* ndims, int64_t** shapes, int i, int64_t E, int64_t N, int64_t K,
                         Held* held) {
  if (std::strcmp(dtypes[i], "float32") || ndims[i] != 3 || shapes[i][0] != E || shapes[i][1] != N ||
      shapes[i][2] < 1 || K % shapes[i][2])
    return false;
  held->groups = shapes[i][2];
  return true;
}

// x [N, H], ids [N, k] int32, weights [N, k], w13 [E, 2I, .], w2 [E, H, .] (each as expert_pack
// takes it, not VNNI), meta [2] int32 (first expert held, glu)[, with int4 weights their group
// scales s13 [E, 2I, H/G] and s2 [E, H, I/G]] -> [N, H]: moe
extern "C" int MoeExperts(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                          void* extra) {
  const bool int4 = nparam == 9;
  if ((nparam != 7 && !int4) || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 3 || ndims[4] != 3)
    return 1;
  const int64_t N = shapes[0][0], H = shapes[0][1], K = shapes[1][1], E = shapes[3][0], I = shapes[3][1] / 2;
  const int32_t* meta = static_cast<const int32_t*>(params[5]);
  const bool glu = meta[1] != 0;
  Held w13{params[3]}, w2{params[4]};
  if (shapes[1][0] != N || shapes[2][0] != N || shapes[2][1] != K || shapes[3][1] % 2 || shapes[4][0] != E ||
      (glu && (2 * I) % kPanel) || std::strcmp(dtypes[1], "int32") || std::strcmp(dtypes[0], dtypes[2]) ||
      !expert_pack(dtypes[0], dtypes[3], shapes[3], 2 * I, H, false, &w13.pack) ||
      !expert_pack(dtypes[0], dtypes[4], shapes[4], H, I, false, &w2.pack))
    return 2;
  if (int4) {                 // both weights int4, with their scales
    if (w13.pack != Pack::Int4 || w2.pack != Pack::Int4 || !group_scales(dtypes, ndims, shapes, 6, E, 2 * I, H, &w13) ||
        !group_scales(dtypes, ndims, shapes, 7, E, H, I, &w2))
      return 2;
    w13.scales = static_cast<const float*>(params[6]);
    w2.scales = static_cast<const float*>(params[7]);
  } else if (w13.pack == Pack::Int4 || w2.pack == Pack::Int4) {
    return 2;
  }
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    auto in = [&](int i) { return static_cast<const T*>(params[i]); };
    moe<T>(in(0), static_cast<const int32_t*>(params[1]), in(2), w13, w2, static_cast<T*>(params[nparam - 1]), N, K, H,
           E, I, meta[0], glu);
  });
  return 0;
}

// MoeUp's and MoeDown's parameters of int8 weights in VNNI panels, at params[i] (the weights'
// scales [E, rows] float32) and params[i + 1] (meta [2] float32: divisor, half away from zero):
// whether their shapes are so, and the Int8Weights they make (with each row's amax, or nullptr).
static bool int8_params(const char** dtypes, int64_t** shapes, int i, int64_t E, int64_t rows) {
  return std::strcmp(dtypes[i], "float32") == 0 && shapes[i][0] == E && shapes[i][1] == rows && shapes[i + 1][0] == 2;
}

static Int8Weights int8_weights(void** params, int i, const float* amax) {
  const float* meta = static_cast<const float*>(params[i + 1]);
  return {static_cast<const float*>(params[i]), meta[0], meta[1] != 0.f, amax};
}

// x [N, H], ids [N, k] int32, w13 [E, 2I, .] (as expert_pack takes it; with VNNI panels, then its
// scales [E, 2I] float32 and meta [2] float32 (divisor, half away from zero) after meta), meta [2]
// int32 (first expert held, glu) -> h [N k, I]: moe_up
extern "C" int MoeUp(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                     void* extra) {
  const bool vnni = nparam == 7;
  if ((nparam != 5 && !vnni) || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 3 || ndims[nparam - 1] != 2) return 1;
  const int64_t N = shapes[0][0], H = shapes[0][1], K = shapes[1][1], E = shapes[2][0], I = shapes[2][1] / 2;
  const int32_t* meta = static_cast<const int32_t*>(params[3]);
  const bool glu = meta[1] != 0;
  Held w13{params[2]};
  if (shapes[1][0] != N || std::strcmp(dtypes[1], "int32") || shapes[2][1] % 2 ||
      !expert_pack(dtypes[0], dtypes[2], shapes[2], 2 * I, H, vnni, &w13.pack) || w13.pack == Pack::Int4 ||
      shapes[nparam - 1][0] != N * K || shapes[nparam - 1][1] != I || (glu && (2 * I) % kPanel) ||
      (vnni && !int8_params(dtypes, shapes, 4, E, 2 * I)))
    return 2;
#ifndef MSINFER_VNNI
  if (vnni) return 3;
#endif
  const Int8Weights q = vnni ? int8_weights(params, 4, nullptr) : Int8Weights{};
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    moe_up<T>(static_cast<const T*>(params[0]), static_cast<const int32_t*>(params[1]), w13, vnni ? &q : nullptr,
              static_cast<T*>(params[nparam - 1]), N, K, H, E, I, meta[0], glu);
  });
  return 0;
}

// h [N k, I] (MoeUp's), ids [N, k] int32, weights [N, k], w2 [E, H, .] (as expert_pack takes it;
// with VNNI panels, then its scales [E, H] float32, meta [2] float32 (divisor, half away from
// zero) and optionally amax [N k, 1] float32 (each row's maximum over the ranks that split it)
// after meta), meta [2] int32 (first expert held, glu) -> [N, H]: moe_down
extern "C" int MoeDown(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                       void* extra) {
  const bool vnni = nparam == 8 || nparam == 9, max_given = nparam == 9;
  if ((nparam != 6 && !vnni) || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 3) return 1;
  const int64_t N = shapes[1][0], K = shapes[1][1], I = shapes[0][1], E = shapes[3][0], H = shapes[3][1];
  Held w2{params[3]};
  if (shapes[0][0] != N * K || shapes[2][0] != N || shapes[2][1] != K || std::strcmp(dtypes[1], "int32") ||
      std::strcmp(dtypes[0], dtypes[2]) || !expert_pack(dtypes[0], dtypes[3], shapes[3], H, I, vnni, &w2.pack) ||
      w2.pack == Pack::Int4 ||
      shapes[nparam - 1][0] != N || shapes[nparam - 1][1] != H || (vnni && !int8_params(dtypes, shapes, 5, E, H)) ||
      (max_given && (shapes[7][0] != N * K || std::strcmp(dtypes[7], "float32"))))
    return 2;
#ifndef MSINFER_VNNI
  if (vnni) return 3;
#endif
  const Int8Weights q =
      vnni ? int8_weights(params, 5, max_given ? static_cast<const float*>(params[7]) : nullptr) : Int8Weights{};
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    moe_down<T>(static_cast<const T*>(params[0]), static_cast<const int32_t*>(params[1]),
                static_cast<const T*>(params[2]), w2, vnni ? &q : nullptr,
                static_cast<T*>(params[nparam - 1]), N, K, H, E, I, static_cast<const int32_t*>(params[4])[0]);
  });
  return 0;
}

namespace {

// ---- A float32 job's greedy token from its LM head in bfloat16 pairs -------------------------
// For a greedy decode step only the largest logit's column is wanted. The LM head's weights are
// bfloat16 values (its panels are uint16: pack_weight), so the same weights in pairs (pack_pairs)
// give, at VDPBF16PS's rate (about twice the float32 FMAs'), a_c = the pairs' product of x
// rounded to bfloat16 (x_b). Against z_c, the float32 logit the panels compute (linear_rows),
//   |z_c - a_c| <= |w_c| |x - x_b| + g(K) |w_c| |x| + g(K + 1) |w_c| |x_b|     (Euclidean norms)
// : the first term by Cauchy-Schwarz, the others each a chain of at most K + 1 float32 roundings
// (g(n) = n u / (1 - n u), u = 2^-24; for the pairs' sums 2u, so that a VDPBF16PS that rounds
// other than to nearest stays within it), plus the denormals VDPBF16PS flushes (`slack`). With m_c
// that bound, a column whose a_c + m_c is below max_j (a_j - m_j) <= max_j z_j cannot hold the
// largest logit; every column that may (all of them where several tie) is computed again as the
// panels compute it, one FMA a k in order (panel_dot), so its value is the panels' to the bit and
// the pick GreedyRows' (the first largest). A row with more than kHeadCandidates such columns, or
// a value past float32's range or not finite, takes the panels' whole product instead.
constexpr int64_t kHeadCandidates = 256;
// Up to kRows rows (one group of the panels' micro-kernel), the float32 panels' product is bound
// by the weights' bytes, as the pairs' is, and the pairs' only add their checks: in a decode step
// of the demo model's float32 job (Zen 5) one sequence took 5.29 ms with them against 4.94
// without, 16 sequences 11.97 against 12.80 (docs/benchmarks.md). Such calls take the panels.
constexpr int64_t kHeadMinRows = kRows;

// m_c for a_c = v and r = norms[c] * s (greedy_head), in float: each float operation's rounding
// (2^-24 of its terms) is covered by the margin's extra 2^-20 of |v| + r.
inline float head_margin(float v, float r, float slack) { return r + (std::fabs(v) + r) * 0x1p-20f + slack; }

// Column c of x [K] times w [N, K] in bfloat16 panels, as micro sums it: from 0, one FMA a k.
inline float panel_dot(const float* x, const uint16_t* w, int64_t K, int64_t N, int64_t c) {
  const auto [col, stride] = panel_row(w, N, K, c);
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc = __builtin_fmaf(x[k], bf16_value(col[k * stride]), acc);
  return acc;
}

// x [M, K] float32, w [N, K] bfloat16 panels, pairs [N, ceil(K/2)] the same in pairs, norms [N]
// (each w_c's norm, rounded up), n real columns -> out [M]: each row's greedy token over the
// panels' x w^T (GreedyRows' pick among columns 0..n-1).
inline void greedy_head(const float* x, const uint16_t* w, const uint32_t* pairs, const float* norms, int64_t n,
                        int32_t* out, int64_t M, int64_t K, int64_t N) {
  int64_t live = 0;
  for (int64_t m = 0; m < M; ++m) live += std::any_of(x + m * K, x + (m + 1) * K, [](float v) { return v != 0.f; });
  std::vector<char> whole(M, live <= kHeadMinRows);
  thread_local std::vector<float> approx;
  float* a = scratch(approx, live <= kHeadMinRows ? 0 : M * N);
  if (live > kHeadMinRows) {
    linear<float, false>(x, a, M, K, N, [&](const float* xs, float* ys, int64_t L) {
      linear_pairs<false>(xs, pairs, ys, L, K, N);
    });
  }
  const double u = 0x1p-24, g0 = K * u / (1 - K * u), g1 = (K + 1) * 2 * u / (1 - (K + 1) * 2 * u);
  const float slack = static_cast<float>(4.0 * (K + 1) * 0x1p-126);
  parallel_for(live <= kHeadMinRows ? 0 : M, 1, [&](int64_t m) {
    const float* xr = x + m * K;
    const float* ar = a + m * N;
    double e2 = 0, x2 = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = xr[k], d = v - bf16_value(bf16_rounded(xr[k]));
      e2 += d * d;
      x2 += v * v;
    }
    if (!std::isfinite(x2)) {
      whole[m] = 1;
      return;
    }
    if (x2 == 0 || n <= 0) {                 // zeros (padding): every logit 0
      out[m] = 0;
      return;
    }
    const double e = std::sqrt(e2), xn = std::sqrt(x2);
    const float s = static_cast<float>((e + g0 * xn + g1 * (xn + e)) * (1 + 1e-6));
    const float* nr = norms;           // (locals: through the lambda's captures GCC gathered)
    const int64_t cols = n;
    const float sl = slack;
    float floor = -std::numeric_limits<float>::infinity(), bad = 0.f;
#pragma omp simd reduction(max : floor, bad)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = ar[c], r = nr[c] * s;
      floor = std::max(floor, v - head_margin(v, r, sl));
      bad = std::max(bad, std::fabs(v) > 1e37f || v != v ? 1.f : 0.f);   // past range, or NaN
    }
    if (bad != 0.f) {
      whole[m] = 1;
      return;
    }
    int64_t best = -1, count = 0;
    float top = 0.f;
    constexpr int64_t kBlock = 256;
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const int64_t c1 = std::min(cols, c0 + kBlock);
      float hit = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : hit)
      for (int64_t c = c0; c < c1; ++c) {
        const float v = ar[c], r = nr[c] * s;
        hit = std::max(hit, v + head_margin(v, r, sl));
      }
      if (hit < floor) continue;
      for (int64_t c = c0; c < c1; ++c) {
        const float v = ar[c], r = nr[c] * s;
        if (v + head_margin(v, r, sl) < floor) continue;
        const float z = panel_dot(xr, w, K, N, c);
        if (++count > kHeadCandidates || std::isnan(z)) {
          whole[m] = 1;
          return;
        }
        if (best < 0 || z > top) best = c, top = z;
      }
    }
    out[m] = static_cast<int32_t>(best);
  });
  std::vector<int64_t> rows;
  for (int64_t m = 0; m < M; ++m)
    if (whole[m]) rows.push_back(m);
  if (rows.empty()) return;
  const int64_t R = static_cast<int64_t>(rows.size());
  std::vector<float> xs(R * K), zs(R * N);
  for (int64_t i = 0; i < R; ++i) std::copy(x + rows[i] * K, x + (rows[i] + 1) * K, xs.data() + i * K);
  linear<float, false>(xs.data(), zs.data(), R, K, N, [&](const float* xa, float* ya, int64_t L) {
    linear_rows<float, false, uint16_t>(xa, w, ya, L, K, N);
  });
  for (int64_t i = 0; i < R; ++i) out[rows[i]] = greedy_row(zs.data() + i * N, n);
}

}  // namespace

// The live rows up to which GreedyHead takes the panels' product (scripts/roofline.py's bound).
extern "C" int64_t GreedyHeadMinRows() { return kHeadMinRows; }

// x [M, K] float32, w [N, K] uint16 (the LM head in bfloat16 panels), pairs [N, ceil(K/2)] uint32
// (the same in pairs), norms [N] float32, meta [1, 2] int32 (real columns first, as GreedyRows')
// -> [M] int32: greedy_head, GreedyRows' tokens over Linear's product of x and w
extern "C" int GreedyHead(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                          void* extra) {
  if (nparam != 6 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 1 || ndims[4] != 2 ||
      std::strcmp(dtypes[0], "float32") || std::strcmp(dtypes[1], "uint16") || std::strcmp(dtypes[2], "uint32") ||
      std::strcmp(dtypes[3], "float32") || std::strcmp(dtypes[4], "int32") || std::strcmp(dtypes[5], "int32"))
    return 1;
  const int64_t M = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  if (shapes[1][1] != K || shapes[2][0] != N || shapes[2][1] != (K + 1) / 2 || shapes[3][0] != N ||
      shapes[4][0] != 1 || shapes[4][1] != 2)
    return 2;
  const int64_t n = std::min<int64_t>(static_cast<const int32_t*>(params[4])[0], N);
  greedy_head(static_cast<const float*>(params[0]), static_cast<const uint16_t*>(params[1]),
              static_cast<const uint32_t*>(params[2]), static_cast<const float*>(params[3]), n,
              static_cast<int32_t*>(params[5]), M, K, N);
  return 0;
}

// x [M, K], w [N, K] panel-major -> [M, N]
extern "C" int Linear(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                      void* extra) {
  return linear_entry<false>(nparam, params, ndims, shapes, dtypes);
}

// x [M, K], w [2I, K] panel-major with gate and up interleaved 16 columns at a time -> silu(x gate^T)
// * (x up^T) [M, I]: the MLP's gate/up projection and its activation in one pass
extern "C" int LinearGlu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                         void* extra) {
  return linear_entry<true>(nparam, params, ndims, shapes, dtypes);
}

// w [V, H] panel-major (or uint16: bfloat16 panels; int16: bfloat16 tiles; uint32 [V, H/2]:
// bfloat16 pairs, H even; all giving float32), ids
// [N] int32 -> [N, H]
extern "C" int Embed(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                     void* extra) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 1) return 1;
  if (std::strcmp(dtypes[0], "int16") == 0) {                  // bfloat16 tiles -> float32
    if (shapes[0][0] % 32 || shapes[0][1] % 32) return 2;
    embed_bf16(static_cast<const uint16_t*>(params[0]), static_cast<const int32_t*>(params[1]),
               static_cast<float*>(params[2]), shapes[1][0], shapes[0][0], shapes[0][1]);
    return 0;
  }
  if (std::strcmp(dtypes[0], "uint16") == 0) {                 // bfloat16 panels -> float32
    embed(static_cast<const uint16_t*>(params[0]), static_cast<const int32_t*>(params[1]),
          static_cast<float*>(params[2]), shapes[1][0], shapes[0][0], shapes[0][1]);
    return 0;
  }
  if (std::strcmp(dtypes[0], "uint32") == 0) {                 // bfloat16 pairs -> float32, out [N, H]
    if (ndims[2] != 2 || shapes[2][1] != 2 * shapes[0][1] || std::strcmp(dtypes[2], "float32")) return 2;
    embed_pairs(static_cast<const uint32_t*>(params[0]), static_cast<const int32_t*>(params[1]),
                static_cast<float*>(params[2]), shapes[1][0], shapes[0][0], shapes[2][1]);
    return 0;
  }
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    embed(static_cast<const T*>(params[0]), static_cast<const int32_t*>(params[1]), static_cast<T*>(params[2]),
          shapes[1][0], shapes[0][0], shapes[0][1]);
  });
  return 0;
}

