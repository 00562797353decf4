// The CPU kernels of msinfer's network, MindSpore AOT custom operators (mindspore.ops.Custom,
// func_type="aot"), built on first use by worker/cpu.py. Each takes float32 or float16 and
// computes in float32:
//   PagedAttention  rotary embedding, the new K/V rows into the cache, then softmax(q K^T /
//                   sqrt(D)) V over each token's context, read through the block tables straight
//                   from the KV cache (no gathered copy, no mask)
//   Linear          x w^T over a weight packed in column panels (every matmul of the network), or
//                   over a bfloat16 weight in AMX tiles, at float32 accuracy (see amx_rows)
//                   or, for a W8A8 layer, over int8 weights and its inputs quantized to int8 per
//                   token, summed exactly with AVX512-VNNI (see linear_vnni), or, for a W4A16
//                   layer, over int4 weights with a scale per group (see int4_rows)
//                   or, computing in bfloat16, over bfloat16 pairs with x rounded to bfloat16,
//                   summed in float32 with AVX512-BF16 (see linear_pairs)
//   LinearGlu       silu(x gate^T) * (x up^T), the MLP's first half, over gate and up packed together
//   Embed           rows of a packed embedding table
//   Rows            rows of a matrix by index, zeros for an index out of range (padding)
//   RmsNorm         x * rsqrt(mean(x^2) + eps) * w over the last dimension
//   AddRmsNorm      x + d (a layer's residual add) and RmsNorm of it, two outputs in one pass
//   SiluMul         silu(gate) * up of a merged [gate | up] projection
//   RopeTables      each token's rotary cos and sin from its position components
//   DecoderLayer    a dense decoder layer of one rank in one call: AddRmsNorm, Linear (qkv),
//                   PagedAttention, Linear (o), AddRmsNorm, LinearGlu, Linear (down), as the
//                   network calls them one by one (see the entry point); DecoderAttention and
//                   DecoderMlp, its halves, where an all-reduce comes between them (tp > 1) or
//                   the other half keeps its operators
//   DecoderStack    every layer of a model whose layers are each one DecoderLayer call, in one
//                   call: those calls in order
//   MoeExperts      a mixture-of-experts layer's experts, each over the tokens routed to it;
//                   weights float, bfloat16 (tiles, or pairs computing in bfloat16), int8 per
//                   channel or int4 per group (W4A16)
//   MoeUp, MoeDown  the same in two calls, for experts whose inputs are quantized per token
//                   (W8A8): over int8 weights with VNNI, or float or int8 weights held as
//                   MoeExperts holds them (see moe.h)
//   SampleStats(T), KeptMass, DrawColumn, CountAtLeast   the device sampler's passes over a vocabulary shard
//   SampleMerge     the step of `sample` between the ranks' stats and a draw over a shard
//   ProcessRows     what penalties, biases, bans and token masks do to the logits, before sampling
//   SampleRows      all of them in one call, for a shard that holds the whole vocabulary (tp 1)
//   GreedyRows      each row's greedy token, for such a shard
//   NodeAllReduce   the sum over a tensor-parallel group whose ranks share a node, and
//   NodeAllGather   every rank's tensor, through shared memory (collective.h; NodeGroupAttach
//                   gives them the group)
// One kernel call replaces the 5-10 MindSpore operators of each, which on the CPU cost a launch
// apiece, an explicit broadcast (see worker/ops.py) and a compile step per graph.
//
// Work is shared by a small pool of threads that spin briefly, then sleep, between calls
// (SetThreads sets how many, the caller's included): OpenMP's long-spinning workers would steal
// the cores from the MindSpore kernels that run next (a decode step was 45% slower with them).
//
// PagedAttention, inputs in order:
//   qkv      [N, (H + 2 KV) D]  the tokens' q, k, v projections, before any norm or rotary
//   q_norm   [D], k_norm [D]    RMSNorm weights of q and k heads (Qwen3), used if norm[1] != 0
//   norm     [2] float32        eps, and whether to norm q and k heads before the rotary
//   cos, sin [N, D/2]           each token's rotary table
//   k_cache  [S * KV, D]        the layer's cache, row slot * KV + kv_head (written in place):
//                               of qkv's dtype, or uint16 holding bfloat16 values for float32
//                               qkv (K and V rounded to nearest as written, widened as read)
//   v_cache  [S * KV, D]
//   slots    [N] int32          the cache slot each token's K/V row goes to (padding: a scratch slot)
//   tables   [M, MB] int32      block table of each sequence in the step
//   rows     [N] int32          which table row (sequence) each token belongs to
//   lens     [N] int32          how many positions of its sequence each token sees (0: padding)
//   meta     [2] int32          block size, KV heads
// Output:
//   out      [N, H D]           softmax(q K^T / sqrt(D)) V, zeros for padding tokens
// First every token's rotated K and its V go to the cache and its rotated q to `out`; then each
// token attends, reading its q back from `out`. The cache is written here rather than by a
// scatter operator in the graph: one pass instead of three operators a layer, and no other
// operator reads the cache, so the order is this kernel's own.
// Query heads sharing a KV head (grouped-query attention) are computed together, so each K/V row
// is read once per token and KV head.
//
// This file holds the entry points of attention, the norms, the sampler's passes and the
// library's switches; linear.cc those of the matmuls (Linear, LinearGlu, Embed, QuantRows and the
// experts'), a translation unit of its own that compiles alongside this one. The kernels are in
// common.h (thread pool, vectors, row-wise pieces, what the two units share), attention.h,
// matmul.h (panels, AMX tiles, lookups), moe.h and sampling.h.

#include <limits>

#include "attention.h"
#include "collective.h"
#include "common.h"
#include "matmul.h"
#include "sampling.h"

