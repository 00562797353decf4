"""`msinfer bench`: generation speed over batch size x input length x output length.

    msinfer bench --model DIR --batch-size 1,8,16 --input-len 32,128 --output-len 32 --output results/

One replica (a tensor-parallel group of workers, launcher.replica) serves every case. A case is a
static batch: B random prompts of exactly `input_len` tokens go through one prefill step, then
`output_len - 1` decode steps, greedy, EOS ignored, so every sequence makes `output_len` tokens.

Cases run in order of KV-cache bytes (2 x dtype bytes x B x (input + output) x kv heads x head_dim
x layers), so that one that exhausts memory comes last. A case that cannot run (too long for the
model, KV cache larger than the machine) or that fails is recorded with its error and the rest go
on; a replica that died is started afresh for them.

Per case, the first pass compiles the graphs of shapes no earlier case used; it is timed but,
when it compiled anything, not reported: `compile_s` is that pass minus the fastest timed pass.
The timed numbers are then steady-state steps:
    prefill_ms      the prompt step of the whole batch on rank 0 (forward + sampling)
    ttft_ms         the same step as the launcher sees it: request out, first tokens back
    decode_tok_s    B x (output_len - 1) / decode time
    e2e_tok_s       B x output_len / (prefill + decode), as the launcher sees it
    peak_mem_mib    peak resident memory of each rank's process (ru_maxrss: the high-water mark
                    since the worker started, so it never falls from one case to the next)
Results go to DIR/bench.csv and DIR/bench.json after every case, and DIR/bench.png (throughput
against batch size, one line per input length) at the end when matplotlib is installed.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from msinfer.launcher.errors import EXIT_JOB_FAILED, OutputError, UserError

CSV_NAME, JSON_NAME, PNG_NAME = "bench.csv", "bench.json", "bench.png"
COLUMNS = ("batch_size", "input_len", "output_len", "kv_cache_bytes", "status", "compile_s", "graphs_compiled",
           "prefill_ms", "ttft_ms", "decode_ms_per_step", "decode_tok_s", "e2e_s", "e2e_tok_s", "peak_mem_mib",
           "peak_mem_mib_per_rank", "error")


class BenchError(UserError):
    """A bench flag is invalid; the message names the flag."""


# ---- flags ------------------------------------------------------------------------------------------
def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="time generation over batch size x input length x output length",
                       description="Time prefill and decode of synthetic prompts over every combination of "
                                   "batch size, input length and output length. List flags take 4, 1,2,4 or [1,2,4].")
    b.add_argument("--model", required=True, metavar="PATH",
                   help="Hugging Face checkpoint folder (config.json + safetensors)")
    b.add_argument("--batch-size", default="1", metavar="LIST", help="sequences per batch (default 1)")
    b.add_argument("--input-len", default="128", metavar="LIST", help="prompt tokens per sequence (default 128)")
    b.add_argument("--output-len", default="128", metavar="LIST", help="generated tokens per sequence (default 128)")
    b.add_argument("--tensor-parallel", "--tp", default="1", metavar="N", help="workers per replica (default 1)")
    b.add_argument("--expert-parallel", action="store_true",
                   help="a mixture of experts: whole experts per rank instead of a slice of each (parallel."
                        "expert_parallel)")
    b.add_argument("--skip-load", action="store_true",
                   help="random weights of the model's shapes instead of the checkpoint (needs only config.json)")
    b.add_argument("--device", default="auto", choices=("auto", "cpu", "ascend"))
    b.add_argument("--ops", default="auto", choices=("auto", "portable"),
                   help="operators: the device's fastest (auto) or portable MindSpore primitives")
    b.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="compute dtype (auto: float32 on the CPU, the checkpoint's on Ascend)")
    b.add_argument("--max-model-len", default=None,
                   help="longest sequence a case may have (default: the model's max_position_embeddings)")
    b.add_argument("--repeats", default="1", help="timed passes per case; the fastest is reported (default 1)")
    b.add_argument("--seed", default="0", help="seed of the random prompts and weights (default 0)")
    b.add_argument("--output", default="bench-results", metavar="DIR",
                   help=f"folder for {CSV_NAME}, {JSON_NAME} and {PNG_NAME} (default ./bench-results)")
    b.add_argument("--ray-address", default=None, help="join this Ray cluster (default: an embedded local Ray)")
    b.add_argument("--step-timeout", default="600", help="seconds a step may take before the replica is "
                                                         "restarted (default 600)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_sizes(text, flag: str) -> list[int]:
    """'4', '1,2,4' or '[1,2,4]' -> [1, 2, 4] (duplicates dropped, order kept); each must be >= 1."""
    raw = str(text).strip()
    body = raw[1:-1] if raw.startswith("[") and raw.endswith("]") else raw
    parts = [p.strip() for p in body.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise BenchError(f"{flag} '{raw}': expected a positive integer or a list of them, e.g. 4, 1,2,4 or [1,2,4]")
    return list(dict.fromkeys(values))


def parse_one(text, flag: str, minimum: int = 1, kind=int):
    try:
        value = kind(str(text).strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise BenchError(f"{flag} '{text}': expected a {'number' if kind is float else 'whole number'} "
                         f">= {minimum}")
    return value


# ---- cases ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    batch_size: int
    input_len: int
    output_len: int
    kv_bytes: int                      # whole model, all ranks: 2 x dtype bytes x B x len x kv heads x D x layers

    @property
    def seq_len(self) -> int:
        return self.input_len + self.output_len

    def __str__(self) -> str:
        return f"B={self.batch_size} in={self.input_len} out={self.output_len}"


def make_cases(batch_sizes, input_lens, output_lens, kv_bytes_per_token: int) -> list[Case]:
    """The cartesian product, smallest KV cache first (ties: smaller batch, then shorter)."""
    cases = [Case(b, i, o, kv_bytes_per_token * b * (i + o))
             for b, i, o in itertools.product(batch_sizes, input_lens, output_lens)]
    return sorted(cases, key=lambda c: (c.kv_bytes, c.batch_size, c.input_len, c.output_len))


@dataclass
class BenchPlan:
    model_dir: str
    model: object                      # sharding.config.ModelConfig
    tp: int
    device: str
    dtype: str
    max_model_len: int
    cases: list[Case]
    rejected: dict[Case, str]          # cases that cannot run, with the reason
    engine: object                     # worker.runner.EngineConfig sized for the largest runnable case
    weight_bytes_per_rank: int
    skip_load: bool
    repeats: int
    seed: int
    step_timeout_s: float
    out_dir: Path
    ray_address: str | None
    checkpoint_bytes: int = 0


def plan_bench(args) -> BenchPlan:
    """Every check that can fail, before Ray starts."""
    from msinfer.launcher.job import host_memory_problem
    from msinfer.sharding.config import ModelConfig
    from msinfer.sharding.layout import LayoutError, bytes_per_rank, check_tp, plan_tensors
    from msinfer.worker.loader import CheckpointError, check_checkpoint
    from msinfer.sharding.config import ascend_emulated, resolve_device
    from msinfer.sharding.config import EngineConfig, resolve_dtype

    batch_sizes = parse_sizes(args.batch_size, "--batch-size")
    input_lens = parse_sizes(args.input_len, "--input-len")
    output_lens = parse_sizes(args.output_len, "--output-len")
    tp = parse_one(args.tensor_parallel, "--tensor-parallel")
    repeats = parse_one(args.repeats, "--repeats")
    seed = parse_one(args.seed, "--seed", minimum=0)
    step_timeout = parse_one(args.step_timeout, "--step-timeout", kind=float, minimum=1)

    m = ModelConfig.from_dir(args.model)
    max_len = m.max_position_embeddings if args.max_model_len is None else \
        parse_one(args.max_model_len, "--max-model-len", minimum=2)
    ep = bool(args.expert_parallel)
    try:
        check_tp(m, tp, ep)
    except LayoutError as e:
        raise BenchError(str(e).replace("parallel.tensor_parallel", "--tensor-parallel")
                         .replace("parallel.expert_parallel", "--expert-parallel")) from None
    try:
        ckpt_bytes = 0 if args.skip_load else check_checkpoint(args.model, plan_tensors(m, tp, ep))
    except CheckpointError as e:
        raise CheckpointError(f"{e} (--skip-load runs on random weights with config.json alone)") from None
    device = resolve_device(args.device)
    emulate = device == "ascend" and ascend_emulated()
    try:
        dtype = resolve_dtype(args.dtype, m, device, emulate)
    except ValueError as e:
        raise BenchError(str(e).replace("model.dtype", "--dtype")) from None
    dbytes = 2 if dtype in ("float16", "bfloat16") else 4
    cases = make_cases(batch_sizes, input_lens, output_lens, m.kv_bytes_per_token(dbytes))
    weights = bytes_per_rank(m, tp, dbytes, ep)
    kv_share = max(1, m.num_kv_heads // tp) / m.num_kv_heads          # of the KV cache one rank holds
    on_host = (device == "cpu" or emulate) and not args.ray_address
    rejected: dict[Case, str] = {}
    for c in cases:
        if c.seq_len > max_len:
            rejected[c] = (f"input_len + output_len = {c.seq_len} exceeds the max model len {max_len} "
                           f"({'--max-model-len' if args.max_model_len else 'max_position_embeddings'})")
        elif on_host and (problem := host_memory_problem(tp, weights, int(kv_share * c.kv_bytes))):
            rejected[c] = f"does not fit in memory: {problem}"
    runnable = [c for c in cases if c not in rejected] or cases[:1]   # size the engine for something
    block_size = 16
    engine = EngineConfig(
        model_dir=str(args.model), dtype=dtype, device=device,
        max_model_len=max(c.seq_len for c in runnable), max_batch_size=max(c.batch_size for c in runnable),
        num_blocks=max(c.batch_size * -(-c.seq_len // block_size) for c in runnable), block_size=block_size,
        random_weights=bool(args.skip_load), ops=args.ops, emulate=emulate, expert_parallel=ep)
    out_dir = Path(args.output)
    check_out_dir(out_dir)
    return BenchPlan(str(args.model), m, tp, device, dtype, max_len, cases, rejected, engine, weights,
                     bool(args.skip_load), repeats, seed, step_timeout, out_dir, args.ray_address, ckpt_bytes)


def check_out_dir(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        raise OutputError(f"--output {d}: cannot write there ({e.strerror or e})") from None


# ---- running ----------------------------------------------------------------------------------------
@dataclass
class Timing:
    prefill_s: float                   # the prompt step on rank 0
    ttft_s: float                      # the prompt step as the launcher sees it
    decode_s: float
    e2e_s: float


class BenchReplica:
    """One replica and the static-batch generation loop a case runs on it."""

    def __init__(self, plan: BenchPlan):
        self.plan = plan
        self.replica = None
        self.setup_info: list[dict] = []
        self.starts = 0
        self.start_error: str | None = None

    def start(self) -> None:
        from msinfer.launcher.controller import launch_error
        from msinfer.launcher.job import threads_per_worker
        from msinfer.launcher.replica import Replica
        import ray

        p = self.plan
        threads = threads_per_worker(p.tp) if p.engine.on_cpu else 0
        self.replica = Replica(self.starts, p.tp, p.device, threads_per_worker=threads)
        self.starts += 1
        try:
            self.replica.start(p.engine)
            if p.skip_load:
                t0 = time.perf_counter()
                filled = ray.get([w.fill_random.remote(seed=p.seed) for w in self.replica.workers])
                for info, n in zip(self.replica.setup_info, filled):
                    info.update(param_bytes=n, random_fill_s=time.perf_counter() - t0)
        except Exception as e:
            self.shutdown()
            raise launch_error(e) from None
        self.setup_info.append({"start": self.starts, "ranks": self.replica.ranks, "setup": self.replica.setup_info})

    def shutdown(self) -> None:
        if self.replica is not None:
            self.replica.shutdown()
            self.replica = None

    def _step(self, seqs, is_prefill: bool):
        import ray
        return ray.get(self.replica.submit(seqs, is_prefill), timeout=self.plan.step_timeout_s)[0]

    def generate(self, case: Case) -> Timing:
        import numpy as np
        from msinfer.worker.protocol import SamplingParams, SeqStep

        B, n_in, n_out = case.batch_size, case.input_len, case.output_len
        rng = np.random.default_rng([self.plan.seed, B, n_in])
        prompts = rng.integers(0, self.plan.model.vocab_size, (B, n_in)).tolist()
        per_seq = -(-case.seq_len // self.plan.engine.block_size)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(B)]
        sampling = SamplingParams(max_new_tokens=n_out, ignore_eos=True)
        t0 = time.perf_counter()
        out = self._step([SeqStep(i, prompts[i], 0, tables[i], sampling) for i in range(B)], True)
        t_first = time.perf_counter()
        last = out.token_ids
        for k in range(1, n_out):
            seqs = [SeqStep(i, [last[i]], n_in + k - 1, tables[i], sampling, num_generated=k) for i in range(B)]
            last = self._step(seqs, False).token_ids
        t_end = time.perf_counter()
        return Timing(out.worker_s, t_first - t0, t_end - t_first, t_end - t0)

    def stats(self) -> list[dict]:
        import ray
        return ray.get([w.stats.remote() for w in self.replica.workers], timeout=60)

    def graphs(self) -> set[str]:
        return set(self.stats()[0]["compile_s"])


def run_case(engine: BenchReplica, case: Case, repeats: int) -> dict:
    """Warm-up (when the case brings new shapes), timed passes, and the case's row of metrics."""
    before = engine.graphs()
    first = engine.generate(case)
    new_graphs = engine.graphs() - before
    passes = [] if new_graphs else [first]       # nothing compiled: the first pass is steady state
    while len(passes) < repeats:
        passes.append(engine.generate(case))
    best = min(passes, key=lambda t: t.e2e_s)
    B, n_out = case.batch_size, case.output_len
    mem = [s["peak_rss_bytes"] / 2**20 for s in engine.stats()]
    return {
        "compile_s": max(0.0, first.e2e_s - best.e2e_s) if new_graphs else 0.0,
        "graphs_compiled": len(new_graphs),
        "prefill_ms": 1e3 * best.prefill_s,
        "ttft_ms": 1e3 * best.ttft_s,
        "decode_ms_per_step": 1e3 * best.decode_s / (n_out - 1) if n_out > 1 else None,
        "decode_tok_s": B * (n_out - 1) / best.decode_s if n_out > 1 and best.decode_s > 0 else None,
        "e2e_s": best.e2e_s,
        "e2e_tok_s": B * n_out / best.e2e_s,
        "peak_mem_mib": max(mem),
        "peak_mem_mib_per_rank": mem,
    }


