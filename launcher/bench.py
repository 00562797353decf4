"""`msinfer bench`: generation speed over batch size x input length x output length.

    msinfer bench --model DIR --batch-size 1,8,16 --input-len 32,128 --output-len 32 --output results/

Every case runs as a job does: the job's controller (launcher.controller) with one replica and its
engine (launcher.engine: the scheduler, async scheduling, postprocessing, result lines), with the
plan `msinfer plan` makes (launcher.job.plan_job: dtype, memory, the card's KV cache on Ascend).
A case is B random prompts of exactly `input_len` token ids, greedy, EOS ignored, so every
sequence makes `output_len` tokens; the scheduler takes the case's B as max_batch_size and, unless
--max-batched-tokens says otherwise, B x input_len prompt tokens a step, so the batch is prefilled
in one step and then decoded together. Prefix caching is off (the passes repeat their prompts).

Cases run in order of KV-cache bytes (2 x dtype bytes x B x (input + output) x kv heads x head_dim
x layers; MLA: the latent width in place of 2 x kv heads x head_dim), so that one that exhausts memory comes last. A case that cannot run (too long for the
model, KV cache larger than the machine or the card's plan) or that fails is recorded with its
error and the rest go on; a replica that failed is started afresh for them.

Per case, the first pass compiles the graphs of shapes no earlier case used; it is timed but,
when it compiled anything, not reported: `compile_s` is that pass minus the fastest timed pass.
The timed figures (launcher.bench_report.DEFINITIONS) come from the engine's step accounts and
the driver's clock. Results go to DIR/bench.csv and DIR/bench.json after every case, and
DIR/bench.png (throughput against batch size, one line per input length) at the end when
matplotlib is installed.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from msinfer.launcher.bench_report import CSV_NAME, JSON_NAME, PNG_NAME, BenchRun, bench_meta, format_table, \
    plot_results
from msinfer.launcher.errors import EXIT_JOB_FAILED, OutputError, UserError

if TYPE_CHECKING:
    from msinfer.launcher.job import Plan
    from msinfer.sharding.config import ModelConfig


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
    b.add_argument("--pipeline-parallel", "--pp", default="1", metavar="P",
                   help="pipeline stages per replica, decoder layers split evenly (default 1)")
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
    b.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16"),
                   help="the KV cache's element (model.kv_cache_dtype): bfloat16 holds a float32 job's K and V "
                        "rounded to bfloat16, half the bytes (default auto: the compute dtype's)")
    b.add_argument("--max-model-len", default=None,
                   help="longest sequence a case may have (default: the model's max_position_embeddings)")
    b.add_argument("--max-batched-tokens", default=None, metavar="N",
                   help="prompt tokens per prefill step, as scheduler.max_batched_tokens in a job, at least the "
                        "case's batch size (default: batch x input_len, every prompt of a case in one step)")
    b.add_argument("--decode-steps", default=None, metavar="K",
                   help="decode steps a call, as scheduler.decode_steps in a job (default: the job's, 4 on "
                        "the CPU)")
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
    model: ModelConfig
    tp: int
    device: str
    dtype: str
    max_model_len: int
    cases: list[Case]
    rejected: dict[Case, str]          # cases that cannot run, with the reason
    job: Plan                          # of the job every case runs as
    weight_bytes_per_rank: int
    skip_load: bool
    repeats: int
    seed: int
    out_dir: Path
    max_batched_tokens: int | None     # None: batch x input_len of each case
    checkpoint_bytes: int = 0

    @property
    def engine(self):                  # sharding.config.EngineConfig
        return self.job.engine

    @property
    def compute(self) -> str:
        """The compute dtype as the table's title says it: float32 on the CPU with its linear
        layers (and KV cache, EngineConfig.kv_bfloat16) in bfloat16 where model.dtype is bfloat16
        there, or its KV cache alone with --kv-cache-dtype bfloat16."""
        if not self.engine.matmuls_apart:
            return self.dtype + self.engine.kv_named()
        return f"{self.dtype}, {self.engine.in_matmul_dtype(self.model)} in {self.engine.matmul_dtype}"

    def case_spec(self, case: Case):
        """The job spec a case runs with: its batch, its prefill budget, its output length."""
        spec = self.job.spec
        budget = max(self.max_batched_tokens or case.batch_size * case.input_len, case.batch_size)
        scheduler = spec.scheduler.model_copy(update={"max_batch_size": case.batch_size,
                                                      "max_batched_tokens": budget})
        sampling = spec.sampling.model_copy(update={"max_new_tokens": case.output_len, "ignore_eos": True,
                                                    "temperature": 0.0})
        return spec.model_copy(update={"scheduler": scheduler, "sampling": sampling})


def plan_bench(args) -> BenchPlan:
    """Every check that can fail, before Ray starts."""
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.job import host_memory_problem, plan_job, resolve_layout
    from msinfer.launcher.spec import MAX_DECODE_STEPS, JobSpec
    from msinfer.sharding.config import ModelConfig, kv_dtype_bytes
    from msinfer.sharding.layout import LayoutError
    from msinfer.worker.loader import CheckpointError

    batch_sizes = parse_sizes(args.batch_size, "--batch-size")
    input_lens = parse_sizes(args.input_len, "--input-len")
    output_lens = parse_sizes(args.output_len, "--output-len")
    tp = parse_one(args.tensor_parallel, "--tensor-parallel")
    pp = parse_one(args.pipeline_parallel, "--pipeline-parallel")
    repeats = parse_one(args.repeats, "--repeats")
    seed = parse_one(args.seed, "--seed", minimum=0)
    step_timeout = parse_one(args.step_timeout, "--step-timeout", kind=float, minimum=1)
    budget = None if args.max_batched_tokens is None else parse_one(args.max_batched_tokens, "--max-batched-tokens")
    chain = None if args.decode_steps is None else parse_one(args.decode_steps, "--decode-steps")
    if chain is not None and chain > MAX_DECODE_STEPS:
        raise BenchError(f"--decode-steps '{args.decode_steps}': expected a whole number <= {MAX_DECODE_STEPS}")

    m = ModelConfig.from_dir(args.model)
    max_len = m.max_position_embeddings if args.max_model_len is None else \
        parse_one(args.max_model_len, "--max-model-len", minimum=2)
    ep = bool(args.expert_parallel)
    try:       # the job's own resolution (plan_job's), before the cases size its spec
        layout = resolve_layout(m, tp, pp, ep, args.device, args.dtype, args.ops, kv_cache_dtype=args.kv_cache_dtype)
    except LayoutError as e:
        raise BenchError(flag_names(str(e))) from None
    device, emulate, dtype, pipeline, weights = (layout.device, layout.emulate, layout.dtype, layout.pipeline,
                                                 layout.weight_bytes)
    kv_per_token = m.kv_bytes(1, kv_dtype_bytes(dtype, layout.matmul_dtype, m, layout.kv_cache_dtype))
    cases = make_cases(batch_sizes, input_lens, output_lens, kv_per_token)
    # of the KV cache one rank holds: its heads, its stage's layers
    kv_share = m.cache_values(tp) / m.cache_values() * max((hi - lo for lo, hi in pipeline),
                                                           default=m.num_layers) / m.num_layers
    on_host = (device == "cpu" or emulate) and not args.ray_address
    rejected: dict[Case, str] = {}
    for c in cases:
        if c.seq_len > max_len:
            rejected[c] = (f"input_len + output_len = {c.seq_len} exceeds the max model len {max_len} "
                           f"({'--max-model-len' if args.max_model_len else 'max_position_embeddings'})")
        elif on_host and (problem := host_memory_problem(tp * pp, weights, int(kv_share * c.kv_bytes))):
            rejected[c] = f"does not fit in memory: {problem}"
    runnable = [c for c in cases if c not in rejected]
    if not runnable:
        shown = "; ".join(f"{c}: {why}" for c, why in list(rejected.items())[:3])
        raise BenchError(f"no case can run: {shown}{' ...' if len(rejected) > 3 else ''}")
    block_size = 16
    blocks = {c: c.batch_size * -(-c.seq_len // block_size) for c in runnable}
    spec = JobSpec.model_validate({
        # greedy steps as they are: not the sampling (a repetition penalty, ...) the model may recommend
        "model": {"path": str(args.model), "dtype": args.dtype, "ops": args.ops, "generation_config": "msinfer",
                  "kv_cache_dtype": args.kv_cache_dtype,
                  "max_model_len": max(c.seq_len for c in runnable),
                  # past the model's positions only where --max-model-len asks for it
                  "allow_long_max_model_len": max_len > m.max_position_embeddings},
        "parallel": {"tensor_parallel": tp, "pipeline_parallel": pp, "expert_parallel": ep, "device": args.device},
        "input": {"path": "bench-cases.jsonl", "chat_template": False},
        "output": {"path": "bench-results.jsonl"},
        "scheduler": {"max_batch_size": max(c.batch_size for c in runnable), "block_size": block_size,
                      "max_batched_tokens": max(max(budget or c.batch_size * c.input_len, c.batch_size)
                                                for c in runnable),
                      "kv_cache_blocks": None if device == "ascend" else max(blocks.values()),
                      "prefix_caching": False, "decode_steps": chain},
        # a case whose replica fails is recorded as failed; bench starts the replica afresh itself
        "fault": {"max_replica_restarts": 0, "step_timeout_s": step_timeout},
        "ray": {"address": args.ray_address},
        "sampling": {"max_new_tokens": max(c.output_len for c in runnable), "ignore_eos": True, "temperature": 0.0},
    })
    try:
        job = plan_job(spec, check_io=False, weights=not args.skip_load)       # reads the checkpoint's headers
    except (LayoutError, SpecError) as e:
        raise BenchError(flag_names(str(e))) from None
    except CheckpointError as e:
        raise CheckpointError(f"{e} (--skip-load runs on random weights with config.json alone)") from None
    if args.skip_load:
        job.engine = dataclasses.replace(job.engine, random_weights=True)
    for c in runnable:                 # on Ascend the card's plan sizes the cache: a case may not fit it
        if c not in rejected and blocks[c] > job.engine.blocks():
            rejected[c] = (f"does not fit the KV cache: needs {blocks[c]} blocks of {block_size} tokens, the card "
                           f"plan holds {job.engine.blocks()}")
    out_dir = Path(args.output)
    check_out_dir(out_dir)
    return BenchPlan(str(args.model), m, tp, device, dtype, max_len, cases, rejected, job, weights,
                     bool(args.skip_load), repeats, seed, out_dir, budget, job.checkpoint_bytes)


def flag_names(message: str) -> str:
    """A layout error worded for the spec, with bench's flags named instead."""
    for key, flag in (("parallel.tensor_parallel", "--tensor-parallel"), ("parallel.pipeline_parallel",
                      "--pipeline-parallel"), ("parallel.expert_parallel",
                      "--expert-parallel"), ("model.max_model_len", "--input-len + --output-len"),
                      ("scheduler.max_batched_tokens", "--max-batched-tokens"),
                      ("scheduler.max_batch_size", "--batch-size"), ("scheduler.decode_steps", "--decode-steps"),
                      ("scheduler.kv_cache_blocks", "the KV cache"),
                      ("model.dtype", "--dtype"), ("model.ops", "--ops"), ("model.kv_cache_dtype", "--kv-cache-dtype"),
                      ("a larger parallel.memory_fraction (now", "a job's larger parallel.memory_fraction (bench "
                                                                 "runs at"),
                      ("parallel.device_memory_gb, the card's size", "a job's parallel.device_memory_gb, the card's "
                                                                     "size (bench assumes)")):
        message = message.replace(key, flag)
    return message


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
    prefill_s: float                   # rank 0's prompt steps, per step
    prefill_steps: int
    ttft_s: float                      # arrival in the engine to the batch's last first token
    decode_s: float                    # the engine's decode steps
    decode_steps: int
    e2e_s: float                       # dealing the batch to its last result, in the driver