namespace {

int64_t numel(int nd, const int64_t* shape) {
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) n *= shape[i];
  return n;
}

}  // namespace

extern "C" int PagedAttention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                              void* stream, void* extra) {
  if (nparam != 14 || ndims[0] != 2 || ndims[6] != 2 || ndims[9] != 2 || ndims[13] != 2 || shapes[12][0] != 2 ||
      shapes[3][0] != 2)
    return 1;
  const int32_t* meta = static_cast<const int32_t*>(params[12]);
  const float* norm = static_cast<const float*>(params[3]);
  const int64_t N = shapes[0][0], D = shapes[6][1], MB = shapes[9][1], bs = meta[0], KV = meta[1];
  const int64_t H = D > 0 ? shapes[13][1] / D : 0;
  if (bs <= 0 || KV <= 0 || H <= 0 || H % KV != 0 || shapes[0][1] != (H + 2 * KV) * D || shapes[4][1] * 2 != D)
    return 2;
  auto i32 = [&](int i) { return static_cast<const int32_t*>(params[i]); };
  if (std::strcmp(dtypes[6], dtypes[7])) return 2;
  if (std::strcmp(dtypes[6], "uint16") == 0) {           // a bfloat16 cache (Bf16), x float32
    if (std::strcmp(dtypes[0], "float32")) return 2;
    auto in = [&](int i) { return static_cast<float*>(params[i]); };
    auto cache = [&](int i) { return static_cast<Bf16*>(params[i]); };
    attend<float, Bf16>(in(0), norm[1] != 0.f ? in(1) : nullptr, in(2), norm[0], in(4), in(5), cache(6), cache(7),
                        i32(8), i32(9), i32(10), i32(11), in(13), N, H, D, KV, MB, bs);
    return 0;
  }
  if (std::strcmp(dtypes[6], dtypes[0])) return 2;
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    auto in = [&](int i) { return static_cast<T*>(params[i]); };
    attend<T>(in(0), norm[1] != 0.f ? in(1) : nullptr, in(2), norm[0], in(4), in(5), in(6), in(7), i32(8), i32(9),
              i32(10), i32(11), in(13), N, H, D, KV, MB, bs);
  });
  return 0;
}

// The entry points DecoderLayer calls as the network would: the matmuls' (linear.cc), AddRmsNorm.
extern "C" int AddRmsNorm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                          void* extra);
extern "C" int Linear(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                      void* extra);
extern "C" int LinearGlu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                         void* extra);
// (PagedAttention by another name: in C++ the name is also the kernel's class template)
extern "C" int paged_attention_entry(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                     void* stream, void* extra) __asm__("PagedAttention");

