"""The configuration the driver and the workers share: the model facts msinfer needs, read once
from a Hugging Face `config.json` (`ModelConfig`); the engine's settings (`EngineConfig`); and the
choices both sides must make alike: the compute dtype, the device, and what Ascend's fused kernels
need of a layout.

Plain Python (no MindSpore, no Ray): the launcher reads it to plan the layout before any worker
starts, and each worker reads it to build its network.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from msinfer.sharding.quant import Quantization, QuantizationError, parse_modelslim, parse_quantization

# architectures value -> (family, does q/k/v carry a bias by default, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "Qwen2MoeForCausalLM": ("qwen2_moe", True, False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
}


class ModelConfigError(ValueError):
    """A checkpoint's config.json cannot be served; the message names the file and the key."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: dict = field(default_factory=dict)
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE); num_experts = 0 for a dense model. A sparse
    # layer routes each token to num_experts_per_tok of num_experts MLPs of moe_intermediate_size
    # (weights: the top-k of the router's softmax, renormalized with norm_topk_prob), plus, with
    # shared_expert_size > 0, a shared MLP that every token passes, scaled by sigmoid(its gate).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int = 0
    shared_expert_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    # A quantized checkpoint's quantization_config (sharding.quant); None: float weights
    quant: Quantization | None = None

    @property
    def is_moe(self) -> bool:
        return bool(self.sparse_layers)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"{source}: architectures {archs or '(missing)'} is not supported; "
                f"msinfer serves {', '.join(SUPPORTED_ARCHITECTURES)}")
        family, default_qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]

        def need(key):
            if d.get(key) is None:
                raise ModelConfigError(f"{source}: required key '{key}' is missing ({arch})")
            return d[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ModelConfigError(
                f"{source}: rope type '{rope_type}' is not supported (default, linear, llama3)")
        if heads % kv_heads:
            raise ModelConfigError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if d.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: use_sliding_window=true is not supported")
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(d.get("attention_bias", default_qkv_bias))
        num_layers = int(need("num_hidden_layers"))
        moe = cls._moe_fields(d, family, num_layers, source, need) if family.endswith("_moe") else {}
        try:
            quant = parse_quantization(d.get("quantization_config"), source)
        except QuantizationError as e:
            raise ModelConfigError(str(e)) from None
        cfg = cls(
            architecture=arch, family=family,
            vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=default_qkv_bias or attention_bias,
            o_bias=attention_bias and family == "llama",
            mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=qk_norm,
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            eos_token_ids=eos,
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"} if rope_type != "default" else {},
            quant=quant, **moe,
        )
        if quant is not None:
            act = next((i for i in cfg.sparse_layers
                        if (sch := quant.scheme_for(f"model.layers.{i}.mlp.experts.0.gate_proj")) and sch.act_int8), None)
            if act is not None:
                raise ModelConfigError(f"{source}: quantization_config quantizes the inputs of layer {act}'s experts "
                                       f"to int8 (W8A8); msinfer runs quantized experts weight-only (W8A16, W4A16)")
        return cfg

    @staticmethod
    def _moe_fields(d: dict, family: str, num_layers: int, source: str, need) -> dict:
        """The mixture-of-experts keys, as transformers reads them: layer i is sparse unless it is
        in mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step."""
        # transformers 5 writes num_experts as num_local_experts
        experts = int(d.get("num_experts") or d.get("num_local_experts") or need("num_experts"))
        top_k = int(need("num_experts_per_tok"))
        if not 0 < top_k <= experts:
            raise ModelConfigError(f"{source}: num_experts_per_tok={top_k} must be between 1 and "
                                   f"num_experts={experts}")
        step = int(d.get("decoder_sparse_step") or 1)
        dense = set(d.get("mlp_only_layers") or [])
        shared = int(d.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
        return dict(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=bool(d.get("norm_topk_prob")),
                    moe_intermediate_size=int(need("moe_intermediate_size")), shared_expert_size=shared,
                    sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0))

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        f = Path(path) / "config.json"
        if not f.is_file():
            raise ModelConfigError(f"{f}: not found; a model directory holds a Hugging Face config.json")
        try:
            d = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{f}: cannot be read as JSON ({e})") from None
        cfg = cls.from_dict(d, str(f))
        described = sorted(Path(path).glob("quant_model_description*.json"))
        if described:
            cfg = cfg.with_modelslim(described)
        gen = Path(path) / "generation_config.json"
        if gen.is_file():
            try:
                g = json.loads(gen.read_text()).get("eos_token_id")
            except (OSError, json.JSONDecodeError):
                g = None
            extra = g if isinstance(g, list) else ([] if g is None else [g])
            merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *map(int, extra)]))
            object.__setattr__(cfg, "eos_token_ids", merged)
        return cfg

    def with_modelslim(self, files: list[Path]) -> "ModelConfig":
        """This config with a ModelSlim checkpoint's quantization, from its description file
        (sharding.quant.parse_modelslim). Its W8A8 layers add quant_bias * deq_scale: every linear
        layer gets a bias (zeros where the checkpoint has none)."""
        if len(files) > 1:
            raise ModelConfigError(f"{files[0].parent}: {len(files)} ModelSlim description files "
                                   f"({', '.join(f.name for f in files)}); keep the one of these weights")
        if self.quant is not None:
            raise ModelConfigError(f"{files[0]}: a ModelSlim description beside a quantization_config in "
                                   f"config.json; keep the one these weights were made with")
        try:
            quant = parse_modelslim(json.loads(files[0].read_text()), str(files[0]))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{files[0]}: cannot be read as JSON ({e})") from None
        except QuantizationError as e:
            raise ModelConfigError(str(e)) from None
        biased = any(s.static for s in quant.schemes)
        return dataclasses.replace(self, quant=quant, qkv_bias=self.qkv_bias or biased, o_bias=self.o_bias or biased,
                                   mlp_bias=self.mlp_bias or biased)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim/2] in float32, as transformers computes them."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if kind == "linear":
            inv = inv / float(self.rope_scaling["factor"])
        elif kind == "llama3":
            s = self.rope_scaling
            factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
            old = float(s["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > old / lo, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            mid = (1 - smooth) * scaled / factor + smooth * scaled
            is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
            inv = np.where(is_mid, mid, scaled)
        return inv.astype(np.float32)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


# ---- the device and the engine ----------------------------------------------------------------

# What Ascend's fused kernels need (worker/ascend.py), here where the launcher can read it
# without importing MindSpore.
EMULATE_ENV = "MSINFER_ASCEND_EMULATE"     # 1: device "ascend" runs on the CPU, its kernels stood in
BLOCK_MULTIPLE = 16            # vllm-mindspore ms_attn.py: "Block size must be a multiple of 16."
HEAD_SIZES = (32, 64, 96, 128, 160, 192, 224, 256)      # vllm-mindspore ms_attn.py: what its kernels run
MASK_PENALTY = -10000.0        # vllm-mindspore attention_mask.py: the additive mask of float16 and bfloat16


VARIANT_ENV = "MSINFER_ASCEND_EMULATE_VARIANT"
VARIANTS = ("fa_cumulative", "pa_wrong")
MEMORY_ENV = "MSINFER_ASCEND_EMULATE_MEMORY_GB"


def ascend_emulated(env: dict | None = None) -> bool:
    return (os.environ if env is None else env).get(EMULATE_ENV, "") not in ("", "0")


def emulate_variants(env: dict | None = None) -> tuple[str, ...]:
    """MSINFER_ASCEND_EMULATE_VARIANT (comma-separated; read only when set, by the driver, which
    passes it to the workers in EngineConfig): stand-ins that follow the other reading of a
    contract only a card settles, so that tests prove the start-up self-check adapts
    (worker.kernel_check). fa_cumulative: FlashAttentionScore reads actual_seq_qlen/kvlen as
    cumulative ends (ACLNN's TND docstring); pa_wrong: PagedAttention reads every query token as
    its sequence's last position (no causal mask within a chunk)."""
    text = (os.environ if env is None else env).get(VARIANT_ENV, "")
    chosen = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise ValueError(f"{VARIANT_ENV}: unknown variant '{unknown[0]}'; known: {', '.join(VARIANTS)}")
    return chosen


def emulated_memory(env: dict | None = None) -> int | None:
    """MSINFER_ASCEND_EMULATE_MEMORY_GB (read only when set): the card size, in bytes, that emulated
    workers report as measured (worker.actor.Worker.card_memory)."""
    text = (os.environ if env is None else env).get(MEMORY_ENV, "")
    if not text:
        return None
    try:
        gb = float(text)
    except ValueError:
        gb = -1.0
    if not gb > 0:
        raise ValueError(f"{MEMORY_ENV}={text!r}: expected a positive number of GiB")
    return int(gb * 1024 ** 3)


def resolve_device(device: str, env: dict | None = None) -> str:
    """parallel.device auto: Ascend where the process sees the CANN toolkit or cards, else the CPU."""
    env = os.environ if env is None else env
    if device in ("auto", ""):
        return "ascend" if env.get("ASCEND_RT_VISIBLE_DEVICES") or env.get("ASCEND_HOME_PATH") else "cpu"
    return device


DTYPES = {"float32", "float16", "bfloat16"}


def dtype_bytes(name: str) -> int:
    """Bytes of one value of a compute or checkpoint dtype (float32 for any other name)."""
    return 2 if name in ("float16", "bfloat16") else 4


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    dtype: str = "float32"             # compute dtype of the network
    device: str = "cpu"
    max_model_len: int = 2048
    max_batch_size: int = 32
    num_blocks: int = 0                # 0: enough for max_batch_size sequences of max_model_len
    block_size: int = 16
    graph_mode: bool = True            # False: PyNative, for debugging
    position_scheme: str = "rope"
    position_options: dict = field(default_factory=dict)   # the scheme's options, e.g. {"ratio": 0.25}
    lora_path: str | None = None       # a PEFT adapter merged into the weights as they load
    lora_scale: float = 1.0            # times the adapter's own alpha / r
    allow_pickle: bool = False
    random_weights: bool = False       # read no checkpoint (msinfer bench --skip-load; Worker.fill_random)
    ops: str = "auto"                  # "auto": the device's fastest operators; "portable": MindSpore primitives
    shapes: str = "auto"               # "dynamic" | "buckets" | "auto": the operators' choice (MsOps.dynamic_shapes)
    emulate: bool = False              # device "ascend" on the CPU, the fused kernels stood in (worker/ascend.py)
    emulate_variants: tuple = ()       # the stand-ins' other readings (emulate_variants)
    emulate_memory: int | None = None  # bytes an emulated card reports (emulated_memory)
    card: dict | None = None           # the card plan's figures (launcher.job.CardPlan.figures), for the summary
    card_env: dict = field(default_factory=dict)   # set on a card where unset (worker.device.card_environment)
    # the fused kernels' start-up self-check (worker.kernel_check); False takes their documented
    # conventions as they are: tests of the wiring on the emulated path, whose stand-ins follow them
    kernel_check: bool = True
    tokenizer_path: str | None = None  # for structured outputs' grammars (None: model_dir)
    trust_remote_code: bool = False
    expert_parallel: bool = False      # a MoE model's experts whole per rank (sharding.layout), not sliced
    # pipeline parallel: each stage's [lo, hi) decoder layers (sharding.layout.stage_layers; () for
    # one stage), and which of them this rank's stage is
    pipeline: tuple = ()
    stage: int = 0

    def blocks(self) -> int:
        return self.num_blocks or self.max_batch_size * -(-self.max_model_len // self.block_size)

    @property
    def on_cpu(self) -> bool:
        """Whether the workers compute on this machine's CPU (the CPU, or Ascend emulated)."""
        return self.device == "cpu" or self.emulate


FUSED_DTYPES = ("bfloat16", "float16")        # what Ascend's fused attention kernels take


def fused(device: str, ops: str) -> bool:
    """Whether the job runs Ascend's fused kernels (worker/ascend.py)."""
    return device == "ascend" and ops == "auto"


def card_dtype(name: str, cfg: ModelConfig, device: str, ops: str = "auto") -> str:
    """The dtype a card computes in. With the fused kernels: float16 or bfloat16 only (FlashAttention
    and PagedAttention take nothing else; for float32 MindSpore falls back from its internal kernels
    to ACLNN's, which read sequence lengths another way), `auto` the checkpoint's when it is one of
    them and bfloat16 for a float32 checkpoint. Without them (`model.ops: portable`), `auto` is the
    checkpoint's dtype, float16 for one MindSpore cannot name."""
    if name not in ("auto", *DTYPES):
        raise ValueError(f"model.dtype '{name}' is not one of auto, {', '.join(sorted(DTYPES))}")
    if fused(device, ops):
        if name == "float32":
            raise ValueError("model.dtype float32 does not run on Ascend's fused kernels (FlashAttentionScore and "
                             "PagedAttention take float16 and bfloat16 only); set model.dtype: bfloat16 or float16 "
                             "(or auto, which picks bfloat16 for a float32 checkpoint), or model.ops: portable to "
                             "compute in float32 without the fused kernels")
        if name == "auto":
            return cfg.torch_dtype if cfg.torch_dtype in FUSED_DTYPES else "bfloat16"
        return name
    if name == "auto":
        return cfg.torch_dtype if cfg.torch_dtype in DTYPES else "float16"
    return name


def resolve_dtype(name: str, cfg: ModelConfig, device: str, emulate: bool = False, ops: str = "auto") -> str:
    """The dtype the workers compute in: a card's (`card_dtype`), or on this machine's CPU (the CPU,
    or Ascend emulated) what it runs: 'auto' is float32 there, except on the emulated fused
    kernels, which take what a card takes; bfloat16, which MindSpore's CPU kernels lack (Gather and
    the collectives refuse it), is refused on the CPU and computed in float16 by the emulation
    (`emulated_note`)."""
    on_cpu = device == "cpu" or emulate
    if not on_cpu:
        return card_dtype(name, cfg, device, ops)
    if fused(device, ops):
        dtype = card_dtype(name, cfg, device, ops)
        return "float16" if dtype == "bfloat16" else dtype
    card_dtype(name, cfg, "cpu")                     # the name's check
    if name == "auto":
        return "float32"
    if name == "bfloat16":
        where = "the emulated Ascend path (it runs on the CPU)" if emulate else "the CPU"
        raise ValueError(f"model.dtype bfloat16 does not run on {where}: MindSpore's CPU Gather and collectives "
                         "have no bfloat16; use float32 or float16, or auto, which picks float32 there")
    return name


def emulated_note(name: str, cfg: ModelConfig, ops: str) -> str | None:
    """What the plan and the summary say where the emulated fused kernels compute a card's
    bfloat16 in float16 (None where they compute what a card does)."""
    if card_dtype(name, cfg, "ascend", ops) == "bfloat16" and fused("ascend", ops):
        return ("a card computes this job in bfloat16; the emulation computes it in float16, which the CPU "
                "runs (the same 16-bit storage, 3 more mantissa bits)")
    return None


def ops_problem(device: str, ops: str, shapes: str, graph_mode: bool = True) -> str | None:
    """Why model.shapes or model.graph_mode cannot be what it is with these operators, or None."""
    if device == "cpu" and ops == "auto" and shapes == "dynamic":
        return ("model.shapes dynamic does not run with the CPU kernels (MindSpore 2.10 runs custom operators in "
                "static shapes only); use model.shapes: buckets or auto, or model.ops: portable")
    if fused(device, ops) and shapes == "buckets":
        return ("model.shapes buckets does not run with Ascend's fused kernels: with infer_boost MindSpore compiles "
                "one graph per phase (step kind) and ignores input shapes, so a second bucket would run the first "
                "bucket's graph, and padding rows would put length 0 in batch_valid_length; use model.shapes: auto "
                "(dynamic shapes), or model.ops: portable")
    if fused(device, ops) and not graph_mode:
        return ("model.graph_mode false does not run with Ascend's fused kernels: PyNative never compiles with "
                "infer_boost, which the internal kernels need to read sequence lengths (vllm-mindspore: PyNative "
                "does not support the TH layout); set model.graph_mode: true, or model.ops: portable")
    return None


