"""Ascend's fused inference kernels, wired as MindSpore 2.10 documents them, and their CPU stand-ins.

`AscendOps` is the device seam (worker/ops.py) of `parallel.device: ascend`. It calls the
primitives of `mindspore.ops.auto_generate`, with the arguments vllm-mindspore and MindFormers pass
on cards (../shared/ASCEND.md has the sources):

    ReshapeAndCache      the step's new K/V rows into caches [blocks, block_size, KV, D] at
                         slot_mapping (int32, block * block_size + offset), in place
    FlashAttentionScore  a prefill with nothing cached: layout "TH", per-sequence lengths
    PagedAttention       every other step (decode, a prefill chunk after cached tokens), with
                         q_seq_lens and an additive causal mask for chunks
    RmsNorm              every norm
    MoeGatingTopKSoftmax a sparse layer's router: softmax over the experts, then the top k
    MoeInitRoutingV2     the (token, expert) pairs sorted by expert, the tokens' rows gathered
    GroupedMatmulV4      each expert's rows times its weights [E, in, out] (gate/up, then down)
    MoeTokenUnpermute    each token's k rows back, weighted and summed
    QuantBatchMatmul     a W8A8 layer's int8 inputs times its int8 weights, scaled per output
                         (and per token): after DynamicQuantExt (per token) or QuantV2 (static)
    WeightQuantBatchMatmul  a W8A16 layer's float inputs times its int8 weights, a W4A16 layer's
                         times its int4 groups (qint4x2, two to a byte)

Rotary runs in MindSpore primitives on the card (MsOps.rotary): msinfer's position schemes give
each token its own cos/sin rows, and ApplyRotaryPosEmb's contract for per-token tables (vllm-
mindspore passes them with batch_valid_length as position_ids) is one no source here settles.

The kernels find sequence lengths by graph input name as well as by argument (ASCEND.md, "the
hidden coupling"): CausalLM's compiled steps name their inputs `batch_valid_length` and
`q_seq_lens` for that reason.

Nobody here has a card. `EmulatedAscendOps` (MSINFER_ASCEND_EMULATE=1) swaps each kernel for a
stand-in cell below with the installed primitive's constructor and call signature (names,
defaults) and the documented semantics, in portable MindSpore primitives so that it runs inside
the same dynamic-shape graphs (ops.Custom pyfunc kernels fail in dynamic-shape graphs in 2.10).
Everything else (cache layout, inputs and their names, dtypes, keyword arguments, the step kinds)
is what a card runs. The kernels themselves are never run here.
"""

from __future__ import annotations

import re

import mindspore as ms
from mindspore import Tensor, mint, nn, ops
from mindspore.ops import auto_generate
import numpy as np

from msinfer.sharding.config import MASK_PENALTY
from msinfer.sharding.layers import HALVES, ROW_MAX, SOFTMAX, SPLIT, TOPK, round_half_away
from msinfer.worker.ops import (INFERENCE_MODE, MsOps, PortableLatentAttention, cache_index, int_range,
                                latent_paged_attention, packed_attention, paged_attention, rms_norm)

KERNELS = ("ReshapeAndCache", "FlashAttentionScore", "PagedAttention", "RmsNorm")
MOE_KERNELS = ("MoeGatingTopKSoftmax", "MoeInitRoutingV2", "GroupedMatmulV4", "MoeTokenUnpermute")
QUANT_KERNELS = ("QuantBatchMatmul", "WeightQuantBatchMatmul", "DynamicQuantExt", "QuantV2")


def flash_mask(dtype) -> Tensor:
    """FlashAttentionScore's compressed causal mask as vllm-mindspore builds it (models/
    attention_mask.py): 128 x 128, upper triangle set, 1 for bfloat16 and -10000 otherwise."""
    fill = 1.0 if dtype == ms.bfloat16 else MASK_PENALTY
    return Tensor(np.triu(np.ones((128, 128), np.float32), 1) * fill, dtype)


class AscendRmsNorm(nn.Cell):
    def __init__(self, kernels, eps: float):
        super().__init__()
        self.op = kernels.RmsNorm(epsilon=eps)

    def construct(self, x, weight):
        # vllm-mindspore layers/layernorm.py: ops.RmsNorm(eps)(x, weight)[0]; output 1 is rstd
        return self.op(x, weight)[0]


class AscendAttention(nn.Cell):
    """One layer's cache write and attention with the fused kernels; q, k, v are 2-D as the
    kernels take them on cards ([T, heads * D]). `conventions` (worker.kernel_check, the start-up
    self-check's verdicts): FlashAttentionScore "ok" (per-sequence lengths), "cumulative" (their
    running sums) or "portable"; PagedAttention and ReshapeAndCache "ok" or "portable". A
    "portable" kernel is replaced, in that operation only, by the portable operators (worker/ops.py)."""

    def __init__(self, kernels, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype,
                 conventions: dict | None = None):
        super().__init__()
        conventions = conventions or {}
        self.fa = conventions.get("FlashAttentionScore", "ok")
        self.pa_portable = conventions.get("PagedAttention", "ok") == "portable"
        self.cache_portable = conventions.get("ReshapeAndCache", "ok") == "portable"
        self.heads, self.kv_heads, self.head_dim, self.block_size = heads, kv_heads, head_dim, block_size
        scale = head_dim ** -0.5
        self.scale = scale
        # mindspore/ops/auto_generate/gen_ops_prim.py ReshapeAndCache.__init__(self): no arguments
        self.reshape_and_cache = kernels.ReshapeAndCache()
        # gen_ops_prim.py FlashAttentionScore.__init__(head_num, keep_prob, scale_value, pre_tokens,
        # next_tokens, inner_precise, input_layout, sparse_mode); the values of vllm-mindspore
        # v1/attention/layer.py (sparse_mode 0, no band: the mask makes it causal)
        self.flash_attention = kernels.FlashAttentionScore(head_num=heads, scale_value=scale,
                                                           pre_tokens=2147483647, next_tokens=2147483647,
                                                           input_layout="TH")
        # gen_ops_prim.py PagedAttention.__init__(head_num, scale_value, kv_head_num, ...), as
        # vllm-mindspore v1/attention/layer.py constructs it
        self.paged_attention = kernels.PagedAttention(head_num=heads, scale_value=scale, kv_head_num=kv_heads)
        self.flash_mask = flash_mask(dtype)

    def construct(self, q, k, v, k_cache, v_cache, ctx, prefill: bool):
        slot_mapping, block_tables, batch_valid_length, q_seq_lens, token_seq, token_len, attn_mask = ctx
        q, k, v = mint.flatten(q, 1), mint.flatten(k, 1), mint.flatten(v, 1)
        if self.cache_portable:
            at = cache_index(slot_mapping, self.block_size)
            written = ops.depend(ops.scatter_nd_update(k_cache, at, k.reshape(-1, self.kv_heads, self.head_dim)),
                                 ops.scatter_nd_update(v_cache, at, v.reshape(-1, self.kv_heads, self.head_dim)))
        else:
            # ReshapeAndCache.__call__(key, value, key_cache, value_cache, slot_mapping): writes the
            # caches (Parameters, passed as they are) in place; the query waits for it (vllm-mindspore
            # layer.py: ops.depend(query, cache_out))
            written = self.reshape_and_cache(k, value=v, key_cache=k_cache, value_cache=v_cache,
                                             slot_mapping=slot_mapping)
        q = ops.depend(q, written)
        if prefill and self.fa == "portable":
            return mint.flatten(packed_attention(q.reshape(-1, self.heads, self.head_dim),
                                                 k.reshape(-1, self.kv_heads, self.head_dim),
                                                 v.reshape(-1, self.kv_heads, self.head_dim), token_seq, self.scale), 1)
        if prefill:
            # FlashAttentionScore.__call__(query, key, value, real_shift, drop_mask, padding_mask,
            # attn_mask, prefix, actual_seq_qlen, actual_seq_kvlen) -> (max, sum, out, attention):
            # per-sequence lengths, as vllm-mindspore and MindFormers' inference path pass them; the
            # docstring's TND layout wants cumulative ones (ASCEND.md), which the start-up
            # self-check picks where the card's kernel reads them so (worker.kernel_check)
            lengths = ops.cumsum(batch_valid_length, 0) if self.fa == "cumulative" else batch_valid_length
            return self.flash_attention(q, k, v, attn_mask=self.flash_mask, actual_seq_qlen=lengths,
                                        actual_seq_kvlen=lengths)[3]
        if self.pa_portable:
            return mint.flatten(paged_attention(q.reshape(-1, self.heads, self.head_dim), k_cache, v_cache,
                                                ops.gather(block_tables, token_seq, 0), token_len, self.scale), 1)
        # PagedAttention.__call__(query, key_cache, value_cache, block_tables, context_lens,
        # antiquant_scale, antiquant_offset, attn_mask, q_seq_lens, alibi_mask): context_lens is
        # each sequence's whole length, q_seq_lens its tokens in this step; the mask is [1, 1]
        # zeros for a decode and [T, context] (0 / -10000 past each token's position) for chunks
        return self.paged_attention(q, key_cache=k_cache, value_cache=v_cache, block_tables=block_tables,
                                    context_lens=batch_valid_length, attn_mask=attn_mask, q_seq_lens=q_seq_lens)