namespace {

// A [rows, cols] buffer of the layer's dtype at place `at` of an entry point's params.
struct Buffer {
  int at;
  void* data;
  int64_t* shape;
};

// One entry point over params `from` of a fused call (their ndims, shapes, dtypes), with
// buffers at the places `at` names (of dtype `dt0`).
template <typename Entry>
int call_entry(Entry entry, void** params, int* ndims, int64_t** shapes, const char** dtypes, const char* dt0,
               std::initializer_list<int> from, std::initializer_list<Buffer> at) {
  void* p[16];
  int nd[16];
  int64_t* sh[16];
  const char* dt[16];
  int n = 0;
  for (int i : from) {
    p[n] = params[i], nd[n] = ndims[i], sh[n] = shapes[i], dt[n] = dtypes[i];
    ++n;
  }
  for (const Buffer& b : at) p[b.at] = b.data, nd[b.at] = 2, sh[b.at] = b.shape, dt[b.at] = dt0;
  return entry(n, p, nd, sh, dt, nullptr, nullptr);
}

// Whether params `which` are [N, E] of params[0]'s shape and dtype (0 among them: 2-D).
bool rows_like_x(int* ndims, int64_t** shapes, const char** dtypes, std::initializer_list<int> which) {
  for (int i : which)
    if (ndims[i] != 2 || shapes[i][0] != shapes[0][0] || shapes[i][1] != shapes[0][1] ||
        std::strcmp(dtypes[i], dtypes[0]))
      return false;
  return true;
}

// A decoder layer's first half, params as DecoderLayer's 0-17 (and its qkv bias at `bias`, or
// -1): h + delta into `h_out`, its norm, qkv (+ bias), attention, o into `o_out` [N, E]. 0, or
// what the first failing entry point returned.
int attention_half(void** params, int* ndims, int64_t** shapes, const char** dtypes, int bias, void* h_out,
                   void* o_out) {
  if (!rows_like_x(ndims, shapes, dtypes, {0, 1}) || ndims[4] != 2 || ndims[17] != 2 || ndims[10] != 2 ||
      shapes[16][0] != 2)
    return 1;
  const int64_t N = shapes[0][0], E = shapes[0][1], Q = shapes[4][0], D = shapes[10][1];
  const int64_t KV = static_cast<const int32_t*>(params[16])[1], A = Q - 2 * KV * D;
  if (A <= 0 || shapes[17][0] != E) return 2;
  if (bias >= 0 && (ndims[bias] != 1 || shapes[bias][0] != Q || std::strcmp(dtypes[bias], dtypes[0]))) return 2;
  const char* d0 = dtypes[0];
  const int64_t es = dtype_bytes(d0);
  // x [N, E], then the attention's output [N, A] in its place (the qkv projection has read x); qkv [N, Q]
  thread_local std::vector<char> buf;
  const int64_t first = std::max(E, A);
  char* x = scratch(buf, static_cast<size_t>(N * (first + Q) * es));
  char *qkv = x + N * first * es, *att = x;
  int64_t sE[2] = {N, E}, sQ[2] = {N, Q}, sA[2] = {N, A};
  auto call = [&](auto entry, std::initializer_list<int> from, std::initializer_list<Buffer> at) {
    return call_entry(entry, params, ndims, shapes, dtypes, d0, from, at);
  };
  int rc = call(AddRmsNorm, {0, 1, 2, 3, 0, 0}, {{4, h_out, sE}, {5, x, sE}});
  rc = rc ? rc : call(Linear, {0, 4, 0}, {{0, x, sE}, {2, qkv, sQ}});
  if (rc == 0 && bias >= 0) {
    with_dtype(d0, [&](auto tag) {
      using T = decltype(tag);
      T* y = reinterpret_cast<T*>(qkv);
      const T* b = static_cast<const T*>(params[bias]);
      parallel_for(N, 16, [&](int64_t n) {
#pragma omp simd
        for (int64_t j = 0; j < Q; ++j) y[n * Q + j] = static_cast<T>(y[n * Q + j] + b[j]);
      });
    });
  }
  rc = rc ? rc : call(paged_attention_entry, {0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 0},
                      {{0, qkv, sQ}, {13, att, sA}});
  return rc ? rc : call(Linear, {0, 17, 0}, {{0, att, sA}, {2, o_out, sE}});
}

// Its second half: params 0 h [N, E] (the residual stream after the attention's input, h_out
// above), 1 o [N, E] (the attention's output, all-reduced), 2 post_norm, 3 post_eps, 4
// gate_up_w, 5 down_w: h + o into `h_out` (h_out may be h), its norm, the gate/up projection with
// its activation, down into `d_out`.
int mlp_half(void** params, int* ndims, int64_t** shapes, const char** dtypes, void* h_out, void* d_out) {
  if (!rows_like_x(ndims, shapes, dtypes, {0, 1}) || ndims[4] != 2 || ndims[5] != 2) return 1;
  const int64_t N = shapes[0][0], E = shapes[0][1], I = shapes[4][0] / 2;
  if (shapes[5][0] != E) return 2;
  const char* d0 = dtypes[0];
  const int64_t es = dtype_bytes(d0);
  thread_local std::vector<char> buf;             // x [N, E], glu [N, I]
  char* x = scratch(buf, static_cast<size_t>(N * (E + I) * es));
  char* g = x + N * E * es;
  int64_t sE[2] = {N, E}, sI[2] = {N, I};
  auto call = [&](auto entry, std::initializer_list<int> from, std::initializer_list<Buffer> at) {
    return call_entry(entry, params, ndims, shapes, dtypes, d0, from, at);
  };
  int rc = call(AddRmsNorm, {0, 1, 2, 3, 0, 0}, {{4, h_out, sE}, {5, x, sE}});
  rc = rc ? rc : call(LinearGlu, {0, 4, 0}, {{0, x, sE}, {2, g, sI}});
  return rc ? rc : call(Linear, {0, 5, 0}, {{0, g, sI}, {2, d_out, sE}});
}

}  // namespace

// A dense decoder layer of one rank in one call (worker/model.py LayerBase.fuse): the seven
// kernels the network otherwise calls one operator at a time, called here in the same order on
// the same values, so the outputs are theirs to the bit. On the CPU, MindSpore spends about 5 us
// launching an operator: the 210 of a 30-layer model's layers, 1 ms of a decode step.
//   h, delta [N, E]          the residual stream and the layer before's output (LayerBase.construct)
//   in_norm [E], in_eps [1]  input_layernorm's weight and eps (float32)
//   qkv_w                    qkv_proj's weight, as Linear takes it (3 params: any of its packings)
//   q_norm, k_norm, norm, cos, sin, k_cache, v_cache, slots, tables, rows, lens, meta
//                            PagedAttention's inputs after qkv, in its order
//   o_w                      o_proj's weight
//   post_norm [E], post_eps [1]   post_attention_layernorm's
//   gate_up_w                the MLP's gate/up weight as LinearGlu takes it; down_w: down_proj's
//   qkv_b [Q]                (optional: Qwen2's) qkv_proj's bias, added to the projection's rows
//                            as the network's Add does (in the layer's dtype)
// Outputs: h + delta + the attention's output (the residual stream after the attention) and the
// MLP's output [N, E], as LayerBase.construct returns them.
extern "C" int DecoderLayer(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                            void* stream, void* extra) {
  if ((nparam != 24 && nparam != 25) || !rows_like_x(ndims, shapes, dtypes, {nparam - 2, nparam - 1})) return 1;
  void* h = params[nparam - 2];
  thread_local std::vector<char> o;              // the attention's output [N, E]
  const int64_t es = dtype_bytes(dtypes[0]);
  int rc = attention_half(params, ndims, shapes, dtypes, nparam == 25 ? 22 : -1, h,
                          scratch(o, static_cast<size_t>(shapes[0][0] * shapes[0][1] * es)));
  if (rc) return rc;
  void* p[6] = {h, o.data(), params[18], params[19], params[20], params[21]};
  int nd[6] = {2, 2, ndims[18], ndims[19], ndims[20], ndims[21]};
  int64_t* sh[6] = {shapes[0], shapes[0], shapes[18], shapes[19], shapes[20], shapes[21]};
  const char* dt[6] = {dtypes[0], dtypes[0], dtypes[18], dtypes[19], dtypes[20], dtypes[21]};
  return mlp_half(p, nd, sh, dt, h, params[nparam - 1]);
}

