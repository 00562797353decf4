"""The start-up kernel self-check of the Ascend path: before a rank loads its weights, it runs each
fused kernel the job uses on small random inputs of the job's own shapes (heads and KV heads per
rank, head_dim, block_size, dtype), compiled as the network's steps are (the seam's jit options,
a phase per step kind, inputs named `batch_valid_length` and `q_seq_lens`), and compares the
outputs with a float64 reference in numpy. Where a source is ambiguous (ASCEND.md), the card
answers:

    case      kernels                          conventions tried, in order
    prefill   ReshapeAndCache, FlashAttention  per-sequence lengths (vllm-mindspore), cumulative
                                               ends (ACLNN's TND docstring), else portable
    chunk     PagedAttention with q_seq_lens   the kernel (q_seq_lens and the causal mask of a chunk
              after cached tokens              after cached tokens), else portable
    decode    PagedAttention                   the kernel, else portable
    norm      RmsNorm                          the kernel, else portable

DeepSeek's latent attention (`values` > 0: one KV head of the cache width, whose first `values`
are the values) runs no FlashAttention; its chunk and decode cases check PagedAttention's MLA
mode (mla_v_dim) and ReshapeAndCache with one cache, the way worker.ascend.AscendLatentAttention
calls them.

A quantized checkpoint's int8 layers (`quant`, `quant_cases`) add, at [hidden, hidden]:

    case      kernels                          conventions tried, in order
    weight    WeightQuantBatchMatmul           the kernel, else portable
    dynamic   QuantBatchMatmul after the       QuantBatchMatmul's scales as worker.ascend.
              per-token levels (DynamicQuant-  AscendInt8Linear passes them (int64 float32 bits
              Ext for ModelSlim's arithmetic)  for a static layer's float16 outputs), then float32
    static    QuantBatchMatmul after QuantV2   scales throughout, else portable
    experts   GroupedMatmulV4's antiquant      the kernel, else portable
              form (weight-only int8 experts,
              worker.ascend.AscendExperts)
    experts-  GroupedMatmulV4's per-token      the kernel, else portable
    dynamic   form (int8 experts, int8 inputs)
    experts-  GroupedMatmulV4's antiquant      column 2j in a byte's low nibble (as
    int4/g    form's groups of g (W4A16        WeightQuantBatchMatmul's), in the high one, else
              experts, two levels a byte)      portable
    weight-   WeightQuantBatchMatmul's int4    column 2j in a byte's low nibble (MindSpore's own
    int4/g    groups of g (W4A16, worker.      test of the kernel, golden-stick), in the high one,
              ascend.AscendInt4Linear)         else portable

A kernel's cases share its verdict: WeightQuantBatchMatmul's and GroupedMatmulV4's int8 cases
pass under either nibble order, and a W4A16 checkpoint's check runs at its own group size, which
the card may refuse (then its layers are held dequantized).

where "portable" keeps those layers' weights dequantized to the compute dtype (the float matmul;
for the experts, GroupedMatmulV4's float form, which this check does not cover).

A kernel that matches under no convention is replaced, in that operation only, by the portable
operators (worker/ops.py; AscendOps.with_conventions); PagedAttention must pass both its cases.
The verdicts are cached per (MindSpore version, CANN version, card model, device kind, shapes,
dtype) in $MSINFER_CACHE/kernel_check, so that later jobs on the same cards skip the check. The
card model is the name MindSpore's `hal.get_device_name` gives on a card (e.g. Ascend910B3): a
home folder shared by clusters of two card models with one CANN keeps a verdict per model. That
call has not run here (no card); the emulated path has no model and keys by its device kind.

TOLERANCE is the largest |output - reference| accepted, in units of the reference's largest
magnitude: the attention outputs are weighted means of unit-normal values, so a wrong convention
misses by O(1), and 16-bit rounding by about 1e-3.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2, "float32": 1e-4}
CONVENTIONS = {"FlashAttentionScore": ("ok", "cumulative"), "PagedAttention": ("ok",), "ReshapeAndCache": ("ok",),
               "RmsNorm": ("ok",), "QuantBatchMatmul": ("ok", "float32"),
               "WeightQuantBatchMatmul": ("ok", "high-first"),
               "GroupedMatmulV4": ("ok", "high-first")}
INT8_KERNELS = {"WeightQuantBatchMatmul": ("weight", "weight-int4"),
                "QuantBatchMatmul": ("dynamic", "dynamic-kernel", "static"),
                "GroupedMatmulV4": ("experts", "experts-dynamic", "experts-int4")}
# each case's sequences: (tokens cached, tokens new)
CASES = {"prefill": [(0, 5), (0, 3)], "chunk": [(6, 3), (4, 1)], "decode": [(7, 1), (4, 1), (2, 1)]}
CHECK_VERSION = 4              # of this module's cases: a change makes the cached verdicts stale


def cache_dir() -> Path:
    from msinfer.sharding.config import cache_root
    return cache_root() / "kernel_check"


def cann_version() -> str:
    """The CANN toolkit's version where its install names it (ASCEND_HOME_PATH), else ''."""
    home = os.environ.get("ASCEND_HOME_PATH")
    if not home:
        return ""
    for name in ("version.info", "version.cfg"):
        try:
            for line in (Path(home) / name).read_text().splitlines():
                if line.lower().startswith("version="):
                    return line.split("=", 1)[1].strip()
        except OSError:
            continue
    return ""


