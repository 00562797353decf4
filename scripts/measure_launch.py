"""What MindSpore's launch of one CPU kernel costs inside a compiled graph: a graph of one
`RmsNorm` kernel call (worker/csrc) and one of N chained calls, on the same rows, run as a decode
step runs them (graph mode, jit level O0, graph pipeline off, the kernels' two threads). The two
graphs alternate round by round; each round is the median call over --seconds. The difference
over N - 1 calls is the cost of one call: its launch plus the norm itself (a 16 x 576 norm is
about a microsecond of it).

    python scripts/measure_launch.py [--calls 210] [--rows 16] [--rounds 3] [--seconds 4]
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
os.environ.setdefault("MS_DEV_RUNTIME_CONF", "graph_pipeline:False")     # as the workers run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=210, help="chained kernel calls in the long graph (a decode "
                                                          "step of the demo model holds ~220)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()

    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn
    from msinfer.worker import cpu

    ms.set_device("CPU")
    cpu.load_kernels(2)

    class Chain(nn.Cell):
        def __init__(self, calls: int):
            super().__init__()
            self.calls = calls
            self.norm = cpu.CpuRmsNorm(1e-5)
            self.w = ms.Parameter(Tensor(np.ones(576, np.float32)), name="w")

        def construct(self, x):
            for _ in range(self.calls):
                x = self.norm(x, self.w)
            return x

    x = Tensor(np.random.default_rng(0).random((args.rows, 576), np.float32))
    graphs = {n: ms.jit(Chain(n).construct, jit_level="O0") for n in (1, args.calls)}
    for f in graphs.values():
        for _ in range(3):
            f(x).asnumpy()

    def timed(f) -> float:
        ts, end = [], time.time() + args.seconds
        while time.time() < end:
            t0 = time.perf_counter()
            f(x).asnumpy()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    per_call = []
    for r in range(args.rounds):
        one, many = timed(graphs[1]), timed(graphs[args.calls])
        per_call.append((many - one) / (args.calls - 1) * 1e3)
        print(f"round {r + 1}: 1 call {one:.3f} ms, {args.calls} calls {many:.3f} ms: {per_call[-1]:.2f} us a call",
              flush=True)
    print(f"median: {statistics.median(per_call):.2f} us a call")


if __name__ == "__main__":
    main()
