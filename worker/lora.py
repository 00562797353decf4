"""LoRA adapters (the PEFT format) merged into the base weights while they stream from disk.

For each target module W [out, in] with adapter matrices A [r, in] and B [out, r]:

    W' = W + s * B @ A,    s = scale * alpha / r    (alpha / sqrt(r) for an rsLoRA adapter)

r, alpha and the target modules come from `adapter_config.json`, A and B from
`adapter_model.safetensors`; `scale` is model.lora.scale. A rank never merges a whole tensor that
it shards: the merged slice W'[rows, cols] = W[rows, cols] + s * B[rows] @ A[:, cols] needs only
B's rows for a column-parallel layer (q/k/v, gate/up: the layer's shard id picks the rows) and
only A's columns for a row-parallel one (o_proj, down_proj). `with_lora` hands each layer's
`weight_loader` such a merged source in place of the checkpoint's slice, so the parallel layers
know nothing of adapters.

No MindSpore here: the launcher checks an adapter against the model's shapes (`check_adapter`)
before any worker starts.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # noqa: F401  registers bfloat16 with numpy (bf16 adapters)
import numpy as np
from safetensors import SafetensorError, safe_open

from msinfer.worker.loader import CheckpointError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# a PEFT key: base_model.model.<module>.lora_A[.<adapter name>].weight
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# a copy of a target module's base weight, which PEFT saves for lm_head (save_embedding_layers)
_COPY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.base_layer\.weight$")


class AdapterError(CheckpointError):
    """An adapter that cannot be merged into the model; the message names the file or module."""


@dataclass(frozen=True)
class LoraModule:
    module: str                 # e.g. model.layers.0.self_attn.q_proj
    a_key: str
    b_key: str
    a_shape: tuple[int, int]    # [r, in]
    b_shape: tuple[int, int]    # [out, r]
    scaling: float              # scale * alpha / r
    copy_key: str | None = None     # the adapter's copy of the base weight (_COPY), which must equal it

    @property
    def weight_name(self) -> str:
        return self.module + ".weight"


class LoraAdapter:
    """An adapter folder, read (config and tensor headers) but not yet merged."""

    def __init__(self, path: str | Path, scale: float = 1.0):
        self.path = Path(path)
        self.scale = float(scale)
        self.weights = self.path / WEIGHTS_FILE
        self.config = self._read_config()
        self.modules = self._read_modules()       # base weight name -> LoraModule

    def _read_config(self) -> dict:
        where = f"model.lora.path {self.path}"
        if not self.path.is_dir():
            raise AdapterError(f"{where} is not a folder; expected a PEFT adapter folder holding {CONFIG_FILE} "
                               f"and {WEIGHTS_FILE}")
        f = self.path / CONFIG_FILE
        if not f.is_file():
            raise AdapterError(f"{where}: {CONFIG_FILE} is missing (a PEFT adapter folder, as save_pretrained "
                               f"writes it, holds {CONFIG_FILE} and {WEIGHTS_FILE})")
        if not self.weights.is_file():
            pickled = (self.path / "adapter_model.bin").is_file()
            raise AdapterError(f"{where}: {WEIGHTS_FILE} is missing" + (
                " (it holds adapter_model.bin, a pickle: save the adapter again with "
                "save_pretrained(safe_serialization=True))" if pickled else ""))
        try:
            cfg = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AdapterError(f"{f}: cannot be read as JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise AdapterError(f"{f}: expected a JSON object")
        unsupported = [
            (cfg.get("peft_type", "LORA") != "LORA", f"peft_type is {cfg.get('peft_type')!r}; only LORA merges"),
            (bool(cfg.get("use_dora")), "use_dora is true; DoRA adapters are not supported"),
            (bool(cfg.get("fan_in_fan_out")), "fan_in_fan_out is true (a Conv1D model's adapter)"),
            (cfg.get("bias", "none") != "none", f"bias is {cfg.get('bias')!r}; adapters that train biases are "
                                                f"not supported"),
            (bool(cfg.get("modules_to_save")), f"modules_to_save {cfg.get('modules_to_save')} replaces whole "
                                               f"modules; only LoRA matrices merge"),
            (bool(cfg.get("lora_bias")), "lora_bias is true; adapters with a lora_B bias are not supported"),
            (any(not isinstance(t, str) or not t.endswith(".weight") for t in cfg.get("target_parameters") or ()),
             f"target_parameters {cfg.get('target_parameters')} names a parameter other than a module's 2-D "
             f"weight (such as a mixture's stacked experts); only LoRA on linear weights merges"),
            (bool(cfg.get("trainable_token_indices")), "trainable_token_indices is set (trained embedding rows); "
                                                       "only LoRA matrices merge"),
            (bool(cfg.get("layer_replication")), "layer_replication is set; the base model's layers are used as "
                                                 "they are"),
        ]
        for bad, why in unsupported:
            if bad:
                raise AdapterError(f"{f}: {why}")
        return cfg

    def _read_modules(self) -> dict[str, LoraModule]:
        try:
            with safe_open(str(self.weights), framework="np") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except SafetensorError as e:
            raise AdapterError(f"{self.weights}: not a readable safetensors file ({e})") from None
        except OSError as e:
            raise AdapterError(f"{self.weights}: cannot be read ({e})") from None
        pairs: dict[str, dict[str, str]] = {}
        copies: dict[str, str] = {}
        for key in shapes:
            m = _KEY.match(key)
            if m is None and (c := _COPY.match(key)) is not None:
                copies[c["module"]] = key
                continue
            if m is None:
                what = "an embedding LoRA" if "lora_embedding" in key else "not a lora_A / lora_B matrix"
                raise AdapterError(f"{self.weights}: tensor '{key}' is {what}; only LoRA on linear layers merges")
            pairs.setdefault(m["module"], {})[m["which"]] = key
        for module, key in copies.items():
            if module not in pairs:
                raise AdapterError(f"{self.weights}: tensor '{key}' is a copy of the weight of '{module}', which the "
                                   f"adapter has no LoRA matrices for; only LoRA on linear layers merges")
        modules = {}
        for module, ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise AdapterError(f"{self.weights}: module '{module}' has lora_{''.join(ab)} but not "
                                   f"lora_{'B' if 'A' in ab else 'A'}")
            a, b = shapes[ab["A"]], shapes[ab["B"]]
            if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
                raise AdapterError(f"{self.weights}: module '{module}': lora_A {list(a)} and lora_B {list(b)} are "
                                   f"not [r, in] and [out, r] of one rank r")
            if not _targeted(self.config, module):
                raise AdapterError(f"{self.weights}: module '{module}' has LoRA matrices, but {CONFIG_FILE} does not "
                                   f"target it ({_targets_said(self.config)}): PEFT would leave them out. The "
                                   f"adapter's file and its config disagree")
            r, r_config = a[0], self.config.get("r", 8)
            want = _pattern_value(self.config.get("rank_pattern") or {}, module, r_config)
            if r != want:
                raise AdapterError(f"{self.weights}: module '{module}': lora_A {list(a)} is of rank {r}, where "
                                   f"{CONFIG_FILE} gives r {want}" + (" (rank_pattern)" if want != r_config else "")
                                   + ": the adapter's file and its config disagree")
            alpha = float(_pattern_value(self.config.get("alpha_pattern") or {}, module,
                                         self.config.get("lora_alpha", 8)))
            base = alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r
            lm = LoraModule(module, ab["A"], ab["B"], a, b, self.scale * base, copies.get(module))
            modules[lm.weight_name] = lm
        if not modules:
            raise AdapterError(f"{self.weights}: holds no LoRA matrices")
        return modules

    def check(self, base_shapes: dict[str, tuple]) -> None:
        """Every target module exists in the base model with the shapes the adapter implies."""
        targets = self.config.get("target_modules")
        tied = "lm_head.weight" not in base_shapes and "model.embed_tokens.weight" in base_shapes
        if isinstance(targets, list):
            modules = {n.removesuffix(".weight") for n in base_shapes if n.endswith(".weight")}
            short = {m.rsplit(".", 1)[-1] for m in modules}
            missing = [t for t in targets if t not in short and t not in modules]
            if missing:
                if tied and missing[0] == "lm_head":
                    raise tied_head(self.path / CONFIG_FILE)
                linear = sorted(n for n in short if n.endswith("_proj") or n == "lm_head")
                raise AdapterError(f"{self.path / CONFIG_FILE}: target module '{missing[0]}' is not a module of "
                                   f"the base model (its linear modules: {', '.join(linear)})")
        self.refuse_experts()
        for name, lm in self.modules.items():
            if name not in base_shapes:
                if tied and name == "lm_head.weight":
                    raise tied_head(self.weights)
                raise AdapterError(f"{self.weights}: target module '{lm.module}' is not in the base model "
                                   f"(no tensor '{name}'); was the adapter trained on another model?")
            check_shapes(lm, base_shapes[name])

    def refuse_experts(self) -> None:
        for name, lm in self.modules.items():
            if ".mlp.experts." in name:
                raise AdapterError(f"{self.weights}: target module '{lm.module}' is a routed expert of a mixture "
                                   f"of experts; msinfer merges adapters into dense modules only (attention, "
                                   f"dense MLPs, shared experts, the router)")

    def source(self, name: str, src):
        """The checkpoint source of tensor `name`, merged with this adapter if it targets it."""
        lm = self.modules.get(name)
        return src if lm is None else MergedSource(src, lm, self.weights)


def tied_head(where: Path) -> AdapterError:
    return AdapterError(f"{where}: targets lm_head, which this checkpoint ties to model.embed_tokens "
                        f"(tie_word_embeddings): a LoRA merged into it would change the embedding too, so msinfer "
                        f"does not merge one")


def check_shapes(lm: LoraModule, base: tuple) -> None:
    (_, a_in), (b_out, _) = lm.a_shape, lm.b_shape
    if tuple(base) != (b_out, a_in):
        raise AdapterError(f"target module '{lm.module}': the adapter's B @ A is [{b_out}, {a_in}] (lora_B "
                           f"{list(lm.b_shape)}, lora_A {list(lm.a_shape)}), the base weight is {list(base)}")


class MergedSource:
    """A checkpoint tensor that reads as W + s * B @ A, computing only the indexed slice."""

    def __init__(self, src, lm: LoraModule, weights: Path):
        self.src, self.lm, self.weights = src, lm, weights
        check_shapes(lm, self.get_shape())

    def get_shape(self) -> tuple[int, ...]:
        return tuple(self.src.get_shape()) if hasattr(self.src, "get_shape") else tuple(self.src.shape)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        rows, cols = (tuple(index) + (slice(None), slice(None)))[:2]
        with safe_open(str(self.weights), framework="np") as f:
            b = np.asarray(f.get_slice(self.lm.b_key)[rows, :], np.float32)
            a = np.asarray(f.get_slice(self.lm.a_key)[:, cols], np.float32)
            copy = None if self.lm.copy_key is None else np.asarray(f.get_slice(self.lm.copy_key)[rows, cols],
                                                                     np.float32)
        base = np.asarray(self.src[rows, cols], np.float32)
        if copy is not None and not np.array_equal(copy, base):
            raise AdapterError(f"{self.weights}: tensor '{self.lm.copy_key}' holds a weight of '{self.lm.module}' "
                               f"other than the checkpoint's (PEFT saves it with save_embedding_layers, for a "
                               f"weight trained or resized with the adapter); msinfer merges LoRA matrices into "
                               f"the checkpoint's weights only")
        return base + np.float32(self.lm.scaling) * (b @ a)


class _LoaderTable:
    """The model as `load_checkpoint` sees it, with every targeted layer's loader merging."""

    def __init__(self, model, adapter: LoraAdapter):
        self.model, self.adapter = model, adapter

    def named_loaders(self) -> dict:
        table = self.model.named_loaders()
        self.adapter.refuse_experts()
        stages = getattr(getattr(self.model, "stage", None), "count", 1)
        for name, lm in self.adapter.modules.items():
            if name not in table:
                if stages > 1:      # another pipeline stage's (the plan checked it against the whole model)
                    continue
                raise AdapterError(f"{self.adapter.weights}: target module '{lm.module}' is not in the base model "
                                   f"(no tensor '{name}'); was the adapter trained on another model?")
            layer, param, shard_id = table[name]
            table[name] = (_MergingLoader(layer, self.adapter), param, shard_id)
        return table


