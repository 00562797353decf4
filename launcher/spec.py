"""The job spec: one pydantic model per YAML section, validated once, before Ray starts.

`load_spec(path, overrides)` reads the YAML file, applies `--set dotted.key=value` overrides and
validates. Every problem becomes a `SpecError` whose lines read
`job.yaml:12: scheduler.max_batch: unknown key; did you mean 'max_batch_size'?`.
Paths (`~`, `${VAR}`, `${VAR:-default}`) are expanded; relative ones resolve against the spec file's folder, or
against the working directory when given with --set (that is where the user typed them).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from msinfer.launcher.errors import RecordError, SpecError
from msinfer.worker.protocol import SamplingParams

INPUT_SUFFIXES = (".txt", ".jsonl", ".parquet")


SHARD = re.compile(r"(\d+)/(\d+)")


def parse_shard(value: str) -> tuple[int, int]:
    """input.shard's 'K/N' -> (K, N) (launcher.shards); ValueError where it is not K/N with
    0 <= K < N."""
    m = SHARD.fullmatch(value.strip())
    if not m:
        raise ValueError(f"expected 'K/N' (this task's number K, from 0, of N tasks) or 'auto', got {value!r}")
    k, n = int(m.group(1)), int(m.group(2))
    if n < 1 or k >= n:
        raise ValueError(f"'{value}': K must be from 0 to N-1 (K {k}, N {n})")
    return k, n


def is_pattern(path: str | Path) -> bool:
    """Whether input.path is a pattern of file names (launcher.inputs.input_files)."""
    return any(c in str(path) for c in "*?[")


PATH_KEYS = ("model.path", "model.tokenizer", "model.lora.path", "input.path", "output.path")
_ENV_REF = re.compile(r"\$\{([^}]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand_path(value: str, base: str | Path | None = None) -> str:
    """`${VAR}` (or, as the shell has it, `${VAR:-default}`: the default where VAR is unset or
    empty), then `~`, then relative to `base` (default: the working directory). Raises ValueError
    naming an unset variable that has no default."""
    def env(m: re.Match) -> str:
        name, has_default, default = m.group(1).partition(":-")
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"'${{{m.group(1)}}}' is not a valid environment variable reference")
        if has_default:
            return os.environ.get(name) or default
        if name not in os.environ:
            raise ValueError(f"environment variable {name} is not set (used as ${{{name}}} in '{value}')")
        return os.environ[name]
    if not value.strip():
        raise ValueError("expected a path, got an empty string")
    path = os.path.expanduser(_ENV_REF.sub(env, value))
    return os.path.normpath(os.path.join(base or os.getcwd(), path))


def _expand(cls, value: str | None, info: ValidationInfo) -> str | None:
    return None if value is None else expand_path(value, (info.context or {}).get("base"))


class Section(BaseModel):
    # strict: a quoted "2" or a YAML `yes` for a number is a mistake to report, not to coerce
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class LoraSpec(Section):
    path: str
    scale: float = 1.0
    _path = field_validator("path")(_expand)


class PositionsSpec(Section):
    scheme: Literal["rope", "rope2d"] = "rope"
    ratio: float = Field(0.0, ge=0.0, le=1.0)   # rope2d: the share of rotary frequency pairs for the branch id

    @model_validator(mode="after")
    def _ratio_is_rope2d(self) -> PositionsSpec:
        if self.scheme != "rope2d" and self.ratio:
            raise ValueError(f"ratio {self.ratio:g} applies to scheme rope2d only (scheme is {self.scheme})")
        return self


class ModelSpec(Section):
    path: str
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    max_model_len: int | None = Field(None, ge=1)  # None: min(max_position_embeddings, 4096), set by the caller
    # a max_model_len past the positions the model is made for (ModelConfig.context_positions) is
    # refused unless this is set, as vLLM refuses it without VLLM_ALLOW_LONG_MAX_MODEL_LEN
    allow_long_max_model_len: bool = False
    tokenizer: str | None = None                    # None: model.path
    allow_pickle: bool = False
    trust_remote_code: bool = False
    graph_mode: bool = True
    ops: Literal["auto", "portable"] = "auto"      # auto: the device's fastest operators (CPU kernels, Ascend's fused)
    # the KV cache's element, as vLLM's kv_cache_dtype: auto (the compute dtype's), or bfloat16: K and
    # V rounded to the nearest bfloat16 as they are written, half a float32 cache's bytes (the CPU
    # kernels in a float32 job; where the cache is bfloat16 already, the same as auto)
    kv_cache_dtype: Literal["auto", "bfloat16"] = "auto"
    shapes: Literal["auto", "dynamic", "buckets"] = "auto"   # auto: dynamic where the operators take them
    # each rank's step graphs saved and loaded again by a later run (worker/graph_cache.py); on the CPU
    compile_cache: bool = True
    lora: LoraSpec | None = None
    positions: PositionsSpec = Field(default_factory=PositionsSpec)
    # auto: the sampling keys the spec leaves unset take the values the checkpoint's
    # generation_config.json recommends, as vLLM's generation_config "auto" does
    # (SamplingSpec.with_model_defaults); msinfer: the sampling section's own defaults only
    generation_config: Literal["auto", "msinfer"] = "auto"
    # task classify with a causal LM (a reranker such as Qwen3-Reranker): the labels are these
    # tokens, and each one's logit is its LM-head row on the last token, as vLLM's
    # classifier_from_token makes a classifier of one
    classifier_from_tokens: list[str] | None = Field(None, min_length=1)
    _paths = field_validator("path", "tokenizer")(_expand)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path


class ParallelSpec(Section):
    tensor_parallel: int = Field(1, ge=1)
    data_parallel: int = Field(1, ge=1)
    device: Literal["auto", "cpu", "ascend"] = "auto"
    placement: Literal["pack", "spread"] = "pack"
    expert_parallel: bool = False        # a mixture of experts: whole experts per rank instead of slices of each
    device_memory_gb: float | None = Field(None, gt=0)   # an accelerator card's memory; None: 64 on Ascend
    memory_fraction: float = Field(0.9, gt=0, le=1)       # of it for weights, KV cache, activations, runtime
    # a replica as pipeline stages of tensor_parallel ranks each, a contiguous run of decoder layers
    # per stage (sharding.layout.stage_layers); pipeline_layers: each stage's count, else an even split
    pipeline_parallel: int = Field(1, ge=1)
    pipeline_layers: list[int] | None = None

    @model_validator(mode="after")
    def _stages(self) -> ParallelSpec:
        layers, pp = self.pipeline_layers, self.pipeline_parallel
        if layers is None:
            return self
        if len(layers) != pp:
            raise ValueError(f"pipeline_layers has {len(layers)} entries for pipeline_parallel {pp}: one layer count "
                             f"per stage")
        if min(layers) < 1:
            raise ValueError(f"pipeline_layers {layers}: every stage needs at least one decoder layer")
        return self


class InputSpec(Section):
    path: str
    # true: the tokenizer's chat template; false: only for 'messages' records; or a template of
    # one's own, as vLLM's --chat-template takes it: a Jinja file's path (read here, so that the
    # spec carries its text to every engine) or the template's text
    chat_template: bool | str = True
    # variables of the chat template for every record it renders (Qwen3: {enable_thinking: false}),
    # as vLLM's chat_template_kwargs; a record's own chat_template_kwargs go over them
    chat_template_kwargs: dict[str, Any] = {}
    # longest_first: within a window of `lookahead` records read ahead, the record with the most
    # expected work (prompt tokens + max_new_tokens, per sample) is dealt first, so that no long
    # record starts last and sets the job's tail (launcher.inputs.longest_first); arrival: as read
    order: Literal["longest_first", "arrival"] = "longest_first"
    lookahead: int = Field(4096, ge=1)
    # "K/N": this job takes the records whose id hashes to K mod N (one of N array tasks), and
    # writes results.K-of-N.jsonl; "auto": K and N from a Slurm job array (launcher.shards)
    shard: str | None = None
    # file: a shard takes input.path's files K, K+N, K+2N, ... in name order and reads no other
    shard_by: Literal["record", "file"] = "record"

    @field_validator("shard")
    @classmethod
    def _shard(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return value
        k, n = parse_shard(value)
        return f"{k}/{n}"

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: bool | str, info: ValidationInfo) -> bool | str:
        if isinstance(value, bool) or any(c in value for c in "{}\n"):  # (as vLLM tells a template from a path)
            return value
        path = _expand(cls, value, info)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"expected true, false, a Jinja template or its file; '{value}' is not a template and "
                             f"{path} does not read as a file ({getattr(e, 'strerror', None) or e})") from None
        if not text.strip():
            raise ValueError(f"the chat template file {path} is empty")
        return text

    def template_text(self) -> str | None:
        """The chat template of the spec's own (chat_template as text), None for the tokenizer's."""
        return None if isinstance(self.chat_template, bool) else self.chat_template

    @field_validator("path")
    @classmethod
    def _input_path(cls, value: str, info: ValidationInfo) -> str:
        # a file, a folder of them or a pattern (launcher.inputs.input_files checks what they hold)
        path = _expand(cls, value, info)
        if Path(path).suffix.lower() not in INPUT_SUFFIXES and not is_pattern(path) and not Path(path).is_dir():
            raise ValueError(f"expected a .txt, .jsonl or .parquet file, a folder of such files or a pattern "
                             f"(data/*.parquet), got '{value}'")
        return path


def closed_objects(schema):
    """A copy of a JSON schema in which every object that lists its properties and says nothing
    of others has `additionalProperties: false`: vLLM's default backend (xgrammar, strict) allows
    no keys a schema does not name, where the JSON Schema standard (and llguidance, which msinfer
    builds its masks with) allows any; vLLM's guidance backend does this with its
    disable-additional-properties option (structured_output/backend_guidance.py). Only the
    schema's own subschemas are walked, as that option walks them: data (an `enum`'s or a
    `const`'s values) and the names of properties stay as written."""
    if isinstance(schema, list):
        return [closed_objects(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed_objects(out[key])
    if "additionalProperties" not in out and (isinstance(out.get("properties"), dict)
                                              or isinstance(out.get("patternProperties"), dict)):
        out["additionalProperties"] = False
    return out


# a JSON schema's keywords whose values are schemas (SUBSCHEMAS: one, or a list of them) or maps
# of names to schemas (SCHEMA_MAPS), as vLLM's guidance backend walks them
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
              "unevaluatedItems", "not", "if", "then", "else", "contentSchema", "items", "prefixItems", "allOf",
              "anyOf", "oneOf")


class StructuredSpec(Section):
    """Structured outputs, with vLLM's names: exactly one of them."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
    json_schema: dict | str | None = Field(None, alias="json")     # a JSON schema, or its text
    json_object: bool = False                                   # any JSON object
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None                                  # a Lark or GBNF grammar

    @field_validator("json_schema")
    @classmethod
    def _schema_text(cls, value):
        """A schema given as text must be a JSON object (kept as text: a re-run's settings compare it)."""
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"the schema's text is not JSON ({e.msg} at character {e.pos + 1} of "
                                 f"{len(e.doc)})") from None
            if not isinstance(schema, dict):
                raise ValueError(f"the schema's text is JSON of a {type(schema).__name__}, not a JSON schema "
                                 f"(an object)")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredSpec:
        given = [k for k, v in (("json", self.json_schema), ("json_object", self.json_object or None),
                                ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar))
                 if v is not None]
        if len(given) != 1:
            raise ValueError("expected exactly one of json, json_object, regex, choice, grammar"
                             + (f"; got {', '.join(given)}" if given else ""))
        return self

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar (worker/sampler.py applies it)."""
        import llguidance
        if self.json_schema is not None:
            schema = json.loads(self.json_schema) if isinstance(self.json_schema, str) else self.json_schema
            return llguidance.grammar_from("json", json.dumps(closed_objects(schema)))
        if self.json_object:
            return llguidance.grammar_from("json", '{"type": "object"}')
        if self.regex is not None:
            return llguidance.grammar_from("regex", self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", self.choice)
        return llguidance.grammar_from("grammar", self.grammar)


class SamplingSpec(Section):
    """vLLM's sampling parameters, with its names and meanings (worker/sampler.py)."""
    n: int = Field(1, ge=1)                     # samples per record, from one prefill of its prompt
    max_new_tokens: int = Field(256, ge=1)
    min_tokens: int = Field(0, ge=0)            # no end-of-sequence or stop before this many tokens
    temperature: float = Field(0.0, ge=0.0, le=2.0)     # (vLLM's range; below 0.01 it samples at 0.01)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)                        # -1 or 0: the whole vocabulary
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] = {}
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    bad_words: list[Annotated[str, Field(min_length=1)]] = []
    structured_outputs: StructuredSpec | None = None
    stop: list[Annotated[str, Field(min_length=1)]] = []
    include_stop_str_in_output: bool = False     # the stop string hit stays at the end of the text
    skip_special_tokens: bool = True             # false: the text keeps the tokenizer's special tokens
    # k: only the prompt's last k tokens (left truncation, after the chat template), -1: the last
    # model.max_model_len - 1; None: a longer prompt fails its record
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    ignore_eos: bool = False
    logprobs: int = Field(0, ge=0)
    # each prompt token's log-probability, and with k > 0 the k most likely alternatives (at most 20)
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value: Any) -> Any:
        # JSON (and OpenAI's logit_bias) writes token ids as string keys
        if isinstance(value, dict):
            try:
                return {int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k: v
                        for k, v in value.items()}
            except ValueError:
                return value
        return value

    @field_validator("temperature")
    @classmethod
    def _vllm_least_temperature(cls, value: float) -> float:
        # vLLM samples a temperature in (0, 0.01) at 0.01 (SamplingParams.__post_init__, _MAX_TEMP):
        # below it the logits' scale overflows
        return 0.01 if 0.0 < value < 0.01 else value

    @field_validator("top_k")
    @classmethod
    def _no_top_k(cls, value: int) -> int:
        return 0 if value == -1 else value      # (vLLM's -1, "disabled", is msinfer's 0)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        # vLLM's `stop` is one string or a list of them
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list):
            raise ValueError(f"expected a string or a list of strings (a number quoted: '5'), got {value!r}")
        return value

    @model_validator(mode="after")
    def _min_tokens_within_max(self) -> SamplingSpec:
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1 (the prompt's last k tokens), or -1")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_new_tokens ({self.max_new_tokens})")
        return self

    def with_model_defaults(self, recommended: tuple, source: str) -> tuple[SamplingSpec, list[str]]:
        """These settings with the (key, value) pairs a checkpoint recommends
        (ModelConfig.generation_sampling, read from `source`) in place of the keys left unset,
        and the keys so taken. A value the sampling section would refuse raises SpecError naming
        the file and the key."""
        taken = {k: v for k, v in recommended if k not in self.model_fields_set}
        if not taken:
            return self, []
        try:
            merged = SamplingSpec.model_validate({**self.model_dump(exclude_unset=True), **taken})
        except ValidationError as e:
            problems = _describe_all(e, SamplingSpec, lambda loc: "", prefix="sampling")
            raise SpecError(f"{source} recommends sampling defaults the sampling section refuses: "
                            + "; ".join(problems) + ". Set those keys in the spec's sampling section, or "
                            "model.generation_config: msinfer to leave the file's out") from None
        return merged, list(taken)

    def merge(self, overrides: dict | None, record_id: str | None = None) -> SamplingSpec:
        """These defaults with one record's `sampling` overrides, validated like the spec."""
        if not overrides:
            return self
        where = f"record '{record_id}'" if record_id is not None else "record"
        if not isinstance(overrides, dict):
            raise RecordError(f"{where}: sampling: expected a mapping of sampling keys, got {_show(overrides)}")
        try:
            return SamplingSpec.model_validate({**self.model_dump(), **overrides})
        except ValidationError as e:
            problems = _describe_all(e, SamplingSpec, lambda loc: "", prefix="sampling")
            raise RecordError(f"{where}: " + "; ".join(problems)) from None

    def to_params(self) -> SamplingParams:
        structured = self.structured_outputs.grammar_text() if self.structured_outputs else ""
        return SamplingParams(**{**self.model_dump(exclude={"structured_outputs"}), "structured": structured,
                                 "stop": tuple(self.stop),
                                 "stop_token_ids": tuple(self.stop_token_ids), "bad_words": tuple(self.bad_words),
                                 "logit_bias": tuple(sorted(self.logit_bias.items())),
                                 "allowed_token_ids": tuple(self.allowed_token_ids or ())})


MAX_DECODE_STEPS = 32       # scheduler.decode_steps: each is a copy of the step in its graph


class SchedulerSpec(Section):
    max_batch_size: int = Field(32, ge=1)
    # prompt tokens per prefill step, packed: a static graph keeps every intermediate of its step
    # (~1 MB a token for the demo model), and 512 to 4096 prefill equally fast on the CPU here
    # (docs/benchmarks.md, "The prefill budget on the CPU")
    max_batched_tokens: int = Field(512, ge=1)
    block_size: int = Field(16, ge=1)
    kv_cache_blocks: int | None = Field(None, ge=1)  # None: max_batch_size sequences of max_model_len
    # schedule and submit each step while the one before it runs (launcher/engine.py)
    async_scheduling: bool = True
    # decode steps run this many at a time in one compiled call, each feeding the next its
    # tokens (launcher/engine.py, worker.model.CausalLM.decode_chain); None: 4 on the CPU kernels, else 1
    decode_steps: int | None = Field(None, ge=1, le=MAX_DECODE_STEPS)
    # a new sequence starts after the KV blocks of its longest cached prefix (launcher/scheduler.py)
    prefix_caching: bool = True
    # with prefix caching and data_parallel > 1: records whose prompts begin alike go to one replica
    # while it has room (launcher/controller.py)
    route_by_prefix: bool = True


class OutputSpec(Section):
    path: str
    status_interval_s: float = Field(2.0, gt=0.0)
    fsync_interval_s: float = Field(1.0, ge=0.0)    # results synced to disk at most this often (0: every line)
    format: Literal["auto", "msinfer", "openai"] = "auto"   # auto: openai for an OpenAI Batch API input file
    # vLLM's reasoning parser: a chat completion's <think> text apart from its answer (launcher.tokenizer)
    reasoning_parser: Literal["qwen3", "deepseek_r1", "deepseek_v3"] | None = None
    # vLLM's tool call parser: the calls a chat completion writes, as message.tool_calls (launcher.tools)
    tool_call_parser: Literal["hermes", "llama3_json", "pythonic", "llama4_pythonic", "mistral", "deepseek_v3",
                              "deepseek_v31", "kimi_k2", "qwen3_coder"] | None = None
    # Prometheus metrics at http://<metrics_host>:<metrics_port>/metrics while the run lasts (launcher.metrics)
    metrics_port: int | None = Field(None, ge=1, le=65535)
    metrics_host: str = Field("127.0.0.1", min_length=1)
    _path = field_validator("path")(_expand)


class RaySpec(Section):
    address: str | None = None  # None: embedded local Ray; "auto" or host:port joins a cluster
    dashboard: bool = False
    num_cpus_per_worker: float = Field(1.0, ge=0.0)


class FaultSpec(Section):
    max_replica_restarts: int = Field(3, ge=0)
    # a record running in this many replica failures is quarantined: an error line, not dealt again
    max_record_failures: int = Field(2, ge=1)
    step_timeout_s: float = Field(600.0, gt=0.0)
    startup_timeout_s: float = Field(900.0, gt=0.0)   # each start-up stage: placement, communication init, load
    # after SIGTERM or SIGUSR1, the records in flight may finish for this long (launcher.drain)
    drain_s: float = Field(30.0, ge=0.0)


class RunSpec(Section):
    # the run ends (drained) before this: a duration from its start ("2h", "45m", "1h30m", "90s") or a
    # date and time ("2026-11-27T06:00"); records that would not finish by then are not dealt
    deadline: str | None = None
    # inside a Slurm job, the allocation's end is a deadline too
    slurm_time_limit: bool = True

    @field_validator("deadline", mode="before")
    @classmethod
    def _deadline(cls, value: Any) -> Any:
        from datetime import datetime
        from msinfer.launcher.drain import parse_deadline
        if isinstance(value, datetime):            # YAML reads an unquoted date and time as one
            value = value.isoformat()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = f"{value}s"
        if isinstance(value, str):
            parse_deadline(value)
        return value


class PoolingSpec(Section):
    """task: embed: how a prompt's final hidden states make its embedding (launcher.embed).
    `auto` (type auto, normalize unset) reads the checkpoint's sentence-transformers files as
    vLLM does (modules.json, its Pooling module's config.json, a Normalize module); a checkpoint
    without them pools its last token and normalizes, vLLM's default for a decoder model."""
    type: Literal["auto", "last", "mean", "cls"] = "auto"
    normalize: bool | None = None
    # the first k values only (a Matryoshka-trained model), normalized after where normalize is on;
    # an OpenAI request's `dimensions` sets its own
    dimensions: int | None = Field(None, ge=1)


class JobSpec(Section):
    task: Literal["generate", "score", "embed", "classify"] = "generate"
    model: ModelSpec
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    input: InputSpec
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    output: OutputSpec
    ray: RaySpec = Field(default_factory=RaySpec)
    fault: FaultSpec = Field(default_factory=FaultSpec)
    run: RunSpec = Field(default_factory=RunSpec)
    pooling: PoolingSpec = Field(default_factory=PoolingSpec)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        # `sampling:` with every line commented out is YAML null: read it as "all defaults"
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _DEFAULTED)}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        n, m = self.model.max_model_len, self.sampling.max_new_tokens
        if self.task != "embed" and self.pooling != PoolingSpec():
            raise ValueError(f"pooling applies to task: embed, and the task is {self.task}")
        # (embed and classify generate nothing; the default of 256, left unset, is capped as a
        # record's own is: a sequence ends at max_model_len with finish_reason length)
        if n is not None and m >= n and self.task not in ("embed", "classify") \
                and "max_new_tokens" in self.sampling.model_fields_set:
            raise ValueError(f"sampling.max_new_tokens ({m}) must be less than model.max_model_len ({n}): "
                             f"a sequence holds its prompt and the generated tokens")
        blocks, bs = self.scheduler.kv_cache_blocks, self.scheduler.block_size
        if n is not None and blocks is not None and blocks * bs < n:
            raise ValueError(f"scheduler.kv_cache_blocks ({blocks}) x scheduler.block_size ({bs}) = {blocks * bs} "
                             f"tokens cannot hold one sequence of model.max_model_len ({n}) tokens")
        if self.input.path == self.output.path:
            raise ValueError(f"output.path and input.path are the same file ({self.input.path}); "
                             f"the results would overwrite the prompts")
        return self

    def resolved(self) -> dict:
        return self.model_dump(mode="json")

    def with_max_model_len(self, n: int) -> JobSpec:
        """The spec with a null model.max_model_len resolved by the caller (from the checkpoint's
        config), with the checks that depend on it run again."""
        data = self.model_dump(mode="json", exclude_unset=True)    # (a key left unset stays unset)
        data["model"]["max_model_len"] = n
        try:
            return JobSpec.model_validate(data)
        except ValidationError as e:
            raise SpecError("\n".join(_describe_all(e, JobSpec, lambda loc: "job spec"))) from None


