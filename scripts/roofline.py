"""A roofline for the CPU engine: this machine's memory bandwidth and multiply-add peak, each
step kind's bytes and FLOPs for a dense model, the lower bound they set, and the step times
`msinfer bench` measures beside it.

    python scripts/roofline.py [--model DIR] [--dtype float32] [--kv-cache-dtype auto] [--batch-size 1,16,64]
                               [--prompt 32] [--prefill 512] [--decode-steps K] [--rounds 1]

The machine (every core of the process's affinity), before the steps and again after them; the
higher figure of each is the one the bounds use, and a figure that moved by more than 15% is noted.
With --rounds N, the machine's measures and the steps run N times one after the other, each
round's ratio against the machine measured around it; the table shows the medians and each
round's measured ms and ratio below its step (a virtual machine's rates move by more than a
kernel change between runs minutes apart):
    bandwidth  a triad z = x + y in numpy over arrays far larger than the caches, one slice per
               thread (numpy releases the GIL in the loop): bytes read and written / second
    peak       the kernels' PeakFlops (worker/csrc/kernels.cc): 12 independent multiply-adds in
               registers on each of the kernels' threads, float32 FMAs, and VDPBF16PS where the
               CPU has AVX512-BF16: the instruction set's rate, which no matmul exceeds
    beside it  numpy's 2048 x 2048 float32 matmul (its BLAS), and with --dtype bfloat16 the
               kernels' Linear over bfloat16 pairs (worker/csrc/matmul.h linear_pairs), 512 x 576
               rows times a 3072 x 576 weight that stays in cache: what a tuned matmul reaches

A step (one replica, tp 1; B sequences at context L, or a prefill of T tokens with nothing cached):
    bytes      every weight once, at the bytes the kernels hold it in (a bfloat16 checkpoint's
               weights stay bfloat16 in a float32 network: 2; the tied embedding counted once, as
               the LM head's) + the KV cache the step reads (decode: B x L x layers x 2 x kv_heads x
               head_dim x 4 in float32, x 2 with --dtype bfloat16 or --kv-cache-dtype bfloat16, whose cache
               holds bfloat16)
    FLOPs      2 x tokens x the weights' multiply-adds (the LM head on the sampled rows only: B,
               or 1 for a prefill) + attention: 4 x heads x head_dim x layers x the (query, key)
               pairs (decode: B x L; prefill: T (T + 1) / 2)
    bound      max(bytes / bandwidth, FLOPs / float32 peak); with --dtype bfloat16 (the linear
               layers and the LM head in bfloat16, attention in float32) their FLOPs at the
               bfloat16 peak (float32's without AVX512-BF16, as the kernels then take FMAs) and
               attention's at float32's; a float32 decode step of more sequences than
               GreedyHead's panels take (14 on AVX-512) takes its greedy tokens from the LM head
               in bfloat16 pairs where the CPU has AVX512-BF16 (worker/csrc/linear.cc
               greedy_head), so the LM head's FLOPs at the bfloat16 peak
    phases     the linear layers' bound (their weights' bytes, their FLOPs) plus attention's (the
               KV bytes, its FLOPs): the kernels run one after the other, so a step whose layers
               are bound by FLOPs and whose attention by bytes (decode at a long context) cannot
               reach `bound`, and its ratio to this sum says how far it is from what it can reach

The measured figures are `msinfer bench`'s decode_ms_per_step (B prompts of --prompt tokens, 64
new: context L = prompt + 32 on average; the job's scheduler.decode_steps, 4 on the CPU, runs 4
decode steps a call) and prefill_ms (one prompt of T tokens), on the CPU kernels. Dense models only: a mixture of experts' step reads the experts its tokens chose, not
all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT, NEW = 32, 64


def bandwidth(threads: int, mib: int = 256, rounds: int = 5) -> float:
    """Bytes a second of z = x + y (2 reads and a write per element), `threads` slices at once."""
    n = mib * 2**20 // 4
    x, y, z = (np.ones(n, np.float32) for _ in range(3))
    bounds = np.linspace(0, n, threads + 1).astype(int)
    parts = [(x[a:b], y[a:b], z[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(rounds):
            t0 = time.perf_counter()
            list(pool.map(lambda p: np.add(p[0], p[1], out=p[2]), parts))
            best = min(best, time.perf_counter() - t0)
    return 3 * n * 4 / best


def matmul_rate(n: int = 2048, rounds: int = 5) -> float:
    a, b = np.random.default_rng(0).standard_normal((2, n, n), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_rate(kind: int, rounds: int = 5) -> float | None:
    """FLOP/s of the kernels' PeakFlops loop: kind 0 float32 FMAs, 1 VDPBF16PS (None where the
    kernels were built without it)."""
    from msinfer.worker.cpu import load_kernels, peak_flops
    load_kernels()
    fn = peak_flops()
    if fn(kind, 1, 0.5) < 0:
        return None
    best, flops = float("inf"), 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        flops = fn(kind, 2_000_000, 0.5)
        best = min(best, time.perf_counter() - t0)
    return flops / best


def measure_machine(cores: int, bf16: bool) -> tuple[float, float, float | None]:
    """The triad bandwidth (bytes/s, the better of one thread and every core), the float32 FMA
    peak and the VDPBF16PS peak (FLOP/s; None without it, or with `bf16` false), measured now."""
    return (max(bandwidth(t) for t in sorted({1, cores})), peak_rate(0), peak_rate(1) if bf16 else None)


def bfloat16_rate(rows: int = 512, rounds: int = 5) -> float:
    """FLOP/s of the kernels' Linear over bfloat16 pairs, rows x 576 times 3072 x 576 (in cache)."""
    import ctypes
    from msinfer.worker import cpu
    from msinfer.worker.cpu import CpuOps, load_kernels
    from scripts.measure_bf16 import Call
    load_kernels()
    rng = np.random.default_rng(0)
    K, N = 576, 3072
    call = Call(ctypes.CDLL(cpu._LIBRARY).Linear, rng.standard_normal((rows, K)).astype(np.float32),
                CpuOps.pack_pairs(rng.standard_normal((N, K)).astype(np.float32))[0], np.zeros((rows, N), np.float32))
    call()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * K * N / best


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
        model = next(line for line in open("/proc/cpuinfo") if line.startswith("model name")).split(":", 1)[1]
    except (OSError, StopIteration):
        return "unknown CPU"
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    return f"{model.strip()}; {len(os.sched_getaffinity(0))} cores; {' '.join(shown)}"


