"""The device seam: the handful of per-device operators the network uses, chosen once per worker.

`CpuOps` (runs here, and anywhere) composes portable MindSpore primitives:
    rms_norm      x * rsqrt(mean(x^2) + eps) * w, in float32
    rotary        q*cos + rotate_half(q)*sin (the Hugging Face, non-interleaved layout)
    cache write   ScatterUpdate of the new K/V rows into the flat cache ([slots * kv_heads, D])
    attention     gather the context rows of each sequence from the cache, head-major, masked
                  softmax(QK^T)V, grouped so K/V heads are never copied per query head
`AscendOps` swaps in MindSpore's fused Ascend kernels where they exist (RmsNorm and
FlashAttentionScore); it needs an Ascend card and is not exercised on the CPU.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import ops

NEG_INF = -1e30
_BMM_T = ops.BatchMatMul(transpose_b=True)


class CpuOps:
    name = "cpu"

    # MindSpore's CPU kernel for an elementwise op between tensors of different shapes builds an
    # index table per output element when it first runs a shape (seconds, and ~19 MB a kernel at
    # 2048 x 576, kept for the graph's life). Every operand is therefore broadcast explicitly,
    # which costs one copy, and the elementwise ops all see equal shapes.

    @staticmethod
    def rms_norm(x, weight, eps):
        x32 = x.astype(ms.float32)
        var = ops.mean(x32 * x32, -1, keep_dims=True)
        y = (x32 * ops.broadcast_to(ops.rsqrt(var + eps), x32.shape)).astype(x.dtype)
        return y * ops.broadcast_to(weight, y.shape)

    @staticmethod
    def rotary(x, cos, sin):
        """x [N, heads, D]; cos/sin [N, heads, D/2] (broadcast once per step, see `rope_tables`)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return ops.concat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    @staticmethod
    def rope_tables(cos, sin, heads):
        """cos/sin [N, D/2] -> [N, heads, D/2], as `rotary` takes them."""
        shape = (cos.shape[0], heads, cos.shape[1])
        return ops.broadcast_to(cos.expand_dims(1), shape), ops.broadcast_to(sin.expand_dims(1), shape)

    @staticmethod
    def cache_index(slots, context_index, kv_heads):
        """The cache is [slots * kv_heads, D], head-minor. Returns the rows a step writes, [N, KV],
        and the rows its attention reads, [KV, B, L]: head-major, so the gathered K/V come out in
        the layout the batched matmuls take, with no transpose."""
        N, (B, L) = slots.shape[0], context_index.shape
        heads = ops.arange(kv_heads, dtype=ms.int32)
        write = ops.broadcast_to(slots.reshape(N, 1) * kv_heads, (N, kv_heads)) + \
            ops.broadcast_to(heads.reshape(1, kv_heads), (N, kv_heads))
        read = ops.broadcast_to(context_index.reshape(1, B, L) * kv_heads, (kv_heads, B, L)) + \
            ops.broadcast_to(heads.reshape(kv_heads, 1, 1), (kv_heads, B, L))
        return write, read

    @staticmethod
    def write_cache(cache, index, rows):
        """cache [slots*KV, D] (a Parameter, updated in place); index [N, KV]; rows [N, KV, D]."""
        return ops.scatter_update(cache, index, rows)

    @staticmethod
    def attention_bias(query_pos, query_seq, key_pos, key_seq, kv_heads, group, dtype):
        """Additive mask [KV, B, group*T, L], built once per step and shared by every layer: a key
        is visible to a query iff both belong to the same sequence and the key's position is not
        after the query's (causal)."""
        (B, T), L = query_pos.shape, key_pos.shape[1]

        def rows(x):
            return ops.broadcast_to(x.reshape(B, T, 1), (B, T, L))

        def cols(x):
            return ops.broadcast_to(x.reshape(B, 1, L), (B, T, L))

        allowed = ops.logical_and(cols(key_seq) == rows(query_seq), cols(key_pos) <= rows(query_pos))
        bias = ops.select(allowed, ops.zeros_like(allowed, dtype=dtype), ops.full_like(allowed, NEG_INF, dtype=dtype))
        return ops.broadcast_to(bias.reshape(1, B, 1, T, L), (kv_heads, B, group, T, L)).reshape(
            kv_heads, B, group * T, L)

    @staticmethod
    def attention(q, k_cache, v_cache, read_index, bias, scale):
        """q [B, T, H, D]; read_index [KV, B, L] cache rows of each sequence's first L positions per
        KV head (from `cache_index`); bias from `attention_bias`. Query heads are grouped by KV
        head, so K/V are never copied per query head. Returns [B, T, H*D]."""
        B, T, H, D = q.shape
        KV = read_index.shape[0]
        G = H // KV
        k = ops.gather(k_cache, read_index, 0)                            # [KV, B, L, D]
        v = ops.gather(v_cache, read_index, 0)
        qg = (q * scale).reshape(B, T, KV, G, D).transpose(2, 0, 3, 1, 4).reshape(KV, B, G * T, D)
        scores = _BMM_T(qg, k)                                            # [KV, B, G*T, L]
        probs = ops.softmax((scores + bias).astype(ms.float32), -1).astype(q.dtype)
        out = ops.matmul(probs, v)                                        # [KV, B, G*T, D]
        return out.reshape(KV, B, G, T, D).transpose(1, 3, 0, 2, 4).reshape(B, T, H * D)


class AscendOps(CpuOps):
    """Fused Ascend kernels (MindSpore's LLM inference tutorial). Not runnable on the CPU."""
    name = "ascend"

    @staticmethod
    def rms_norm(x, weight, eps):
        return ops.rms_norm(x, weight, eps)[0]


def select_ops(device: str):
    return AscendOps if device == "ascend" else CpuOps