namespace {
// Tokens per thread from which DecoderStack gives each thread a share of a step's sequences to
// run through every layer alone, instead of sharing each kernel between the threads. Each thread
// then streams every weight (the other's copy is in L3, a layer's weights being a few MB), no
// kernel waits for the slower thread, and one thread's attention (bound by memory) runs while
// the other's matmuls (bound by multiply-adds) do. At 8 tokens a thread the weights' stream
// outruns the caches (the demo model at batch 16 in bfloat16 pairs, Zen 5: 11.99 ms a step
// against 9.33 shared); at 16 and 32 the split was 3-6% faster (docs/benchmarks.md).
constexpr int64_t kAloneRows = 16;
// Steps of more tokens (a prefill) share each kernel: their matmuls' rows are blocks that reuse
// each panel from L2, and their weights are read once.
constexpr int64_t kAloneMaxTokens = 128;
bool g_alone = true;                            // SetAlone
std::atomic<int64_t> g_stack_shares{0};         // DecoderStack calls that split their step (StackShares)

// Where DecoderStack's shares of a step of N tokens start (seq: each token's sequence, tokens of
// a sequence consecutive; lens: 0 for padding, which comes last) and end (at[parts]): one share a
// thread, split where a sequence ends, at most 1.5 times the even share each. None (an empty
// vector) when the step is too small, or too uneven (a long prompt's chunk), to split.
std::vector<int64_t> alone_shares(int64_t N, const int32_t* seq, const int32_t* lens) {
  const int64_t threads = threads_now();
  if (!g_alone || threads < 2 || N > kAloneMaxTokens) return {};
  int64_t live = N;
  while (live > 0 && lens[live - 1] <= 0) --live;
  if (live < kAloneRows * threads) return {};
  std::vector<int64_t> at(threads + 1, N);
  at[0] = 0;
  for (int64_t k = 1; k < threads; ++k) {
    int64_t b = std::max(at[k - 1], live * k / threads);
    while (b < live && seq[b] == seq[b - 1]) ++b;
    at[k] = b;
  }
  for (int64_t k = 0; k < threads; ++k)
    if (2 * (std::min(at[k + 1], live) - at[k]) * threads > 3 * live) return {};
  return at;
}
}  // namespace

// A run of dense decoder layers in one call: DecoderLayer's for each, in order, on the residual
// stream and the output the layer before leaves in the outputs (so the results are those of the
// layers' calls one by one, to the bit). MindSpore spends its time between one operator and the
// next, and on each input of an operator, once a step instead of once a layer; an input that every
// layer shares (eps, metadata), or that holds every layer's (the weights or caches of one kind,
// [L, ...]), once.
//   0-7  h, delta [N, E]; cos, sin, slots, tables, rows, lens: DecoderLayer's first two, and
//        PagedAttention's inputs that every layer shares
//   8    stack [2 + 2 S] int32: the layers L, the inputs K each has of its own (the last L x K
//        inputs, layer after layer), then where each of DecoderLayer's S inputs of a layer is
//        (S = 14 or 15: in_norm, in_eps, qkv_w, q_norm, k_norm, norm, k_cache, v_cache, meta,
//        o_w, post_norm, post_eps, gate_up_w, down_w[, qkv_b]): v >= 0, the layer's own input v;
//        v < 0, this call's input -1 - v, the same for every layer; then, for each, 1 where that
//        input of the call holds every layer's, [L, ...] (layer l's: its l-th [...]), else 0
//   then the shared inputs, then each layer's own
// Outputs: h and delta after the last layer.
// A decode step of enough tokens (alone_shares) is split between the threads at sequence
// boundaries, and each thread runs every layer for its share with t_alone set: its kernels take
// no helper. A token's results do not depend on the other rows of its step, so they are the
// same to the bit either way.
extern "C" int DecoderStack(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                            void* stream, void* extra) {
  constexpr int kFixed = 9;
  if (nparam < kFixed + 2 || ndims[8] != 1 || shapes[8][0] % 2 || std::strcmp(dtypes[8], "int32")) return 1;
  const int32_t* stack = static_cast<const int32_t*>(params[8]);
  const int64_t L = stack[0], K = stack[1], S = (shapes[8][0] - 2) / 2, first = nparam - 2 - L * K;   // (its own)
  const int32_t *where = stack + 2, *sliced = stack + 2 + S;
  if ((S != 14 && S != 15) || L < 1 || K < 0 || first < kFixed ||
      !rows_like_x(ndims, shapes, dtypes, {1, nparam - 2, nparam - 1}))
    return 1;
  for (int64_t j = 0; j < S; ++j) {
    const int64_t v = where[j], at = -1 - v;
    if (v >= K || (v < 0 && (at < kFixed || at >= first)) ||
        (sliced[j] && (v >= 0 || ndims[at] < 2 || shapes[at][0] != L || element_bytes(dtypes[at]) == 0)))
      return 1;
  }
  void *h = params[nparam - 2], *d = params[nparam - 1];
  const size_t bytes = static_cast<size_t>(shapes[0][0] * shapes[0][1] * dtype_bytes(dtypes[0]));
  std::memcpy(h, params[0], bytes);
  std::memcpy(d, params[1], bytes);
  // DecoderLayer's inputs: the outputs (h, delta), the shared ones (this call's 2-7), and S of a layer
  constexpr int kShared[6][2] = {{8, 2}, {9, 3}, {12, 4}, {13, 5}, {14, 6}, {15, 7}};
  constexpr int kLayer[15] = {2, 3, 4, 5, 6, 7, 10, 11, 16, 17, 18, 19, 20, 21, 22};
  const int n = static_cast<int>(8 + S);
  // Every layer for tokens n0..n1-1: their rows of the outputs and of the inputs by token (cos,
  // sin, slots, rows, lens), the rest as they are.
  auto layers = [&](int64_t n0, int64_t n1) {
    const int64_t rows = n1 - n0;
    int64_t sE[2] = {rows, shapes[0][1]}, sR[2] = {rows, shapes[2][1]}, sN[1] = {rows};
    for (int64_t l = 0; l < L; ++l) {
      void* p[25];
      int nd[25];
      int64_t* sh[25];
      const char* dt[25];
      auto put = [&](int i, int64_t from) {
        p[i] = params[from], nd[i] = ndims[from], sh[i] = shapes[from], dt[i] = dtypes[from];
      };
      put(0, nparam - 2);
      put(1, nparam - 1);
      for (const auto& [i, from] : kShared) put(i, from);
      for (int64_t j = 0; j < S; ++j) {
        const int64_t v = where[j], at = v >= 0 ? first + l * K + v : -1 - v;
        put(kLayer[j], at);
        if (sliced[j]) {            // layer l's [...] of an [L, ...] input
          const int64_t bytes = numel(ndims[at], shapes[at]) / L * element_bytes(dtypes[at]);
          p[kLayer[j]] = static_cast<char*>(params[at]) + l * bytes;
          nd[kLayer[j]] = ndims[at] - 1;
          sh[kLayer[j]] = shapes[at] + 1;
        }
      }
      put(n, nparam - 2);
      put(n + 1, nparam - 1);
      if (rows != shapes[0][0]) {
        for (int i : {0, 1, n, n + 1}) p[i] = static_cast<char*>(p[i]) + n0 * sE[1] * dtype_bytes(dt[0]), sh[i] = sE;
        for (int i : {8, 9}) p[i] = static_cast<char*>(p[i]) + n0 * sR[1] * element_bytes(dt[i]), sh[i] = sR;
        for (int i : {12, 14, 15}) p[i] = static_cast<int32_t*>(p[i]) + n0, sh[i] = sN;
      }
      const int rc = DecoderLayer(n + 2, p, nd, sh, dt, stream, extra);
      if (rc) return rc;
    }
    return 0;
  };
  // A decode step of enough tokens: each thread runs every layer for its share of the sequences,
  // alone (t_alone: its kernels take no helper).
  const std::vector<int64_t> at = alone_shares(shapes[0][0], static_cast<const int32_t*>(params[6]),
                                               static_cast<const int32_t*>(params[7]));
  if (at.empty()) return layers(0, shapes[0][0]);
  const int64_t parts = static_cast<int64_t>(at.size()) - 1;
  g_stack_shares.fetch_add(1, std::memory_order_relaxed);
  std::atomic<int> failed{0};
  parallel_for(parts, 1, [&](int64_t k) {
    msinfer_shared::t_alone = true;
    const int rc = at[k] < at[k + 1] ? layers(at[k], at[k + 1]) : 0;
    msinfer_shared::t_alone = false;
    if (rc) failed.store(rc);
  });
  return failed.load();
}