class AscendLatentAttention(nn.Cell):
    """DeepSeek's latent cache write and paged attention (worker.ops.PortableLatentAttention's
    interface) with the fused kernels, called as vllm-mindspore's DeepSeek-V3 calls them
    (models/deepseekv3.py): ReshapeAndCache with the latent [T, W] as the key and no value into one
    cache [blocks, block_size, 1, W]; PagedAttention(head_num=H, kv_head_num=1, mla_v_dim=values)
    with that cache as key and value cache, the queries [T, H * W] in the latent space, its output
    [T, H * values] (the first `values` of each position are its value). MindSpore 2.10 documents
    neither the single cache nor mla_v_dim: the start-up self-check settles both on the card
    (worker.kernel_check), and a "portable" verdict replaces the kernel by the portable operators."""

    def __init__(self, kernels, heads: int, width: int, values: int, block_size: int, dtype, scale: float,
                 conventions: dict | None = None):
        super().__init__()
        conventions = conventions or {}
        self.portable = PortableLatentAttention(heads, width, values, block_size, dtype, scale)
        self.pa_portable = conventions.get("PagedAttention", "ok") == "portable"
        self.cache_portable = conventions.get("ReshapeAndCache", "ok") == "portable"
        self.heads, self.width, self.values = heads, width, values
        self.reshape_and_cache = kernels.ReshapeAndCache()
        # gen_ops_prim.py PagedAttention.__init__(head_num, scale_value, kv_head_num, kv_cache_quant_mode,
        # mask_mode, mla_v_dim), as vllm-mindspore's DeepseekV3 attention constructs it
        self.paged_attention = kernels.PagedAttention(head_num=heads, scale_value=scale, kv_head_num=1,
                                                      mla_v_dim=values)

    def write(self, latent, cache, slot_mapping):
        if self.cache_portable:
            return self.portable.write(latent, cache, slot_mapping)
        return self.reshape_and_cache(latent, None, cache, None, slot_mapping)

    def attend(self, q, cache, ctx):
        if self.pa_portable:
            return self.portable.attend(q, cache, ctx)
        _, block_tables, batch_valid_length, q_seq_lens, _, _, attn_mask = ctx
        out = self.paged_attention(mint.flatten(q, 1), key_cache=cache, value_cache=cache,
                                   block_tables=block_tables, context_lens=batch_valid_length, attn_mask=attn_mask,
                                   q_seq_lens=q_seq_lens)
        return out.reshape(-1, self.heads, self.values)


class AscendRouter(nn.Cell):
    """MoeGatingTopKSoftmax(x, finished=None, k) -> (y, expert_idx, row_idx): the softmax over all
    experts, then its top k, largest first and not renormalized (vllm-mindspore fused_moe.py
    fused_topk, L103-104; docs/ascend.md has the sources)."""

    def __init__(self, kernels, k: int):
        super().__init__()
        self.gating, self.k = kernels.MoeGatingTopKSoftmax(), k

    def construct(self, logits):
        weights, ids, _ = self.gating(logits, None, self.k)
        return weights.astype(ms.float32), ids


