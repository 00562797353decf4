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

# the tasks whose network ends at its final norm and whose prefills pool (ModelConfig.pooling_only)
POOLING_TASKS = ("embed", "classify")

# architectures value -> (family, does q/k/v carry a bias by default, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    # the base models (an embedding model's checkpoint, saved without an LM head: task embed)
    "LlamaModel": ("llama", False, False),
    "Qwen2Model": ("qwen2", True, False),
    "Qwen3Model": ("qwen3", False, True),
    # sequence classifiers and reward models: a `score` head on the last token (task classify)
    "LlamaForSequenceClassification": ("llama", False, False),
    "Qwen2ForSequenceClassification": ("qwen2", True, False),
    "Qwen3ForSequenceClassification": ("qwen3", False, True),
    "Qwen2MoeForCausalLM": ("qwen2_moe", True, False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
    "DeepseekV2ForCausalLM": ("deepseek_v2", False, False),
    "DeepseekV3ForCausalLM": ("deepseek_v3", False, False),
}
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
# What transformers' DeepseekV2Config / DeepseekV3Config assume for a key config.json leaves out
DEEPSEEK_DEFAULTS = {
    "deepseek_v2": dict(q_lora_rank=1536, n_shared_experts=2, first_k_dense_replace=0, norm_topk_prob=False,
                        routed_scaling_factor=1.0, topk_method="greedy", scoring_func="softmax", rope_interleave=True),
    "deepseek_v3": dict(q_lora_rank=1536, n_shared_experts=1, first_k_dense_replace=3, norm_topk_prob=True,
                        routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True,
                        n_group=8, topk_group=4),
}


# generation_config.json's sampling keys that vLLM takes as a request's defaults (its
# ModelConfig.get_diff_sampling_param, with generation_config "auto"), with the same names in
# msinfer's sampling section: every one the file gives a value (GenerationConfig.to_diff_dict,
# whose defaults are None since transformers 5, keeps top_k 50 or temperature 1.0 as written)
GENERATION_SAMPLING = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                       "top_p", "min_p", "max_new_tokens", "skip_special_tokens")