// The two halves of DecoderLayer, for a layer whose o and down projections' partial sums are
// all-reduced between them (tp above 1), or whose other half keeps its operators (experts,
// latent attention): DecoderAttention takes DecoderLayer's inputs up to o_w (and the qkv bias
// after them) and gives (h + delta, the attention's output before any all-reduce); DecoderMlp
// takes (that h, the attention's output, reduced, post_norm, post_eps, gate_up_w, down_w) and
// gives (the residual stream after the attention, the MLP's output before any all-reduce).
extern "C" int DecoderAttention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                void* stream, void* extra) {
  if ((nparam != 20 && nparam != 21) || !rows_like_x(ndims, shapes, dtypes, {nparam - 2, nparam - 1})) return 1;
  return attention_half(params, ndims, shapes, dtypes, nparam == 21 ? 18 : -1, params[nparam - 2],
                        params[nparam - 1]);
}

extern "C" int DecoderMlp(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                          void* stream, void* extra) {
  if (nparam != 8 || !rows_like_x(ndims, shapes, dtypes, {6, 7})) return 1;
  return mlp_half(params, ndims, shapes, dtypes, params[6], params[7]);
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

// x [..., H], d [..., H], w [H], eps [1] float32 -> (x + d, rms_norm(x + d) * w), both [..., H]
extern "C" int AddRmsNorm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                          void* extra) {
  if (nparam != 6 || ndims[0] < 1 || ndims[1] != ndims[0] || std::strcmp(dtypes[0], dtypes[1])) return 1;
  const int64_t H = shapes[0][ndims[0] - 1], rows = numel(ndims[0], shapes[0]) / std::max<int64_t>(H, 1);
  if (numel(ndims[1], shapes[1]) != rows * H) return 1;
  const float eps = *static_cast<const float*>(params[3]);
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm(static_cast<const T*>(params[0]), static_cast<const T*>(params[1]), static_cast<const T*>(params[2]),
                 eps, static_cast<T*>(params[4]), static_cast<T*>(params[5]), rows, H);
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

// x [N, H], idx [M] int32 -> [M, H]
extern "C" int Rows(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                    void* extra) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 1) return 1;
  with_dtype(dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    rows_of(static_cast<const T*>(params[0]), static_cast<const int32_t*>(params[1]), static_cast<T*>(params[2]),
            shapes[0][0], shapes[1][0], shapes[0][1]);
  });
  return 0;
}

