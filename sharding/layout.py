"""The tensor-parallel layout: which checkpoint tensor splits on which dimension, and what each rank holds.

Computed in the launcher before any worker starts (no MindSpore here), and used by the parallel
layers in `sharding.layers` to slice each tensor as it streams from disk.

    column-parallel   W [out, in] split on dim 0 (q/k/v, gate/up, vocab rows of embedding / lm_head)
    row-parallel      W [out, in] split on dim 1 (o_proj, down_proj), output all-reduced
    replicated        norms, and K/V heads when tp_size exceeds num_kv_heads

DeepSeek's latent attention (MLA) splits its heads: q_b_proj (or q_proj) and kv_b_proj by rows,
o_proj by columns. q_a_proj and kv_a_proj_with_mqa are replicated: every rank computes each
token's latent and caches it whole, since each of its heads attends over all of it (the latent
is per token, not per head; splitting it would need an all-gather per layer, and replicating it
costs 576 values a token in DeepSeek-V3, less than one rank's share of decompressed heads).

A mixture-of-experts layer takes one of two layouts (`parallel.expert_parallel`):
    sliced            every rank holds a 1/tp slice of every expert, split as a dense MLP is
    expert parallel   rank r holds experts [r E/tp, (r + 1) E/tp) whole
Either way the rank computes its part of the layer for every token of the step (the activations
are the same on every rank of a tensor-parallel group, so a token needs no sending to reach the
rank of its experts) and one all-reduce sums the parts. The router and a shared expert's gate
are replicated; a shared expert is sliced like a dense MLP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from msinfer.sharding.config import ModelConfig, greedy_head_on


class LayoutError(ValueError):
    """A tensor-parallel size that the model's shapes cannot take."""


@dataclass(frozen=True)
class TPInfo:
    """This rank's place in its tensor-parallel group; set once per worker."""
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False    # a MoE layer's experts whole on each rank, not sliced

    def experts(self, cfg: ModelConfig) -> tuple[int, int, int]:
        """(first expert, how many, intermediate size of each) that this rank holds of a sparse layer."""
        if self.expert_parallel:
            per = cfg.num_experts // self.size
            return self.rank * per, per, cfg.moe_intermediate_size
        return 0, cfg.num_experts, cfg.moe_intermediate_size // self.size


@dataclass(frozen=True)
class Stage:
    """This rank's pipeline stage: decoder layers [lo, hi) of the model; the first stage also holds
    the embedding, the last the final norm, the LM head and the sampler (both, with one stage)."""
    index: int = 0
    count: int = 1
    lo: int = 0
    hi: int | None = None            # None: to the last layer

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def layers(self, num_layers: int) -> range:
        return range(self.lo, num_layers if self.hi is None else self.hi)

    @staticmethod
    def of(ranges, index: int) -> "Stage":
        """Stage `index` of a split (stage_layers' ranges; empty: one stage of every layer)."""
        if not ranges:
            return Stage()
        lo, hi = ranges[index]
        return Stage(index, len(ranges), lo, hi)


def stage_layers(num_layers: int, pp: int, layers=None) -> tuple[tuple[int, int], ...]:
    """The [lo, hi) decoder layers of each of pp stages: `layers` (a count per stage, as
    parallel.pipeline_layers gives them), else an even split with the remainder on the later
    stages (the first holds the embedding, the last the LM head). () for one stage."""
    if layers is not None:
        if len(layers) != pp or min(layers) < 1:
            raise LayoutError(f"parallel.pipeline_layers {list(layers)}: expected {pp} counts of at least 1 layer")
        if sum(layers) != num_layers:
            raise LayoutError(f"parallel.pipeline_layers {list(layers)} adds up to {sum(layers)} layers; the model "
                              f"has {num_layers}")
        sizes = list(layers)
    else:
        if pp > num_layers:
            raise LayoutError(f"parallel.pipeline_parallel {pp} is more stages than the model's {num_layers} "
                              f"decoder layers")
        base, extra = divmod(num_layers, pp)
        sizes = [base + (s >= pp - extra) for s in range(pp)]
    if pp == 1:
        return ()
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return tuple(zip(bounds[:-1], bounds[1:]))


