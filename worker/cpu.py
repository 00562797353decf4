"""The CPU kernels of msinfer (worker/csrc: kernels.cc and linear.cc) as the device seam `CpuOps`:
MindSpore AOT custom operators compiled with the machine's C++ compiler on first use and cached
(worker/build.py), one call where MindSpore's CPU backend runs 5-10 small kernels, attention
with no gathered copy of K/V and no mask, and the weights reordered once loaded into the panels
and bfloat16 tiles the kernels read (`CpuOps.pack_weight`, `pack_experts`).
"""

from __future__ import annotations

import ctypes
import os

import mindspore as ms
from mindspore import Tensor, nn, ops
import numpy as np

from msinfer.sharding.config import bf16_panels_on
from msinfer.sharding.layers import PerTokenInt8
from msinfer.sharding.quant import int8_levels
from msinfer.worker.build import kernel_library
from msinfer.worker.ops import INFERENCE_MODE, MsOps

PANEL = 32     # csrc/matmul.h kPanel: the column panels of a packed weight
GLU_GROUP = PANEL // 2      # outputs per panel of LinearGlu
TILE = 32      # csrc/matmul.h amx_rows: N and K of a weight in bfloat16 tiles are multiples of this

# The kernels' library and primitives, set by `load_kernels` before any network that uses them
# is built.
_LIBRARY = _RMS_NORM = _ADD_RMS_NORM = _SILU_MUL = _ROWS = _ROPE = None


class CpuRmsNorm(nn.Cell):
    def __init__(self, eps: float):
        super().__init__()
        self.eps = Tensor(np.array([eps], np.float32))

    def construct(self, x, weight):
        return _RMS_NORM(x, weight, self.eps)


class CpuAddRmsNorm(CpuRmsNorm):
    def construct(self, x, delta, weight):
        return _ADD_RMS_NORM(x, delta, weight, self.eps)


