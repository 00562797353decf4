"""The decoder network (Llama / Qwen2 / Qwen3, their mixtures of experts, DeepSeek-V2/V3) over a paged KV cache, in MindSpore.

One `forward` serves every step: it writes the new tokens' K/V rows into the cache at their
slots, then each token attends over the first positions of its own sequence (read through the
sequence's block table, or, in a prefill with nothing cached, among the step's own tokens; the
device's attention, `worker.ops`). A step's tokens are packed one after another, whatever
sequence they belong to, so prefill and decode steps differ only in how many tokens each
sequence brings. All index tensors are built by the engine (`worker.runner`),
never by a caller.
"""

from __future__ import annotations

import gc
import re
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
import numpy as np

from msinfer.sharding.config import ModelConfig
from msinfer.sharding.layers import (HALVES, MAX, SOFTMAX, SPLIT, TOPK, ColumnParallelLinear, FusedExperts, LinearBase,
                                     MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, ReplicatedLinear,
                                     RMSNorm, RowParallelLinear, StaticInt8, VocabParallelEmbedding, all_reduce,
                                     carried_levels, huge_pages, in_turn, load_replicated, new_param)
from msinfer.sharding.layout import Stage, TPInfo
from msinfer.sharding.quant import QuantizationError, int4_levels, int8_levels
from msinfer.worker.cpu import GLU_GROUP
from msinfer.worker.device_sampler import VocabSampler
from msinfer.worker.ops import MASKED, packed_attention


class Attention(nn.Cell):
    """kv_dtype: the KV cache's element, dtype's or uint16 holding bfloat16 values (the CPU
    kernels computing in bfloat16: K and V rounded as they are written)."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, dtype, dev, num_blocks: int, block_size: int, kv_dtype=None):
        super().__init__()
        self.dev = dev
        self.qkv_proj = QKVParallelLinear(cfg, cfg.qkv_bias, tp, dtype, dev.linear_op)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp, dtype,
                                        dev.linear_op)
        self.heads, self.kv_heads, self.head_dim = self.qkv_proj.q_heads, self.qkv_proj.kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, dev)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, dev)
        else:
            self.q_norm = self.k_norm = None
        shape = dev.cache_shape(num_blocks, block_size, self.kv_heads, cfg.head_dim)
        self.k_cache = dev.cache_param(shape, kv_dtype or dtype, "k_cache")
        self.v_cache = dev.cache_param(shape, kv_dtype or dtype, "v_cache")
        if dev.fused_attention:      # one kernel from the qkv projection on: slices, norms and all
            self.attend = dev.attention_op(self.q_size)
            ones = Tensor(np.ones(cfg.head_dim), dtype)
            self.qk_norm = (self.q_norm.weight, self.k_norm.weight) if cfg.qk_norm else (ones, ones)
            self.norm_meta = Tensor(np.array([cfg.rms_norm_eps, float(cfg.qk_norm)], np.float32))
            self.attn_meta = Tensor(np.array([block_size, self.kv_heads], np.int32))
        else:
            self.attend = dev.attention(self.heads, self.kv_heads, cfg.head_dim, block_size, dtype)

    def construct(self, x, rope_q, rope_k, ctx, prefill: bool):
        qkv = self.qkv_proj(x)
        if self.dev.fused_attention:
            slot_mapping, block_tables, _, _, token_seq, token_len, _ = ctx
            return self.o_proj(self.attend(qkv, *self.qk_norm, self.norm_meta, *rope_q, self.k_cache, self.v_cache,
                                           slot_mapping, block_tables, token_seq, token_len, self.attn_meta))
        q, k, v = SPLIT(qkv, (self.q_size, self.kv_size, self.kv_size), 1)
        q = q.reshape(-1, self.heads, self.head_dim)
        k = k.reshape(-1, self.kv_heads, self.head_dim)
        v = v.reshape(-1, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        out = self.attend(self.dev.rotary(q, *rope_q), self.dev.rotary(k, *rope_k), v, self.k_cache, self.v_cache,
                          ctx, prefill)
        return self.o_proj(out.reshape(-1, self.q_size))

    def caches(self) -> tuple:
        return self.k_cache, self.v_cache

    def loaders(self, p: str, table: dict) -> None:
        """Its checkpoint tensors under prefix p (e.g. model.layers.0.self_attn.) into `table`."""
        for s in ("q", "k", "v"):
            add_linear(table, p + f"{s}_proj", self.qkv_proj, s)
        add_linear(table, p + "o_proj", self.o_proj)
        if self.q_norm is not None:
            table[p + "q_norm.weight"] = (self.q_norm, self.q_norm.weight, None)
            table[p + "k_norm.weight"] = (self.k_norm, self.k_norm.weight, None)


LATENT_EPS = 1e-6      # the latents' RMSNorm eps (transformers' and DeepSeek's: not rms_norm_eps)


class MLAttention(nn.Cell):
    """DeepSeek's multi-head latent attention (sharding.config.LatentAttention), this rank's heads,
    over a latent cache [blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]: each new token's
    [c_kv | k_rope] goes in at its slot, the layout Ascend's kernels take for one KV head.
    - Steps that read the cache (decode, chunks after cached tokens, scoring) attend in the latent
      space: kv_b_proj's key part is absorbed into each head's query (q_nope W_UK, kv_lora_rank
      values), every head attends over the cache as over one KV head whose keys are whole latents
      and whose values are their c_kv (the device's `latent_attention`), and kv_b_proj's value
      part maps the result to v_head_dim (as vLLM, vllm-ascend and vllm-mindspore serve MLA).
    - A prefill with nothing cached decompresses its own latents into per-head keys and values
      (kv_b_proj as a matmul) and attends among them (`packed_attention`): qk_head_dim per score,
      not the cache width.
    kv_b_proj's weight is read in Hugging Face's order ([heads x (nope + v), kv_lora_rank]) by both,
    so the device does not reorder it (`device_order`). Rotary is applied to the rope parts only,
    after DeepSeek's interleaved pairs are put in halves (the same scores: q and k permuted alike)."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, dtype, dev, num_blocks: int, block_size: int, kv_dtype=None):
        super().__init__()
        m = cfg.mla          # (the latents stay in dtype: kv_dtype is Attention's)
        H = self.heads = cfg.num_heads // tp.size
        self.scale = m.softmax_scale
        self.kv_heads = 1
        lin = dev.linear_op
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if m.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, m.q_lora_rank, cfg.qkv_bias, tp, dtype, lin)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_EPS, dtype, dev)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, cfg.num_heads * m.qk_head_dim, False, tp, dtype, lin)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * m.qk_head_dim, False, tp, dtype, lin)
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden_size, m.cache_width, cfg.qkv_bias, tp, dtype, lin)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_EPS, dtype, dev)
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                              False, tp, dtype)
        self.kv_b_proj.device_order = False
        self.o_proj = RowParallelLinear(cfg.num_heads * m.v_head_dim, cfg.hidden_size, cfg.o_bias, tp, dtype, lin)
        self.cache = dev.cache_param((num_blocks, block_size, 1, m.cache_width), dtype, "latent_cache")
        self.latent = dev.latent_attention(H, m.cache_width, m.kv_lora_rank, block_size, dtype, self.scale)
        self.nope, self.rope, self.lora, self.v = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
        order = np.concatenate([np.arange(0, self.rope, 2), np.arange(1, self.rope, 2)]).astype(np.int32)
        self.rope_order = Tensor(order) if m.rope_interleave else None

    def rotate(self, x, cos, sin):
        """x [N, h, rope] rotated by cos/sin [N, rope/2] (halves; interleaved pairs put in halves first)."""
        if self.rope_order is not None:
            x = ops.gather(x, self.rope_order, 2)
        shape = (-1, x.shape[1], -1)
        c, s = ops.broadcast_to(cos.expand_dims(1), shape), ops.broadcast_to(sin.expand_dims(1), shape)
        x1, x2 = HALVES(x)
        return ops.concat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    def construct(self, x, rope_q, rope_k, ctx, prefill: bool):
        H = self.heads
        slot_mapping, token_seq = ctx[0], ctx[4]
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = SPLIT(q.reshape(-1, H, self.nope + self.rope), (self.nope, self.rope), 2)
        cos, sin = rope_q
        q_pe = self.rotate(q_pe, cos, sin)
        c_kv, k_pe = SPLIT(self.kv_a_proj_with_mqa(x), (self.lora, self.rope), 1)
        c_kv = self.kv_a_layernorm(c_kv)
        if self.kv_b_proj.input_quant is not None:
            # W8A8: c_kv is kv_b_proj's input, quantized per token as the checkpoint's arithmetic
            # says (sharding.quant), once: the cache holds it so, for decode's absorbed kv_b_proj too
            c_kv = self.kv_b_proj.input_quant(c_kv)
        k_pe = self.rotate(k_pe.reshape(-1, 1, self.rope), cos, sin)
        written = self.latent.write(ops.concat((c_kv, k_pe.reshape(-1, self.rope)), -1), self.cache, slot_mapping)
        if prefill:
            kv = self.kv_b_proj.matmul(c_kv, self.kv_b_proj.weight).reshape(-1, H, self.nope + self.v)
            k_nope, v = SPLIT(kv, (self.nope, self.v), 2)
            k = ops.concat((k_nope, ops.broadcast_to(k_pe, (-1, H, -1))), -1)
            q = ops.depend(ops.concat((q_nope, q_pe), -1), written)
            out = packed_attention(q, k, v, token_seq, self.scale)
        else:
            w_k, w_v = SPLIT(self.kv_b_proj.weight.reshape(H, self.nope + self.v, self.lora), (self.nope, self.v), 1)
            q_lat = ops.bmm(q_nope.transpose(1, 0, 2), w_k)                                        # [H, N, lora]
            q = ops.depend(ops.concat((q_lat.transpose(1, 0, 2), q_pe), -1), written)
            out = self.latent.attend(q, self.cache, ctx)                                          # [N, H, lora]
            out = ops.bmm(out.transpose(1, 0, 2), w_v.transpose(0, 2, 1)).transpose(1, 0, 2)
        return self.o_proj(out.reshape(-1, H * self.v))

    def caches(self) -> tuple:
        return (self.cache,)

    def loaders(self, p: str, table: dict) -> None:
        for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            if getattr(self, name) is not None:
                add_linear(table, p + name, getattr(self, name))
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            if getattr(self, name) is not None:
                table[p + name + ".weight"] = (getattr(self, name), getattr(self, name).weight, None)


