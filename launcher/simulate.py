"""`msinfer simulate job.yaml`: the job exactly as `msinfer run` runs it (spec, inputs, tokenizer
and chat template, the dp x tp layout, the engines and their scheduling, results, resume, status
and summary), on stand-in workers that load no weights and take a given time per step. It
measures what the driver, the engines and the Ray round trips cost at a scale this machine cannot
run models at, and tells a user sizing a cluster whether one driver keeps their replicas busy.

A stand-in step sleeps `step_ms` (plus `prefill_ms_per_token` per token a prefill feeds) and
samples tokens drawn deterministically from the vocabulary by (the prompt's first 16 tokens, token
index), never an end-of-sequence token: every record generates its max_new_tokens, and the same
tokens on any replica, in any run. A step's tokens take a few numpy operations: the stand-ins share
the machine with the engines and the driver they measure, so they should cost it little. The
stand-ins are Ray actors like the workers (one per rank, in the replica's placement group, asking
for no CPU), so the driver and the engines are exactly the real ones.
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass

import numpy as np

from msinfer.worker.actor import Worker
from msinfer.worker.protocol import SAMPLED, DecodeChain, DecodeStep, SeqStep, StepOutput, StepReader, one_by_one
from msinfer.worker.sampler import mix64


KEYS_KEPT = 100_000             # sequences whose prompt key a stand-in remembers
KEY_TOKENS = 16                 # a prompt's first tokens that pick a stand-in's draws


@dataclass(frozen=True)
class StandIn:
    """How long a stand-in step takes, and the stand-in rank's class (a subclass of
    StandInWorker injects faults in tests)."""
    step_ms: float = 20.0
    prefill_ms_per_token: float = 0.0
    worker_cls: type | None = None


def simulate_output(spec, path: str | None = None):
    """The spec with its results going to `path`, or to `<output.path>.simulate.jsonl`: stand-in
    tokens in the job's own results file would be taken for done records by the next `run`. Never
    a file of the job's (its output.path, its shard's, input.path), a results file's companion
    (`.status.json`, `.summary.json`, `.inputs`, `.lock`), nor a file that holds results no
    simulate wrote (a run's, or ones without a status file), with or without --overwrite."""
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.shards import for_shard
    from msinfer.launcher.spec import OutputSpec, expand_path
    from msinfer.launcher.writer import holds_results, inputs_path, kept_settings, lock_path, status_path, summary_path
    default = f"{spec.output.path}.simulate.jsonl"
    target = expand_path(path) if path else default
    mine = [("output.path", spec.output.path), ("input.path", spec.input.path)]
    if spec.input.shard is not None:
        mine.append(("results file of input.shard", for_shard(spec).output.path))
    if own := [k for k, p in mine if same_file(target, p)]:
        raise SpecError(f"--output {path}: that is the job's own {own[0]}; msinfer simulate writes its "
                        f"stand-in results elsewhere (default {default})")
    companions = (status_path, summary_path, inputs_path, lock_path)
    if any(target.endswith(str(f(""))) for f in companions):
        raise SpecError(f"--output {path}: that is the name of a results file's companion (its status, summary, "
                        f"inputs or lock file); msinfer simulate writes its stand-in results elsewhere (default "
                        f"{default})")
    output = OutputSpec.model_validate({**spec.output.model_dump(), "path": target})
    spec = spec.model_copy(update={"output": output})
    written = for_shard(spec).output.path
    if holds_results(written) and (kept_settings(written) or {}).get("simulate") is not True:
        raise SpecError(f"--output {path}: {written} holds results that msinfer simulate did not write; it never "
                        f"writes over them, not even with --overwrite. Give another --output (default {default})")
    return spec


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: the same one opened (a link, a hard link), or the same
    place once links in their folders are followed (a file not made yet)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def prompt_key(prompt: list[int]) -> int:
    return zlib.crc32(repr(list(prompt[:KEY_TOKENS])).encode())


class StandInRunner:
    """ModelRunner's `step` without a model (see the module docstring)."""

    def __init__(self, engine_config, timing: StandIn):
        from msinfer.sharding.config import ModelConfig
        cfg = ModelConfig.from_dir(engine_config.model_dir)
        # what a pooled sequence hands back: a vector (task embed), or a classifier's logits
        labels = len(engine_config.head_tokens) or cfg.num_labels
        self.vocab, self.hidden = cfg.vocab_size, labels if engine_config.task == "classify" else cfg.hidden_size
        self.avoid = np.array(sorted(set(cfg.eos_token_ids or ())), np.int64)     # never drawn
        self.timing = timing
        self.num_blocks, self.dtype = engine_config.blocks(), engine_config.dtype
        self.block_size = engine_config.block_size
        from msinfer.sharding.layout import Stage
        self.stage = Stage.of(engine_config.pipeline, engine_config.stage)
        self.busy_s = 0.0                     # in steps, all of them
        # the first KEY_TOKENS positions' tokens by cache slot: a sequence that starts after cached
        # blocks (prefix caching) finds its prompt's first tokens there
        self.first_tokens: dict[int, int] = {}
        self.load_s, self.load_stats, self.compile_s = 0.0, {"tensors": 0, "bytes": 0}, {}
        self.steps = StepReader()
        self.sampled: dict[int, int] = {}
        self.keys: dict[int, int] = {}        # seq_id -> its prompt's first tokens, hashed

    def draw(self, keys: np.ndarray, index: np.ndarray) -> np.ndarray:
        """The tokens of sequences whose prompts hash to `keys`, at token `index` (uint64 arrays):
        SplitMix64's finalizer of the pair, modulo the vocabulary, past the eos tokens."""
        with np.errstate(over="ignore"):
            t = (mix64(keys * np.uint64(0x9E3779B97F4A7C15) + index) % np.uint64(self.vocab)).astype(np.int64)
        if len(self.avoid):
            while (bad := np.isin(t, self.avoid)).any():
                t[bad] = (t[bad] + 1) % self.vocab
        return t

    def tokens(self, prompt: list[int], n: int) -> list[int]:
        """The first n tokens a stand-in generates after `prompt`."""
        return self.draw(np.full(n, prompt_key(prompt), np.uint64), np.arange(n, dtype=np.uint64)).tolist()

    def first(self, s: SeqStep) -> list[int]:
        """The first KEY_TOKENS tokens of a sequence at its first step: from the cache slots
        where it starts after cached tokens, then from what it feeds (which is kept for others)."""
        bs, table = self.block_size, s.block_table
        cached = [self.first_tokens.get(table[p // bs] * bs + p % bs, -1) for p in range(min(s.num_cached, KEY_TOKENS))]
        for p in range(s.num_cached, KEY_TOKENS):
            if p - s.num_cached < len(s.token_ids):
                self.first_tokens[table[p // bs] * bs + p % bs] = s.token_ids[p - s.num_cached]
        return cached + s.token_ids[:KEY_TOKENS - len(cached)]

    def step(self, seqs: list[SeqStep] | DecodeStep | DecodeChain, is_prefill: bool, logprobs: bool = True,
             released=(), hidden=None, sampled=None) -> StepOutput | list:
        """A pipeline stage (EngineConfig.pipeline) takes step_ms / stages per call, a micro-batch
        as long as a step of the whole batch: each stage holds that share of the layers. A stage
        but the last samples nothing and passes on empty hidden states; the first takes the
        tokens of its SAMPLED inputs from the last (`sampled`), like the runner."""
        if isinstance(seqs, DecodeChain):       # its steps one at a time: a stand-in's step costs its time
            return one_by_one(self.step, seqs, logprobs, released)
        t0 = time.perf_counter()
        stage = self.stage
        seqs = self.steps.read(seqs, released)
        fed = sum(len(s.token_ids) for s in seqs) if is_prefill else 0
        for seq_id in released if stage.count > 1 else ():
            self.sampled.pop(seq_id, None)
        if sampled:
            self.sampled.update(sampled)
        if not stage.last:
            self.wait(t0, fed)
            return StepOutput([], worker_s=time.perf_counter() - t0, hidden=np.zeros((fed or len(seqs), 0), np.float32))
        keys, sampled = self.keys, self.sampled
        for s in seqs:
            if s.token_ids[0] == SAMPLED and stage.first and s.seq_id not in sampled:
                raise ValueError(f"sequence {s.seq_id}: the step before sampled no token for it")
            if s.seq_id not in keys:        # its first chunk: the prompt's first tokens name its draws
                keys[s.seq_id] = prompt_key(self.first(s))
                if len(keys) > KEYS_KEPT:           # the oldest half: long finished
                    keys = self.keys = dict(list(keys.items())[KEYS_KEPT // 2:])
        rows = [s for s in seqs if s.sample]
        drawn = self.draw(np.fromiter((keys[s.seq_id] for s in rows), np.uint64, len(rows)),
                          np.fromiter((s.num_generated for s in rows), np.uint64, len(rows))).tolist()
        if len(rows) == len(seqs):
            tokens = drawn
        else:
            it = iter(drawn)
            tokens = [next(it) if s.sample else -1 for s in seqs]
        # the sampled token and the next ids after it, as a real step's k distinct most likely
        lps = [(0.0, [((t + i) % self.vocab, 0.0) for i in range(s.sampling.logprobs)])
               if t >= 0 and s.sampling.logprobs else None
               for s, t in zip(seqs, tokens)] if any(s.sampling.logprobs for s in rows) else [None]
        # task embed and classify: a vector drawn by the prompt, as its tokens are
        scores = [self.draw(np.full(self.hidden, keys[s.seq_id], np.uint64), np.arange(self.hidden, dtype=np.uint64))
                  .astype(np.float32) if s.sampling.pooling else self.target_scores(s) if s.targets
                  else None for s in seqs] if is_prefill else [None]
        self.sampled = {s.seq_id: t for s, t in zip(seqs, tokens) if t >= 0}
        self.wait(t0, fed)
        seconds = time.perf_counter() - t0
        scored = any(x is not None and len(x) for x in scores)
        return StepOutput(tokens, lps if logprobs and any(lps) else None, scores if scored else None,
                          seconds, seconds, sampled=self.sampled if stage.count > 1 else None)

    @staticmethod
    def target_scores(s: SeqStep) -> list:
        """Each target's log-probability, 0.0, and rank, 1, as ModelRunner.forward_scores gives
        them: with `prompt_logprobs: k`, the target at 0.0 k times for the k most likely third."""
        k = s.sampling.prompt_logprobs or 0
        return [(0.0, 1, [(t, 0.0)] * k) if k else (0.0, 1) for t in s.targets if t >= 0]

    def wait(self, t0: float, fed: int) -> None:
        """Until the step's time since t0 is up (StandIn; a stage's share of it)."""
        share = (self.timing.step_ms + self.timing.prefill_ms_per_token * fed) / 1e3 / self.stage.count
        time.sleep(max(0.0, share - (time.perf_counter() - t0)))
        self.busy_s += time.perf_counter() - t0


class StandInWorker(Worker):
    """A rank that runs a StandInRunner: no device, no communication group, no weights."""
    communicates = False

    def __init__(self, rank: int, world: int, device: str, timing: StandIn = StandIn()):
        super().__init__(rank, world, "cpu")
        self.timing = timing

    def info(self) -> dict:
        return {**super().info(), "device": "stand-in"}

    def join(self, engine_config, sched_host=None, sched_port=None) -> float:
        return 0.0

    def load(self, engine_config) -> dict:
        t0 = time.perf_counter()
        self.runner = StandInRunner(engine_config, self.timing)
        self.cpu0 = time.process_time()
        return {"rank": self.tp.rank, "comm_init_s": 0.0, "load_s": 0.0, "setup_s": time.perf_counter() - t0,
                "param_bytes": 0, "num_blocks": self.runner.num_blocks, "dtype": self.runner.dtype}

    def stats(self) -> dict:
        return {**super().stats(), "cpu_s": time.process_time() - self.cpu0,       # since setup
                "stage": self.runner.stage.index, "busy_s": self.runner.busy_s}


def cpu_seconds(controller) -> dict:
    """CPU-seconds so far by role: the driver (this process, less an engine running in it), of
    which its loop (this thread: reading, dealing, receiving and writing records; the rest is
    Ray's threads, the writer's disk syncs and the progress bar), the engines (their own
    threads), the stand-in workers (their processes, less the engines hosted in rank 0's). Called
    from the thread that runs the controller's loop."""
    import ray
    from msinfer.launcher.engine import LocalEngine
    workers = ray.get([w.stats.remote() for s in controller.slots for w in s.replica.workers], timeout=60)
    engines = controller.engine_stats()
    stages: dict[int, list[float]] = {}                 # stage -> busy seconds of each of its ranks
    for st in workers:
        stages.setdefault(st.get("stage", 0), []).append(st.get("busy_s", 0.0))
    local = sum(s.replica.engine.engine.engine_stats()["cpu_s"] for s in controller.slots
                if isinstance(s.replica.engine, LocalEngine))
    engine_s = sum(st["cpu_s"] for st in engines)
    return {"driver": time.process_time() - local, "driver_loop": time.thread_time(), "engines": engine_s,
            "workers": sum(st.get("cpu_s", 0.0) for st in workers) - (engine_s - local),
            "stage_busy_s": [sum(v) / len(v) for _, v in sorted(stages.items())]}


def capacity(summary: dict, spec, timing: StandIn, cpu0: dict, cpu1: dict) -> dict:
    """The simulation's figures: throughput against the stand-ins' ceiling, and the CPU each
    process role spent while records were served (`cpu_seconds` before and after): the driver
    (and its loop), the engines (also per step they ran), the stand-in workers. CPU-seconds are
    given to the millisecond: a small job's loop spends a few."""
    dp, tp, pp = spec.parallel.data_parallel, spec.parallel.tensor_parallel, spec.parallel.pipeline_parallel
    st = summary.get("steps") or {}
    steps = st.get("prefill_steps", 0) + st.get("decode_steps", 0)
    driver_cpu_s, loop_cpu_s, engine_cpu_s, worker_cpu_s = (cpu1[k] - cpu0[k] for k in
                                                            ("driver", "driver_loop", "engines", "workers"))
    gen_s = summary.get("generation_s") or 0.0
    tokens, records = summary.get("completion_tokens") or 0, summary.get("records_done") or 0
    ceiling = dp * spec.scheduler.max_batch_size * 1e3 / timing.step_ms
    pipeline = {}
    if pp > 1 and gen_s:        # the pipeline's bubble: the share of each stage's time it waited
        busy = [b1 - b0 for b0, b1 in zip(cpu0["stage_busy_s"], cpu1["stage_busy_s"])]
        pipeline = {"pipeline_parallel": pp, "stage_idle_share": [round(max(0.0, 1 - b / gen_s), 3) for b in busy]}
    return {
        "step_ms": timing.step_ms, "prefill_ms_per_token": timing.prefill_ms_per_token, **pipeline,
        "replicas": dp, "workers": dp * tp * pp,
        "ceiling_tokens_per_s": round(ceiling, 1),
        "tokens_per_s": summary.get("tokens_per_s"),
        "of_ceiling": round((summary.get("tokens_per_s") or 0.0) / ceiling, 3),
        "records_per_s": round(records / gen_s, 2) if gen_s else None,
        "driver_cpu_s": round(driver_cpu_s, 3),
        "driver_cpu_us_per_token": round(1e6 * driver_cpu_s / tokens, 2) if tokens else None,
        "driver_cpu_us_per_record": round(1e6 * driver_cpu_s / records, 1) if records else None,
        "driver_loop_cpu_s": round(loop_cpu_s, 3),
        "driver_loop_cpu_us_per_record": round(1e6 * loop_cpu_s / records, 1) if records else None,
        "engine_cpu_s": round(engine_cpu_s, 3),
        "engine_cpu_ms_per_step": round(1e3 * engine_cpu_s / steps, 3) if steps else None,
        "worker_cpu_s": round(worker_cpu_s, 3),
    }
