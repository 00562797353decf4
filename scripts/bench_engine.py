"""Decode speed of the demo model (SmolLM2-135M-Instruct, float32) in msinfer's engine and in
transformers, side by side on this machine, single sequence and batch 8.

Both sides get the same prompts (32 tokens, equal length so transformers needs no padding), the
same greedy decoding of 64 new tokens and the same number of threads. Every case first runs once
untimed: for the engine that compiles each graph shape (prefill, and decode at each context
bucket), and those first-call times are reported as compile times. Then the cases run in turn,
`--repeats` rounds, and each keeps its fastest run: the machine may be shared, and interleaving
puts both sides under the same load.

Decode tokens/s = tokens made by the decode steps / time of the decode steps; the prefill step
(which makes each sequence's first token) is timed apart. transformers runs a plain loop of
`model(...)` calls over its KV cache rather than `generate`, so neither side pays for extras.
The engine pads a small decode batch up to a bucket that depends on `max_batch_size`, so a single
sequence is measured in a runner sized for batches of 8 and in one sized for it alone.

    python scripts/bench_engine.py [--threads 2] [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LEN = 32
BATCH = 8
TEXT = ("The history of astronomy is a long story of people looking up at the night sky and trying "
        "to explain what they saw. Early farmers tracked the seasons by the rising of certain stars, "
        "sailors found their way across open water by the pole star, and priests kept calendars that "
        "predicted eclipses. Greek thinkers asked why the planets wander against the fixed stars, and "
        "built models of nested spheres to answer. Much later, telescopes showed moons circling "
        "Jupiter and phases of Venus, and the sun took its place at the centre of the system.")


def make_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n different prompts of exactly `length` tokens: windows at different offsets of TEXT."""
    ids = tokenizer(TEXT).input_ids
    step = (len(ids) - length) // max(n - 1, 1)
    if step < 1:
        raise SystemExit(f"bench text has {len(ids)} tokens, too few for {n} prompts of {length}")
    return [ids[i * step: i * step + length] for i in range(n)]


def engine_side(path: Path, new_tokens: int, max_batch_size: int):
    """A runner, and run(prompts) -> (prefill s, decode s, tokens per prompt) on it."""
    from msinfer.worker.protocol import SeqStep
    from msinfer.sharding.config import EngineConfig
    from msinfer.worker.runner import ModelRunner

    max_len = PROMPT_LEN + new_tokens
    runner = ModelRunner(EngineConfig(str(path), dtype="float32", max_model_len=max_len,
                                      max_batch_size=max_batch_size, graph_mode=True))
    blocks = -(-max_len // runner.block_size)

    def run(batch):
        tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(batch))]
        t0 = time.perf_counter()
        out = runner.step([SeqStep(i, p, 0, tables[i]) for i, p in enumerate(batch)], is_prefill=True)
        prefill = time.perf_counter() - t0
        tokens = [[t] for t in out.token_ids]
        t0 = time.perf_counter()
        for step in range(1, new_tokens):
            seqs = [SeqStep(i, [tokens[i][-1]], len(p) + step - 1, tables[i], num_generated=step)
                    for i, p in enumerate(batch)]
            for seq_tokens, t in zip(tokens, runner.step(seqs, is_prefill=False).token_ids):
                seq_tokens.append(t)
        return prefill, time.perf_counter() - t0, tokens

    return runner, run


def torch_side(path: Path, new_tokens: int):
    """The transformers model, its load time, and run(prompts) like the engine's."""
    import torch
    import transformers

    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0

    @torch.no_grad()
    def run(batch):
        t0 = time.perf_counter()
        out = model(torch.tensor(batch), use_cache=True)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        prefill = time.perf_counter() - t0
        tokens = [next_ids]
        t0 = time.perf_counter()
        for _ in range(1, new_tokens):
            out = model(next_ids, past_key_values=out.past_key_values, use_cache=True)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(next_ids)
        return prefill, time.perf_counter() - t0, torch.cat(tokens, 1).tolist()

    return load_s, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each side (default 2)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds; each case keeps its fastest run")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)          # before torch or MindSpore start

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts.make_demo_model import ensure_demo_model
    import mindspore
    import torch
    import transformers

    mindspore.set_device("CPU")
    mindspore.device_context.cpu.op_tuning.threads_num(args.threads)
    torch.set_num_threads(args.threads)
    path = ensure_demo_model()
    prompts = make_prompts(transformers.AutoTokenizer.from_pretrained(path), BATCH, PROMPT_LEN)
    load_before = os.getloadavg()[0]

    batched, run_batched = engine_side(path, args.new_tokens, BATCH)
    alone, run_alone = engine_side(path, args.new_tokens, 1)
    hf_load, run_hf = torch_side(path, args.new_tokens)
    cases = [("msinfer", 1, run_batched), ("msinfer, max_batch_size 1", 1, run_alone), ("transformers", 1, run_hf),
             ("msinfer", BATCH, run_batched), ("transformers", BATCH, run_hf)]
    for _, b, run in cases:                                    # compiles every shape the engine needs
        run(prompts[:b])
    best = [None] * len(cases)
    for _ in range(args.repeats):
        for i, (_, b, run) in enumerate(cases):
            r = run(prompts[:b])
            best[i] = r if best[i] is None or r[1] < best[i][1] else best[i]

    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip() or str(os.cpu_count())
    print(f"\nmodel     {path.name} (float32), prompts of {PROMPT_LEN} tokens, {args.new_tokens} new tokens, "
          f"greedy, best of {args.repeats}")
    print(f"versions  mindspore {mindspore.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, python {sys.version.split()[0]}")
    print(f"machine   nproc {nproc}, threads per side {args.threads}, load average "
          f"{load_before:.2f} before / {os.getloadavg()[0]:.2f} after")
    print(f"load      msinfer {batched.load_s:.1f} s (build + checkpoint), transformers {hf_load:.1f} s\n")
    print("compile (first call of each graph shape, msinfer graph mode)")
    for runner in (batched, alone):
        for key, s in runner.compile_s.items():
            print(f"  {key:<24} max_batch_size {runner.ec.max_batch_size}  {s:6.2f} s")

    steps = args.new_tokens - 1
    reference = {b: r[2] for (name, b, _), r in zip(cases, best) if name == "transformers"}
    print(f"\n{'':27}{'batch':>6}{'prefill ms':>12}{'decode ms/step':>16}{'decode tok/s':>14}"
          f"{'same tokens as transformers':>29}")
    for (name, b, _), (prefill, decode, tokens) in zip(cases, best):
        same = sum(a == c for a, c in zip(tokens, reference[b]))
        print(f"{name:<27}{b:>6}{prefill * 1e3:>12.1f}{decode / steps * 1e3:>16.1f}"
              f"{b * steps / decode:>14.1f}{f'{same}/{b}':>29}")


if __name__ == "__main__":
    main()
