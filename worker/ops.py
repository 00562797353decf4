"""The device seam: the handful of per-device operators the network uses, chosen once per worker.

    rms_norm      x * rsqrt(mean(x^2) + eps) * w, in float32 (a cell per eps: `rms_norm_op`); with
                  a layer's residual add before it (`add_rms_norm_op`: the sum and its norm, in
                  one kernel on the CPU, the add then the norm elsewhere)
    rotary        q*cos + rotate_half(q)*sin (the Hugging Face, non-interleaved layout)
    silu_mul      silu(gate) * up
    attention     the new K/V rows into the layer's cache, then attention: among the step's own
                  tokens for a prefill with nothing cached, else paged (each token reads its
                  sequence's K/V rows through the block table)
    latent attention  DeepSeek's: the latents into the layer's cache, then attention over them as
                  one KV head (`latent_attention`)
    linear        x w^T, and the embedding lookup, both over weights the device may reorder
                  (`pack_weight`) once they are loaded
    moe           a sparse layer's router and its experts (`moe_router`, `moe_op`)

`MsOps` writes them in portable MindSpore primitives (`model.ops: portable`), here.
`worker.cpu.CpuOps` replaces them with kernels of our own; `worker.ascend.AscendOps` calls
MindSpore's fused Ascend kernels. `worker.device.select_ops` chooses one per worker; this module
imports none of them.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import mint, nn, ops

from msinfer.sharding.layers import HALVES, SOFTMAX, TOPK, new_param

def rms_norm(x, weight, eps: float):
    """(x * rsqrt(mean(x^2) + eps) * weight, rsqrt(...)) in MindSpore primitives, in float32
    whatever x's dtype."""
    x32 = x.astype(ms.float32)
    rstd = ops.rsqrt(ops.mean(x32 * x32, -1, keep_dims=True) + eps)
    y = (x32 * ops.broadcast_to(rstd, (-1,) * (x32.ndim - 1) + (x32.shape[-1],))).astype(x.dtype)
    return y * ops.broadcast_to(weight, y.shape), rstd


class RmsNorm(nn.Cell):
    """`rms_norm` as a cell with its eps: (x, weight) -> normalized x."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def construct(self, x, weight):
        return rms_norm(x, weight, self.eps)[0]


class AddThenNorm(nn.Cell):
    """A residual add, then a device's norm cell: (x, delta, weight) -> (x + delta, its norm)."""

    def __init__(self, norm: nn.Cell):
        super().__init__()
        self.norm = norm

    def construct(self, x, delta, weight):
        s = x + delta
        return s, self.norm(s, weight)


# The score of a position a token must not see. Finite, so that a padding token that sees nothing
# (static shapes) gets a uniform average instead of NaN; exp() of it is 0 in float32.
MASKED = -1e30


def int_range(n):
    """[0, 1, ..., n - 1] int32, n an int or a graph's dynamic dimension: MindSpore's Range
    operator, the one ops.arange calls, then a cast. ops.arange first works out its dtype with
    Python code (str() of types, a dict) that a dynamic-shape graph cannot fold: it compiles into
    each graph that calls it, about 0.8 s of type inference a graph on a Zen 3 core; ops.range's
    call of the same operator about 0.1 s."""
    return ops.range(0, n, 1).astype(ms.int32)


