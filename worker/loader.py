"""Streams a Hugging Face safetensors checkpoint into a (sharded) network, one tensor at a time.

Each rank opens the files itself and asks each parallel layer to read its own slice
(`safe_open(...).get_slice(name)[rows]`), so no rank ever holds a full tensor that it shards and
peak host memory is one slice, not one checkpoint.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from contextlib import ExitStack, contextmanager
from pathlib import Path

import ml_dtypes  # registers bfloat16 with numpy, so safetensors can hand out bf16 slices
import numpy as np
from safetensors import SafetensorError, safe_open

from msinfer.sharding.quant import (FP8_SCALE, Fp8BlockWeight, QuantizationError, QuantizedWeight, scale_values,
                                    source_shape)

# safetensors' numpy reader names float8 slices by numpy.float8_e4m3fn, which numpy lacks: ml_dtypes'
# type is the one safetensors expects there (FP8 checkpoints, sharding.quant.Fp8BlockWeight)
if not hasattr(np, "float8_e4m3fn"):
    np.float8_e4m3fn = ml_dtypes.float8_e4m3fn

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
NOT_WEIGHTS = ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


def safetensors_files(model_dir: str | Path, allow_pickle: bool = False) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = [d / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p for p in d.glob("*") if p.suffix in PICKLE_SUFFIXES and p.name not in NOT_WEIGHTS)
    if pickled:
        names = ", ".join(p.name for p in pickled)
        if allow_pickle:
            return pickled
        raise CheckpointError(
            f"{d}: holds only pickle weights ({names}), which can run code when loaded; msinfer loads "
            f"safetensors only, unless model.allow_pickle: true (then they are read with torch's weights-only "
            f"unpickler). Better: convert them once with transformers' save_pretrained(safe_serialization=True)")
    raise CheckpointError(f"{d}: no *.safetensors weights found")


def holds_weights(model_dir: str | Path) -> bool:
    """Whether the folder holds any weights file (safetensors, an index of them, or pickles)."""
    d = Path(model_dir)
    return (d / "model.safetensors.index.json").is_file() or any(
        p.suffix == ".safetensors" or (p.suffix in PICKLE_SUFFIXES and p.name not in NOT_WEIGHTS) for p in d.glob("*"))


def check_model_dir(model_dir: str | Path) -> None:
    """model.path exists, is a folder and can be listed and read (before anything else reads it)."""
    d = Path(model_dir)
    if not d.exists():
        raise CheckpointError(f"model.path {d} does not exist; it should be a folder holding a Hugging Face "
                              f"config.json and *.safetensors weights")
    if not d.is_dir():
        raise CheckpointError(f"model.path {d} is a file, not a folder; give the folder that holds config.json "
                              f"and the *.safetensors weights")
    try:
        names = os.listdir(d)
        for name in ("config.json", *(n for n in names if n.endswith(".safetensors"))):
            if (d / name).is_file():
                with open(d / name, "rb") as f:
                    f.read(1)
    except OSError as e:
        raise CheckpointError(f"model folder {d} cannot be read: {e.strerror or e}"
                              + (f" ({e.filename})" if e.filename else "")) from None


@contextmanager
def open_weights(path: Path):
    """One weights file as `keys()` and `get_slice(name)`: safetensors read lazily, slice by slice;
    a pickle file (only with model.allow_pickle) read whole by torch's weights-only unpickler."""
    if path.suffix != ".safetensors":
        yield _PickleWeights(path)
        return
    with safe_open(str(path), framework="np") as f:
        yield f


