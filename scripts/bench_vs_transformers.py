"""A whole batch job, side by side: `msinfer run` at tensor parallel 1 against transformers'
batched `generate`, on the same prompts, the same machine and the same number of threads.

The workload is the one of issue 7: the demo model (SmolLM2-135M-Instruct) in float32, 64 prompts
of varied length (token windows of a fixed text, lengths drawn uniformly from [--min-len,
--max-len] with a fixed seed), 64 new tokens each, greedy, end of sequence ignored so both sides
make exactly the same number of tokens.

- msinfer: a real job (spec, embedded Ray, one worker, results file). Its figure is completion
  tokens / `generation_s` from the job summary: that time includes compiling every graph shape the
  job meets, and excludes start-up (Ray, worker, weights), which is reported apart with the time
  to the first result.
- transformers: `model.generate` over the prompts, left-padded, in batches of each size given by
  --hf-batch (64 = all prompts in one call). Its figure is new tokens / total generate time.
  Loading the model is not counted.

The sides run in turn, msinfer first; with --rounds N they alternate N times, so that both meet
the same machine load, and every round is printed with each side's median round.

    python scripts/bench_vs_transformers.py [--prompts 64] [--new-tokens 64] [--hf-batch 64,16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = """\
The history of astronomy is a long story of people looking up at the night sky and trying to
explain what they saw. Early farmers tracked the seasons by the rising of certain stars, sailors
found their way across open water by the pole star, and priests kept calendars that predicted
eclipses. Greek thinkers asked why the planets wander against the fixed stars, and built models of
nested spheres to answer. Much later, telescopes showed moons circling Jupiter and phases of Venus,
and the sun took its place at the centre of the system. Kepler found that the planets move on
ellipses, sweeping equal areas in equal times, and Newton showed that one law of gravity explains
both a falling apple and the orbit of the moon. In the nineteenth century, spectroscopes split
starlight into colours and revealed which elements the stars are made of, and photography let
astronomers record faint objects that no eye could see. The twentieth century brought the
discovery that the spiral nebulae are galaxies like our own, that the universe is expanding, and
that it began in a hot, dense state some fourteen billion years ago. Radio telescopes found
pulsars and the faint glow left over from the early universe; space telescopes, above the blurring
air, photographed galaxies whose light set out before the earth was formed. Today astronomers
measure the wobble of stars to find planets around them, listen for ripples in space-time from
colliding black holes, and map the positions of a billion stars in our galaxy. Each answer has
raised new questions: what the dark matter is that holds galaxies together, why the expansion of
the universe is speeding up, and whether life has begun anywhere else among the stars.
"""


def make_prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """n token-id prompts of lengths uniform in [lo, hi], windows of TEXT (repeated as needed)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    base = tokenizer(TEXT).input_ids
    ids = base * (-(-2 * hi // len(base)))
    prompts = []
    for length in rng.integers(lo, hi + 1, n):
        start = int(rng.integers(0, len(ids) - length))
        prompts.append(ids[start:start + int(length)])
    return prompts


def run_msinfer(path: Path, prompts: list[list[int]], new_tokens: int, max_batch_size: int,
                max_batched_tokens: int, work: Path, overrides: list[str] = ()) -> dict:
    """A real `msinfer run` (the CLI, in a subprocess) over the prompts; returns its summary."""
    inp, out = work / "prompts.jsonl", work / "results.jsonl"
    with open(inp, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"p{i}", "prompt_token_ids": p}) + "\n")
    spec = {
        "model": {"path": str(path), "dtype": "float32", "max_model_len": max(map(len, prompts)) + new_tokens},
        "parallel": {"tensor_parallel": 1, "device": "cpu"},
        "input": {"path": str(inp), "chat_template": False},
        "sampling": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0.0},   # greedy, as generate's
        "scheduler": {"max_batch_size": max_batch_size, "max_batched_tokens": max_batched_tokens},
        "output": {"path": str(out)},
    }
    (work / "job.yaml").write_text(json.dumps(spec))          # JSON is YAML
    cmd = [sys.executable, "-m", "msinfer.launcher.cli", "run", str(work / "job.yaml"), "--overwrite", "--no-progress"]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    summary["wall_s"] = time.perf_counter() - t0
    summary["token_ids"] = {}
    for line in out.read_text().splitlines():
        r = json.loads(line)
        summary["token_ids"][r["id"]] = r.get("output_token_ids")
    return summary


def left_padded(prompts: list[list[int]], batch: int, pad_id: int):
    """The prompts in batches for transformers, left-padded (each row's last position is its
    last token): (index of the batch's first prompt, input_ids, attention_mask) per batch."""
    import torch

    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(map(len, chunk))
        yield (i, torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk]),
               torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk]))


def run_transformers(model, prompts: list[list[int]], new_tokens: int, batch: int,
                     pad_id: int) -> tuple[float, int, dict]:
    """Batched greedy generate, left-padded. Returns (seconds, new tokens, {id: token ids})."""
    import torch

    made, tokens = 0, {}
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, ids, mask in left_padded(prompts, batch, pad_id):
            width = ids.shape[1]
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
            new = out[:, width:]
            made += new.numel()
            for j, row in enumerate(new.tolist()):
                tokens[f"p{i + j}"] = row
    return time.perf_counter() - t0, made, tokens


