"""A batch job from spec to results file: `plan_job` checks everything before anything starts,
`run_job` starts the replicas and streams one result per record to the output file.

One record's path: input line -> Record (launcher.inputs) -> dealt by the driver
(launcher.controller) to a replica's engine (launcher.engine), where it becomes a Sequence
(launcher.records, launcher.tokenizer) in that replica's scheduler -> steps on the workers ->
its result line, formatted in the engine -> written by the driver (launcher.writer).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

from msinfer.launcher.errors import SpecError, SystemicError, UserError
from msinfer.launcher.inputs import check_input, is_openai_batch, read_records
from msinfer.launcher.records import Done
from msinfer.launcher.spec import JobSpec
from msinfer.launcher.tokenizer import Tokenizer, load_tokenizer
from msinfer.launcher.writer import ResultWriter, Stats, check_output, status_path, summary_path, write_json_atomic
from msinfer.sharding.config import (BLOCK_MULTIPLE, EMULATE_ENV, HEAD_SIZES, EngineConfig, ModelConfig,
                                    ModelConfigError, ascend_emulated, resolve_device, resolve_dtype, shapes_problem)
from msinfer.sharding.layout import (LayoutError, bytes_per_rank, check_tp, divisors_problem, plan_tensors,
                                    valid_tp_sizes)
from msinfer.worker.loader import CheckpointError, check_checkpoint, check_model_dir
from msinfer.worker.lora import check_adapter
from msinfer.worker.positions import make_scheme

DEFAULT_MAX_MODEL_LEN = 4096
SAME_CAUSE_STOP = 100           # failed results, all alike and none succeeded before them: the job stops


@dataclass
class Plan:
    spec: JobSpec
    model: ModelConfig
    tokenizer: Tokenizer | None
    engine: EngineConfig
    device: str
    weight_bytes_per_rank: int
    kv_bytes_per_rank: int
    checkpoint_bytes: int
    notes: list[str] = field(default_factory=list)
    card: CardPlan | None = None          # accelerators: the memory of one card, as planned
    output_format: str = "msinfer"        # output.format resolved: "msinfer" | "openai"

    def describe(self) -> str:
        s, m = self.spec, self.model
        tp, dp = s.parallel.tensor_parallel, s.parallel.data_parallel
        gib = 1024 ** 3
        lines = [
            f"model       {s.model.path}",
            f"            {m.architecture}: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_heads} "
            f"(kv {m.num_kv_heads}, head_dim {m.head_dim}), vocab {m.vocab_size}, checkpoint "
            f"{self.checkpoint_bytes / gib:.2f} GiB",
            f"parallel    {dp} replica(s) x tensor parallel {tp} = {dp * tp} worker(s) on {self.device}, "
            f"placement {s.parallel.placement}, compute dtype {self.engine.dtype}",
            f"per rank    weights {self.weight_bytes_per_rank / gib:.3f} GiB + KV cache "
            f"{self.kv_bytes_per_rank / gib:.3f} GiB ({self.engine.blocks()} blocks x {self.engine.block_size} "
            f"tokens) = {(self.weight_bytes_per_rank + self.kv_bytes_per_rank) / gib:.3f} GiB",
            f"sequences   max_model_len {self.engine.max_model_len}, batch <= {s.scheduler.max_batch_size}, "
            f"<= {s.scheduler.max_batched_tokens} tokens per step, prefix caching "
            + ("on (a prompt starts after its longest run of cached KV blocks)" if s.scheduler.prefix_caching
               else "off"),
            f"input       {s.input.path}" + ("" if self.tokenizer else "  (no tokenizer: prompt_token_ids only)"),
            f"output      {s.output.path}",
            f"ray         {s.ray.address or 'embedded local Ray'}",
        ]
        lines.append("layout      " + layout_summary(m, tp, s.parallel.expert_parallel))
        if m.is_moe:
            lines.append("experts     " + experts_summary(m, tp, s.parallel.expert_parallel,
                                                          2 if self.engine.dtype in ("float16", "bfloat16") else 4))
        if self.card is not None:
            lines.append("card        " + self.card.describe())
        return "\n".join(lines + [f"note        {n}" for n in self.notes])


def layout_summary(m: ModelConfig, tp: int, ep: bool = False) -> str:
    if tp == 1:
        return "tp 1: every rank holds every tensor whole"
    kv = "split" if m.num_kv_heads % tp == 0 else f"replicated on {tp // m.num_kv_heads} ranks each"
    mlp = f"mlp {m.intermediate_size}/{tp} columns"
    if m.is_moe:
        mlp = (f"experts {m.num_experts}/{tp} whole per rank" if ep else
               f"every expert's {m.moe_intermediate_size} columns /{tp}") + ", router replicated"
    return (f"q heads {m.num_heads}/{tp} per rank, kv heads {kv}, {mlp}, vocab rows {m.vocab_size}/{tp}, "
            f"norms replicated")


def experts_summary(m: ModelConfig, tp: int, ep: bool, dbytes: int) -> str:
    """Per-rank bytes of the experts and of the rest in both layouts, and the sizes each allows."""
    gib = 1024 ** 3
    parts = []
    for layout, flag in (("sliced", False), ("expert parallel", True)):
        if divisors_problem(m, tp, flag):
            sizes = ", ".join(map(str, valid_tp_sizes(m, ep=flag)))
            parts.append(f"{layout}: does not fit tp {tp} (tensor_parallel {sizes})")
            continue
        experts = bytes_per_rank(m, tp, dbytes, flag, experts=True)
        rest = bytes_per_rank(m, tp, dbytes, flag, experts=False)
        chosen = " (chosen)" if flag == ep else ""
        parts.append(f"{layout}{chosen}: experts {experts / gib:.3f} GiB + the rest {rest / gib:.3f} GiB per rank")
    return (f"{m.num_experts} per sparse layer ({len(m.sparse_layers)} of {m.num_layers}), top "
            f"{m.num_experts_per_tok}; " + "; ".join(parts))


def verification_note(device: str, emulate: bool, ops: str) -> str:
    """How the chosen device path is verified, for `plan` (docs/ascend.md says the same)."""
    if device == "cpu":
        return "verified here by running: the CPU path is tested against transformers"
    if ops == "portable":
        return ("ascend with portable MindSpore operators: the same network is tested on the CPU against "
                "transformers; never run on a card here")
    if emulate:
        return (f"ascend EMULATED on the CPU ({EMULATE_ENV}=1): the fused kernels are stand-ins with their "
                f"documented semantics; everything around them is what a card runs")
    return ("ascend fused kernels: verified by emulation against MindSpore's documented contracts, never on a "
            "card here; if a kernel fails, model.ops: portable runs the same model without them")


def check_ops(spec: JobSpec, m: ModelConfig, device: str, notes: list[str]) -> None:
    """What the chosen operators need of the spec: block sizes and head sizes for Ascend's kernels,
    static shapes for the CPU kernels."""
    if problem := shapes_problem(device, spec.model.ops, spec.model.shapes):
        raise LayoutError(problem)
    if device == "ascend" and spec.model.ops == "auto":
        bs = spec.scheduler.block_size
        if bs % BLOCK_MULTIPLE:
            raise LayoutError(f"scheduler.block_size {bs}: Ascend's ReshapeAndCache and PagedAttention take blocks "
                              f"of a multiple of {BLOCK_MULTIPLE} tokens (128 is usual on cards); or set model.ops: "
                              f"portable")
        if m.head_dim not in HEAD_SIZES:
            notes.append(f"head_dim {m.head_dim} is not among the head sizes vllm-mindspore runs Ascend's attention "
                         f"kernels with ({', '.join(map(str, HEAD_SIZES))}); if a card refuses it, model.ops: "
                         f"portable runs the model without them")


HOST_MEMORY_FRACTION = 0.8     # of this machine's memory that the weights and KV caches of its workers may take


def host_memory_problem(ranks: int, weights: int, kv: int) -> str | None:
    """Why `ranks` workers computing on this machine's CPU, each holding `weights` bytes of weights
    and `kv` bytes of KV cache, do not fit in HOST_MEMORY_FRACTION of its memory (None if they do).
    `plan` and `bench` both ask it."""
    import psutil
    have, gib = psutil.virtual_memory().total, 1024 ** 3
    if ranks * (weights + kv) <= HOST_MEMORY_FRACTION * have:
        return None
    return (f"{ranks} worker(s) x (weights {weights / gib:.2f} GiB + KV cache {kv / gib:.2f} GiB) = "
            f"{ranks * (weights + kv) / gib:.1f} GiB is more than {HOST_MEMORY_FRACTION:.0%} of this machine's "
            f"{have / gib:.1f} GiB")


def kv_block_bytes(m: ModelConfig, tp: int, block_size: int, dbytes: int) -> int:
    """K and V of every layer for one cache block, on one rank."""
    return 2 * m.num_layers * max(1, m.num_kv_heads // tp) * m.head_dim * dbytes * block_size


@dataclass(frozen=True)
class CardPlan:
    """One card of an accelerator replica: what it holds, in bytes."""
    memory: int               # the card's memory
    assumed: bool             # memory is the default, not parallel.device_memory_gb
    fraction: float
    weights: int
    activations: int          # the largest step's intermediates and logits (an estimate)
    runtime: int              # workspace and communication buffers (an estimate)
    kv: int
    blocks: int

    def describe(self) -> str:
        gib = 1024 ** 3
        return (f"{self.memory / gib:.3g} GiB{' (assumed: set parallel.device_memory_gb)' if self.assumed else ''} x "
                f"{self.fraction:g} = {self.fraction * self.memory / gib:.2f} GiB for weights {self.weights / gib:.2f}"
                f" + activations {self.activations / gib:.2f} + runtime {self.runtime / gib:.2f} + KV cache "
                f"{self.kv / gib:.2f} GiB ({self.blocks} blocks)")


CARD_MEMORY_GB = 64           # an Atlas 800T A2's 910B card, when parallel.device_memory_gb is not set
RUNTIME_BYTES = 2 * 1024 ** 3  # per card: the runtime's workspace and HCCL buffers (an estimate, not measured)


def card_plan(spec: JobSpec, m: ModelConfig, engine: EngineConfig, weights: int, dbytes: int) -> CardPlan:
    """The KV cache a card holds after weights, the largest step's activations and the runtime's
    share, within parallel.memory_fraction of its memory: as many blocks as fit, at most what
    max_batch_size sequences of max_model_len need (or scheduler.kv_cache_blocks, which must fit).
    Refuses a layout that leaves no room for one sequence of max_model_len, naming the smallest
    tensor_parallel that leaves it."""
    p, tp = spec.parallel, spec.parallel.tensor_parallel
    memory = int((p.device_memory_gb or CARD_MEMORY_GB) * 1024 ** 3)
    activations, block, fits = card_room(spec, m, engine, tp, weights, dbytes)
    blocks = engine.blocks() if engine.num_blocks else min(fits, engine.blocks())
    one_seq = -(-engine.max_model_len // engine.block_size)
    gib = 1024 ** 3
    if blocks > fits or fits < one_seq:
        need = blocks if engine.num_blocks else one_seq
        larger = (t for t in valid_tp_sizes(m, ep=p.expert_parallel) if t > tp)
        fit = next(((t, w) for t in larger for w in [bytes_per_rank(m, t, dbytes, p.expert_parallel)]
                    if card_room(spec, m, engine, t, w, dbytes)[2] >= need), None)
        raise LayoutError(
            f"the layout does not fit a {memory / gib:.3g} GiB card at memory_fraction {p.memory_fraction:g}: weights "
            f"{weights / gib:.2f} GiB + activations {activations / gib:.2f} + runtime {RUNTIME_BYTES / gib:.2f} leave "
            f"room for {fits} KV blocks of {engine.block_size} tokens, and "
            + (f"scheduler.kv_cache_blocks asks for {blocks}" if blocks > fits else
               f"one sequence of max_model_len {engine.max_model_len} needs {one_seq}")
            + (f"; parallel.tensor_parallel {fit[0]} fits ({fit[1] / gib:.2f} GiB of weights a card)" if fit else
               "; no larger parallel.tensor_parallel fits")
            + ", or lower model.max_model_len or scheduler.max_batched_tokens")
    return CardPlan(memory, p.device_memory_gb is None, p.memory_fraction, weights, activations, RUNTIME_BYTES,
                    (blocks + 1) * block, blocks)


def card_room(spec: JobSpec, m: ModelConfig, engine: EngineConfig, tp: int, weights: int,
              dbytes: int) -> tuple[int, int, int]:
    """(activation bytes of the largest step, bytes of a KV block, KV blocks that fit) on one card of
    a tensor-parallel group of tp holding `weights`. A sparse layer's activations are its k routed
    copies of each token and their intermediate rows (the grouped matmuls' buffers)."""
    p = spec.parallel
    budget = int(p.memory_fraction * (p.device_memory_gb or CARD_MEMORY_GB) * 1024 ** 3)
    tokens, rows = spec.scheduler.max_batched_tokens, spec.scheduler.max_batch_size
    mlp = 2 * m.intermediate_size // tp
    if m.is_moe:
        inter = m.moe_intermediate_size // (1 if p.expert_parallel else tp)
        mlp = max(mlp if len(m.sparse_layers) < m.num_layers else 0,
                  m.num_experts_per_tok * (2 * m.hidden_size + 2 * inter))
    per_token = (4 * m.hidden_size + mlp + (m.num_heads + 2 * max(1, m.num_kv_heads // tp)) * m.head_dim // tp) * dbytes
    # float32 logits: the rank's vocabulary shard and the device sampler's few copies of it, and the
    # whole rows gathered once for a step whose sampling changes its logits on the host
    activations = tokens * per_token + rows * (4 * -(-m.vocab_size // tp) + m.vocab_size) * 4
    block = kv_block_bytes(m, tp, engine.block_size, dbytes)
    return activations, block, max(0, (budget - weights - activations - RUNTIME_BYTES) // block - 1)  # - scratch


def plan_job(spec: JobSpec, check_io: bool = True, weights: bool = True) -> Plan:
    """Every check that can fail, before Ray starts. Raises a UserError-like exception.
    `check_io=False` skips the input and output files (the Python API has neither);
    `weights=False` the checkpoint's tensors and the memory they need (`msinfer simulate`)."""
    check_model_dir(spec.model.path)
    m = ModelConfig.from_dir(spec.model.path)
    if spec.model.max_model_len is None:
        spec = spec.with_max_model_len(min(m.max_position_embeddings, DEFAULT_MAX_MODEL_LEN))
    tp, ep = spec.parallel.tensor_parallel, spec.parallel.expert_parallel
    check_tp(m, tp, ep)
    plans = plan_tensors(m, tp, ep)
    ckpt_bytes = check_checkpoint(spec.model.path, plans, spec.model.allow_pickle) if weights else 0
    tokenizer = load_tokenizer(spec.model.tokenizer_path, spec.model.trust_remote_code)
    if tokenizer is not None and spec.input.chat_template:
        tokenizer.check_chat_template()
    if check_io:
        check_input(spec.input.path)
        check_output(spec.output.path)
    device = resolve_device(spec.parallel.device)
    emulate = device == "ascend" and ascend_emulated()
    try:
        dtype = resolve_dtype(spec.model.dtype, m, device, emulate)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    notes = []
    if spec.model.max_model_len > m.max_position_embeddings:
        notes.append(f"max_model_len {spec.model.max_model_len} exceeds the model's max_position_embeddings "
                     f"{m.max_position_embeddings}")
    engine = EngineConfig(model_dir=spec.model.path, dtype=dtype, device=device,
                          max_model_len=spec.model.max_model_len, max_batch_size=spec.scheduler.max_batch_size,
                          num_blocks=spec.scheduler.kv_cache_blocks or 0, block_size=spec.scheduler.block_size,
                          graph_mode=spec.model.graph_mode, position_scheme=spec.model.positions.scheme,
                          allow_pickle=spec.model.allow_pickle, ops=spec.model.ops, shapes=spec.model.shapes,
                          emulate=emulate, tokenizer_path=spec.model.tokenizer_path,
                          trust_remote_code=spec.model.trust_remote_code, expert_parallel=ep)
    engine = dataclasses.replace(engine, **model_extensions(spec, m, plans, notes))
    check_ops(spec, m, device, notes)
    dbytes = 2 if dtype in ("float16", "bfloat16") else 4
    weight_bytes = bytes_per_rank(m, tp, dbytes, ep)
    card = None
    if device == "ascend":
        card = card_plan(spec, m, engine, weight_bytes, dbytes)
        engine = dataclasses.replace(engine, num_blocks=card.blocks)
    kv = kv_block_bytes(m, tp, engine.block_size, dbytes) * (engine.blocks() + 1)      # + the scratch block
    if engine.on_cpu and weights:
        ranks_here = tp * spec.parallel.data_parallel if not spec.ray.address else tp
        if problem := host_memory_problem(ranks_here, weight_bytes, kv):
            raise LayoutError(f"{problem}; lower scheduler.kv_cache_blocks (now {engine.blocks()}), "
                              f"scheduler.max_batch_size or model.max_model_len")
    check_structured(spec.sampling, tokenizer)
    notes.append(verification_note(device, emulate, spec.model.ops))
    output_format = spec.output.format
    if output_format == "auto":
        output_format = "openai" if check_io and is_openai_batch(spec.input.path) else "msinfer"
    if output_format == "openai" and spec.task == "score":
        raise SpecError("output.format openai has no place for scoring results (task: score); use output.format: "
                        "msinfer")
    return Plan(spec, m, tokenizer, engine, device, weight_bytes, kv, ckpt_bytes, notes, card, output_format)


def check_structured(sampling, tokenizer) -> None:
    """The job's default structured output (sampling.structured_outputs), read once before any
    worker starts; a record's own is checked where it is read (launcher.records)."""
    if sampling.structured_outputs is None:
        return
    if tokenizer is None:
        raise SpecError("sampling.structured_outputs: the model has no tokenizer to build token masks with")
    from llguidance import LLMatcher
    try:
        error = LLMatcher.validate_grammar(sampling.to_params().structured, None)
    except ValueError as e:
        error = str(e)
    if error:
        raise SpecError(f"sampling.structured_outputs: {error.strip()}")


def model_extensions(spec: JobSpec, m: ModelConfig, plans, notes: list[str]) -> dict:
    """EngineConfig fields of model.positions and model.lora, checked here: the scheme's options,
    and the adapter against the checkpoint's tensor shapes (headers only)."""
    positions, lora = spec.model.positions, spec.model.lora
    options = {"ratio": positions.ratio} if positions.scheme == "rope2d" else {}
    try:
        scheme = make_scheme(positions.scheme, **options)
    except ValueError as e:
        raise SpecError(str(e)) from None
    if positions.scheme == "rope2d":
        half = m.head_dim // 2
        notes.append(f"positions rope2d: {len(scheme.branch_pairs(half))} of {half} rotary frequency pairs carry "
                     f"the branch id (0 for plain prompts), the others the token's position")
    fields = {"position_options": options}
    if lora is not None:
        n = check_adapter(lora.path, lora.scale, plans)
        notes.append(f"LoRA adapter {lora.path}: {n} modules merged into the weights as they load "
                     f"(scale {lora.scale:g})")
        fields.update(lora_path=lora.path, lora_scale=lora.scale)
    return fields


USER_ERRORS = (UserError, ModelConfigError, LayoutError, CheckpointError)


def count_lines(path: str) -> int | None:
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
            return pq.ParquetFile(path).metadata.num_rows
        except Exception:
            return None
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


class JobRun:
    """One pass of records through a started controller, on the driver's side: skipping records
    already done, results to `sink` (the results file's writer), streamed text, stats, the
    progress bar and the status file. What happens to a record in between is the engines'
    (launcher.engine, launcher.records)."""

    def __init__(self, plan: Plan, controller, sink, done_ids=frozenset(), stream: bool = False,
                 progress: bool = True, status: bool = True, flush=None):
        """sink(record_id, line): one result line, JSON without its newline; flush(): writes the
        lines given so far (called once per pass of the controller's loop, and at the end)."""
        self.plan, self.spec = plan, plan.spec
        self.controller, self.sink, self.done_ids, self.status = controller, sink, done_ids, status
        self.flush = flush or (lambda: None)
        self.stats = Stats()
        self.t_gen: float | None = None
        self.t_first_result: float | None = None
        self.stream, self.last_streamed = stream, None
        self.status_t = 0.0
        self.tokens_done = 0
        self.held: list | None = []           # failed results held back until one succeeds (`_hold`)
        self.bar = None
        if progress and status:
            from tqdm import tqdm
            self.bar = tqdm(total=count_lines(self.spec.input.path), unit="rec", dynamic_ncols=True,
                            file=sys.stderr, desc="msinfer", disable=None)

    def run(self, records) -> None:
        self.controller.run(self.new_records(records), self.on_done, self.on_stream if self.stream else None,
                            self.on_tick)
        self.flush_held()
        self.flush()

    def new_records(self, records):
        """The records whose results are not in the results file yet."""
        for rec in records:
            if rec.id in self.done_ids:
                self.stats.skipped += 1
                self._tick()
                continue
            if self.t_gen is None:
                self.t_gen = time.perf_counter()
            yield rec

    def on_done(self, done: Done, rec) -> None:
        if self.held is not None:
            self._hold(done, rec)
            return
        self._emit(done, rec)

    def _hold(self, done: Done, rec) -> None:
        """Until a record succeeds, failed ones are held back: when the first SAME_CAUSE_STOP
        records of the run (in input order) all failed alike, the cause is not in the records (a
        template the tokenizer cannot render, a vocabulary the inputs were not made for), and the
        job stops without their error lines, so that a re-run after the fix computes them."""
        if done.failed:
            self.held.append((done, rec))
            if len(self.held) < SAME_CAUSE_STOP:
                return
            causes = {d.cause for d, _ in self.held}
            first = {d.serial for d, _ in self.held} >= set(range(SAME_CAUSE_STOP))
            if first and len(causes) == 1:
                raise SystemicError(
                    f"the first {len(self.held)} records all failed alike (record '{self.held[0][1].id}' was the "
                    f"first): {causes.pop()}. That is not one record's fault, so the job stops without writing "
                    f"their error lines; fix the cause and run the job again")
        self.flush_held()
        if not done.failed:
            self._emit(done, rec)

    def flush_held(self) -> None:
        held, self.held = self.held or [], None
        for d, r in held:
            self._emit(d, r)

    def _emit(self, done: Done, rec) -> None:
        self.sink(rec.id, done.line)
        if self.t_first_result is None:
            self.t_first_result = time.perf_counter()
        self.stats.count(done.failed, done.prompt_tokens, done.completion_tokens, done.ttft_s)
        self._tick(done.completion_tokens)

    def on_stream(self, key: str, text: str) -> None:
        if self.last_streamed != key:
            sys.stdout.write(f"\n[{key}] ")
            self.last_streamed = key
        sys.stdout.write(text)
        sys.stdout.flush()

    def on_tick(self) -> None:
        self.flush()
        if time.perf_counter() - self.status_t > self.spec.output.status_interval_s:
            self.write_status("running")

    def _tick(self, tokens: int = 0) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.tokens_done += tokens
            el = self.bar.format_dict.get("elapsed") or 0
            if el > 0:
                self.bar.set_postfix(tok_s=f"{self.tokens_done / el:.1f}", refresh=False)

    # ---- status and summary -------------------------------------------------------------------
    def workers(self) -> list[dict]:
        return self.controller.ranks() if self.controller else []

    def write_status(self, state: str) -> None:
        self.status_t = time.perf_counter()
        if not self.status:
            return
        s = self.stats
        write_json_atomic(status_path(self.spec.output.path), {
            "state": state, "updated_unix": time.time(), "records_done": s.done, "records_failed": s.failed,
            "records_skipped": s.skipped, "completion_tokens": s.completion_tokens,
            "replica_restarts": self.controller.restarts if self.controller else 0,
            "workers": self.workers()}, durable=state != "running")

    def summary(self, startup_s: float) -> dict:
        gen_s = (time.perf_counter() - self.t_gen) if self.t_gen else 0.0
        out = self.stats.summary(startup_s, gen_s)
        out["replica_restarts"] = self.controller.restarts if self.controller else 0
        out["restart_reasons"] = list(self.controller.restart_log) if self.controller else []
        out["spec"] = self.spec.resolved()
        out["replicas"] = self.workers()
        if self.controller:
            out["setup"] = [info for s in self.controller.slots for info in s.replica.setup_info]
            out["steps"] = self.controller.step_stats()
        return out


STAND_IN_CPUS = 0.01           # Ray's share for a stand-in worker: placement needs some resource


def make_controller(plan: Plan, simulate=None, stream: bool = False):
    """The job's controller; with `simulate` (a launcher.simulate.StandIn), on stand-in workers
    that ask Ray for a hundredth of a CPU each and no card. `stream`: the engines report text as
    it grows."""
    from msinfer.launcher.controller import Controller, ControllerConfig
    from msinfer.launcher.engine import EngineSetup

    spec = plan.spec
    tp, dp = spec.parallel.tensor_parallel, spec.parallel.data_parallel
    # one replica on an embedded Ray: its engine in this process (launcher.engine.LocalEngine)
    local = dp == 1 and not spec.ray.address
    cfg = dict(
        engine_config=plan.engine, tokenizer=plan.tokenizer if local else False,
        engine_setup=EngineSetup(spec, plan.model, plan.engine, plan.output_format, stream, local,
                                 **EngineSetup.intervals(dp, local)),
        tensor_parallel=tp, data_parallel=dp, device=plan.device,
        placement=spec.parallel.placement, cpus_per_worker=spec.ray.num_cpus_per_worker,
        # cores shared by all workers on an embedded Ray, by a packed replica on a cluster
        threads_per_worker=threads_per_worker(tp * dp if not spec.ray.address else tp) if plan.engine.on_cpu else 0,
        max_restarts=spec.fault.max_replica_restarts, step_timeout_s=spec.fault.step_timeout_s,
        startup_timeout_s=spec.fault.startup_timeout_s)
    if simulate is not None:
        from msinfer.launcher.simulate import StandInWorker
        cfg.update(worker_cls=simulate.worker_cls or StandInWorker, worker_options={"timing": simulate}, device="cpu",
                   cpus_per_worker=STAND_IN_CPUS, threads_per_worker=0)
    return Controller(ControllerConfig(**cfg))


def start_controller(plan: Plan, simulate=None, stream: bool = False):
    """Ray (embedded or joined) and every replica ready. Returns (controller, started_ray)."""
    import ray
    from msinfer.launcher.replica import init_ray

    spec = plan.spec
    started_ray = not ray.is_initialized()
    workers = spec.parallel.tensor_parallel * spec.parallel.data_parallel
    init_ray(spec.ray.address, int(workers * spec.ray.num_cpus_per_worker + 1), spec.ray.dashboard,
             npus=workers if plan.engine.emulate and simulate is None else 0)
    controller = make_controller(plan, simulate, stream)
    try:
        controller.start()
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    return controller, started_ray


def run_job(spec: JobSpec, *, overwrite: bool = False, stream: bool = False, progress: bool = True,
            t_start: float | None = None, simulate=None) -> dict:
    """Runs a job to the end; returns the summary (also written to <output>.summary.json).
    `simulate` (a launcher.simulate.StandIn): on stand-in workers, with the summary's `simulate`
    figures (see launcher/simulate.py)."""
    import ray

    t_start = time.perf_counter() if t_start is None else t_start
    plan = plan_job(spec, weights=simulate is None)
    spec = plan.spec
    writer = ResultWriter(spec.output.path, overwrite, spec.output.fsync_interval_s,
                          "custom_id" if plan.output_format == "openai" else "id")
    job = JobRun(plan, None, writer.write_line, writer.done_ids, stream, progress, flush=writer.flush)
    started_ray = False
    try:
        job.write_status("starting")
        controller, started_ray = start_controller(plan, simulate, stream)
        job.controller = controller
        startup_s = time.perf_counter() - t_start
        job.write_status("running")
        if simulate is not None:
            from msinfer.launcher.simulate import capacity, cpu_seconds
            cpu0 = cpu_seconds(controller)
        job.run(read_records(spec.input.path))
        summary = job.summary(startup_s)
        if simulate is not None:
            summary["simulate"] = capacity(summary, spec, simulate, cpu0, cpu_seconds(controller))
        if job.t_first_result is not None:
            summary["first_result_s"] = round(job.t_first_result - t_start, 3)
        write_json_atomic(summary_path(spec.output.path), summary)
        job.write_status("done")
        return summary
    except BaseException:
        try:
            job.write_status("failed")
        except Exception:
            pass
        raise
    finally:
        if job.bar is not None:
            job.bar.close()
        if job.stream:
            sys.stdout.write("\n")
        if job.controller is not None:
            job.controller.shutdown()
        writer.close()
        if started_ray and ray.is_initialized():
            ray.shutdown()


def threads_per_worker(workers_on_node: int) -> int:
    """Intra-op threads per worker so the node's cores are shared, not oversubscribed."""
    return max(1, (os.cpu_count() or 1) // max(1, workers_on_node))