class BenchEngine:
    """The job's controller with one replica, and a case run through it as a job of B records."""

    def __init__(self, plan: BenchPlan):
        self.plan = plan
        self.controller = None
        self.setup_info: list[dict] = []
        self.starts = 0
        self.start_error: str | None = None
        self.started_ray = False

    @property
    def workers(self) -> list:
        return self.controller.slots[0].replica.workers

    def start(self) -> None:
        import ray
        from msinfer.launcher.job import start_controller

        p = self.plan
        self.starts += 1
        self.controller, started = start_controller(p.job)
        self.started_ray = self.started_ray or started
        replica = self.controller.slots[0].replica
        if p.skip_load:
            t0 = time.perf_counter()
            try:
                filled = ray.get([w.fill_random.remote(seed=p.seed) for w in self.workers])
            except Exception as e:
                self.shutdown()
                from msinfer.launcher.controller import launch_error
                raise launch_error(e) from None
            for info, n in zip(replica.setup_info, filled):
                info.update(param_bytes=n, random_fill_s=time.perf_counter() - t0)
        self.setup_info.append({"start": self.starts, "ranks": replica.ranks, "setup": replica.setup_info})

    def shutdown(self) -> None:
        if self.controller is not None:
            self.controller.shutdown()
            self.controller = None

    def generate(self, case: Case) -> Timing:
        import numpy as np
        from msinfer.launcher.engine import STEP_FIGURES
        from msinfer.launcher.inputs import parse_record

        B, n_in = case.batch_size, case.input_len
        rng = np.random.default_rng([self.plan.seed, B, n_in])
        prompts = rng.integers(0, self.plan.model.vocab_size, (B, n_in)).tolist()
        records = [parse_record({"id": i, "prompt_token_ids": p}, i + 1, "prompt") for i, p in enumerate(prompts)]
        self.controller.configure(self.plan.case_spec(case))
        before = self.steps()
        ttfts, failed = [], []

        def on_done(done, rec):
            ttfts.append(done.ttft_s or 0.0)
            if done.failed:
                failed.append(done.cause or done.line)

        t0 = time.perf_counter()
        self.controller.run(iter(records), on_done)
        e2e = time.perf_counter() - t0
        if failed:
            raise RuntimeError(f"{len(failed)} of {B} records failed: {failed[0]}")
        after = self.steps()
        prefill, decode = ({x: a - b for x, a, b in zip(STEP_FIGURES, after[kind], before[kind])}
                           for kind in ("prefill", "decode"))
        return Timing(prefill["worker_s"] / max(1, prefill["steps"]), prefill["steps"], max(ttfts), decode["s"],
                      decode["steps"], e2e)

    def steps(self) -> dict:
        """The engine's step figures so far. An engine that does not answer is down with its
        replica: the workers' own failure is raised (a worker process died), else that."""
        got = self.controller.engine_stats()
        if not got:
            self.stats()
            raise RuntimeError("the replica's engine does not answer")
        return got[0]["steps"]

    def stats(self) -> list[dict]:
        import ray
        return ray.get([w.stats.remote() for w in self.workers], timeout=60)

    def graphs(self) -> set[str]:
        return set(self.stats()[0]["compile_s"])