def workload_args(ap: argparse.ArgumentParser, prompts: int, hf_batch: str, rounds: int) -> None:
    """The options of a side-by-side script (this one, bench_embed_vs_transformers): the
    prompts, each side's threads, transformers' batch sizes, msinfer's scheduler, the rounds."""
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--min-len", type=int, default=16, help="shortest prompt, tokens (default 16)")
    ap.add_argument("--max-len", type=int, default=256, help="longest prompt, tokens (default 256)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each side (default 2)")
    ap.add_argument("--hf-batch", default=hf_batch,
                    help=f"transformers batch sizes, comma separated (default {hf_batch})")
    ap.add_argument("--max-batch-size", type=int, default=64, help="msinfer scheduler.max_batch_size (default 64)")
    ap.add_argument("--max-batched-tokens", type=int, default=512,
                    help="msinfer scheduler.max_batched_tokens (default 512)")
    ap.add_argument("--rounds", type=int, default=rounds,
                    help="alternate the sides this many times (median reported)")


def demo_workload(args) -> tuple:
    """(the demo model's folder, its tokenizer, the prompts) for workload_args' options, with
    transformers' threads set (before torch is imported: OMP_NUM_THREADS too)."""
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(ROOT))
    from scripts.make_demo_model import ensure_demo_model
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    path = ensure_demo_model()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return path, tokenizer, make_prompts(tokenizer, args.prompts, args.min_len, args.max_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(ap, prompts=64, hf_batch="64,16", rounds=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-transformers", action="store_true", help="only run msinfer")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="passed on to msinfer run, e.g. scheduler.async_scheduling=false")
    args = ap.parse_args()
    path, tokenizer, prompts = demo_workload(args)
    import torch
    import transformers
    hf_batches = [int(b) for b in args.hf_batch.split(",") if b.strip()]
    model = None if args.skip_transformers else \
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    load_before = os.getloadavg()[0]

    ms_runs, hf_runs = [], {}
    with tempfile.TemporaryDirectory(prefix="msinfer-vs-hf-") as work:
        for _ in range(args.rounds):
            ms_runs.append(run_msinfer(path, prompts, args.new_tokens, args.max_batch_size, args.max_batched_tokens,
                                       Path(work), args.set))
            for b in ([] if model is None else hf_batches):
                hf_runs.setdefault(b, []).append(run_transformers(model, prompts, args.new_tokens, b, pad_id))
    ms_best = median_run(ms_runs, lambda s: s["generation_s"])
    hf_best = {b: median_run(runs, lambda r: r[0]) for b, runs in hf_runs.items()}

    import mindspore
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip() or str(os.cpu_count())
    lengths = sorted(map(len, prompts))
    print(f"\nworkload  {path.name} (float32), {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens "
          f"({sum(lengths)} in all), {args.new_tokens} new tokens each, greedy, eos ignored; median of {args.rounds}")
    print(f"versions  mindspore {mindspore.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, python {sys.version.split()[0]}")
    print(f"machine   nproc {nproc}, threads per side {args.threads}, load average "
          f"{load_before:.2f} before / {os.getloadavg()[0]:.2f} after\n")
    ms_tok = ms_best["completion_tokens"]
    ms_rate = ms_tok / ms_best["generation_s"]
    print(f"msinfer tp 1 (max_batch_size {args.max_batch_size}, max_batched_tokens {args.max_batched_tokens}"
          + "".join(f", {o}" for o in args.set) + ")")
    first = ms_best.get('first_result_s', float('nan'))
    print(f"  start-up {ms_best['startup_s']:.1f} s, first result after {first:.1f} s "
          f"from start, generation {ms_best['generation_s']:.1f} s, whole command {ms_best['wall_s']:.1f} s")
    print(f"  {ms_tok} tokens / generation_s = {ms_rate:.1f} tok/s (rounds: "
          + ", ".join(f"{r['completion_tokens'] / r['generation_s']:.1f}" for r in ms_runs) + ")")
    st = ms_best.get("steps") or {}
    if st:
        print(f"  {st['prefill_steps']} prefill steps {st['prefill_s']:.1f} s, {st['decode_steps']} decode steps "
              f"{st['decode_s']:.1f} s; {st['graphs_compiled']} graphs compiled, first calls {st['compile_s']:.1f} s")
        for key, secs in (st.get("graphs") or {}).items():
            print(f"    {key}: first call {secs:.1f} s")
        for kind in ("prefill", "decode"):
            if st.get(f"{kind}_s"):
                print(f"  {kind}: {st[f'{kind}_model_s']:.1f} s on the device, {st[f'{kind}_worker_s']:.1f} s in "
                      f"the worker's step, {st[f'{kind}_s']:.1f} s as the controller saw them: "
                      f"{1 - st[f'{kind}_model_s'] / st[f'{kind}_s']:.0%} outside it")
    for b, (secs, made, tokens) in sorted(hf_best.items()):
        same = sum(tokens[k] == ms_best["token_ids"].get(k) for k in tokens)
        print(f"transformers generate, batch {b}: {made} tokens in {secs:.1f} s = {made / secs:.1f} tok/s (rounds: "
              + ", ".join(f"{m / t:.1f}" for t, m, _ in hf_runs[b]) + f"); msinfer is {ms_rate / (made / secs):.2f}x; "
              f"same tokens for {same}/{len(tokens)} prompts")


def median_run(runs: list, seconds):
    """The run whose time is the median (the lower middle one of an even count)."""
    return sorted(runs, key=seconds)[(len(runs) - 1) // 2]


if __name__ == "__main__":
    main()
