"""DeepSeek's latent attention at a prefill with nothing cached, computed both ways, in one process:
decompressed (kv_b_proj expands the step's latents to per-head K and V, and the heads attend
among them: what worker.model.MLAttention does for such a step) and absorbed (kv_b_proj's key part
folded into the queries, every head reading the latents as one KV head: what it does for every
step that reads the cache). One layer of DeepSeek-V3's attention as a rank of tp 8 holds it (16
heads; q_lora 1536, kv_lora 512, rope 64, nope 128, v 128; hidden 7168), MindSpore's portable
operators on the CPU in float32, random weights; the two sides alternate round by round, each
round timing --steps calls of a graph compiled before.

    python scripts/measure_mla.py [--rounds 5] [--steps 3] [--seqs 4] [--tokens 256] [--heads 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_v", "3")

import numpy as np  # noqa: E402

from msinfer.sharding.config import ModelConfig  # noqa: E402
from msinfer.sharding.layout import TPInfo  # noqa: E402

V3 = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
      "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 1,
      "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=4, help="sequences in the step")
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens of each")
    ap.add_argument("--heads", type=int, default=16, help="this rank's heads (DeepSeek-V3: 128 / tp)")
    args = ap.parse_args()
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn
    from msinfer.worker.model import MLAttention
    from msinfer.worker.ops import MsOps
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    cfg = ModelConfig.from_dict({**V3, "num_attention_heads": args.heads}, "measure_mla")
    B, T, bs = args.seqs, args.tokens, 16
    N = B * T
    blocks = B * -(-T // bs)
    rng = np.random.default_rng(0)
    attn = MLAttention(cfg, TPInfo(), ms.float32, MsOps, blocks + 1, bs)
    attn.set_train(False)
    for name, p in attn.parameters_and_names():
        if "cache" not in name:
            p.set_data(Tensor((rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])).astype(np.float32)))

    class Step(nn.Cell):
        def __init__(self, prefill: bool):
            super().__init__()
            self.attn, self.prefill = attn, prefill

        def construct(self, x, cos, sin, slots, tables, token_seq, token_len):
            ctx = (slots, tables, token_len, token_len, token_seq, token_len, token_len)
            return self.attn(x, (cos, sin), (cos, sin), ctx, self.prefill)

    pos = np.tile(np.arange(T), B)
    angles = pos[:, None] * cfg.inv_freq()[None, :]
    per = -(-T // bs)
    tables = np.arange(B * per, dtype=np.int32).reshape(B, per)
    seq = np.repeat(np.arange(B), T).astype(np.int32)
    inputs = [Tensor(rng.standard_normal((N, cfg.hidden_size)).astype(np.float32)),
              Tensor(np.cos(angles).astype(np.float32)), Tensor(np.sin(angles).astype(np.float32)),
              Tensor((tables[seq, pos // bs] * bs + pos % bs).astype(np.int32)), Tensor(tables),
              Tensor(seq), Tensor((pos + 1).astype(np.int32))]
    sides = {"decompressed": Step(True), "absorbed": Step(False)}
    outs = {k: f(*inputs).asnumpy() for k, f in sides.items()}          # compiles; the same result both ways
    diff = float(np.abs(outs["decompressed"] - outs["absorbed"]).max() / np.abs(outs["absorbed"]).max())
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.rounds):
        for k in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                sides[k](*inputs).asnumpy()
            times[k].append((time.perf_counter() - t0) / args.steps * 1000)
    print(f"one layer's latent attention, {args.heads} heads, {B} sequences x {T} prompt tokens, float32, "
          f"portable operators, {os.cpu_count()} cores; relative max difference of the outputs {diff:.1e}")
    for k, ts in times.items():
        print(f"  {k:<13} ms per step: {' '.join(f'{t:.1f}' for t in ts)}   median {statistics.median(ts):.1f}")


if __name__ == "__main__":
    main()