def describe_failure(e: BaseException) -> str:
    from msinfer.launcher.engine import describe
    from ray.exceptions import GetTimeoutError, RayActorError

    if isinstance(e, RayActorError):
        text = str(e).lower()
        return "a worker process died" + (" (out of memory)" if "memory" in text or "oom" in text else "")
    if isinstance(e, GetTimeoutError):
        return "a step took longer than --step-timeout"
    return describe(e)


def replica_usable(engine: BenchReplica, error: BaseException) -> bool:
    """After a failed case: at tp 1 an exception raised inside the worker leaves it serviceable; a dead
    or stuck worker, or any failure at tp > 1 (peers may be waiting in a collective), does not."""
    from ray.exceptions import RayTaskError
    if engine.replica is None or engine.plan.tp > 1 or not isinstance(error, RayTaskError):
        return False
    try:
        engine.stats()
        return True
    except Exception:
        return False


@dataclass
class BenchRun:
    plan: BenchPlan
    rows: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def record(self, case: Case, metrics: dict | None = None, error: str | None = None) -> dict:
        """One row; a failure's full text goes to the JSON only, its gist to the error column."""
        row = {k: None for k in COLUMNS}
        row.update(batch_size=case.batch_size, input_len=case.input_len, output_len=case.output_len,
                   kv_cache_bytes=case.kv_bytes, status="error" if error else "ok", error=error and gist(error))
        if error and error != row["error"]:
            row["error_detail"] = error
        row.update(metrics or {})
        self.rows.append(row)
        self.write()
        return row

    def write(self) -> None:
        d = self.plan.out_dir
        from msinfer.launcher.writer import write_json_atomic
        try:
            write_json_atomic(d / JSON_NAME, {"bench": self.meta, "cases": self.rows})
            fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{CSV_NAME}.", suffix=".tmp")
            with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
                w = csv.DictWriter(f, fieldnames=COLUMNS)
                w.writeheader()
                for row in self.rows:
                    w.writerow({k: csv_value(k, row[k]) for k in COLUMNS})
            os.replace(tmp, d / CSV_NAME)
        except OSError as e:
            raise OutputError(f"--output {d}: cannot write the results ({e.strerror or e})") from None