def divisors_problem(cfg: ModelConfig, tp: int, ep: bool = False) -> list[str]:
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_heads} is not divisible by {tp}")
    kv = cfg.num_kv_heads
    if cfg.mla is None and kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} neither divides nor is divisible by {tp}")
    if len(cfg.sparse_layers) < cfg.num_layers and cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by {tp}")
    if cfg.is_moe and ep and cfg.num_experts % tp:
        problems.append(f"num_experts={cfg.num_experts} is not divisible by {tp} (expert parallel)")
    if cfg.is_moe and not ep and cfg.moe_intermediate_size % tp:
        problems.append(f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by {tp} (experts "
                        f"sliced)")
    if cfg.shared_expert_size % tp:
        key = "n_shared_experts x moe_intermediate_size" if cfg.mla else "shared_expert_intermediate_size"
        problems.append(f"{key}={cfg.shared_expert_size} is not divisible by {tp}")
    return problems + quant_split_problems(cfg, tp, ep)


def quant_split_problems(cfg: ModelConfig, tp: int, ep: bool = False) -> list[str]:
    """A quantized row-parallel layer (its inputs split over the ranks) needs each rank's inputs
    to be whole groups of its scales, and whole int32 words where its ints come packed."""
    q = cfg.quant
    if q is None:
        return []
    found: dict[str, str] = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        rows = [(p + "self_attn.o_proj", cfg.num_heads * cfg.head_dim)]
        if cfg.is_sparse(i):
            if not ep:
                rows.append((p + "mlp.experts.0.down_proj", cfg.moe_intermediate_size))
            if cfg.shared_expert_size:
                rows.append((p + f"mlp.{cfg.shared_expert_key}.down_proj", cfg.shared_expert_size))
        else:
            rows.append((p + "mlp.down_proj", cfg.intermediate_size))
        for name, cols in rows:
            s = q.scheme_for(name)
            per = 32 // s.bits if s is not None and q.packed else 1
            unit = math.lcm(s.group_size or 1, per) if s is not None else 1
            kind = name.split(".", 3)[-1].replace(".0.", ".")
            if s is not None and (cols % tp or (cols // tp) % unit) and kind not in found:
                what = f"groups of {s.group_size}" if s.group_size else f"int32 words of {per} values"
                found[kind] = f"{kind} ({s.name}) would hold {cols / tp:g} of its {cols} inputs per rank, not whole {what}"
    return list(found.values())


def valid_tp_sizes(cfg: ModelConfig, limit: int = 64, ep: bool = False) -> list[int]:
    return [t for t in range(1, limit + 1) if not divisors_problem(cfg, t, ep)]


def check_tp(cfg: ModelConfig, tp: int, ep: bool = False) -> None:
    if tp < 1:
        raise LayoutError(f"parallel.tensor_parallel must be >= 1, got {tp}")
    if ep and not cfg.is_moe:
        raise LayoutError(f"parallel.expert_parallel is set, but {cfg.architecture} has no experts; leave it out")
    problems = divisors_problem(cfg, tp, ep)
    if problems:
        other = "" if not cfg.is_moe else (
            f"; with {'experts sliced' if ep else 'whole experts per rank'} (parallel.expert_parallel: "
            f"{str(not ep).lower()}): {', '.join(map(str, valid_tp_sizes(cfg, ep=not ep)))}")
        raise LayoutError(
            f"parallel.tensor_parallel={tp} does not fit {cfg.architecture}: {'; '.join(problems)}. "
            f"Sizes that work: {', '.join(map(str, valid_tp_sizes(cfg, ep=ep)))}{other}")


def vocab_shard(vocab_size: int, tp: TPInfo) -> tuple[int, int, int]:
    """(start, stop, padded shard size) of this rank's vocab rows; the last shard may be short."""
    per = -(-vocab_size // tp.size)
    start = min(tp.rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


def kv_head_range(cfg: ModelConfig, tp: TPInfo) -> tuple[int, int]:
    """KV heads held by this rank; with tp_size > num_kv_heads each head is replicated."""
    if tp.size <= cfg.num_kv_heads:
        per = cfg.num_kv_heads // tp.size
        return tp.rank * per, (tp.rank + 1) * per
    replicas = tp.size // cfg.num_kv_heads
    head = tp.rank // replicas
    return head, head + 1


@dataclass(frozen=True)
class TensorPlan:
    name: str
    full_shape: tuple[int, ...]
    split_dim: int | None       # None: replicated
    rank_shape: tuple[int, ...]


def plan_tensors(cfg: ModelConfig, tp_size: int, ep: bool = False, stage: Stage = Stage()) -> list[TensorPlan]:
    """Every tensor of the checkpoint a rank may load, with its split dim and rank-0 shape (all
    ranks hold equal sizes). Expert parallel: an expert's tensors are whole on the rank that holds
    it, and rank 0's shape of another rank's expert is empty. `stage`: only its layers, the
    embedding on the first stage, the final norm and LM head on the last (a tied LM head is the
    embedding's tensor, loaded there too)."""
    check_tp(cfg, tp_size, ep)
    t0 = TPInfo(0, tp_size, ep)
    H, I = cfg.hidden_size, cfg.intermediate_size
    _, _, vocab_rank = vocab_shard(cfg.vocab_size, t0)
    plans = []

    def add(name, full, dim, rank_shape):
        plans.append(TensorPlan(name, full, dim, rank_shape))

    if stage.first or (stage.last and cfg.tie_word_embeddings and cfg.lm_head):
        add("model.embed_tokens.weight", (cfg.vocab_size, H), 0, (vocab_rank, H))
    for i in stage.layers(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.mla is not None:
            add_latent_attention(plans, cfg, p + "self_attn.", tp_size)
        else:
            add_attention(plans, cfg, p + "self_attn.", t0)
        if cfg.is_sparse(i):
            add_experts(plans, cfg, t0, p + "mlp.")
        else:
            add_mlp(plans, cfg, p + "mlp.", I, tp_size)
        add(p + "input_layernorm.weight", (H,), None, (H,))
        add(p + "post_attention_layernorm.weight", (H,), None, (H,))
    if stage.last:
        add("model.norm.weight", (H,), None, (H,))
        if not cfg.tie_word_embeddings and cfg.lm_head:
            add("lm_head.weight", (cfg.vocab_size, H), 0, (vocab_rank, H))
        if cfg.num_labels and not cfg.head_tokens:     # a classifier's head (read on the host)
            add("score.weight", (cfg.num_labels, H), None, (cfg.num_labels, H))
    return plans


def add_attention(plans: list[TensorPlan], cfg: ModelConfig, p: str, t0: TPInfo) -> None:
    """Multi-head attention's tensors under prefix p (`self_attn.`): q heads split, K/V heads split
    or replicated (kv_head_range), o_proj row-parallel."""
    H, D, tp_size = cfg.hidden_size, cfg.head_dim, t0.size
    q_out = cfg.num_heads * D
    kv_lo, kv_hi = kv_head_range(cfg, t0)
    kv_out, kv_rank = cfg.num_kv_heads * D, (kv_hi - kv_lo) * D

    def add(name, full, dim, rank_shape):
        plans.append(TensorPlan(name, full, dim, rank_shape))

    add(p + "q_proj.weight", (q_out, H), 0, (q_out // tp_size, H))
    for kv in ("k", "v"):
        add(p + f"{kv}_proj.weight", (kv_out, H), 0, (kv_rank, H))
    if cfg.qkv_bias:
        add(p + "q_proj.bias", (q_out,), 0, (q_out // tp_size,))
        for kv in ("k", "v"):
            add(p + f"{kv}_proj.bias", (kv_out,), 0, (kv_rank,))
    add(p + "o_proj.weight", (H, q_out), 1, (H, q_out // tp_size))
    if cfg.o_bias:
        add(p + "o_proj.bias", (H,), None, (H,))
    if cfg.qk_norm:
        add(p + "q_norm.weight", (D,), None, (D,))
        add(p + "k_norm.weight", (D,), None, (D,))


def add_latent_attention(plans: list[TensorPlan], cfg: ModelConfig, p: str, tp_size: int) -> None:
    """Latent attention's tensors under prefix p (`self_attn.`): the query's and kv_b_proj's rows
    split by heads, o_proj's columns; the down-projections to the latents and their norms
    replicated. attention_bias gives q_a_proj, kv_a_proj_with_mqa and o_proj a bias."""
    m, H, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    q_out, kv_out, o_in = heads * m.qk_head_dim, heads * (m.qk_nope_head_dim + m.v_head_dim), heads * m.v_head_dim
    down = [("kv_a_proj_with_mqa", m.cache_width)]
    if m.q_lora_rank:
        down.insert(0, ("q_a_proj", m.q_lora_rank))
        plans.append(TensorPlan(p + "q_b_proj.weight", (q_out, m.q_lora_rank), 0, (q_out // tp_size, m.q_lora_rank)))
        plans.append(TensorPlan(p + "q_a_layernorm.weight", (m.q_lora_rank,), None, (m.q_lora_rank,)))
    else:
        plans.append(TensorPlan(p + "q_proj.weight", (q_out, H), 0, (q_out // tp_size, H)))
    for name, out in down:
        plans.append(TensorPlan(p + f"{name}.weight", (out, H), None, (out, H)))
        if cfg.qkv_bias:
            plans.append(TensorPlan(p + f"{name}.bias", (out,), None, (out,)))
    plans.append(TensorPlan(p + "kv_a_layernorm.weight", (m.kv_lora_rank,), None, (m.kv_lora_rank,)))
    plans.append(TensorPlan(p + "kv_b_proj.weight", (kv_out, m.kv_lora_rank), 0,
                            (kv_out // tp_size, m.kv_lora_rank)))
    plans.append(TensorPlan(p + "o_proj.weight", (H, o_in), 1, (H, o_in // tp_size)))
    if cfg.o_bias:
        plans.append(TensorPlan(p + "o_proj.bias", (H,), None, (H,)))


def add_mlp(plans: list[TensorPlan], cfg: ModelConfig, p: str, I: int, tp_size: int) -> None:
    """A dense MLP's tensors under prefix p: gate and up column-parallel, down row-parallel."""
    H = cfg.hidden_size
    for name in ("gate_proj", "up_proj"):
        plans.append(TensorPlan(p + f"{name}.weight", (I, H), 0, (I // tp_size, H)))
        if cfg.mlp_bias:
            plans.append(TensorPlan(p + f"{name}.bias", (I,), 0, (I // tp_size,)))
    plans.append(TensorPlan(p + "down_proj.weight", (H, I), 1, (H, I // tp_size)))
    if cfg.mlp_bias:
        plans.append(TensorPlan(p + "down_proj.bias", (H,), None, (H,)))


def add_experts(plans: list[TensorPlan], cfg: ModelConfig, t0: TPInfo, p: str) -> None:
    """A sparse layer's tensors under prefix p (`mlp.`): router, experts, shared expert and its gate."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    plans.append(TensorPlan(p + "gate.weight", (cfg.num_experts, H), None, (cfg.num_experts, H)))
    if cfg.routing is not None and cfg.routing.bias:
        plans.append(TensorPlan(p + "gate.e_score_correction_bias", (cfg.num_experts,), None, (cfg.num_experts,)))
    first, count, rank_i = t0.experts(cfg)
    dim = None if t0.expert_parallel else 0          # gate/up rows sliced; down's columns (dim 1)
    for e in range(cfg.num_experts):
        held = first <= e < first + count
        for name in ("gate_proj", "up_proj"):
            plans.append(TensorPlan(p + f"experts.{e}.{name}.weight", (I, H), dim, (rank_i if held else 0, H)))
        plans.append(TensorPlan(p + f"experts.{e}.down_proj.weight", (H, I), None if dim is None else 1,
                                (H, rank_i if held else 0)))
    if cfg.shared_expert_size:
        add_mlp(plans, cfg, p + cfg.shared_expert_key + ".", cfg.shared_expert_size, t0.size)
        if cfg.routing is None:          # Qwen2-MoE scales its shared expert by a gate
            plans.append(TensorPlan(p + "shared_expert_gate.weight", (1, H), None, (1, H)))


def bytes_per_rank(cfg: ModelConfig, tp_size: int, dtype_bytes: int = 4, ep: bool = False,
                   experts: bool | None = None, stage: Stage = Stage(), int8: bool = False,
                   int8_experts: bool = False, int4: bool = False, int4_experts: bool = False,
                   bf16: bool = False, int4_scale_bytes: int = 0, pairs: bool = False) -> int:
    """Bytes of the weights one rank (of `stage`) holds; experts True / False: only the experts' /
    all but them. int8: the device holds a quantized checkpoint's int8 weights with a scale per
    row as they are (a byte a weight and 4 a row: the CPU kernels' float32 scales; Ascend's
    quantized matmuls take 2, 4 or 8 bytes a row, sharding.quant.Scheme.int8_kind), the rest in dtype_bytes, as is
    latent attention's kv_b_proj: its weight is absorbed into the query as a whole, not a matmul's.
    int8_experts: so are the experts' int8 weights per channel, weight-only or with int8 inputs per
    token (Ascend's GroupedMatmulV4; the CPU's grouped kernels, worker.cpu.CpuOps.int8_experts).
    int4: so are linear layers' int4 groups (Ascend's WeightQuantBatchMatmul, the CPU's
    CpuInt4Linear: two levels a byte and a scale per group). int4_experts: so are the experts' int4
    groups (GroupedMatmulV4's antiquant form, the CPU's grouped kernel). A group's scale takes
    int4_scale_bytes (the CPU kernels' float32: 4), or dtype_bytes where that is 0.
    bf16: the weights of a bfloat16 checkpoint's linear layers and embedding that are not quantized
    are held in 2 bytes where dtype_bytes is 4 (the CPU kernels' bfloat16 panels or tiles,
    worker.cpu.CpuOps.pack_weight), but for those the device keeps in float32 as loaded: latent
    attention's kv_b_proj and DeepSeek's router (worker.model, `device_order`). pairs: those
    weights and the experts' are held in bfloat16 pairs, whatever the checkpoint's dtype: 4 bytes a
    row per 2 inputs, an odd one padded; the embedding and the LM head so where the hidden size is
    even (the CPU kernels computing the linear layers in bfloat16, worker.cpu.CpuOps.pack_pairs).
    With bf16 at tp 1 and one stage, the LM head also in bfloat16 pairs with a norm a row where
    this CPU's kernels hold them for a float32 job's greedy chains (greedy_head_on)."""
    halved = bf16 and dtype_bytes == 4 and cfg.torch_dtype == "bfloat16"
    total = 0
    for p in plan_tensors(cfg, tp_size, ep, stage):
        expert = ".experts." in p.name
        if experts is not None and expert != experts:
            continue
        n = 1
        for s in p.rank_shape:
            n *= s
        module = p.name[:-len(".weight")] if p.name.endswith(".weight") else None
        held_int8 = (cfg.quant and module and (int8_experts or int4_experts if expert else int8 or int4)
                     and not (cfg.mla is not None and module.endswith(".kv_b_proj")))
        scheme = cfg.quant.scheme_for(module) if held_int8 else None
        kind = scheme.int8_kind if scheme is not None else None
        if ((int4_experts if expert else int4) and scheme is not None and scheme.int4_groups
                and module != "lm_head"):
            out, cols = p.rank_shape
            total += n // 2 + out * (cols // scheme.group_size) * (int4_scale_bytes or dtype_bytes)
        elif (kind in ("weight", "dynamic") and int8_experts if expert else int8 and kind) and module != "lm_head":
            total += n + 4 * p.rank_shape[0] * (n > 0)
        elif (((halved and not expert) or pairs) and module and len(p.rank_shape) == 2
              and not (cfg.quant and cfg.quant.scheme_for(module) is not None)
              and not (cfg.mla is not None and module.endswith(".kv_b_proj"))
              and not (cfg.routing is not None and module.endswith(".mlp.gate"))):
            table = module in ("lm_head", "model.embed_tokens")
            if pairs and not (table and p.rank_shape[1] % 2):
                total += 4 * p.rank_shape[0] * ((p.rank_shape[1] + 1) // 2)
            else:
                total += n * (2 if halved else dtype_bytes)
        else:
            total += n * dtype_bytes
    if (halved and not pairs and tp_size == 1 and stage.first and stage.last and cfg.lm_head and experts is not True
            and greedy_head_on(cfg.vocab_size, cfg.hidden_size)):
        # the LM head again in bfloat16 pairs, and each row's norm (CausalLM.pack_greedy_head)
        total += cfg.vocab_size * (4 * ((cfg.hidden_size + 1) // 2) + 4)
    return total