_DEFAULTED = {name for name, f in JobSpec.model_fields.items() if not f.is_required()}


def load_spec(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: job spec file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: cannot read the job spec ({e})") from None
    data, lines = _parse_yaml(text, str(path))
    if data is None:
        raise SpecError(f"{path}: the job spec is empty; expected a mapping with at least "
                        f"model.path, input.path and output.path")
    if not isinstance(data, dict):
        raise SpecError(f"{path}: the top level of the job spec must be a mapping of sections "
                        f"({', '.join(JobSpec.model_fields)}), got {_kind(data)}")
    set_keys = [_apply_override(data, item) for item in overrides or ()]

    def where(loc: tuple) -> str:
        dotted = ".".join(map(str, loc))
        if any(dotted == k or dotted.startswith(k + ".") for k in set_keys):
            return "--set"
        if loc in lines:
            return f"{path}:{lines[loc]}"
        if any(k.startswith(dotted + ".") for k in set_keys):  # e.g. --set task.x=1 made `task` a mapping
            return "--set"
        for n in range(len(loc) - 1, 0, -1):
            if loc[:n] in lines:
                return f"{path}:{lines[loc[:n]]}"
        return str(path)

    try:
        return JobSpec.model_validate(data, context={"base": path.absolute().parent})
    except ValidationError as e:
        problems = _describe_all(e, JobSpec, where)
        head = "" if len(problems) == 1 else f"{len(problems)} problems in the job spec:\n"
        raise SpecError(head + "\n".join(problems)) from None


def validate(model: type[BaseModel], data: Any, where: str, prefix: str = "") -> Any:
    """`model` from `data` given in Python (the Python API), each problem in the words the CLI
    uses for a YAML file: `where: dotted.key: what was expected`."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = _describe_all(e, model, lambda loc: where, prefix)
        raise SpecError("\n".join(problems)) from None


# ---- YAML with line numbers -------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        # PyYAML keeps the last of two equal keys silently; a second `sampling:` section is a mistake
        seen = {}
        for key_node, _ in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node)
            if key in seen and key != "<<":
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice (first on line {seen[key] + 1}); YAML would keep "
                    f"only the last one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


# YAML 1.1 reads 1e-3 as a string; read it as the number the user meant
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _parse_yaml(text: str, name: str) -> tuple[Any, dict[tuple, int]]:
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        raise SpecError(f"{where}: malformed YAML: {problem}" + (f" ({context})" if context else "")) from None
    lines: dict[tuple, int] = {}

    def walk(n, prefix: tuple):
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode):
                    lines[prefix + (k.value,)] = k.start_mark.line + 1
                    walk(v, prefix + (k.value,))
    walk(node, ())
    return data, lines


def _apply_override(data: dict, item: str) -> str:
    key, sep, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not all(parts):
        raise SpecError(f"--set {item!r}: expected dotted.key=value, e.g. --set parallel.tensor_parallel=2")
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise SpecError(f"--set {key}: the value {text!r} is not a valid YAML scalar or list "
                        f"({getattr(e, 'problem', None) or e})") from None
    if key in PATH_KEYS and isinstance(value, str):
        try:
            value = expand_path(value)
        except ValueError as e:
            raise SpecError(f"--set {key}: {e}") from None
    elif key == "input.chat_template" and isinstance(value, str) and "{" not in value:
        with contextlib.suppress(ValueError):      # a template's file, named where it was typed (else the text)
            if os.path.isfile(expand_path(value)):
                value = expand_path(value)
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise SpecError(f"--set {key}: '{'.'.join(parts[:i + 1])}' is {_kind(child)}, not a section of keys")
        node = child
    node[parts[-1]] = value
    return key


# ---- pydantic errors as sentences -------------------------------------------------------------

def _bound(op: str, x) -> str:
    # the bound's type is the field's: Field(1, ge=1) is an integer, Field(0.0, ge=0.0) a number
    return f"expected a number {op} {x:g}" if isinstance(x, float) else f"expected an integer {op} {x}"


_EXPECTED: dict[str, Callable[[dict], str]] = {
    "greater_than_equal": lambda c: _bound(">=", c["ge"]),
    "greater_than": lambda c: _bound(">", c["gt"]),
    "less_than_equal": lambda c: _bound("<=", c["le"]),
    "less_than": lambda c: _bound("<", c["lt"]),
    "int_type": lambda c: "expected an integer",
    "int_from_float": lambda c: "expected an integer",
    "float_type": lambda c: "expected a number",
    "finite_number": lambda c: "expected a finite number",
    "bool_type": lambda c: "expected true or false",
    "string_type": lambda c: "expected a string",
    "string_too_short": lambda c: "expected a non-empty string",
    "literal_error": lambda c: f"expected one of {c['expected']}",
    "list_type": lambda c: "expected a list",
    "model_type": lambda c: "expected a mapping",
    "dict_type": lambda c: "expected a mapping",
}


def _describe_all(e: ValidationError, root: type[BaseModel], where: Callable[[tuple], str],
                  prefix: str = "") -> list[str]:
    return [_describe(err, root, where, prefix) for err in e.errors()]


def _describe(err: dict, root: type[BaseModel], where: Callable[[tuple], str], prefix: str) -> str:
    loc = tuple(err["loc"])
    dotted = ".".join([prefix] * bool(prefix) + [f"[{p}]" if isinstance(p, int) else str(p) for p in loc])
    dotted = dotted.replace(".[", "[")
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        what = "unknown key; " + _suggest(str(loc[-1]), _keys_at(root, loc[:-1]))
    elif kind == "missing":
        what = "missing required key"
    elif kind in ("value_error", "assertion_error"):
        what = str(ctx.get("error", err["msg"]))
    else:
        expected = _EXPECTED.get(kind, lambda c: "expected: " + err["msg"].replace("Input should be ", ""))(ctx)
        what = f"{expected}, got {_show(err['input'])}"
    return ": ".join(part for part in (where(loc), dotted, what) if part)


def _keys_at(root: type[BaseModel], loc: tuple) -> list[str]:
    model = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        model = _model_in(field.annotation) if field else None
        if model is None:
            return []
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_in(tp) -> type[BaseModel] | None:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    return next((m for m in map(_model_in, get_args(tp)) if m), None)


# the names other tools give msinfer's keys (vLLM's and OpenAI's max_tokens), suggested first
SYNONYMS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
            "max_num_seqs": "max_batch_size", "max_num_batched_tokens": "max_batched_tokens",
            "gpu_memory_utilization": "memory_fraction", "tensor_parallel_size": "tensor_parallel",
            "pipeline_parallel_size": "pipeline_parallel", "data_parallel_size": "data_parallel",
            "enable_expert_parallel": "expert_parallel", "enable_prefix_caching": "prefix_caching",
            "num_gpu_blocks_override": "kv_cache_blocks", "num_scheduler_steps": "decode_steps"}


def _suggest(key: str, valid: list[str]) -> str:
    if SYNONYMS.get(key) in valid:
        return f"did you mean '{SYNONYMS[key]}'?"
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
    return f"valid keys here: {', '.join(valid)}" if valid else "no keys are expected here"


def _kind(x: Any) -> str:
    if isinstance(x, dict):
        return "a mapping"
    if isinstance(x, list):
        return "a list"
    return f"the scalar {_show(x)}"


def _show(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, dict):
        return "a mapping"
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."
