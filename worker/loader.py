"""Streams a Hugging Face safetensors checkpoint into a (sharded) network, one tensor at a time.

Each rank opens the files itself and asks each parallel layer to read its own slice
(`safe_open(...).get_slice(name)[rows]`), so no rank ever holds a full tensor that it shards and
peak host memory is one slice, not one checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, so safetensors can hand out bf16 slices
from safetensors import SafetensorError, safe_open

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
    pickled = sorted(p.name for p in d.glob("*") if p.suffix in (".bin", ".pt", ".pth"))
    if pickled:
        if allow_pickle:
            raise CheckpointError(
                f"{d}: holds only pickle weights ({', '.join(pickled)}); msinfer loads safetensors only: "
                f"convert them once with transformers' save_pretrained(safe_serialization=True)")
        raise CheckpointError(
            f"{d}: holds only pickle weights ({', '.join(pickled)}), which can run code when loaded; "
            f"msinfer refuses them (model.allow_pickle: true acknowledges the risk, but the weights "
            f"must still be converted to safetensors)")
    raise CheckpointError(f"{d}: no *.safetensors weights found")


def load_checkpoint(model, model_dir: str | Path, allow_pickle: bool = False) -> dict:
    """Load every tensor `model.named_loaders()` expects; returns {'tensors': n, 'bytes': read}."""
    table = model.named_loaders()
    seen: set[str] = set()
    for path in safetensors_files(model_dir, allow_pickle):
        try:
            with safe_open(str(path), framework="np") as f:
                for name in f.keys():
                    if name not in table:
                        continue
                    layer, param, shard_id = table[name]
                    layer.weight_loader(param, f.get_slice(name), name, shard_id)
                    seen.add(name)
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot be read ({e})") from None
    missing = [n for n in table if n not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{model_dir}: weight tensor '{missing[0]}' is missing from the checkpoint"
            + (f" (also {', '.join(missing[1:5])}{more})" if len(missing) > 1 else ""))
    unique = {id(param): param for _, param, _ in table.values()}
    nbytes = sum(p.nbytes for p in unique.values())
    return {"tensors": len(seen), "bytes": nbytes}


def check_checkpoint(model_dir: str | Path, plans, allow_pickle: bool = False) -> int:
    """Before any worker starts: every tensor the layout plan needs is in the checkpoint with the
    shape the config implies, and every file's header reads. Reads headers only. Returns the
    checkpoint's size in bytes."""
    found: dict[str, tuple[Path, tuple]] = {}
    size = 0
    for path in safetensors_files(model_dir, allow_pickle):
        try:
            with safe_open(str(path), framework="np") as f:
                for name in f.keys():
                    found[name] = (path, tuple(f.get_slice(name).get_shape()))
            size += path.stat().st_size
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e}); the file may be truncated "
                                  f"or corrupted: copy it again") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot be read ({e})") from None
    for p in plans:
        if p.name not in found:
            raise CheckpointError(f"{model_dir}: weight tensor '{p.name}' is missing from the checkpoint")
        path, shape = found[p.name]
        if shape != tuple(p.full_shape):
            raise CheckpointError(f"{path.name}: tensor '{p.name}' has shape {list(shape)}, the config implies "
                                  f"{list(p.full_shape)}")
    return size