class ModelConfigError(ValueError):
    """A checkpoint's config.json cannot be served; the message names the file and the key."""


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA). Each head's query is [nope | rope] of
    qk_nope_head_dim + qk_rope_head_dim values, from q_proj, or q_a_proj, its RMSNorm and q_b_proj
    when q_lora_rank > 0. kv_a_proj_with_mqa gives each token a latent c_kv (kv_lora_rank, then
    RMSNorm) and one rotary key k_rope (qk_rope_head_dim) that every head shares; kv_b_proj expands
    c_kv to each head's key part (qk_nope_head_dim) and value (v_head_dim). The cache holds
    [c_kv | k_rope] per token (`cache_width`), not per-head keys and values (worker.model.MLAttention).
    rope_interleave: the rotary dimensions pair as (x0, x1), (x2, x3), ... (DeepSeek's layout), not
    as halves. softmax_scale: 1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)^2."""
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class Routing:
    """How a DeepSeek sparse layer picks its experts (Qwen's MoEs: None, the softmax's top k).
    Scores are the router logits' sigmoid (V3) or softmax (V2). Experts are chosen by score plus
    the checkpoint's e_score_correction_bias (`bias`, V3), among the `top_groups` best of `groups`
    equal groups of experts (a group's score: the sum of its two best (V3), or its best (V2));
    their weights are the unbiased scores, divided by their sum with norm_topk_prob, times `scale`
    (routed_scaling_factor). (DeepSeek-V2's own code and vLLM divide with norm_topk_prob too;
    transformers' V2 ignores the key, which V2 checkpoints leave false.)"""
    scoring: str           # "sigmoid" | "softmax"
    groups: int
    top_groups: int
    group_score: str       # "top2" | "max"
    scale: float
    bias: bool


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
    # the sampling defaults its generation_config.json recommends (GENERATION_SAMPLING's keys), as
    # (key, value) pairs: what vLLM takes for a request's unset parameters (launcher.spec)
    generation_sampling: tuple = ()
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
    # DeepSeek: latent attention, its routing, YaRN's factor on cos and sin, and the multi-token
    # prediction layers the checkpoint holds after the decoder layers (not loaded)
    mla: LatentAttention | None = None
    routing: Routing | None = None
    rope_factor: float = 1.0
    mtp_layers: int = 0
    # False (the pooling tasks, embed and classify: ModelConfig.pooling_only): the network ends at
    # the final norm, whose hidden states are pooled; no LM head is planned, loaded or held
    lm_head: bool = True
    # a sequence classifier (*ForSequenceClassification): its head `score.weight` [num_labels,
    # hidden] on the last token's final hidden state, and its labels' names (id2label)
    num_labels: int = 0
    labels: tuple[str, ...] = ()
    # how its logits become `probs` (launcher.records.classified), as vLLM's pooler picks it from
    # problem_type and a cross-encoder's activation: "identity", "sigmoid" (each label on its own),
    # "softmax", or "" (one label: sigmoid, several: softmax)
    classifier_activation: str = ""
    # Matryoshka embeddings: whether a vector may be cut to its first `dimensions` values, and to
    # which (None: any), as config.json says (is_matryoshka, matryoshka_dimensions)
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # a causal LM read as a classifier of its next token among these (ModelConfig.token_classifier):
    # its head is their rows of the LM head (or of the tied embedding), not a `score` tensor
    head_tokens: tuple[int, ...] = ()

    def token_classifier(self, token_ids, names=None) -> "ModelConfig":
        """This causal LM as a classifier whose labels are `token_ids` (model.classifier_from_tokens)."""
        return dataclasses.replace(self, lm_head=False, num_labels=len(token_ids), head_tokens=tuple(token_ids),
                                   labels=tuple(names or map(str, token_ids)))

    @property
    def head_tensor(self) -> str:
        """The checkpoint tensor a classifier's head is read from (its rows head_tokens, if any)."""
        if not self.head_tokens:
            return "score.weight"
        return "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"

    def pooling_only(self) -> "ModelConfig":
        """This model without its LM head (POOLING_TASKS)."""
        return dataclasses.replace(self, lm_head=False)

    @property
    def is_moe(self) -> bool:
        return bool(self.sparse_layers)

    @property
    def expert_scheme(self):
        """The quantization scheme of the first sparse layer's experts (sharding.quant.Scheme), or
        None: float experts or no experts."""
        if self.quant is None or not self.sparse_layers:
            return None
        return self.quant.scheme_for(f"model.layers.{min(self.sparse_layers)}.mlp.experts.0.gate_proj")

    def expert_inputs(self, proj: str):
        """The scheme of the experts' `proj` (gate_proj: with up_proj, the token's row; down_proj:
        silu(gate) * up) where it quantizes the inputs per token, else None."""
        if self.quant is None or not self.sparse_layers:
            return None
        scheme = self.quant.scheme_for(f"model.layers.{min(self.sparse_layers)}.mlp.experts.0.{proj}")
        return scheme if scheme is not None and scheme.act_int8 else None

    @property
    def shared_expert_key(self) -> str:
        """The shared expert's name in the checkpoint (under mlp.); Qwen2-MoE's alone has a gate."""
        return "shared_experts" if self.family in MLA_FAMILIES else "shared_expert"

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
        rope_types = ("default", "linear", "llama3") + (("yarn",) if family in MLA_FAMILIES else ())
        if rope_type not in rope_types:
            raise ModelConfigError(
                f"{source}: rope type '{rope_type}' is not supported for {arch} ({', '.join(rope_types)})")
        if heads % kv_heads:
            raise ModelConfigError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if d.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: use_sliding_window=true is not supported")
        act = d.get("hidden_act", "silu")            # (transformers' ACT2FN: swish is SiLU by another name)
        if act not in ("silu", "swish"):
            raise ModelConfigError(f"{source}: hidden_act '{act}' is not supported: msinfer's MLPs and experts "
                                   f"compute SiLU (hidden_act 'silu'), as vLLM's {arch} does")
        if d.get("is_causal") is False:         # (gte-Qwen2's embedding models): a causal run would differ
            raise ModelConfigError(f"{source}: is_causal=false (attention both ways, as some embedding models "
                                   f"use) is not supported: msinfer's attention is causal")
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(d.get("attention_bias", default_qkv_bias))
        num_layers = int(need("num_hidden_layers"))
        try:
            quant = parse_quantization(d.get("quantization_config"), source)
        except QuantizationError as e:
            raise ModelConfigError(str(e)) from None
        moe = cls._moe_fields(d, family, num_layers, source, need) if family.endswith("_moe") else {}
        if family in MLA_FAMILIES:
            moe = cls._deepseek_fields(d, arch, family, num_layers, source, need, rope, rope_type)
            head_dim = moe["mla"].qk_rope_head_dim        # the rotary frequencies' dimension, as transformers'
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
            o_bias=attention_bias and family in ("llama", *MLA_FAMILIES),
            mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=qk_norm,
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            eos_token_ids=eos,
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"} if rope_type != "default" else {},
            quant=quant, **moe,
        )
        if quant is not None:
            check_expert_inputs(cfg, source)
        if arch.endswith("ForSequenceClassification"):
            cfg = dataclasses.replace(cfg, lm_head=False, **cls._labels(d, source),
                                      classifier_activation=cls._activation(d, source))
        dims = d.get("matryoshka_dimensions")
        if dims or d.get("is_matryoshka"):
            cfg = dataclasses.replace(cfg, matryoshka=True,
                                      matryoshka_dimensions=tuple(int(x) for x in dims) if dims else None)
        return cfg

    # a cross-encoder's activation (sentence-transformers), by its torch.nn class
    ACTIVATIONS = {"Identity": "identity", "Sigmoid": "sigmoid", "Softmax": "softmax"}

    @staticmethod
    def _activation(d: dict, source: str) -> str:
        """How a sequence classifier's logits become probabilities, as vLLM's pooler reads its config
        (model_executor/layers/pooler/activations.py): problem_type regression: the logits as
        they are; multi_label_classification: a sigmoid for each; else a sentence-transformers
        cross-encoder's activation_fn (or sbert_ce_default_activation_function)."""
        problem = d.get("problem_type") or ""
        if problem == "regression":
            return "identity"
        if problem == "multi_label_classification":
            return "sigmoid"
        if problem == "single_label_classification":
            return ""
        st = d.get("sentence_transformers")
        name = ((st.get("activation_fn") if isinstance(st, dict) else None)
                or d.get("sbert_ce_default_activation_function"))
        if not name:
            return ""
        kind = ModelConfig.ACTIVATIONS.get(str(name).rsplit(".", 1)[-1]) if str(name).startswith("torch.nn.") else None
        if kind is None:
            raise ModelConfigError(f"{source}: the classifier's activation {name!r} is not one msinfer applies "
                                   f"({', '.join('torch.nn.' + k for k in ModelConfig.ACTIVATIONS)})")
        return kind

    @staticmethod
    def _labels(d: dict, source: str) -> dict:
        """A classifier's num_labels and the names of its labels, from id2label (transformers'
        default: LABEL_0, LABEL_1, ... for num_labels, 2 where it says neither)."""
        names = d.get("id2label") or {}
        try:
            count = len(names) or int(d.get("num_labels") or 2)
            labels = tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(count))
        except (TypeError, ValueError, AttributeError):
            raise ModelConfigError(f"{source}: id2label and num_labels do not name the classifier's labels "
                                   f"(id2label {names!r:.80}, num_labels {d.get('num_labels')!r})") from None
        return {"num_labels": count, "labels": labels}

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

    @staticmethod
    def _deepseek_fields(d: dict, arch: str, family: str, num_layers: int, source: str, need, rope: dict,
                         rope_type: str) -> dict:
        """DeepSeek-V2/V3: latent attention, routing and experts, with transformers' defaults for
        the keys config.json leaves out. Layers from first_k_dense_replace on are sparse."""
        defaults = DEEPSEEK_DEFAULTS[family]

        def get(key):
            return d[key] if key in d else defaults.get(key)

        def whole(key, low=1):
            value = need(key)
            if not isinstance(value, int) or value < low:
                raise ModelConfigError(f"{source}: {key}={value!r} must be an integer >= {low} ({arch})")
            return value

        q_lora = get("q_lora_rank") or 0
        nope, rope_dim, v = whole("qk_nope_head_dim"), whole("qk_rope_head_dim"), whole("v_head_dim")
        if rope_dim % 2:
            raise ModelConfigError(f"{source}: qk_rope_head_dim={rope_dim} must be even (rotary pairs)")
        scale = (nope + rope_dim) ** -0.5
        factor = 1.0
        if rope_type == "yarn":
            if not rope.get("original_max_position_embeddings"):
                raise ModelConfigError(f"{source}: rope type yarn needs 'original_max_position_embeddings' (the "
                                       f"context the model was pretrained on) in rope_scaling")
            factor, scale = yarn_factors(rope, int(d.get("max_position_embeddings", 4096)), scale)
        mla = LatentAttention(int(q_lora), whole("kv_lora_rank"), nope, rope_dim, v,
                              bool(get("rope_interleave")) if family == "deepseek_v3" else True, scale)
        experts, top_k = whole("n_routed_experts"), whole("num_experts_per_tok")
        method, scoring = get("topk_method"), get("scoring_func") or defaults["scoring_func"]
        methods = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}[family]
        if method not in methods or scoring != defaults["scoring_func"]:
            raise ModelConfigError(f"{source}: topk_method '{method}' with scoring_func '{scoring}' is not how "
                                   f"{arch} routes; msinfer runs topk_method {' or '.join(methods)} with "
                                   f"scoring_func {defaults['scoring_func']}")
        groups = int(get("n_group") or 1) if method != "greedy" else 1
        top_groups = int(get("topk_group") or 1) if groups > 1 else 1
        per = experts // groups if experts % groups == 0 else 0
        least = 2 if family == "deepseek_v3" and groups > 1 else 1        # V3 scores a group by its two best
        if per < least or not 1 <= top_groups <= groups:
            raise ModelConfigError(f"{source}: n_routed_experts={experts} in n_group={groups} groups, "
                                   f"topk_group={top_groups}: the groups must be equal, of at least {least} "
                                   f"expert(s) each, and topk_group between 1 and n_group")
        if not 0 < top_k <= top_groups * per:
            raise ModelConfigError(f"{source}: num_experts_per_tok={top_k} must be between 1 and the "
                                   f"{top_groups * per} experts of the topk_group={top_groups} chosen groups")
        if get("moe_layer_freq") not in (None, 1):
            raise ModelConfigError(f"{source}: moe_layer_freq={d['moe_layer_freq']} is not supported (1: every "
                                   f"layer from first_k_dense_replace on is sparse, as transformers builds {arch})")
        first_dense = int(get("first_k_dense_replace") or 0)
        moe_size = whole("moe_intermediate_size")
        routing = Routing("sigmoid" if family == "deepseek_v3" else "softmax", groups, top_groups,
                          "top2" if family == "deepseek_v3" else "max", float(get("routed_scaling_factor")),
                          family == "deepseek_v3")
        return dict(mla=mla, routing=routing, rope_factor=factor, mtp_layers=int(d.get("num_nextn_predict_layers") or 0),
                    num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=bool(get("norm_topk_prob")),
                    moe_intermediate_size=moe_size, shared_expert_size=int(get("n_shared_experts") or 0) * moe_size,
                    sparse_layers=tuple(range(first_dense, num_layers)))

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
                d = json.loads(gen.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                d = {}
            d = d if isinstance(d, dict) else {}
            g = d.get("eos_token_id")
            extra = g if isinstance(g, list) else ([] if g is None else [g])
            merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *map(int, extra)]))
            object.__setattr__(cfg, "eos_token_ids", merged)
            object.__setattr__(cfg, "generation_sampling",
                               tuple((k, d[k]) for k in GENERATION_SAMPLING if d.get(k) is not None))
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

    def context_positions(self) -> int:
        """The longest sequence the model's positions are made for, derived as vLLM derives its
        limit on max_model_len: max_position_embeddings, times a linear RoPE scaling's factor; with
        YaRN, its factor times original_max_position_embeddings; llama3's scaling is already counted
        in max_position_embeddings."""
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if kind == "linear":
            return int(self.max_position_embeddings * float(self.rope_scaling["factor"]))
        if kind == "yarn":
            return int(int(self.rope_scaling["original_max_position_embeddings"]) * float(self.rope_scaling["factor"]))
        return self.max_position_embeddings

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
        elif kind == "yarn":
            inv = yarn_inv_freq(self.rope_scaling, d, self.rope_theta, self.max_position_embeddings)
        return inv.astype(np.float32)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def cache_values(self, tp: int = 1) -> int:
        """Values one rank caches per token per layer: its K and V heads' (a KV head replicated
        where tp exceeds them), or the latent of MLA, which every rank caches whole (sharding.layout)."""
        if self.mla is not None:
            return self.mla.cache_width
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim

    def kv_bytes(self, tokens: int = 1, dtype_bytes: int = 4, tp: int = 1, layers: int | None = None) -> int:
        """The KV cache's bytes for `tokens` tokens on one rank of tensor parallel `tp` (its heads,
        `cache_values`) over `layers` layers (None: all: a pipeline stage holds its own): the
        whole model's per token with the defaults, a cache block's with tokens = block_size."""
        return (self.num_layers if layers is None else layers) * self.cache_values(tp) * dtype_bytes * tokens


