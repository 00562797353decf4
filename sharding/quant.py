"""Quantized checkpoints: what a config.json's `quantization_config` says each linear layer holds,
and the arithmetic to read it back.

compressed-tensors (llm-compressor's format) and ModelSlim (below) are read; anything else is
refused by name, never ignored (a quantized checkpoint read as a float one runs and gives wrong
tokens). What is read of compressed-tensors:

    W8A8    int8 weights, symmetric, one scale per output channel; inputs quantized to int8 per
            token at run time (dynamic)
    W8A16   int8 weights per channel, float inputs
    W4A16   int4 weights, symmetric, one scale per group of `group_size` inputs, packed in int32

in either format: `int-quantized` (an int8 `weight`) or `pack-quantized` (`weight_packed`, int32
words of 32/bits values each, and `weight_shape`). Layers in `ignore` stay float.

The arithmetic is compressed-tensors' own, since transformers with it is the reference:
    weight     w = q * scale                        (q in [-2^(b-1), 2^(b-1) - 1])
    input      s = max|x| over the token / 127.5    (its range, 255, halved; 0 -> float eps)
               x = clamp(round_half_even(x / s), -128, 127) * s
vLLM's int8 kernels take s = max|x| / 127 instead; the difference is a rounding of the input.

ModelSlim (msmodelslim, what MindIE and vllm-ascend deploy on Ascend) is read from its
`quant_model_description.json` (a type per tensor: W8A8, W8A8_DYNAMIC or FLOAT), as vllm-ascend
reads it (vllm_ascend/quantization/modelslim_config.py, methods/w8a8_static.py and
w8a8_dynamic.py):

    W8A8           int8 weight; per-tensor static input_scale and input_offset; deq_scale and
                   quant_bias per output: xq = clamp(round(x / input_scale + input_offset)),
                   y = (xq Wq^T + quant_bias) * deq_scale (the layer's float bias is not used)
    W8A8_DYNAMIC   int8 weight, weight_scale per output; inputs per token, s = max|x| / 127:
                   y = round(x / s) Wq^T * weight_scale * s + bias

round() is CANN's "round" mode, read as half away from zero (not checked on a card).

FP8 in blocks (`quant_method: fp8` with `weight_block_size: [rows, cols]`, `fmt: e4m3`: DeepSeek-V3
and R1 as released, Qwen3's -FP8 checkpoints): a layer is FP8 where the checkpoint holds its
`weight_scale_inv` ([ceil(out / rows), ceil(in / cols)] float32), and its weight is float8_e4m3fn:

    w[i, j] = float(q[i, j]) * weight_scale_inv[i // rows, j // cols]

The weights are dequantized to the compute dtype as they load, as DeepSeek's own fp8_cast_bf16.py
converts the release to bfloat16 (Ascend's 910 cards have no FP8 matmul); the inputs stay float.
vLLM and transformers on FP8 GPUs also quantize each layer's inputs to FP8, per group of `cols`,
so their logits differ from these by FP8's rounding of the inputs.

Plain Python and numpy (no MindSpore): the launcher reads it to plan, the workers to load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

SUPPORTED = ("compressed-tensors W8A8, W8A16 and W4A16 (symmetric int weights, int-quantized or pack-quantized), "
             "and FP8 (e4m3) weights in blocks (quant_method fp8 with weight_block_size)")
FP8_SCALE = ".weight_scale_inv"


class QuantizationError(ValueError):
    """A quantization_config (or a quantized tensor) msinfer cannot read; the message names it."""


@dataclass(frozen=True)
class Scheme:
    """One config group: int weights of `bits`, a scale per output channel (group_size 0) or per
    group of group_size inputs; with act_int8, inputs quantized to int8: per token at run time
    (max|x| / act_divisor), or with `static` ModelSlim's per-tensor scale and offset."""
    bits: int
    group_size: int
    act_int8: bool
    targets: tuple[str, ...] = ()
    act_divisor: float = 127.5        # compressed-tensors' (its range, 255, halved); ModelSlim's 127
    static: bool = False              # ModelSlim W8A8: input_scale, input_offset, deq_scale, quant_bias
    modelslim: str = ""               # ModelSlim's name of it

    @property
    def name(self) -> str:
        return self.modelslim or f"W{self.bits}A{8 if self.act_int8 else 16}"

    @property
    def int8_kind(self) -> str | None:
        """How a device that multiplies int8 weights itself runs a layer of this scheme: "weight"
        (int8 weights per channel, float inputs), "dynamic" (and int8 inputs per token), "static"
        (ModelSlim W8A8: a per-layer input scale and offset); None: weights per group (int4 groups:
        `int4_groups`)."""
        if self.bits != 8 or self.group_size:
            return None
        return "static" if self.static else "dynamic" if self.act_int8 else "weight"

    @property
    def int4_groups(self) -> bool:
        """Int4 weights with a scale per group of inputs, float inputs (W4A16): what Ascend's
        WeightQuantBatchMatmul multiplies packed two to a byte (worker.ascend.AscendInt4Linear)."""
        return self.bits == 4 and self.group_size > 0 and not self.act_int8

    def describe(self) -> str:
        if self.static:
            return f"{self.name} (int8 weights, int8 inputs with a static scale and offset per layer)"
        w = f"int{self.bits} weights per {'channel' if not self.group_size else f'group of {self.group_size}'}"
        return f"{self.name} ({w}, " + ("int8 inputs per token, dynamic)" if self.act_int8 else "float inputs)")


