"""Tensor-parallel layers in MindSpore. Each layer knows which dimension it splits and slices the
checkpoint tensors it owns itself (`weight_loader`), reading only its rows or columns from disk.

Activations are 2-D, [tokens, features]. Weights keep the Hugging Face shape [out, in] and are
multiplied with `transpose_b`, so a checkpoint slice is copied into a parameter as it is. A device
may bring its own matmul (`linear`, a primitive (x, w) -> x w^T) and embedding lookup (`lookup`,
(w, local ids) -> rows, zeros for ids outside the shard) that read the weights in its own element
order, which it sets once every weight is loaded (`CausalLM.pack_weights`).
Collectives run on the world group of the rank's communication cluster: one cluster per
tensor-parallel group, so the world group *is* the tensor-parallel group.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common import dtype as mstype
from mindspore.common.initializer import initializer

from msinfer.sharding.config import ModelConfig
from msinfer.sharding.layout import TPInfo, kv_head_range, vocab_shard
from msinfer.sharding.quant import Dequantized, source_shape


# What a step graph compiles. The graphs have dynamic shapes, and MindSpore compiles the Python of
# a functional op or a slice into each graph that calls it: a shape tuple holding a dynamic dimension
# goes through its argument handler (a loop, ~10 subgraphs a call), a slice through tensor indexing
# (~12), ops.full_like and ops.softmax through their checks. So the step graphs reshape and broadcast
# to constant shapes (-1 for the dynamic dimension; mint.flatten to merge two), and call primitives
# for softmax, top k, halves and masks: the tests' 2-layer Llama's portable prefill graph compiles in
# about 1.1 s instead of 1.3 and its emulated Ascend one in 1.1 instead of 1.6 (Zen 3,
# docs/benchmarks.md).
HALVES = ops.Split(-1, 2)           # x [..., 2D] -> its halves [..., D]
SPLIT = ops.auto_generate.SplitWithSize()    # (x, sizes, axis) -> its parts along axis
SOFTMAX = ops.Softmax(-1)           # over the last axis
TOPK = ops.TopK(sorted=True)        # (x, k) -> the k largest of the last axis and their indices, largest first
LAST = ops.Squeeze(-1)              # x [..., 1] -> [...]
ROW_MAX = ops.ReduceMax(keep_dims=True)     # (x, axis) -> its max along axis, kept as 1
MAX = ops.ReduceMax()               # (x, axis) -> its max along axis


class ShapeMismatch(ValueError):
    """A checkpoint tensor whose shape is not the one the config implies."""


def read_shard(src, dim: int | None, start: int = 0, size: int | None = None) -> np.ndarray:
    """Read rows/columns [start, start+size) of `dim` (None: all of it). Only that part leaves the disk.
    The array is new, the caller's to give up (copy_into's `owned`): a checkpoint slice reads
    into one, and a numpy array given as the source (tests, zeros standing in) is copied."""
    shape = source_shape(src)
    index = [slice(None)] * len(shape)
    if dim is not None:
        index[dim] = slice(start, start + size)
    part = src[tuple(index)]                      # (a quantized weight's region keeps its row scales)
    return part.copy() if isinstance(src, np.ndarray) else np.asanyarray(part)


def check_shape(name: str, src, expected: tuple[int, ...]) -> None:
    got = source_shape(src)
    if got != tuple(expected):
        raise ShapeMismatch(f"tensor '{name}' has shape {list(got)}, the config implies {list(expected)}")


def record_scales(holder, data, at, rows_shape: tuple) -> None:
    """A quantized region's scales (sharding.quant.Dequantized: `row_scales`, a scale per row, or
    `group_scales`, per row and group of inputs) kept in `holder`'s attributes of the same names
    at `at`: arrays of `rows_shape` rows, made when the first comes, NaN for rows loaded from
    anything else (or with other groups than the first's). Its `levels` likewise, in an int8
    array of the holder's shape, with `levels_known` (rows_shape) saying which rows they fill."""
    for attr in ("row_scales", "group_scales"):
        scales = getattr(data, attr, None)
        kept = getattr(holder, attr, None)
        if scales is None and kept is None:
            continue
        if kept is None:
            kept = np.full((*rows_shape, *scales.shape[1:]), np.nan, np.float32)
            setattr(holder, attr, kept)
        kept[at] = np.nan if scales is None or scales.shape[1:] != kept.shape[len(rows_shape):] else scales
    levels, known = getattr(data, "levels", None), getattr(data, "levels_known", None)
    if levels is None and getattr(holder, "levels", None) is None:
        return
    if getattr(holder, "levels", None) is None:      # (known over the rows of a gathered buffer's)
        holder.levels = np.zeros(tuple(holder.shape), np.int8)
        holder.levels_known = np.zeros(rows_shape if known is None else known.shape, bool)
    if levels is not None:
        holder.levels[at] = levels
    holder.levels_known[at] = levels is not None if known is None else known


def carried_levels(holder) -> np.ndarray | None:
    """The int levels a parameter loaded as (`record_scales`), where every row of it loaded from
    the checkpoint's ints; else None (then they are found from the values: sharding.quant)."""
    known = getattr(holder, "levels_known", None)
    return holder.levels if known is not None and known.all() else None


def copy_into(param: Parameter, data: np.ndarray, owned: bool = False) -> None:
    """Copy host data, the whole of a parameter, into it, converting to the parameter's dtype (a
    region of it: `gather_part`). owned: the caller gives `data` up, so a parameter of float32 or
    float16 holds it without a copy (Tensor.from_numpy; a float32 buffer into a float16 parameter
    is converted). Quantized weights (sharding.quant.Dequantized) leave their scales on the
    parameter (`record_scales`)."""
    record_scales(param, data, slice(None), param.shape[:1])
    if owned and param.dtype in (mstype.float32, mstype.float16):
        value = np.ascontiguousarray(data, np.float32 if param.dtype == mstype.float32 else np.float16)
        param.set_data(Tensor.from_numpy(value))
        return
    param.set_data(Tensor(np.ascontiguousarray(data), dtype=param.dtype))


def gather_part(host: dict, param: Parameter, data: np.ndarray, at, parts: int, rows_dims: int = 1) -> bool:
    """Region `at` of `param` from `data`, gathered on the host and copied into the parameter once,
    when the last of its `parts` regions is in (True then). `host`: the layer's parameters in
    progress, by name. A part written into the parameter itself would copy the whole parameter
    again: the q, k and v of a merged projection three times, gate and up twice, and the many
    experts of a sparse layer once each. The buffer is float32 (the loader's
    values, converted once to the parameter's dtype), and a quantized part's scales ride on it to
    the parameter (`record_scales`; `rows_dims`: the leading dimensions they are kept over)."""
    entry = host.get(param.name)
    if entry is None:
        entry = host[param.name] = [np.zeros(param.shape, np.float32).view(Dequantized), 0]
    buf = entry[0]
    buf[at] = data
    record_scales(buf, data, at, param.shape[:rows_dims])
    entry[1] += 1
    if entry[1] < parts:
        return False
    copy_into(param, host.pop(param.name)[0], owned=True)
    return True


def new_param(shape, dtype, name: str) -> Parameter:
    """A zero parameter whose memory is not touched until written (`initializer` allocates zero
    pages): the KV cache of a long max_model_len costs no time or resident memory for what no
    sequence reaches, and weights are written once, by the loader."""
    return Parameter(initializer("zeros", shape, dtype), name=name, requires_grad=False)


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15          # (Linux's asm-generic/mman-common.h)


def advise_pages(held: np.ndarray, advice: int, page: int) -> bool:
    """madvise(advice) over the `page`-aligned interior of `held`'s memory: whether it was taken
    (False off Linux, and for memory that holds no aligned page)."""
    lo = -(-held.ctypes.data // page) * page
    hi = (held.ctypes.data + held.nbytes) // page * page
    if not sys.platform.startswith("linux") or hi <= lo:
        return False
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(lo, hi - lo, advice) == 0


def huge_pages(held: np.ndarray) -> bool:
    """Asks Linux to back the 2 MB-aligned interior of `held`'s memory with 2 MB pages, before it
    is written: its pages are then made huge as they are first touched, at no copy. Where the
    kernel's transparent huge pages are set to `madvise` (a common default), only memory advised
    so gets them. A decode step streams every weight from memory, most of them from DecoderStack's
    stacks (CausalLM.stack_weights), and reads them faster from 2 MB pages (docs/benchmarks.md).
    Unadvised, a stack had huge pages only where the allocator reused memory that numpy had
    advised for its arrays of 4 MB and more: the demo model's qkv stack had none. Whether the
    advice was taken (False off Linux, and for memory that holds no aligned 2 MB page)."""
    return advise_pages(held, MADV_HUGEPAGE, HUGE_PAGE)


# How a tensor-parallel group sums a tensor over its ranks and gathers every rank's, factories of
# the operators: MindSpore's AllReduce and AllGather (HCCL on cards, MCCL on the CPU), or the CPU
# kernels' NodeAllReduce and NodeAllGather once the worker's ranks have joined a node group
# (worker.device.join_node_group). Set before the networks are built.
ALL_REDUCE, ALL_GATHER = ops.AllReduce, ops.AllGather


def all_reduce():
    return ALL_REDUCE()


def all_gather():
    return ALL_GATHER()


def in_turn(x, after):
    """`x`, once `after` has been computed. The ranks of a group must reach their collectives in one
    order, and MindSpore's runtime may run two branches of a graph that share no data in either
    order (seen on the CPU under load: a scoring step whose greedy pick and scores gathered
    independently had its ranks at different collectives, on inputs that had run cleanly before).
    A graph with more than one chain of collectives gives each chain after the first its input
    through this."""
    return ops.depend(x, after)


class PerTokenInt8(nn.Cell):
    """A W8A8 layer's input as compressed-tensors quantizes it (sharding.quant): each token's row
    to int8 levels of max|x| / 127.5, rounded half to even, and back, in float32. group_max > 1:
    the row is split over the tensor-parallel ranks (a row-parallel layer's input), so the ranks take
    the row's max over all of them, as the reference takes it over the whole row (gathered and
    reduced here: MindSpore's CPU all-reduce sums only)."""

    def __init__(self, group_max: int = 0, divisor: float = 127.5, half_away: bool = False, kernel=None):
        super().__init__()
        self.ranks, self.divisor, self.half_away = group_max, divisor, half_away
        self.gather = all_gather() if group_max > 1 else None
        self.eps = float(np.finfo(np.float32).eps)      # the scale of a row of zeros
        # the device's one-pass kernel (a row whole on this rank), else MindSpore's operators
        self.kernel = kernel() if kernel is not None and self.gather is None else None
        self.meta = Tensor(np.array([divisor, float(half_away)], np.float32))

    def construct(self, x):
        if self.kernel is not None:
            return self.kernel(x, self.meta)
        levels, s = self.levels(x)
        return (levels * s).astype(x.dtype)

    def row_max(self, x):
        """Each row's max|x| [M, 1] float32, over every rank that holds a part of the row."""
        amax = ROW_MAX(ops.abs(x.astype(mstype.float32)), -1)
        if self.gather is not None:
            amax = MAX(self.gather(amax).reshape(self.ranks, -1, 1), 0)
        return amax

    def levels(self, x):
        """(each row's int8 levels [M, K], float32; its scale [M, 1] float32)."""
        xf = x.astype(mstype.float32)
        s = self.row_max(xf) / self.divisor
        s = s + (s == 0).astype(mstype.float32) * self.eps
        r = round_half_away(xf / s) if self.half_away else ops.round(xf / s)
        return ops.clip(r, -128.0, 127.0), s


def round_half_away(y):
    """CANN's "round" mode as ModelSlim's kernels use it: halves away from zero."""
    return ops.sign(y) * ops.floor(ops.abs(y) + 0.5)


class StaticInt8(nn.Cell):
    """A ModelSlim W8A8 layer's input (sharding.quant): clamp(round(x * (1 / input_scale) +
    input_offset), -128, 127), one scale and offset per layer from the checkpoint. The int levels
    themselves go on: the weight's scale (deq_scale) carries input_scale, and the bias
    (quant_bias) the offset."""

    def __init__(self):
        super().__init__()
        self.scale = new_param((1,), mstype.float32, "scale")
        self.offset = new_param((1,), mstype.float32, "offset")
        self.seen: dict[str, float] = {}

    def weight_loader(self, param, src, name, shard_id=None):
        """Layers that one matmul fuses (q, k, v; gate, up) share an input, so their scales must
        agree."""
        value = np.asarray(read_shard(src, None), np.float32).reshape(-1)
        kind = name.rsplit(".", 1)[-1]
        if value.shape != (1,):
            raise ShapeMismatch(f"tensor '{name}' has shape {list(value.shape)}; a per-tensor {kind} is [1]")
        if kind in self.seen and self.seen[kind] != float(value[0]):
            raise ShapeMismatch(f"tensor '{name}' is {value[0]:g}, but a layer that shares its input has "
                                f"{self.seen[kind]:g}: one matmul takes one {kind}")
        self.seen[kind] = float(value[0])
        copy_into(param, value)

    def construct(self, x):
        y = x.astype(mstype.float32) * (1.0 / self.scale) + self.offset
        return ops.clip(round_half_away(y), -128.0, 127.0).astype(x.dtype)


def named(cell: nn.Cell, prefix: str) -> None:
    """A cell added to a built network gets only its attribute's name as its parameters' prefix
    (input_quant.scale in every layer): its parameters get the layer's name before it."""
    for param in cell.get_parameters():
        if not param.name.startswith(prefix):
            param.name = f"{prefix}.{param.name}"


def input_quantizer(scheme, name: str, row_parallel_ranks: int = 0, kernel=None):
    """The cell that quantizes the inputs of layer `name` as `scheme` (sharding.quant.Scheme)
    says; kernel: the device's per-token one (dev.quant_rows_op)."""
    if scheme.static:
        return StaticInt8()
    return PerTokenInt8(row_parallel_ranks, scheme.act_divisor, half_away=bool(scheme.modelslim), kernel=kernel)


class InputQuantized:
    """A layer that quantizes its inputs before its matmul where the checkpoint is W8A8
    (`quantize_inputs`, called before the first call; its `input_quant`, which the cell sets to
    None in its __init__, otherwise: a class attribute would stand in MindSpore's way of adding
    the quantizer as a child cell)."""

    def input_split(self) -> int:
        """The ranks a row of its input is split over (their maximum is shared), 0 for none."""
        return 0

    def quantize_inputs(self, scheme, name: str, kernel=None) -> None:
        """name: the layer's checkpoint name; kernel: the device's per-token one (dev.quant_rows_op)."""
        self.input_quant = input_quantizer(scheme, name, self.input_split(), kernel)
        named(self.input_quant, name)


class LinearBase(InputQuantized, nn.Cell):
    """Y = X W^T + b on [tokens, in]; `tp_dim` is the weight dimension this layer splits."""
    tp_dim: int | None = None

    def __init__(self, in_size: int, out_size: int, bias: bool, tp: TPInfo, dtype, linear=None):
        super().__init__()
        self.tp = tp
        self.matmul = linear() if linear else ops.MatMul(transpose_b=True)
        self.weight = new_param((out_size, in_size), dtype, "weight")
        self.bias = new_param((out_size,), dtype, "bias") if bias else None
        self.input_quant = None
        self.quant_scheme = None     # the checkpoint's scheme of this layer (CausalLM.quantize_inputs)
        # a device that multiplies int8 weights itself (`hold_int8`): its cell (x, int8 weight
        # [out, in], their scales) -> y, which quantizes a W8A8 layer's inputs itself
        self.int8_matmul = self.weight_scale = None

    def hold_int8(self, matmul: nn.Cell, levels: np.ndarray, scales) -> None:
        """Keep the weight as its levels, as the device's `matmul` takes them (int8 [out, in], or
        its own packing in its `weight_dtype`: worker.ascend.AscendInt4Linear), and their scales (a
        Tensor in the dtype `matmul` takes), multiplied by `matmul`, which quantizes the inputs
        itself (with the layer's input quantizer's parameters, where it has one)."""
        dtype = getattr(matmul, "weight_dtype", mstype.int8)
        self.weight = Parameter(Tensor(levels, dtype), name=self.weight.name, requires_grad=False)
        self.weight_scale = Parameter(scales, name=self.weight.name + "_scale", requires_grad=False)
        self.int8_matmul = matmul
        named(matmul, self.weight.name.rsplit(".", 1)[0])     # (the quantizer's parameters are renamed)

    def input_split(self) -> int:
        return self.tp.size if self.tp_dim == 1 else 0

    def weight_loader(self, param: Parameter, src, name: str, shard_id=None) -> None:
        full = list(param.shape)
        if self.tp_dim is not None and (param is self.weight or self.tp_dim == 0):
            full[self.tp_dim] *= self.tp.size
        check_shape(name, src, tuple(full))
        dim = self.tp_dim if (param is self.weight or self.tp_dim == 0) else None
        size = param.shape[dim] if dim is not None else None
        copy_into(param, read_shard(src, dim, self.tp.rank * (size or 0), size), owned=True)

    def construct(self, x):
        y = self.product(x)
        return y + ops.broadcast_to(self.bias, y.shape) if self.bias is not None else y

    def product(self, x):
        """x W^T, the inputs quantized first where the checkpoint says so."""
        if self.int8_matmul is not None:
            return self.int8_matmul(x, self.weight, self.weight_scale)
        if self.input_quant is not None:
            x = self.input_quant(x)
        return self.matmul(x, self.weight)


class ReplicatedLinear(LinearBase):
    tp_dim = None


class ColumnParallelLinear(LinearBase):
    """Y = X [A_1, ..., A_p]: rank r holds output rows A_r and returns its part of Y, no collective."""
    tp_dim = 0

    def __init__(self, in_size, out_size, bias, tp, dtype, linear=None):
        super().__init__(in_size, out_size // tp.size, bias, tp, dtype, linear)


class RowParallelLinear(LinearBase):
    """Y = sum_r X_r A_r + b: rank r holds input columns A_r; partial products are all-reduced,
    and the bias is added once, after the reduce (adding it on every rank would count it tp times).
    reduce=False: the caller sums the partial products (one all-reduce for several layers)."""
    tp_dim = 1

    def __init__(self, in_size, out_size, bias, tp, dtype, linear=None, reduce: bool = True):
        super().__init__(in_size // tp.size, out_size, bias, tp, dtype, linear)
        assert reduce or not bias, "a bias is added after the reduce"
        self.all_reduce = all_reduce() if tp.size > 1 and reduce else None

    def construct(self, x):
        y = self.product(x)
        if self.all_reduce is not None:
            y = self.all_reduce(y)
        return y + ops.broadcast_to(self.bias, y.shape) if self.bias is not None else y


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs in one matmul (gate and up): [A_r^0; A_r^1; ...]."""
    tp_dim = 0

    def __init__(self, in_size, out_sizes: list[int], bias, tp, dtype, linear=None):
        self.out_sizes = [o // tp.size for o in out_sizes]
        super().__init__(in_size, sum(self.out_sizes), bias, tp, dtype, linear)
        self.host: dict[str, list] = {}      # the parameters being gathered (gather_part)

    def weight_loader(self, param, src, name, shard_id: int = 0):
        size = self.out_sizes[shard_id]
        offset = sum(self.out_sizes[:shard_id])
        expected = (size * self.tp.size,) + tuple(param.shape[1:])
        check_shape(name, src, expected)
        gather_part(self.host, param, read_shard(src, 0, self.tp.rank * size, size), slice(offset, offset + size),
                    len(self.out_sizes))


class QKVParallelLinear(LinearBase):
    """q, k, v projections fused. Rank r holds num_heads/tp query heads and the KV heads they
    attend to; with tp_size > num_kv_heads each KV head is replicated on tp/num_kv_heads ranks."""
    tp_dim = 0

    def __init__(self, cfg: ModelConfig, bias, tp, dtype, linear=None):
        self.head_dim = cfg.head_dim
        self.q_heads = cfg.num_heads // tp.size
        self.kv_lo, self.kv_hi = kv_head_range(cfg, tp)
        self.kv_heads = self.kv_hi - self.kv_lo
        self.total = {"q": cfg.num_heads, "k": cfg.num_kv_heads, "v": cfg.num_kv_heads}
        out = (self.q_heads + 2 * self.kv_heads) * cfg.head_dim
        super().__init__(cfg.hidden_size, out, bias, tp, dtype, linear)
        self.host: dict[str, list] = {}      # the parameters being gathered (gather_part)

    def weight_loader(self, param, src, name, shard_id: str = "q"):
        D = self.head_dim
        q, kv = self.q_heads * D, self.kv_heads * D
        first_head = self.tp.rank * self.q_heads if shard_id == "q" else self.kv_lo
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        expected = (self.total[shard_id] * D,) + tuple(param.shape[1:])
        check_shape(name, src, expected)
        gather_part(self.host, param, read_shard(src, 0, first_head * D, size), slice(offset, offset + size), 3)


class FusedExperts(nn.Cell):
    """The experts of a sparse layer that this rank holds (`TPInfo.experts`: all of them sliced,
    or whole ones, expert parallel), stacked: w13 [E, 2I, H] (each expert's gate rows, then its
    up rows) and w2 [E, H, I]. (x [N, H], ids [N, k] int32, weights [N, k]) -> this rank's part of
    sum_j weights[n, j] * down(silu(gate x) * up x) of expert ids[n, j]: experts held elsewhere add
    nothing, and sliced experts give partial sums over I, so the caller all-reduces the parts.
    `op` is the device's grouped kernel (tokens grouped by expert, each expert's weights read
    once for its tokens); without one every held expert runs on every token, weighted zero where
    not routed (portable: any device, E/k times the routed work). A weight-only int8 checkpoint's
    experts leave their scales per output channel in w13's and w2's `row_scales` ([E, 2I], [E, H];
    NaN where a row loaded from floats) and their scheme in `quant_scheme`, for a device whose
    grouped kernel multiplies int8 levels (`hold_int8`); a W4A16 checkpoint's, their scales per
    group of inputs in `group_scales` ([E, 2I, H/g], [E, H, I/g]).
    Where the checkpoint quantizes the experts' inputs per token (compressed-tensors W8A8, ModelSlim
    W8A8_DYNAMIC: cfg.expert_inputs), each token's row is quantized before gate|up (`x_quant`: one
    row for every expert) and each (token, expert) row of silu(gate) * up before down (`h_quant`,
    over I: sliced experts take the row's maximum over the ranks, as a row-parallel layer does),
    as each expert's Linear layers quantize them. `op` must then quantize its rows itself (the
    device's moe_quant_inputs: AscendExperts' and CpuExperts' x_quant and h_quant): with the
    weights dequantized, to the levels and back; held int8 (`hold_int8`), to the levels and a
    scale per row."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, dtype, op=None, glu_group: int = 0):
        super().__init__()
        self.tp, self.hidden, self.full = tp, cfg.hidden_size, cfg.moe_intermediate_size
        self.first, self.count, self.inter = tp.experts(cfg)
        self.w13 = new_param((self.count, 2 * self.inter, self.hidden), dtype, "w13")
        self.w2 = new_param((self.count, self.hidden, self.inter), dtype, "w2")
        # gate and up interleaved in the kernel's packing (dev.pack_experts) where I allows
        self.glu = op is not None and glu_group > 0 and self.inter % glu_group == 0
        self.op = op() if op else None
        self.meta = Tensor(np.array([self.first, int(self.glu)], np.int32))
        self.host: dict[str, list] = {}      # the parameters being gathered (gather_part)
        self.quant_scheme = None             # the experts' scheme, where one int8 scheme loaded them all
        self.schemes: set = set()
        self.w13_scale = self.w2_scale = None
        if self.op is None:
            self.batch_matmul = ops.BatchMatMul(transpose_b=True)
            self.expert_ids = Tensor(np.arange(self.first, self.first + self.count, dtype=np.int32))
        x_scheme, h_scheme = cfg.expert_inputs("gate_proj"), cfg.expert_inputs("down_proj")
        split = tp.size if tp.size > 1 and not tp.expert_parallel else 0
        self.x_quant = input_quantizer(x_scheme, "experts") if x_scheme else None
        self.h_quant = input_quantizer(h_scheme, "experts", split) if h_scheme else None
        if self.op is not None:              # the device's cell quantizes its sorted rows
            self.op.x_quant, self.op.h_quant = self.x_quant, self.h_quant

    def weight_loader(self, param, src, name, shard_id):
        """shard_id (e, part): local expert e's gate (0), up (1) or down (2) projection. The
        experts' tensors are many and small, so each parameter is gathered on the host and copied
        to the device once, when its last expert has arrived."""
        e, part = shard_id
        sliced = not self.tp.expert_parallel
        start = self.tp.rank * self.inter
        self.schemes.add(getattr(src, "scheme", None))
        if part < 2:
            check_shape(name, src, (self.full, self.hidden))
            rows = read_shard(src, 0 if sliced else None, start, self.inter)
            at = (e, slice(part * self.inter, (part + 1) * self.inter))
        else:
            check_shape(name, src, (self.hidden, self.full))
            rows = read_shard(src, 1 if sliced else None, start, self.inter)
            at = (e, slice(None))
        if gather_part(self.host, param, rows, at, (2 if part < 2 else 1) * self.count, rows_dims=2):
            self.quant_scheme = next(iter(self.schemes)) if len(self.schemes) == 1 else None

    def hold_int8(self, w13: np.ndarray, w2: np.ndarray, w13_scale=None, w2_scale=None, dtype=None) -> None:
        """Keep the experts' weights as int8 levels in the device's layout (w13, w2 as its grouped
        kernel takes them) with their scales per output channel (Tensors [E, 2I], [E, H] in the
        dtype the kernel takes; None where the layout holds them, the CPU's int8 panels); or as
        int4 levels two a byte with their group scales (the CPU's int4 layout, uint8; Ascend's, in
        `dtype`: qint4x2). The weights' dtype: `dtype`, else the arrays'."""
        self.w13 = Parameter(Tensor(w13, dtype), name=self.w13.name, requires_grad=False)
        self.w2 = Parameter(Tensor(w2, dtype), name=self.w2.name, requires_grad=False)
        if w13_scale is not None:
            self.w13_scale = Parameter(w13_scale, name=self.w13.name + "_scale", requires_grad=False)
            self.w2_scale = Parameter(w2_scale, name=self.w2.name + "_scale", requires_grad=False)
        self.op.int8_inputs = self.x_quant is not None      # W8A8: the per-token form (AscendExperts)

    def construct(self, x, ids, weights):
        if self.x_quant is not None and self.op is None:
            x = self.x_quant(x)
        if self.op is not None:
            if self.w13_scale is not None:
                return self.op(x, ids, weights, self.w13, self.w2, self.meta, self.w13_scale, self.w2_scale)
            return self.op(x, ids, weights, self.w13, self.w2, self.meta)
        e = self.count
        # dense routing weights [E, N]: weights[n, j] where ids[n, j] is local expert e
        hit = ops.equal(ops.broadcast_to(ids.expand_dims(-1), (-1, -1, e)),
                        ops.broadcast_to(self.expert_ids, ids.shape + (e,))).astype(weights.dtype)
        dense = (hit * ops.broadcast_to(weights.expand_dims(-1), (-1, -1, e))).sum(1).transpose(1, 0)
        xs = ops.broadcast_to(x.expand_dims(0), (e, -1, -1))
        gate, up = HALVES(self.batch_matmul(xs, self.w13))                      # [E, N, 2I]
        h = ops.silu(gate) * up
        if self.h_quant is not None:
            h = self.h_quant(h.reshape(-1, self.inter)).reshape(e, -1, self.inter)
        y = self.batch_matmul(h, self.w2)                                        # [E, N, H]
        return (y * ops.broadcast_to(dense.expand_dims(-1), (-1, -1, self.hidden))).sum(0)


class VocabParallelEmbedding(nn.Cell):
    """Rank r holds vocab rows [start, stop); ids outside give zeros, and the sum over ranks
    (all-reduce) is the full lookup. Shards are padded to equal size when tp does not divide vocab."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo, dtype, lookup=None):
        super().__init__()
        self.tp = tp
        self.lookup = lookup() if lookup else None
        self.vocab_size = vocab_size
        self.start, self.stop, per = vocab_shard(vocab_size, tp)
        self.weight = new_param((per, hidden), dtype, "weight")
        self.all_reduce = all_reduce() if tp.size > 1 else None
        self.host: dict[str, list] = {}      # a padded shard being gathered (gather_part)

    def weight_loader(self, param, src, name, shard_id=None):
        check_shape(name, src, (self.vocab_size, param.shape[1]))
        n = self.stop - self.start
        rows = read_shard(src, 0, self.start, n)
        if n == param.shape[0]:
            copy_into(param, rows, owned=True)
        else:                                # the last shard: its rows, then zeros to the shards' size
            gather_part(self.host, param, rows, slice(0, n), 1)

    def construct(self, ids):
        if self.lookup is not None:
            out = self.lookup(self.weight, ids - self.start if self.start else ids)
            return out if self.all_reduce is None else self.all_reduce(out)
        if self.all_reduce is None:
            return ops.gather(self.weight, ids, 0)
        local = ids - self.start
        inside = ops.logical_and(local >= 0, local < self.stop - self.start)
        local = ops.select(inside, local, ops.zeros_like(local))
        out = ops.gather(self.weight, local, 0)
        out = out * ops.broadcast_to(ops.expand_dims(inside.astype(out.dtype), -1), (-1, out.shape[1]))
        return self.all_reduce(out)


class ParallelLMHead(InputQuantized, VocabParallelEmbedding):
    """Logits of this rank's vocabulary rows, [N, per]: no gather (the sampler works shard by
    shard, worker.device_sampler); a padded shard's extra columns hold zeros."""

    def __init__(self, vocab_size, hidden, tp, dtype, tied: VocabParallelEmbedding | None = None, linear=None):
        super().__init__(vocab_size, hidden, tp, dtype)
        self.all_reduce = None
        if tied is not None:
            self.weight = tied.weight
        self.matmul = linear() if linear else ops.MatMul(transpose_b=True)
        self.input_quant = None

    def construct(self, x):
        if self.input_quant is not None:
            x = self.input_quant(x)
        return self.matmul(x, self.weight)


def load_replicated(param, src, name: str, shard_id=None) -> None:
    """A cell's `weight_loader` for a tensor every rank holds whole, in the parameter's shape."""
    check_shape(name, src, tuple(param.shape))
    copy_into(param, read_shard(src, None), owned=True)


class RMSNorm(nn.Cell):
    def __init__(self, size: int, eps: float, dtype, dev):
        super().__init__()
        self.weight = new_param((size,), dtype, "weight")
        self.op = dev.rms_norm_op(eps)            # the device's (x, weight) -> normalized x cell
        self.add_op = dev.add_rms_norm_op(eps, self.op)    # (x, delta, weight) -> (x + delta, normalized)

    weight_loader = staticmethod(load_replicated)

    def construct(self, x, delta=None):
        """x normalized; with `delta`, (x + delta, that normalized)."""
        if delta is None:
            return self.op(x, self.weight)
        return self.add_op(x, delta, self.weight)