// positions [N, P] float32, freq [P, F] float32, factor [1] float32 -> cos, sin [N, F] float32:
// each angle sum_p positions[n][p] freq[p][f] in float32 (p in order, as MindSpore's MatMul of
// the two), its cosine and sine computed in double and rounded to float32, then times factor
// (YaRN's attention factor; 1 leaves them as they are). CausalLM.forward's rotary tables in one
// operator where MatMul, Cos and Sin were three.
extern "C" int RopeTables(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                          void* extra) {
  if (nparam != 5 || ndims[0] != 2 || ndims[1] != 2 || shapes[0][1] != shapes[1][0] || numel(ndims[2], shapes[2]) != 1)
    return 1;
  for (int i = 0; i < 3; ++i)
    if (std::strcmp(dtypes[i], "float32")) return 1;
  const int64_t N = shapes[0][0], P = shapes[0][1], F = shapes[1][1];
  const float* pos = static_cast<const float*>(params[0]);
  const float* freq = static_cast<const float*>(params[1]);
  const float factor = *static_cast<const float*>(params[2]);
  float* cos = static_cast<float*>(params[3]);
  float* sin = static_cast<float*>(params[4]);
  parallel_for(N, 64, [&](int64_t n) {
    for (int64_t f = 0; f < F; ++f) {
      float a = 0.f;
      for (int64_t p = 0; p < P; ++p) a += pos[n * P + p] * freq[p * F + f];
      double s, c;
      ::sincos(static_cast<double>(a), &s, &c);
      cos[n * F + f] = static_cast<float>(c) * factor;
      sin[n * F + f] = static_cast<float>(s) * factor;
    }
  });
  return 0;
}

// x [M, P] float32, meta [1, 2] int32 (the shard's real columns first) -> [M] int32: each row's
// greedy token (greedy_row), the whole of VocabSampler.greedy at tp 1
extern "C" int GreedyRows(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                          void* extra) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 2 || shapes[1][0] != 1 || shapes[1][1] != 2 ||
      std::strcmp(dtypes[0], "float32"))
    return 1;
  const int64_t P = shapes[0][1], n = std::min<int64_t>(static_cast<const int32_t*>(params[1])[0], P);
  greedy_rows(static_cast<const float*>(params[0]), n, static_cast<int32_t*>(params[2]), shapes[0][0], P);
  return 0;
}

// Each shard's real columns, at most the rows' width (shapes[0][1]): from meta [R, 2] int32,
// params[at], whose first column holds them.
static std::vector<int32_t> real_columns(void** params, int64_t** shapes, int at) {
  const int32_t* meta = static_cast<const int32_t*>(params[at]);
  std::vector<int32_t> cols(shapes[at][0]);
  for (size_t r = 0; r < cols.size(); ++r) cols[r] = std::min<int32_t>(meta[2 * r], shapes[0][1]);
  return cols;
}

// x [Q, P] float32, (t [M]: SampleStatsT), meta [R, 2] int32 (real columns of each shard, with_sum)
// -> [Q, 4 + 2C] (sample_stats)
static int sample_stats_call(void** params, int64_t** shapes, const float* t, int meta_at) {
  const std::vector<int32_t> cols = real_columns(params, shapes, meta_at);
  const bool with_sum = static_cast<const int32_t*>(params[meta_at])[1] != 0;
  sample_stats(static_cast<const float*>(params[0]), t, cols.data(), static_cast<float*>(params[meta_at + 1]),
               shapes[0][0], shapes[meta_at][0], shapes[0][1], (shapes[meta_at + 1][1] - 4) / 2, with_sum);
  return 0;
}

extern "C" int SampleStats(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                           void* extra) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || shapes[2][1] % 2 || shapes[2][1] < 6 ||
      shapes[0][0] % shapes[1][0])
    return 1;
  return sample_stats_call(params, shapes, nullptr, 1);
}

extern "C" int SampleStatsT(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                            void* stream, void* extra) {
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 2 || ndims[3] != 2 || shapes[3][1] % 2 ||
      shapes[3][1] < 6 || shapes[0][0] != shapes[1][0] * shapes[2][0])
    return 1;
  return sample_stats_call(params, shapes, static_cast<const float*>(params[1]), 2);
}

// x [Q, P] float32, entries [E, 5] float32, mask [M, W] int32, meta [R, 3] int32 (each shard's
// first column, real columns, and in meta[0][2] whether mask applies) -> [Q, P] (process_rows)
extern "C" int ProcessRows(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                           void* stream, void* extra) {
  if (nparam != 5 || ndims[0] != 2 || ndims[1] != 2 || shapes[1][1] != 5 || ndims[2] != 2 || ndims[3] != 2 ||
      shapes[3][1] != 3 || shapes[3][0] < 1 || shapes[0][0] % shapes[3][0] ||
      shapes[2][0] != shapes[0][0] / shapes[3][0])
    return 1;
  const int32_t* meta = static_cast<const int32_t*>(params[3]);
  const int64_t R = shapes[3][0];
  std::vector<int32_t> starts(R), cols(R);
  for (int64_t r = 0; r < R; ++r) {
    starts[r] = meta[3 * r];
    cols[r] = std::min<int32_t>(meta[3 * r + 1], shapes[0][1]);
  }
  process_rows(static_cast<const float*>(params[0]), static_cast<const float*>(params[1]),
               meta[2] ? static_cast<const int32_t*>(params[2]) : nullptr, starts.data(), cols.data(),
               static_cast<float*>(params[4]), shapes[0][0], R, shapes[0][1], shapes[1][0], shapes[2][1]);
  return 0;
}