def check_expert_inputs(cfg: "ModelConfig", source: str) -> None:
    """Raises ModelConfigError where the checkpoint quantizes its experts' inputs in a way the
    experts do not run (sharding.layers.FusedExperts): other than per token, unlike from one sparse
    layer to the next (their layers share one compiled graph), or gate_proj's unlike up_proj's."""
    schemes = {(i, proj): cfg.quant.scheme_for(f"model.layers.{i}.mlp.experts.0.{proj}")
               for i in cfg.sparse_layers for proj in ("gate_proj", "up_proj", "down_proj")}
    for (i, proj), sch in schemes.items():
        if sch is not None and sch.act_int8 and sch.int8_kind != "dynamic":
            raise ModelConfigError(f"{source}: quantization_config gives layer {i}'s experts' {proj} "
                                   f"{sch.describe()}; msinfer quantizes experts' inputs per token only "
                                   f"(compressed-tensors W8A8, ModelSlim W8A8_DYNAMIC)")

    def inputs(sch):          # how a projection's inputs are quantized (None: float inputs)
        return (sch.act_divisor, sch.modelslim) if sch is not None and sch.act_int8 else None
    if not cfg.sparse_layers:
        return
    base = min(cfg.sparse_layers)
    first = {proj: inputs(schemes[base, proj]) for proj in ("gate_proj", "up_proj", "down_proj")}
    for (i, proj), sch in schemes.items():
        if inputs(sch) != first[proj]:
            raise ModelConfigError(f"{source}: quantization_config quantizes the inputs of layer {i}'s experts' "
                                   f"{proj} otherwise than layer {base}'s; msinfer takes one way for every sparse "
                                   f"layer's experts (their layers share one compiled graph)")
    if first["gate_proj"] != first["up_proj"]:
        raise ModelConfigError(f"{source}: quantization_config quantizes the inputs of the experts' gate_proj "
                               f"and up_proj differently; they share one input")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_factors(rope: dict, max_positions: int, scale: float) -> tuple[float, float]:
    """YaRN's factor on cos and sin (its `attention_factor`), and the softmax scale times
    mscale(factor, mscale_all_dim)^2, as transformers' DeepSeek models compute them."""
    factor = rope.get("factor") or max_positions / rope["original_max_position_embeddings"]
    attention = rope.get("attention_factor")
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    if mscale_all and rope.get("factor"):
        scale *= yarn_mscale(rope["factor"], mscale_all) ** 2
    return float(attention), float(scale)