@dataclass(frozen=True)
class Quantization:
    packed: bool                  # pack-quantized (weight_packed, weight_shape), else int-quantized (weight)
    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...]
    described: tuple[tuple[str, str], ...] = ()     # ModelSlim: (tensor, its type) of the description
    fp8_block: tuple[int, int] | None = None        # FP8: the weight_block_size (no schemes: dequantized)

    def __post_init__(self):
        object.__setattr__(self, "_types", dict(self.described))     # looked up once per tensor

    def scheme_for(self, module: str) -> Scheme | None:
        """The scheme of a linear layer by its checkpoint module name (model.layers.0.mlp.down_proj),
        as compressed-tensors matches it (a target is the class Linear, the name, or re:<pattern>
        matched at the name's start); None: the layer is float, as are embeddings and norms."""
        leaf = module.rsplit(".", 1)[-1]
        if leaf == "embed_tokens" or leaf.endswith("norm"):
            return None
        if self.described:
            kind = self._types.get(module + ".weight", "FLOAT")
            return MODELSLIM_SCHEMES.get(kind)
        if any(_matches(module, t) for t in self.ignore):
            return None
        return next((s for s in self.schemes if any(_matches(module, t) for t in s.targets)), None)

    def describe(self) -> str:
        if self.fp8_block is not None:
            rows, cols = self.fp8_block
            return (f"FP8 (e4m3) weights with a scale per block of {rows}x{cols}, in the layers whose "
                    f"weight_scale_inv the checkpoint holds")
        kinds = sorted({s.describe() for s in self.schemes})
        if self.described:
            return f"ModelSlim ({MODELSLIM_FILE}): {'; '.join(kinds)}; the layers it calls FLOAT stay float"
        return (f"compressed-tensors {'pack' if self.packed else 'int'}-quantized: {'; '.join(kinds)}"
                + (f"; float: {', '.join(self.ignore)}" if self.ignore else ""))