def run_case(engine: BenchEngine, case: Case, repeats: int) -> dict:
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
    decoded = n_out > 1 and best.decode_s > 0
    return {
        "compile_s": max(0.0, first.e2e_s - best.e2e_s) if new_graphs else 0.0,
        "graphs_compiled": len(new_graphs),
        "prefill_steps": best.prefill_steps,
        "decode_steps": best.decode_steps,
        "prefill_ms": 1e3 * best.prefill_s,
        "ttft_ms": 1e3 * best.ttft_s,
        "decode_ms_per_step": 1e3 * best.decode_s / best.decode_steps if decoded and best.decode_steps else None,
        "decode_tok_s": B * (n_out - 1) / best.decode_s if decoded else None,
        "e2e_s": best.e2e_s,
        "e2e_tok_s": B * n_out / best.e2e_s,
        "peak_mem_mib": max(mem),
        "peak_mem_mib_per_rank": mem,
    }


def describe_failure(e: BaseException) -> str:
    from msinfer.launcher.controller import JobFailed
    from msinfer.launcher.engine import describe

    if isinstance(e, JobFailed):        # the replica failed: what failed it
        return e.reason
    return describe(e)


def run_bench(args) -> int:
    import ray

    from msinfer.launcher.replica import LaunchError

    plan = plan_bench(args)
    run = BenchRun(plan, meta=bench_meta(plan))
    runnable = [c for c in plan.cases if c not in plan.rejected]
    print(f"msinfer bench: {len(plan.cases)} case(s), {len(runnable)} runnable, {plan.model.architecture} "
          f"tp {plan.tp}{' (experts whole per rank)' if plan.engine.expert_parallel else ''}"
          f"{f' x pp {len(plan.engine.pipeline)}' if plan.engine.pipeline else ''} on {plan.device}"
          f"{' (emulated)' if plan.engine.emulate else ''} ({plan.compute}, "
          f"{'random weights' if plan.skip_load else 'checkpoint weights'}) -> {plan.out_dir}", file=sys.stderr)
    engine = BenchEngine(plan)
    bar = None
    try:
        if runnable:
            try:
                engine.start()
            except LaunchError as e:        # (the card measured too small: worded for bench's flags)
                raise LaunchError(flag_names(str(e))) from None
        if not args.no_progress:
            from tqdm import tqdm
            bar = tqdm(total=len(plan.cases), unit="case", file=sys.stderr, dynamic_ncols=True, desc="bench",
                       disable=None)
        for case in plan.cases:
            if bar is not None:
                bar.set_postfix_str(str(case), refresh=True)
            if case in plan.rejected:
                run.record(case, error=plan.rejected[case])
            elif engine.controller is None:
                run.record(case, error=f"no replica: {engine.start_error}")
            else:
                try:
                    run.record(case, run_case(engine, case, plan.repeats))
                except OutputError:
                    raise
                except Exception as e:
                    run.record(case, error=describe_failure(e))
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
        if engine.started_ray and ray.is_initialized():
            from msinfer.launcher.replica import shutdown_ray
            shutdown_ray()
    title = (f"msinfer bench: {Path(plan.model_dir).name}, tp {plan.tp}, {plan.device} {plan.compute}"
             f"{', random weights' if plan.skip_load else ''}")
    note = plot_results(plan.out_dir / PNG_NAME, run.rows, title)
    print(format_table(run.rows))
    written = [plan.out_dir / CSV_NAME, plan.out_dir / JSON_NAME] + ([] if note else [plan.out_dir / PNG_NAME])
    print("written: " + ", ".join(map(str, written)) + (f"\nnote: {note}" if note else ""))
    return 0 if any(r["status"] == "ok" for r in run.rows) else EXIT_JOB_FAILED


def restart(engine: BenchEngine, failed: Case, runnable: list[Case]) -> None:
    """A fresh replica for the cases after `failed`, if any remain."""
    engine.shutdown()
    if runnable.index(failed) < len(runnable) - 1:
        try:
            engine.start()
        except Exception as e:
            engine.start_error = f"the replica did not restart ({e})"