class _MergingLoader:
    def __init__(self, layer, adapter: LoraAdapter):
        self.layer, self.adapter = layer, adapter

    def weight_loader(self, param, src, name, shard_id=None):
        self.layer.weight_loader(param, self.adapter.source(name, src), name, shard_id)


def with_lora(model, path: str | None, scale: float = 1.0):
    """What to hand `load_checkpoint`: the model itself, or (with an adapter) a view of it whose
    loaders merge the adapter into each target tensor's slice."""
    return model if not path else _LoaderTable(model, LoraAdapter(path, scale))


def check_adapter(path: str, scale: float, plans) -> int:
    """Before any worker starts: the adapter reads and fits the base model (layout plans: tensor
    names and full shapes). Returns the number of target modules."""
    adapter = LoraAdapter(path, scale)
    adapter.check({p.name: tuple(p.full_shape) for p in plans})
    return len(adapter.modules)


def _targeted(config: dict, module: str) -> bool:
    """Whether PEFT applies the adapter to `module` (its name in the base model), as its
    check_target_module_exists decides: exclude_modules, then target_modules (a regular
    expression the whole name matches, names it ends in, or all-linear: every linear module but
    lm_head) with layers_to_transform for a list of names, then target_parameters (a module's
    2-D weight). No targets given (PEFT's defaults for the architecture): every module."""
    def ends_in(names, key: str) -> bool:
        return any(key == n or key.endswith(f".{n}") for n in names)

    exclude = config.get("exclude_modules")
    if exclude and (re.fullmatch(exclude, module) if isinstance(exclude, str) else ends_in(exclude, module)):
        return False
    targets, params = config.get("target_modules"), config.get("target_parameters") or []
    if targets is None and not params:
        return True
    if params and ends_in(params, module + ".weight"):
        return True
    if targets is None:
        return False
    if targets == "all-linear":
        return not ends_in(["lm_head"], module)
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    if module in targets:
        return True
    if not ends_in(targets, module):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern") or []
    patterns = [patterns] if isinstance(patterns, str) else patterns
    found = (next((m for p in patterns if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module))), None)
             if patterns else re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module))
    if found is None:
        return False
    index = int(found["idx"])
    return index == layers if isinstance(layers, int) else index in layers


def _targets_said(config: dict) -> str:
    said = [f"{k} {config[k]}" for k in ("target_modules", "target_parameters", "exclude_modules",
                                          "layers_to_transform", "layers_pattern") if config.get(k) not in (None, [])]
    return ", ".join(said) or "no target_modules"


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name ending in it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default