// st [tp M, 4 + 2C], prm [M, 5], kept [tp M], starts [tp] -> [M, 2 + 2K + 5] (sample_merge)
extern "C" int SampleMerge(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                           void* extra) {
  if (nparam != 5 || ndims[0] != 2 || ndims[1] != 2 || shapes[1][1] != 5 || ndims[2] != 1 || ndims[3] != 1 ||
      ndims[4] != 2 || shapes[4][0] != shapes[1][0] || shapes[0][0] != shapes[1][0] * shapes[3][0] ||
      shapes[2][0] != shapes[0][0] || shapes[0][1] % 2 || shapes[0][1] < 6 || (shapes[4][1] - 7) % 2)
    return 1;
  const int64_t C = (shapes[0][1] - 4) / 2, K = (shapes[4][1] - 7) / 2;
  if (K < 0 || K > C) return 1;
  sample_merge(static_cast<const float*>(params[0]), static_cast<const float*>(params[1]),
               static_cast<const float*>(params[2]), static_cast<const float*>(params[3]),
               static_cast<float*>(params[4]), shapes[1][0], shapes[3][0], C, K);
  return 0;
}

// x [Q, P] float32, prm [M, 3], meta [R, 2] -> [Q] (kept_mass)
extern "C" int KeptMass(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                        void* extra) {
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 2 || shapes[1][1] != 3 || ndims[2] != 2 ||
      shapes[0][0] != shapes[1][0] * shapes[2][0])
    return 1;
  const std::vector<int32_t> cols = real_columns(params, shapes, 2);
  kept_mass(static_cast<const float*>(params[0]), static_cast<const float*>(params[1]), cols.data(),
            static_cast<float*>(params[3]), shapes[0][0], shapes[2][0], shapes[0][1]);
  return 0;
}

// x [Q, P] float32, thresholds [M], meta [R, 2] -> [Q] (count_at_least)
extern "C" int CountAtLeast(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                            void* stream, void* extra) {
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 2 || shapes[0][0] != shapes[1][0] * shapes[2][0])
    return 1;
  const std::vector<int32_t> cols = real_columns(params, shapes, 2);
  count_at_least(static_cast<const float*>(params[0]), static_cast<const float*>(params[1]), cols.data(),
                 static_cast<float*>(params[3]), shapes[0][0], shapes[2][0], shapes[0][1]);
  return 0;
}

// x [Q, P] float32, prm [M, 3], target [Q], meta [R, 2] -> [Q, 2] (draw_column)
extern "C" int DrawColumn(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                          void* extra) {
  if (nparam != 5 || ndims[0] != 2 || ndims[1] != 2 || shapes[1][1] != 3 || ndims[2] != 1 || ndims[3] != 2 ||
      shapes[0][0] != shapes[1][0] * shapes[3][0] || shapes[2][0] != shapes[0][0])
    return 1;
  const std::vector<int32_t> cols = real_columns(params, shapes, 3);
  draw_column(static_cast<const float*>(params[0]), static_cast<const float*>(params[1]),
              static_cast<const float*>(params[2]), cols.data(), static_cast<float*>(params[4]), shapes[0][0],
              shapes[3][0], shapes[0][1]);
  return 0;
}

// x [M, P] float32, prm [M, 5], meta [1, 2] = (real columns, C) -> [M, 2 + 2K] (sample_rows)
extern "C" int SampleRows(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                          void* extra) {
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 2 || shapes[1][1] != 5 || shapes[1][0] != shapes[0][0] ||
      ndims[2] != 2 || shapes[2][0] != 1 || ndims[3] != 2 || shapes[3][0] != shapes[0][0] || shapes[3][1] % 2)
    return 1;
  const int32_t* meta = static_cast<const int32_t*>(params[2]);
  const int64_t n = std::min<int64_t>(meta[0], shapes[0][1]), C = meta[1], K = (shapes[3][1] - 2) / 2;
  if (C < 1 || C > n || K > C) return 1;
  sample_rows(static_cast<const float*>(params[0]), static_cast<const float*>(params[1]), n,
              static_cast<float*>(params[3]), shapes[0][0], shapes[0][1], C, K);
  return 0;
}

// This process's rank of a node group: the segment every rank has mapped at `base` (`bytes`, its
// header and two buffers of `world` slots of `slot_bytes`), and how long a rank waits for the
// others. 0, or 1: the segment cannot hold them, or the library was built elsewhere than Linux.
extern "C" int NodeGroupAttach(void* base, int64_t bytes, int rank, int world, int64_t slot_bytes, double timeout_s) {
#ifndef MSINFER_NODE_GROUP
  return 1;
#endif
  if (base == nullptr || world < 2 || world > kNodeMaxRanks || rank < 0 || rank >= world || slot_bytes < 64 ||
      slot_bytes % 64 || NodeGroup::header_bytes(world) + 2 * world * slot_bytes > bytes)
    return 1;
  g_node = NodeGroup{static_cast<char*>(base), rank, world, slot_bytes, static_cast<int64_t>(timeout_s * 1e9), 0};
  return 0;
}

// x [...] float32, float16 or bfloat16, tag [1] int32 (the call site) -> the sum of x over the
// node group's ranks, the same bits on each. 1: no group or a bad argument; 2: a rank did not
// come within the group's timeout; 3: the ranks reached different call sites.
extern "C" int NodeAllReduce(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                             void* extra) {
  if (nparam != 3 || g_node.base == nullptr || std::strcmp(dtypes[0], dtypes[2]) ||
      numel(ndims[0], shapes[0]) != numel(ndims[2], shapes[2]) || numel(ndims[1], shapes[1]) != 1)
    return 1;
  const int64_t n = numel(ndims[0], shapes[0]);
  const int32_t tag = *static_cast<const int32_t*>(params[1]);
  if (std::strcmp(dtypes[0], "bfloat16") == 0)
    return node_all_reduce(static_cast<const uint16_t*>(params[0]), static_cast<uint16_t*>(params[2]), n, tag);
  if (std::strcmp(dtypes[0], "float16") == 0)
    return node_all_reduce(static_cast<const _Float16*>(params[0]), static_cast<_Float16*>(params[2]), n, tag);
  if (std::strcmp(dtypes[0], "float32") == 0)
    return node_all_reduce(static_cast<const float*>(params[0]), static_cast<float*>(params[2]), n, tag);
  return 1;
}

