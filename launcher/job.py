"""A batch job from spec to results file: `plan_job` checks everything before anything starts,
`run_job` starts the replicas and streams one result per record to the output file.

One record's path: input line -> Record (launcher.inputs) -> dealt by the driver
(launcher.controller) to a replica's engine (launcher.engine), where it becomes a Sequence
(launcher.records, launcher.tokenizer) in that replica's scheduler -> steps on the workers ->
its result line, formatted in the engine -> written by the driver (launcher.writer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from msinfer.launcher.drain import SIGNALS, Drain, parse_deadline, slurm_time_left
from msinfer.launcher.embed import resolve_pooling
from msinfer.launcher.errors import InputError, OutputError, SpecError, SystemicError, Terminated, UserError
from msinfer.launcher.idset import IdSet, chunks
from msinfer.launcher.inputs import (check_chat, check_input, expected_length, file_label, input_files,
                                    is_openai_batch, line_id, location, longest_first, reads_back, unit_of)
from msinfer.launcher.metrics import check_port
from msinfer.launcher.records import Done, matryoshka_problem, outside_vocabulary
from msinfer.launcher.shards import check_shard_by, for_shard, shard_files, shard_input
from msinfer.launcher.spec import JobSpec
from msinfer.launcher.tokenizer import TOKENIZER_FILES, Tokenizer, check_reasoning_tokens, load_tokenizer
from msinfer.launcher.tools import check_parser_tokens
from msinfer.launcher.writer import (DIGEST_DROPPED, FAILED, ResultsLock, ResultWriter, Stats, check_output,
                                     digest_value, held_ids, holds_results, input_digest_index, kept_settings,
                                     not_a_result, read_summary, recorded_ids, result_id, status_path,
                                     summary_path, write_json_atomic)
from msinfer.sharding.config import (BLOCK_MULTIPLE, EMULATE_ENV, HEAD_SIZES, EngineConfig, ModelConfig,
                                    ModelConfigError, ascend_emulated, bf16_panels_on, card_dtype, cpu_bfloat16,
                                    cpu_kernels, cpu_kv_cache_dtype, dtype_bytes, emulate_variants, emulated_memory,
                                    emulated_note, fused, int4_on, POOLING_TASKS, ops_problem, resolve_device,
                                    resolve_dtype)
from msinfer.sharding.layout import (LayoutError, Stage, bytes_per_rank, check_tp, divisors_problem, plan_tensors,
                                    stage_layers, valid_tp_sizes)
from msinfer.worker.loader import CheckpointError, check_checkpoint, check_model_dir, holds_weights
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
    weights_absent: bool = False          # sized from config.json alone (`msinfer plan` before a download)
    sampling_from_model: tuple = ()       # the sampling keys taken from generation_config.json (model_sampling)

    @property
    def bf16(self) -> bool:
        """Whether the workers hold a bfloat16 checkpoint's matmul weights in bfloat16 (holds_bfloat16)."""
        return holds_bfloat16(self.engine.device, self.engine.ops, self.spec.model.lora is not None)

    @property
    def pairs(self) -> bool:
        """Whether the workers hold the matmul weights in bfloat16 pairs (computing in bfloat16)."""
        return self.engine.matmul_dtype == "bfloat16"

    def describe(self) -> str:
        s, m = self.spec, self.model
        tp, dp, pp = s.parallel.tensor_parallel, s.parallel.data_parallel, s.parallel.pipeline_parallel
        gib = 1024 ** 3
        stages = f" x pipeline stages {pp}" if pp > 1 else ""
        lines = [
            f"model       {s.model.path}",
            f"            {m.architecture}: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_heads} "
            + (f"(kv {m.num_kv_heads}, head_dim {m.head_dim})" if m.mla is None else
               f"(latent attention: q/k {m.mla.qk_head_dim}, v {m.mla.v_head_dim})")
            + f", vocab {m.vocab_size}, checkpoint "
            + (f"absent (about {self.checkpoint_bytes / gib:.2f} GiB in the config's dtype"
               + ("; the quantized checkpoint's files hold less" if m.quant is not None else "") + ")"
               if self.weights_absent else f"{self.checkpoint_bytes / gib:.2f} GiB"),
            f"parallel    {dp} replica(s){stages} x tensor parallel {tp} = {dp * pp * tp} worker(s) on {self.device}, "
            f"placement {s.parallel.placement}, compute dtype {self.engine.dtype}"
            + (f" ({self.engine.in_matmul_dtype(m)} {self.engine.matmul_dtype})" if self.engine.matmuls_apart
               else "") + self.engine.kv_named(),
            f"per rank    weights {self.weight_bytes_per_rank / gib:.3f} GiB + KV cache "
            f"{self.kv_bytes_per_rank / gib:.3f} GiB ({self.engine.blocks()} blocks x {self.engine.block_size} "
            f"tokens) = {(self.weight_bytes_per_rank + self.kv_bytes_per_rank) / gib:.3f} GiB",
            f"sequences   max_model_len {self.engine.max_model_len}, batch <= {s.scheduler.max_batch_size}"
            + (f" (the KV cache holds {full} of max_model_len; shorter ones fill the rest)"
               if (full := self.engine.blocks() // -(-self.engine.max_model_len // self.engine.block_size))
               < s.scheduler.max_batch_size else "") + ", "
            f"<= {s.scheduler.max_batched_tokens} tokens per step, prefix caching "
            + ("on (a prompt starts after its longest run of cached KV blocks)" if s.scheduler.prefix_caching
               else "off"),
            f"input       {s.input.path}{input_note(s.input.path)}"
            + ("" if self.tokenizer else "  (no tokenizer: prompt_token_ids only)"),
            f"output      {s.output.path}, "
            + ("OpenAI batch output lines" if self.output_format == "openai" else "msinfer's result lines")
            + (" (output.format auto: from the input's first JSON object)" if s.output.format == "auto" else ""),
            f"ray         {s.ray.address or 'embedded local Ray'}",
        ]
        dbytes = dtype_bytes(self.engine.dtype)
        for st, (lo, hi) in enumerate(self.engine.pipeline):
            stage = Stage.of(self.engine.pipeline, st)
            held = ["the embedding"] * stage.first + ["the final norm, LM head and sampler"] * stage.last
            where = "one node" if s.parallel.placement == "pack" else "any nodes"
            int8, int8_experts, int4, int4_experts = holds_int8(self.engine.device, self.engine.ops)
            weights = bytes_per_rank(m, tp, dbytes, s.parallel.expert_parallel, stage=stage, int8=int8,
                                     int8_experts=int8_experts, int4=int4, int4_experts=int4_experts, bf16=self.bf16,
                                     int4_scale_bytes=int4_scale_bytes(self.engine.device), pairs=self.pairs)
            kv = (m.kv_bytes(self.engine.block_size, self.engine.kv_dtype_bytes(m), tp, hi - lo)
                  * (self.engine.blocks() + 1))
            lines.append(f"stage {st:<5} workers {st * tp}-{st * tp + tp - 1} on {where}, layers {lo}-{hi - 1} "
                         f"({hi - lo})" + (f" + {' and '.join(held)}" if held else "")
                         + f": weights {weights / gib:.3f} GiB + KV cache {kv / gib:.3f} GiB per rank")
        if m.mla is not None:
            lines.append("kv cache    " + latent_summary(m, dbytes))
        if self.tokenizer is not None:
            lines.append("templates   " + template_summary(self.tokenizer.has_chat_template, s.input.chat_template,
                                                                 s.task))
        lines.append("layout      " + layout_summary(m, tp, s.parallel.expert_parallel))
        if m.quant is not None:
            lines.append("quantized   " + quant_summary(m, self.engine.device, self.engine.ops, self.engine.dtype))
        if m.is_moe:
            lines.append("experts     " + experts_summary(m, tp, s.parallel.expert_parallel,
                                                          dtype_bytes(self.engine.dtype),
                                                          self.engine.pipeline,
                                                          holds_int8(self.engine.device, self.engine.ops),
                                                          self.bf16, int4_scale_bytes(self.engine.device), self.pairs))
        if self.card is not None:
            lines.append("card        " + self.card.describe())
        return "\n".join(lines + [f"note        {n}" for n in self.notes])


def input_note(path: str) -> str:
    """`plan`'s word on a folder's or a pattern's files (none for one file)."""
    try:
        files, root = input_files(path)
    except InputError:
        return ""
    if root is None:
        return ""
    return (f" ({len(files)} {files[0].suffix} file(s), from {file_label(files[0], root)}; records without an id "
            f"are named <file>:<{unit_of(files[0])}>)")


def template_summary(has_template: bool, chat_template: bool | str, task: str = "generate") -> str:
    """Which records the chat template applies to (launcher.records, docs/spec.md)."""
    if not has_template:
        return ("the tokenizer has no chat template: prompts are encoded as written; 'messages' records fail "
                "(input.chat_template can give one)")
    which = "chat template" if isinstance(chat_template, bool) else "the chat template of input.chat_template"
    if task in POOLING_TASKS:
        return (f"{which} on 'messages' records, without a generation prompt; 'prompt' text and prompt_token_ids "
                f"are {'embedded' if task == 'embed' else 'classified'} as written")
    return (f"{which} on 'messages' records and on 'prompt' text of generated records"
            if chat_template else f"{which} on 'messages' records only (input.chat_template: false)") + (
        "; never on prompt_token_ids, nor on scored prompts (they are scored as written)")


def latent_summary(m: ModelConfig, dbytes: int) -> str:
    """What a token costs in the latent cache of MLA, against the per-head K and V it replaces."""
    a = m.mla
    heads = m.num_heads * (a.qk_head_dim + a.v_head_dim)
    return (f"latent: kv_lora_rank {a.kv_lora_rank} + qk_rope_head_dim {a.qk_rope_head_dim} = {a.cache_width} values "
            f"per token per layer, x {m.num_layers} layers x {dbytes} bytes = {m.kv_bytes(1, dbytes)} bytes per "
            f"token, {heads / a.cache_width:.0f}x less than {m.num_heads} heads' K and V; every rank caches the "
            f"latents of its layers whole")


def layout_summary(m: ModelConfig, tp: int, ep: bool = False) -> str:
    if tp == 1:
        return "tp 1: every rank holds every tensor whole"
    kv = "split" if m.num_kv_heads % tp == 0 else f"replicated on {tp // m.num_kv_heads} ranks each"
    if m.mla is not None:
        kv = "latent projections and cache replicated (a latent per token serves every head)"
    mlp = f"mlp {m.intermediate_size}/{tp} columns"
    if m.is_moe:
        mlp = (f"experts {m.num_experts}/{tp} whole per rank" if ep else
               f"every expert's {m.moe_intermediate_size} columns /{tp}") + ", router replicated"
    heads = f"q heads {m.num_heads}/{tp} per rank, kv heads {kv}" if m.mla is None else \
        f"q and kv_b_proj heads {m.num_heads}/{tp} per rank, {kv}"
    return f"{heads}, {mlp}, vocab rows {m.vocab_size}/{tp}, norms replicated"


def quant_summary(m: ModelConfig, device: str, ops: str, dtype: str) -> str:
    """A quantized checkpoint's schemes, and which of its quantized weights the workers keep so."""
    int8, int8_experts, int4, int4_experts = holds_int8(device, ops)
    int8 = int8 and bool(m.quant.schemes)
    scheme = m.expert_scheme
    by = "the CPU kernels" if device == "cpu" else "Ascend's quantized matmuls"
    kind = scheme.int8_kind if scheme is not None else None
    int8_inputs = bool(m.expert_inputs("gate_proj") and m.expert_inputs("down_proj"))
    held = int8_experts and (kind == "weight" or (kind == "dynamic" and int8_inputs))
    if held and device == "cpu":
        by += ("; the experts' through the grouped kernels"
               + (", their int8 inputs summed with VNNI where the CPU has it" if kind == "dynamic" else ""))
    elif held:
        form = "per-token form, their inputs int8 per token" if kind == "dynamic" else "antiquant form"
        by += f"; the experts' through GroupedMatmulV4's {form}"
    elif kind in ("weight", "dynamic"):
        by += "; the experts' int8 weights are dequantized: no grouped int8 kernel here"
    elif scheme is not None and scheme.int4_groups and int4_experts:
        by += "; the experts' int4 groups through " + ("the grouped kernels" if device == "cpu"
                                                        else "GroupedMatmulV4's antiquant form")
    elif scheme is not None and scheme.int4_groups:
        by += "; the experts' int4 weights are dequantized: " + ("no AVX-512, or MSINFER_INT4=0" if device == "cpu"
                                                                 else "no grouped int4 kernel")
    if (not held or device == "cpu") and (m.expert_inputs("gate_proj") or m.expert_inputs("down_proj")):
        by += ("; the experts' inputs are quantized per token"
               + (", every expert on every token" if ops == "portable" else ""))
    grouped = int4 and any(s.int4_groups for s in m.quant.schemes)
    kept = "int8 weights with a scale per channel stay int8" + (" and int4 groups int4, two a byte" if grouped else "")
    held = f"{kept} ({by}), the rest are " if int8 else "the weights are "
    return f"{m.quant.describe()}; {held}dequantized to {dtype} as they load, and counted so"


def experts_summary(m: ModelConfig, tp: int, ep: bool, dbytes: int, pipeline: tuple = (),
                    int8: tuple[bool, bool, bool, bool] = (False,) * 4, bf16: bool = False,
                    scale_bytes: int = 0, pairs: bool = False) -> str:
    """Per-rank bytes of the experts and of the rest in both layouts (on a rank of the pipeline
    stage with the most weights, the plan's "per rank"; int8: holds_int8's, bf16: holds_bfloat16's,
    scale_bytes: int4_scale_bytes', pairs: bytes_per_rank's), and the sizes each allows."""
    weights = stage_weights(m, tp, dbytes, ep, pipeline, int8, bf16, scale_bytes, pairs) if pipeline else [0]
    stage = Stage.of(pipeline, weights.index(max(weights))) if pipeline else Stage()
    gib = 1024 ** 3
    parts = []
    for layout, flag in (("sliced", False), ("expert parallel", True)):
        if divisors_problem(m, tp, flag):
            sizes = ", ".join(map(str, valid_tp_sizes(m, ep=flag)))
            parts.append(f"{layout}: does not fit tp {tp} (tensor_parallel {sizes})")
            continue
        experts = bytes_per_rank(m, tp, dbytes, flag, experts=True, stage=stage, int8_experts=int8[1],
                                 int4_experts=int8[3], int4_scale_bytes=scale_bytes, pairs=pairs)
        rest = bytes_per_rank(m, tp, dbytes, flag, experts=False, stage=stage, int8=int8[0], int4=int8[2], bf16=bf16,
                              int4_scale_bytes=scale_bytes, pairs=pairs)
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
    if problem := ops_problem(device, spec.model.ops, spec.model.shapes, spec.model.graph_mode):
        raise LayoutError(problem)
    if fused(device, spec.model.ops):
        bs = spec.scheduler.block_size
        if bs % BLOCK_MULTIPLE:
            raise LayoutError(f"scheduler.block_size {bs}: Ascend's ReshapeAndCache and PagedAttention take blocks "
                              f"of a multiple of {BLOCK_MULTIPLE} tokens (128 is usual on cards); or set model.ops: "
                              f"portable")
        if m.mla is not None:
            notes.append("latent attention: steps that read the cache call PagedAttention in its MLA mode and "
                         "ReshapeAndCache on one latent cache, as vllm-mindspore does (the start-up check settles "
                         "both on the card); a prefill with nothing cached attends among its decompressed keys and "
                         "values in portable operators")
        elif m.head_dim not in HEAD_SIZES:
            notes.append(f"head_dim {m.head_dim} is not among the head sizes vllm-mindspore runs Ascend's attention "
                         f"kernels with ({', '.join(map(str, HEAD_SIZES))}); if a card refuses it, model.ops: "
                         f"portable runs the model without them")


HOST_MEMORY_FRACTION = 0.8     # of this machine's memory that the weights and KV caches of its workers may take


def host_memory_problem(ranks: int, weights: int, kv: int, kv_advice: str = "",
                        weights_advice: str = "") -> str | None:
    """Why `ranks` workers computing on this machine's CPU, each holding `weights` bytes of weights
    and `kv` bytes of KV cache, do not fit in HOST_MEMORY_FRACTION of its memory (None if they do),
    with `kv_advice` where a smaller KV cache would make room, else (the weights alone do not fit)
    `weights_advice`. `plan` and `bench` both ask it."""
    import psutil
    have, gib = psutil.virtual_memory().total, 1024 ** 3
    if ranks * (weights + kv) <= HOST_MEMORY_FRACTION * have:
        return None
    alone = ranks * weights > HOST_MEMORY_FRACTION * have
    advice = (f" (the weights alone {ranks * weights / gib:.1f} GiB: no KV cache setting makes room; the model "
              f"needs a larger machine, or a cluster's){weights_advice}" if alone else kv_advice)
    return (f"{ranks} worker(s) x (weights {weights / gib:.2f} GiB + KV cache {kv / gib:.2f} GiB) = "
            f"{ranks * (weights + kv) / gib:.1f} GiB is more than {HOST_MEMORY_FRACTION:.0%} of this machine's "
            f"{have / gib:.1f} GiB{advice}")


def stage_weights(m: ModelConfig, tp: int, dbytes: int, ep: bool, pipeline: tuple,
                  int8: tuple[bool, bool, bool, bool] = (False,) * 4, bf16: bool = False,
                  scale_bytes: int = 0, pairs: bool = False) -> list[int]:
    """The weight bytes of a rank of each pipeline stage (one entry for a one-stage replica);
    int8: holds_int8's (linear layers, experts, int4 groups in linear layers, in experts); bf16:
    holds_bfloat16's; scale_bytes: int4_scale_bytes'; pairs: the linear layers computed in
    bfloat16 (Layout.matmul_dtype)."""
    return [bytes_per_rank(m, tp, dbytes, ep, stage=Stage.of(pipeline, st), int8=int8[0], int8_experts=int8[1],
                           int4=int8[2], int4_experts=int8[3], bf16=bf16, int4_scale_bytes=scale_bytes, pairs=pairs)
            for st in range(max(1, len(pipeline)))]


def weight_counter(m: ModelConfig, dbytes: int, ep: bool, device: str, ops: str, lora: bool = False,
                   pairs: bool = False, int8: tuple[bool, bool, bool, bool] | None = None):
    """stage_weights at any (tp, pipeline), the weights held as a layout of these choices holds
    them (int8: holds_int8's unless given): what card_plan weighs other layouts with."""
    held, bf16, scales = holds_int8(device, ops) if int8 is None else int8, holds_bfloat16(device, ops, lora), \
        int4_scale_bytes(device)
    return lambda tp, pipeline: stage_weights(m, tp, dbytes, ep, pipeline, held, bf16, scales, pairs)


def holds_int8(device: str, ops: str) -> tuple[bool, bool, bool, bool]:
    """Whether the workers keep a quantized checkpoint's weights as they are, (int8 with a scale
    per channel in linear layers, the same in experts, int4 groups in linear layers, the same in
    experts): the CPU kernels do the first two (worker.cpu.CpuOps.pack_int8; the experts' in the
    same panels, or VNNI's for W8A8 where the CPU has it: CpuOps.int8_experts), and the last two
    on a CPU with AVX-512 (CpuInt4Linear, and its layout in the grouped kernel; sharding.config.
    int4_on); Ascend's quantized matmuls do all four (worker.ascend.AscendInt8Linear,
    AscendExperts, AscendInt4Linear; emulated too) unless the start-up self-check finds them
    wanting; the portable operators dequantize them all."""
    ascend, cpu = fused(device, ops), cpu_kernels(device, ops)
    int4_cpu = cpu and int4_on()
    return ops != "portable", ascend or cpu, ascend or int4_cpu, ascend or int4_cpu


def int4_scale_bytes(device: str) -> int:
    """The bytes of an int4 group's scale where they are not the compute dtype's (0): the CPU
    kernels hold them in float32 (worker.cpu.CpuInt4Linear, and the experts')."""
    return 4 if device == "cpu" else 0


def holds_bfloat16(device: str, ops: str, lora: bool = False) -> bool:
    """Whether the workers keep a bfloat16 checkpoint's linear and embedding weights in bfloat16
    where they compute in float32: the CPU kernels do (in panels, or AMX tiles; worker.cpu.
    CpuOps.pack_weight), unless MSINFER_BF16_PANELS=0 or an adapter is merged into the weights
    (its sums are no bfloat16). With MSINFER_BF16_PANELS=0 on a CPU with AMX, the weights whose
    sizes the tiles take are still held in bfloat16: the plan counts them at 4 bytes; nor does it
    count the experts' AMX tiles (2 bytes) where the CPU has them."""
    return cpu_kernels(device, ops) and not lora and bf16_panels_on()


def largest_stage(m: ModelConfig, engine: EngineConfig) -> int:
    """The decoder layers of the replica's largest pipeline stage (all of them with one stage):
    every stage holds the same number of KV blocks, so the largest one's KV cache is the largest."""
    return max((hi - lo for lo, hi in engine.pipeline), default=m.num_layers)


@dataclass(frozen=True)
class CardPlan:
    """One card of an accelerator replica: what it holds, in bytes."""
    memory: int               # the card's memory
    assumed: bool             # memory is the default, not parallel.device_memory_gb nor measured
    fraction: float
    weights: int
    activations: int          # the largest step's intermediates, chunk mask and logits (an estimate)
    runtime: int              # workspace and communication buffers (an estimate)
    kv: int
    blocks: int
    measured: bool = False    # memory and in_use as the workers measured the card
    in_use: int = 0           # taken on the card before msinfer started (measured)

    def describe(self) -> str:
        gib = 1024 ** 3
        source = (" (measured)" if self.measured else " (assumed: set parallel.device_memory_gb)" if self.assumed
                  else "")
        in_use = f" + in use at start {self.in_use / gib:.2f}" if self.measured else ""
        return (f"{self.memory / gib:.3g} GiB{source} x {self.fraction:g} = {self.fraction * self.memory / gib:.2f} "
                f"GiB for weights {self.weights / gib:.2f} + activations {self.activations / gib:.2f}{in_use} + "
                f"runtime {self.runtime / gib:.2f} + KV cache {self.kv / gib:.2f} GiB ({self.blocks} blocks)")

    def figures(self) -> dict:
        """In bytes: the card, and what the plan gives each part of it."""
        return {"card_total": self.memory, "in_use_at_start": self.in_use, "weights": self.weights,
                "activations_estimate": self.activations, "runtime_estimate": self.runtime, "kv_cache": self.kv,
                "blocks": self.blocks, "measured": self.measured}


CARD_MEMORY_GB = 64           # an Atlas 800T A2's 910B card, when parallel.device_memory_gb is not set
RUNTIME_BYTES = 2 * 1024 ** 3  # per card: the runtime's workspace and HCCL buffers (an estimate, not measured)


def card_plan(spec: JobSpec, m: ModelConfig, engine: EngineConfig, weights: int, dbytes: int,
              measured: tuple[int, int] | None = None, weighs=None) -> CardPlan:
    """The KV cache a card holds after weights, the largest step's activations and the runtime's
    share, within parallel.memory_fraction of its memory: as many blocks as fit, at most what
    max_batch_size sequences of max_model_len need (or scheduler.kv_cache_blocks, which must fit).
    `measured`: (the card's total memory, bytes in use before msinfer started) as the workers
    read them; they replace parallel.device_memory_gb (or the 64 GiB assumed), and what is in use
    comes off the budget besides the runtime's estimate (no profile step measures msinfer's own
    peak yet: the activations stay an estimate too). Refuses a layout that leaves no room for one
    sequence of max_model_len, naming the smallest tensor_parallel (and pipeline_parallel) that
    leaves it. `weighs`: weight_counter's, each stage's weights at another tp or pipeline split
    held as this layout holds them (None: every stage holds `weights`, and others are weighed
    unquantized)."""
    p, tp = spec.parallel, spec.parallel.tensor_parallel
    memory, in_use = measured if measured else (int((p.device_memory_gb or CARD_MEMORY_GB) * 1024 ** 3), 0)
    in_use = max(in_use, 0)
    runtime = RUNTIME_BYTES + in_use
    if weighs is None:
        current = [weights] * max(1, len(engine.pipeline))
        weighs = lambda t, split: stage_weights(m, t, dbytes, p.expert_parallel, split)    # noqa: E731
    else:
        current = weighs(tp, engine.pipeline)
    activations, block, fits = card_room(spec, m, engine, tp, current, dbytes, memory, runtime)
    blocks = engine.blocks() if engine.num_blocks else min(fits, engine.blocks())
    one_seq = -(-engine.max_model_len // engine.block_size)
    gib = 1024 ** 3
    if blocks > fits or fits < one_seq:
        need = blocks if engine.num_blocks else one_seq
        larger = (t for t in valid_tp_sizes(m, ep=p.expert_parallel) if t > tp)
        fit = next(((t, max(w)) for t in larger for w in [weighs(t, engine.pipeline)]
                    if card_room(spec, m, engine, t, w, dbytes, memory, runtime)[2] >= need), None)
        stages = max(1, len(engine.pipeline))
        deeper = next(((n, max(w)) for n in range(stages + 1, m.num_layers + 1)
                       for split in [stage_layers(m.num_layers, n)] for w in [weighs(tp, split)]
                       if card_room(spec, m, dataclasses.replace(engine, pipeline=split), tp, w, dbytes, memory,
                                    runtime)[2] >= need), None)
        card = (f"the card's measured {memory / gib:.3g} GiB ({in_use / gib:.2f} GiB of it in use before msinfer "
                f"started)" if measured else f"a {memory / gib:.3g} GiB card")
        # what else would make room, for the cause at hand: the blocks asked for, the memory
        # counted, what is on the card already; shorter sequences only where one does not fit
        ways = ([f"scheduler.kv_cache_blocks {fits} or fewer"] if blocks > fits and fits >= one_seq else [])
        ways += [f"a larger parallel.memory_fraction (now {p.memory_fraction:g})"] if p.memory_fraction < 1 else []
        if not measured and p.device_memory_gb is None:
            ways.append(f"parallel.device_memory_gb, the card's size ({CARD_MEMORY_GB} GiB assumed)")
        if measured and in_use >= gib // 4:
            ways.append(f"the {in_use / gib:.2f} GiB in use on the card freed")
        if fits < one_seq:
            ways.append("a lower model.max_model_len or scheduler.max_batched_tokens")
        raise LayoutError(
            f"the layout does not fit {card} at memory_fraction {p.memory_fraction:g}: weights "
            f"{weights / gib:.2f} GiB + activations {activations / gib:.2f} + "
            + (f"in use {in_use / gib:.2f} + " if measured else "")
            + f"runtime {RUNTIME_BYTES / gib:.2f} leave room for {fits} KV blocks of {engine.block_size} tokens, and "
            + (f"scheduler.kv_cache_blocks asks for {blocks}" if blocks > fits else
               f"one sequence of max_model_len {engine.max_model_len} needs {one_seq}")
            + (f"; parallel.tensor_parallel {fit[0]} fits ({fit[1] / gib:.2f} GiB of weights a card)" if fit else
               "; no larger parallel.tensor_parallel fits")
            + (f"; parallel.pipeline_parallel {deeper[0]} fits at tensor_parallel {tp} ({deeper[1] / gib:.2f} GiB of "
               f"weights a card in its largest stage)" if deeper else "")
            + (f". It may fit with {'; or '.join(ways)}" if ways else ""))
    return CardPlan(memory, p.device_memory_gb is None and not measured, p.memory_fraction, weights, activations,
                    RUNTIME_BYTES, (blocks + 1) * block, blocks, bool(measured), in_use)


def card_room(spec: JobSpec, m: ModelConfig, engine: EngineConfig, tp: int, weights: list[int], dbytes: int,
              memory: int, runtime: int) -> tuple[int, int, int]:
    """(activation bytes of the largest step, bytes of a KV block of the stage with the most
    weights, KV blocks that fit on every stage's card: each replica's stages hold as many) on one
    card of `memory` bytes, `runtime` of them taken by others, in a tensor-parallel group of tp
    holding `weights` (a rank's of each pipeline stage, their layers engine.pipeline's: a stage's
    KV block holds its layers). Per token of the largest step: its hidden rows, this rank's q, k and v heads, its
    MLP columns (a sparse layer: its k routed copies and their intermediate rows, the grouped
    matmuls' buffers), and a row of the chunk mask [tokens, max_model_len]; per sequence its
    float32 logits."""
    p = spec.parallel
    budget = int(p.memory_fraction * memory)
    tokens, rows = spec.scheduler.max_batched_tokens, spec.scheduler.max_batch_size
    mlp = 2 * m.intermediate_size // tp
    if m.is_moe:
        inter = m.moe_intermediate_size // (1 if p.expert_parallel else tp)
        mlp = max(mlp if len(m.sparse_layers) < m.num_layers else 0,
                  m.num_experts_per_tok * (2 * m.hidden_size + 2 * inter))
    heads = (m.num_heads // tp + 2 * max(1, m.num_kv_heads // tp)) * m.head_dim
    if m.mla is not None:        # q, a prefill's decompressed K and V, the latents and the absorbed queries
        a = m.mla
        heads = m.num_heads // tp * (2 * a.qk_head_dim + a.v_head_dim + a.cache_width) + 2 * a.cache_width
    mask = -(-engine.max_model_len // engine.block_size) * engine.block_size
    per_token = (4 * m.hidden_size + mlp + heads + mask) * dbytes
    # float32 logits: the rank's vocabulary shard and the device sampler's few copies of it, and the
    # whole rows gathered once for a step whose sampling changes its logits on the host
    activations = tokens * per_token + rows * (4 * -(-m.vocab_size // tp) + m.vocab_size) * 4
    layers = [hi - lo for lo, hi in engine.pipeline] or [m.num_layers]
    blocks = [m.kv_bytes(engine.block_size, engine.kv_dtype_bytes(m), tp, n) for n in layers]
    fits = min((budget - w - activations - runtime) // b - 1 for w, b in zip(weights, blocks))     # - scratch
    return activations, blocks[weights.index(max(weights))], max(0, fits)


@dataclass(frozen=True)
class Layout:
    """Where a replica's ranks run and what each holds, resolved from the choices a spec or
    `msinfer bench`'s flags make (`resolve_layout`)."""
    device: str                 # "cpu" or "ascend"
    emulate: bool               # ascend's kernels stood in on the CPU
    dtype: str                  # the compute dtype
    pipeline: tuple             # each stage's decoder layers, [lo, hi)
    weight_bytes: int           # a rank's weights, in the stage that holds the most
    matmul_dtype: str = "float32"     # "bfloat16": the CPU kernels compute in bfloat16 (cpu_bfloat16)
    kv_cache_dtype: str = "auto"      # "bfloat16": a float32 job's KV cache in bfloat16 (cpu_kv_cache_dtype)


def resolve_layout(m: ModelConfig, tp: int, pp: int, ep: bool, device: str, dtype: str, ops: str,
                   pipeline_layers=None, lora: bool = False, kv_cache_dtype: str = "auto") -> Layout:
    """The device, compute dtype, pipeline stages and weight bytes a rank holds for these choices
    (spec keys parallel.* and model.dtype / model.ops / model.lora / model.kv_cache_dtype); raises
    LayoutError naming the spec key where a choice does not fit the model."""
    check_tp(m, tp, ep)
    pipeline = stage_layers(m.num_layers, pp, pipeline_layers)
    device = resolve_device(device)
    emulate = device == "ascend" and ascend_emulated()
    matmul_dtype = "bfloat16" if cpu_bfloat16(dtype, device, emulate, ops) else "float32"
    try:
        on_card = card_dtype(dtype, m, device, ops) if device == "ascend" else None     # (emulated: a card's)
        dtype = resolve_dtype(dtype, m, device, emulate, ops)
        kv_cache_dtype = cpu_kv_cache_dtype(kv_cache_dtype, m, device, on_card or dtype, matmul_dtype, ops)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    weighs = weight_counter(m, dtype_bytes(dtype), ep, device, ops, lora, matmul_dtype == "bfloat16")
    return Layout(device, emulate, dtype, pipeline, max(weighs(tp, pipeline)), matmul_dtype, kv_cache_dtype)


def plan_job(spec: JobSpec, check_io: bool = True, weights: bool = True, make_output: bool = False,
             sizing: bool = False) -> Plan:
    """Every check that can fail, before Ray starts. Raises a UserError-like exception.
    `check_io=False` skips the input and output files (the Python API has neither);
    `weights=False` the checkpoint's tensors and the memory they need (`msinfer simulate`);
    `make_output`: the output folder is made (a run), not only checked (`msinfer plan`);
    `sizing`: a folder with config.json and no weights yet is planned from the config alone
    (`msinfer plan`: a cluster is sized before a download of hundreds of GB)."""
    check_model_dir(spec.model.path)
    spec = for_shard(spec)
    m = ModelConfig.from_dir(spec.model.path)
    notes = []
    if spec.task == "embed":                    # no LM head, the pooling the checkpoint gives (launcher.embed)
        (spec, note), m = resolve_pooling(spec), m.pooling_only()
        notes.append(note)
        if spec.pooling.dimensions is not None and (problem := matryoshka_problem(m, spec.pooling.dimensions)):
            raise SpecError(f"pooling.dimensions {problem}")
    elif spec.task == "classify" and not m.num_labels and not spec.model.classifier_from_tokens:
        raise SpecError(f"task classify needs a sequence classifier's checkpoint (*ForSequenceClassification, "
                        f"with its `score` head), or a causal LM and model.classifier_from_tokens (a reranker's "
                        f"[\"no\", \"yes\"]); {spec.model.path} is {m.architecture}")
    elif spec.task == "classify":
        m = m.pooling_only()
    elif m.num_labels:
        raise SpecError(f"{spec.model.path} is a sequence classifier ({m.architecture}, {m.num_labels} label(s)), "
                        f"with no LM head to {spec.task} with; set task: classify (or task: embed)")
    card_keys = [k for k in ("device_memory_gb", "memory_fraction") if k in spec.parallel.model_fields_set]
    if spec.model.max_model_len is None:       # (checks the keys its user set against it, not the model's)
        spec = spec.with_max_model_len(min(m.max_position_embeddings, DEFAULT_MAX_MODEL_LEN))
    spec, taken = model_sampling(spec, m)       # (while the spec knows which keys its user set: a
    # max_new_tokens taken from the model above max_model_len is capped as the default is)
    tp, ep = spec.parallel.tensor_parallel, spec.parallel.expert_parallel
    layout = resolve_layout(m, tp, spec.parallel.pipeline_parallel, ep, spec.parallel.device, spec.model.dtype,
                            spec.model.ops, spec.parallel.pipeline_layers, spec.model.lora is not None,
                            spec.model.kv_cache_dtype)
    device, emulate, dtype, pipeline = layout.device, layout.emulate, layout.dtype, layout.pipeline
    plans = plan_tensors(m, tp, ep)
    absent = sizing and weights and not holds_weights(spec.model.path)
    ckpt_bytes = (check_checkpoint(spec.model.path, plans, spec.model.allow_pickle, m.quant, notes)
                  if weights and not absent else 0)
    tokenizer = load_tokenizer(spec.model.tokenizer_path, spec.model.trust_remote_code, spec.input.template_text())
    if spec.model.classifier_from_tokens is not None:
        m = token_classifier(spec, m, tokenizer, weights and not absent)
    if spec.task == "classify":
        head = "the LM head's rows of its tokens" if m.head_tokens else f"{m.architecture}'s head"
        notes.append(f"task classify: {head} on the last token's final hidden state, {m.num_labels} label(s) "
                     f"({', '.join(m.labels[:8])}{', ...' if m.num_labels > 8 else ''})")
    if error := check_chat({"chat_template_kwargs": spec.input.chat_template_kwargs}, "input."):
        raise SpecError(error)
    if tokenizer is not None and spec.input.chat_template:
        tokenizer.check_chat_template(spec.input.chat_template_kwargs, own=spec.input.template_text() is not None)
    if parser := spec.output.reasoning_parser:
        if spec.task != "generate":
            raise SpecError(f"output.reasoning_parser '{parser}' splits generated text, and task: {spec.task} "
                            f"generates none; leave it unset")
        if tokenizer is None:
            raise SpecError(f"output.reasoning_parser '{parser}' splits a completion's text, and the model has no "
                            f"tokenizer in {spec.model.tokenizer_path} to decode it with")
        if error := check_reasoning_tokens(tokenizer, parser):
            raise SpecError(error)
    if parser := spec.output.tool_call_parser:
        if spec.task != "generate":
            raise SpecError(f"output.tool_call_parser '{parser}' reads the tool calls a chat completion writes, and "
                            f"task: {spec.task} generates none; leave it unset")
        if tokenizer is None or not tokenizer.has_chat_template:
            raise SpecError(f"output.tool_call_parser '{parser}' reads tool calls in chat completions, and the model "
                            f"has no " + ("tokenizer" if tokenizer is None else "chat template") +
                            f" in {spec.model.tokenizer_path}; leave it unset")
        if error := check_parser_tokens(parser, lambda t: tokenizer.encode(t, add_special_tokens=False)):
            raise SpecError(f"{error}; the tokenizer is {spec.model.tokenizer_path}")
        if not tokenizer.renders_tools(spec.input.chat_template_kwargs):
            raise SpecError(f"output.tool_call_parser '{parser}' reads the tool calls a model writes when its chat "
                            f"template tells it the tools, and the chat template of {spec.model.tokenizer_path} "
                            f"leaves a chat's tools out of the prompt: the model would never learn of them. Give a "
                            f"template that renders `tools` (input.chat_template), or leave output.tool_call_parser "
                            f"unset")
    if check_io:
        check_shard_by(spec)
        check_input(spec.input.path, shard_files(spec))
        if reads_back(spec.input.path, spec.output.path):
            raise SpecError(f"output.path {spec.output.path} would be one of the files of input.path "
                            f"{spec.input.path}: a re-run would read its results as records. Write the results "
                            f"outside the input's folder, or give a pattern that leaves them out")
        check_output(spec.output.path, keep_folder=make_output)
        if spec.output.metrics_port is not None:
            check_port(spec.output.metrics_host, spec.output.metrics_port)
    notes += [sampling_note(spec, taken)] if taken else []
    if emulate and (note := emulated_note(spec.model.dtype, m, spec.model.ops)):
        notes.append(note)
    if layout.matmul_dtype == "bfloat16":
        notes.append("model.dtype bfloat16 on the CPU: each linear layer, expert and the LM head round their "
                     "inputs and weights to bfloat16 and sum in float32 (AVX512-BF16 where the CPU has it), the "
                     "embedding's rows are bfloat16, the KV cache holds K and V rounded to bfloat16"
                     + (" (latent attention's: float32)" if m.mla is not None else "")
                     + "; the norms and attention compute in float32")
    if m.mtp_layers:
        notes.append(f"the checkpoint's {m.mtp_layers} multi-token prediction layer(s) (model.layers.{m.num_layers}"
                     f"{'' if m.mtp_layers == 1 else '-' + str(m.num_layers + m.mtp_layers - 1)}, "
                     f"num_nextn_predict_layers) are not loaded: msinfer decodes one token per step")
    if spec.model.max_model_len > (limit := m.context_positions()):
        made_for = ("max_position_embeddings" if limit == m.max_position_embeddings
                    else "its RoPE scaling's factor times the positions it scales")
        if not spec.model.allow_long_max_model_len:
            raise SpecError(f"model.max_model_len ({spec.model.max_model_len}) is more than the {limit} positions the "
                            f"model is made for ({made_for}, config.json): a sequence past them gets positions the "
                            f"model never saw, and tokens it would not give. Lower model.max_model_len, or set "
                            f"model.allow_long_max_model_len: true to run so anyway")
        notes.append(f"max_model_len {spec.model.max_model_len} exceeds the {limit} positions the model is made for "
                     f"({made_for}); model.allow_long_max_model_len lets it")
    try:
        emulation = dict(emulate_variants=emulate_variants(), emulate_memory=emulated_memory()) if emulate else {}
        if device == "ascend":
            from msinfer.worker.device import card_environment
            emulation["card_env"] = card_environment(spec.fault.startup_timeout_s, spec.fault.step_timeout_s)
    except ValueError as e:
        raise SpecError(str(e)) from None
    on_cpu = device == "cpu" or emulate           # (EngineConfig.on_cpu)
    workers_here = tp * spec.parallel.pipeline_parallel * spec.parallel.data_parallel if not spec.ray.address else tp
    # the compile cache is verified on the CPU (emulated Ascend included), not on a card; threads:
    # cores shared by all workers on an embedded Ray, by a packed replica on a cluster
    resolved = {**same_named(spec), **emulation, "compile_cache": spec.model.compile_cache and on_cpu,
                "kv_cache_dtype": layout.kv_cache_dtype,
                "threads": threads_per_worker(workers_here) if on_cpu else 0}
    engine = EngineConfig(**resolved, model_dir=spec.model.path, dtype=dtype, matmul_dtype=layout.matmul_dtype,
                          device=device,
                          num_blocks=spec.scheduler.kv_cache_blocks or 0, position_scheme=spec.model.positions.scheme,
                          emulate=emulate, tokenizer_path=spec.model.tokenizer_path, pipeline=pipeline,
                          task=spec.task, head_tokens=m.head_tokens,
                          **model_extensions(spec, m, plans, notes))
    check_ops(spec, m, device, notes)
    dbytes, weight_bytes = dtype_bytes(dtype), layout.weight_bytes
    card = None
    weighs = weight_counter(m, dbytes, spec.parallel.expert_parallel, device, spec.model.ops,
                            spec.model.lora is not None, layout.matmul_dtype == "bfloat16")
    if device == "ascend":
        card = card_plan(spec, m, engine, weight_bytes, dbytes, weighs=weighs)
        engine = dataclasses.replace(engine, num_blocks=card.blocks, card=card.figures())
    # a rank's KV cache (+ scratch): the one beside the most weights (the plan's "per rank"), and
    # the largest, which the host's memory is checked against
    per_stage = weighs(tp, engine.pipeline)
    heaviest = [hi - lo for lo, hi in engine.pipeline][per_stage.index(max(per_stage))] if engine.pipeline \
        else m.num_layers
    kv = m.kv_bytes(engine.block_size, engine.kv_dtype_bytes(m), tp, heaviest) * (engine.blocks() + 1)
    kv_most = m.kv_bytes(engine.block_size, engine.kv_dtype_bytes(m), tp, largest_stage(m, engine)) \
        * (engine.blocks() + 1)
    if device == "cpu" and card_keys:
        one = len(card_keys) == 1
        notes.append(f"parallel.{' and parallel.'.join(card_keys)} {'sizes' if one else 'size'} an accelerator card's "
                     f"memory and {'is' if one else 'are'} not used on the CPU: there the KV cache is "
                     f"scheduler.kv_cache_blocks (or max_batch_size sequences of max_model_len), and every worker's "
                     f"weights and KV cache must fit in {HOST_MEMORY_FRACTION:.0%} of this machine's memory")
    if engine.on_cpu and weights:
        pp = spec.parallel.pipeline_parallel
        ranks_here = tp * pp * spec.parallel.data_parallel if not spec.ray.address else tp * pp
        if problem := host_memory_problem(
                ranks_here, weight_bytes, kv_most, f"; lower scheduler.kv_cache_blocks (now {engine.blocks()}), "
                f"scheduler.max_batch_size or model.max_model_len",
                "; MSINFER_ASCEND_EMULATE=1 runs every card's share on this machine's CPU" if emulate else ""):
            raise LayoutError(problem)
    check_structured(spec.sampling, tokenizer)
    check_token_ids(spec.sampling, m.vocab_size)
    if absent:
        ckpt_bytes = bytes_per_rank(m, 1, dtype_bytes(m.torch_dtype))
        notes.append("the folder holds no weights yet: every figure comes from config.json; `msinfer run` needs the "
                     "*.safetensors")
    notes.append(verification_note(device, emulate, spec.model.ops))
    output_format = resolve_output_format(spec, check_io)
    if output_format == "openai" and spec.task in ("score", "classify"):
        raise SpecError(f"output.format openai has no place for {'scoring' if spec.task == 'score' else 'classifier'} "
                        f"results (task: {spec.task}); use output.format: msinfer")
    return Plan(spec, m, tokenizer, engine, device, weight_bytes, kv, ckpt_bytes, notes, card, output_format,
                weights_absent=absent, sampling_from_model=tuple(taken))


def token_classifier(spec: JobSpec, m: ModelConfig, tokenizer, weights: bool) -> ModelConfig:
    """The model of task classify by model.classifier_from_tokens: a causal LM whose labels are
    those tokens (each must be one token of the tokenizer), their logits its LM head's rows of
    them; `weights`: those rows are read once, to be sure the checkpoint has them."""
    given = spec.model.classifier_from_tokens
    if spec.task != "classify":
        raise SpecError(f"model.classifier_from_tokens makes a classifier of a causal LM: it needs task: classify, "
                        f"and the task is {spec.task}")
    if m.head_tokens or m.num_labels:
        raise SpecError(f"model.classifier_from_tokens is for a causal LM; {spec.model.path} is a classifier "
                        f"({m.architecture}) with a head of its own: leave it unset")
    if tokenizer is None:
        raise SpecError(f"model.classifier_from_tokens names tokens, and the model has no tokenizer in "
                        f"{spec.model.tokenizer_path} to find them with")
    ids = []
    hf = tokenizer.tok
    for text in given:          # a vocabulary entry, as vLLM looks a label up (convert_tokens_to_ids)
        tid = hf.convert_tokens_to_ids(text)
        if tid is None or (tid == hf.unk_token_id and text != hf.unk_token):
            got = tokenizer.encode(text, add_special_tokens=False)
            raise SpecError(f"model.classifier_from_tokens: {text!r} is not a token of the tokenizer's vocabulary "
                            f"(as text it is {len(got)} token(s), {got[:8]}); each label is one vocabulary entry, "
                            f"as vLLM looks it up")
        ids.append(tid)
    if len(set(ids)) != len(ids):
        raise SpecError(f"model.classifier_from_tokens: {given} name the same token twice")
    m = m.token_classifier(ids, given)
    if weights:
        from msinfer.worker.loader import read_tensor
        read_tensor(spec.model.path, m.head_tensor, spec.model.allow_pickle, ids)
    return m


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


def check_token_ids(sampling, vocab_size: int) -> None:
    """The job's default token ids (sampling.logit_bias, allowed_token_ids, stop_token_ids) within
    the model's vocabulary, before any worker starts: out of it, every record would fail alike
    (one record's own are checked where it is read, launcher.records)."""
    if bad := outside_vocabulary(sampling.to_params(), vocab_size):
        raise SpecError(f"sampling.{bad[0]}: token id {bad[1]} is outside the model's vocabulary (0..{vocab_size - 1})")


def same_named(spec: JobSpec) -> dict:
    """The spec's model:, parallel: and scheduler: keys that EngineConfig has a field of the same
    name for, with their values: such a key reaches every rank as it is, so a new one takes its
    spec field, that EngineConfig field and the code that reads it. plan_job overrides the few
    it resolves (dtype, device)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"dtype", "device"}
    return {name: getattr(section, name) for section in (spec.model, spec.parallel, spec.scheduler)
            for name in type(section).model_fields if name in names}


def model_sampling(spec: JobSpec, m: ModelConfig) -> tuple[JobSpec, list[str]]:
    """The spec with the sampling defaults the checkpoint's generation_config.json recommends in
    place of the sampling keys it leaves unset (model.generation_config: auto, as vLLM's
    generation_config "auto"), and the keys so taken."""
    if spec.model.generation_config != "auto" or not m.generation_sampling:
        return spec, []
    sampling, taken = spec.sampling.with_model_defaults(
        m.generation_sampling, str(Path(spec.model.path) / "generation_config.json"))
    return (spec.model_copy(update={"sampling": sampling}) if taken else spec), taken


def sampling_note(spec: JobSpec, taken: list[str]) -> str:
    shown = ", ".join(f"{k} {getattr(spec.sampling, k)}" for k in taken)
    return (f"sampling defaults from the model's generation_config.json, as vLLM takes them: {shown} (keys set in "
            f"the spec's sampling, or a record's, win; model.generation_config: msinfer leaves the file's out)")


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


def count_lines(path: str, pick=None) -> int | None:
    """The records of input.path, for the progress bar: its files' rows or lines that are not
    blank; `pick`: as read_records'."""
    total = 0
    files = input_files(path)[0]
    for f in files if pick is None else pick(files):
        if f.suffix.lower() == ".parquet":
            try:
                import pyarrow.parquet as pq
                total += pq.ParquetFile(f).metadata.num_rows
            except Exception:
                return None
        else:
            with open(f, "rb") as lines:
                total += sum(1 for line in lines if line.strip())
    return total


class JobRun:
    """One pass of records through a started controller, on the driver's side: skipping records
    already done, results to `sink` (the results file's writer), streamed text, stats, the
    progress bar and the status file. What happens to a record in between is the engines'
    (launcher.engine, launcher.records)."""

    def __init__(self, plan: Plan, controller, sink, done_ids: IdSet | None = None, stream: bool = False,
                 progress: bool = True, status: bool = True, flush=None):
        """sink(record_id, line, digest): one result line, JSON without its newline, and its
        record's input digest; flush(): writes the lines given so far (called once per pass of the
        controller's loop, and at the end)."""
        self.plan, self.spec = plan, plan.spec
        self.controller, self.sink, self.status = controller, sink, status
        self.done_ids = IdSet() if done_ids is None else done_ids
        self.flush = flush or (lambda: None)
        self.stats = Stats()
        self.t_gen: float | None = None
        self.t_first_result: float | None = None
        self.stream = StreamPrinter(sys.stderr) if stream else None
        self.status_t = 0.0
        self.settings: dict | None = None      # result_settings, kept in the status file by run_job's runs
        self.tokens_done = 0
        self.held: list | None = []           # failed results held back until one succeeds (`_hold`)
        self.bar = None
        self.metrics = None                   # launcher.metrics.JobMetrics, with output.metrics_port
        if progress and status:
            from tqdm import tqdm
            by_record = self.spec.input.shard is not None and self.spec.input.shard_by == "record"
            total = None if by_record else count_lines(self.spec.input.path, shard_files(self.spec))  # (by record: unknown)
            self.bar = tqdm(total=total, unit="rec", dynamic_ncols=True, file=sys.stderr, desc="msinfer",
                            disable=None)

    def run(self, records) -> bool:
        """Whether every record was handed on (launcher.controller.Controller.run). A run stopped
        early does not write the failed results it held back (`_hold`): the next run computes
        them again."""
        self.t_gen = time.perf_counter()
        # a tick at least every second, and twice per output.status_interval_s (the status file's)
        complete = self.controller.run(records, self.on_done, self.stream.write if self.stream else None,
                                       self.on_tick, min(1.0, self.spec.output.status_interval_s / 2))
        if complete:
            self.flush_held(end=True)
        self.flush()
        return complete

    def new_records(self, records):
        """The records whose results are not in the results file yet (done_ids, looked up a
        chunk at a time)."""
        for chunk in chunks(records):
            held = self.done_ids.lookup([rec.id for rec in chunk])
            for rec, seen in zip(chunk, held):
                if seen >= 0:
                    self.stats.skipped += 1
                    if self.bar is not None:
                        self.bar.update(1)
                    continue
                yield rec

    def nothing_to_do(self, t_start: float, resumed: dict) -> dict:
        """The summary of a run that found every record's line in the results file and started
        nothing: this run's figures (records skipped, none done), and the summary of the last run
        that did run (`last_run`, kept from the summary before)."""
        before = read_summary(summary_path(self.spec.output.path)) or {}
        last = before.get("last_run") if before.get("nothing_to_do") else before
        summary = {**self.summary(0.0), **resumed, "nothing_to_do": True,
                   "rerun_s": round(time.perf_counter() - t_start, 3),
                   **({"last_run": last} if isinstance(last, dict) and last else {})}
        write_json_atomic(summary_path(self.spec.output.path), summary)
        # a merge's file (msinfer merge) that this run left as it was stays one: merged again later,
        # it is replaced rather than refused as a run's results
        merged = (read_summary(status_path(self.spec.output.path)) or {}).get("merged_shards")
        untouched = not any(resumed.get(k) for k in ("records_retried", "records_redone", "records_removed"))
        self.write_status("done", {"merged_shards": merged} if merged and untouched else None)
        return summary

    def on_stage(self, stage: str) -> None:
        """A replica reached a start-up stage (launcher.replica): shown on the progress bar."""
        if self.bar is not None and self.t_first_result is None:
            self.bar.set_description(stage)

    def on_done(self, done: Done, rec) -> None:
        if self.held is not None:
            self._hold(done, rec)
            return
        self._emit(done, rec)

    def _hold(self, done: Done, rec) -> None:
        """Until a record succeeds, failed ones are held back: when the first SAME_CAUSE_STOP
        records of the run (in input order), or every record of a smaller run, all failed alike,
        the cause is not in the records (a template the tokenizer cannot render, a vocabulary the
        inputs were not made for), and the job stops without their error lines, so that a re-run
        after the fix computes them."""
        if done.failed:
            self.held.append((done, rec))
            if len(self.held) < SAME_CAUSE_STOP:
                return
            if {d.serial for d, _ in self.held} >= set(range(SAME_CAUSE_STOP)):
                self._stop_if_alike()
        self.flush_held()
        if not done.failed:
            self._emit(done, rec)

    def _stop_if_alike(self) -> None:
        causes = {d.cause for d, _ in self.held}
        if len(causes) == 1:
            n = len(self.held)
            raise SystemicError(
                (f"the first {n} records all failed alike" if n >= SAME_CAUSE_STOP else f"all {n} records failed alike")
                + f" (record '{self.held[0][1].id}' was the first): {causes.pop()}. That is not one record's fault, "
                f"so the job stops without writing their error lines; fix the cause and run the job again")

    def flush_held(self, end: bool = False) -> None:
        """Writes the failed results held back; at the `end` of a run in which every record
        failed, two or more and alike, the job stops instead (`_hold`)."""
        if end and self.held and len(self.held) >= 2:
            self._stop_if_alike()
        held, self.held = self.held or [], None
        for d, r in held:
            self._emit(d, r)

    def _emit(self, done: Done, rec) -> None:
        self.sink(rec.id, done.line, getattr(rec, "digest", None))
        if self.t_first_result is None:
            self.t_first_result = time.perf_counter()
            if self.bar is not None and not self.bar.disable:     # rates from here: start-up is not generation
                self.bar.set_description("msinfer")
                self.bar.start_t = self.bar.last_print_t = time.time()      # tqdm's clock
                self.bar.initial = self.bar.last_print_n = self.bar.n
        if self.stream is not None:
            self.stream.end(rec.id)
        self.stats.count(done.failed, done.prompt_tokens, done.completion_tokens, done.ttft_s, done.cut)
        if self.metrics is not None:
            self.metrics.result(done)
        if self.bar is not None:
            self.bar.update(1)
            self.tokens_done += done.completion_tokens
            elapsed = time.perf_counter() - self.t_first_result
            if elapsed > 0:
                self.bar.set_postfix(tok_s=f"{self.tokens_done / elapsed:.1f}", refresh=False)

    def on_tick(self) -> None:
        self.flush()
        if self.metrics is not None:
            self.metrics.update(self.controller)
        if time.perf_counter() - self.status_t > self.spec.output.status_interval_s:
            stop = self.controller.stop
            self.write_status("draining" if stop is not None and not stop.dealing() else "running")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.stream is not None:
            self.stream.close()

    # ---- status and summary -------------------------------------------------------------------
    def workers(self) -> list[dict]:
        return self.controller.ranks() if self.controller else []

    def write_status(self, state: str, add: dict | None = None) -> None:
        self.status_t = time.perf_counter()
        if not self.status:
            return
        s = self.stats
        write_json_atomic(status_path(self.spec.output.path), {
            "state": state, "updated_unix": time.time(), "records_done": s.done, "records_failed": s.failed,
            "records_skipped": s.skipped, "completion_tokens": s.completion_tokens,
            "replica_restarts": self.controller.restarts if self.controller else 0,
            "workers": self.workers(), "settings": self.settings, **(add or {})}, durable=state != "running")

    def conclude(self, state: str, startup_s: float, resumed: dict, drain: Drain, complete: bool = True,
                 t_start: float | None = None, add=None, engines: bool = True) -> dict:
        """Writes the run's summary (`summary` with the resumed records' counts, the deadline, the
        drain's figures where the run did not finish, the first result's time, and what `add`
        gives for it) and then its status, `state`; returns the summary. `engines` False: without
        asking the engines for their step figures (a run stopped at once, or failed, waits for
        nothing)."""
        summary = {**self.summary(startup_s, engines), **resumed}
        if drain.deadline is not None:
            summary["deadline"] = drain.deadline_summary()
        if not complete:
            summary["drained"] = drain.summary(self.controller.abandoned if self.controller else 0)
        if add is not None:
            summary.update(add(summary))
        if t_start is not None and self.t_first_result is not None:
            summary["first_result_s"] = round(self.t_first_result - t_start, 3)
        write_json_atomic(summary_path(self.spec.output.path), summary)
        self.write_status(state)
        return summary

    def summary(self, startup_s: float, engines: bool = True) -> dict:
        gen_s = (time.perf_counter() - self.t_gen) if self.t_gen else 0.0
        out = self.stats.summary(startup_s, gen_s)
        out["replica_restarts"] = self.controller.restarts if self.controller else 0
        out["restart_reasons"] = list(self.controller.restart_log) if self.controller else []
        out["records_quarantined"] = self.controller.quarantined if self.controller else 0
        out["records_rebalanced"] = self.controller.rebalanced if self.controller else 0    # the tail's
        out["replicas_without_room"] = self.controller.waits_for_room() if self.controller else []
        out["spec"] = self.spec.resolved()
        out["notes"] = list(self.plan.notes)          # as `plan` prints them: device path, dtype, heads
        out["replicas"] = self.workers()
        if self.controller:
            out["setup"] = [info for s in self.controller.slots for info in s.replica.setup_info]
            if engines:
                out["steps"] = self.controller.step_stats()
        return out


class StreamPrinter:
    """`--stream`: each record's text as it grows, a whole line at a time, each line behind its
    record's id (`[id] `; `[id][i] ` for sample i of n), on stderr, so that stdout keeps only the
    summary. A record's last partial line is written when its result is."""

    def __init__(self, out):
        self.out = out
        self.partial: dict[str, str] = {}

    @staticmethod
    def label(key: str) -> str:
        """`[id] `, or `[id][i] ` for the key of sample i (launcher.engine.stream_key's `id[i]`)."""
        head, sep, index = key.rpartition("[")
        return f"[{head}][{index} " if sep and index[:-1].isdigit() and index.endswith("]") else f"[{key}] "

    def write(self, key: str, text: str) -> None:
        lines = (self.partial.pop(key, "") + text).split("\n")
        for line in lines[:-1]:
            self.out.write(f"{self.label(key)}{line}\n")
        if lines[-1]:
            self.partial[key] = lines[-1]
        self.out.flush()

    def end(self, record_id: str) -> None:
        """The record's result is written: its partial lines (of each sample) go out."""
        for key in [k for k in self.partial if k == record_id or k.startswith(record_id + "[")]:
            self.out.write(f"{self.label(key)}{self.partial.pop(key)}\n")
        self.out.flush()

    def close(self) -> None:
        for key in list(self.partial):
            self.out.write(f"{self.label(key)}{self.partial.pop(key)}\n")
        self.out.flush()


STAND_IN_CPUS = 0.01           # Ray's share for a stand-in worker: placement needs some resource


def make_controller(plan: Plan, simulate=None, stream: bool = False):
    """The job's controller; with `simulate` (a launcher.simulate.StandIn), on stand-in workers
    that ask Ray for a hundredth of a CPU each and no card. `stream`: the engines report text as
    it grows."""
    from msinfer.launcher.controller import Controller, ControllerConfig
    from msinfer.launcher.engine import EngineSetup
    from msinfer.launcher.replica import ReplicaConfig

    spec = plan.spec
    tp, dp = spec.parallel.tensor_parallel, spec.parallel.data_parallel
    # one replica of several ranks on an embedded Ray: its engine in this process
    # (launcher.engine.LocalEngine); a replica of one rank hosts its engine (launcher.engine)
    local = dp == 1 and not spec.ray.address and tp * spec.parallel.pipeline_parallel > 1
    replica = ReplicaConfig(
        tensor_parallel=tp, device=plan.device, placement=spec.parallel.placement,
        cpus_per_worker=spec.ray.num_cpus_per_worker, startup_timeout_s=spec.fault.startup_timeout_s,
        engine_setup=EngineSetup(spec, plan.model, plan.engine, plan.output_format, stream, local,
                                 **EngineSetup.intervals(dp, local)),
        tokenizer=plan.tokenizer if local else False,
        card_planner=card_replanner(plan) if plan.card is not None and simulate is None else None)
    if simulate is not None:
        from msinfer.launcher.simulate import StandInWorker
        replica = dataclasses.replace(replica, worker_cls=simulate.worker_cls or StandInWorker,
                                      worker_options={"timing": simulate}, device="cpu", cpus_per_worker=STAND_IN_CPUS)
    return Controller(ControllerConfig(plan.engine, replica, data_parallel=dp,
                                       max_restarts=spec.fault.max_replica_restarts,
                                       max_record_failures=spec.fault.max_record_failures,
                                       step_timeout_s=spec.fault.step_timeout_s))


def card_replanner(plan: Plan):
    """For replicas on cards (launcher.replica.Replica.card_planner): the card as its ranks measured
    it (total bytes, bytes in use before msinfer, where the figure comes from, and whether its int8
    matmuls passed the start-up kernel check) -> the job's EngineConfig with the KV cache that card
    holds (card_plan). The measured size wins over parallel.device_memory_gb, and a difference is
    reported; int8 layers the card cannot multiply are held dequantized, and the cache makes room
    for them; a card too small for the weights and one sequence of max_model_len stops the job
    (LaunchError, exit 2)."""
    from msinfer.launcher.replica import LaunchError
    spec, gib = plan.spec, 1024 ** 3
    dbytes = dtype_bytes(plan.engine.dtype)
    base = dataclasses.replace(plan.engine, num_blocks=spec.scheduler.kv_cache_blocks or 0)

    def replan(total: int, in_use: int, source: str, int8: tuple[bool, bool] = (True, True)) -> EngineConfig:
        weights, note = plan.weight_bytes_per_rank, None
        planned = holds_int8(plan.engine.device, plan.engine.ops)
        held = (planned[0] and int8[0], planned[1] and int8[1], planned[2] and int8[0], planned[3] and int8[1])
        weighs = weight_counter(plan.model, dbytes, spec.parallel.expert_parallel, plan.engine.device,
                                plan.engine.ops, spec.model.lora is not None, plan.engine.matmul_dtype == "bfloat16",
                                held)
        if held != planned:
            weights = max(weighs(spec.parallel.tensor_parallel, plan.engine.pipeline))
            what = " and ".join(w for w, p, h in zip(("layers", "experts"), planned, held) if p and not h)
            note = (f"the cards' int8 matmuls failed the start-up kernel check: the quantized {what} are held "
                    f"dequantized to {plan.engine.dtype}, {weights / gib:.2f} GiB of weights a rank where the plan "
                    f"counted {plan.weight_bytes_per_rank / gib:.2f}, and the KV cache is sized around them")
            print(f"msinfer: note: {note}", file=sys.stderr, flush=True)
        try:
            card = card_plan(spec, plan.model, base, weights, dbytes, measured=(total, in_use), weighs=weighs)
        except LayoutError as e:
            raise LaunchError(f"{e} (measured by the workers: {source})") from None
        figures = {**card.figures(), "source": source, "plan": plan.card.figures(),
                   **({"int8_note": note} if note else {})}
        asked = spec.parallel.device_memory_gb
        if asked is not None and abs(asked * gib - total) > 0.01 * total:
            figures["note"] = (f"parallel.device_memory_gb is {asked:g}, the cards measure {total / gib:.3g} GiB: "
                               f"the measured size sizes the KV cache")
            print(f"msinfer: note: {figures['note']}", file=sys.stderr, flush=True)
        return dataclasses.replace(plan.engine, num_blocks=card.blocks, card=figures)
    return replan


def start_controller(plan: Plan, simulate=None, stream: bool = False, on_stage=None):
    """Ray (embedded or joined) and every replica ready. Returns (controller, started_ray).
    `on_stage(name)`: called as the replicas reach each start-up stage."""
    import ray
    from msinfer.launcher.replica import init_ray, shutdown_ray

    spec = plan.spec
    started_ray = not ray.is_initialized()
    if simulate is None and not spec.ray.address and plan.engine.cpu_kernels:
        from msinfer.worker.build import start_build
        start_build()       # the CPU kernels' library, built while Ray starts (worker/build.py)
    workers = spec.parallel.tensor_parallel * spec.parallel.pipeline_parallel * spec.parallel.data_parallel
    try:        # (a signal held while Ray started is raised as init_ray returns: Ray is shut down)
        init_ray(spec.ray.address, int(workers * spec.ray.num_cpus_per_worker + 1), spec.ray.dashboard,
                 npus=workers if plan.engine.emulate and simulate is None else 0)
        controller = make_controller(plan, simulate, stream)
        controller.on_stage = on_stage
        if plan.device == "ascend" and simulate is None:
            check_npus(spec.parallel.tensor_parallel * spec.parallel.pipeline_parallel, spec.ray.address)
        if spec.ray.address and simulate is None and (note := cpu_room_note(spec)):
            print(f"msinfer: note: {note}", file=sys.stderr, flush=True)
        controller.start()
    except BaseException:
        if started_ray and ray.is_initialized():
            shutdown_ray()
        raise
    return controller, started_ray


def result_settings(plan: Plan, simulate: bool = False) -> dict:
    """What a job's result lines depend on besides their records: the checkpoint (its config.json,
    its weight files' names and sizes, its tokenizer's files and chat template, so that a model
    moved to another folder stays the same one), the compute dtypes, the task, a LoRA adapter
    (likewise) and its scale, the position scheme, the chat template's use, the sampling defaults,
    the output format and the reasoning and tool call parsers; and whether stand-ins wrote them
    (`simulate`: msinfer simulate's tokens are no model's). Not max_model_len: a record that fits gives the
    same tokens under any, and raising it for the records too long before is what --retry-failed
    is for. Kept in the status file (`JobRun.write_status`)."""
    import hashlib

    def identity(folder, *files: str, weights: bool = False) -> str:
        h = hashlib.sha256()
        for name in files:
            f = Path(folder) / name
            h.update(name.encode() + (f.read_bytes() if f.is_file() else b"-"))
        for f in sorted(Path(folder).glob("*.safetensors")) if weights else ():
            h.update(f"{f.name}:{f.stat().st_size}".encode())
        return h.hexdigest()[:16]

    s = plan.spec
    lora = s.model.lora
    return {"task": s.task,
            "model": {"checkpoint": identity(s.model.path, "config.json", weights=True),
                      "tokenizer": identity(s.model.tokenizer_path, *TOKENIZER_FILES, "chat_template.jinja"),
                      "dtype": plan.engine.dtype, "matmul_dtype": plan.engine.matmul_dtype,
                      "kv_cache_dtype": plan.engine.kv_cache_dtype,
                      "positions": s.model.positions.model_dump(mode="json"),
                      "lora": None if lora is None else {"adapter": identity(lora.path, "adapter_config.json",
                                                                                  weights=True),
                                                         "scale": lora.scale}},
            "input": {"chat_template": s.input.chat_template if s.input.template_text() is None else
                      "sha256:" + hashlib.sha256(s.input.chat_template.encode()).hexdigest()[:16],
                      "chat_template_kwargs": s.input.chat_template_kwargs},
            "sampling": s.sampling.model_dump(mode="json"),
            "output": {"format": plan.output_format, "reasoning_parser": s.output.reasoning_parser,
                       **({"tool_call_parser": s.output.tool_call_parser} if s.output.tool_call_parser else {})},
            **({"pooling": s.pooling.model_dump(mode="json")} if s.task == "embed" else {}),
            "simulate": simulate}


# Settings `result_settings` keeps that msinfer added since its first runs kept their settings,
# with the value every run before them ran with: such a run's results differ from a re-run's
# where the re-run sets another value.
SETTINGS_SINCE = {"model.kv_cache_dtype": "auto", "simulate": False}


def check_same_settings(output: str, settings: dict, from_model: tuple = ()) -> None:
    """Stops a run whose settings (`result_settings`) differ from those of the run that wrote the
    results its results file holds: it would skip their records, which would keep the other
    settings' results. Nothing to compare (no results yet, or a file written before msinfer kept
    the settings in its status file): no check. from_model: the sampling keys now taken from the
    model's generation_config.json, which the message names (a run from before msinfer took them)."""
    if not holds_results(output):
        return
    changed = changed_settings(kept_settings(output), settings)
    if not changed:
        return
    stand_in = next((then for k, then, _ in changed if k == "simulate"), None)
    if stand_in is not None:
        raise OutputError(f"{output} holds " + ("stand-in results of msinfer simulate, no model's; a run would skip "
                                                "their records" if stand_in else "a run's results; msinfer simulate "
                                                "would add stand-in lines to them") +
                          ". Run with --overwrite to start over, or write to another output.path")
    shown = shown_settings(changed)
    model = [k for k, _, _ in changed if k.startswith("sampling.") and k[len("sampling."):] in from_model]
    why = (f" ({', '.join(model)} now from the model's generation_config.json: set {'it' if len(model) == 1 else 'them'} "
           f"in the spec's sampling section, or model.generation_config: msinfer, to keep the run's)" if model else "")
    raise OutputError(f"{output} holds results of a run with other settings ({shown}){why}. A re-run skips "
                      f"the records it holds, so they would keep the other settings' results. Run with --overwrite "
                      f"to compute every record with these settings, or write to another output.path")


def unknown_settings(output: str) -> str | None:
    """What a run resuming `output` should hear when the results it holds have no settings kept
    beside them (their status file removed, or not copied with them): none are checked."""
    if not holds_results(output) or kept_settings(output) is not None:
        return None
    return (f"{output} holds results, but {status_path(output)}, which keeps the settings they were computed "
            f"with, is missing or unreadable: their settings are not checked against this run's (a re-run with "
            f"other settings would keep both), and this run's are kept from now on")


def changed_settings(before: dict | None, settings: dict) -> list[tuple[str, object, object]]:
    """(key, value then, value now) of each setting in which `settings` differ from those a run
    kept (`before`; None: nothing to compare)."""
    if before is None:
        return []

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
        return out

    def differs(k: str) -> bool:
        if k in old:
            return old[k] != new.get(k)
        # a key the run before did not keep is a setting msinfer added since, which that run ran
        # without (or with its SETTINGS_SINCE value); unless it sits under a value the run before
        # kept (a LoRA adapter where it had none)
        parts = k.split(".")
        return any(".".join(parts[:i]) in old for i in range(1, len(parts)))

    def leaf_above(side: dict, k: str) -> str | None:
        """The key above `k` that `side` holds as a value, not a section (a LoRA adapter, a
        structured output where the other run had none)."""
        parts = k.split(".")
        return next((p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in side), None)

    def value(d: dict, key: str):
        for part in key.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        return {k: v for k, v in d.items() if v is not None} if isinstance(d, dict) else d

    old, new = flat(before), flat(settings)
    old.update({k: v for k, v in SETTINGS_SINCE.items() if k not in old and k in new})
    changed, sections = [], set()
    for k in sorted(old.keys() | new.keys()):
        if not differs(k):
            continue
        # a section on one side and a value on the other: the section, once, as it is then and now
        top = leaf_above(old, k) if k not in old else leaf_above(new, k) if k not in new else None
        if top is None:
            changed.append((k, old.get(k), new.get(k)))
        elif top not in sections:
            sections.add(top)
            changed.append((top, value(before, top), value(settings, top)))
    return changed


# What a setting `result_settings` keeps under a name of its own comes from, as a message says it
SETTING_WORDS = {"model.checkpoint": "model.checkpoint (its config.json and weight files)",
                 "model.tokenizer": "model.tokenizer (its files and chat template)",
                 "model.dtype": "model.dtype (as resolved)",
                 "model.matmul_dtype": "model.matmul_dtype (the linear layers' dtype, from model.dtype)"}


def shown_settings(changed: list[tuple[str, object, object]]) -> str:
    """`changed_settings`' first four, as a message names them."""
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    return ", ".join(f"{SETTING_WORDS.get(k, k)} {then!r} then, {now!r} now" for k, then, now in changed[:4]) + more


def changed_records(spec: JobSpec, id_key: str, retry_failed: bool, redo_changed: bool) -> tuple[frozenset, int]:
    """The ids of the records whose result line in the results file answers another input than
    the record has now (launcher.writer.input_digest_index): a prompt edited since, or, where ids
    are line numbers (a .txt file, records without an id), a file whose lines were replaced,
    inserted or removed; and of the result lines named by such a line number that no longer
    holds a record (blank now, or past the file's end). A re-run would skip them and keep the
    old answers. Without `redo_changed` the run stops (OutputError) naming them; with it, they
    are returned, for the writer to drop their lines and the run to compute them again (those
    of lines gone: their count, the second figure, as they are not computed again). An error
    line's record is not counted with `retry_failed` (computed again anyway). A results file
    without digests (empty, or written before msinfer kept them) is not checked. id_key: the key
    of a result line that holds its record's id (launcher.writer.ResultWriter)."""
    output = spec.output.path
    if not holds_results(output):
        return frozenset(), 0
    before = input_digest_index(output)
    if not len(before):
        return frozenset(), 0
    changed = []                        # (id, its file's name, line, gone): not whole records, of which there may be many
    numbered: dict[str, bytearray] = {}   # each file whose records are named by their lines: which lines hold one
    current = IdSet()                   # the ids that end in digits (lines_gone's line numbers)
    for chunk in chunks(shard_input(spec)):
        current.update([rec.id for rec in chunk if rec.id[-1:].isdigit()])
        for rec, old in zip(chunk, before.lookup([rec.id for rec in chunk])):
            if rec.id == line_id(rec.source, rec.line):
                lines = numbered.setdefault(rec.source, bytearray())
                if rec.line >= len(lines):
                    lines.extend(bytes(rec.line + 1 - len(lines)))
                lines[rec.line] = 1
            if old < 0 or old == DIGEST_DROPPED or rec.digest is None or (retry_failed and old & 1):
                continue
            if old >> 1 != digest_value(rec.digest) >> 1:
                changed.append((rec.id, rec.source, rec.line, False))
    changed += lines_gone(output, before, numbered, current, retry_failed)
    if changed:     # (a digest is kept for each line written; one the user removed since holds nothing)
        held = held_ids(output, {c[0] for c in changed}, id_key)
        changed = [c for c in changed if c[0] in held]
    if not changed or redo_changed:
        return frozenset(c[0] for c in changed), sum(c[3] for c in changed)
    unit = unit_of(input_files(spec.input.path)[0][0])
    shown = ", ".join(f"'{rid}' ({location(source, line, unit)}{', no longer a record' if gone else ''})"
                      for rid, source, line, gone in changed[:4])
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    raise OutputError(f"{output} holds results of {len(changed)} record(s) whose input in {spec.input.path} changed "
                      f"since they were written: {shown}{more}. A re-run skips the records it holds, so they would "
                      f"keep the answers to their old input. Run with --redo-changed to compute these again (and "
                      f"drop the results of lines that are no longer records), with --overwrite to compute every "
                      f"record again, or write to another output.path")


def lines_gone(output: str, before: IdSet, numbered: dict[str, bytearray], current: IdSet,
               retry_failed: bool) -> list[tuple]:
    """(id, file, line, True) of each result in `<output>.inputs` (its latest digest in `before`)
    whose id is a line number (launcher.inputs.line_id) that no record has now (`current`: the
    records' ids that end in digits), where that line no longer holds a record named so: in a
    file whose records are named by their lines (`numbered`: file -> 1 at each line that holds
    such a record now), a line removed or blanked since; in any file, an error line's, whose
    record could not be read then (a line that was not JSON, say) and has an id of its own now. Its record is gone; a re-run
    would keep its result beside the others. An id a record gave itself ('100') is not taken for
    a line number while a record has it."""
    gone = {}
    for chunk in chunks(recorded_ids(output)):        # (those no record has: few, where every id is one)
        maybe = {}
        for rid in chunk:
            source, _, n = rid.rpartition(":")
            if not n.isdigit() or str(int(n)) != n or rid in gone:
                continue
            lines = numbered.get(source)
            if lines is None or int(n) >= len(lines) or not lines[int(n)]:
                maybe[rid] = (source, int(n), lines is not None)
        gone.update((rid, where) for (rid, where), v in zip(maybe.items(), current.lookup(list(maybe))) if v < 0)
    if not gone:
        return []
    latest = before.lookup(list(gone))
    return [(rid, source, n, True) for (rid, (source, n, named)), v in zip(gone.items(), latest)
            if v >= 0 and v != DIGEST_DROPPED and (named or v & 1) and not (retry_failed and v & 1)]


def resolve_output_format(spec: JobSpec, check_io: bool = True) -> str:
    """output.format, `auto` resolved: openai for an OpenAI Batch API input file (without
    `check_io`, no input file is read: msinfer)."""
    if spec.output.format != "auto":
        return spec.output.format
    return "openai" if check_io and is_openai_batch(spec.input.path) else "msinfer"


def result_id_key(output_format: str) -> str:
    """The key of a result line that holds its record's id (launcher.writer.ResultWriter)."""
    return "custom_id" if output_format == "openai" else "id"


def resume_summary(plan: Plan, simulate: bool = False) -> str | None:
    """`msinfer plan`'s word on the results file a run would resume (None: there is none yet): the
    lines it holds, and whether `run` resumes after them or stops, a line not being a result (as
    the writer's resume finds it) or its settings or records having changed since
    (check_same_settings, changed_records). `simulate`: a run of msinfer simulate's."""
    out = Path(plan.spec.output.path)
    if not holds_results(out):
        return None
    id_key = result_id_key(plan.output_format)
    lines = errors = 0
    bad = None              # the first line that is not a whole result, and a line after it
    with open(out, "rb") as f:
        for n, raw in enumerate(f, 1):
            lines += raw.endswith(b"\n")
            errors += FAILED in raw
            if bad is None and result_id(raw, id_key) is None:
                bad = [n, False]
            elif bad is not None:
                bad[1] = True
    held = f"{out} holds {lines} result line(s)" + (f", {errors} of them errors" if errors else "")
    try:
        if bad is not None and bad[1]:      # (a partial last line is a crash's, which a run cuts)
            raise not_a_result(out, bad[0])
        check_same_settings(str(out), result_settings(plan, simulate), plan.sampling_from_model)
        changed_records(plan.spec, result_id_key(plan.output_format), False, False)
    except OutputError as e:
        return f"{held}; `run` would stop: {e}"
    unknown = " (their settings unknown: " + status_path(out).name + " is missing)" if unknown_settings(str(out)) else ""
    return f"{held}{unknown}; `run` resumes after them (--overwrite starts over)"


def run_job(spec: JobSpec, *, overwrite: bool = False, stream: bool = False, progress: bool = True,
            t_start: float | None = None, simulate=None, retry_failed: bool = False,
            redo_changed: bool = False) -> dict:
    """Runs a job to the end; returns the summary (also written to <output>.summary.json).
    `simulate` (a launcher.simulate.StandIn): on stand-in workers, with the summary's `simulate`
    figures (see launcher/simulate.py). `retry_failed`: the records whose result line is an error
    are computed again (launcher.writer.ResultWriter); `redo_changed`: those whose input changed
    since their result was written (`changed_records`). While it runs, the job holds the results
    file's lock (launcher.writer.ResultsLock): a second run on the same output stops at once."""
    import ray

    t_start = time.perf_counter() if t_start is None else t_start
    plan = plan_job(spec, weights=simulate is None, make_output=True)
    spec = plan.spec
    drain = make_drain(spec)
    lock = ResultsLock(spec.output.path, "simulate" if simulate is not None else "run")
    writer = job = metrics = None
    started_ray = False
    startup_s, resumed = 0.0, {}
    try:
        settings, id_key = result_settings(plan, simulate is not None), result_id_key(plan.output_format)
        redo, removed = frozenset(), 0
        if not overwrite:               # (before the writer, which may drop lines, changes the file)
            check_same_settings(spec.output.path, settings, plan.sampling_from_model)
            if note := unknown_settings(spec.output.path):
                print(f"msinfer: note: {note}", file=sys.stderr, flush=True)
            redo, removed = changed_records(spec, id_key, retry_failed, redo_changed)
        writer = ResultWriter(spec.output.path, overwrite, spec.output.fsync_interval_s, id_key,
                              retry_failed=retry_failed, redo_ids=redo)
        job = JobRun(plan, None, writer.write_line, writer.done_ids, stream, progress, flush=writer.flush)
        job.settings = settings
        if plan.sampling_from_model:        # (as vLLM warns of it)
            print(f"msinfer: note: {sampling_note(spec, plan.sampling_from_model)}", file=sys.stderr, flush=True)
        if spec.output.metrics_port is not None:
            from msinfer.launcher.metrics import JobMetrics
            job.metrics = metrics = JobMetrics(spec.output.metrics_host, spec.output.metrics_port)
            print(f"msinfer: metrics at {metrics.address}", file=sys.stderr, flush=True)
        resumed = {"records_skipped_failed": writer.failed_lines, "records_retried": writer.dropped_failed,
                   "records_redone": writer.dropped_changed - removed, "records_removed": removed}
        records = job.new_records(shard_input(spec))
        first = next(records, None)
        if first is None:               # every record has its line: nothing to start
            return job.nothing_to_do(t_start, resumed)
        if drain.over():        # a deadline too near to finish anything: nothing is started
            drain.count_unread(itertools.chain([first], records))
            return job.conclude("drained", 0.0, resumed, drain, complete=False)
        job.write_status("starting")
        controller, started_ray = start_controller(plan, simulate, stream, on_stage=job.on_stage)
        job.controller = controller
        if metrics is not None:
            controller.on_latency = metrics.latency.observe
            metrics.update(controller)
        startup_s = time.perf_counter() - t_start
        job.write_status("running")
        if simulate is not None:
            from msinfer.launcher.simulate import capacity, cpu_seconds
            cpu0 = cpu_seconds(controller)
        controller.stop = drain
        SIGNALS.drain = drain
        try:
            complete = job.run(dealing_order(spec, itertools.chain([first], records)))
        finally:
            SIGNALS.drain = None
        add = None
        if simulate is not None:
            def add(summary):
                return {"simulate": capacity(summary, spec, simulate, cpu0, cpu_seconds(controller))}
        return job.conclude("done" if complete else "drained", startup_s, resumed, drain, complete, t_start, add)
    except BaseException as e:
        stop = SIGNALS.cause(e)
        if job is not None:
            state = ("drained" if getattr(stop, "drained", False) else
                     "interrupted" if isinstance(stop, KeyboardInterrupt) else "failed")
            with contextlib.suppress(Exception):    # (the stop's own error is the one to report)
                stop.summary = job.conclude(state, startup_s, resumed, drain, True, t_start,
                                            lambda _: {"stopped": {"state": state, "why": stop_words(stop)}},
                                            engines=False)      # (the command prints it too)
        if stop is not e:
            raise stop from None
        raise
    finally:
        if job is not None:
            job.close()
        if job is not None and job.controller is not None:
            job.controller.shutdown()
        if metrics is not None:
            metrics.close()
        if writer is not None:
            writer.close()
        lock.release()
        if started_ray and ray.is_initialized():
            from msinfer.launcher.replica import shutdown_ray
            shutdown_ray()


def stop_words(stop: BaseException) -> str:
    """Why a run stopped before its end, for its summary's `stopped`."""
    if isinstance(stop, Terminated):
        return f"{stop.signal_name}: " + ("stopped before any record was in flight" if stop.drained
                                          else "stopped at once, the records in flight given up")
    if isinstance(stop, KeyboardInterrupt):
        return "interrupted (Ctrl-C): the records in flight given up"
    return str(stop) or type(stop).__name__


def make_drain(spec: JobSpec) -> Drain:
    """The run's stop conditions (launcher.drain): fault.drain_s, and the earlier of run.deadline
    (a duration counts from now) and, inside a Slurm job, its allocation's end."""
    deadlines = []
    if spec.run.deadline is not None:
        try:
            deadlines.append((parse_deadline(spec.run.deadline), f"run.deadline {spec.run.deadline}"))
        except ValueError as e:         # a date and time that passed since the spec was read
            raise SpecError(f"run.deadline: {e}") from None
    if spec.run.slurm_time_limit:
        slurm = slurm_time_left()
        if slurm is not None:
            deadlines.append((slurm[0], f"the Slurm allocation's end, from {slurm[1]}"))
    deadline, source = min(deadlines) if deadlines else (None, "")
    return Drain(spec.fault.drain_s, deadline, source, record_length(spec))


def record_length(spec: JobSpec):
    """record -> the tokens it is expected to run for under `spec` (launcher.inputs.expected_length):
    what longest-first dealing orders by and what a deadline's estimate multiplies."""
    default, score = (0 if spec.task in POOLING_TASKS else spec.sampling.max_new_tokens), spec.task == "score"
    return lambda rec: expected_length(rec, default, score)


def dealing_order(spec: JobSpec, records):
    """The records in the order they are dealt: input.order (see launcher.inputs.longest_first)."""
    if spec.input.order == "arrival":
        return records
    return longest_first(records, spec.input.lookahead, record_length(spec))


def check_npus(ranks: int, address: str | None) -> None:
    """Fails in seconds where the Ray cluster advertises fewer NPUs than one replica needs:
    placement would otherwise wait fault.startup_timeout_s for cards that are not there."""
    import ray
    from msinfer.launcher.replica import LaunchError
    have = int(ray.cluster_resources().get("NPU", 0))
    if have < ranks:
        where = f"the Ray cluster at {address}" if address else "this machine's embedded Ray"
        raise LaunchError(
            f"parallel.device is ascend, but {where} advertises {have} 'NPU' resource(s), and a replica of "
            f"{ranks} ranks (tensor_parallel x pipeline_parallel) needs {ranks}. Start Ray's nodes on Ascend machines (Ray finds "
            f"the cards through CANN; scripts/msinfer-node.sh), set parallel.device: cpu, or set "
            f"{EMULATE_ENV}=1 to run the Ascend path emulated on the CPU")


def cpu_room_note(spec: JobSpec) -> str | None:
    """Where no node of the Ray cluster has the CPUs a replica's packed stage asks for (spread:
    the cluster has too few in all), what to do, said before placement waits for them up to
    fault.startup_timeout_s: a node with more may yet join (an autoscaler's), so it is a note."""
    import ray
    tp, cpus = spec.parallel.tensor_parallel, spec.ray.num_cpus_per_worker
    nodes = [n.get("Resources", {}).get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
    if spec.parallel.placement == "pack":
        need, have = tp * cpus, max(nodes, default=0.0)
        if have >= need:
            return None
        what = f"no node of it has the {need:g} CPUs that a replica's {tp} packed workers ask for"
    else:
        need, have = tp * spec.parallel.pipeline_parallel * cpus, sum(nodes)
        if have >= need:
            return None
        what = f"it has {have:g} CPUs in all, and a replica's workers ask for {need:g}"
    return (f"the Ray cluster at {spec.ray.address}: {what} (its nodes: {', '.join(f'{c:g}' for c in nodes)} CPUs), "
            f"so placement waits for a node that has them, up to fault.startup_timeout_s "
            f"({spec.fault.startup_timeout_s:g} s). Ray's CPUs are slots, not cores: start the nodes with "
            f"more (scripts/msinfer-node.sh --num-cpus N, ray start --num-cpus N), or lower "
            f"ray.num_cpus_per_worker or parallel.tensor_parallel")


def threads_per_worker(workers_on_node: int) -> int:
    """Intra-op threads per worker so the node's cores are shared, not oversubscribed."""
    return max(1, (os.cpu_count() or 1) // max(1, workers_on_node))