def _matches(module: str, target: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def parse_quantization(q, source: str = "config.json") -> Quantization | None:
    """config.json's quantization_config -> what each layer holds; None for a float checkpoint.
    Raises QuantizationError naming the key and the scheme for anything not in SUPPORTED."""
    if q is None:
        return None

    def refuse(what: str) -> QuantizationError:
        return QuantizationError(f"{source}: quantization_config {what}; msinfer reads {SUPPORTED}")

    if not isinstance(q, dict):
        raise refuse(f"is a {type(q).__name__}, not a mapping")
    method = q.get("quant_method")
    if method == "fp8":
        return _parse_fp8(q, refuse)
    if method != "compressed-tensors":
        raise refuse(f"quant_method '{method}' is not supported"
                     + (f" (bits {q.get('bits')})" if q.get("bits") is not None else ""))
    fmt = q.get("format")
    if fmt not in ("int-quantized", "pack-quantized"):
        raise refuse(f"format '{fmt}' is not supported")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse(f"quantization_status '{status}': the weights are not stored compressed")
    for key in ("kv_cache_scheme", "transform_config", "sparsity_config"):
        value = q.get(key)
        stored = value.get("format") if key == "sparsity_config" and isinstance(value, dict) else None
        # (a sparsity config of format dense says the weights are stored whole, as llm-compressor
        # writes it for a model it did not prune; compressed-tensors and vLLM ignore it)
        if value and stored != "dense":
            raise refuse(f"{key} is set" + (f" (format '{stored}')" if stored is not None else "") + ": not supported")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise refuse("has no config_groups")
    schemes = []
    for gname, g in groups.items():
        schemes.append(_scheme(f"config_groups.{gname}", g, refuse))
        if isinstance(g, dict) and g.get("format") not in (None, fmt):
            raise refuse(f"config_groups.{gname}.format '{g.get('format')}' differs from format '{fmt}' (mixed "
                         f"formats are not supported)")
    if fmt == "int-quantized" and any(s.bits != 8 for s in schemes):
        raise refuse("format 'int-quantized' with int4 weights: int4 weights come packed (pack-quantized)")
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise refuse("ignore is not a list of names")
    return Quantization(packed=fmt == "pack-quantized", schemes=tuple(schemes), ignore=tuple(ignore))


def _parse_fp8(q: dict, refuse) -> Quantization:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise refuse(f"fp8 fmt '{fmt}' is not supported (e4m3 is)")
    block = q.get("weight_block_size")
    if block is None:
        raise refuse("fp8 without weight_block_size (one scale per tensor) is not supported")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise refuse(f"weight_block_size {block!r}: expected [rows, cols], two positive whole numbers")
    if q.get("kv_cache_scheme"):
        raise refuse("kv_cache_scheme is set: not supported")
    return Quantization(packed=False, schemes=(), ignore=(), fp8_block=(block[0], block[1]))


class _WeightView:
    """A quantized weight read as a float [out, in] tensor: get_shape(), and w[rows, cols] (two
    slices) dequantized by the subclass from `region`."""
    shape: tuple[int, int]

    def get_shape(self) -> tuple[int, int]:
        return self.shape

    def check_scale(self, tensor: str, want: tuple, what: str) -> None:
        """QuantizationError naming the scale tensor where self.scale's shape is not `want`."""
        if source_shape(self.scale) != tuple(want):
            raise QuantizationError(f"tensor '{tensor}' has shape {list(source_shape(self.scale))}; {what} needs {list(want)}")

    def region(self, index) -> tuple[int, int, int, int]:
        rows, cols = index
        r0, r1, _ = rows.indices(self.shape[0])
        c0, c1, _ = cols.indices(self.shape[1])
        return r0, r1, c0, c1


class Fp8BlockWeight(_WeightView):
    """An FP8 layer's weight as the parallel layers read a checkpoint tensor: get_shape() is [out,
    in], and w[rows, cols] reads that region's float8 values and the scales of the blocks it
    touches, and returns it dequantized, float32 (any region: a rank's slice need not follow the
    blocks)."""

    def __init__(self, name: str, values, scale, block: tuple[int, int]):
        self.name, self.values, self.scale, self.block = name, values, scale, block
        self.shape = source_shape(values)
        if len(self.shape) != 2:
            raise QuantizationError(f"tensor '{name}' has shape {list(self.shape)}; an FP8 weight is [out, in]")
        self.check_scale(name[:-len(".weight")] + FP8_SCALE, tuple(-(-n // b) for n, b in zip(self.shape, block)),
                         f"FP8 weights of {list(self.shape)} in blocks of {block[0]}x{block[1]}")

    def __getitem__(self, index) -> np.ndarray:
        r0, r1, c0, c1 = self.region(index)
        br, bc = self.block
        q = np.asarray(self.values[r0:r1, c0:c1]).astype(np.float32)
        s = np.asarray(self.scale[r0 // br:-(-r1 // br), c0 // bc:-(-c1 // bc)]).astype(np.float32)
        s = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)
        return q * s[r0 % br:r0 % br + (r1 - r0), c0 % bc:c0 % bc + (c1 - c0)]


def _scheme(where: str, g, refuse) -> Scheme:
    if not isinstance(g, dict):
        raise refuse(f"{where} is not a mapping")
    targets = g.get("targets") or []
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise refuse(f"{where}.targets is not a list of names")
    for t in targets:
        if t != "Linear" and not t.startswith("re:") and t[:1].isupper():
            raise refuse(f"{where}.targets names the class '{t}': only Linear layers are quantized")
    if g.get("output_activations"):
        raise refuse(f"{where}.output_activations is set: not supported")
    w = g.get("weights")
    if not isinstance(w, dict):
        raise refuse(f"{where}.weights is missing: weight-only or W8A8 schemes only")
    desc = (f"{where}.weights (type {w.get('type')}, {w.get('num_bits')} bits, strategy {w.get('strategy')}, "
            f"symmetric {w.get('symmetric')})")
    if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8) or not w.get("symmetric", True):
        raise refuse(f"{desc} is not supported (int4 or int8, symmetric)")
    if w.get("dynamic"):
        raise refuse(f"{where}.weights.dynamic is true: weights are quantized once, not per step")
    if w.get("actorder") not in (None, "static"):
        raise refuse(f"{where}.weights.actorder '{w.get('actorder')}' (GPTQ act-order with g_idx) is not supported")
    strategy = w.get("strategy")
    if strategy == "channel":
        group = 0
    elif strategy == "group":
        group = w.get("group_size")
        if not isinstance(group, int) or group <= 0 or group % (32 // w["num_bits"]):
            raise refuse(f"{where}.weights.group_size {group!r} is not a positive multiple of "
                         f"{32 // w['num_bits']}")
    else:
        raise refuse(f"{desc}: strategy '{strategy}' is not supported (channel or group)")
    a = g.get("input_activations")
    if a:
        if not isinstance(a, dict) or (a.get("type", "int"), a.get("num_bits"), a.get("strategy"),
                                        a.get("dynamic"), a.get("symmetric", True)) != ("int", 8, "token", True, True):
            raise refuse(f"{where}.input_activations {a} is not supported (int8, per token, dynamic, symmetric)")
        if w["num_bits"] != 8 or group:
            raise refuse(f"{where}: int8 inputs with int{w['num_bits']} weights per "
                         f"{'group' if group else 'channel'} are not supported (W8A8 is per channel)")
    return Scheme(bits=w["num_bits"], group_size=group, act_int8=bool(a), targets=tuple(targets))


# ---- ModelSlim ---------------------------------------------------------------------------------------

MODELSLIM_FILE = "quant_model_description.json"
MODELSLIM_SCHEMES = {
    "W8A8": Scheme(bits=8, group_size=0, act_int8=True, static=True, modelslim="W8A8"),
    "W8A8_DYNAMIC": Scheme(bits=8, group_size=0, act_int8=True, act_divisor=127.0, modelslim="W8A8_DYNAMIC"),
}
MODELSLIM_KEYS = ("model_quant_type", "version", "group_size", "kv_quant_type", "kv_cache_type", "fa_quant_type",
                  "indexer_quant_type", "reduce_quant_type")


def parse_modelslim(d, source: str) -> Quantization:
    """A ModelSlim quant_model_description.json (already read) -> what each layer holds. Raises
    QuantizationError naming the tensor and type for anything but W8A8, W8A8_DYNAMIC and FLOAT."""
    def refuse(what: str) -> QuantizationError:
        return QuantizationError(f"{source}: {what}; msinfer reads ModelSlim's W8A8 and W8A8_DYNAMIC linear layers "
                                 f"(FLOAT for the rest)")
    if not isinstance(d, dict):
        raise refuse(f"is a {type(d).__name__}, not a mapping of tensor names to types")
    for key in ("kv_cache_type", "kv_quant_type", "fa_quant_type", "indexer_quant_type"):
        if d.get(key) not in (None, "FLOAT", "", "NONE"):
            raise refuse(f"{key} '{d.get(key)}': a quantized KV cache is not supported")
    described = []
    for name, kind in d.items():
        if name in MODELSLIM_KEYS or not isinstance(kind, str):
            continue
        if "norm.bias" in name or name.endswith(".module.weight") or name.endswith(".module.bias"):
            raise refuse(f"'{name}': anti-outlier norm biases are not supported")
        if name.endswith(".weight") and kind != "FLOAT":
            if kind not in MODELSLIM_SCHEMES:
                raise refuse(f"'{name}' is {kind}")
            if name.startswith(("lm_head", "model.embed_tokens")):
                raise refuse(f"'{name}' is {kind}: msinfer reads ModelSlim's embedding and LM head as FLOAT only")
            if ".experts." in name and kind != "W8A8_DYNAMIC":
                raise refuse(f"'{name}' is {kind}: msinfer reads ModelSlim's experts as W8A8_DYNAMIC or FLOAT")
            described.append((name, kind))
    if not described:
        raise refuse("quantizes no layer")
    kinds = tuple(MODELSLIM_SCHEMES[k] for k in sorted({k for _, k in described}))
    return Quantization(packed=False, schemes=kinds, ignore=(), described=tuple(described))


# ---- the weights ------------------------------------------------------------------------------------

def unpack_int32(words: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """compressed-tensors' pack_to_int32 undone along the last dimension: value i of a row at bit
    i*bits of its little-endian int32 words, stored + 2^(bits-1). [..., W] -> int8 [..., cols]."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * bits
    u = (words.astype(np.int32).view(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    u = u.reshape(*words.shape[:-1], words.shape[-1] * per)[..., :cols]
    return (u.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)


class QuantizedWeight(_WeightView):
    """A quantized linear layer's weight as the parallel layers read a checkpoint tensor
    (sharding.layers.read_shard): get_shape() is the float weight's [out, in], and
    w[rows, cols] reads only that region's ints and scales and returns it dequantized, float32."""

    def __init__(self, name: str, scheme: Scheme, ints, scale, shape: tuple[int, int], packed: bool):
        self.name, self.scheme, self.ints, self.scale = name, scheme, ints, scale
        self.shape, self.packed = tuple(shape), packed
        out, cols = self.shape
        per = 32 // scheme.bits
        want_ints = (out, -(-cols // per)) if packed else (out, cols)
        got = source_shape(ints)
        if got != want_ints:
            raise QuantizationError(f"tensor '{name}' has shape {list(got)}; {scheme.name} weights of "
                                    f"[{out}, {cols}] {'pack into' if packed else 'are'} {list(want_ints)}")
        if packed and cols % per:
            raise QuantizationError(f"tensor '{name}': {cols} inputs do not pack into whole int32 words of "
                                    f"{per} int{scheme.bits} values")
        g = scheme.group_size
        if g and cols % g:
            raise QuantizationError(f"tensor '{name}': {cols} inputs are not a whole number of groups of {g}")
        want_scale = (out, cols // g) if g else (out, 1)
        if scheme.static and source_shape(scale) == (out,):          # ModelSlim's deq_scale
            scale = _Column(scale)
        self.scale = scale
        self.check_scale(name[:-len("weight")] + ("deq_scale" if scheme.static else "weight_scale"), want_scale,
                         f"{scheme.describe()} of [{out}, {cols}]")

    def __getitem__(self, index) -> np.ndarray:
        r0, r1, c0, c1 = self.region(index)
        per, g = 32 // self.scheme.bits, self.scheme.group_size
        if self.packed:
            if c0 % per or (c1 - c0) % per:
                raise QuantizationError(f"tensor '{self.name}': columns {c0}-{c1} split an int32 word of "
                                        f"{per} values")
            q = unpack_int32(np.asarray(self.ints[r0:r1, c0 // per:c1 // per]), self.scheme.bits, c1 - c0)
        else:
            q = np.asarray(self.ints[r0:r1, c0:c1])
        if g:
            if c0 % g or (c1 - c0) % g:
                raise QuantizationError(f"tensor '{self.name}': columns {c0}-{c1} split a group of {g}")
            s = np.asarray(self.scale[r0:r1, c0 // g:c1 // g]).astype(np.float32)
            return Dequantized.of(q.astype(np.float32) * np.repeat(s, g, axis=1), group_scales=s, levels=q)
        s = scale_values(np.asarray(self.scale[r0:r1, 0:1]))
        return Dequantized.of(q.astype(np.float32) * s, row_scales=s[:, 0], levels=q)


class Dequantized(np.ndarray):
    """A quantized weight's region, dequantized, that keeps its scales: `row_scales` [rows] (a
    scale per output channel) or `group_scales` [rows, groups] (a scale per group of inputs),
    and its `levels` (int8, the region's shape), the ints the checkpoint holds.
    sharding.layers.copy_into records them beside the parameter, for a device that multiplies
    the weights as the checkpoint holds them (worker.cpu.CpuOps.pack_int8, worker.ascend's
    quantized matmuls), which then need not find the levels again from the values. Only those
    given are set."""
    row_scales: np.ndarray
    group_scales: np.ndarray
    levels: np.ndarray

    @staticmethod
    def of(values: np.ndarray, row_scales: np.ndarray | None = None,
           group_scales: np.ndarray | None = None, levels: np.ndarray | None = None) -> "Dequantized":
        out = values.view(Dequantized)
        for name, value in (("row_scales", row_scales), ("group_scales", group_scales), ("levels", levels)):
            if value is not None:
                setattr(out, name, value)
        return out


def int8_levels(w: np.ndarray, scales: np.ndarray, levels: np.ndarray | None = None) -> np.ndarray | None:
    """A loaded weight [N, K] and each row's scale (Dequantized.row_scales) -> its int8 levels q
    with w == q * scales[:, None] exactly; None where a row has no scale (NaN: loaded from a float
    tensor), a scale is not positive, or w is not exactly that (an adapter merged into it): then the
    device keeps the float weight. `levels`: the levels the weight loaded as (`carried_levels`),
    returned as they are."""
    if np.isnan(scales).any() or not (scales > 0).all():
        return None
    if levels is not None:
        return levels
    q = np.rint(w.astype(np.float32) / scales[:, None])
    if q.min(initial=0) < -128 or q.max(initial=0) > 127:
        return None
    return q.astype(np.int8) if np.array_equal((q * scales[:, None]).astype(w.dtype), w) else None


def int4_levels(w: np.ndarray, group_scales: np.ndarray, levels: np.ndarray | None = None) -> np.ndarray | None:
    """A loaded weight [N, K] and its group scales [N, K / g] (Dequantized.group_scales) -> its
    int4 levels q in -8..7 (int8 [N, K]) with w == q * its group's scale exactly; None where
    int8_levels gives None, or a level is outside int4. `levels`: as int8_levels takes them."""
    groups = group_scales.shape[1] if group_scales.ndim == 2 else 0
    cols = (w if levels is None else levels).shape[1]
    if not groups or cols % groups or np.isnan(group_scales).any() or not (group_scales > 0).all():
        return None
    if levels is not None:
        return levels if levels.min(initial=0) >= -8 and levels.max(initial=0) <= 7 else None
    s = np.repeat(group_scales, w.shape[1] // groups, axis=1)
    q = np.rint(w.astype(np.float32) / s)
    if q.min(initial=0) < -8 or q.max(initial=0) > 7:
        return None
    return q.astype(np.int8) if np.array_equal((q * s).astype(w.dtype), w) else None


def scale_values(s: np.ndarray) -> np.ndarray:
    """Scales as float32: ModelSlim stores a float16 model's deq_scale as int64 whose low 32 bits
    are the float32's (what its fake quantizer and vllm-mindspore read back)."""
    if s.dtype == np.int64:
        return (s.astype(np.int64) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    return s.astype(np.float32)


class _Column:
    """A 1-D tensor [out] read as [out, 1]."""

    def __init__(self, src):
        self.src = src

    def get_shape(self):
        return (source_shape(self.src)[0], 1)

    def __getitem__(self, index):
        return np.asarray(self.src[index[0]])[:, None]


def source_shape(src) -> tuple[int, ...]:
    """Shape of a checkpoint tensor: a safetensors slice (`get_shape`), a stand-in for one, or a
    numpy array."""
    return tuple(src.get_shape()) if hasattr(src, "get_shape") else tuple(src.shape)