def yarn_inv_freq(rope: dict, dim: int, base: float, max_positions: int) -> np.ndarray:
    """YaRN's inverse frequencies (transformers' _compute_yarn_parameters): interpolated by
    `factor` below the correction range, extrapolated above it, a linear ramp between."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(fast), correction(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos = base ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation


# ---- the device and the engine ----------------------------------------------------------------

# What Ascend's fused kernels need (worker/ascend.py), here where the launcher can read it
# without importing MindSpore.
EMULATE_ENV = "MSINFER_ASCEND_EMULATE"     # 1: device "ascend" runs on the CPU, its kernels stood in
BLOCK_MULTIPLE = 16            # vllm-mindspore ms_attn.py: "Block size must be a multiple of 16."
HEAD_SIZES = (32, 64, 96, 128, 160, 192, 224, 256)      # vllm-mindspore ms_attn.py: what its kernels run
MASK_PENALTY = -10000.0        # vllm-mindspore attention_mask.py: the additive mask of float16 and bfloat16


VARIANT_ENV = "MSINFER_ASCEND_EMULATE_VARIANT"
VARIANTS = ("fa_cumulative", "pa_wrong", "qbmm_float32_scale", "wqbmm_int4_high_first", "gmm_int4_high_first")
MEMORY_ENV = "MSINFER_ASCEND_EMULATE_MEMORY_GB"


def bf16_panels_on() -> bool:
    """Whether the CPU kernels keep a bfloat16 checkpoint's weights in bfloat16 panels where the CPU
    has no AMX tiles (worker.cpu.CpuOps.bf16_panels); MSINFER_BF16_PANELS=0 keeps float32 panels."""
    return os.environ.get("MSINFER_BF16_PANELS", "1") != "0"


def cpu_flags() -> list[str]:
    """This machine's CPU flags (/proc/cpuinfo's first `flags` line; none where there is no such
    file), which the driver's plan reads instead of the kernels': it takes the workers' nodes to be
    of the driver's kind."""
    if not os.path.exists("/proc/cpuinfo"):
        return []
    with open("/proc/cpuinfo") as f:
        return next((line for line in f if line.startswith("flags")), "").split()