class AscendExperts(nn.Cell):
    """(x [N, H], ids [N, k] int32, weights [N, k], w13 [E, H, 2I], w2 [E, I, H] (AscendOps.pack_experts:
    [in, out], as vllm-mindspore's fused_moe/layer.py L91-102 stores them), meta [first expert held,
    -]) -> [N, H], the sequence of vllm-mindspore's FusedExperts (fused_moe.py L217-354):
    MoeInitRoutingV2 sorts the (token, expert) pairs by expert, dropless, and counts each expert's
    rows (flag 2); GroupedMatmulV4 (split_item 3, group_type 0, group_list_type 1: counts, int64)
    runs each expert's rows through gate|up, then silu(gate) * up, then down; MoeTokenUnpermute
    weights each token's k rows and sums them. Pairs whose expert another rank holds (expert
    parallel) sort after every held expert's rows, as expert E, and the grouped matmuls leave
    those rows out (group_list counts E experts): their rows are zeroed (nan_to_num, as
    vllm-mindspore's TP_MIX_EP path, L327-328 and L359-398) and weighted 0.

    Experts held as int8 levels (w13, w2 int8 in the same layout; w13_scale [E, 2I], w2_scale
    [E, H] in the compute dtype: a weight-only checkpoint's scale per output channel) run
    GroupedMatmulV4's antiquant form: antiquant_scale [[E, N]] and a zero antiquant_offset, as
    golden-stick's WeightQuantMatmul calls it on experts (ptq/hal.py; CANN's aclnnGroupedMatmulV4:
    y = x (w + offset) scale, x float16 or bfloat16, weight INT8, scale and offset in x's dtype).
    Experts with int8 inputs per token (W8A8: int8_inputs) run its per-token form on the rows'
    int8 levels: y = (x w) * scale * per_token_scale (MindSpore's grouped_matmul_v4 doc), with
    the rows quantized after the routing sorts them, once for each projection, as golden-stick's
    MoE wrappers and vllm-ascend's w8a8_dynamic.py do (a sorted row is a token's row, so its
    levels are the token's). Experts held as int4 levels (w13 [E, H, I], w2 [E, I, H / 2], two
    levels a byte: AscendOps.pack_experts; qint4x2 on a card) run the antiquant form's groups:
    antiquant_scale [[E, in / g, out]] in x's dtype (aclnnGroupedMatmulV4's 伪量化 pergroup case,
    weight INT4, one tensor for all groups: [g, G, n])."""

    def __init__(self, kernels):
        super().__init__()
        self.init_routing = kernels.MoeInitRoutingV2()
        self.grouped_matmul = kernels.GroupedMatmulV4()
        self.unpermute = kernels.MoeTokenUnpermute()
        # Experts whose inputs the checkpoint quantizes per token (FusedExperts sets them): the
        # quantizers of the sorted rows before gate|up and of silu(gate) * up before down
        # (sharding.layers.PerTokenInt8). With the experts' weights float, each row to its levels
        # and back; with them int8 (int8_inputs), the levels and each row's scale go to the
        # grouped matmul's per-token form.
        self.x_quant = self.h_quant = None
        self.int8_inputs = False
        self.dynamic_quant = kernels.DynamicQuantExt()

    def construct(self, x, ids, weights, w13, w2, meta, w13_scale=None, w2_scale=None):
        E = w13.shape[0]
        local = ids - meta[0]
        held = ops.logical_and(local >= 0, local < E)
        local = ops.select(held, local, E)
        weights = ops.select(held, weights, ops.zeros_like(weights))
        rows, unsort, counts, _ = self.init_routing(x, local, active_num=0, expert_capacity=0, expert_num=E + 1,
                                                    drop_pad_mode=0, expert_tokens_count_or_cumsum_flag=2,
                                                    expert_tokens_before_capacity_flag=True)
        group_list = SPLIT(counts, (E, 1), 0)[0].astype(ms.int64)
        gate, up = HALVES(self.project(rows, self.x_quant, w13, group_list, w13_scale))
        h = ops.silu(gate) * up
        y = ops.nan_to_num(self.project(h, self.h_quant, w2, group_list, w2_scale), 0.0, 0.0, 0.0)
        return self.unpermute(permuted_tokens=y, sorted_indices=unsort, probs=weights, padded_mode=False,
                              restore_shape=None)

    def project(self, x, quantizer, w, group_list, scale):
        """The grouped rows x through one projection, their inputs quantized where `quantizer` is
        set: to int8 levels and a scale per row for the per-token form (int8_inputs; DynamicQuantExt
        where its arithmetic is the checkpoint's, max|x| / 127 and halves away from zero, and the
        row is whole on this rank, else the quantizer's primitives), or to the levels and back."""
        if quantizer is None:
            return self.matmul(x, w, group_list, scale)
        if not self.int8_inputs:
            return self.matmul(quantizer(x), w, group_list, scale)
        if quantizer.divisor == 127.0 and quantizer.half_away and quantizer.gather is None:
            levels, per_token = self.dynamic_quant(x, None)
        else:
            levels, per_token = quantizer.levels(x)
            levels = levels.astype(ms.int8)
        return self.matmul(levels, w, group_list, scale, per_token.reshape(-1).astype(ms.float32)).astype(x.dtype)

    def matmul(self, x, w, group_list, scale=None, per_token=None):
        """Each group's rows of x times its expert's w: float; int8 levels with `scale` [E, N], or
        int4 pairs with `scale` [E, groups, N] (the antiquant form, x float); or int8 x and w with
        `scale` and each row's `per_token` scale [M] float32 (the per-token form: scale bfloat16
        for a bfloat16 output, float32 for float16, as golden-stick's DynamicQuantMatmul passes
        it, ptq/hal.py)."""
        if per_token is not None:
            return self.grouped_matmul([x], [w], None, [scale], None, None, None, [per_token], group_list,
                                       split_item=3, group_type=0, group_list_type=1)[0]
        if scale is None:
            return self.grouped_matmul([x], [w], None, None, None, None, None, None, group_list, split_item=3,
                                       group_type=0, group_list_type=1)[0]
        return self.grouped_matmul([x], [w], None, None, None, [scale], [ops.zeros_like(scale)], None, group_list,
                                   split_item=3, group_type=0, group_list_type=1)[0]


def float_bits(scales: np.ndarray) -> np.ndarray:
    """Scales as int64 holding their float32 bits: what QuantBatchMatmul takes for float16 outputs
    (golden-stick numpy_quant_common.py trans_fp32_to_i64; vllm-mindspore a8w8.py on 310P)."""
    return np.ascontiguousarray(scales, np.float32).view(np.uint32).astype(np.int64)


class AscendInt8Linear(nn.Cell):
    """(x [M, in], w [out, in] int8, scales [out]) -> x W^T [M, out] in the compute dtype, for a
    layer held as its int8 levels with a scale per output (CausalLM.hold_int8), by `kind`
    (sharding.quant.Scheme.int8_kind):

        weight   WeightQuantBatchMatmul(transpose_x=False, transpose_weight=True, antiquant_group_size=0)
                 (x, w, antiquant_scale [out] in the compute dtype, antiquant_offset zeros): golden-stick
                 (ptq/hal.py, the one source that calls it) passes -zero point as the offset, zeros
                 for symmetric weights
        dynamic  each token's int8 levels and scale, then QuantBatchMatmul(False, True, dtype)(levels,
                 w, scale [out] float32, None, None, pertokenScaleOptional [M] float32), as MindFormers'
                 a8dynw8.py calls it but for the scale's dtype: MindFormers passes bfloat16 for a
                 bfloat16 model; float32 keeps the checkpoint's scale, and CANN lists it for A2/A3
                 cards (hicann/ops-nn matmul/quant_batch_matmul_v3/README.md: scale UINT64, FLOAT32,
                 INT64 or BF16; pertoken FLOAT32). The levels come from DynamicQuantExt(x, None) where its arithmetic
                 is the checkpoint's (max|x| / 127, halves away from zero: ModelSlim W8A8_DYNAMIC) and the
                 row is whole on this rank; else from the layer's quantizer in primitives
                 (sharding.layers.PerTokenInt8: compressed-tensors' max|x| / 127.5 and halves to even;
                 a row split over ranks takes their maximum)
        static   QuantV2(x, 1 / input_scale, input_offset, False, "ROUND", int8), both [in] in the
                 compute dtype (MindFormers a8w8.py reads ModelSlim's so: the reciprocal, offset
                 float), then QuantBatchMatmul(False, True, dtype)(levels, w, deq_scale [out], None,
                 None); the layer adds quant_bias * deq_scale after it (the same sum as the kernel's
                 int32 bias before the scale). deq_scale is float32 for bfloat16 outputs and int64
                 holding its float32 bits for float16 ones (golden-stick hal.py)

    convention "float32" (the start-up self-check's second reading, worker.kernel_check): every
    QuantBatchMatmul scale float32. The weights stay [out, in] as the checkpoint has them
    (transpose_x2 / transpose_weight), as all three projects keep them."""

    def __init__(self, kernels, kind: str, quantizer, dtype, convention: str = "ok"):
        super().__init__()
        self.kind, self.dtype, self.convention = kind, dtype, convention
        self.quantizer = quantizer
        if kind == "weight":
            self.matmul = kernels.WeightQuantBatchMatmul(transpose_x=False, transpose_weight=True,
                                                         antiquant_group_size=0)
            return
        self.matmul = kernels.QuantBatchMatmul(transpose_x1=False, transpose_x2=True, dtype=dtype)
        self.dynamic_quant = self.quant = None
        if kind == "static":
            self.quant = kernels.QuantV2()
        elif quantizer.divisor == 127.0 and quantizer.half_away and quantizer.gather is None:
            self.dynamic_quant = kernels.DynamicQuantExt()

    @staticmethod
    def pack(levels: np.ndarray):
        """The weight as the kernels take it: the levels [out, in] themselves; and the unpack."""
        return levels, lambda t: t

    def scales(self, scales: np.ndarray) -> Tensor:
        """Each output's scale as this kind's kernel takes it."""
        if self.kind == "weight":
            return Tensor(np.asarray(scales, np.float32), self.dtype)
        if self.kind == "static" and self.dtype == ms.float16 and self.convention == "ok":
            return Tensor(float_bits(scales))
        return Tensor(np.asarray(scales, np.float32), ms.float32)

    def construct(self, x, w, scale):
        if self.kind == "weight":
            return self.matmul(x, w, scale, ops.zeros_like(scale), None, None, None)
        if self.kind == "static":
            k = (x.shape[-1],)
            levels = self.quant(x, ops.broadcast_to((1.0 / self.quantizer.scale).astype(x.dtype), k),
                                ops.broadcast_to(self.quantizer.offset.astype(x.dtype), k), False, "ROUND", ms.int8)
            return self.matmul(levels, w, scale, None, None, None)
        if self.dynamic_quant is not None:
            levels, per_token = self.dynamic_quant(x, None)
        else:
            levels, per_token = self.quantizer.levels(x)
            levels = levels.astype(ms.int8)
        return self.matmul(levels, w, scale, None, None, per_token.reshape(-1).astype(ms.float32))