class MLP(nn.Cell):
    """down(silu(gate x) * up x), sliced over its intermediate size I; reduce=False leaves the
    all-reduce of down's partial sums to the caller."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, dtype, dev, intermediate: int = 0, reduce: bool = True):
        super().__init__()
        self.dev = dev
        I = intermediate or cfg.intermediate_size
        # silu(gate) * up computed by the projection itself where the device has such a kernel
        glu = dev.glu_linear_op is not None and not cfg.mlp_bias and (I // tp.size) % GLU_GROUP == 0
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [I, I], cfg.mlp_bias, tp, dtype,
                                                       dev.glu_linear_op if glu else dev.linear_op)
        self.gate_up_proj.glu = glu                 # its weight is packed for it (dev.pack_weight)
        self.down_proj = RowParallelLinear(I, cfg.hidden_size, cfg.mlp_bias, tp, dtype, dev.linear_op, reduce)

    def construct(self, x):
        h = self.gate_up_proj(x)
        return self.down_proj(h if self.gate_up_proj.glu else self.dev.silu_mul(h))

    def loaders(self, p: str, table: dict) -> None:
        """Its checkpoint tensors under prefix p (e.g. model.layers.0.mlp.) into `table`."""
        for j, name in enumerate(("gate_proj", "up_proj")):
            add_linear(table, p + name, self.gate_up_proj, j)
        add_linear(table, p + "down_proj", self.down_proj)


def add_linear(table: dict, name: str, layer, shard_id=None) -> None:
    """Checkpoint tensors <name>.weight, and <name>.bias where the layer has a bias, -> `layer`'s
    loaders (the loader table of CausalLM.named_loaders); a ModelSlim W8A8 layer's input scale and
    offset to its input quantizer's."""
    table[name + ".weight"] = (layer, layer.weight, shard_id)
    if layer.bias is not None:
        table[name + ".bias"] = (layer, layer.bias, shard_id)
    if isinstance(layer.input_quant, StaticInt8):
        table[name + ".input_scale"] = (layer.input_quant, layer.input_quant.scale, None)
        table[name + ".input_offset"] = (layer.input_quant, layer.input_quant.offset, None)


