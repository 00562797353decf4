"""Portable MindSpore operators (`model.ops: portable`, dynamic shapes) against the CPU kernels
(`model.ops: auto` on the CPU, power-of-two buckets), in one process on the same model: decode
steps at batch 1, 16 and 64 and a 512-token prefill, the two sides alternating round by round;
and each side's compile seconds per step kind. With --compile instead: a workload of steps of
many sizes (prefills of 20-600 tokens, decodes of 1-40 sequences) on fresh runners, portable
operators with dynamic shapes and with buckets, and the CPU kernels (buckets): graphs compiled,
their seconds, and the workload's time.

    python scripts/measure_ops.py [--model DIR] [--rounds 3] [--steps 5] [--compile]
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

from msinfer.worker.protocol import SeqStep  # noqa: E402
from msinfer.sharding.config import EngineConfig  # noqa: E402
from msinfer.worker.runner import ModelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache/msinfer/SmolLM2-135M-Instruct"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    import mindspore as ms
    ms.set_device("CPU")
    if args.compile:
        return compiles(args.model)
    ctx = 576
    runners = {side: ModelRunner(EngineConfig(args.model, max_model_len=1024, max_batch_size=64, ops=side))
               for side in ("auto", "portable")}
    blocks = -(-ctx // 16)

    def table(i):
        return list(range(i * blocks, (i + 1) * blocks))

    cases = {f"decode {b}": lambda b=b: ([SeqStep(i, [7], 511, table(i)) for i in range(b)], False)
             for b in (1, 16, 64)}
    cases["prefill 512"] = lambda: ([SeqStep(0, [5 + t % 900 for t in range(512)], 0, table(0))], True)
    times = {(side, c): [] for side in runners for c in cases}
    for side, r in runners.items():                      # compile every graph first
        for make in cases.values():
            r.forward(*make())
        print(f"{side}: compile seconds {', '.join(f'{k} {v:.2f}' for k, v in r.compile_s.items())}", flush=True)
    for rnd in range(args.rounds):
        for side in (("auto", "portable") if rnd % 2 == 0 else ("portable", "auto")):
            for c, make in cases.items():
                seqs, prefill = make()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    runners[side].forward(seqs, prefill)
                times[(side, c)].append((time.perf_counter() - t0) / args.steps * 1e3)
    print("ms per step (rounds; median)")
    for c in cases:
        row = [f"{side} {', '.join(f'{t:.1f}' for t in times[(side, c)])}; {statistics.median(times[(side, c)]):.1f}"
               for side in runners]
        print(f"{c:12s} " + " | ".join(row))


def compiles(model: str) -> None:
    from mindspore.graph import api
    blocks = 40
    steps = [([SeqStep(0, [5 + t % 900 for t in range(n)], 0, list(range(blocks)))], True)
             for n in (20, 70, 150, 300, 600)]
    steps += [([SeqStep(i, [7], 100, list(range(i * blocks, (i + 1) * blocks))) for i in range(b)], False)
              for b in (1, 3, 9, 20, 40)]
    for ops, shapes in (("portable", "dynamic"), ("portable", "buckets"), ("auto", "buckets")):
        before = len(api.ms_compile_cache)
        r = ModelRunner(EngineConfig(model, max_model_len=640, max_batch_size=64, ops=ops, shapes=shapes))
        t0 = time.perf_counter()
        for seqs, prefill in steps:
            r.forward(seqs, prefill)
        total = time.perf_counter() - t0
        print(f"{ops} {shapes}: {len(api.ms_compile_cache) - before} graphs compiled, first calls "
              f"{sum(r.compile_s.values()):.1f} s ({', '.join(f'{k} {v:.2f}' for k, v in r.compile_s.items())}); "
              f"{len(steps)} steps {total:.1f} s", flush=True)


if __name__ == "__main__":
    main()
