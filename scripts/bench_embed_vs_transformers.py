"""An embedding job, side by side: `msinfer run` with task embed at tensor parallel 1 against
transformers' AutoModel forward in batches, on the same prompts, machine and thread count.

The workload: the demo model (SmolLM2-135M-Instruct) in float32, --prompts token windows of a
fixed text (lengths uniform in [--min-len, --max-len], fixed seed: bench_vs_transformers'
prompts), last-token pooling, L2-normalized (msinfer's default for a checkpoint without
sentence-transformers files).

- msinfer: a real job (spec, embedded Ray, one worker, results file); its figure is prompt
  tokens / `generation_s` of the job summary (compiles included, start-up excluded, which is
  printed apart).
- transformers: `AutoModel` over the prompts, left-padded (so each row's last position is its last
  token), in batches of each size given by --hf-batch; its figure is prompt tokens (padding not
  counted) / the forwards' time. Loading the model is not counted.

The sides alternate --rounds times; every round is printed, with each side's median round and
the largest difference between the two sides' vectors.

    python scripts/bench_embed_vs_transformers.py [--prompts 256] [--hf-batch 32,8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_msinfer(path: Path, prompts: list[list[int]], max_batch_size: int, max_batched_tokens: int,
                work: Path) -> dict:
    """A real `msinfer run` with task embed (the CLI, in a subprocess); returns its summary, with
    the vectors by id."""
    inp, out = work / "prompts.jsonl", work / "results.jsonl"
    with open(inp, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"p{i}", "prompt_token_ids": p}) + "\n")
    spec = {"task": "embed",
            "model": {"path": str(path), "dtype": "float32", "max_model_len": max(map(len, prompts)) + 1},
            "parallel": {"tensor_parallel": 1, "device": "cpu"}, "input": {"path": str(inp)},
            "scheduler": {"max_batch_size": max_batch_size, "max_batched_tokens": max_batched_tokens},
            "output": {"path": str(out)}}
    (work / "job.yaml").write_text(json.dumps(spec))          # JSON is YAML
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "msinfer.launcher.cli", "run", str(work / "job.yaml"), "--overwrite",
                    "--no-progress"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    summary["wall_s"] = time.perf_counter() - t0
    summary["vectors"] = {r["id"]: r["embedding"] for r in map(json.loads, out.read_text().splitlines())}
    return summary


def run_transformers(model, prompts: list[list[int]], batch: int, pad_id: int) -> tuple[float, dict]:
    """Left-padded forwards, last-token pooling, normalized. Returns (seconds, {id: vector})."""
    import torch
    from scripts.bench_vs_transformers import left_padded

    vectors = {}
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, ids, mask in left_padded(prompts, batch, pad_id):
            last = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
            for j, row in enumerate(torch.nn.functional.normalize(last, dim=-1).tolist()):
                vectors[f"p{i + j}"] = row
    return time.perf_counter() - t0, vectors


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from scripts.bench_vs_transformers import demo_workload, median_run, workload_args
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(ap, prompts=256, hf_batch="32,8", rounds=3)
    args = ap.parse_args()
    path, tokenizer, prompts = demo_workload(args)
    import numpy as np
    import torch
    import transformers
    tokens = sum(map(len, prompts))
    batches = [int(b) for b in args.hf_batch.split(",") if b.strip()]
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    ms_runs, hf_runs = [], {}
    with tempfile.TemporaryDirectory(prefix="msinfer-embed-vs-hf-") as work:
        for _ in range(args.rounds):
            ms_runs.append(run_msinfer(path, prompts, args.max_batch_size, args.max_batched_tokens, Path(work)))
            for b in batches:
                hf_runs.setdefault(b, []).append(run_transformers(model, prompts, b, pad_id))
    ms = median_run(ms_runs, lambda s: s["generation_s"])
    rate = tokens / ms["generation_s"]
    lengths = sorted(map(len, prompts))
    print(f"\nworkload  {path.name} (float32), {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens "
          f"({tokens} in all), last-token pooling, normalized; median of {args.rounds}")
    print(f"versions  torch {torch.__version__}, transformers {transformers.__version__}; threads per side "
          f"{args.threads}\n")
    print(f"msinfer tp 1 (max_batch_size {args.max_batch_size}, max_batched_tokens {args.max_batched_tokens}): "
          f"start-up {ms['startup_s']:.1f} s, generation {ms['generation_s']:.2f} s, whole command "
          f"{ms['wall_s']:.1f} s")
    print(f"  {rate:.0f} prompt tok/s, {len(prompts) / ms['generation_s']:.1f} records/s (rounds: "
          + ", ".join(f"{tokens / r['generation_s']:.0f}" for r in ms_runs) + " tok/s)")
    for b, runs in sorted(hf_runs.items()):
        secs, vectors = median_run(runs, lambda r: r[0])
        diff = max(float(np.abs(np.array(v) - np.array(ms["vectors"][k])).max()) for k, v in vectors.items())
        print(f"transformers AutoModel, batch {b}: {tokens / secs:.0f} prompt tok/s (rounds: "
              + ", ".join(f"{tokens / t:.0f}" for t, _ in runs) + f"); msinfer is {rate / (tokens / secs):.2f}x; "
              f"largest difference between the vectors {diff:.1e}")


if __name__ == "__main__":
    main()