class GroupedRouter(nn.Cell):
    """DeepSeek's routing (sharding.config.Routing), in float32 MindSpore primitives on every
    device: (router logits [N, E]) -> (weights [N, k] float32, experts [N, k] int32), the weights
    final (normalized with norm_topk_prob, times routed_scaling_factor)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        r = cfg.routing
        self.k, self.norm, self.experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.num_experts
        self.sigmoid, self.groups, self.top_groups, self.top2 = (r.scoring == "sigmoid", r.groups, r.top_groups,
                                                                 r.group_score == "top2")
        self.scale = r.scale
        self.bias = new_param((cfg.num_experts,), ms.float32, "e_score_correction_bias") if r.bias else None
        self.group_ids = Tensor(np.arange(r.groups, dtype=np.int32))

    weight_loader = staticmethod(load_replicated)     # the correction bias

    def construct(self, logits):
        logits = logits.astype(ms.float32)
        E, G = self.experts, self.groups
        scores = ops.sigmoid(logits) if self.sigmoid else SOFTMAX(logits)
        choice = scores + ops.broadcast_to(self.bias, scores.shape) if self.bias is not None else scores
        if G > 1:
            grouped = choice.reshape(-1, G, E // G)
            best = TOPK(grouped, 2)[0].sum(-1) if self.top2 else MAX(grouped, -1)
            top = TOPK(best, self.top_groups)[1].astype(ms.int32)                          # [N, top_groups]
            hit = ops.equal(ops.broadcast_to(top.expand_dims(-1), (-1, -1, G)),
                            ops.broadcast_to(self.group_ids, top.shape + (G,)))
            keep = ops.broadcast_to((hit.astype(ms.float32).sum(1) > 0).expand_dims(-1), (-1, -1, E // G))
            choice = ops.select(keep.reshape(-1, E), choice, MASKED)
        ids = TOPK(choice, self.k)[1].astype(ms.int32)
        weights = ops.gather_elements(scores, 1, ids)
        if self.norm:
            weights = weights / ops.broadcast_to(weights.sum(-1, keepdims=True) + 1e-20, (-1, self.k))
        return weights * self.scale, ids


class SparseMoeBlock(nn.Cell):
    """A mixture-of-experts layer: Qwen2-MoE's and Qwen3-MoE's router (the softmax in float32, its
    top k, renormalized with norm_topk_prob), or DeepSeek's (`GroupedRouter`), weighting k experts
    per token; plus a shared expert, scaled by sigmoid(shared_expert_gate x) in Qwen2-MoE. The
    router runs on every rank (the activations are replicated); each rank adds up its experts'
    part, and one all-reduce sums the parts of the routed and the shared experts (sharding.layout)."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, dtype, dev):
        super().__init__()
        self.shared_key = cfg.shared_expert_key
        self.norm_topk = cfg.norm_topk_prob and cfg.routing is None
        self.route = dev.moe_router(cfg.num_experts_per_tok) if cfg.routing is None else GroupedRouter(cfg)
        if cfg.routing is None:
            self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, False, tp, dtype, dev.linear_op)
        else:    # in float32, as transformers keeps DeepSeek's router (_keep_in_fp32_modules_strict)
            self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, False, tp, ms.float32)
            self.gate.device_order = False
        self.gate_fp32 = cfg.routing is not None
        int8_inputs = cfg.expert_inputs("gate_proj") or cfg.expert_inputs("down_proj")
        self.experts = FusedExperts(cfg, tp, dtype, dev.moe_op if dev.moe_quant_inputs or not int8_inputs else None,
                                    GLU_GROUP)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_size:
            self.shared_expert = MLP(cfg, tp, dtype, dev, cfg.shared_expert_size, reduce=False)
            if cfg.routing is None:
                self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, False, tp, dtype, dev.linear_op)
        self.all_reduce = all_reduce() if tp.size > 1 else None

    def construct(self, x):
        weights, ids = self.route(self.gate(x.astype(ms.float32)) if self.gate_fp32 else self.gate(x))
        if self.norm_topk:
            weights = weights / ops.broadcast_to(weights.sum(-1, keepdims=True), (-1, weights.shape[1]))
        y = self.experts(x, ids, weights.astype(x.dtype))
        shared = None
        if self.shared_expert is not None:
            # (int8 inputs split over the ranks gather each row's max in the experts and in the
            # shared expert's down projection: one after the other)
            shared = self.shared_expert(in_turn(x, y) if self.all_reduce is not None else x)
        if self.shared_expert_gate is not None:
            scale = ops.sigmoid(self.shared_expert_gate(x))
            y = y + ops.broadcast_to(scale, (-1, y.shape[1])) * shared
        elif shared is not None:
            y = y + shared
        return y if self.all_reduce is None else self.all_reduce(y)

    def loaders(self, p: str, table: dict) -> None:
        add_linear(table, p + "gate", self.gate)
        if isinstance(self.route, GroupedRouter) and self.route.bias is not None:
            table[p + "gate.e_score_correction_bias"] = (self.route, self.route.bias, None)
        ex = self.experts
        for e in range(ex.count):
            q = f"{p}experts.{ex.first + e}."
            table[q + "gate_proj.weight"] = (ex, ex.w13, (e, 0))
            table[q + "up_proj.weight"] = (ex, ex.w13, (e, 1))
            table[q + "down_proj.weight"] = (ex, ex.w2, (e, 2))
        if self.shared_expert is not None:
            self.shared_expert.loaders(p + self.shared_key + ".", table)
        if self.shared_expert_gate is not None:
            add_linear(table, p + "shared_expert_gate", self.shared_expert_gate)


class LayerBase(nn.Cell):
    def build(self, cfg, tp, dtype, dev, num_blocks, block_size, kv_dtype, mlp):
        self.self_attn = (Attention if cfg.mla is None else MLAttention)(cfg, tp, dtype, dev, num_blocks, block_size,
                                                                        kv_dtype)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, dev)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, dev)
        # the device's one-call layer, or its halves' calls (`fuse`)
        self.fused = self.attention_half = self.mlp_half = None

    def fuse(self, dev) -> bool:
        """Runs the layer's halves as calls of the device's decoder_layer_op (the CPU kernels'
        DecoderAttention and DecoderMlp) where they compute what its operators do: the attention
        half (its norm, the qkv projection with or without Qwen2's bias, the device's attention
        from it, the o projection without a bias) and the MLP half (its norm, a dense MLP with its
        activation in the gate/up projection, neither projection with a bias), their linear
        layers without an input quantizer or an int8 matmul of their own (float, bfloat16 or int8
        panels, bfloat16 pairs or tiles). With both halves and no all-reduce between them (tp 1),
        the whole layer is one call (DecoderLayer). A mixture of experts' layer fuses its
        attention half; latent attention's keeps its operators. Called once the weights are
        packed, before the first step compiles; whether any part of the layer runs fused."""
        attn, mlp = self.self_attn, self.mlp
        if dev.decoder_layer_op is None or not dev.fused_attention:
            return False

        def plain(x):
            return x.input_quant is None and x.int8_matmul is None
        attention = isinstance(attn, Attention) and attn.o_proj.bias is None and plain(attn.qkv_proj) \
            and plain(attn.o_proj)
        dense = isinstance(mlp, MLP) and mlp.gate_up_proj.glu and mlp.gate_up_proj.bias is None \
            and mlp.down_proj.bias is None and plain(mlp.gate_up_proj) and plain(mlp.down_proj)
        if attention and dense and attn.o_proj.all_reduce is None and mlp.down_proj.all_reduce is None:
            self.fused = dev.decoder_layer_op()
            return self.fused is not None
        halves = dev.decoder_layer_op(True) if attention or dense else None
        if halves is None:
            return False
        self.attention_half = halves[0] if attention else None
        self.mlp_half = halves[1] if dense else None
        return True

    def construct(self, h, delta, rope_q, rope_k, ctx, prefill: bool):
        """(the residual stream before the layer before's output is added, that output) ->
        the same pair after this layer: each residual add goes with the norm after it
        (RMSNorm with a delta), one kernel where the device fuses them; the layer or its halves
        in one call each where `fuse` found they can be."""
        attn, mlp, post = self.self_attn, self.mlp, self.post_attention_layernorm
        if self.fused is not None or self.attention_half is not None:
            slot_mapping, block_tables, _, _, token_seq, token_len, _ = ctx
            first = (h, delta, self.input_layernorm.weight, self.input_layernorm.add_op.eps, attn.qkv_proj.weight,
                     *attn.qk_norm, attn.norm_meta, *rope_q, attn.k_cache, attn.v_cache, slot_mapping, block_tables,
                     token_seq, token_len, attn.attn_meta, attn.o_proj.weight)
            bias = () if attn.qkv_proj.bias is None else (attn.qkv_proj.bias,)
            if self.fused is not None:
                return self.fused(*first, post.weight, post.add_op.eps, mlp.gate_up_proj.weight,
                                  mlp.down_proj.weight, *bias)
            h, o = self.attention_half(*first, *bias)
            if attn.o_proj.all_reduce is not None:
                o = attn.o_proj.all_reduce(o)
        else:
            h, x = self.input_layernorm(h, delta)
            o = self.self_attn(x, rope_q, rope_k, ctx, prefill)
        if self.mlp_half is not None:
            h, d = self.mlp_half(h, o, post.weight, post.add_op.eps, mlp.gate_up_proj.weight, mlp.down_proj.weight)
            return h, d if mlp.down_proj.all_reduce is None else mlp.down_proj.all_reduce(d)
        h, x = post(h, o)
        return h, self.mlp(x)

    def stack_slots(self) -> list:
        """The inputs of this layer's DecoderLayer call (`construct`) but those every layer takes
        from the step (the residual stream, the rotary tables, the step's tokens), in that order:
        its norms, weights, caches and metadata, which the device's DecoderStack takes for every
        layer (CausalLM.fuse). A norm's or linear layer's weight (or bias) is given as (its cell,
        the attribute), the others as they are."""
        attn, mlp, post = self.self_attn, self.mlp, self.post_attention_layernorm
        bias = [] if attn.qkv_proj.bias is None else [(attn.qkv_proj, "bias")]
        return [(self.input_layernorm, "weight"), self.input_layernorm.add_op.eps, (attn.qkv_proj, "weight"),
                *attn.qk_norm, attn.norm_meta, attn.k_cache, attn.v_cache, attn.attn_meta, (attn.o_proj, "weight"),
                (post, "weight"), post.add_op.eps, (mlp.gate_up_proj, "weight"), (mlp.down_proj, "weight"), *bias]


