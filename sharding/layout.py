"""The tensor-parallel layout: which checkpoint tensor splits on which dimension, and what each rank holds.

Computed in the launcher before any worker starts (no MindSpore here), and used by the parallel
layers in `sharding.layers` to slice each tensor as it streams from disk.

    column-parallel   W [out, in] split on dim 0 (q/k/v, gate/up, vocab rows of embedding / lm_head)
    row-parallel      W [out, in] split on dim 1 (o_proj, down_proj), output all-reduced
    replicated        norms, and K/V heads when tp_size exceeds num_kv_heads
"""

from __future__ import annotations

from dataclasses import dataclass

from sharding.config import ModelConfig


class LayoutError(ValueError):
    """A tensor-parallel size that the model's shapes cannot take."""


@dataclass(frozen=True)
class TPInfo:
    """This rank's place in its tensor-parallel group; set once per worker."""
    rank: int = 0
    size: int = 1


def divisors_problem(cfg: ModelConfig, tp: int) -> list[str]:
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_heads} is not divisible by {tp}")
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} neither divides nor is divisible by {tp}")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by {tp}")
    return problems


def valid_tp_sizes(cfg: ModelConfig, limit: int = 64) -> list[int]:
    return [t for t in range(1, limit + 1) if not divisors_problem(cfg, t)]


def check_tp(cfg: ModelConfig, tp: int) -> None:
    if tp < 1:
        raise LayoutError(f"parallel.tensor_parallel must be >= 1, got {tp}")
    problems = divisors_problem(cfg, tp)
    if problems:
        raise LayoutError(
            f"parallel.tensor_parallel={tp} does not fit {cfg.architecture}: {'; '.join(problems)}. "
            f"Sizes that work: {', '.join(map(str, valid_tp_sizes(cfg)))}")


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


def plan_tensors(cfg: ModelConfig, tp_size: int) -> list[TensorPlan]:
    """Every tensor a rank loads, with its split dim and rank-0 shape (all ranks hold equal sizes)."""
    check_tp(cfg, tp_size)
    t0 = TPInfo(0, tp_size)
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out = cfg.num_heads * D
    kv_lo, kv_hi = kv_head_range(cfg, t0)
    kv_out, kv_rank = cfg.num_kv_heads * D, (kv_hi - kv_lo) * D
    _, _, vocab_rank = vocab_shard(cfg.vocab_size, t0)
    plans = [TensorPlan("model.embed_tokens.weight", (cfg.vocab_size, H), 0, (vocab_rank, H))]

    def add(name, full, dim, rank_shape):
        plans.append(TensorPlan(name, full, dim, rank_shape))

    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        add(p + "self_attn.q_proj.weight", (q_out, H), 0, (q_out // tp_size, H))
        for kv in ("k", "v"):
            add(p + f"self_attn.{kv}_proj.weight", (kv_out, H), 0, (kv_rank, H))
        if cfg.qkv_bias:
            add(p + "self_attn.q_proj.bias", (q_out,), 0, (q_out // tp_size,))
            for kv in ("k", "v"):
                add(p + f"self_attn.{kv}_proj.bias", (kv_out,), 0, (kv_rank,))
        add(p + "self_attn.o_proj.weight", (H, q_out), 1, (H, q_out // tp_size))
        if cfg.o_bias:
            add(p + "self_attn.o_proj.bias", (H,), None, (H,))
        if cfg.qk_norm:
            add(p + "self_attn.q_norm.weight", (D,), None, (D,))
            add(p + "self_attn.k_norm.weight", (D,), None, (D,))
        for name in ("gate_proj", "up_proj"):
            add(p + f"mlp.{name}.weight", (I, H), 0, (I // tp_size, H))
            if cfg.mlp_bias:
                add(p + f"mlp.{name}.bias", (I,), 0, (I // tp_size,))
        add(p + "mlp.down_proj.weight", (H, I), 1, (H, I // tp_size))
        if cfg.mlp_bias:
            add(p + "mlp.down_proj.bias", (H,), None, (H,))
        add(p + "input_layernorm.weight", (H,), None, (H,))
        add(p + "post_attention_layernorm.weight", (H,), None, (H,))
    add("model.norm.weight", (H,), None, (H,))
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", (cfg.vocab_size, H), 0, (vocab_rank, H))
    return plans


def bytes_per_rank(cfg: ModelConfig, tp_size: int, dtype_bytes: int = 4) -> int:
    total = 0
    for p in plan_tensors(cfg, tp_size):
        n = 1
        for s in p.rank_shape:
            n *= s
        total += n * dtype_bytes
    return total