def gist(message: str, limit: int = 300) -> str:
    """The first informative line of an error (MindSpore's start with rulers and headings)."""
    lines = [ln.strip() for ln in message.splitlines()] or [""]
    typed = re.match(r"(\w+):\s*(.*)", lines[0])          # "TypeError: ..." as describe() words it
    head, first = typed.groups() if typed else ("", lines[0])
    body = first or next((ln for ln in lines[1:] if ln and not ln.startswith(("-", "="))), "")
    text = f"{head}: {body}" if head and body else head or body
    return text if len(text) <= limit else text[: limit - 3] + "..."


def csv_value(key: str, v):
    if v is None:
        return ""
    if isinstance(v, list):
        return ";".join(f"{x:.1f}" for x in v)
    if isinstance(v, float):
        return f"{v:.4f}" if key in ("compile_s", "e2e_s") else f"{v:.2f}"
    return v


def bench_meta(plan: BenchPlan) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    m = plan.model
    return {
        "model": plan.model_dir, "architecture": m.architecture,
        "shape": {"layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
                  "head_dim": m.head_dim, "vocab": m.vocab_size},
        "weights": "random (--skip-load)" if plan.skip_load else "checkpoint",
        "tensor_parallel": plan.tp, "expert_parallel": plan.engine.expert_parallel, "device": plan.device,
        "dtype": plan.dtype, "max_model_len": plan.max_model_len,
        "engine": dataclasses.asdict(plan.engine), "repeats": plan.repeats,
        "seed": plan.seed, "weight_bytes_per_rank": plan.weight_bytes_per_rank,
        "checkpoint_bytes": plan.checkpoint_bytes,
        "versions": {"mindspore": ver("mindspore"), "ray": ver("ray"), "python": sys.version.split()[0]},
        "machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0]},
        "started_unix": time.time(),
        "definitions": {
            "kv_cache_bytes": "2 x dtype bytes x batch x (input + output) x kv heads x head_dim x layers",
            "compile_s": "first pass minus the fastest timed pass, when the first pass compiled new graph shapes",
            "prefill_ms": "the prompt step of the whole batch on rank 0 (forward + sampling)",
            "ttft_ms": "the prompt step as the launcher sees it (Ray round trip included)",
            "decode_tok_s": "batch x (output_len - 1) / decode time",
            "e2e_tok_s": "batch x output_len / (prefill + decode time)",
            "peak_mem_mib": "ru_maxrss of each rank's process: the high-water mark since it started"},
    }