def int4_on() -> bool:
    """Whether the CPU kernels hold W4A16 layers' int4 weights as they are (worker.cpu.CpuOps.int4:
    the kernels built for a CPU with AVX-512); MSINFER_INT4=0 dequantizes them. From cpu_flags."""
    return os.environ.get("MSINFER_INT4", "1") != "0" and "avx512f" in cpu_flags()


def greedy_head_on(vocab: int, hidden: int) -> bool:
    """Whether the CPU kernels hold a float32 job's LM head of [vocab, hidden] bfloat16 weights in
    bfloat16 pairs as well as panels, for greedy chains (worker.model.CausalLM.pack_greedy_head):
    the kernels built for this CPU (MSINFER_KERNEL_ARCH unset) with AVX512-BF16 in use
    (MSINFER_BF16_DOT and MSINFER_GREEDY_HEAD unset or 1), and the head in panels, not AMX tiles
    (no AMX in use, or a shape the tiles do not take). From cpu_flags."""
    if (any(os.environ.get(k, "1") == "0" for k in ("MSINFER_BF16_DOT", "MSINFER_GREEDY_HEAD"))
            or os.environ.get("MSINFER_KERNEL_ARCH")):
        return False
    flags = cpu_flags()
    tiles = "amx_tile" in flags and os.environ.get("MSINFER_AMX", "1") != "0" and vocab % 32 == 0 and hidden % 32 == 0
    return "avx512_bf16" in flags and not tiles