// x [n, ...] (any dtype), tag [1] int32 -> [world n, ...]: every rank's x, rank after rank. Codes as
// NodeAllReduce's.
extern "C" int NodeAllGather(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                             void* extra) {
  const int64_t size = element_bytes(dtypes[0]);
  if (nparam != 3 || g_node.base == nullptr || size == 0 || std::strcmp(dtypes[0], dtypes[2]) ||
      numel(ndims[2], shapes[2]) != g_node.world * numel(ndims[0], shapes[0]) || numel(ndims[1], shapes[1]) != 1)
    return 1;
  return node_all_gather(static_cast<const char*>(params[0]), static_cast<char*>(params[2]),
                         numel(ndims[0], shapes[0]) * size, *static_cast<const int32_t*>(params[1]));
}

// Whether Linear and Embed take bfloat16 weights in AMX tiles (int16): the library was built for a
// CPU with AMX and the kernel lets this process use it.
extern "C" int AmxReady() {
#ifdef MSINFER_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// Whether Linear and LinearGlu take int8 inputs quantized per token (linear_vnni): the library was
// built for a CPU with AVX512-VNNI.
extern "C" int VnniReady() {
#ifdef MSINFER_VNNI
  return 1;
#else
  return 0;
#endif
}

// Whether Linear and LinearGlu take int4 weights in groups (int4_rows): the library was built for
// a CPU with AVX-512.
extern "C" int Int4Ready() {
#ifdef MSINFER_INT4
  return 1;
#else
  return 0;
#endif
}

// Whether Linear and LinearGlu compute bfloat16 pairs (uint32 weights) with VDPBF16PS: the
// library was built for a CPU with AVX512-BF16. Without it they take FMAs, to the same bits.
extern "C" int Bf16DotReady() {
#ifdef MSINFER_BF16_DOT
  return 1;
#else
  return 0;
#endif
}

// SetBf16Dot(0): bfloat16 pairs with FMAs even where VDPBF16PS is there (MSINFER_BF16_DOT=0).
extern "C" void SetBf16Dot(int on) { g_bf16_dot = on != 0; }

// SetAlone(0): DecoderStack shares each kernel between the threads at every step (MSINFER_ALONE=0).
extern "C" void SetAlone(int on) { g_alone = on != 0; }
// SetSteal(0): the threads of a matmul's or attention's runs (runs_taken) do not take each
// other's items (MSINFER_STEAL=0); StolenItems: how many they took (tests).
extern "C" void SetSteal(int on) { msinfer_shared::g_steal = on != 0; }
extern "C" int64_t StolenItems() { return msinfer_shared::g_stolen.load(); }
// How many DecoderStack calls split their step between the threads (tests).
extern "C" int64_t StackShares() { return g_stack_shares.load(); }

// How many threads the kernels use, the caller's included (the worker's MindSpore thread count).
extern "C" void SetThreads(int threads) { g_threads = std::max(1, threads); }

// The instruction set's multiply-add rate, for scripts/roofline.py's lower bound: 8 items a
// thread of `iterations` rounds of 12 independent vector multiply-adds in registers, no memory
// traffic, on the kernels' threads. kind 0: float32 FMAs (16 products an instruction on AVX-512,
// 8 on AVX2); kind 1: VDPBF16PS (32 bfloat16 products into float32). Returns the FLOPs done (2 a
// product), or -1 for VDPBF16PS where the library was built without it.
extern "C" double PeakFlops(int kind, int64_t iterations, float x) {
  constexpr int kAcc = 12;
  const int64_t items = 8 * static_cast<int64_t>(g_threads);
  std::atomic<uint32_t> sink{0};
  if (kind == 0) {
    // In the CPU's own vector: 12 accumulators of 16 lanes are 24 of AVX2's 16 registers, and
    // spilled they measured 13 GFLOP/s on a Zen 3 whose FMAs do 160-196.
    parallel_for(items, 1, [&](int64_t) {
      vreg acc[kAcc];
      for (int i = 0; i < kAcc; ++i) acc[i] = vreg{} + x * static_cast<float>(i);
      const vreg a = vreg{} + x, b = vreg{} + (1.f - x);
      for (int64_t k = 0; k < iterations; ++k)
#pragma GCC unroll 12
        for (int i = 0; i < kAcc; ++i) acc[i] = acc[i] * a + b;
      vreg s = acc[0];
      for (int i = 1; i < kAcc; ++i) s += acc[i];
      sink.fetch_add(static_cast<uint32_t>(s[0] != 0.f));
    });
    return 2.0 * kLanes * kAcc * static_cast<double>(iterations) * items;
  }
#ifdef MSINFER_BF16_DOT
  if (kind == 1) {
    parallel_for(items, 1, [&](int64_t) {
      __m512 acc[kAcc];
      for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(x * static_cast<float>(i));
      const __m512bh a = (__m512bh)_mm512_set1_epi16(static_cast<short>(bf16_rounded(x)));
      const __m512bh b = (__m512bh)_mm512_set1_epi16(static_cast<short>(bf16_rounded(1.f - x)));
      for (int64_t k = 0; k < iterations; ++k)
#pragma GCC unroll 12
        for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
      __m512 s = acc[0];
      for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
      sink.fetch_add(static_cast<uint32_t>(_mm512_reduce_add_ps(s) != 0.f));
    });
    return 2.0 * 32 * kAcc * static_cast<double>(iterations) * items;
  }
#endif
  return -1.0;
}