def card_model() -> str:
    """The card's model as MindSpore names it (`hal.get_device_name` of the device in use), '' off
    a card (the CPU, the emulated path) or where the driver does not say."""
    import mindspore as ms
    if ms.get_context("device_target") != "Ascend":
        return ""
    try:
        return str(ms.hal.get_device_name(ms.get_context("device_id"), "Ascend") or "")
    except Exception:                   # an old driver or CANN: the other fields still key the verdict
        return ""


def check_key(ops, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: str, values: int = 0,
              quant: tuple[str, ...] = ()) -> dict:
    import mindspore as ms
    from msinfer.worker import ascend
    variants = ascend.VARIANTS_IN_FORCE if ops.kernels is ascend.StandIns else ()
    device = ops.name + (f" [{','.join(variants)}]" if variants else "")
    return {"mindspore": ms.__version__, "cann": cann_version(), "card": card_model(), "device": device,
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size, "dtype": dtype,
            "check": CHECK_VERSION, **({"latent_values": values} if values else {}),
            **({"quant": list(quant)} if quant else {})}


def cached_check(ops, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: str, values: int = 0,
                 quant: tuple[str, ...] = ()) -> dict:
    """`check_kernels`' verdicts, from the cache when this key was checked before (`cached`: True)."""
    key = check_key(ops, heads, kv_heads, head_dim, block_size, dtype, values, quant)
    try:
        found = json.loads(cache_path(key).read_text())
        if found.get("key") == key:
            return {**found["results"], "cached": True}
    except (OSError, ValueError, AttributeError, KeyError):
        pass
    results = check_kernels(ops, heads, kv_heads, head_dim, block_size, dtype, values, quant)
    store(key, results)
    return {**results, "cached": False}


def cache_path(key: dict) -> Path:
    return cache_dir() / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")


def store(key: dict, results: dict) -> None:
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "results": results}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass                        # a read-only cache: the next job checks again


def conventions(results: dict) -> dict[str, str]:
    """Each kernel's convention from `check_kernels`' results."""
    return {k: v["convention"] for k, v in results.items() if isinstance(v, dict) and "convention" in v}


def describe(results: dict) -> str:
    """One line: every kernel's convention, as the job's log and `msinfer check-device` say it."""
    parts = [f"{k} {v['convention']} (max error {v['max_error']:.1e})" for k, v in results.items()
             if isinstance(v, dict)]
    return "kernel check" + (" (cached)" if results.get("cached") else "") + ": " + ", ".join(parts)


def check_kernels(ops, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: str, values: int = 0,
                  quant: tuple[str, ...] = ()) -> dict:
    """{kernel: {"convention", "max_error", "seconds", "cases"}} for the seam `ops` (AscendOps or
    EmulatedAscendOps) at this rank's shapes (module docstring); values > 0: latent attention's;
    quant: the int8 cases of a quantized checkpoint (`quant_cases`)."""
    out = _attention_kernels(ops, heads, kv_heads, head_dim, block_size, dtype, values)
    if quant:
        out.update(check_quant(ops, heads * head_dim, dtype, quant))
    return out