class _PickleWeights:
    def __init__(self, path: Path):
        try:
            import torch
        except ImportError:
            raise CheckpointError(f"{path}: reading pickle weights needs torch, which is not installed; "
                                  f"convert the checkpoint to safetensors instead") from None
        self.torch = torch
        try:
            try:
                self.tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:  # the legacy (pre-zip) format cannot be memory-mapped
                if "mmap" not in str(e):
                    raise
                self.tensors = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a pickle that is not a plain state dict, a truncated file, ...
            raise CheckpointError(f"{path}: not a readable PyTorch weights file ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if not isinstance(self.tensors, dict):
            raise CheckpointError(f"{path}: expected a state dict of tensors, got {type(self.tensors).__name__}")

    def keys(self):
        return [k for k, v in self.tensors.items() if isinstance(v, self.torch.Tensor)]

    def get_slice(self, name: str):
        t = self.tensors[name]
        return (t.float() if t.dtype == self.torch.bfloat16 else t).numpy()


def _dtype(src) -> str:
    """A tensor's element type as safetensors names it (I8, I32, F32, BF16, ...)."""
    if hasattr(src, "get_dtype"):
        return src.get_dtype()
    return {"int8": "I8", "int32": "I32", "int64": "I64", "uint8": "U8"}.get(str(src.dtype), "F")


QUANTIZED_SUFFIXES = (".weight_scale", ".weight_packed", ".weight_shape", ".weight_zero_point", ".weight_g_idx",
                      ".deq_scale", ".quant_bias", ".input_scale", ".input_offset", FP8_SCALE)


def quantized_names(name: str, quant) -> tuple[str, ...]:
    """The checkpoint tensors that hold float tensor `name` where the checkpoint quantizes its
    layer: the ints (and for packed ints their shape), then their scales; for ModelSlim W8A8 the
    layer's bias is its quant_bias times deq_scale. () where it is float."""
    if quant is None or not name.endswith((".weight", ".bias")):
        return ()
    module, leaf = name.rsplit(".", 1)
    scheme = quant.scheme_for(module)
    if scheme is None:
        return ()
    if leaf == "bias":
        return (module + ".quant_bias", module + ".deq_scale") if scheme.static else ()
    if scheme.static:
        return name, module + ".deq_scale"
    ints = (module + ".weight_packed", module + ".weight_shape") if quant.packed else (name,)
    return (*ints, module + ".weight_scale")


def weight_source(name: str, get, quant, has=lambda n: True):
    """What a parallel layer reads for checkpoint tensor `name`: its slice, or for a quantized
    layer a QuantizedWeight over its ints and scales (dequantized as read); for a ModelSlim W8A8
    layer's bias quant_bias * deq_scale, and zeros for a float layer's bias that a W8A8 model
    has only for its quantized ones. get(name) -> slice; has(name): whether the checkpoint holds it."""
    names = quantized_names(name, quant)
    if not names:
        if not has(name) and optional(name, quant):
            return np.zeros(source_shape(get(name[:-len("bias")] + "weight"))[0], np.float32)
        scale = fp8_scale(name, quant, has)
        if scale is not None:
            try:
                return Fp8BlockWeight(name, get(name), get(scale), quant.fp8_block)
            except QuantizationError as e:
                raise CheckpointError(str(e)) from None
        return get(name)
    module = name.rsplit(".", 1)[0]
    if name.endswith(".bias"):
        return (np.asarray(get(names[0])[:]).astype(np.float64)
                * scale_values(np.asarray(get(names[1])[:]))).astype(np.float32)
    ints, scale = get(names[0]), get(names[-1])
    shape = tuple(int(v) for v in np.asarray(get(names[1])[:]).reshape(-1)) if quant.packed else source_shape(ints)
    try:
        return QuantizedWeight(name, quant.scheme_for(module), ints, scale, shape, quant.packed)
    except QuantizationError as e:
        raise CheckpointError(str(e)) from None


def fp8_scale(name: str, quant, has) -> str | None:
    """The `weight_scale_inv` of weight `name` where the checkpoint is FP8 in blocks and holds one
    for it (that layer is FP8: sharding.quant.Fp8BlockWeight), else None."""
    if quant is None or quant.fp8_block is None or not name.endswith(".weight"):
        return None
    scale = name[:-len(".weight")] + FP8_SCALE
    return scale if has(scale) else None


def optional(name: str, quant) -> bool:
    """A tensor the network has that the checkpoint may lack: a float layer's bias in a ModelSlim
    W8A8 model (zeros; sharding.config gives every linear layer a bias there)."""
    return (name.endswith(".bias") and quant is not None and not quantized_names(name, quant)
            and any(s.static for s in quant.schemes))


LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


def read_tensor(model_dir: str | Path, name: str, allow_pickle: bool = False, rows=None) -> np.ndarray:
    """A tensor of the checkpoint as float32, for the host: a classifier's head, whole, or (`rows`)
    those rows of it only (an LM head's rows of a few tokens: ModelConfig.head_tokens)."""
    for path in safetensors_files(model_dir, allow_pickle):
        with open_weights(path) as f:
            own = base_model_names(f.keys()).get(name, name)
            if own in f.keys():
                sl = f.get_slice(own)
                if rows is None:
                    return np.asarray(sl[:], np.float32)
                return np.stack([np.asarray(sl[r:r + 1], np.float32)[0] for r in rows])
    raise CheckpointError(f"{model_dir}: weight tensor '{name}' is missing from the checkpoint")


def base_model_names(names) -> dict[str, str]:
    """A base model's checkpoint (LlamaModel, Qwen3Model: an embedding model saved without its LM
    head) names its tensors without the causal LM's `model.` prefix, as vLLM reads either: the
    network's name of each ('model.' + name) -> the checkpoint's. {} for a causal LM's."""
    names = list(names)
    if any(n.startswith("model.") for n in names):
        return {}
    return {"model." + n: n for n in names if not n.startswith("lm_head.")}


def load_checkpoint(model, model_dir: str | Path, allow_pickle: bool = False, quant=None,
                    layer_done=None) -> dict:
    """Load every tensor `model.named_loaders()` expects (`quant`: the checkpoint's quantization,
    ModelConfig.quant); returns {'tensors': n, 'bytes': held}. `layer_done(i)` is called once the
    last tensor of decoder layer i (model.layers.i.*) is in."""
    table = model.named_loaders()
    names = list(table)
    left = Counter(m.group(1) for m in map(LAYER_TENSOR.match, table) if m)
    with ExitStack() as stack:
        where: dict[str, tuple] = {}
        for path in safetensors_files(model_dir, allow_pickle):
            try:
                f = stack.enter_context(open_weights(path))
                where.update((name, (f, path)) for name in f.keys())
            except SafetensorError as e:
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
            except OSError as e:
                raise CheckpointError(f"{path}: cannot be read ({e})") from None
        own = base_model_names(where)
        where.update((name, where[n]) for name, n in own.items())
        missing = [n for name in table for n in (quantized_names(name, quant) or (name,))
                   if n not in where and not optional(n, quant)]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(
                f"{model_dir}: weight tensor '{missing[0]}' is missing from the checkpoint"
                + (f" (also {', '.join(missing[1:5])}{more})" if len(missing) > 1 else ""))

        def get(n: str):
            return where[n][0].get_slice(own.get(n, n))

        held: dict[str, int] = {}          # name of each parameter loaded -> its bytes
        for name in names:
            # (popped: a layer's float parameters are freed once `layer_done` replaces them)
            layer, param, shard_id = table.pop(name)
            held[param.name] = param.nbytes
            try:
                layer.weight_loader(param, weight_source(name, get, quant, where.__contains__), name, shard_id)
            except SafetensorError as e:
                raise CheckpointError(f"{where[name][1] if name in where else model_dir}: not a readable "
                                      f"safetensors file ({e})") from None
            except OSError as e:
                raise CheckpointError(f"{model_dir}: tensor '{name}' cannot be read ({e})") from None
            if (m := LAYER_TENSOR.match(name)) is not None:
                left[m.group(1)] -= 1
                if not left[m.group(1)] and layer_done is not None:
                    layer_done(int(m.group(1)))
    return {"tensors": len(names), "bytes": sum(held.values())}


class _Header:
    """A tensor's shape and element type, read from a file header, standing in for its slice."""

    def __init__(self, shape: tuple, dtype: str):
        self.shape, self.dtype = shape, dtype

    def get_shape(self):
        return self.shape

    def get_dtype(self):
        return self.dtype


def check_checkpoint(model_dir: str | Path, plans, allow_pickle: bool = False, quant=None,
                     notes: list | None = None) -> int:
    """Before any worker starts: every tensor the layout plan needs is in the checkpoint with the
    shape the config implies (a quantized layer's ints, scales and packing with the shapes its
    scheme implies), and every file's header reads. Reads headers, and the shape of packed
    weights. Returns the checkpoint's size in bytes; `notes` gets a word on an LM head the
    checkpoint holds and a tied config leaves unused."""
    found: dict[str, tuple[Path, _Header]] = {}
    packed_shapes: dict[str, np.ndarray] = {}         # the values of packed weights' weight_shape
    size = 0
    for path in safetensors_files(model_dir, allow_pickle):
        try:
            with open_weights(path) as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    found[name] = (path, _Header(source_shape(sl), _dtype(sl)))
                    if name.endswith(".weight_shape"):
                        packed_shapes[name] = np.asarray(sl[:])
            size += path.stat().st_size
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e}); the file may be truncated "
                                  f"or corrupted: copy it again") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot be read ({e})") from None
    for name, n in base_model_names(found).items():
        found[name] = found[n]
        if n in packed_shapes:
            packed_shapes[name] = packed_shapes[n]
    planned = {p.name for p in plans}
    if notes is not None and "lm_head.weight" in found and "lm_head.weight" not in planned \
            and "model.embed_tokens.weight" in planned:
        notes.append("config.json ties the LM head to the embedding (tie_word_embeddings: true), so the "
                     "checkpoint's own lm_head.weight is not used, as vLLM does (transformers uses it where it "
                     "differs from the embedding)")
    if quant is None:
        marked = next((n for n in found if n.endswith(QUANTIZED_SUFFIXES)), None)
        if marked is not None:
            raise CheckpointError(f"{found[marked][0].name}: tensor '{marked}' is part of a quantized weight, but "
                                  f"{Path(model_dir) / 'config.json'} has no quantization_config to say how to read it")
    for p in plans:
        names = quantized_names(p.name, quant)
        if p.name.endswith(".bias") and (names or (p.name not in found and optional(p.name, quant))):
            continue                    # a quantized layer's bias (its shape: quant_bias's) or zeros
        static = names and quant.scheme_for(p.name.rsplit(".", 1)[0]).static
        for n in (*names, *(p.name[:-len("weight")] + x for x in ("input_scale", "input_offset") if static)) or (p.name,):
            if n not in found:
                raise CheckpointError(f"{model_dir}: weight tensor '{n}' is missing from the checkpoint"
                                      + (f" ({quant.scheme_for(p.name[:-len('.weight')]).describe()})" if names else ""))
        path, header = found[names[0] if names else p.name]
        if names or fp8_scale(p.name, quant, found.__contains__):
            def get(n: str):
                return packed_shapes[n] if n in packed_shapes else found[n][1]
            shape = tuple(weight_source(p.name, get, quant, found.__contains__).get_shape())
        else:
            shape = header.get_shape()
            if header.get_dtype().startswith("F8"):
                raise CheckpointError(f"{path.name}: tensor '{p.name}' holds {header.get_dtype()} values without "
                                      f"their scales ('{p.name.rsplit('.', 1)[0]}{FP8_SCALE}'), or the config has no "
                                      f"FP8 quantization_config")
            if header.get_dtype() in ("I8", "U8", "I32"):
                raise CheckpointError(f"{path.name}: tensor '{p.name}' holds {header.get_dtype()} integers, not "
                                      f"floats: " + ("the checkpoint's quantization (its quantization_config or "
                                                     "quant_model_description.json) leaves this layer float" if quant else
                                                     "a quantized checkpoint needs its quantization_config or "
                                                     "quant_model_description.json"))
        if tuple(shape) != tuple(p.full_shape):
            raise CheckpointError(f"{path.name}: tensor '{p.name}' has shape {list(shape)}, the config implies "
                                  f"{list(p.full_shape)}")
    return size
