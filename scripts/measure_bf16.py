"""The linear layers of a demo-model step (30 layers of qkv 960 x 576, o_proj 576 x 576, gate/up
2 x 1536 x 576 with its activation, down_proj 576 x 1536, each layer's weights distinct; each
kind's 30 weights in one stack, as the workers' DecoderStack holds them, in 2 MB pages, or in 4 KB
pages with --small-pages) at M rows, through the kernel library's Linear and LinearGlu entry
points (ctypes, no MindSpore graph), three ways in turn: bfloat16 panels with float32 FMAs (what a
float32 job runs on a bfloat16 checkpoint), bfloat16 pairs with VDPBF16PS (`model.dtype:
bfloat16`, where the CPU has AVX512-BF16), and bfloat16 pairs with FMAs (the same bits without
it). Prints ms and GFLOP/s per round, the median of `--repeats` passes each. With --in-cache the
30 layers are one layer's weights called 30 times (7.1 MB, in L3), against which the
weights' stream from memory is measured. With --by-kind each way runs both, from memory and in
cache, their passes alternating within the round (the machine's phase moves a separate run's
figures by more than the stream costs), and each kind of layer is timed by itself: its ms,
GFLOP/s, and its time from memory over its time in cache, what the stream costs it.

    python scripts/measure_bf16.py [--rows 16] [--rounds 3] [--repeats 5] [--threads 0] [--small-pages]
                                   [--in-cache | --by-kind]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msinfer.worker import cpu  # noqa: E402
from msinfer.sharding.layers import MADV_NOHUGEPAGE, advise_pages, huge_pages  # noqa: E402
from msinfer.worker.cpu import CpuOps, bfloat16_bits, load_kernels, set_bf16_dot  # noqa: E402

LAYER = [(960, 576, False), (576, 576, False), (3072, 576, True), (576, 1536, False)]   # (N, K, glu)


class Call:
    """One AOT call of `fn` (the custom operators' signature) over numpy arrays it keeps alive,
    each named by its numpy dtype or by `dtypes` (MindSpore's names: "bfloat16" for uint16 bits)."""

    def __init__(self, fn, *arrays: np.ndarray, dtypes: list[str] | None = None):
        self.fn, self.arrays = fn, arrays
        n = len(arrays)
        self.params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
        self.ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
        self.dims = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
        self.shapes = (ctypes.POINTER(ctypes.c_int64) * n)(
            *[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in self.dims])
        names = dtypes if dtypes is not None else [str(a.dtype) for a in arrays]
        self.dtypes = (ctypes.c_char_p * n)(*[d.encode() for d in names])

    def code(self) -> int:
        """The kernel's return value (0: done)."""
        return self.fn(len(self.arrays), self.params, self.ndims, self.shapes, self.dtypes, None, None)

    def __call__(self) -> None:
        if self.code():
            raise RuntimeError("the kernel refused its arguments")


def timed(calls, repeats: int) -> float:
    """Seconds of one pass over `calls`, the median of `repeats` passes."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for call in calls:
            call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_kinds(sets: list[list], repeats: int) -> list[list[float]]:
    """Seconds of each kind of layer (a call's index mod len(LAYER)) in one pass over each set of
    calls, the median of `repeats` passes; the sets' passes alternate."""
    times = [[[] for _ in LAYER] for _ in sets]
    for _ in range(repeats):
        for at, calls in enumerate(sets):
            sums = [0.0] * len(LAYER)
            for i, call in enumerate(calls):
                t0 = time.perf_counter()
                call()
                sums[i % len(LAYER)] += time.perf_counter() - t0
            for k, t in enumerate(sums):
                times[at][k].append(t)
    return [[statistics.median(t) for t in kinds] for kinds in times]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="the kernels' threads (0: every core)")
    ap.add_argument("--in-cache", action="store_true", help="one layer's weights for all 30 layers")
    ap.add_argument("--small-pages", action="store_true",
                    help="the weight stacks in 4 KB pages (default: 2 MB pages, as the workers hold them)")
    ap.add_argument("--by-kind", action="store_true",
                    help="each kind of layer timed by itself, from memory and in cache in alternating passes")
    args = ap.parse_args()
    if args.in_cache and args.by_kind:
        ap.error("--by-kind runs the weights in cache too: give it without --in-cache")
    load_kernels(args.threads)
    lib = ctypes.CDLL(cpu._LIBRARY)
    dot = CpuOps.bf16_dot
    rng = np.random.default_rng(0)
    M = args.rows
    packed = {"panels": [[] for _ in LAYER], "pairs": [[] for _ in LAYER]}
    # one x for each K and one output for each kind, which every layer takes: they stay in cache,
    # as a step's do (the kernel before wrote x), where 120 arrays of their own came from memory
    inputs = {K: rng.standard_normal((M, K)).astype(np.float32) for _, K, _ in LAYER}
    for _ in range(30):
        for kind, (N, K, glu) in enumerate(LAYER):
            w = (bfloat16_bits((rng.standard_normal((N, K)) * 0.05).astype(np.float32)).astype(np.uint32) << 16)
            w = w.view(np.float32)
            bits = bfloat16_bits(w)
            packed["panels"][kind].append(CpuOps.pack_glu(bits) if glu else CpuOps.pack(bits))
            packed["pairs"][kind].append(CpuOps.pack_pairs(w, glu)[0])
    # each kind's 30 weights in one stack, as DecoderStack holds them (CausalLM.stack_weights):
    # advised into 2 MB pages before they are written, as the workers do, or with --small-pages
    # advised against them (numpy advises its own arrays of 4 MB and more into them)
    for kinds in packed.values():
        for kind, layers in enumerate(kinds):
            stack = np.empty((30, *layers[0].shape), layers[0].dtype)
            if not (advise_pages(stack, MADV_NOHUGEPAGE, 4096) if args.small_pages else huge_pages(stack)):
                sys.exit("measure_bf16: Linux refused the advice on the weights' pages")
            stack[...] = layers
            kinds[kind] = list(stack)
    outputs = {kind: np.zeros((M, N // 2 if glu else N), np.float32) for kind, (N, _, glu) in enumerate(LAYER)}
    panels, pairs = [], []
    for layer in range(30):
        for kind, (N, K, glu) in enumerate(LAYER):
            fn = lib.LinearGlu if glu else lib.Linear
            panels.append(Call(fn, inputs[K], packed["panels"][kind][layer], outputs[kind]))
            pairs.append(Call(fn, inputs[K], packed["pairs"][kind][layer], outputs[kind]))
    if args.in_cache:
        panels, pairs = panels[:len(LAYER)] * 30, pairs[:len(LAYER)] * 30
    flops = 2 * M * sum(N * K for N, K, _ in LAYER) * 30
    kind_flops = [2 * M * N * K * 30 for N, K, _ in LAYER]
    names = ["qkv", "o", "gate/up", "down"]

    where = "from memory and in cache" if args.by_kind else "in cache" if args.in_cache else "from memory"
    print(f"{M} rows, AVX512-BF16 {'yes' if dot else 'no'}, weights {where}")
    for r in range(args.rounds):
        ways = [("bfloat16 panels, float32 FMAs", None, panels), ("bfloat16 pairs, VDPBF16PS", True, pairs),
                ("bfloat16 pairs, FMAs", False, pairs)]
        parts = []
        for name, on, calls in ways:
            if on is True and not dot:
                continue
            if on is not None:
                set_bf16_dot(on)
            if args.by_kind:
                memory, cache = timed_kinds([calls, calls[:len(LAYER)] * 30], args.repeats)
                kinds = ", ".join(f"{n} {m * 1e3:.2f} ms ({f / m / 1e9:.0f} GFLOP/s) against {c * 1e3:.2f} "
                                  f"({f / c / 1e9:.0f}): {m / c:.2f}x"
                                  for n, m, c, f in zip(names, memory, cache, kind_flops))
                parts.append(f"{name}, from memory against in cache: {kinds}; all {sum(memory) * 1e3:.2f} ms "
                             f"against {sum(cache) * 1e3:.2f}: {sum(memory) / sum(cache):.2f}x")
                continue
            s = timed(calls, args.repeats)
            parts.append(f"{name} {s * 1e3:.2f} ms ({flops / s / 1e9:.0f} GFLOP/s)")
        set_bf16_dot(dot)
        print(f"round {r + 1}:" + ("\n  " if args.by_kind else " ") + ("\n  " if args.by_kind else "; ").join(parts))


if __name__ == "__main__":
    main()