def _attention_kernels(ops, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: str,
                       values: int) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    t0 = time.perf_counter()
    if values:
        errors = _attention_errors(ops, {}, ["chunk", "decode"], heads, 1, head_dim, block_size, dtype, rng, values)
        worst = max(errors.values())
        out["PagedAttention"] = _verdict("ok" if worst <= TOLERANCE[dtype] else "portable", worst, t0, list(errors))
        t0 = time.perf_counter()
        error = _cache_error(ops, heads, 1, head_dim, block_size, dtype, rng, values)
        out["ReshapeAndCache"] = _verdict("ok" if error <= TOLERANCE[dtype] else "portable", error, t0, ["decode"])
        t0 = time.perf_counter()
        error = _norm_error(ops, heads * head_dim, dtype, rng)
        out["RmsNorm"] = _verdict("ok" if error <= TOLERANCE[dtype] else "portable", error, t0, ["norm"])
        return out
    for convention in CONVENTIONS["FlashAttentionScore"]:
        errors = _attention_errors(ops, {"FlashAttentionScore": convention}, ["prefill"], heads, kv_heads, head_dim,
                                   block_size, dtype, rng)
        if max(errors.values()) <= TOLERANCE[dtype]:
            break
    else:
        convention = "portable"
    out["FlashAttentionScore"] = _verdict(convention, errors["prefill"], t0, ["prefill"])
    t0 = time.perf_counter()
    errors = _attention_errors(ops, {"FlashAttentionScore": "portable"}, ["chunk", "decode"], heads, kv_heads,
                               head_dim, block_size, dtype, rng)
    worst = max(errors.values())
    out["PagedAttention"] = _verdict("ok" if worst <= TOLERANCE[dtype] else "portable", worst, t0, list(errors))
    t0 = time.perf_counter()
    error = _cache_error(ops, heads, kv_heads, head_dim, block_size, dtype, rng)
    out["ReshapeAndCache"] = _verdict("ok" if error <= TOLERANCE[dtype] else "portable", error, t0, ["prefill"])
    t0 = time.perf_counter()
    error = _norm_error(ops, heads * head_dim, dtype, rng)
    out["RmsNorm"] = _verdict("ok" if error <= TOLERANCE[dtype] else "portable", error, t0, ["norm"])
    return out


def int8_held(results: dict) -> tuple[bool, bool]:
    """Whether the check's verdicts keep a quantized checkpoint's int8 weights int8, (in its
    linear layers: no int8 matmul found wanting; in its experts)."""
    def held(*kernels):
        return all(results.get(k, {}).get("convention") != "portable" for k in kernels)
    return held("QuantBatchMatmul", "WeightQuantBatchMatmul"), held("GroupedMatmulV4")


def int8_usable(ec, tp_size: int) -> tuple[bool, bool] | None:
    """Before the weights load, for the card plan: whether these cards keep a quantized
    checkpoint's int8 weights int8, as int8_held says (the check's int8 verdicts, from the cache or
    run now and cached for the load's own check), for EngineConfig `ec` at rank 0's shapes. None:
    a float checkpoint, no int8 layers, or no check."""
    from msinfer.sharding.config import ModelConfig, resolve_dtype
    from msinfer.worker import ascend
    from msinfer.worker.device import select_ops
    cfg = ModelConfig.from_dir(ec.model_dir)
    if not ec.kernel_check or cfg.quant is None or not quant_cases(cfg):
        return None
    if ec.emulate:
        ascend.set_variants(ec.emulate_variants)
    ops = select_ops(ec.device, ec.ops, emulate=ec.emulate)
    if not hasattr(ops, "with_conventions"):
        return None
    dtype = resolve_dtype(ec.dtype, cfg, ec.device, ec.emulate, ec.ops)
    return int8_held(cached_check(ops, *check_shapes(cfg, tp_size, ec.block_size, dtype)))