def pack_int4(levels: np.ndarray, high_first: bool = False) -> np.ndarray:
    """int4 levels [out, in] (int8 holding -8..7) -> [in, out / 2] int8, two levels a byte along
    out: column 2j in the low nibble, 2j + 1 in the high one (golden-stick's and MindSpore's own
    tests' np_int4data_pack_to_int8, on the transposed weight); high_first: the other way round."""
    t = np.ascontiguousarray(levels.T).astype(np.int16)
    lo, hi = (t[:, 1::2], t[:, 0::2]) if high_first else (t[:, 0::2], t[:, 1::2])
    return ((lo & 0xF) | ((hi & 0xF) << 4)).astype(np.uint8).view(np.int8)


def unpack_int4(packed: np.ndarray, high_first: bool = False) -> np.ndarray:
    """pack_int4 undone: [in, out / 2] -> int8 levels [out, in]."""
    u = np.asarray(packed).view(np.uint8).astype(np.int16)
    lo, hi = ((u & 0xF) ^ 8) - 8, ((u >> 4) ^ 8) - 8
    first, second = (hi, lo) if high_first else (lo, hi)
    t = np.empty((u.shape[0], 2 * u.shape[1]), np.int8)
    t[:, 0::2], t[:, 1::2] = first, second
    return np.ascontiguousarray(t.T)


class AscendInt4Linear(nn.Cell):
    """(x [M, in], w [in, out / 2] int4 pairs, scales [in / g, out]) -> x W^T [M, out] in the
    compute dtype, for a W4A16 layer held as its int4 levels with a scale per group of g inputs
    (CausalLM.hold_int8):

        WeightQuantBatchMatmul(transpose_x=False, transpose_weight=False, antiquant_group_size=g)
        (x, w, antiquant_scale [in / g, out] in the compute dtype, antiquant_offset zeros)

    The weight is handed over as MindSpore's own test of the kernel's int4 groups
    (test_ms_int4_weight_quant_pergroup_1p_GE) and golden-stick's W4A16 deployment
    (AxW4ParamProcessor) hand it: the checkpoint's [out, in] transposed to [in, out], packed two
    to a byte along out (`pack_int4`), a qint4x2 tensor [in, out / 2]; the scales [in / g, out]
    (aclnnWeightQuantBatchMatmulV2's per-group antiquantScale, (ceil(K / g), N)).
    convention "high-first" (the start-up self-check's second reading, worker.kernel_check):
    column 2j in the high nibble. weight_dtype: qint4x2 on a card; the emulated path holds the same
    bytes as int8 (MindSpore's CPU operators take no qint4x2 tensor) and its stand-in unpacks them."""

    def __init__(self, kernels, group: int, dtype, weight_dtype, convention: str = "ok"):
        super().__init__()
        self.matmul = kernels.WeightQuantBatchMatmul(transpose_x=False, transpose_weight=False,
                                                     antiquant_group_size=group)
        self.dtype, self.weight_dtype, self.high_first = dtype, weight_dtype, convention == "high-first"

    def pack(self, levels: np.ndarray):
        """The weight as the kernel takes it (None for an odd number of outputs), and the unpack."""
        if levels.shape[0] % 2:
            return None
        return pack_int4(levels, self.high_first), lambda t: unpack_int4(t, self.high_first)

    def scales(self, group_scales: np.ndarray) -> Tensor:
        """The group scales [out, in / g] as the kernel takes them: [in / g, out], compute dtype."""
        return Tensor(np.ascontiguousarray(np.asarray(group_scales, np.float32).T), self.dtype)

    def construct(self, x, w, scale):
        return self.matmul(x, w, scale, ops.zeros_like(scale), None, None, None)


class AscendOps(MsOps):
    """The fused Ascend kernels (module docstring); MsOps for the rest."""
    name = "ascend"
    paged_mask = True
    # Kernel-by-kernel execution in inference mode, as vllm-mindspore (utils.py: jit_config
    # {"jit_level": "O0", "infer_boost": "on"}) and MindFormers (models/utils.py) compile on cards:
    # the mode in which the internal kernels read lengths by graph input name. infer_boost is
    # deprecated in 2.10 but accepted, also by the CPU backend, so emulation compiles the same way.
    jit_options = INFERENCE_MODE
    # In that mode MindSpore keeps one compiled graph per value of the network cell's `phase`
    # (graph/api.py, _JitExecutor._predict): without a phase per step kind, a decode would run the
    # prefill graph. vllm-mindspore sets model.phase to "prefill" / "increment" before each call.
    phases = {"prefill": "prefill", "decode": "increment", "score": "score", "score_top": "score_top",
              "pool": "pool"}
    kernels = auto_generate          # where the kernels come from (EmulatedAscendOps: StandIns)
    # the start-up self-check's verdict per kernel (worker.kernel_check; `with_conventions`)
    conventions: dict = {}

    @classmethod
    def with_conventions(cls, conventions: dict) -> type:
        """This seam with the self-check's verdicts: a kernel marked "portable" is replaced by the
        portable operators, FlashAttentionScore's lengths follow the convention found."""
        return type(cls.__name__, (cls,), {"conventions": dict(conventions)})

    @classmethod
    def rms_norm_op(cls, eps):
        if cls.conventions.get("RmsNorm") == "portable":
            return MsOps.rms_norm_op(eps)
        return AscendRmsNorm(cls.kernels, eps)

    @classmethod
    def attention(cls, heads, kv_heads, head_dim, block_size, dtype):
        return AscendAttention(cls.kernels, heads, kv_heads, head_dim, block_size, dtype, cls.conventions)

    @classmethod
    def latent_attention(cls, heads, width, values, block_size, dtype, scale):
        return AscendLatentAttention(cls.kernels, heads, width, values, block_size, dtype, scale, cls.conventions)

    @classmethod
    def moe_router(cls, k):
        return AscendRouter(cls.kernels, k)

    moe_quant_inputs = True

    @classmethod
    def moe_op(cls):
        return AscendExperts(cls.kernels)

    # the dtype a W4A16 layer's packed weight is held in: qint4x2, as the kernel takes it
    # (EmulatedAscendOps: int8, the same bytes)
    int4_dtype = ms.qint4x2

    @classmethod
    def int8_linear(cls, scheme, quantizer, dtype, glu: bool = False):
        """AscendInt8Linear for a layer of `scheme` (AscendInt4Linear for int4 groups), or None
        where its weights stay dequantized: other weights per group, and a kernel the self-check
        found wanting."""
        kind = "int4" if scheme.int4_groups else scheme.int8_kind
        kernel = "QuantBatchMatmul" if kind in ("dynamic", "static") else "WeightQuantBatchMatmul"
        convention = cls.conventions.get(kernel, "ok")
        if kind is None or convention == "portable" or glu:
            return None
        if kind == "int4":
            return AscendInt4Linear(cls.kernels, scheme.group_size, dtype, cls.int4_dtype, convention)
        return AscendInt8Linear(cls.kernels, kind, quantizer, dtype, convention)

    @classmethod
    def int8_experts(cls, scheme) -> bool | str:
        """Whether experts of `scheme` keep their quantized levels, unless the self-check found
        GroupedMatmulV4 wanting: True for int8 weights with a scale per channel, with float inputs
        (W8A16: AscendExperts' antiquant form) or int8 inputs per token (W8A8: its per-token form);
        "int4" for int4 weights with a scale per group of inputs (W4A16: the antiquant form's
        groups, two levels a byte; CausalLM.hold_int8_experts); False for the others."""
        if scheme is None or cls.conventions.get("GroupedMatmulV4") == "portable":
            return False
        return "int4" if scheme.int4_groups else scheme.int8_kind in ("weight", "dynamic")

    @staticmethod
    def int4_scale_dtype(dtype):
        """The dtype of int4 experts' group scales: GroupedMatmulV4's antiquant scale is x's."""
        return dtype

    @staticmethod
    def cache_param(shape: tuple, dtype, name: str):
        """A layer's K or V cache made on the device (mint.zeros, as vllm-mindspore's and MindFormers'
        caches are), not filled on the host and copied: a big plan's caches are tens of GiB a rank."""
        from mindspore import Parameter, mint
        return Parameter(mint.zeros(shape, dtype=dtype), name=name, requires_grad=False)

    @classmethod
    def pack_experts(cls, w: np.ndarray, glu: bool = False, scales: np.ndarray | None = None):
        """Stacked expert weights [E, out, in] (Hugging Face's [out, in] per expert) -> [E, in, out],
        the layout GroupedMatmulV4 multiplies without a transpose; and the unpack. Int4 levels with
        their group scales [E, out, in / g] -> [E, in, out / 2], each expert packed two levels a
        byte along out as a W4A16 layer is (`pack_int4`; the self-check's "high-first" reading
        swaps the nibbles), or None for an odd number of outputs; the unpack gives the levels."""
        if scales is not None and np.ndim(scales) == 3:
            if w.shape[1] % 2:
                return None
            high = cls.conventions.get("GroupedMatmulV4") == "high-first"
            return (np.stack([pack_int4(q, high) for q in w]),
                    lambda t: np.stack([unpack_int4(e, high) for e in np.asarray(t)]))
        return np.ascontiguousarray(w.swapaxes(1, 2)), lambda t: np.ascontiguousarray(t.swapaxes(1, 2))

    @staticmethod
    def expert_scales(scales, glu: bool = False):
        """Int8 experts' scales per output channel [E, N] as they are; int4 experts' group scales
        [E, N, groups] as GroupedMatmulV4's per-group antiquant scale takes them, [E, groups, N]."""
        scales = np.asarray(scales, np.float32)
        return np.ascontiguousarray(scales.swapaxes(1, 2)) if scales.ndim == 3 else scales