def weight_bytes(cfg, dtype: str) -> int:
    """Bytes a weight element takes as the CPU kernels hold it: a bfloat16 checkpoint's weights stay
    bfloat16 in a float32 network (worker/cpu.py CpuOps.pack_weight, bfloat16 panels or AMX tiles,
    unless MSINFER_BF16_PANELS=0), and with dtype bfloat16 the linear layers' are bfloat16 pairs
    (CpuOps.pack_pairs), the LM head's and the embedding's too; otherwise float32's 4."""
    if dtype == "bfloat16" or (cfg.torch_dtype == "bfloat16" and os.environ.get("MSINFER_BF16_PANELS", "1") != "0"):
        return 2
    return 4


def step_cost(cfg, dtype_bytes: int, tokens: int, pairs: int, kv_read: int, sampled: int,
              w_bytes: int | None = None) -> tuple[float, float, float, float, float]:
    """(weight bytes, KV bytes, FLOPs of the linear layers, of the LM head, attention's FLOPs) of
    one step: every weight once (w_bytes each, default dtype_bytes), `kv_read` cached tokens' K
    and V (dtype_bytes a value), `tokens` rows through the layers, `sampled` through the LM head,
    `pairs` (query, key) pairs attended."""
    from msinfer.sharding.layout import plan_tensors
    layer_macs = sum(int(np.prod(p.full_shape)) for p in plan_tensors(cfg, 1)
                     if len(p.full_shape) == 2 and ".layers." in p.name)
    head_macs = cfg.vocab_size * cfg.hidden_size
    weights = sum(int(np.prod(p.full_shape)) for p in plan_tensors(cfg, 1)) * (w_bytes or dtype_bytes)
    kv = kv_read * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    attention = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * pairs
    return weights, kv, 2 * tokens * layer_macs, 2 * sampled * head_macs, attention


def greedy_head_rows(dtype: str, wbytes: int, bf16_peak: float | None) -> tuple[bool, int]:
    """Whether a float32 job's greedy chains pick from the LM head in bfloat16 pairs here
    (worker.cpu.CpuOps.greedy_head: VDPBF16PS, a bfloat16 checkpoint held in bfloat16 panels, not
    AMX tiles, MSINFER_GREEDY_HEAD unset or 1), and above how many sequences (GreedyHeadMinRows)."""
    import ctypes

    import msinfer.worker.cpu as cpu
    if dtype != "float32" or wbytes != 2 or not bf16_peak or not cpu.CpuOps.greedy_head or cpu.CpuOps.amx:
        return False, 0
    fn = ctypes.CDLL(cpu._LIBRARY).GreedyHeadMinRows
    fn.restype = ctypes.c_int64
    return True, int(fn())