def cache_index(slot_mapping, block_size: int):
    """[T, 2]: each slot's (block, offset) in a cache [blocks, block_size, ...], where
    scatter_nd_update writes the token's row (a slot is block * block_size + offset)."""
    return ops.stack((slot_mapping // block_size, slot_mapping % block_size), -1)


def _softmax_pv(scores, visible, v):
    """softmax over the last axis of float32 scores [..., L] where `visible` (of their shape), then
    times v [..., L, D] in v's dtype."""
    return ops.bmm(SOFTMAX(ops.select(visible, scores, MASKED)).astype(v.dtype), v)


def paged_attention(q, k_cache, v_cache, tables, lens, scale: float, bias=None):
    """Each token n of q [N, H, D] attends over the first lens[n] positions of its sequence, whose
    cache blocks are tables[n] [MB], in caches [blocks, block_size, KV, D] (the values' last
    dimension Dv) -> [N, H, Dv]; `bias` [N, MB * block_size] (or [1, 1]) is added to its scores.
    Query head h reads KV head h // (H / KV).
    The K/V rows are gathered ([N, MB * block_size, KV, D]): memory grows with N x the table width."""
    N, H, D = q.shape
    KV, Dv = k_cache.shape[2], v_cache.shape[3]
    G = H // KV
    L = tables.shape[1] * k_cache.shape[1]
    k = mint.flatten(ops.gather(k_cache, tables, 0), 1, 2).transpose(0, 2, 3, 1)        # [N, KV, D, L]
    v = mint.flatten(ops.gather(v_cache, tables, 0), 1, 2).transpose(0, 2, 1, 3)        # [N, KV, L, Dv]
    scores = ops.bmm(q.reshape(-1, KV, G, D), k).astype(ms.float32) * scale            # [N, KV, G, L]
    if bias is not None:        # [N, L] or [1, 1]
        scores = scores + bias.astype(ms.float32).expand_dims(1).expand_dims(1)
    visible = int_range(L).reshape(1, -1) < lens.reshape(-1, 1)                          # [N, L]
    visible = ops.broadcast_to(visible.expand_dims(1).expand_dims(1), (-1, KV, G, -1))
    return _softmax_pv(scores, visible, v).reshape(-1, H, Dv)


def latent_paged_attention(q, cache, tables, lens, scale: float, values: int, bias=None):
    """Multi-head latent attention over a paged latent cache [blocks, block_size, 1, W]: each token
    n of q [N, H, W] (its heads' queries in the latent space) attends over the first lens[n]
    positions of its sequence (blocks tables[n]) as over one KV head whose keys are the whole W
    values of a position and whose values are their first `values` ones -> [N, H, values];
    `bias` [N, MB * block_size] (or [1, 1]) is added to the scores."""
    N, H, W = q.shape
    L = tables.shape[1] * cache.shape[1]
    rows = mint.flatten(mint.flatten(ops.gather(cache, tables, 0), 1, 2), 2, 3)          # [N, L, W], read once
    scores = ops.bmm(q, rows.transpose(0, 2, 1)).astype(ms.float32) * scale                # [N, H, L]
    if bias is not None:        # [N, L] or [1, 1]
        scores = scores + bias.astype(ms.float32).expand_dims(1)
    visible = int_range(L).reshape(1, -1) < lens.reshape(-1, 1)                          # [N, L]
    visible = ops.broadcast_to(visible.expand_dims(1), (-1, H, -1))
    return _softmax_pv(scores, visible, rows[:, :, :values])


def packed_attention(q, k, v, token_seq, scale: float, causal: bool = True):
    """Attention among a step's own tokens, nothing read from the cache (a prefill of sequences with
    nothing cached): q [N, H, D], k [N, KV, D] and v [N, KV, Dv], packed one sequence after another;
    token i sees token j of the same sequence (token_seq) with j <= i (causal) -> [N, H, Dv].
    Scores are [H, N, N]."""
    N, H, D = q.shape
    KV, Dv = k.shape[1], v.shape[2]
    G = H // KV
    qh = q.reshape(-1, KV, G, D).transpose(1, 2, 0, 3).reshape(KV, -1, D)
    scores = ops.bmm(qh, k.transpose(1, 2, 0)).astype(ms.float32) * scale                 # [KV, G*N, N]
    visible = token_seq.reshape(-1, 1) == token_seq.reshape(1, -1)
    if causal:
        index = int_range(N)
        visible = ops.logical_and(visible, index.reshape(1, -1) <= index.reshape(-1, 1))
    visible = mint.flatten(ops.broadcast_to(visible.expand_dims(0).expand_dims(0), (KV, G, -1, -1)), 1, 2)
    out = _softmax_pv(scores, visible, v.transpose(1, 0, 2))                              # [KV, G*N, Dv]
    return out.reshape(KV, G, -1, Dv).transpose(2, 0, 1, 3).reshape(-1, H, Dv)


class PortableAttention(nn.Cell):
    """Cache write and attention of one layer in MindSpore primitives. Caches [blocks, block_size,
    KV, D] (the layout Ascend's kernels take); the new rows go in with ScatterNdUpdate at (slot //
    block_size, slot % block_size). A prefill with nothing cached attends among its own tokens
    (`packed_attention`); every other step reads K/V through the block tables (`paged_attention`)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype):
        super().__init__()
        self.scale = head_dim ** -0.5
        self.block_size = block_size

    def construct(self, q, k, v, k_cache, v_cache, ctx, prefill: bool):
        slot_mapping, block_tables, _, _, token_seq, token_len, _ = ctx
        at = cache_index(slot_mapping, self.block_size)
        written = ops.depend(ops.scatter_nd_update(k_cache, at, k), ops.scatter_nd_update(v_cache, at, v))
        q = ops.depend(q, written)
        if prefill:
            return packed_attention(q, k, v, token_seq, self.scale)
        return paged_attention(q, k_cache, v_cache, ops.gather(block_tables, token_seq, 0), token_len, self.scale)


class PortableLatentAttention(nn.Cell):
    """The cache write and the paged attention of DeepSeek's latent attention (worker.model.
    MLAttention) in MindSpore primitives: `write` puts each token's latent [N, W] at its slot of
    the cache [blocks, block_size, 1, W]; `attend` reads the cache for the queries [N, H, W] (in the
    latent space) as `latent_paged_attention` -> [N, H, values]."""

    def __init__(self, heads: int, width: int, values: int, block_size: int, dtype, scale: float):
        super().__init__()
        self.block_size, self.values, self.scale = block_size, values, scale

    def write(self, latent, cache, slot_mapping):
        at = cache_index(slot_mapping, self.block_size)
        return ops.scatter_nd_update(cache, at, latent.reshape(latent.shape[0], 1, latent.shape[1]))

    def attend(self, q, cache, ctx):
        _, block_tables, _, _, token_seq, token_len, _ = ctx
        return latent_paged_attention(q, cache, ops.gather(block_tables, token_seq, 0), token_len, self.scale,
                                      self.values)


# MindSpore's inference mode, kernel by kernel: how vllm-mindspore and MindFormers compile on
# cards (AscendOps.jit_options) and the CPU kernels' step graphs (CpuOps.static_step_jit_options).
INFERENCE_MODE = {"jit_level": "O0", "infer_boost": "on"}


class MsOps:
    """The network's operators in portable MindSpore primitives (`model.ops: portable`): any
    device target, no kernel of ours, dynamic shapes. The base of the other devices' seams."""
    name = "portable"
    # Weights as Hugging Face stores them, MindSpore's MatMul (transpose_b) and Gather.
    linear_op = embed_op = pack_weight = None
    # linear weights computed in bfloat16, and an embedding's lookup over them (CpuOps;
    # EngineConfig.matmul_dtype)
    pack_pairs = embed_pairs_op = None
    glu_linear_op = None      # gate/up projection and silu-mul in one (CpuOps)
    # a sparse layer's experts grouped by routing, and their weights' order (CpuOps, AscendOps;
    # without: every expert on every token, sharding.layers.FusedExperts)
    moe_op = pack_experts = None
    # whether moe_op's cell quantizes its rows per token (its x_quant and h_quant) where the
    # experts' inputs are int8 (AscendOps, CpuOps); without, such experts run the portable way
    # (FusedExperts)
    moe_quant_inputs = False
    quant_rows_op = None          # a W8A8 input's per-token int8 levels in one kernel (CpuOps)
    # (scheme, the layer's input quantizer or None, compute dtype, glu: a LinearGlu layer) -> a cell
    # (x, int8 weight as its `pack(levels [out, in]) -> (data, unpack) or None` gives it, its
    # scales as its `scales(row scales) -> Tensor` gives them) -> y, or None where the device keeps
    # that scheme's weights float (AscendOps; CpuOps for W8A8 with VNNI; CausalLM.hold_int8)
    int8_linear = None
    # (the experts' scheme or None) -> whether the device's moe_op multiplies experts held as int8
    # levels with a scale per output channel, or int4 levels with a scale per group of inputs:
    # truthy (CpuOps: the layout, "vnni", "panels" or "int4"; AscendOps: True, or "int4") or not
    # (CausalLM.hold_int8_experts; for "int4", worker.model.hold_int4_experts)
    int8_experts = None

    @staticmethod
    def expert_scales(scales, glu: bool = False):
        """Int8 experts' scales per output channel [E, N] in the order of the device's packed
        columns (`pack_experts`): as they are, but for CpuOps."""
        return scales

    # the device sampler's passes over whole rows as kernels (worker.cpu.SamplerKernels; without:
    # MindSpore primitives, worker.device_sampler)
    sampler_kernels = None
    pad_id = 0          # the token id of a step's padding rows (worker/runner.py): any valid id
    dynamic_shapes = True     # one graph per step kind (worker/runner.py); False: power-of-two buckets
    paged_mask = False        # whether paged steps take an additive causal mask input (AscendOps)
    fused_attention = False   # True: the attention op takes the qkv projection whole (CpuOps)
    # (halves) -> an op that runs a dense decoder layer in one call, or the ops of its attention
    # and MLP halves (CpuOps: LayerBase.fuse); or None
    decoder_layer_op = None
    # () -> an op that runs every layer of a model whose layers each run as one call, in one
    # call (CpuOps: CausalLM.fuse); or None
    decoder_stack_op = None
    jit_options: dict = {}    # options of mindspore.jit for the step graphs
    phases: dict | None = None   # step kind -> the network's `phase` while it runs (AscendOps)
    # Static-shape step graphs in MindSpore's inference mode (CpuOps): these jit options for them
    # (the sampler's graphs and the kernel checks keep jit_options), and a `phase` for each graph.
    static_step_jit_options: dict | None = None
    # MindSpore's CPU kernel for an elementwise op between tensors of different shapes builds an
    # index table per output element when it first runs a shape (seconds, and ~19 MB a kernel at
    # 2048 x 576, kept for the graph's life). Every operand is therefore broadcast explicitly,
    # which costs one copy, and the elementwise ops all see equal shapes.

    @staticmethod
    def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple:
        return (num_blocks, block_size, kv_heads, head_dim)

    @staticmethod
    def cache_param(shape: tuple, dtype, name: str):
        """A layer's K or V cache: on the host, zero pages that cost nothing until a sequence
        reaches them (sharding.layers.new_param)."""
        return new_param(shape, dtype, name)

    @staticmethod
    def rms_norm_op(eps: float):
        """A cell (x [..., H], weight [H]) -> x normalized over H, times weight."""
        return RmsNorm(eps)

    @classmethod
    def add_rms_norm_op(cls, eps: float, norm: nn.Cell | None = None):
        """A cell (x, delta, weight) -> (x + delta, rms_norm_op's result on it): a layer's
        residual add and the norm after it. `norm`: the norm's own rms_norm_op cell, to reuse."""
        return AddThenNorm(norm if norm is not None else cls.rms_norm_op(eps))

    # CausalLM's rotary tables in one operator (CpuOps): (positions [N, P] float32, freq_matrix
    # [P, D/2] float32, factor [1] float32) -> (cos, sin) [N, D/2] float32, the angles' cosine and
    # sine times the factor. None: MatMul, Cos and Sin (and Mul by the factor).
    rope_cos_sin = None

    @staticmethod
    def rope_tables(cos, sin, heads):
        """cos/sin [N, D/2] -> the tables `rotary` takes, built once per step: [N, heads, D/2]."""
        shape = (-1, heads, -1)
        return ops.broadcast_to(cos.expand_dims(1), shape), ops.broadcast_to(sin.expand_dims(1), shape)

    @staticmethod
    def rotary(x, cos, sin):
        """x [N, heads, D]; cos/sin from `rope_tables`."""
        x1, x2 = HALVES(x)
        return ops.concat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    @staticmethod
    def silu_mul(gate_up):
        """[N, 2I] (gate | up) -> silu(gate) * up [N, I]."""
        gate, up = HALVES(gate_up)
        return ops.silu(gate) * up

    @staticmethod
    def rows(x, index):
        """x [N, H] -> rows index [M] of it; an index of -1 (a padding row) may give any row."""
        return ops.gather(x, ops.maximum(index, ops.zeros_like(index)), 0)

    @staticmethod
    def attention(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype):
        """A cell (q [N, H, D], k and v [N, KV, D] (rotated), k_cache, v_cache, ctx, prefill) -> [N, H, D]
        that writes the new K/V rows and attends; ctx is CausalLM's step context."""
        return PortableAttention(heads, kv_heads, head_dim, block_size, dtype)

    @staticmethod
    def latent_attention(heads: int, width: int, values: int, block_size: int, dtype, scale: float):
        """A cell with `write(latent [N, W], cache, slot_mapping)` and `attend(q [N, H, W], cache,
        ctx) -> [N, H, values]`: DeepSeek's latent cache and the attention that reads it."""
        return PortableLatentAttention(heads, width, values, block_size, dtype, scale)

    @staticmethod
    def moe_router(k: int):
        """A cell (router logits [N, E]) -> (the top k of their softmax [N, k] float32, largest
        first, not renormalized; their experts [N, k] int32), as transformers routes."""
        return TopKRouter(k)


class TopKRouter(nn.Cell):
    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def construct(self, logits):
        weights, ids = TOPK(SOFTMAX(logits.astype(ms.float32)), self.k)
        return weights, ids.astype(ms.int32)