def run_bench(args) -> int:
    import ray
    from msinfer.launcher.replica import init_ray

    plan = plan_bench(args)
    run = BenchRun(plan, meta=bench_meta(plan))
    runnable = [c for c in plan.cases if c not in plan.rejected]
    print(f"msinfer bench: {len(plan.cases)} case(s), {len(runnable)} runnable, {plan.model.architecture} "
          f"tp {plan.tp}{' (experts whole per rank)' if plan.engine.expert_parallel else ''} on {plan.device}"
          f"{' (emulated)' if plan.engine.emulate else ''} ({plan.dtype}, "
          f"{'random weights' if plan.skip_load else 'checkpoint weights'}) -> {plan.out_dir}", file=sys.stderr)
    started_ray = not ray.is_initialized()
    engine = BenchReplica(plan)
    bar = None
    try:
        if runnable:
            init_ray(plan.ray_address, plan.tp + 1, npus=plan.tp if plan.engine.emulate else 0)
            engine.start()
        if not args.no_progress:
            from tqdm import tqdm
            bar = tqdm(total=len(plan.cases), unit="case", file=sys.stderr, dynamic_ncols=True, desc="bench",
                       disable=None)
        for case in plan.cases:
            if bar is not None:
                bar.set_postfix_str(str(case), refresh=True)
            if case in plan.rejected:
                run.record(case, error=plan.rejected[case])
            elif engine.replica is None:
                run.record(case, error=f"no replica: {engine.start_error}")
            else:
                try:
                    run.record(case, run_case(engine, case, plan.repeats))
                except OutputError:
                    raise
                except Exception as e:
                    run.record(case, error=describe_failure(e))
                    if not replica_usable(engine, e):
                        restart(engine, case, runnable)
            if bar is not None:
                bar.update(1)
    except KeyboardInterrupt:
        done = sum(r["status"] == "ok" for r in run.rows)
        print(f"\nmsinfer bench: interrupted; {done} finished case(s) are in {plan.out_dir / CSV_NAME}",
              file=sys.stderr)
        raise
    finally:
        if bar is not None:
            bar.close()
        engine.shutdown()
        run.meta["machine"]["load_avg_end"] = os.getloadavg()[0]
        run.meta.update(finished_unix=time.time(), replica_starts=engine.setup_info)
        run.write()
        if started_ray and ray.is_initialized():
            ray.shutdown()
    title = (f"msinfer bench: {Path(plan.model_dir).name}, tp {plan.tp}, {plan.device} {plan.dtype}"
             f"{', random weights' if plan.skip_load else ''}")
    note = plot_results(plan.out_dir / PNG_NAME, run.rows, title)
    print(format_table(run.rows))
    written = [plan.out_dir / CSV_NAME, plan.out_dir / JSON_NAME] + ([] if note else [plan.out_dir / PNG_NAME])
    print("written: " + ", ".join(map(str, written)) + (f"\nnote: {note}" if note else ""))
    return 0 if any(r["status"] == "ok" for r in run.rows) else EXIT_JOB_FAILED