# ---- stand-ins: the documented semantics in portable primitives, for emulation on the CPU -------

def _token_sequences(seq_lens, num_tokens_like):
    """seq_lens [B] (tokens of each sequence, packed in order) -> each token's sequence [T] and
    its index within that sequence [T], for T = num_tokens_like.shape[0]."""
    ends = ops.cumsum(seq_lens, 0)
    token = int_range(num_tokens_like.shape[0])
    seq = (ends.reshape(1, -1) <= token.reshape(-1, 1)).astype(ms.int32).sum(1)          # [T, B] summed
    return seq, token - ops.gather(ends - seq_lens, seq, 0)


class ReshapeAndCache(nn.Cell):
    """Stand-in: key/value [T, KV * D] or [T, KV, D] into caches [blocks, block_size, KV, D] at
    slot_mapping, in place (ScatterNdUpdate on the cache Parameters); the key alone where value
    and value_cache are None (a latent cache). Returns the key cache."""

    def __init__(self):
        super().__init__()

    def construct(self, key, value=None, key_cache=None, value_cache=None, slot_mapping=None):
        bs, KV, D = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
        at = cache_index(slot_mapping, bs)
        k = ops.scatter_nd_update(key_cache, at, key.reshape(-1, KV, D))
        if value is None:
            return k
        return ops.depend(k, ops.scatter_nd_update(value_cache, at, value.reshape(-1, KV, D)))


VARIANTS_IN_FORCE: tuple[str, ...] = ()      # the stand-ins' other readings (EngineConfig.emulate_variants)


def set_variants(variants: tuple[str, ...]) -> None:
    """The stand-ins made from now on follow these readings (sharding.config.emulate_variants)."""
    global VARIANTS_IN_FORCE
    VARIANTS_IN_FORCE = tuple(variants)