class CpuOps(MsOps):
    """MsOps with the kernels of worker/csrc (see kernels.cc's header) in place of the
    elementwise chains, attention, every matmul and the embedding lookup (over packed weights).
    MindSpore 2.10 runs custom operators in static shapes only ("The pointer[value] is null" at the
    first call of a dynamic-shape graph), so steps run in power-of-two buckets (worker/runner.py)."""
    name = "cpu"
    # Padding rows embed to zeros, every kernel keeps a zero row zero (attention gives zeros for a
    # token that sees nothing) and `linear` skips zero rows: a padded step costs its real tokens.
    # (A layer with a bias makes them non-zero from there on; they are then computed, as before.)
    pad_id = -1
    dynamic_shapes = False
    # The step graphs run in MindSpore's inference mode (jit's infer_boost, documented for Atlas A2
    # and taken by the CPU backend): a call runs the graph the network's `phase` names without
    # MindSpore's per-call compile lookup and preparing every weight anew, 0.5-2 ms less a decode
    # step of the demo model (docs/benchmarks.md). That mode keeps one graph per phase, whatever
    # the inputs' shapes, so the runner gives every shape a phase of its own (runner.by_shape).
    # MSINFER_INFER_BOOST=0 turns it off (load_kernels).
    static_step_jit_options = INFERENCE_MODE

    @staticmethod
    def cache_shape(num_blocks, block_size, kv_heads, head_dim):
        return (num_blocks * block_size * kv_heads, head_dim)   # row (slot * KV + head), the same bytes

    @staticmethod
    def rms_norm_op(eps):
        return CpuRmsNorm(eps)

    @staticmethod
    def add_rms_norm_op(eps, norm=None):
        return CpuAddRmsNorm(eps)             # one kernel: the add and the norm

    @staticmethod
    def rope_cos_sin(positions, freq_matrix, factor):
        return _ROPE(positions, freq_matrix, factor)     # one kernel (RopeTables) for MatMul, Cos and Sin

    @staticmethod
    def rope_tables(cos, sin, heads):
        return cos, sin                       # the kernel reads [N, D/2] for every head

    @staticmethod
    def rows(x, index):
        return _ROWS(x, index)                # -1 gives a zero row, which `linear` then skips

    @staticmethod
    def silu_mul(gate_up):
        return _SILU_MUL(gate_up)

    # Whether Linear and LinearGlu take a W8A8 layer's inputs as int8 with AVX512-VNNI
    # (csrc/matmul.h, linear_vnni): set by load_kernels; MSINFER_VNNI=0 turns it off.
    vnni = False

    # Whether Linear and LinearGlu take W4A16 layers' int4 weights (csrc/matmul.h, int4_rows): set by
    # load_kernels (a CPU with AVX-512); MSINFER_INT4=0 turns it off.
    int4 = False

    @classmethod
    def int8_linear(cls, scheme, quantizer, dtype, glu: bool = False):
        """CpuInt8Linear for a W8A8 layer whose inputs are quantized per token (compressed-tensors
        W8A8, ModelSlim W8A8_DYNAMIC) where the CPU has VNNI; CpuInt4Linear for a W4A16 layer (int4
        groups) where it has AVX-512; None elsewhere: an int8 weight then goes to int8 panels
        (`pack_int8`) and its inputs through `quant_rows_op`, in float32 FMAs; an int4 weight is
        dequantized."""
        if scheme is not None and scheme.int4_groups:
            return CpuInt4Linear(scheme.group_size, glu) if cls.int4 else None
        if not cls.vnni or scheme is None or scheme.int8_kind != "dynamic" or not isinstance(quantizer, PerTokenInt8):
            return None
        return CpuInt8Linear(quantizer, glu)

    @staticmethod
    def quant_rows_op():
        """(x [N, K], (divisor, half away from zero) [2] float32) -> each row to its int8 levels
        and back (sharding.layers.PerTokenInt8, in one pass)."""
        return _custom("QuantRows", lambda x, meta: x)

    fused_attention = True

    @staticmethod
    def attention_op(q_size: int):
        """(qkv [N, (H + 2 KV) D], q_norm [D], k_norm [D], (eps, qk norm?) [2], cos, sin, k_cache,
        v_cache, slots, block_tables, token_seq, token_len, meta) -> [N, H D]: q/k norm, rotary,
        cache write and attention in one kernel (kernels.cc), straight from the qkv projection."""
        return _custom("PagedAttention", lambda qkv, *_: [qkv[0], q_size])

    # Whether a layer or its halves run as one kernel call each (LayerBase.fuse): set by
    # load_kernels; MSINFER_FUSED_LAYERS=0 turns it off (each layer's kernels then launch one by one).
    fused_layers = True

    @classmethod
    def decoder_layer_op(cls, halves: bool = False):
        """(h, delta, the layer's norms, weights, attention inputs: kernels.cc DecoderLayer) ->
        (the residual stream after attention, the MLP's output): what the layer's seven operators
        give, from one launch; with `halves`, the ops of its two halves (DecoderAttention,
        DecoderMlp), for a layer whose all-reduces come between them or whose other half keeps
        its operators; None where MSINFER_FUSED_LAYERS=0."""
        if not cls.fused_layers:
            return None
        two = (lambda h, *_: (h, h), lambda h, *_: (h, h))
        if halves:
            return _custom("DecoderAttention", *two), _custom("DecoderMlp", *two)
        return _custom("DecoderLayer", *two)

    @classmethod
    def decoder_stack_op(cls):
        """(h, delta, the attention's inputs from the step, the stack's metadata int32, the inputs
        of every layer given once, each layer's own: kernels.cc DecoderStack) -> (h, delta) after
        the last: the layers' DecoderLayer calls from one launch; None where
        MSINFER_FUSED_LAYERS=0."""
        if not cls.fused_layers:
            return None
        return _custom("DecoderStack", lambda h, *_: (h, h), lambda h, *_: (h, h))

    @staticmethod
    def stack_shares() -> int:
        """How many DecoderStack calls of this process split their step between the kernels'
        threads, each running every layer for its share of the sequences (kernels.cc)."""
        fn = ctypes.CDLL(_LIBRARY).StackShares
        fn.restype = ctypes.c_int64
        return fn()

    @staticmethod
    def linear_op():
        """(x [M, K], w [N, K] packed) -> x w^T [M, N]."""
        return _custom("Linear", lambda x, w: [x[0], w[0]])

    @staticmethod
    def glu_linear_op():
        """(x [M, K], w [2I, K] packed by `pack_glu`) -> silu(x gate^T) * (x up^T) [M, I], for
        I a multiple of GLU_GROUP: the MLP's gate/up projection and its activation in one pass,
        with no [M, 2I] intermediate."""
        return _custom("LinearGlu", lambda x, w: [x[0], w[0] // 2])

    @staticmethod
    def moe_op():
        """CpuExperts: (x [N, H], ids [N, k] int32, weights [N, k], w13 [E, 2I, H], w2 [E, H, I]
        packed by `pack_experts`, meta (first expert held, glu) [2] int32[, the int8 weights'
        scales]) -> [N, H]: each held expert's tokens gathered and passed through its weights once
        (sharding.layers.FusedExperts)."""
        return CpuExperts()

    # Experts whose inputs are quantized per token run as CpuExperts says.
    moe_quant_inputs = True

    @classmethod
    def int8_experts(cls, scheme) -> str | None:
        """How experts of `scheme` keep their int levels (CausalLM.hold_int8_experts): "vnni" for
        int8 weights with a scale per output channel and int8 inputs per token (W8A8) where the CPU
        has VNNI (`pack_vnni`'s panels, the int8 products summed exactly); "panels" for the other
        int8 ones (`pack_int8`'s panels, products in float32: weight-only, or W8A8 without VNNI);
        "int4" for int4 weights with a scale per group of inputs (W4A16) where the CPU has AVX-512
        (CpuInt4Linear's layout, each weight widened to its dequantized value); None: dequantized."""
        if scheme is not None and scheme.int4_groups:
            return "int4" if cls.int4 else None
        kind = scheme.int8_kind if scheme is not None else None
        if kind not in ("weight", "dynamic"):
            return None
        return "vnni" if kind == "dynamic" and cls.vnni else "panels"

    @staticmethod
    def int4_scale_dtype(dtype):
        """The dtype of int4 experts' group scales: float32, whatever the compute dtype."""
        return ms.float32

    @staticmethod
    def expert_scales(scales: np.ndarray, glu: bool = False) -> np.ndarray:
        """Int8 experts' scales per output channel [E, N] in the order of `pack_experts`' columns:
        float32, w13's gate and up interleaved with glu. Int4 experts' group scales [E, N, groups]:
        each expert's in CpuInt4Linear.scales' order."""
        scales = np.asarray(scales, np.float32)
        if scales.ndim == 3:
            return np.stack([CpuInt4Linear.panel_scales(s, glu) for s in scales])
        return np.stack([CpuOps.interleave_glu(s[:, None])[:, 0] for s in scales]) if glu else scales

    @classmethod
    def pack_experts(cls, w: np.ndarray, glu: bool = False, scales: np.ndarray | None = None,
                     pairs: bool = False):
        """Stacked expert weights [E, N, K] -> every expert packed as `pack_weight` packs a weight,
        all in bfloat16 tiles (when every value is a bfloat16 and the CPU has AMX) or all in panels;
        and the unpack. With `pairs` (computing in bfloat16), float weights go to `pack_pairs`'
        bfloat16 pairs, uint32 [E, N, ceil(K/2)]. Int8 levels with their `scales` [E, N] go to
        `pack_int8`'s panels (the unpack gives their dequantized values); without, to `pack_vnni`'s
        layout (gate and up interleaved with glu), or None where N is not whole panels. Int4 levels
        with their group scales [E, N, groups] go to CpuInt4Linear's layout, uint8 [E, N, K/2] (the
        unpack gives the levels; the scales go apart, `expert_scales`), or None where it does not
        take the sizes."""
        if not len(w):
            return w, lambda t: t
        if w.dtype == np.int8 and scales is not None and np.ndim(scales) == 3:
            cell = CpuInt4Linear(w.shape[2] // scales.shape[2], glu)
            packed = [cell.pack(q) for q in w]
            return None if packed[0] is None else stacked(packed)
        if w.dtype == np.int8 and scales is not None:
            return stacked([cls.int8_panels(q, s, glu) for q, s in zip(w, scales)])
        if pairs and w.dtype != np.int8:
            return stacked([cls.pack_pairs(e, glu) for e in w])
        if w.dtype == np.int8:
            E, N, K = w.shape
            if N % PANEL:
                return None
            rows = np.stack([cls.interleave_glu(e) for e in w]) if glu else w

            def unpack(t: np.ndarray) -> np.ndarray:
                q = np.stack([cls.unpack_vnni(e, K) for e in t])
                return np.stack([cls.deinterleave_glu(e) for e in q]) if glu else q
            return np.stack([cls.pack_vnni(e) for e in rows]), unpack
        if cls.takes_tiles(w):
            return stacked([cls.pack_weight(e, glu) for e in w])     # each expert's values are bfloat16: tiles
        return stacked([(cls.pack_glu(e), cls.unpack_glu) if glu else (cls.pack(e), cls.unpack) for e in w])

    @staticmethod
    def embed_op():
        """(w [V, H] packed, ids [N]) -> rows [N, H], zeros for ids outside [0, V); float32 from a
        table in bfloat16 tiles."""
        return _custom("Embed", lambda w, ids: [ids[0], w[1]],
                       lambda w, ids: ms.float32 if w.element_type() in (ms.int16, ms.uint16) else w)

    @staticmethod
    def embed_pairs_op():
        """(w [V, H/2] in bfloat16 pairs (`pack_pairs`, H even), ids [N]) -> float32 rows [N, H],
        zeros for ids outside [0, V): the lookup of a table held for bfloat16 linear layers."""
        return _custom("Embed", lambda w, ids: [ids[0], 2 * w[1]], lambda w, ids: ms.float32)

    sampler_kernels = None      # set by load_kernels: SamplerKernels

    # Whether Linear and Embed take bfloat16 weights in AMX tiles (csrc/matmul.h, amx_rows): set by
    # load_kernels; MSINFER_AMX=0 turns it off.
    amx = False
    # Whether, without tiles, a bfloat16 checkpoint's weights stay bfloat16 in the panels (uint16,
    # widened to float32 in the registers); MSINFER_BF16_PANELS=0 keeps them in float32 panels.
    bf16_panels = True
    # Whether Linear and LinearGlu take bfloat16 pairs (pack_pairs) with VDPBF16PS (AVX512-BF16):
    # set by load_kernels (set_bf16_dot); without it the kernels take FMAs, to the same bits.
    bf16_dot = False

    @classmethod
    def pack_weight(cls, w: np.ndarray, glu: bool = False, scales: np.ndarray | None = None,
                    levels: np.ndarray | None = None):
        """A loaded weight [N, K] in the order the kernels read -> (packed array, its unpack).
        With `scales` (a quantized checkpoint's int8 weight, dequantized as it loaded, and the
        scale of each row: sharding.quant.Dequantized), int8 panels (`pack_int8`: a quarter of
        float32's bytes). A float32 weight whose values are all bfloat16 (a bfloat16 checkpoint's,
        unless an adapter was merged into it), with N and K multiples of 32, goes to bfloat16 AMX
        tiles where the CPU has them (int16, half the bytes; products still at float32 accuracy);
        elsewhere (or of other shapes) to panels of its bfloat16 bits (uint16, half the bytes,
        widened to float32 as they are read: the float32 panels' result); any other weight to
        panels of its own dtype. glu: gate and up rows of LinearGlu, interleaved GLU_GROUP at a
        time."""
        if scales is not None and (packed := cls.pack_int8(w, scales, glu, levels)) is not None:
            return packed
        if cls.takes_tiles(w):
            if glu:
                return cls.pack_tiles(cls.interleave_glu(w)), lambda t: cls.deinterleave_glu(cls.unpack_tiles(t))
            return cls.pack_tiles(w), cls.unpack_tiles
        if cls.bf16_panels and w.dtype == np.float32 and is_bfloat16(w):
            unpack = cls.unpack_glu if glu else cls.unpack
            bits = bfloat16_bits(w)
            return (cls.pack_glu(bits) if glu else cls.pack(bits)), lambda t: bfloat16_values(unpack(t))
        return (cls.pack_glu(w), cls.unpack_glu) if glu else (cls.pack(w), cls.unpack)

    @classmethod
    def pack_pairs(cls, w: np.ndarray, glu: bool = False):
        """w [N, K] float32 -> (uint32 [N, ceil(K/2)], its unpack to the bfloat16 values, float32
        [N, K]), as `pack_weight` gives its pair: w's values rounded to bfloat16
        (`bfloat16_rounded`), each word a pair of k (the even one in the low 16 bits, zero past
        K), in `pack`'s panels (`pack_glu`'s, glu). Linear and LinearGlu then round x to bfloat16
        too and sum the exact products in float32 (csrc/matmul.h linear_pairs); Embed looks rows up
        in such a table (`embed_pairs_op`, K even)."""
        N, K = w.shape
        bits = np.zeros((N, K + K % 2), np.uint16)
        bits[:, :K] = bfloat16_rounded(w)
        words = bits.view(np.uint32)                 # little-endian: k even in the low half

        def unpack(t: np.ndarray) -> np.ndarray:
            held = np.ascontiguousarray(cls.unpack_glu(t) if glu else cls.unpack(t))
            return bfloat16_values(held.view(np.uint16)[:, :K])
        return (cls.pack_glu(words) if glu else cls.pack(words)), unpack

    # Whether a float32 job's greedy decode chains pick their tokens with GreedyHead (set by
    # load_kernels: VDPBF16PS in force, unless MSINFER_GREEDY_HEAD=0; CausalLM.pack_greedy_head)
    greedy_head = False

    @staticmethod
    def greedy_head_op():
        """(x [M, K] float32, w [N, K] the LM head in bfloat16 panels (uint16), pairs [N, ceil(K/2)]
        and norms [N] (`greedy_head_tables`), meta [1, 2] int32 (real columns first)) -> [M] int32:
        the tokens GreedyRows picks from Linear(x, w), from the pairs' product checked against its
        error bound (csrc/linear.cc greedy_head)."""
        return _custom("GreedyHead", lambda x, *_: [x[0]], lambda *_: ms.int32)

    @classmethod
    def greedy_head_tables(cls, panels: np.ndarray):
        """An LM head in bfloat16 panels (uint16 [N, K], `pack_weight`) -> (the same values in
        `pack_pairs`' panels, uint32 [N, ceil(K/2)]; each row's Euclidean norm [N] float32, rounded
        up), GreedyHead's tables; None where a weight is a bfloat16 denormal, which the pairs (as
        VDPBF16PS reads them) would hold as zero."""
        bits = cls.unpack(panels)
        if (((bits & 0x7F80) == 0) & ((bits & 0x7F) != 0)).any():
            return None
        N, K = bits.shape
        if K % 2:
            bits = np.concatenate((bits, np.zeros((N, 1), np.uint16)), 1)
        pairs = cls.pack(np.ascontiguousarray(bits).view(np.uint32))
        norms = np.empty(N, np.float32)
        for r in range(0, N, 4096):
            exact = np.sqrt(np.square(bfloat16_values(bits[r:r + 4096]), dtype=np.float64).sum(1))
            near = exact.astype(np.float32)
            norms[r:r + 4096] = np.where(near < exact, np.nextafter(near, np.float32(np.inf)), near)
        return pairs, norms

    @classmethod
    def pack_int8(cls, w: np.ndarray, scales: np.ndarray, glu: bool = False, levels: np.ndarray | None = None):
        """w [N, K] = q * scales[:, None] with q int8 -> (int8 [N, K + 4]: the N scales as float32
        bytes, then q in `pack`'s panels (`pack_glu`'s, glu), and the unpack); None where any row
        has no scale (NaN: loaded from a float tensor, or an adapter was merged into it) or w is
        not exactly q * scale (then the float panels hold it)."""
        q = int8_levels(w, scales, levels)
        return None if q is None else cls.int8_panels(q, scales, glu)

    @classmethod
    def int8_panels(cls, q: np.ndarray, scales: np.ndarray, glu: bool = False):
        """int8 levels q [N, K] with a scale per row -> `pack_int8`'s layout and its unpack (to
        the dequantized values)."""
        N, K = q.shape
        if glu:
            q, scales = cls.interleave_glu(q), cls.interleave_glu(scales[:, None])[:, 0]
        packed = np.concatenate((np.ascontiguousarray(scales, np.float32).view(np.int8), cls.pack(q).reshape(-1)))

        def unpack(t: np.ndarray) -> np.ndarray:
            flat = t.reshape(-1)
            s = flat[:4 * N].copy().view(np.float32)
            values = cls.unpack(flat[4 * N:].reshape(N, K)).astype(np.float32) * s[:, None]
            return cls.deinterleave_glu(values) if glu else values
        return packed.reshape(N, K + 4), unpack

    @staticmethod
    def pack_vnni(q: np.ndarray) -> np.ndarray:
        """int8 levels [N, K], N a multiple of PANEL -> int8 [N, Kq] (Kq: K rounded up to 4) holding
        level + 128 as uint8 bits, in panels of 32 columns [Kq/4][32][4] (csrc/matmul.h, linear_vnni):
        per 4 k, each column's 4 bytes together, the order VPDPBUSD sums them in."""
        N, K = q.shape
        Kq = -(-K // 4) * 4
        u = np.full((N, Kq), 128, np.uint8)
        u[:, :K] = (q.astype(np.int16) + 128).astype(np.uint8)
        panels = u.reshape(N // PANEL, PANEL, Kq // 4, 4).transpose(0, 2, 1, 3)
        return np.ascontiguousarray(panels).reshape(N, Kq).view(np.int8)

    @staticmethod
    def unpack_vnni(t: np.ndarray, K: int) -> np.ndarray:
        """The inverse of `pack_vnni`, for K columns: int8 levels [N, K]."""
        N, Kq = t.shape
        u = t.view(np.uint8).reshape(N // PANEL, Kq // 4, PANEL, 4).transpose(0, 2, 1, 3).reshape(N, Kq)
        return (u[:, :K].astype(np.int16) - 128).astype(np.int8)

    @classmethod
    def takes_tiles(cls, w: np.ndarray) -> bool:
        """Whether weights [..., N, K] go to bfloat16 tiles: every value a bfloat16 in float32, N and
        K multiples of TILE, and a CPU with AMX."""
        return (cls.amx and w.dtype == np.float32 and w.shape[-2] % TILE == 0 and w.shape[-1] % TILE == 0
                and is_bfloat16(w))

    @staticmethod
    def pack_tiles(w: np.ndarray) -> np.ndarray:
        """w [N, K] float32 holding bfloat16 values -> int16 [N, K]: bfloat16 tiles [N/16][K/32][16][32],
        tile (n, k) holding, for k-pair i and column c of 16n..16n+15, w[c][32k + 2i], w[c][32k + 2i + 1]."""
        N, K = w.shape
        tiles = bfloat16_bits(w).reshape(N // 16, 16, K // 32, 16, 2).transpose(0, 2, 3, 1, 4)
        return np.ascontiguousarray(tiles).reshape(N, K).view(np.int16)

    @staticmethod
    def unpack_tiles(t: np.ndarray) -> np.ndarray:
        """The inverse of `pack_tiles`."""
        N, K = t.shape
        bits = t.view(np.uint16).reshape(N // 16, K // 32, 16, 16, 2).transpose(0, 3, 1, 2, 4).reshape(N, K)
        return bfloat16_values(bits)

    @staticmethod
    def pack(w: np.ndarray) -> np.ndarray:
        """w [N, K] -> the same shape in the kernels' order: panels of 32 rows (columns of the
        product), each stored K-major ([K][32]; the last panel [K][N mod 32])."""
        N, K = w.shape
        full = N // PANEL * PANEL
        head = w[:full].reshape(N // PANEL, PANEL, K).transpose(0, 2, 1)
        return np.concatenate((head.reshape(-1), w[full:].T.reshape(-1))).reshape(N, K)

    @staticmethod
    def unpack(w: np.ndarray) -> np.ndarray:
        """The inverse of `pack`."""
        N, K = w.shape
        full = N // PANEL * PANEL
        flat = w.reshape(-1)
        head = flat[:full * K].reshape(N // PANEL, K, PANEL).transpose(0, 2, 1).reshape(full, K)
        return np.concatenate((head, flat[full * K:].reshape(K, N - full).T))

    @classmethod
    def pack_glu(cls, w: np.ndarray) -> np.ndarray:
        """w [2I, K] (gate rows, then up rows) -> `pack` of `interleave_glu(w)`: each panel of 32
        holds the gate and up columns of 16 outputs."""
        return cls.pack(cls.interleave_glu(w))

    @classmethod
    def unpack_glu(cls, w: np.ndarray) -> np.ndarray:
        """The inverse of `pack_glu`."""
        return cls.deinterleave_glu(cls.unpack(w))

    @staticmethod
    def interleave_glu(w: np.ndarray) -> np.ndarray:
        """w [2I, K] (gate rows, then up rows) -> its rows GLU_GROUP at a time: 16 gate, 16 up, ..."""
        I, K = w.shape[0] // 2, w.shape[1]
        pairs = np.stack((w[:I].reshape(I // GLU_GROUP, GLU_GROUP, K), w[I:].reshape(I // GLU_GROUP, GLU_GROUP, K)), 1)
        return pairs.reshape(2 * I, K)

    @staticmethod
    def deinterleave_glu(w: np.ndarray) -> np.ndarray:
        """The inverse of `interleave_glu`."""
        I, K = w.shape[0] // 2, w.shape[1]
        pairs = w.reshape(I // GLU_GROUP, 2, GLU_GROUP, K)
        return np.concatenate((pairs[:, 0].reshape(I, K), pairs[:, 1].reshape(I, K)))


class CpuInt8Linear(nn.Cell):
    """(x [M, K], w [N, Kq] int8 by `pack`, scales [N] float32) -> x W^T [M, N] (glu: silu(x gate^T)
    * (x up^T) [M, N/2]) for a W8A8 layer held as its int8 levels (CausalLM.hold_int8): one kernel
    call quantizes x's rows as the layer's quantizer (sharding.layers.PerTokenInt8) would and sums
    the int8 products exactly with AVX512-VNNI (csrc/matmul.h, linear_vnni). A row split over
    tensor-parallel ranks takes the maximum the quantizer gathers over them."""

    def __init__(self, quantizer, glu: bool = False):
        super().__init__()
        self.quantizer, self.glu = quantizer, glu
        self.op = _custom("LinearGlu" if glu else "Linear", lambda x, w, *_: [x[0], w[0] // 2 if glu else w[0]])

    def scales(self, scales: np.ndarray) -> Tensor:
        """Each output's scale as the kernel takes it (interleaved as `pack` interleaves rows)."""
        scales = np.asarray(scales, np.float32)
        return Tensor(CpuOps.interleave_glu(scales[:, None])[:, 0] if self.glu else scales)

    def pack(self, levels: np.ndarray):
        """int8 levels [N, K] -> (`CpuOps.pack_vnni` of them, its unpack to levels), or None where
        N is not whole panels (the layer then stays in int8 panels)."""
        if levels.shape[0] % (2 * PANEL if self.glu else PANEL):
            return None
        rows = CpuOps.interleave_glu(levels) if self.glu else levels
        K = levels.shape[1]

        def unpack(t: np.ndarray) -> np.ndarray:
            q = CpuOps.unpack_vnni(t, K)
            return CpuOps.deinterleave_glu(q) if self.glu else q
        return CpuOps.pack_vnni(rows), unpack

    def construct(self, x, w, scales):
        if self.quantizer.gather is None:
            return self.op(x, w, scales, self.quantizer.meta)
        return self.op(x, w, scales, self.quantizer.meta, self.quantizer.row_max(x))


class CpuExperts(nn.Cell):
    """A sparse layer's held experts over the grouped kernels (csrc/moe.h; sharding.layers.
    FusedExperts calls it). Float experts: MoeExperts, one call. Experts whose inputs the
    checkpoint quantizes per token (FusedExperts sets `x_quant` and `h_quant`) run in two calls,
    MoeUp (gate|up, silu(gate) * up of each (token, expert) pair) and MoeDown (down, and each
    token's weighted sum), so that a row of silu(gate) * up split over tensor-parallel ranks
    (sliced experts) is quantized with its maximum over all of them, as a row-parallel layer's is.
    With their weights held as int8 levels in VNNI panels (the scales given: W8A8 with VNNI,
    CpuOps.int8_experts), the kernels quantize the rows as the quantizers would and sum the int8
    products exactly (linear_vnni's arithmetic); with weights held otherwise (float panels, or
    int8 panels with their scales inside), the quantizers take the rows to their levels and back
    in between. Int4 experts (W4A16: float inputs) run in one call, their group scales given."""

    def __init__(self):
        super().__init__()
        self.fused = _custom("MoeExperts", lambda x, *_: x)
        self.up = _custom("MoeUp", lambda x, ids, w13, *_: [x[0] * ids[1] if x[0] >= 0 else -1, w13[1] // 2])
        self.down = _custom("MoeDown", lambda h, ids, weights, w2, *_: [ids[0], w2[1]])
        self.x_quant = self.h_quant = None

    def construct(self, x, ids, weights, w13, w2, meta, w13_scale=None, w2_scale=None):
        if self.x_quant is None and self.h_quant is None:
            if w13_scale is not None:        # int4 weights and their group scales (W4A16)
                return self.fused(x, ids, weights, w13, w2, meta, w13_scale, w2_scale)
            return self.fused(x, ids, weights, w13, w2, meta)
        if w13_scale is None:
            if self.x_quant is not None:
                x = self.x_quant(x)
            h = self.up(x, ids, w13, meta)
            if self.h_quant is not None:
                h = self.h_quant(h)
            return self.down(h, ids, weights, w2, meta)
        h = self.up(x, ids, w13, meta, w13_scale, self.x_quant.meta)
        if self.h_quant.gather is None:
            return self.down(h, ids, weights, w2, meta, w2_scale, self.h_quant.meta)
        return self.down(h, ids, weights, w2, meta, w2_scale, self.h_quant.meta, self.h_quant.row_max(h))


class CpuInt4Linear(nn.Cell):
    """(x [M, K], w [N, K/2] uint8 by `pack`, scales [N, K/g] float32 by `scales`) -> x W^T [M, N]
    (glu: silu(x gate^T) * (x up^T) [M, N/2]) for a W4A16 layer held as its int4 levels with a
    scale per group of g inputs (CausalLM.hold_int8): each weight widened and scaled to its
    dequantized float32 value as the kernel reads it (csrc/matmul.h, int4_rows), so the result is the
    float32 panels' from an eighth of their bytes."""

    def __init__(self, group: int, glu: bool = False):
        super().__init__()
        self.group, self.glu = group, glu
        self.weight_dtype = ms.uint8          # (LinearBase.hold_int8)
        self.op = _custom("LinearGlu" if glu else "Linear", lambda x, w, *_: [x[0], w[0] // 2 if glu else w[0]])

    def pack(self, levels: np.ndarray):
        """int4 levels [N, K] (-8..7, int8) -> uint8 [N, K/2]: panels of 32 columns, each [K][16],
        byte c of k holding column c's level + 8 in its low nibble and column c + 16's in its high
        one (a last, narrower panel of W columns [K][W/2], column c + W/2's in the high nibble; gate
        and up interleaved for glu); and its unpack to the levels. None where N is odd (glu: not
        whole panels) or K is odd or not whole groups."""
        N, K = levels.shape
        if N % 2 or K % 2 or K % self.group or (self.glu and N % PANEL):
            return None
        rows = CpuOps.interleave_glu(levels) if self.glu else levels
        u = (rows.astype(np.int16) + 8).astype(np.uint8)
        packed = np.concatenate([self._nibbles(u[c:c + PANEL]).reshape(-1) for c in range(0, N, PANEL)])

        def unpack(t: np.ndarray) -> np.ndarray:
            flat, parts = t.reshape(-1), []
            for c in range(0, N, PANEL):
                W = min(PANEL, N - c)
                b = flat[c * K // 2:(c + W) * K // 2].reshape(K, W // 2).T
                parts.append(np.concatenate((b & 0x0F, b >> 4)))
            q = (np.concatenate(parts).astype(np.int16) - 8).astype(np.int8)
            return CpuOps.deinterleave_glu(q) if self.glu else q
        return packed.reshape(N, K // 2), unpack

    @staticmethod
    def _nibbles(u: np.ndarray) -> np.ndarray:
        """A panel's W columns of levels + 8 [W, K] -> [K][W/2] bytes: column c low, c + W/2 high."""
        half = u.shape[0] // 2
        return np.ascontiguousarray((u[:half] | (u[half:] << 4)).T)

    def scales(self, group_scales: np.ndarray) -> Tensor:
        """The group scales [N, K/g] in the panels' order (`panel_scales`)."""
        return Tensor(self.panel_scales(group_scales, self.glu))

    @staticmethod
    def panel_scales(group_scales: np.ndarray, glu: bool = False) -> np.ndarray:
        """Group scales [N, K/g] -> each panel's [K/g][32] ([K/g][W] for a last, narrower one),
        gate and up interleaved for glu, float32, held as [N, K/g]."""
        s = np.asarray(group_scales, np.float32)
        if glu:
            s = CpuOps.interleave_glu(s)
        N, groups = s.shape
        return np.concatenate([s[c:c + PANEL].T.reshape(-1) for c in range(0, N, PANEL)]).reshape(N, groups)

    def construct(self, x, w, scales):
        return self.op(x, w, scales)


def stacked(packed: list) -> tuple:
    """Each expert's (packed, unpack), all packed alike -> (the packed experts stacked, the unpack
    of such a stack)."""
    unpack = packed[0][1]
    return np.stack([p for p, _ in packed]), lambda t: np.stack([unpack(e) for e in t])


def bfloat16_bits(w: np.ndarray) -> np.ndarray:
    """The bfloat16 bits (uint16) of float32 values, truncated: exact for values that are bfloat16."""
    return (np.ascontiguousarray(w, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bfloat16_rounded(w: np.ndarray) -> np.ndarray:
    """The bits (uint16) of float32 values rounded to the nearest bfloat16, ties to even, as
    csrc/common.h's bf16_rounded rounds x: a NaN stays a quiet NaN, a denormal becomes a zero of its
    sign (VDPBF16PS reads denormals as zero)."""
    u = np.ascontiguousarray(w, np.float32).view(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    bits = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan, tiny = a > np.uint32(0x7F800000), a < np.uint32(0x00800000)
    bits[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    bits[tiny] = ((u[tiny] >> 16) & np.uint32(0x8000)).astype(np.uint16)
    return bits


def bfloat16_values(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 bits (uint16): the inverse of `bfloat16_bits`."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def is_bfloat16(w: np.ndarray) -> bool:
    """Whether every value of a float32 array is a bfloat16 value (its low 16 bits zero)."""
    bits = np.ascontiguousarray(w).view(np.uint16).reshape(-1, 2)
    return not bits[:, 0].any()          # little-endian: the low half of each float32 comes first


class SamplerKernels:
    """The device sampler's passes over vocabulary shards (worker.device_sampler.VocabSampler:
    stats, kept, draw, score's count; and all of `sample` in one, at tp 1) as the kernels of
    csrc/sampling.h: x [R M, per] float32 (R shards' rows), meta [R, 2] int32 (each shard's real
    columns, and whether `stats` sums), parameters per row of a shard."""

    @staticmethod
    def stats(C: int, temperature: bool = False):
        """(x, [t [M]], meta) -> [R M, 4 + 2C]: max, its column, sum exp(x - max), sum
        exp((x - max) / t) (with `temperature`, where t > 0), the C largest, their columns."""
        if temperature:
            return _custom("SampleStatsT", lambda x, *_: [x[0], 4 + 2 * C])
        return _custom("SampleStats", lambda x, meta: [x[0], 4 + 2 * C])

    @staticmethod
    def greedy():
        """(x [M, per], meta [1, 2]) -> [M] int32: each row's greedy token (stats' column, R = 1)."""
        return _custom("GreedyRows", lambda x, *_: [x[0]], lambda *_: ms.int32)

    @staticmethod
    def kept():
        """(x, (g, t, tau) [M, 3], meta) -> [R M]: the sum of the kept weights."""
        return _custom("KeptMass", lambda x, *_: [x[0]])

    @staticmethod
    def count():
        """(x, thresholds [M], meta) -> [R M]: each row's real columns at or above its threshold."""
        return _custom("CountAtLeast", lambda x, *_: [x[0]])

    @staticmethod
    def draw():
        """(x, (g, t, tau) [M, 3], target [R M], meta) -> [R M, 2]: the drawn column, x there."""
        return _custom("DrawColumn", lambda x, *_: [x[0], 2])

    @staticmethod
    def merge(K: int):
        """(every rank's stats [tp M, 4 + 2C], (temperature, top_k, top_p, min_p, u) [M, 5], every
        rank's kept sum under log(min_p) [tp M], the ranks' first columns [tp]) -> [M, 2 + 2K + 5]:
        the token (-1: drawn from a shard), its log-probability, the K most likely tokens'
        and their ids, and (owner rank, target, g, t, tau) of a draw from a shard."""
        return _custom("SampleMerge", lambda st, prm, *_: [prm[0], 2 + 2 * K + 5])

    @staticmethod
    def process():
        """(x, entries [E, 5], mask [M, W] int32, meta [R, 3] int32) -> x as the sampling
        parameters that change it leave it (VocabSampler.process)."""
        return _custom("ProcessRows", lambda x, *_: x)

    @staticmethod
    def sample(K: int):
        """(x [M, vocab], (temperature, top_k, top_p, min_p, u) [M, 5], (real columns, C) [1, 2]
        int32) -> [M, 2 + 2K]: the token, its log-probability, the K most likely tokens'
        log-probabilities and their ids; the whole of VocabSampler.sample at tp 1."""
        return _custom("SampleRows", lambda x, *_: [x[0], 2 + 2 * K])


def _custom(func: str, out_shape, out_dtype=lambda x, *_: x):
    """Kernel `func` of the library as a MindSpore operator; its output has the first input's
    dtype unless out_dtype says otherwise."""
    return ops.Custom(f"{_LIBRARY}:{func}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot")


class NodeAllReduce(nn.Cell):
    """The sum of a tensor over a tensor-parallel group whose ranks share this node, through the
    segment they have mapped (worker.device.join_node_group; worker/csrc/collective.h): the
    library's NodeAllReduce with this call site's tag, the count of sites built before it in this
    process, so that ranks building the same networks give each site the same tag."""
    sites = 0
    kernel = "NodeAllReduce"

    def __init__(self):
        super().__init__()
        NodeAllReduce.sites += 1
        self.tag = Tensor(np.array([NodeAllReduce.sites], np.int32))
        self.op = _custom(self.kernel, self.shape)

    @staticmethod
    def shape(x, tag):
        return x

    def construct(self, x):
        return self.op(x, self.tag)


class NodeAllGather(NodeAllReduce):
    """Every rank's tensor [n, ...], rank after rank [world n, ...], as MindSpore's AllGather gives
    them, through the node group's segment (the library's NodeAllGather)."""
    world = 0             # the node group's ranks (attach_node_group)
    kernel = "NodeAllGather"

    @staticmethod
    def shape(x, tag):
        return [NodeAllGather.world * x[0], *x[1:]]


def attach_node_group(segment: memoryview, rank: int, world: int, slot_bytes: int, timeout_s: float) -> bool:
    """Gives the library's NodeAllReduce and NodeAllGather this rank's group: the mapped `segment`
    (its header, then two buffers of `world` slots of `slot_bytes`), and how long a rank waits for
    the others."""
    fn = ctypes.CDLL(_LIBRARY).NodeGroupAttach
    fn.restype = ctypes.c_int
    fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_double)
    base = ctypes.addressof(ctypes.c_char.from_buffer(segment))
    NodeAllGather.world = world
    return fn(base, len(segment), rank, world, slot_bytes, timeout_s) == 0


def set_bf16_dot(on: bool) -> bool:
    """Whether the kernels compute bfloat16 pairs (`CpuOps.pack_pairs`) with VDPBF16PS: `on` where
    the library was built for a CPU with AVX512-BF16, else never (FMAs, to the same bits).
    MSINFER_BF16_DOT=0 turns it off, as for a CPU without it. Returns what is now in force."""
    lib = ctypes.CDLL(_LIBRARY)
    CpuOps.bf16_dot = bool(on) and bool(lib.Bf16DotReady())
    lib.SetBf16Dot(ctypes.c_int(int(CpuOps.bf16_dot)))
    return CpuOps.bf16_dot


def peak_flops():
    """The library's PeakFlops(kind, iterations, x) -> FLOPs (worker/csrc/kernels.cc): kind 0 float32
    FMAs, 1 VDPBF16PS; -1 where the library has no such loop (scripts/roofline.py times it)."""
    fn = ctypes.CDLL(_LIBRARY).PeakFlops
    fn.restype, fn.argtypes = ctypes.c_double, (ctypes.c_int, ctypes.c_int64, ctypes.c_float)
    return fn


def load_kernels(threads: int = 0) -> None:
    """Builds (once per machine) and loads the CPU kernels; `threads` of theirs, the caller's
    included (0: every core), as many as the worker gives MindSpore."""
    global _LIBRARY, _RMS_NORM, _ADD_RMS_NORM, _SILU_MUL, _ROWS, _ROPE
    _LIBRARY = kernel_library("kernels")
    lib = ctypes.CDLL(_LIBRARY)                        # the same library MindSpore opens
    lib.SetThreads(ctypes.c_int(threads or os.cpu_count() or 1))
    CpuOps.amx = bool(lib.AmxReady()) and os.environ.get("MSINFER_AMX", "1") != "0"
    CpuOps.vnni = bool(lib.VnniReady()) and os.environ.get("MSINFER_VNNI", "1") != "0"
    CpuOps.int4 = bool(lib.Int4Ready()) and os.environ.get("MSINFER_INT4", "1") != "0"
    CpuOps.bf16_panels = bf16_panels_on()
    CpuOps.fused_layers = os.environ.get("MSINFER_FUSED_LAYERS", "1") != "0"
    CpuOps.static_step_jit_options = INFERENCE_MODE if os.environ.get("MSINFER_INFER_BOOST", "1") != "0" else None
    set_bf16_dot(os.environ.get("MSINFER_BF16_DOT", "1") != "0")
    CpuOps.greedy_head = CpuOps.bf16_dot and os.environ.get("MSINFER_GREEDY_HEAD", "1") != "0"
    lib.SetAlone(ctypes.c_int(int(os.environ.get("MSINFER_ALONE", "1") != "0")))
    lib.SetSteal(ctypes.c_int(int(os.environ.get("MSINFER_STEAL", "1") != "0")))
    CpuOps.sampler_kernels = SamplerKernels
    _RMS_NORM = _custom("RmsNorm", lambda x, *_: x)
    _ADD_RMS_NORM = _custom("AddRmsNorm", lambda x, *_: (x, x), lambda x, *_: (x, x))
    _SILU_MUL = _custom("SiluMul", lambda x: [*x[:-1], x[-1] // 2])
    _ROWS = _custom("Rows", lambda x, index: [index[0], x[1]])
    _ROPE = _custom("RopeTables", lambda p, f, _: ([p[0], f[1]], [p[0], f[1]]), lambda p, *_: (p, p))
