"""task: embed: a record's prompt to one vector, as vLLM's pooling runner makes it.

The network ends at its final norm (no LM head: sharding.config.ModelConfig.pooling_only). Each
prefill chunk of a sequence hands back what its tokens add to the pooled vector
(worker.runner.forward_pooled): the last token's final hidden state (`last`), the first
position's (`cls`), or the sum over the chunk's tokens (`mean`, divided by the prompt's length
here). The vector is then cut to `dimensions` (Matryoshka) and L2-normalized where `normalize`
is on, as sentence-transformers' Normalize module and vLLM do.

`resolve_pooling` fills in `pooling: auto` from the checkpoint's sentence-transformers files:
modules.json names a Pooling module (its folder's config.json: pooling_mode_lasttoken,
pooling_mode_mean_tokens or pooling_mode_cls_token) and, optionally, a Normalize module.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

from msinfer.launcher.errors import SpecError

MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def checkpoint_pooling(model_dir: str | Path) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) as the checkpoint's sentence-transformers files give them, each
    None where they do not (no modules.json). A module msinfer cannot apply (a Dense projection, a
    pooling mode other than last, mean and cls) is a SpecError naming its file."""
    d = Path(model_dir)
    modules_file = d / "modules.json"
    if not modules_file.is_file():
        return None, None
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [(m["type"], m.get("path", "")) for m in modules]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise SpecError(f"{modules_file}: cannot be read as sentence-transformers modules ({e}); set "
                        f"pooling.type and pooling.normalize to pool without it") from None
    how, normalize = None, False
    for kind, path in kinds:
        name = str(kind).rsplit(".", 1)[-1]     # (sentence_transformers.models.Pooling, or the newer
        # sentence_transformers.sentence_transformer.modules.pooling.Pooling)
        if name == "Pooling":
            config = d / path / "config.json"
            try:
                modes = json.loads(config.read_text())
            except (OSError, ValueError) as e:
                raise SpecError(f"{config}: the Pooling module's config cannot be read ({e})") from None
            on = [k for k, v in modes.items() if k.startswith("pooling_mode_") and v]
            if len(on) != 1 or on[0] not in MODES:
                raise SpecError(f"{config}: pooling modes {on or '(none)'}; msinfer pools by exactly one of "
                                f"{', '.join(MODES)}; set pooling.type to override")
            how = MODES[on[0]]
        elif name == "Normalize":
            normalize = True
        elif name != "Transformer":
            raise SpecError(f"{modules_file}: module {kind} ({path or 'at the top'}) is not applied by msinfer "
                            f"(it applies Transformer, Pooling and Normalize)")
    if how is None:         # no Pooling module: no sentence-transformers pooling to read (vLLM's
        return None, None   # get_pooling_config), so the model's defaults, normalized
    return how, normalize


def resolve_pooling(spec) -> tuple:
    """(the spec of a task embed job with `pooling` resolved: type and normalize set, a note that
    says how and from where, for `msinfer plan`)."""
    pooling = spec.pooling
    how, normalize = checkpoint_pooling(spec.model.path) if pooling.type == "auto" or pooling.normalize is None \
        else (None, None)
    resolved = pooling.model_copy(update={
        "type": pooling.type if pooling.type != "auto" else how or "last",
        "normalize": pooling.normalize if pooling.normalize is not None else normalize is not False})
    source = ("the checkpoint's sentence-transformers files (modules.json)" if how is not None or normalize is not None
              else "vLLM's default for a decoder model" if pooling.type == "auto" or pooling.normalize is None
              else "the spec")
    note = (f"task embed: {resolved.type} pooling of the final hidden states, "
            f"{'L2-normalized' if resolved.normalize else 'not normalized'}"
            + (f", the first {pooling.dimensions} values" if pooling.dimensions else "") + f" (from {source})")
    return spec.model_copy(update={"pooling": resolved}), note


def embedding(pooled: np.ndarray, how: str, tokens: int, normalize: bool, dimensions: int | None) -> np.ndarray:
    """The record's vector (float32) from what its chunks pooled (see the module's text)."""
    v = np.asarray(pooled, np.float64)
    if how == "mean":
        v = v / max(tokens, 1)
    if dimensions:
        v = v[:dimensions]
    if normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)       # torch's F.normalize, as vLLM's
    return v.astype(np.float32)


def encoded(vector: np.ndarray, as_base64: bool):
    """An OpenAI embedding's value: a list of floats, or (encoding_format base64) the float32
    values' little-endian bytes in base64, as OpenAI and vLLM encode them."""
    if as_base64:
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()
