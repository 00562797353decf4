"""The device seam: the handful of per-device operators the network uses, chosen once per worker.

`CpuOps` (runs here, and anywhere) composes portable MindSpore primitives:
    rms_norm      x * rsqrt(mean(x^2) + eps) * w, in float32
    rotary        q*cos + rotate_half(q)*sin (the Hugging Face, non-interleaved layout)
    cache write   ScatterUpdate of the new K/V rows into the flat slot cache
    attention     gather the context rows of each sequence from the cache, masked softmax(QK^T)V,
                  grouped so K/V heads are never copied per query head
`AscendOps` swaps in MindSpore's fused Ascend kernels where they exist (RmsNorm and
FlashAttentionScore); it needs an Ascend card and is not exercised on the CPU.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import ops

NEG_INF = -1e30


class CpuOps:
    name = "cpu"

    @staticmethod
    def rms_norm(x, weight, eps):
        x32 = x.astype(ms.float32)
        var = ops.mean(x32 * x32, -1, keep_dims=True)
        return (x32 * ops.rsqrt(var + eps)).astype(x.dtype) * weight

    @staticmethod
    def rotary(x, cos, sin):
        """x [N, heads, D]; cos/sin [N, 1, D/2]."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return ops.concat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    @staticmethod
    def write_cache(cache, slots, rows):
        """cache [slots, kv_heads, D] (a Parameter, updated in place); slots [N]; rows [N, kv_heads, D]."""
        return ops.scatter_update(cache, slots, rows)

    @staticmethod
    def attention_bias(query_pos, L, group, dtype):
        """Additive mask [B, 1, group*T, L], built once per step and shared by every layer: key j
        is visible to a query at position p iff j <= p (causal; padding keys lie beyond every p)."""
        B, T = query_pos.shape
        key_pos = ops.arange(L, dtype=ms.int32).reshape(1, 1, L)
        allowed = key_pos <= query_pos.reshape(B, T, 1)                   # [B, T, L]
        bias = ops.select(allowed, ops.zeros_like(allowed, dtype=dtype), ops.full_like(allowed, NEG_INF, dtype=dtype))
        return ops.tile(bias.reshape(B, 1, 1, T, L), (1, 1, group, 1, 1)).reshape(B, 1, group * T, L)

    @staticmethod
    def attention(q, k_cache, v_cache, context_index, bias, scale):
        """q [B, T, H, D]; context_index [B, L] cache rows of each sequence's first L positions;
        bias from `attention_bias`. Query heads are grouped by KV head, so K/V are never copied
        per query head. Returns [B, T, H*D]."""
        B, T, H, D = q.shape
        k = ops.gather(k_cache, context_index, 0)                         # [B, L, KV, D]
        v = ops.gather(v_cache, context_index, 0)
        KV = k.shape[2]
        G = H // KV
        qg = q.reshape(B, T, KV, G, D).transpose(0, 2, 3, 1, 4).reshape(B, KV, G * T, D)
        scores = ops.matmul(qg, k.transpose(0, 2, 3, 1)) * scale          # [B, KV, G*T, L]
        probs = ops.softmax((scores + bias).astype(ms.float32), -1).astype(q.dtype)
        out = ops.matmul(probs, v.transpose(0, 2, 1, 3))                  # [B, KV, G*T, D]
        return out.reshape(B, KV, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, H * D)


class AscendOps(CpuOps):
    """Fused Ascend kernels (MindSpore's LLM inference tutorial). Not runnable on the CPU."""
    name = "ascend"

    @staticmethod
    def rms_norm(x, weight, eps):
        return ops.rms_norm(x, weight, eps)[0]


def select_ops(device: str):
    return AscendOps if device == "ascend" else CpuOps
