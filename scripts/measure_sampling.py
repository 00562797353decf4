"""Decode step time of the demo model (SmolLM2-135M-Instruct, float32, tp 1, the CPU kernels) at
several batch sizes, greedy and sampled, and how much of the step is spent outside the device.

For each batch size B: B prompts of 32 tokens are prefilled, then `--steps` decode steps run
(untimed warm-up first, which compiles each shape); each decode step's wall time in
ModelRunner.step is recorded, with the part the step reports on the device (StepOutput.model_s:
the network, the sampler, their copies to numpy) and the bytes it copied to the host. One JSON
line per (batch, sampling) with the median step, the median device part and the bytes per step.
"greedy_logprobs" is greedy with `logprobs: 5`; "sampled" is temperature 0.8, top_p 0.95,
top_k 50, a seed per sequence; "temperature" is temperature 0.8 alone (a draw over the whole
vocabulary); "penalized" is "sampled" with repetition_penalty 1.1 and frequency_penalty 0.2
(logits changed before sampling); "json" is "sampled" under a JSON schema (an array of strings,
llguidance), with the median time of one step's masks (mask_ms) filled as the worker fills them.

To compare two versions of msinfer, run this script under each (e.g. PYTHONPATH pointing at a
package tree of the other), alternating, and compare the medians.

    python scripts/measure_sampling.py [--batches 1 16 64] [--steps 24] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

PROMPT_LEN = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per case")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", help="of: greedy greedy_logprobs sampled temperature penalized json")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts.make_demo_model import ensure_demo_model
    import mindspore
    from msinfer.sharding.config import EngineConfig
    from msinfer.worker.protocol import SamplingParams, SeqStep
    from msinfer.worker.runner import ModelRunner

    import llguidance
    import llguidance.numpy
    JSON = llguidance.grammar_from("json", json.dumps({"type": "array", "items": {"type": "string"}}))
    mindspore.set_device("CPU")
    path = ensure_demo_model()
    B = max(args.batches)
    max_len = PROMPT_LEN + 2 * args.steps + 8
    runner = ModelRunner(EngineConfig(str(path), dtype="float32", max_model_len=max_len, max_batch_size=B,
                                      threads=args.threads))
    blocks = -(-max_len // runner.block_size)
    modes = {"greedy": lambda i: SamplingParams(),
             "greedy_logprobs": lambda i: SamplingParams(logprobs=5),
             "sampled": lambda i: SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i),
             "temperature": lambda i: SamplingParams(temperature=0.8, seed=i),
             "penalized": lambda i: SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i,
                                                   repetition_penalty=1.1, frequency_penalty=0.2),
             "json": lambda i: SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i, structured=JSON)}
    modes = {m: modes[m] for m in args.modes or modes}
    for b in args.batches:
        for mode, params in modes.items():
            runner.histories.clear()             # the sequence ids of the case before are used again
            tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(b)]
            prompts = [[(17 * i + 31 * j) % 5000 + 100 for j in range(PROMPT_LEN)] for i in range(b)]
            out = runner.step([SeqStep(i, p, 0, tables[i], params(i), history=(p, []) if params(i).looks_back else None)
                               for i, p in enumerate(prompts)], True)
            last = list(out.token_ids)
            steps, device, copied = [], [], []
            for k in range(2 * args.steps):        # the first half warms up (compiles), the second is timed
                seqs = [SeqStep(i, [last[i]], PROMPT_LEN + k, tables[i], params(i), num_generated=k + 1)
                        for i in range(b)]
                t0 = time.perf_counter()
                out = runner.step(seqs, False)
                if k >= args.steps:
                    steps.append(time.perf_counter() - t0)
                    device.append(out.model_s)
                    copied.append(getattr(out, "host_bytes", None))
                last = out.token_ids
            step_ms, device_ms = 1e3 * statistics.median(steps), 1e3 * statistics.median(device)
            line = {"batch": b, "sampling": mode, "step_ms": round(step_ms, 3), "device_ms": round(device_ms, 3),
                    "outside_ms": round(step_ms - device_ms, 3), "host_bytes_per_step": copied[-1]}
            matchers = [(h.matcher, i) for i, h in runner.histories.items() if h.matcher is not None]
            if matchers:              # the grammars' masks of one step, as ModelRunner.start_masks fills them
                mask = np.full((b, -(-runner.cfg.vocab_size // 32)), -1, np.int32)
                executor, fills = llguidance.LLExecutor(), []
                for _ in range(16):
                    t0 = time.perf_counter()
                    llguidance.numpy.fill_next_token_bitmask_par(executor, matchers, mask)
                    fills.append(time.perf_counter() - t0)
                line["mask_ms"] = round(1e3 * statistics.median(fills), 3)
                line["grammars_in_error"] = sum(m.is_error() for m, _ in matchers)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