def cache_root() -> Path:
    """Where msinfer keeps what it builds or learns once per machine (the CPU kernels, the kernel
    self-check's verdicts, the compiled step graphs, the demo model): $MSINFER_CACHE, else
    ~/.cache/msinfer."""
    return Path(os.environ.get("MSINFER_CACHE") or Path.home() / ".cache" / "msinfer")


def ascend_emulated(env: dict | None = None) -> bool:
    return (os.environ if env is None else env).get(EMULATE_ENV, "") not in ("", "0")


def emulate_variants(env: dict | None = None) -> tuple[str, ...]:
    """MSINFER_ASCEND_EMULATE_VARIANT (comma-separated; read only when set, by the driver, which
    passes it to the workers in EngineConfig): stand-ins that follow the other reading of a
    contract only a card settles, so that tests prove the start-up self-check adapts
    (worker.kernel_check). fa_cumulative: FlashAttentionScore reads actual_seq_qlen/kvlen as
    cumulative ends (ACLNN's TND docstring); pa_wrong: PagedAttention reads every query token as
    its sequence's last position (no causal mask within a chunk); qbmm_float32_scale:
    QuantBatchMatmul refuses scales of int64 (float32 bits), taking float32 ones only."""
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
    matmul_dtype: str = "float32"      # "bfloat16": the CPU kernels compute in bfloat16 (cpu_bfloat16)
    kv_cache_dtype: str = "auto"       # "bfloat16": a float32 network's KV cache in bfloat16 (kv_bfloat16)
    device: str = "cpu"
    max_model_len: int = 2048
    max_batch_size: int = 32
    num_blocks: int = 0                # 0: enough for max_batch_size sequences of max_model_len
    block_size: int = 16
    graph_mode: bool = True            # False: PyNative, for debugging
    compile_cache: bool = False        # the step graphs in MindSpore's compile cache (worker.graph_cache)
    threads: int = 0                   # a rank's intra-op threads, MindSpore's and the CPU kernels' (0: all cores)
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
    # embed and classify: no LM head (ModelConfig.pooling_only), prefills pool; classify: the
    # classifier's head on the pooled last token (worker.runner.forward_pooled)
    task: str = "generate"
    head_tokens: tuple = ()            # classify by these tokens' LM-head rows (ModelConfig.token_classifier)

    def blocks(self) -> int:
        return self.num_blocks or self.max_batch_size * -(-self.max_model_len // self.block_size)

    @property
    def on_cpu(self) -> bool:
        """Whether the workers compute on this machine's CPU (the CPU, or Ascend emulated)."""
        return self.device == "cpu" or self.emulate

    @property
    def cpu_kernels(self) -> bool:
        """Whether the workers compute with the CPU kernels (cpu_kernels)."""
        return cpu_kernels(self.device, self.ops)

    def kv_bfloat16(self, cfg: "ModelConfig") -> bool:
        return kv_bfloat16(self.matmul_dtype, cfg, self.kv_cache_dtype)

    def kv_dtype_bytes(self, cfg: "ModelConfig") -> int:
        return kv_dtype_bytes(self.dtype, self.matmul_dtype, cfg, self.kv_cache_dtype)

    def in_matmul_dtype(self, cfg: "ModelConfig") -> str:
        """What computes in matmul_dtype where it is not dtype, as `plan` and `bench` name it."""
        return "linear layers and KV cache" if self.kv_bfloat16(cfg) else "linear layers"

    @property
    def matmuls_apart(self) -> bool:
        """Whether the linear layers compute in another dtype than the network (the CPU kernels in
        bfloat16 under a float32 network): `plan` and `bench` then name it. matmul_dtype's float32
        elsewhere says only that they do not."""
        return self.matmul_dtype == "bfloat16" and self.dtype != "bfloat16"

    def kv_named(self) -> str:
        """The KV cache's bfloat16 where model.kv_cache_dtype alone makes it so, as `plan` and `bench`
        say it after the compute dtype; "" otherwise."""
        return " (KV cache bfloat16)" if self.kv_cache_dtype == "bfloat16" else ""


def kv_bfloat16(matmul_dtype: str, cfg: "ModelConfig", kv_cache_dtype: str = "auto") -> bool:
    """Whether the KV cache holds bfloat16 values in a network computing in float32: the CPU
    kernels computing in bfloat16 (matmul_dtype), or a float32 job on them with model.kv_cache_dtype
    bfloat16 (`cpu_kv_cache_dtype`), round K and V to the nearest bfloat16 as they write them, as a
    card's bfloat16 cache holds them, at half float32's bytes (worker/csrc attention.h). Latent
    attention's cache stays float32."""
    return (matmul_dtype == "bfloat16" or kv_cache_dtype == "bfloat16") and cfg.mla is None


def kv_dtype_bytes(dtype: str, matmul_dtype: str, cfg: "ModelConfig", kv_cache_dtype: str = "auto") -> int:
    """Bytes of one value of the KV cache: of the compute dtype, or bfloat16 (`kv_bfloat16`)."""
    return 2 if kv_bfloat16(matmul_dtype, cfg, kv_cache_dtype) else dtype_bytes(dtype)


def cpu_kv_cache_dtype(name: str, cfg: "ModelConfig", device: str, dtype: str, matmul_dtype: str,
                       ops: str = "auto") -> str:
    """model.kv_cache_dtype `name` resolved for a job computing in `dtype` (matmul_dtype: the CPU
    kernels' linear layers'): "bfloat16" where it makes a float32 job's cache bfloat16, which only
    the CPU kernels hold; "auto" where the cache is bfloat16 already (model.dtype bfloat16, on the
    CPU or a card) or the name is auto. Raises ValueError naming the key where the cache cannot be
    bfloat16, as vLLM refuses a kv_cache_dtype its attention backend lacks."""
    if name == "auto":
        return "auto"
    leave = "; leave model.kv_cache_dtype auto"
    if cfg.mla is not None:
        raise ValueError("model.kv_cache_dtype bfloat16: latent attention's cache (DeepSeek's MLA) stays in the "
                         "compute dtype" + leave)
    if matmul_dtype == "bfloat16" or dtype == "bfloat16":
        return "auto"
    if device == "ascend":
        raise ValueError(f"model.kv_cache_dtype bfloat16: Ascend's attention kernels read a cache of the compute "
                         f"dtype ({dtype} here); set model.dtype bfloat16 for a bfloat16 cache" + leave)
    if not cpu_kernels(device, ops):
        raise ValueError("model.kv_cache_dtype bfloat16: the portable operators (model.ops portable) keep the cache "
                         "in the compute dtype; the CPU kernels (model.ops auto) hold it in bfloat16" + leave)
    if dtype != "float32":
        raise ValueError(f"model.kv_cache_dtype bfloat16: the CPU kernels hold a bfloat16 cache for a float32 network, "
                         f"not a {dtype} one; set model.dtype float32 (or auto)" + leave)
    return "bfloat16"


FUSED_DTYPES = ("bfloat16", "float16")        # what Ascend's fused attention kernels take


def fused(device: str, ops: str) -> bool:
    """Whether the job runs Ascend's fused kernels (worker/ascend.py)."""
    return device == "ascend" and ops == "auto"


def cpu_kernels(device: str, ops: str) -> bool:
    """Whether the job runs the CPU kernels (worker/cpu.py, worker/csrc): model.ops auto on the CPU."""
    return device == "cpu" and ops == "auto"


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


def cpu_bfloat16(name: str, device: str, emulate: bool = False, ops: str = "auto") -> bool:
    """Whether model.dtype `name` makes the CPU kernels compute the linear layers in bfloat16: so on
    the CPU (not with its portable operators, nor on the emulated Ascend path). MindSpore's CPU
    Gather and collectives have no bfloat16, so the network (norms, attention) stays float32;
    each linear layer, expert and the LM head round their inputs and weights to bfloat16 and sum
    the products in float32, as a card's bfloat16 matmul does, the embedding's rows are bfloat16
    (worker.cpu.CpuOps.pack_pairs; EngineConfig.matmul_dtype), and the KV cache holds bfloat16
    values (EngineConfig.kv_bfloat16)."""
    return name == "bfloat16" and cpu_kernels(device, ops) and not emulate


def resolve_dtype(name: str, cfg: ModelConfig, device: str, emulate: bool = False, ops: str = "auto") -> str:
    """The dtype the workers compute in: a card's (`card_dtype`), or on this machine's CPU (the CPU,
    or Ascend emulated) what it runs: 'auto' is float32 there, except on the emulated fused
    kernels, which take what a card takes; bfloat16, which MindSpore's CPU kernels lack (Gather and
    the collectives refuse it), is float32 with the linear layers in bfloat16 on the CPU kernels
    (`cpu_bfloat16`), refused with the portable operators, and computed in float16 by the
    emulation (`emulated_note`)."""
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
        if cpu_bfloat16(name, device, emulate, ops):
            return "float32"
        where = ("the emulated Ascend path (it runs on the CPU)" if emulate
                 else "the CPU with model.ops portable (the CPU kernels, model.ops auto, compute its linear layers "
                      "in bfloat16)")
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
    if cpu_kernels(device, ops) and shapes == "dynamic":
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