def restart(engine: BenchReplica, failed: Case, runnable: list[Case]) -> None:
    """A fresh replica for the cases after `failed`, if any remain."""
    engine.shutdown()
    if runnable.index(failed) < len(runnable) - 1:
        try:
            engine.start()
        except Exception as e:
            engine.start_error = f"the replica did not restart ({e})"


# ---- reporting ----------------------------------------------------------------------------------------
def plot_results(path: Path, rows: list[dict], title: str = "msinfer bench") -> str | None:
    """Decode and end-to-end tokens/s against batch size, one line per input (and output) length.
    Returns a note instead when there is no plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed, so no {path.name} (pip install matplotlib)"
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return f"no case succeeded, so no {path.name}"
    several_out = len({r["output_len"] for r in ok}) > 1
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, name in ((axes[0], "decode_tok_s", "decode tokens/s"), (axes[1], "e2e_tok_s", "end-to-end tokens/s")):
        groups: dict[tuple, list] = {}
        for r in ok:
            if r[key] is not None:
                groups.setdefault((r["input_len"], r["output_len"] if several_out else None), []).append(r)
        for (n_in, n_out), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            rs = sorted(rs, key=lambda r: r["batch_size"])
            label = f"input {n_in}" + (f", output {n_out}" if n_out is not None else "")
            ax.plot([r["batch_size"] for r in rs], [r[key] for r in rs], marker="o", label=label)
        batches = sorted({r["batch_size"] for r in ok})
        if batches[-1] >= 4 * batches[0]:
            ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        return f"cannot write {path} ({e.strerror or e})"
    finally:
        plt.close(fig)
    return None


def format_table(rows: list[dict]) -> str:
    head = ("batch", "in", "out", "KV MiB", "compile s", "prefill ms", "TTFT ms", "decode tok/s", "e2e tok/s",
            "peak MiB/rank", "error")

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = []
    for r in rows:
        mem = "/".join(f"{m:.0f}" for m in r["peak_mem_mib_per_rank"]) if r["peak_mem_mib_per_rank"] else "-"
        lines.append((str(r["batch_size"]), str(r["input_len"]), str(r["output_len"]),
                      f"{r['kv_cache_bytes'] / 2**20:.1f}", f(r["compile_s"], ".2f"), f(r["prefill_ms"], ".1f"),
                      f(r["ttft_ms"], ".1f"), f(r["decode_tok_s"], ".1f"), f(r["e2e_tok_s"], ".1f"), mem,
                      r["error"] or ""))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths[:-1]) + "  {}"
    return "\n".join([fmt.format(*head), *(fmt.format(*line) for line in lines)])