def quant_cases(cfg) -> tuple[str, ...]:
    """The int8 matmul cases (module docstring) the layers of a quantized checkpoint run on the
    Ascend path (the linear layers' from the schemes they have, the experts' from theirs):
    "weight", "dynamic" (compressed-tensors' per-token arithmetic), "dynamic-kernel" (ModelSlim's,
    through DynamicQuantExt), "static", "weight-int4/g" (int4 groups of g), "experts" (weight-only
    int8 experts), "experts-dynamic" (int8 experts with int8 inputs per token), "experts-int4/g"
    (int4 experts in groups of g); () for a float one."""
    if cfg.quant is None:
        return ()
    from msinfer.sharding.layout import plan_tensors
    layers = {cfg.quant.scheme_for(p.name[:-len(".weight")]) for p in plan_tensors(cfg, 1)     # (not experts')
              if p.name.endswith(".weight") and ".experts." not in p.name} - {None}
    kinds = {s.int8_kind + ("-kernel" if s.int8_kind == "dynamic" and s.modelslim else "")
             for s in layers if s.int8_kind}
    kinds.update(f"weight-int4/{s.group_size}" for s in layers if s.int4_groups)
    if cfg.expert_scheme is not None and cfg.expert_scheme.int8_kind == "weight":
        kinds.add("experts")
    elif cfg.expert_scheme is not None and cfg.expert_scheme.int8_kind == "dynamic" and cfg.expert_inputs("down_proj"):
        kinds.add("experts-dynamic")
    elif cfg.expert_scheme is not None and cfg.expert_scheme.int4_groups:
        kinds.add(f"experts-int4/{cfg.expert_scheme.group_size}")
    return tuple(sorted(kinds))


def check_quant(ops, hidden: int, dtype: str, cases: tuple[str, ...]) -> dict:
    """The verdicts of the int8 matmuls (module docstring): for each kernel, the first convention
    under which every case of it matches its reference."""
    rng = np.random.default_rng(1)
    out = {}
    for kernel, theirs in INT8_KERNELS.items():
        mine = [c for c in cases if c.split("/")[0] in theirs]
        if not mine:
            continue
        t0 = time.perf_counter()
        for convention in CONVENTIONS[kernel]:
            worst = max(_int8_error(ops.with_conventions({kernel: convention}), case, hidden, dtype, rng)
                        for case in mine)
            if worst <= TOLERANCE[dtype]:
                break
        else:
            convention = "portable"
        out[kernel] = _verdict(convention, worst, t0, mine)
    return out


def _int8_error(seam, case: str, hidden: int, dtype: str, rng) -> float:
    """One int8 case: x [5, hidden] times int8 weights [hidden, hidden] with a scale per row, through
    the seam's int8 matmul as a quantized layer calls it, against the documented arithmetic in
    float64 (inputs quantized as the case's scheme says)."""
    import mindspore as ms
    from mindspore import Tensor
    from msinfer.sharding.layers import input_quantizer
    from msinfer.sharding.quant import MODELSLIM_SCHEMES, Scheme
    mdt = getattr(ms, dtype)
    if case in ("experts", "experts-dynamic"):
        return _experts_error(seam, hidden, mdt, rng, case == "experts-dynamic")
    if case.startswith("weight-int4/"):
        return _int4_error(seam, int(case.split("/")[1]), hidden, mdt, rng)
    if case.startswith("experts-int4/"):
        return _experts_int4_error(seam, int(case.split("/")[1]), hidden, mdt, rng)
    scheme = {"weight": Scheme(8, 0, False), "dynamic": Scheme(8, 0, True),
              "dynamic-kernel": MODELSLIM_SCHEMES["W8A8_DYNAMIC"], "static": MODELSLIM_SCHEMES["W8A8"]}[case]
    quantizer = input_quantizer(scheme, "check") if scheme.act_int8 else None
    matmul = seam.int8_linear(scheme, quantizer, mdt)
    if matmul is None:
        return float("inf")
    x = _numpy(Tensor(rng.standard_normal((5, hidden)), mdt))          # as the device holds it
    levels = rng.integers(-127, 128, (hidden, hidden)).astype(np.int8)
    scales = rng.uniform(0.5, 1.5, hidden) / (127 * np.sqrt(hidden))
    if case == "static":
        scale, offset = 0.02, 3.0
        quantizer.scale.set_data(Tensor(np.array([scale], np.float32)))
        quantizer.offset.set_data(Tensor(np.array([offset], np.float32)))
        inputs = np.clip(_half_away(x / scale + offset), -128, 127)
    elif case != "weight":
        s = np.abs(x).max(-1, keepdims=True) / scheme.act_divisor
        inputs = np.clip(_half_away(x / s) if scheme.modelslim else np.rint(x / s), -128, 127) * s
    else:
        inputs = x
    want = inputs @ (levels.astype(np.float64) * scales[:, None]).T
    try:
        got = _numpy(ms.jit(matmul.construct, **seam.jit_options)(Tensor(x, mdt), Tensor(matmul.pack(levels)[0]),
                                                                  matmul.scales(scales.astype(np.float32))))
    except (RuntimeError, ValueError, TypeError):
        return float("inf")
    return _error(got, want)


