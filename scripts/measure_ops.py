"""Portable MindSpore operators (`model.ops: portable`, dynamic shapes) against the CPU kernels
(`model.ops: auto` on the CPU, power-of-two buckets), in one process on the same model: decode
steps at batch 1, 16 and 64 and a 512-token prefill, the two sides alternating round by round;
and each side's compile seconds per step kind.

    python scripts/measure_ops.py [--model DIR] [--rounds 3] [--steps 5]
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

from worker.protocol import SeqStep  # noqa: E402
from worker.runner import EngineConfig, ModelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache/msinfer/SmolLM2-135M-Instruct"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    import mindspore as ms
    ms.set_device("CPU")
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


if __name__ == "__main__":
    main()