class DecoderLayer(LayerBase):
    # Compiled once and reused for every layer: a 30-layer step compiles in ~2/3 of the time.
    @ms.lazy_inline(policy="front")
    def __init__(self, cfg, tp, dtype, dev, num_blocks, block_size, kv_dtype=None):
        super().__init__()
        self.build(cfg, tp, dtype, dev, num_blocks, block_size, kv_dtype, MLP(cfg, tp, dtype, dev))


class SparseDecoderLayer(LayerBase):
    """A layer whose MLP is a mixture of experts: a class of its own, so that one compiled graph
    serves the sparse layers and another the dense ones."""

    @ms.lazy_inline(policy="front")
    def __init__(self, cfg, tp, dtype, dev, num_blocks, block_size, kv_dtype=None):
        super().__init__()
        self.build(cfg, tp, dtype, dev, num_blocks, block_size, kv_dtype, SparseMoeBlock(cfg, tp, dtype, dev))


# The inputs of every compiled step, in order (see CausalLM). The names are the graph's input
# names: Ascend's kernels read `batch_valid_length` and `q_seq_lens` by name (worker/ascend.py).
STEP_INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "batch_valid_length", "q_seq_lens",
               "token_seq", "token_len", "attn_mask", "out_index")
SCORE_INPUTS = STEP_INPUTS + ("score_index", "targets")
POOL_INPUTS = STEP_INPUTS + ("pool_index",)
PROMPT_TOP = 20        # the most alternatives `prompt_logprobs: k` returns a prompt token (vLLM's max_logprobs)


def expert_levels(w: Parameter, scales: np.ndarray, levels_of) -> np.ndarray | None:
    """Stacked experts' weights [E, N, K] -> their levels (int8 [E, N, K]), expert by expert
    (`levels_of`: int8_levels or int4_levels of one [N, K] weight and its scales), so that the
    float temporaries are one expert's, not the layer's; None where any expert has none. The
    levels they loaded as where they carry them (sharding.layers.carried_levels)."""
    carried = carried_levels(w)
    values = w.asnumpy() if carried is None else None
    out = np.empty(w.shape, np.int8)
    for e, s in enumerate(scales):
        q = levels_of(None if values is None else values[e], s, None if carried is None else carried[e])
        if q is None:
            return None
        out[e] = q
    return out