def _int4_error(seam, group: int, hidden: int, mdt, rng) -> float:
    """The int4 case: x [5, hidden] times int4 levels [hidden, hidden] with a scale per group of
    `group` inputs (hidden rounded up to whole groups), through the seam's matmul as a W4A16 layer
    calls it, against the dequantized product in float64."""
    import mindspore as ms
    from mindspore import Tensor
    from msinfer.sharding.quant import Scheme
    K = -(-hidden // group) * group
    matmul = seam.int8_linear(Scheme(4, group, False), None, mdt)
    if matmul is None:
        return float("inf")
    x = _numpy(Tensor(rng.standard_normal((5, K)), mdt))
    levels = rng.integers(-8, 8, (hidden, K)).astype(np.int8)
    scales = (rng.uniform(0.5, 1.5, (hidden, K // group)) / (8 * np.sqrt(K))).astype(np.float32)
    held = _numpy(matmul.scales(scales)).astype(np.float64).T          # as the kernel holds them
    want = x.astype(np.float64) @ (levels * np.repeat(held, group, axis=1)).T
    try:
        got = _numpy(ms.jit(matmul.construct, **seam.jit_options)(
            Tensor(x, mdt), Tensor(matmul.pack(levels)[0], matmul.weight_dtype), matmul.scales(scales)))
    except (RuntimeError, ValueError, TypeError):
        return float("inf")
    return _error(got, want)


# The experts cases' rows per expert: an expert with none between two with some.
EXPERT_ROWS = np.array([3, 0, 4], np.int64)


def _experts_error(seam, hidden: int, mdt, rng, per_token: bool = False) -> float:
    """The experts cases: 7 rows grouped 3, 0 and 4 over 3 experts' int8 weights [3, hidden,
    hidden] (the kernel's [in, out]) with a scale per output, through the grouped matmul as
    worker.ascend.AscendExperts calls it (_grouped_error). Weight-only: float rows (the antiquant
    form); per_token: int8 rows with a scale each (the per-token form, the weights' scale float32
    for a float16 output, bfloat16 for bfloat16)."""
    import mindspore as ms
    from mindspore import Tensor
    from msinfer.sharding.quant import Scheme
    if not seam.int8_experts(Scheme(8, 0, per_token)):
        return float("inf")
    rows = int(EXPERT_ROWS.sum())
    levels = rng.integers(-127, 128, (len(EXPERT_ROWS), hidden, hidden)).astype(np.int8)
    scales = (rng.uniform(0.5, 1.5, (len(EXPERT_ROWS), hidden)) / (127 * np.sqrt(hidden))).astype(np.float32)
    tokens = None
    if per_token:
        x = rng.integers(-127, 128, (rows + 2, hidden)).astype(np.int8)
        tokens = rng.uniform(0.5, 1.5, rows + 2).astype(np.float32) / 127
        sdt = ms.bfloat16 if mdt == ms.bfloat16 else ms.float32
        extra = (Tensor(scales, sdt), Tensor(tokens))
        scales = _numpy(extra[0]).astype(np.float32)                   # as the kernel holds them
    else:
        x = _numpy(Tensor(rng.standard_normal((rows + 2, hidden)), mdt))
        extra = (Tensor(scales, mdt),)
    weights = levels.astype(np.float64) * scales[:, None, :]
    return _grouped_error(seam, x, weights, (Tensor(x, ms.int8 if per_token else mdt), Tensor(levels),
                                             Tensor(EXPERT_ROWS), *extra), tokens)


def _experts_int4_error(seam, group: int, hidden: int, mdt, rng) -> float:
    """The int4 experts case: 7 rows grouped 3, 0 and 4 over 3 experts' int4 levels [hidden, K]
    ([out, in]; K: hidden rounded up to whole groups) with a scale per group of `group` inputs,
    packed and scaled as worker.ascend.AscendExperts holds them, through its grouped matmul's
    antiquant form (_grouped_error)."""
    import mindspore as ms
    from mindspore import Tensor
    from msinfer.sharding.quant import Scheme
    if seam.int8_experts(Scheme(4, group, False)) != "int4":
        return float("inf")
    K = -(-hidden // group) * group
    rows = int(EXPERT_ROWS.sum())
    levels = rng.integers(-8, 8, (len(EXPERT_ROWS), hidden, K)).astype(np.int8)
    scales = (rng.uniform(0.5, 1.5, (len(EXPERT_ROWS), hidden, K // group)) / (8 * np.sqrt(K))).astype(np.float32)
    packed = seam.pack_experts(levels, False, scales)
    if packed is None:
        return float("inf")
    held = Tensor(seam.expert_scales(scales), mdt)
    weights = np.repeat(_numpy(held).astype(np.float64), group, axis=1) * levels.swapaxes(1, 2)     # [E, in, out]
    x = _numpy(Tensor(rng.standard_normal((rows + 2, K)), mdt))
    return _grouped_error(seam, x, weights, (Tensor(x, mdt), Tensor(packed[0], seam.int4_dtype),
                                             Tensor(EXPERT_ROWS), held))


def _grouped_error(seam, x: np.ndarray, weights: np.ndarray, args: tuple, row_scales=None) -> float:
    """AscendExperts' grouped matmul (`seam.moe_op().matmul(*args)`, compiled as the steps are) on
    x's rows grouped EXPERT_ROWS over the experts, against each row times its expert's dequantized
    `weights` [E, in, out] (and its scale, `row_scales`) in float64. Two rows of x past the groups
    ride along (the kernel leaves their outputs unwritten: not compared)."""
    import mindspore as ms
    rows = int(EXPERT_ROWS.sum())
    want = np.zeros((rows, weights.shape[2]))
    for e, (end, n) in enumerate(zip(np.cumsum(EXPERT_ROWS), EXPERT_ROWS)):
        want[end - n:end] = x[end - n:end].astype(np.float64) @ weights[e]
    if row_scales is not None:
        want *= row_scales[:rows, None]
    try:
        got = _numpy(ms.jit(seam.moe_op().matmul, **seam.jit_options)(*args))
    except (RuntimeError, ValueError, TypeError):
        return float("inf")
    return _error(got[:rows], want)


def _half_away(y: np.ndarray) -> np.ndarray:
    return np.sign(y) * np.floor(np.abs(y) + 0.5)


def _verdict(convention: str, error: float, t0: float, cases: list[str]) -> dict:
    return {"convention": convention, "max_error": float(error), "seconds": round(time.perf_counter() - t0, 3),
            "cases": cases}


def _inputs(specs: list[tuple[int, int]], H: int, KV: int, D: int, bs: int, rng, values: int = 0) -> dict:
    """A step of sequences (cached, new) in the runner's input layout (worker.runner.ModelRunner.
    inputs), each on blocks of its own; the caches' cached positions filled; and per token the
    reference attention in float64. values > 0: each value is its key's first `values` (a latent)."""
    from msinfer.sharding.config import MASK_PENALTY
    B = len(specs)
    width = max(-(-(c + n) // bs) for c, n in specs)
    blocks = B * width + 1
    k_cache = np.zeros((blocks, bs, KV, D))
    v_cache = np.zeros((blocks, bs, KV, values or D))
    tables = np.arange(B * width, dtype=np.int32).reshape(B, width)
    rows = {"q": [], "k": [], "v": [], "slot": [], "seq": [], "pos": []}
    reference = []
    for b, (cached, new) in enumerate(specs):
        K = rng.standard_normal((cached + new, KV, D))
        V = K[:, :, :values] if values else rng.standard_normal((cached + new, KV, D))
        Q = rng.standard_normal((new, H, D))
        for p in range(cached):
            k_cache[tables[b, p // bs], p % bs] = K[p]
            v_cache[tables[b, p // bs], p % bs] = V[p]
        for j in range(new):
            p = cached + j
            rows["q"].append(Q[j])
            rows["k"].append(K[p])
            rows["v"].append(V[p])
            rows["slot"].append(tables[b, p // bs] * bs + p % bs)
            rows["seq"].append(b)
            rows["pos"].append(p)
            g = H // KV
            scores = np.einsum("hd,lhd->hl", Q[j], np.repeat(K[: p + 1], g, axis=1)) * D ** -0.5
            w = np.exp(scores - scores.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            reference.append(np.einsum("hl,lhd->hd", w, np.repeat(V[: p + 1], g, axis=1)).reshape(-1))
    T = len(rows["q"])
    pos = np.array(rows["pos"])
    n = np.array([new for _, new in specs])
    paged = any(c for c, _ in specs)
    if paged and n.max() > 1:
        mask = np.where(np.arange(width * bs)[None, :] > pos[:, None], MASK_PENALTY, 0.0)
    else:
        mask = np.zeros((1, 1))
    return {"q": np.array(rows["q"]).reshape(T, -1), "k": np.array(rows["k"]).reshape(T, -1),
            "v": np.array(rows["v"]).reshape(T, -1), "slot_mapping": np.array(rows["slot"], np.int32),
            "block_tables": tables, "batch_valid_length": np.array([c + n for c, n in specs], np.int32),
            "q_seq_lens": n.astype(np.int32), "token_seq": np.array(rows["seq"], np.int32),
            "token_len": (pos + 1).astype(np.int32), "attn_mask": mask, "k_cache": k_cache, "v_cache": v_cache,
            "prefill": not paged, "reference": np.array(reference), "written": (np.array(rows["slot"]),
                                                                              np.array(rows["k"]))}


def _run_case(ops, conventions: dict, x: dict, H: int, KV: int, D: int, bs: int, dtype: str, phase: str,
              values: int = 0):
    """The attention of one case through the seam, compiled as a step: (output [T, H * D] (latent:
    [T, H * values]), the key cache after the step), in numpy float64."""
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops as P

    mdt = getattr(ms, dtype)
    seam = ops.with_conventions(conventions)

    class Case(nn.Cell):
        def __init__(self):
            super().__init__()
            if values:
                self.latent = seam.latent_attention(H, D, values, bs, mdt, D ** -0.5)
            else:
                self.attention = seam.attention(H, KV, D, bs, mdt)
            self.k_cache = Parameter(Tensor(x["k_cache"], mdt), name="k_cache")
            self.v_cache = Parameter(Tensor(x["v_cache"], mdt), name="v_cache")
            self.prefill = bool(x["prefill"])

        def step(self, q, k, v, slot_mapping, block_tables, batch_valid_length, q_seq_lens, token_seq, token_len,
                 attn_mask):
            ctx = (slot_mapping, block_tables, batch_valid_length, q_seq_lens, token_seq, token_len, attn_mask)
            if values:           # as worker.model.MLAttention: the latents written, then read
                q = P.depend(q.reshape(q.shape[0], H, D), self.latent.write(k, self.k_cache, slot_mapping))
                return self.latent.attend(q, self.k_cache, ctx).reshape(q.shape[0], -1)
            return self.attention(q, k, v, self.k_cache, self.v_cache, ctx, self.prefill)

    case = Case()
    case.set_train(False)
    if ops.phases:
        case.phase = phase
    fn = ms.jit(case.step, **ops.jit_options)
    i32 = ms.int32
    out = fn(Tensor(x["q"], mdt), Tensor(x["k"], mdt), Tensor(x["v"], mdt), Tensor(x["slot_mapping"], i32),
             Tensor(x["block_tables"], i32), Tensor(x["batch_valid_length"], i32), Tensor(x["q_seq_lens"], i32),
             Tensor(x["token_seq"], i32), Tensor(x["token_len"], i32), Tensor(x["attn_mask"], mdt))
    return _numpy(out), _numpy(case.k_cache.value())


def _numpy(t) -> np.ndarray:
    import mindspore as ms
    return t.astype(ms.float32).asnumpy().astype(np.float64)


def _error(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape or not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def _attention_errors(ops, conventions: dict, cases: list[str], H, KV, D, bs, dtype, rng,
                      values: int = 0) -> dict[str, float]:
    errors = {}
    for name in cases:
        x = _inputs(CASES[name], H, KV, D, bs, rng, values)
        try:
            got, _ = _run_case(ops, conventions, x, H, KV, D, bs, dtype, "prefill" if x["prefill"] else "increment",
                               values)
            errors[name] = _error(got, x["reference"])
        except (RuntimeError, ValueError, TypeError):       # a kernel the card refuses: not this way
            errors[name] = float("inf")
    return errors


def _cache_error(ops, H, KV, D, bs, dtype, rng, values: int = 0) -> float:
    """ReshapeAndCache: after a prefill step (latent: a decode step), the key cache holds each new
    key at its slot."""
    x = _inputs(CASES["decode" if values else "prefill"], H, KV, D, bs, rng, values)
    try:
        conventions = {"PagedAttention": "portable"} if values else {"FlashAttentionScore": "portable"}
        _, cache = _run_case(ops, conventions, x, H, KV, D, bs, dtype, "increment" if values else "prefill", values)
    except (RuntimeError, ValueError, TypeError):
        return float("inf")
    slots, keys = x["written"]
    got = cache.reshape(-1, KV, D)[slots]
    return _error(got, keys.reshape(len(slots), KV, D))


def _norm_error(ops, hidden: int, dtype: str, rng) -> float:
    """RmsNorm of a few random rows against x / sqrt(mean(x^2) + eps) * gamma."""
    import mindspore as ms
    from mindspore import Tensor
    eps = 1e-6
    x = rng.standard_normal((4, hidden))
    gamma = rng.uniform(0.5, 1.5, hidden)
    want = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * gamma
    mdt = getattr(ms, dtype)
    norm = ops.with_conventions({}).rms_norm_op(eps)
    try:
        got = _numpy(ms.jit(norm.construct, **ops.jit_options)(Tensor(x, mdt), Tensor(gamma, mdt)))
    except (RuntimeError, ValueError, TypeError):
        return float("inf")
    return _error(got, want)


def check_device(ec, cfg, tp_size: int) -> tuple[dict, str]:
    """`msinfer check-device`: the check at rank 0's shapes of a job (EngineConfig `ec`, model
    `cfg`, tensor parallel `tp_size`), run afresh in this process, its verdicts cached for later
    jobs; returns the results and their table."""
    import mindspore as ms
    from msinfer.worker import ascend
    from msinfer.worker.device import select_ops
    ms.set_device("CPU" if ec.emulate else "Ascend")
    ascend.set_variants(ec.emulate_variants if ec.emulate else ())
    ops = select_ops(ec.device, ec.ops, emulate=ec.emulate)
    shapes = check_shapes(cfg, tp_size, ec.block_size, ec.dtype)
    results = check_kernels(ops, *shapes)
    store(check_key(ops, *shapes), results)
    rows = [("kernel", "convention", "max error", "seconds", "cases")]
    rows += [(k, v["convention"], f"{v['max_error']:.2e}", f"{v['seconds']:.2f}", ", ".join(v["cases"]))
             for k, v in results.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    H, KV, D, bs, dtype, values, quant = shapes
    head = (f"{ops.name}: {H} heads, {KV} KV heads, head_dim {D}"
            + (f" (latent attention: values the first {values})" if values else "")
            + f", block_size {bs}, {dtype}" + (f", int8 matmuls {', '.join(quant)}" if quant else "")
            + f" (rank 0 of tp {tp_size}); tolerance {TOLERANCE[dtype]:g} of the reference's largest magnitude")
    return results, head + "\n" + table


def check_shapes(cfg, tp_size: int, block_size: int, dtype: str) -> tuple:
    """(heads, KV heads, head_dim, block_size, dtype, values, int8 cases) of rank 0 as its kernels
    see them; latent attention: one KV head of the cache width, values its kv_lora_rank."""
    from msinfer.sharding.layout import TPInfo, kv_head_range
    if cfg.mla is not None:
        return (cfg.num_heads // tp_size, 1, cfg.mla.cache_width, block_size, dtype, cfg.mla.kv_lora_rank,
                quant_cases(cfg))
    lo, hi = kv_head_range(cfg, TPInfo(0, tp_size))
    return cfg.num_heads // tp_size, hi - lo, cfg.head_dim, block_size, dtype, 0, quant_cases(cfg)