def bounds(cost: tuple, b: int, dtype: str, wbytes: int, before: tuple, after: tuple) -> tuple[float, float]:
    """(bound, phases) in ms of a step of `cost` (step_cost's) for b sequences (0: a prefill),
    with the machine measured before and after its steps: the higher figure of each is its rate,
    since a virtual machine's core taken by its host for a moment halves a peak measured then,
    which would put the bound below what the steps reached."""
    weights, kv, layers, head, others = cost
    bw, rate, bf16_peak = (max(x, y) if x else None for x, y in zip(before, after))
    layer_rate = (bf16_peak or rate) if dtype == "bfloat16" else rate
    greedy_head, head_rows = greedy_head_rows(dtype, wbytes, bf16_peak)
    # (others: attention) a float32 job's greedy chains of more than head_rows sequences take the
    # LM head's logits from bfloat16 pairs (GreedyHead): at VDPBF16PS's rate
    head_time = head / (bf16_peak if greedy_head and b > head_rows else layer_rate)
    bound = 1e3 * max((weights + kv) / bw, layers / layer_rate + head_time + others / rate)
    phases = 1e3 * (max(weights / bw, layers / layer_rate + head_time) + max(kv / bw, others / rate))
    return bound, phases


def bench(model: Path, dtype: str, batches: list[int], prompt: int, prefill: int, out: Path,
          kv_cache_dtype: str = "auto", decode_steps: int | None = None) -> dict:
    """`msinfer bench`'s rows: (batch, input_len) -> row."""
    rows = {}
    for sizes, lengths, new in ((",".join(map(str, batches)), str(prompt), str(NEW)), ("1", str(prefill), "1")):
        d = out / f"in{lengths}"
        cmd = [sys.executable, "-m", "msinfer.launcher.cli", "bench", "--model", str(model), "--batch-size", sizes,
               "--input-len", lengths, "--output-len", new, "--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype,
               "--repeats", "3", *(("--decode-steps", str(decode_steps)) if decode_steps else ()),
               "--max-model-len", str(max(prefill, prompt + NEW) + 16), "--output", str(d), "--no-progress"]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if p.returncode != 0:
            sys.exit(f"roofline: msinfer bench failed ({p.returncode}):\n{p.stderr[-2000:]}")
        for row in json.loads((d / "bench.json").read_text())["cases"]:
            rows[row["batch_size"], row["input_len"]] = row
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a dense Hugging Face checkpoint (default: the demo model)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16"),
                    help="the KV cache's element (model.kv_cache_dtype); with --dtype bfloat16 it is bfloat16 anyway")
    ap.add_argument("--batch-size", default="1,16,64", help="decode batch sizes (default 1,16,64)")
    ap.add_argument("--prompt", type=int, default=PROMPT, help=f"decode prompts' tokens (default {PROMPT})")
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens, one prompt (default 512)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of the machine's measures and the steps, one after the other; the table shows "
                         "their medians and each round's figures (default 1)")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="decode steps a call (scheduler.decode_steps; default the job's: 4 on the CPU)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be 1 or more, not {args.rounds}")
    sys.path.insert(0, str(ROOT))
    from msinfer.sharding.config import ModelConfig
    if args.model is None:
        from scripts.make_demo_model import ensure_demo_model
        args.model = Path(ensure_demo_model())
    cfg = ModelConfig.from_dir(args.model)
    if cfg.is_moe or cfg.mla is not None:
        sys.exit("roofline: dense models only (a mixture of experts reads the experts its tokens chose)")
    batches = [int(b) for b in args.batch_size.split(",")]
    kv_bytes = 2 if "bfloat16" in (args.dtype, args.kv_cache_dtype) else 4    # the cache's values (the network: float32)
    wbytes = weight_bytes(cfg, args.dtype)
    cores = len(os.sched_getaffinity(0))
    dot = os.environ.get("MSINFER_BF16_DOT", "1") != "0"          # (the kernels' override)
    L, T = args.prompt + NEW // 2, args.prefill
    costs = [(f"decode B={b} L={L}", (b, args.prompt), b, step_cost(cfg, kv_bytes, b, b * L, b * L, b, wbytes))
             for b in batches]
    costs.append((f"prefill T={T}", (1, T), 0, step_cost(cfg, kv_bytes, T, T * (T + 1) // 2, 0, 1, wbytes)))
    # (before numpy's: its BLAS threads go on spinning after a matmul, and would take the cores
    # from the kernels' threads)
    pairs_rate = numpy_rate = None
    rounds = []                 # per round: (machine before, after, {case: (bound, phases, measured)})
    for r in range(args.rounds):
        before = measure_machine(cores, dot)
        if r == 0:
            pairs_rate = bfloat16_rate() if args.dtype == "bfloat16" else None
            numpy_rate = matmul_rate()
        with tempfile.TemporaryDirectory() as tmp:
            rows = bench(args.model, args.dtype, batches, args.prompt, args.prefill, Path(tmp), args.kv_cache_dtype,
                         args.decode_steps)
        after = measure_machine(cores, dot)
        rounds.append((before, after, {name: bounds(cost, b, args.dtype, wbytes, before, after)
                                       + (rows[key].get("prefill_ms" if b == 0 else "decode_ms_per_step"),)
                                       for name, key, b, cost in costs}))
    print(f"machine   {cpu_flags()}")
    for r, (before, after, _) in enumerate(rounds):
        bw, f32_peak, bf16_peak = (max(a, b) if a else None for a, b in zip(before, after))
        said = f"round {r + 1}: " if len(rounds) > 1 else ""
        print(f"          {said}triad bandwidth {bw / 1e9:.1f} GB/s; peak float32 FMAs {f32_peak / 1e9:.1f} GFLOP/s"
              + (f", VDPBF16PS {bf16_peak / 1e9:.1f}" if bf16_peak else ", no VDPBF16PS") + " (the kernels' PeakFlops)")
        print("          measured before and after the steps: " + "; ".join(
            f"{name} {a / 1e9:.1f} and {b / 1e9:.1f}" for name, a, b in zip(("triad", "float32", "VDPBF16PS"),
                                                                           before, after) if a))
        moved = [name for name, a, b in zip(("the triad", "the float32 peak", "the VDPBF16PS peak"), before, after)
                 if a and abs(a - b) > 0.15 * max(a, b)]
        if moved:
            print(f"          note: {', '.join(moved)} moved by more than 15% between the two: the machine was busy "
                  f"or slowed meanwhile, and the steps' figures may be too")
    print(f"          matmuls reach: float32 {numpy_rate / 1e9:.1f} GFLOP/s (numpy's BLAS, 2048 x 2048)"
          + (f"; bfloat16 {pairs_rate / 1e9:.1f} (the kernels' Linear over pairs, 512 rows)"
             if pairs_rate else ""))
    print(f"model     {args.model} ({cfg.architecture}, {args.dtype}; weights held at {wbytes} bytes, "
          f"KV cache at {kv_bytes})")
    if len(rounds) > 1:
        print(f"          {len(rounds)} rounds, each against the machine measured around it; the table's figures "
              f"are their medians, and each round's measured ms and ratio follow it")
    print(f"{'step':<26}{'MB':>8}{'GFLOP':>8}{'bound ms':>10}{'phases ms':>11}{'measured ms':>13}{'ratio':>7}"
          f"{'to phases':>11}")
    for name, _, _, (weights, kv, layers, head, others) in costs:
        figures = [r[2][name] for r in rounds]
        bound, phases = (float(np.median([f[i] for f in figures])) for i in (0, 1))
        measured = [f[2] for f in figures if f[2]]
        ratios = [f[2] / f[0] for f in figures if f[2]]
        shown, ratio, to_phases = (f"{float(np.median(v)):.{d}f}" if measured else "-" for v, d in (
            (measured, 1), (ratios, 2), ([f[2] / f[1] for f in figures if f[2]], 2)))
        print(f"{name:<26}{(weights + kv) / 1e6:>8.0f}{(layers + head + others) / 1e9:>8.2f}{bound:>10.1f}"
              f"{phases:>11.1f}{shown:>13}{ratio:>7}{to_phases:>11}")
        if len(rounds) > 1 and measured:
            print(f"{'':<26}rounds: " + ", ".join(f"{m:.1f} ms {q:.2f}x" for m, q in zip(measured, ratios)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
