"""A decode step's attention over the paged KV cache, through the kernel library's PagedAttention
entry point (ctypes, no MindSpore graph): the demo model's 30 layers (9 query heads, 3 KV heads of
64), each its own cache, B sequences at context L whose blocks lie scattered over the cache, as
they do after a job has run a while. A float32 cache and a bfloat16 one (`model.dtype:
bfloat16`) in turn, each round. Prints ms a step (the median of `--repeats` passes), the K and V
bytes the step reads, and the rate they are read at beside this machine's triad bandwidth
(scripts/roofline.py), which a decode step's attention cannot beat: it reads every cached row
of its sequences once.

    python scripts/measure_attention.py [--batch 16] [--context 1024] [--rounds 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msinfer.worker import cpu  # noqa: E402
from msinfer.worker.cpu import bfloat16_bits, load_kernels  # noqa: E402
from scripts.measure_bf16 import Call, timed  # noqa: E402
from scripts.roofline import bandwidth  # noqa: E402

LAYERS, H, KV, D, BS = 30, 9, 3, 64, 16


def layer_calls(lib, B: int, L: int, bf16: bool, rng) -> list[Call]:
    """One PagedAttention call a layer: B decode tokens, each at position L - 1 of its sequence."""
    blocks = -(-L // BS)
    calls = []
    for _ in range(LAYERS):
        order = rng.permutation(B * blocks + 1)[: B * blocks]       # scattered blocks (the last: scratch)
        tables = order.reshape(B, blocks).astype(np.int32)
        slots = (tables[:, (L - 1) // BS] * BS + (L - 1) % BS).astype(np.int32)
        shape = ((B * blocks + 1) * BS * KV, D)
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        if bf16:
            k, v = bfloat16_bits(k), bfloat16_bits(v)
        half = np.ones((B, D // 2), np.float32)
        calls.append(Call(lib.PagedAttention, rng.standard_normal((B, (H + 2 * KV) * D)).astype(np.float32),
                          np.ones(D, np.float32), np.ones(D, np.float32), np.array([1e-6, 0], np.float32),
                          half, 0 * half, k, v, slots, tables, np.arange(B, dtype=np.int32),
                          np.full(B, L, np.int32), np.array([BS, KV], np.int32), np.zeros((B, H * D), np.float32)))
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    load_kernels()
    lib = ctypes.CDLL(cpu._LIBRARY)
    rng = np.random.default_rng(0)
    B, L = args.batch, args.context
    ways = {"float32 cache": (layer_calls(lib, B, L, False, rng), 4),
            "bfloat16 cache": (layer_calls(lib, B, L, True, rng), 2)}
    bw = bandwidth(2)
    print(f"{B} sequences at context {L}, {LAYERS} layers of {H} query heads, {KV} KV heads of {D}; "
          f"triad bandwidth {bw / 1e9:.1f} GB/s")
    for r in range(args.rounds):
        parts = []
        for name, (calls, size) in ways.items():
            s = timed(calls, args.repeats)
            read = LAYERS * B * L * 2 * KV * D * size
            parts.append(f"{name} {s * 1e3:.2f} ms ({read / 2**20:.0f} MiB at {read / s / 1e9:.1f} GB/s, "
                         f"{read / bw * 1e3:.1f} ms at the triad's)")
        print(f"round {r + 1}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
