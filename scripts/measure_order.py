"""The dealing order (input.order) on a skewed workload, measured with `msinfer simulate`: stand-in
workers that take --step-ms a step, so a job's time is its steps and what the driver and the
engines cost. The workload: --records records of the demo model's vocabulary, --long-share of
them generating --long-factor times the others' --short-tokens; the long records placed at random
(seeded), or all at the end (--long-last: the case a job that reads a file sorted by some key
meets). The two orders alternate, round by round, in one run.

Besides each run's generation seconds (startup excluded), it prints the bound no dealing order
beats: each replica's steps are at least its share of the token-steps (every record's
max_new_tokens, max_batch_size sequences a step) and at least the longest record's; prefill steps
come on top of it in every order alike.

    python scripts/measure_order.py [--rounds 3] [--records 400] [--dp 4] [--batch 16] [--step-ms 20]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def workload(args) -> list[dict]:
    rng = random.Random(args.seed)
    n_long = round(args.records * args.long_share)
    lengths = [args.short_tokens] * (args.records - n_long) + [args.short_tokens * args.long_factor] * n_long
    if not args.long_last:
        rng.shuffle(lengths)
    return [{"id": f"r{i:05d}", "prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)],
             "sampling": {"max_new_tokens": m}} for i, m in enumerate(lengths)]


def simulate(spec: Path, order: str, args) -> float:
    cmd = [sys.executable, "-m", "msinfer.launcher.cli", "simulate", str(spec), "--overwrite", "--no-progress",
           "--step-ms", str(args.step_ms), "--set", f"input.order={order}"]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GLOG_v": "3"})
    if p.returncode != 0:
        sys.exit(f"msinfer simulate failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["generation_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--long-share", type=float, default=0.05)
    ap.add_argument("--long-factor", type=int, default=8)
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--long-last", action="store_true")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=str(Path.home() / ".cache/msinfer/SmolLM2-135M-Instruct"))
    args = ap.parse_args()

    records = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        spec = tmp / "job.yaml"
        spec.write_text(json.dumps({
            "model": {"path": args.model, "max_model_len": 1024},
            "parallel": {"data_parallel": args.dp, "device": "cpu"},
            "input": {"path": str(tmp / "in.jsonl"), "chat_template": False},
            "output": {"path": str(tmp / "out.jsonl")},
            "sampling": {"ignore_eos": True},
            "scheduler": {"max_batch_size": args.batch, "prefix_caching": False}}))
        times: dict[str, list[float]] = {"arrival": [], "longest_first": []}
        for r in range(args.rounds):
            sides = ("arrival", "longest_first") if r % 2 == 0 else ("longest_first", "arrival")
            for order in sides:
                times[order].append(simulate(spec, order, args))
                print(f"round {r + 1}: {order:13s} {times[order][-1]:.2f} s", flush=True)

    lengths = [r["sampling"]["max_new_tokens"] for r in records]
    steps = max(sum(lengths) / (args.batch * args.dp), max(lengths))
    print(f"\n{args.records} records, {sum(m > args.short_tokens for m in lengths)} of them {args.long_factor}x "
          f"longer ({'at the end' if args.long_last else 'placed at random'}); dp {args.dp}, batch {args.batch}, "
          f"{args.step_ms:g} ms a step")
    print(f"bound: {steps:.0f} decode steps a replica = {steps * args.step_ms / 1000:.2f} s")
    for order, xs in times.items():
        print(f"{order:13s} median {statistics.median(xs):.2f} s  (rounds: {', '.join(f'{x:.2f}' for x in xs)})")


if __name__ == "__main__":
    main()