class FlashAttentionScore(nn.Cell):
    """Stand-in for layout "TH": query [T, H * D], key and value [T, KV * D] packed one sequence
    after another, actual_seq_qlen = actual_seq_kvlen = per-sequence lengths (the convention of
    the projects that run on cards; cumulative ends with the fa_cumulative variant); attention
    within each sequence, causal when a mask is given (the compressed 128 x 128 causal mask).
    Returns the four outputs; only the last is computed."""

    def __init__(self, head_num, keep_prob=1.0, scale_value=1.0, pre_tokens=2147483647, next_tokens=2147483647,
                 inner_precise=0, input_layout="BSH", sparse_mode=0):
        super().__init__()
        if input_layout != "TH" or keep_prob != 1.0 or sparse_mode != 0:
            raise NotImplementedError(f"the FlashAttentionScore stand-in emulates input_layout TH, sparse_mode 0 and "
                                      f"keep_prob 1 only, got {input_layout}, {sparse_mode}, {keep_prob}")
        self.head_num, self.scale = head_num, scale_value
        self.cumulative = "fa_cumulative" in VARIANTS_IN_FORCE

    def construct(self, query, key, value, real_shift=None, drop_mask=None, padding_mask=None, attn_mask=None,
                  prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
        D = query.shape[1] // self.head_num
        lengths = actual_seq_qlen
        if self.cumulative:         # ends -> lengths
            lengths = lengths - ops.concat((ops.zeros((1,), lengths.dtype), lengths[:-1]))
        seq, _ = _token_sequences(lengths, query)
        kv = key.shape[1] // D
        out = mint.flatten(packed_attention(query.reshape(-1, self.head_num, D), key.reshape(-1, kv, D),
                                            value.reshape(-1, kv, value.shape[1] // kv), seq, self.scale,
                                            causal=attn_mask is not None), 1)
        return out, out, out, out


class PagedAttention(nn.Cell):
    """Stand-in: query [T, H * D] of B sequences packed in order (q_seq_lens [B] tokens each; one
    each when None), each reading the first context_lens[b] positions of its caches through
    block_tables[b]; attn_mask (broadcast to [T, block_tables width * block_size]) is added to
    the scores. With the pa_wrong variant the mask is not applied: every token reads its
    sequence's whole context, as its last position does. mla_v_dim > 0 (latent attention, as
    vllm-mindspore's DeepSeek path and MindSpore's shape inference read it): the values are the
    first mla_v_dim of each cached key, and the output [T, H * mla_v_dim]."""

    def __init__(self, head_num, scale_value, kv_head_num, kv_cache_quant_mode="DEFAULT", mask_mode="MASK_DEFAULT",
                 mla_v_dim=0):
        super().__init__()
        if kv_cache_quant_mode != "DEFAULT" or mask_mode != "MASK_DEFAULT":
            raise NotImplementedError("the PagedAttention stand-in emulates the default modes only")
        self.head_num, self.scale, self.values = head_num, scale_value, mla_v_dim
        self.wrong = "pa_wrong" in VARIANTS_IN_FORCE

    def construct(self, query, key_cache, value_cache=None, block_tables=None, context_lens=None,
                  antiquant_scale=None, antiquant_offset=None, attn_mask=None, q_seq_lens=None, alibi_mask=None):
        T = query.shape[0]
        D = key_cache.shape[3]
        if q_seq_lens is None:
            seq = int_range(T)
        else:
            seq, _ = _token_sequences(q_seq_lens, query)
        tables, lens, bias = ops.gather(block_tables, seq, 0), ops.gather(context_lens, seq, 0), attn_mask
        if self.values:
            out = latent_paged_attention(query.reshape(-1, self.head_num, D), key_cache, tables, lens, self.scale,
                                         self.values, None if self.wrong else bias)
            return mint.flatten(out, 1)
        out = paged_attention(query.reshape(-1, self.head_num, D), key_cache, value_cache, tables, lens, self.scale,
                              None if self.wrong else bias)
        return mint.flatten(out, 1)


class RmsNorm(nn.Cell):
    """Stand-in: (x, gamma) -> (x * rsqrt(mean(x^2) + epsilon) * gamma, rstd), in float32 inside."""

    def __init__(self, epsilon=1e-6):
        super().__init__()
        self.epsilon = epsilon

    def construct(self, x, gamma):
        return rms_norm(x, gamma, self.epsilon)


class MoeGatingTopKSoftmax(nn.Cell):
    """Stand-in: (x [N, E], finished=None, k) -> (the top k of softmax(x) in float32, in x's dtype,
    largest first, not renormalized; their experts int32; row_idx[n, j] = j * N + n)."""

    def __init__(self):
        super().__init__()

    def construct(self, x, finished=None, k=1):
        if finished is not None:
            raise NotImplementedError("the MoeGatingTopKSoftmax stand-in emulates finished=None only")
        y, ids = TOPK(SOFTMAX(x.astype(ms.float32)), k)
        row_idx = int_range(x.shape[0] * k).reshape(k, -1).transpose(1, 0)
        return y.astype(x.dtype), ids.astype(ms.int32), row_idx


class MoeInitRoutingV2(nn.Cell):
    """Stand-in, dropless (drop_pad_mode 0, active_num 0): the pairs (n, j) of expert_idx [N, K]
    sorted by expert, stably (pair n * K + j); expanded_x [N K, H] = x[n] of each sorted pair;
    expanded_row_idx [N K] = where each pair went (pair -> row); then each expert's row count
    (flag 2) or their running sums (flag 1), [expert_num] int32; a fourth output of zeros."""

    def __init__(self):
        super().__init__()

    def construct(self, x, expert_idx, active_num, expert_capacity, expert_num, drop_pad_mode,
                  expert_tokens_count_or_cumsum_flag, expert_tokens_before_capacity_flag):
        if drop_pad_mode != 0 or active_num != 0 or expert_tokens_count_or_cumsum_flag not in (1, 2):
            raise NotImplementedError("the MoeInitRoutingV2 stand-in emulates dropless routing with counts only")
        k = expert_idx.shape[1]
        flat = expert_idx.reshape(-1)
        m = flat.shape[0]
        pair = int_range(m)
        _, order = ops.sort((flat * m + pair).astype(ms.float32))        # stable: ties by pair
        order = order.astype(ms.int32)
        _, row_of_pair = ops.sort(order.astype(ms.float32))
        experts = int_range(expert_num)
        counts = ops.equal(flat.reshape(-1, 1), experts.reshape(1, -1)).astype(ms.int32).sum(0)      # [m, E] summed
        if expert_tokens_count_or_cumsum_flag == 1:
            counts = ops.cumsum(counts, 0)
        return (ops.gather(x, order // k, 0), row_of_pair.astype(ms.int32), counts.astype(ms.int32),
                ops.zeros((expert_num,), ms.int32))


class GroupedMatmulV4(nn.Cell):
    """Stand-in for split_item 3, group_type 0: x [[M, in]] with its rows grouped in order,
    weight [[E, in, out]]; group_list [E] int64 holds each group's rows (group_list_type 1) or
    their running sums (0). Row r of group e gives x[r] @ weight[e]; rows past the groups give
    zeros here (the kernel leaves them unwritten). Returns [[M, out]]. The antiquant form
    (aclnnGroupedMatmulV4's "伪量化" case): weight int8, antiquant_scale and antiquant_offset
    [[E, out]] in x's dtype, x float16 or bfloat16: x @ ((weight + offset) * scale), in x's dtype;
    or per group (its pergroup case): weight int4 levels packed two to a byte [[E, in, out / 2]]
    (a qint4x2 tensor on a card; the same bytes as int8 here, read as int4 where the weight has
    half the scale's columns), column 2j in the low nibble (as WeightQuantBatchMatmul's; the
    gmm_int4_high_first variant: the high one), antiquant_scale and antiquant_offset
    [[E, in / g, out]], row i for inputs i*g .. i*g + g - 1."""

    def __init__(self):
        super().__init__()
        self.high_first = "gmm_int4_high_first" in VARIANTS_IN_FORCE

    def construct(self, x, weight, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                  pre_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                  activation_quant_offset=None, split_item=0, group_type=-1, group_list_type=0, act_type=0,
                  output_dtype=None):
        if split_item != 3 or group_type != 0 or bias is not None or act_type != 0:
            raise NotImplementedError("the GroupedMatmulV4 stand-in emulates split_item 3, group_type 0, no bias "
                                      "or activation only")
        x, w = x[0], weight[0]
        if scale is not None or pre_token_scale is not None:
            return [self.per_token(x, w, scale, pre_token_scale, group_list, group_list_type)]
        if w.dtype == ms.int8:
            if antiquant_scale is None or antiquant_offset is None or x.dtype not in (ms.float16, ms.bfloat16):
                raise TypeError("GroupedMatmulV4: int8 weights with float16 or bfloat16 x take antiquant_scale "
                                "and antiquant_offset (the stand-in emulates no other quantized form)")
            scale, offset = antiquant_scale[0].astype(ms.float32), antiquant_offset[0].astype(ms.float32)
            if scale.ndim == 3:                  # per group: [E, in / g, out]
                group = w.shape[1] // scale.shape[1]
                if 2 * w.shape[2] == scale.shape[2]:
                    w = ops.stack([int4_pairs(w[e], self.high_first) for e in range(w.shape[0])])
                scale, offset = ops.repeat_interleave(scale, group, 1), ops.repeat_interleave(offset, group, 1)
            else:
                shape = (w.shape[0], 1, w.shape[2])
                scale, offset = scale.reshape(shape), offset.reshape(shape)
            w = (w.astype(ms.float32) + offset) * scale
            return [self.grouped(x.astype(ms.float32), w, group_list, group_list_type).astype(x.dtype)]
        return [self.grouped(x, w, group_list, group_list_type)]

    def per_token(self, x, w, scale, pre_token_scale, group_list, group_list_type):
        """The per-token form (MindSpore's grouped_matmul_v4 doc: y = (x w) * scale * per_token_scale):
        x and weight int8, scale [[E, out]] bfloat16 (the output bfloat16) or float32 (float16),
        pre_token_scale [[M]] float32, given together; the int8 products summed in float32 here."""
        if scale is None or pre_token_scale is None or x.dtype != ms.int8 or w.dtype != ms.int8:
            raise TypeError("GroupedMatmulV4: scale and pre_token_scale go together, with int8 x and weight")
        s = scale[0]
        if s.dtype not in (ms.bfloat16, ms.float32):
            raise TypeError("GroupedMatmulV4: a per-token scale form takes a bfloat16 or float32 scale")
        out = ms.bfloat16 if s.dtype == ms.bfloat16 else ms.float16
        y = self.grouped(x.astype(ms.float32), w.astype(ms.float32), group_list, group_list_type)
        M = x.shape[0]
        E, N = s.shape
        ends = group_list.astype(ms.int32)
        if group_list_type == 1:
            ends = ops.cumsum(ends, 0)
        group = (ends.reshape(1, -1) <= int_range(M).reshape(-1, 1)).astype(ms.int32).sum(1)           # [M, E] summed
        rows = ops.gather(ops.concat((s.astype(ms.float32), ops.zeros((1, N), ms.float32))), group, 0)   # [M, N]
        return (y * rows * pre_token_scale[0].astype(ms.float32).reshape(-1, 1)).astype(out)

    def grouped(self, x, w, group_list, group_list_type):
        E, M = w.shape[0], x.shape[0]
        ends = group_list.astype(ms.int32)
        if group_list_type == 1:
            ends = ops.cumsum(ends, 0)
        group = (ends.reshape(1, -1) <= int_range(M).reshape(-1, 1)).astype(ms.int32).sum(1)           # [M, E] summed
        every = ops.BatchMatMul()(ops.broadcast_to(x.expand_dims(0), (E, -1, -1)), w)          # [E, M, out]
        pick = ops.equal(group.reshape(1, -1), int_range(E).reshape(-1, 1)).astype(x.dtype)     # [E, M]
        return (every * ops.broadcast_to(pick.expand_dims(-1), (-1, -1, w.shape[2]))).sum(0)


class MoeTokenUnpermute(nn.Cell):
    """Stand-in: out[n] = sum_j permuted_tokens[sorted_indices[n * K + j]] * probs[n, j], for
    probs [N, K] (padded_mode False, restore_shape None)."""

    def __init__(self):
        super().__init__()

    def construct(self, permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
        if probs is None or padded_mode or restore_shape is not None:
            raise NotImplementedError("the MoeTokenUnpermute stand-in emulates probs given, padded_mode False only")
        k, H = probs.shape[1], permuted_tokens.shape[1]
        rows = ops.gather(permuted_tokens, sorted_indices, 0).reshape(-1, k, H)
        return (rows * ops.broadcast_to(probs.astype(rows.dtype).expand_dims(-1), (-1, -1, H))).sum(1)


def _bits_to_float(bits):
    """int64 holding a positive float32's bits -> that float32 (MindSpore 2.10 has no bit cast)."""
    b = bits.astype(ms.float64)
    exponent = ops.floor(b / 8388608.0)
    return ((1.0 + (b - exponent * 8388608.0) / 8388608.0) * ops.pow(2.0, exponent - 127.0)).astype(ms.float32)


class QuantBatchMatmul(nn.Cell):
    """Stand-in (CANN's QuantBatchMatmulV3 formulas, hicann/ops-nn matmul/quant_batch_matmul_v3):
    x1 [M, K] int8 times x2 [N, K] (transpose_x2) or [K, N] int8, summed exactly; plus an int32
    bias; times scale [N] (float32, bfloat16, or int64 holding float32 bits) and
    pertokenScaleOptional [M] float32; plus offset; in `dtype`. The products are summed in float32
    here (exact while |sum| < 2^24). With the qbmm_float32_scale variant an int64 scale is refused,
    as a card whose kernel takes float32 scales only would."""

    def __init__(self, transpose_x1=False, transpose_x2=False, dtype=ms.float16):
        super().__init__()
        if transpose_x1:
            raise NotImplementedError("the QuantBatchMatmul stand-in emulates transpose_x1 False only")
        self.transpose_x2, self.dtype = transpose_x2, dtype
        self.float32_scales = "qbmm_float32_scale" in VARIANTS_IN_FORCE

    def construct(self, x1, x2, scale, offset=None, bias=None, pertokenScaleOptional=None):
        if x1.dtype != ms.int8 or x2.dtype != ms.int8:
            raise TypeError("QuantBatchMatmul takes int8 x1 and x2")
        if self.float32_scales and scale.dtype == ms.int64:
            raise TypeError("QuantBatchMatmul: an int64 scale is not supported (qbmm_float32_scale)")
        w = x2.astype(ms.float32)
        y = ops.matmul(x1.astype(ms.float32), w.T if self.transpose_x2 else w)
        if bias is not None:
            y = y + ops.broadcast_to(bias.astype(ms.float32).reshape(1, -1), y.shape)
        s = _bits_to_float(scale) if scale.dtype == ms.int64 else scale.astype(ms.float32)
        y = y * ops.broadcast_to(s.reshape(1, -1), y.shape)
        if pertokenScaleOptional is not None:
            y = y * ops.broadcast_to(pertokenScaleOptional.astype(ms.float32).reshape(-1, 1), y.shape)
        if offset is not None:
            y = y + ops.broadcast_to(offset.astype(ms.float32).reshape(1, -1), y.shape)
        return y.astype(self.dtype)


def int4_pairs(weight, high_first: bool = False):
    """int4 pairs [K, N / 2] (int8 bytes) -> their levels [K, N], float32: column 2j from the low
    nibble (high_first: the high one)."""
    b = weight.astype(ms.float32)
    hi = ops.floor(b / 16.0)                 # the high nibble, signed: b >> 4
    lo = b - 16.0 * hi                       # the low one, 0..15
    lo = lo - 16.0 * (lo >= 8.0).astype(ms.float32)
    pair = (hi, lo) if high_first else (lo, hi)
    return ops.stack(pair, axis=-1).reshape(weight.shape[0], -1)


class WeightQuantBatchMatmul(nn.Cell):
    """Stand-in (aclnnWeightQuantBatchMatmulV2, hicann/ops-nn): y = x @ ((weight + antiquant_offset) *
    antiquant_scale) + bias, summed in float32, in x's dtype, no output quantization:
    - antiquant_group_size 0: weight int8 [N, K] (transpose_weight) or [K, N], the scale and
      offset [N] per output;
    - antiquant_group_size g (transpose_weight False): the scale and offset [K / g, N], row i for
      inputs i*g .. i*g + g - 1; weight int8 [K, N], or int4 levels packed two to a byte [K, N / 2]
      (a qint4x2 tensor on a card: the emulated path holds the same bytes as int8, and a weight of
      half the scale's columns is read as such), column 2j in the low nibble (MindSpore's own test
      of the kernel packs them so); with the wqbmm_int4_high_first variant, in the high one."""

    def __init__(self, transpose_x=False, transpose_weight=False, antiquant_group_size=0):
        super().__init__()
        if transpose_x or (antiquant_group_size and transpose_weight):
            raise NotImplementedError("the WeightQuantBatchMatmul stand-in emulates transpose_x False, and "
                                      "groups with transpose_weight False")
        self.transpose_weight, self.group = transpose_weight, antiquant_group_size
        self.high_first = "wqbmm_int4_high_first" in VARIANTS_IN_FORCE

    def construct(self, x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None, quant_offset=None,
                  bias=None):
        if weight.dtype != ms.int8 or quant_scale is not None or quant_offset is not None:
            raise TypeError("the WeightQuantBatchMatmul stand-in takes int8 weights and no output quantization")
        if self.group:
            w = (int4_pairs(weight, self.high_first) if 2 * weight.shape[1] == antiquant_scale.shape[-1]
                 else weight.astype(ms.float32))
            scale = ops.repeat_interleave(antiquant_scale.astype(ms.float32), self.group, 0)
            if antiquant_offset is not None:
                w = w + ops.repeat_interleave(antiquant_offset.astype(ms.float32), self.group, 0)
            y = ops.matmul(x.astype(ms.float32), w * scale)
            if bias is not None:
                y = y + ops.broadcast_to(bias.astype(ms.float32).reshape(1, -1), y.shape)
            return y.astype(x.dtype)
        shape = (-1, 1) if self.transpose_weight else (1, -1)
        w = weight.astype(ms.float32)
        if antiquant_offset is not None:
            w = w + ops.broadcast_to(antiquant_offset.astype(ms.float32).reshape(shape), w.shape)
        w = w * ops.broadcast_to(antiquant_scale.astype(ms.float32).reshape(shape), w.shape)
        y = ops.matmul(x.astype(ms.float32), w.T if self.transpose_weight else w)
        if bias is not None:
            y = y + ops.broadcast_to(bias.astype(ms.float32).reshape(1, -1), y.shape)
        return y.astype(x.dtype)


class DynamicQuantExt(nn.Cell):
    """Stand-in (its docstring): scale = max|x| / 127 over the last axis, y = round(x / scale) int8
    (CANN's "round": halves away from zero); scale float32 [rows]. A row of zeros gives zeros."""

    def __init__(self):
        super().__init__()

    def construct(self, x, smooth_scales=None):
        if smooth_scales is not None:
            raise NotImplementedError("the DynamicQuantExt stand-in emulates smooth_scales None only")
        xf = x.astype(ms.float32)
        s = ROW_MAX(ops.abs(xf), -1) / 127.0
        s = s + (s == 0).astype(ms.float32) * float(np.finfo(np.float32).eps)
        y = ops.clip(round_half_away(xf / ops.broadcast_to(s, xf.shape)), -128.0, 127.0)
        return y.astype(ms.int8), s.reshape(x.shape[:-1])


class QuantV2(nn.Cell):
    """Stand-in (its docstring, sqrt_mode False): y = round(scale * x + offset), scale and offset [K]
    in x's dtype, rounding "ROUND" (halves away from zero), clamped to int8."""

    def __init__(self):
        super().__init__()

    def construct(self, x, scale, offset, sqrt_mode=False, rounding_mode="ROUND", dst_type=ms.int8):
        if sqrt_mode or rounding_mode != "ROUND" or dst_type != ms.int8:
            raise NotImplementedError("the QuantV2 stand-in emulates sqrt_mode False, ROUND, int8 only")
        xf = x.astype(ms.float32)
        y = xf * ops.broadcast_to(scale.astype(ms.float32).reshape(1, -1), xf.shape)
        y = y + ops.broadcast_to(offset.astype(ms.float32).reshape(1, -1), xf.shape)
        return ops.clip(round_half_away(y), -128.0, 127.0).astype(ms.int8)


class StandIns:
    """The stand-ins, under the names of mindspore.ops.auto_generate."""
    ReshapeAndCache = ReshapeAndCache
    FlashAttentionScore = FlashAttentionScore
    PagedAttention = PagedAttention
    RmsNorm = RmsNorm
    MoeGatingTopKSoftmax = MoeGatingTopKSoftmax
    MoeInitRoutingV2 = MoeInitRoutingV2
    GroupedMatmulV4 = GroupedMatmulV4
    MoeTokenUnpermute = MoeTokenUnpermute
    QuantBatchMatmul = QuantBatchMatmul
    WeightQuantBatchMatmul = WeightQuantBatchMatmul
    DynamicQuantExt = DynamicQuantExt
    QuantV2 = QuantV2


class EmulatedAscendOps(AscendOps):
    """AscendOps with the stand-ins: the Ascend path on the CPU (MSINFER_ASCEND_EMULATE=1)."""
    name = "ascend (emulated)"
    kernels = StandIns
    int4_dtype = ms.int8             # MindSpore's CPU operators take no qint4x2 tensor: the same bytes


class KernelError(RuntimeError):
    """A fused kernel failed on a card: names it, what it was given, and the way around it."""


def kernel_error(error: Exception, inputs: dict, kind: str, cfg, tp_heads: tuple[int, int], dtype: str,
                 block_size: int, experts: tuple[int, int] | None = None) -> KernelError | None:
    """The KernelError for a step's failure where MindSpore's message names one of the fused
    kernels (None otherwise): the kernel, the shapes and dtypes msinfer gave it in this step,
    and `model.ops: portable`. experts: (experts held, intermediate size of each) on this rank."""
    text = str(error)
    # (MoeTokenUnpermute runs as the primitive InnerMoeTokenUnpermute)
    found = {m.start(): k for k in KERNELS + MOE_KERNELS + QUANT_KERNELS
             for m in [re.search(rf"(?:\b|Inner){k}\b", text)] if m}
    if not found:
        return None
    kernel = found[min(found)]                   # the first named: MindSpore names the failing node first
    H, KV = tp_heads
    D = cfg.head_dim
    T = inputs["input_ids"].shape[0]
    B, MB = inputs["block_tables"].shape
    cache = f"[blocks, {block_size}, {KV}, {D}] {dtype}"
    given: dict = {
        "ReshapeAndCache": f"key [{T}, {KV * D}] {dtype}, value [{T}, {KV * D}] {dtype}, key_cache and value_cache "
                           f"{cache}, slot_mapping [{T}] int32",
        "FlashAttentionScore": f"query [{T}, {H * D}] {dtype}, key and value [{T}, {KV * D}] {dtype}, attn_mask "
                               f"[128, 128] {dtype}, actual_seq_qlen and actual_seq_kvlen [{B}] int32 (layout TH)",
        "PagedAttention": f"query [{T}, {H * D}] {dtype}, key_cache and value_cache {cache}, block_tables [{B}, {MB}] "
                          f"int32, context_lens and q_seq_lens [{B}] int32, attn_mask "
                          f"{list(inputs['attn_mask'].shape)} {dtype}",
        "RmsNorm": f"x [{T}, hidden or {D}] {dtype}, gamma {dtype}",
    }
    if cfg.mla is not None:          # AscendLatentAttention's calls
        W, V = cfg.mla.cache_width, cfg.mla.kv_lora_rank
        cache = f"[blocks, {block_size}, 1, {W}] {dtype}"
        given.update({
            "ReshapeAndCache": f"key [{T}, {W}] {dtype}, value None, key_cache {cache}, value_cache None, "
                               f"slot_mapping [{T}] int32",
            "PagedAttention": f"query [{T}, {H * W}] {dtype}, key_cache and value_cache the same {cache}, kv_head_num 1, "
                              f"mla_v_dim {V}, block_tables [{B}, {MB}] int32, context_lens and q_seq_lens [{B}] int32, "
                              f"attn_mask {list(inputs['attn_mask'].shape)} {dtype}"})
    if experts is not None:
        E, I, k, Hd = *experts, cfg.num_experts_per_tok, cfg.hidden_size
        given.update({
            "MoeGatingTopKSoftmax": f"x [{T}, {cfg.num_experts}] {dtype}, finished None, k {k}",
            "MoeInitRoutingV2": f"x [{T}, {Hd}] {dtype}, expert_idx [{T}, {k}] int32, expert_num {E + 1}, dropless, "
                                f"counts (flag 2)",
            "GroupedMatmulV4": f"x [[{T * k}, {Hd} or {I}]] {dtype}, weight [[{E}, {Hd}, {2 * I}] or [{E}, {I}, {Hd}]] "
                               f"{dtype}, group_list [{E}] int64 counts, split_item 3, group_type 0",
            "MoeTokenUnpermute": f"permuted_tokens [{T * k}, {Hd}] {dtype}, sorted_indices [{T * k}] int32, probs "
                                 f"[{T}, {k}] {dtype}"})
    inputs_given = given.get(kernel, "its inputs")
    said = next((line.strip() for line in text.splitlines()
                 if re.search(r"[A-Za-z]", line) and not line.lstrip().startswith("- ")), text)
    return KernelError(f"the Ascend kernel {kernel} failed in a {kind} step; msinfer gave it {inputs_given}. "
                       f"MindSpore said: {said[:400]} Set model.ops: portable in the job spec to run this model in "
                       f"portable MindSpore operators instead of the fused kernels.")