def hold_int4_experts(dev, cell: FusedExperts, dtype=ms.float32) -> dict | None:
    """Experts whose weights all loaded as int4 levels with a scale per group of inputs (W4A16)
    keep them, two a byte, in the device's int4 expert layout (`dev.pack_experts` with the group
    scales: the CPU's, or GroupedMatmulV4's in `dev.int4_dtype`), their scales beside them
    (`dev.expert_scales`, in `dev.int4_scale_dtype` of the compute dtype). Returns each
    weight's name -> the unpack to its dequantized values; None where they stay as they are (a
    weight's values are not its levels times its scales, or the layout does not take the sizes)."""
    held = []
    for w, glu in ((cell.w13, cell.glu), (cell.w2, False)):
        scales = getattr(w, "group_scales", None)
        if scales is None:
            return None
        levels = expert_levels(w, scales, int4_levels)
        packed = None if levels is None else dev.pack_experts(levels, glu, scales)
        if packed is None:
            return None
        held.append((w.name, packed, scales, w.shape[-1] // scales.shape[-1]))
    (_, (p13, _), s13, _), (_, (p2, _), s2, _) = held
    sdt = dev.int4_scale_dtype(dtype)
    cell.hold_int8(p13, p2, Tensor(dev.expert_scales(s13, cell.glu), sdt), Tensor(dev.expert_scales(s2), sdt),
                   getattr(dev, "int4_dtype", None))
    return {name: lambda t, u=unpack, s=s, g=g: u(t).astype(np.float32) * np.repeat(s, g, axis=-1)
            for name, (_, unpack), s, g in held}


# The inputs of the device's decoder_stack_op before its `stack` metadata (CausalLM.forward).
STACK_FIXED = 9


class CausalLM(nn.Cell):
    """Inputs of one step (N tokens of B sequences, in M >= B rows; see ModelRunner.prepare):
        input_ids          [N]      int32   the new tokens, packed one sequence after another
        positions          [N, P]   float32 rotary position components (P = 1 for plain RoPE)
        slot_mapping       [N]      int32   cache slot (block * block_size + offset) of each new token's K/V
        block_tables       [M, MB]  int32   the cache blocks of each sequence
        batch_valid_length [M]      int32   each sequence's length with this step's tokens (0: padding)
        q_seq_lens         [M]      int32   each sequence's tokens in this step
        token_seq          [N]      int32   which sequence (row of block_tables) each token is of
        token_len          [N]      int32   how many positions of its sequence it sees: its position + 1
                                            (causal), 0 for a padding token
        attn_mask          [N, MB * block_size] or [1, 1]   the compute dtype: 0 where a token may
                                            look, -10000 past its position (devices with `paged_mask`)
        out_index          [M]      int32   rows of the N tokens whose logits are returned (-1: padding,
                                            whose logits are not computed where the device can skip them)
    Each device reads the inputs its attention takes. Two step kinds compile apart: `prefill`
    (nothing of any sequence cached: attention among the step's own tokens) and `decode` (any
    other step, chunks after cached tokens included: attention through the block tables).
    The attention scale is 1/sqrt(head_dim), as in every supported family.
    `forward` gives this rank's vocabulary shard of the logits, [M, per] float32
    (sharding.layout.vocab_shard); the step functions return them, to stay on the device for the
    sampler (worker.device_sampler), which gathers no row of them, with each row's greedy token
    [M] int32 computed in the same graph (a greedy step needs no other)."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, dtype, dev, num_blocks: int, freq_matrix: np.ndarray,
                 block_size: int = 16, stage: Stage = Stage(), kv_dtype=None):
        super().__init__()
        self.cfg = cfg
        self.stage = stage
        # a pipeline stage but the first takes the stage before's hidden states (`hidden`), and one
        # but the last returns its own, [N, hidden_size] float32, instead of logits
        self.first, self.last = stage.first, stage.last
        self.layer_ids = stage.layers(cfg.num_layers)
        self.embed_tokens = self.norm = self.lm_head = self.sampler = self.scorer = None
        if self.first:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, dev.embed_op)
        self.layers = nn.CellList([(SparseDecoderLayer if cfg.is_sparse(i) else DecoderLayer)(
            cfg, tp, dtype, dev, num_blocks, block_size, kv_dtype) for i in self.layer_ids])
        if self.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, dev)
        if self.last and cfg.lm_head:
            # tied: the embedding's weight; on a last stage without the embedding, a copy of its own
            tied = self.embed_tokens if cfg.tie_word_embeddings and self.first else None
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, tied=tied,
                                          linear=dev.linear_op)
            self.sampler = VocabSampler(cfg.vocab_size, tp, kernels=dev.sampler_kernels)     # its greedy pick
            # score_top's: the PROMPT_TOP most likely tokens of each scored row
            self.scorer = VocabSampler(cfg.vocab_size, tp, PROMPT_TOP, PROMPT_TOP, kernels=dev.sampler_kernels)
        # [P, head_dim/2]: which position component drives each rotary frequency, times inv_freq.
        self.freq_matrix = Parameter(Tensor(freq_matrix, ms.float32), name="freq_matrix", requires_grad=False)
        self.dtype = dtype
        self.dev = dev
        self.rope_factor, self.latent = cfg.rope_factor, cfg.mla is not None
        self.rope_scale = Tensor(np.array([cfg.rope_factor], np.float32))
        self.has_lm_head = cfg.lm_head           # (graphs read plain attributes, not the config's)
        attn = self.layers[0].self_attn
        self.heads, self.kv_heads = attn.heads, attn.kv_heads
        self.packed: dict = {}               # name of a weight in the device's order -> its unpack
        self.held_weights: dict = {}         # name of a weight in the device's order -> its Parameter
        # the linear layers', the experts', the LM head's and the embedding's weights in bfloat16
        # pairs (dev.pack_pairs), computed in bfloat16 (quantized ones stay as they are): set by the
        # runner from EngineConfig.matmul_dtype before the weights load
        self.bf16_matmuls = False
        self.uncollected = 0                 # bytes of parameters replaced since the last collection (pack_layer)
        # the device's one call for every layer (`fuse`), its metadata and its inputs past the step's
        self.stack = self.stack_meta = None
        self.stack_args = ()
        self.stacked: dict = {}              # a layer weight's name -> (its stack_weights Parameter, the layer)
        # greedy chains' pick from the LM head in bfloat16 pairs (`pack_greedy_head`): its op and tables
        self.greedy_head = self.head_pairs = self.head_norms = None
        if cfg.quant is not None:
            self.quantize_inputs()

    def fuse(self) -> int:
        """Each layer's `fuse`, then, where every layer is one call of the same inputs (dense, at
        tp 1, all with or all without a qkv bias) and the device has one, the layers as one call
        of its decoder_stack_op. MindSpore charges a call for each distinct Parameter it takes
        (~2 us each, at its start and end), so the call takes every layer's weights of one kind
        as one [layers, ...] Parameter (`stack_weights`), the K and V caches likewise
        (`stack_caches`), and an input that is the same in every layer (a constant of equal
        values, or one Parameter) once; the rest layer by layer. How many layers run any part
        fused."""
        fused = sum(layer.fuse(self.dev) for layer in self.layers)
        if (self.dev.decoder_stack_op is None or len(self.layers) < 2
                or any(layer.fused is None for layer in self.layers)):
            return fused
        slots = [layer.stack_slots() for layer in self.layers]
        if len({len(x) for x in slots}) != 1:
            return fused

        def same(values) -> bool:
            if all(v is values[0] for v in values):
                return True
            if any(isinstance(v, Parameter) for v in values):
                return False
            first = values[0].asnumpy()
            return all(v.shape == first.shape and v.dtype == values[0].dtype and np.array_equal(v.asnumpy(), first)
                       for v in values[1:])

        def stackable(column) -> bool:       # one weight a layer, all of one shape and dtype
            if not all(isinstance(x, tuple) for x in column):
                return False
            first = getattr(*column[0])
            return all(getattr(*x).shape == first.shape and getattr(*x).dtype == first.dtype for x in column)
        caches = [(layer.self_attn.k_cache, layer.self_attn.v_cache) for layer in self.layers]
        shared, own, where, sliced = [], [], [], []              # own: [input][layer]
        for column in zip(*slots):
            if stackable(column):
                where.append(-1 - (STACK_FIXED + len(shared)))
                sliced.append(1)
                shared.append(self.stack_weights(column))
                continue
            values = [getattr(*x) if isinstance(x, tuple) else x for x in column]
            kind = next((k for k in (0, 1) if all(v is c[k] for v, c in zip(values, caches))), None)
            if kind is not None or same(values):
                where.append(-1 - (STACK_FIXED + len(shared)))
                sliced.append(int(kind is not None))
                shared.append(values[0] if kind is None else self.stack_caches[kind])
            else:
                where.append(len(own))
                sliced.append(0)
                own.append(values)
        self.replaced(0, self.STACKED_BYTES)              # the layers' weights, now in their stacks
        self.stack = self.dev.decoder_stack_op()
        self.stack_meta = Tensor(np.array([len(self.layers), len(own), *where, *sliced], np.int32))
        self.stack_args = (*shared, *(values[layer] for layer in range(len(self.layers)) for values in own))
        return fused

    def stack_weights(self, column) -> Parameter:
        """One Parameter [layers, ...] of the weights `column` names, (cell, attribute) of each
        layer, named as theirs with `stack.` for the layer's prefix. Each layer's is copied into it
        and replaced by a Parameter of its name, shape and dtype that is never written (zero
        pages, no memory: `stacked` says where its values are); the replaced ones are freed as
        pack_layer's are. The stack's memory is advised into 2 MB pages before it is written
        (sharding.layers.huge_pages)."""
        first = getattr(*column[0])
        name = re.sub(r"^(.*\.)?layers\.\d+\.", "stack.", first.name)
        whole = new_param((len(column), *first.shape), first.dtype, name)
        self.insert_param_to_cell(name.replace(".", "_"), whole)
        held = whole.asnumpy()                   # (the Parameter's own memory)
        huge_pages(held)
        for layer, (cell, attr) in enumerate(column):
            p = getattr(cell, attr)
            held[layer] = p.asnumpy()
            self.stacked[p.name] = (whole, layer)
            setattr(cell, attr, new_param(p.shape, p.dtype, p.name))
            if self.held_weights.get(p.name) is p:
                self.held_weights[p.name] = getattr(cell, attr)
            nbytes = p.nbytes
            del p
            self.replaced(nbytes)
        return whole

    @property
    def stack_caches(self) -> tuple:
        """The K and V caches of every layer, [layers, ...] each, for DecoderStack: parameters of
        this cell (made on first use, as a layer's are: zero pages until written)."""
        if not hasattr(self, "stack_k_cache"):
            k = self.layers[0].self_attn.k_cache
            for name in ("k_cache", "v_cache"):
                self.insert_param_to_cell(f"stack_{name}",
                                          self.dev.cache_param((len(self.layers), *k.shape), k.dtype, f"stack.{name}"))
        return self.stack_k_cache, self.stack_v_cache

    def quantize_inputs(self) -> None:
        """W8A8 (sharding.quant): each layer whose scheme quantizes its inputs does so before its
        matmul. The checkpoint layers one matmul fuses (q, k, v; gate, up) must agree. Each layer
        keeps its scheme (`quant_scheme`) for a device that multiplies int8 weights itself."""
        layers: dict[int, tuple] = {}
        for name, (layer, param, _) in self.named_loaders().items():
            if name.endswith(".weight") and param is getattr(layer, "weight", None):
                scheme = self.cfg.quant.scheme_for(name[:-len(".weight")])
                act = (scheme.static, scheme.act_divisor, scheme.modelslim) if scheme and scheme.act_int8 else None
                layers.setdefault(id(layer), (layer, name, {}))[2][act] = scheme
        for layer, name, acts in layers.values():
            if len(acts) > 1:
                raise QuantizationError(f"'{name}' shares one matmul with layers whose inputs the checkpoint "
                                        f"quantizes differently")
            (act, scheme), = acts.items()
            layer.quant_scheme = scheme
            if act:
                layer.quantize_inputs(scheme, name[:-len(".weight")], self.dev.quant_rows_op)

    def forward(self, input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens, token_seq,
                token_len, attn_mask, out_index, prefill: bool, hidden=None, head: bool = True):
        """The step's logits at out_index; with `head` False, the final norm's rows there instead."""
        x = self.embed_tokens(input_ids) if self.first else hidden.astype(self.dtype)
        if self.dev.rope_cos_sin is not None:                            # one operator (the CPU kernels)
            cos, sin = self.dev.rope_cos_sin(positions, self.freq_matrix, self.rope_scale)
        else:
            angles = ops.matmul(positions, self.freq_matrix)             # [N, D/2]
            cos, sin = ops.cos(angles), ops.sin(angles)
            if self.rope_factor != 1.0:                                  # YaRN's attention factor
                cos, sin = cos * self.rope_factor, sin * self.rope_factor
        cos, sin = cos.astype(self.dtype), sin.astype(self.dtype)
        if not self.latent:
            rope_q = self.dev.rope_tables(cos, sin, self.heads)
            rope_k = self.dev.rope_tables(cos, sin, self.kv_heads)
        else:                                # MLAttention rotates its rope parts itself
            rope_q = rope_k = (cos, sin)
        ctx = (slot_mapping, block_tables, batch_valid_length, q_seq_lens, token_seq, token_len, attn_mask)
        delta = ops.zeros_like(x)
        if self.stack is not None:
            x, delta = self.stack(x, delta, *rope_q, slot_mapping, block_tables, token_seq, token_len,
                                  self.stack_meta, *self.stack_args)
        else:
            for layer in self.layers:
                x, delta = layer(x, delta, rope_q, rope_k, ctx, prefill)
        if not self.last:
            return (x + delta).astype(ms.float32)
        _, x = self.norm(self.dev.rows(x, out_index), self.dev.rows(delta, out_index))
        if not self.has_lm_head or not head:     # embed, classify: the final norm's hidden states (`pool`)
            return x
        return self.lm_head(x).astype(ms.float32)

    def prefill(self, input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens, token_seq,
                token_len, attn_mask, out_index, hidden=None):
        logits = self.forward(input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens,
                              token_seq, token_len, attn_mask, out_index, True, hidden)
        if not self.last:                   # the stage's hidden states
            return logits
        return logits, self.sampler.greedy(logits)

    def decode(self, input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens, token_seq,
               token_len, attn_mask, out_index, hidden=None):
        logits = self.forward(input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens,
                              token_seq, token_len, attn_mask, out_index, False, hidden)
        if not self.last:
            return logits
        return logits, self.sampler.greedy(logits)

    construct = decode

    def decode_chain(self, input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens,
                     token_seq, token_len, attn_mask, out_index, draws):
        """K decode steps of the same sequences in one call (K = positions.shape[0], fixed by the
        graph's shape, so the loop unrolls as it compiles): step k feeds the tokens step k - 1
        picked. The per-step inputs carry a leading K (positions [K, N, P], slot_mapping [K, N],
        batch_valid_length [K, M], token_len [K, N]); the rest are a decode step's. `draws`: [K, M, 5]
        float32, each step's VocabSampler.sample parameters of each row (temperature, top_k, top_p,
        min_p, its uniform), drawn by one SampleRows call a step (tp 1 with the CPU kernels); or
        [K, 1, 1] for greedy steps (GreedyRows). A decode step has N = M and token b in row b, so a
        step's tokens [M] are the next step's input ids, the padding rows' (out_index -1) put back
        to the device's padding id. Greedy steps pick with GreedyHead where the model holds its
        tables (`pack_greedy_head`). -> tokens [K, M] int32."""
        real = out_index >= 0
        sampled = draws.shape[-1] == 5          # (fixed by the graph's shape)
        ids, tokens = input_ids, []
        by_head = not sampled and self.greedy_head is not None    # GreedyHead's pick (pack_greedy_head)
        for k in range(positions.shape[0]):
            out = self.forward(ids, positions[k], slot_mapping[k], block_tables, batch_valid_length[k], q_seq_lens,
                               token_seq, token_len[k], attn_mask, out_index, False, head=not by_head)
            if by_head:
                picked = self.greedy_head(out, self.lm_head.weight, self.head_pairs, self.head_norms, self.sampler.meta)
            else:
                picked = self.sampler.fused(out, draws[k]) if sampled else self.sampler.greedy(out)
            tokens.append(picked)
            ids = ops.select(real, picked, self.dev.pad_id)
        return ops.stack(tokens)

    def score(self, input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens, token_seq,
              token_len, attn_mask, out_index, score_index, targets, hidden=None):
        """A prefill (of the decode kind: its sequences may have cached tokens) that also scores:
        returns (logits [M, per] at out_index and their greedy tokens, as `decode` returns them;
        [S, 2] float32: log p(targets[i] | the tokens up to row score_index[i]) and the target's
        rank). The log-softmax, the pick and the count run in the graph, shard by shard (the
        sampler's `score`), so a scoring step hands back 2 S floats, not S x vocab logits."""
        m = out_index.shape[0]
        logits = self.forward(input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens,
                              token_seq, token_len, attn_mask, ops.concat((out_index, score_index)), False, hidden)
        greedy = self.sampler.greedy(logits[:m])
        return logits[:m], greedy, self.sampler.score(in_turn(logits[m:], greedy), targets)

    def score_top(self, input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens, token_seq,
                  token_len, attn_mask, out_index, score_index, targets, hidden=None):
        """`score` with the alternatives of `prompt_logprobs: k`: the third output is [S, 2 + 2
        PROMPT_TOP], per scored row log p(target), its rank, the PROMPT_TOP largest
        log-probabilities and their tokens (float32), as the sampler's `figures`."""
        m = out_index.shape[0]
        logits = self.forward(input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens,
                              token_seq, token_len, attn_mask, ops.concat((out_index, score_index)), False, hidden)
        greedy = self.sampler.greedy(logits[:m])
        scored = self.sampler.score(in_turn(logits[m:], greedy), targets)
        _, figures = self.scorer.greedy_logprobs(in_turn(logits[m:], scored))
        return logits[:m], greedy, ops.concat((scored, figures[:, 1:]), -1)

    def pool(self, input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens, token_seq,
             token_len, attn_mask, out_index, pool_index, hidden=None):
        """A prefill (of the decode kind, as `score`) for task embed or classify (no LM head:
        cfg.lm_head is False): the final norm's hidden states of rows pool_index [S] of the step's tokens, [S,
        hidden_size] float32, for the runner to pool (worker.runner.forward_pooled)."""
        x = self.forward(input_ids, positions, slot_mapping, block_tables, batch_valid_length, q_seq_lens,
                         token_seq, token_len, attn_mask, pool_index, False, hidden)
        return x if not self.last else x.astype(ms.float32)

    def pack_weights(self, cells: nn.Cell | None = None) -> None:
        """Every matmul and embedding weight of `cells` (a cell and those in it; None: the whole
        model) into the device's element order (`dev.pack_weight`), and the experts' stacked
        weights into theirs (`dev.pack_experts`), once they are loaded; the layers were built with
        the device's ops, which read that order. A weight packed by an earlier call is left as it
        is. A weight may change its dtype (bfloat16 tiles are int16), so it becomes a new Parameter
        of the same name, set on every cell that holds it (a tied LM head shares the embedding's)."""
        loaded = list((cells or self).get_parameters())
        for _, cell in (cells or self).cells_and_names():
            if isinstance(cell, FusedExperts):
                if cell.w13.name in self.packed:                 # by an earlier call
                    continue
                if self.dev.int8_experts is not None and self.hold_int8_experts(cell):
                    continue
                # experts that loaded as floats in bfloat16 pairs, computed in bfloat16 (dev.pack_pairs)
                pairs = {"pairs": True} if self.bf16_matmuls and cell.schemes <= {None} else {}
                for attr, glu in (("w13", cell.glu), ("w2", False)) if self.dev.pack_experts and cell.op else ():
                    w = getattr(cell, attr)
                    if w.name not in self.packed:
                        data, self.packed[w.name] = self.dev.pack_experts(w.asnumpy(), glu, **pairs)
                        setattr(cell, attr, Parameter(Tensor(data), name=w.name, requires_grad=False))
                continue
            w = getattr(cell, "weight", None)
            if self.dev.int8_linear is not None and isinstance(cell, LinearBase) and self.hold_int8(cell):
                continue
            if (self.dev.pack_weight is None or not isinstance(cell, (LinearBase, VocabParallelEmbedding))
                    or not getattr(cell, "device_order", True)):
                continue
            if w.name not in self.held_weights:
                if w.name in self.packed:        # held int8 by an earlier call
                    continue
                # int8 weights with a scale per row stay int8 where the device multiplies them
                scales = getattr(w, "row_scales", None) if isinstance(cell, (LinearBase, ParallelLMHead)) else None
                glu = getattr(cell, "glu", False)
                # (an embedding's pairs: its lookup needs an even hidden size)
                if self.bf16_matmuls and scales is None and (isinstance(cell, LinearBase) or w.shape[1] % 2 == 0):
                    data, self.packed[w.name] = self.dev.pack_pairs(w.asnumpy(), glu)
                else:
                    data, self.packed[w.name] = self.dev.pack_weight(w.asnumpy(), glu, scales, carried_levels(w))
                self.held_weights[w.name] = Parameter(Tensor(data), name=w.name, requires_grad=False)
            cell.weight = self.held_weights[w.name]
            if (cell.weight.dtype == ms.uint32 and isinstance(cell, VocabParallelEmbedding)
                    and not isinstance(cell, ParallelLMHead)):       # a table in pairs (tied to the LM head or not)
                cell.lookup = self.dev.embed_pairs_op()
        for p in loaded:            # the int levels the weights loaded as (record_scales) are of no more
            for attr in ("levels", "levels_known"):     # use, on those replaced (which wait for a
                if getattr(p, attr, None) is not None:  # collection) and those kept as float alike
                    delattr(p, attr)

    def pack_greedy_head(self) -> bool:
        """Where the device picks greedy tokens from the LM head in bfloat16 pairs (CpuOps.greedy_head:
        the CPU kernels with VDPBF16PS, MSINFER_GREEDY_HEAD unset or 1), a float32 network of one
        stage (whose decode steps chain) at tp 1 whose LM head is in bfloat16 panels: that head's
        `greedy_head_tables` as Parameters, which decode_chain's greedy steps take instead of the
        logits (GreedyHead; the same tokens as GreedyRows over them). Called once the weights are
        packed (sharding.layout.bytes_per_rank counts them); whether the tables are held."""
        head = self.lm_head
        if (not getattr(self.dev, "greedy_head", False) or head is None or not self.first
                or self.dtype != ms.float32 or self.sampler.tp_size != 1 or self.dev.sampler_kernels is None
                or head.input_quant is not None or head.weight.dtype != ms.uint16):
            return False
        tables = self.dev.greedy_head_tables(head.weight.asnumpy())
        if tables is None:
            self.greedy_head = self.head_pairs = self.head_norms = None
            return False
        self.head_pairs = Parameter(Tensor(tables[0]), name="lm_head.greedy_pairs", requires_grad=False)
        self.head_norms = Parameter(Tensor(tables[1]), name="lm_head.greedy_norms", requires_grad=False)
        self.greedy_head = self.dev.greedy_head_op()
        return True

    def refresh_greedy_head(self) -> None:
        """GreedyHead's tables (`pack_greedy_head`) made again from the LM head's values as they
        now are (the actor's fill_random wrote others), into the same Parameters."""
        tables = self.dev.greedy_head_tables(self.lm_head.weight.asnumpy())
        if tables is None:
            raise ValueError("the LM head now holds bfloat16 denormals, which GreedyHead's pairs would read as zeros")
        self.head_pairs.set_data(Tensor(tables[0]))
        self.head_norms.set_data(Tensor(tables[1]))

    # The bytes of replaced parameters that pack_layer lets wait for a collection, and that fuse
    # leaves once the weights are stacked (a small model's: a test's process, where one takes ~90 ms).
    UNCOLLECTED_BYTES = 64 << 20
    STACKED_BYTES = 8 << 20

    def pack_layer(self, index: int) -> None:
        """`pack_weights` of decoder layer `index` (the checkpoint's numbering), which the loader
        calls as it finishes each layer: the float weights it loaded (dequantized, or float32
        where the device holds bfloat16) are then freed layer by layer, so that loading takes the
        packed model's memory and a layer's more (or UNCOLLECTED_BYTES), not the whole model in
        float. A MindSpore Parameter is in a reference cycle with its ParamInfo (`param_info.obj`),
        so the replaced ones are freed by a collection, run once UNCOLLECTED_BYTES of them wait:
        3-5 ms in a worker, whose imports are frozen, but ~90 ms in a process that imported
        MindSpore and transformers unfrozen (a test's), for a small model's every layer."""
        if index not in self.layer_ids:
            return
        layer = self.layers[self.layer_ids.index(index)]
        before = {id(p): p.nbytes for p in layer.get_parameters()}
        self.pack_weights(layer)
        after = {id(p) for p in layer.get_parameters()}
        self.replaced(sum(n for i, n in before.items() if i not in after))

    def replaced(self, nbytes: int, wait: int | None = None) -> None:
        """`nbytes` more of replaced parameters wait for a collection (see pack_layer), which runs
        once `wait` (UNCOLLECTED_BYTES) bytes of them do."""
        self.uncollected += nbytes
        if self.uncollected >= (self.UNCOLLECTED_BYTES if wait is None else wait):
            gc.collect()
            self.uncollected = 0

    def hold_int8(self, cell: LinearBase) -> bool:
        """A layer whose weight loaded as int8 levels with a scale per row, or int4 levels with a
        scale per group of inputs (sharding.quant.Dequantized), keeps them as they are, multiplied
        by the device's quantized matmul (`dev.int8_linear`), where the device has one for the
        layer's scheme (AscendOps: per its kernel self-check). Whether it does."""
        w, scheme = cell.weight, cell.quant_scheme
        if scheme is None or not getattr(cell, "device_order", True):
            return False
        grouped = scheme.int4_groups
        scales = getattr(w, "group_scales" if grouped else "row_scales", None)
        if scales is None:
            return False
        matmul = self.dev.int8_linear(scheme, cell.input_quant, self.dtype, getattr(cell, "glu", False))
        if matmul is None:
            return False
        carried = carried_levels(w)
        levels = (int4_levels if grouped else int8_levels)(w.asnumpy() if carried is None else None, scales, carried)
        packed = matmul.pack(levels) if levels is not None else None
        if packed is None:
            return False
        name = w.name
        data, unpack = packed
        cell.hold_int8(matmul, data, matmul.scales(scales))
        # (the group scales are repeated over their inputs when asked: kept repeated, they would
        # take a float32 the weight's size)
        g = w.shape[1] // scales.shape[1] if grouped else 0
        self.packed[name] = lambda t, u=unpack, s=scales.astype(np.float32), g=g: \
            u(t).astype(np.float32) * (np.repeat(s, g, axis=1) if g else s[:, None])
        return True

    def hold_int8_experts(self, cell: FusedExperts) -> bool:
        """Experts whose weights all loaded as int8 levels with a scale per row keep them, in the
        device's expert layout (`dev.pack_experts`: the Ascend path's transposes alone, so each
        output channel keeps its scale; the CPU's VNNI panels where the sizes are whole panels, else
        its int8 panels with the scales inside), multiplied by the device's grouped kernel, where
        it takes the experts' scheme (`dev.int8_experts`: the layout). Whether they do."""
        scheme = cell.quant_scheme
        layout = self.dev.int8_experts(scheme)
        if not layout:
            return False
        if layout == "int4":
            unpacks = hold_int4_experts(self.dev, cell, self.dtype)
            self.packed.update(unpacks or {})
            return unpacks is not None
        if scheme.int8_kind == "dynamic" and (cell.x_quant is None or cell.h_quant is None):
            return False                 # int8 inputs to one projection only: both stay float
        held = []
        for w in (cell.w13, cell.w2):
            scales = getattr(w, "row_scales", None)
            levels = None if scales is None else expert_levels(w, scales, int8_levels)
            if levels is None:
                return False
            held.append((levels, scales))
        (l13, s13), (l2, s2) = held
        names = cell.w13.name, cell.w2.name
        packed = None if layout == "panels" else (self.dev.pack_experts(l13, cell.glu), self.dev.pack_experts(l2))
        if packed is None or None in packed:
            # the CPU's int8 panels, the scales inside, products in float32 (also where its VNNI
            # panels do not take the sizes)
            p13, unpack13 = self.dev.pack_experts(l13, cell.glu, s13)
            p2, unpack2 = self.dev.pack_experts(l2, False, s2)
            cell.hold_int8(p13, p2)
            self.packed.update(zip(names, (unpack13, unpack2)))
            return True
        (p13, unpack13), (p2, unpack2) = packed
        # weight-only: the antiquant scale in the compute dtype; int8 inputs: the per-token form's
        # scale, bfloat16 for a bfloat16 output and float32 for float16 (golden-stick, ptq/hal.py)
        sdt = self.dtype if scheme.int8_kind == "weight" or self.dtype == ms.bfloat16 else ms.float32
        cell.hold_int8(p13, p2, Tensor(self.dev.expert_scales(s13, cell.glu), sdt),
                       Tensor(self.dev.expert_scales(s2), sdt))
        for name, unpack, s in zip(names, (unpack13, unpack2), (s13, s2)):
            self.packed[name] = lambda t, u=unpack, s=s: u(t).astype(np.float32) * s[..., None]
        return True

    def int8_scales(self) -> list[Parameter]:
        """The scales of the weights held as int8 (`hold_int8`, `hold_int8_experts`)."""
        return ([c.weight_scale for _, c in self.cells_and_names()
                 if isinstance(c, LinearBase) and c.weight_scale is not None]
                + [p for _, c in self.cells_and_names() if isinstance(c, FusedExperts) and c.w13_scale is not None
                   for p in (c.w13_scale, c.w2_scale)])

    def held_parameters(self) -> list[Parameter]:
        """The parameters the checkpoint's weights are held in, once packed: what the loader wrote,
        the scales of int8 weights and GreedyHead's tables (`pack_greedy_head`)."""
        held = {id(p): p for _, p, _ in self.named_loaders().values()}
        held.update((id(p), p) for p in self.int8_scales())
        held.update((id(p), p) for p in (self.head_pairs, self.head_norms) if p is not None)
        return list(held.values())

    def weights(self) -> dict[str, np.ndarray]:
        """name -> value of every parameter but the KV cache, in the Hugging Face layout (an int8
        weight dequantized, its scales not listed; a layer's weight in its stack, `stacked`, read
        there, the stacks not listed; GreedyHead's tables, made from the LM head, not listed)."""
        scales, stacks = {id(p) for p in self.int8_scales()}, {id(w) for w, _ in self.stacked.values()}
        stacks.update(id(p) for p in (self.head_pairs, self.head_norms) if p is not None)
        out = {}
        for p in self.get_parameters():
            if "cache" in p.name or id(p) in scales or id(p) in stacks:
                continue
            if p.name in self.stacked:
                whole, layer = self.stacked[p.name]
                value = whole.asnumpy()[layer]
            else:
                value = p.asnumpy()
            out[p.name] = self.packed[p.name](value) if p.name in self.packed else value
        return out

    def named_loaders(self):
        """checkpoint tensor name -> (layer, parameter, shard id), for the streaming loader."""
        table = {}
        for i, layer in zip(self.layer_ids, self.layers):
            p = f"model.layers.{i}."
            layer.self_attn.loaders(p + "self_attn.", table)
            layer.mlp.loaders(p + "mlp.", table)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                cell = getattr(layer, norm)
                table[p + f"{norm}.weight"] = (cell, cell.weight, None)
        if self.first:
            table["model.embed_tokens.weight"] = (self.embed_tokens, self.embed_tokens.weight, None)
        elif self.last and self.cfg.tie_word_embeddings and self.cfg.lm_head:
            # the last stage's copy of the tied embedding
            table["model.embed_tokens.weight"] = (self.lm_head, self.lm_head.weight, None)
        if self.last:
            table["model.norm.weight"] = (self.norm, self.norm.weight, None)
            if not self.cfg.tie_word_embeddings and self.cfg.lm_head:
                table["lm_head.weight"] = (self.lm_head, self.lm_head.weight, None)
        return table
