"""The device seam: the handful of per-device operators the network uses, chosen once per worker.

    rms_norm      x * rsqrt(mean(x^2) + eps) * w, in float32 (a cell per eps: `rms_norm_op`)
    rotary        q*cos + rotate_half(q)*sin (the Hugging Face, non-interleaved layout)
    silu_mul      silu(gate) * up
    attention     the new K/V rows into the layer's cache, then attention: among the step's own
                  tokens for a prefill with nothing cached, else paged (each token reads its
                  sequence's K/V rows through the block table)
    linear        x w^T, and the embedding lookup, both over weights the device may reorder
                  (`pack_weight`) once they are loaded

`MsOps` writes them in portable MindSpore primitives (`model.ops: portable`). `CpuOps` replaces
them with kernels of our own (worker/csrc/kernels.cc), MindSpore AOT custom operators compiled
with the machine's C++ compiler on first use and cached (`kernel_library`): one call where
MindSpore's CPU backend runs 5-10 small kernels, and attention with no gathered copy of K/V and
no mask. `worker.ascend.AscendOps` calls MindSpore's fused Ascend kernels.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
from pathlib import Path
import platform
import shutil
import subprocess

import mindspore as ms
from mindspore import Tensor, nn, ops
import numpy as np

CSRC = Path(__file__).with_name("csrc")
CXXFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=fast", "-std=c++17", "-shared",
            "-fPIC", "-pthread")
PANEL = 32     # kernels.cc kPanel: the column panels of a packed weight
GLU_GROUP = PANEL // 2      # outputs per panel of LinearGlu
TILE = 32      # kernels.cc amx_rows: N and K of a weight in bfloat16 tiles are multiples of this


def kernel_library(name: str) -> str:
    """Path of csrc/<name>.cc built as a shared library for this machine. Built once per source,
    flags and CPU (-march=native), into $MSINFER_CACHE or ~/.cache/msinfer/kernels, by one
    process at a time (a file lock; the others then find it built)."""
    src = CSRC / f"{name}.cc"
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError(f"msinfer's CPU kernels ({src}) need a C++ compiler: install g++ or set CXX")
    cpu = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith("flags")), "")
    key = hashlib.sha256(src.read_bytes() + " ".join((cxx, *CXXFLAGS, platform.machine(), cpu)).encode())
    root = Path(os.environ.get("MSINFER_CACHE") or Path.home() / ".cache" / "msinfer") / "kernels"
    lib = root / f"{name}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return str(lib)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:       # the ranks of a node build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            tmp = lib.with_suffix(f".{os.getpid()}.tmp")
            run = subprocess.run([cxx, *CXXFLAGS, str(src), "-o", str(tmp)], capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"building {src} with {cxx} failed:\n{run.stderr[-2000:]}")
            os.replace(tmp, lib)
    return str(lib)


def rms_norm(x, weight, eps: float):
    """(x * rsqrt(mean(x^2) + eps) * weight, rsqrt(...)) in MindSpore primitives, in float32
    whatever x's dtype."""
    x32 = x.astype(ms.float32)
    rstd = ops.rsqrt(ops.mean(x32 * x32, -1, keep_dims=True) + eps)
    y = (x32 * ops.broadcast_to(rstd, x32.shape)).astype(x.dtype)
    return y * ops.broadcast_to(weight, y.shape), rstd


class RmsNorm(nn.Cell):
    """`rms_norm` as a cell with its eps: (x, weight) -> normalized x."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def construct(self, x, weight):
        return rms_norm(x, weight, self.eps)[0]


# The score of a position a token must not see. Finite, so that a padding token that sees nothing
# (static shapes) gets a uniform average instead of NaN; exp() of it is 0 in float32.
MASKED = -1e30


def _softmax_pv(scores, visible, v):
    """softmax over the last axis of float32 scores [..., L] where `visible` (broadcast to them),
    then times v [..., L, D] in v's dtype."""
    scores = ops.select(ops.broadcast_to(visible, scores.shape), scores, ops.full_like(scores, MASKED))
    return ops.bmm(ops.softmax(scores, -1).astype(v.dtype), v)


def paged_attention(q, k_cache, v_cache, tables, lens, scale: float, bias=None):
    """Each token n of q [N, H, D] attends over the first lens[n] positions of its sequence, whose
    cache blocks are tables[n] [MB], in caches [blocks, block_size, KV, D]; `bias` [N, MB *
    block_size] (or [1, 1]) is added to its scores. Query head h reads KV head h // (H / KV).
    The K/V rows are gathered ([N, MB * block_size, KV, D]): memory grows with N x the table width."""
    N, H, D = q.shape
    bs, KV = k_cache.shape[1], k_cache.shape[2]
    L = tables.shape[1] * bs
    k = ops.gather(k_cache, tables, 0).reshape(N, L, KV, D).transpose(0, 2, 3, 1)       # [N, KV, D, L]
    v = ops.gather(v_cache, tables, 0).reshape(N, L, KV, D).transpose(0, 2, 1, 3)       # [N, KV, L, D]
    scores = ops.bmm(q.reshape(N, KV, H // KV, D), k).astype(ms.float32) * scale      # [N, KV, G, L]
    if bias is not None:
        scores = scores + ops.broadcast_to(bias.astype(ms.float32), (N, L)).reshape(N, 1, 1, L)
    visible = (ops.arange(L, dtype=ms.int32).reshape(1, L) < lens.reshape(N, 1)).reshape(N, 1, 1, L)
    return _softmax_pv(scores, visible, v).reshape(N, H, D)


def packed_attention(q, k, v, token_seq, scale: float, causal: bool = True):
    """Attention among a step's own tokens, nothing read from the cache (a prefill of sequences with
    nothing cached): q [N, H, D], k and v [N, KV, D], packed one sequence after another; token i
    sees token j of the same sequence (token_seq) with j <= i (causal). Scores are [H, N, N]."""
    N, H, D = q.shape
    KV = k.shape[1]
    G = H // KV
    qh = q.reshape(N, KV, G, D).transpose(1, 2, 0, 3).reshape(KV, G * N, D)
    scores = ops.bmm(qh, k.transpose(1, 2, 0)).astype(ms.float32) * scale                 # [KV, G*N, N]
    visible = token_seq.reshape(N, 1) == token_seq.reshape(1, N)
    if causal:
        index = ops.arange(N, dtype=ms.int32)
        visible = ops.logical_and(visible, index.reshape(1, N) <= index.reshape(N, 1))
    visible = ops.broadcast_to(visible.reshape(1, 1, N, N), (KV, G, N, N)).reshape(KV, G * N, N)
    out = _softmax_pv(scores, visible, v.transpose(1, 0, 2))                              # [KV, G*N, D]
    return out.reshape(KV, G, N, D).transpose(2, 0, 1, 3).reshape(N, H, D)


class PortableAttention(nn.Cell):
    """Cache write and attention of one layer in MindSpore primitives. Caches [blocks, block_size,
    KV, D] (the layout Ascend's kernels take); the new rows go in with ScatterNdUpdate at (slot //
    block_size, slot % block_size). A prefill with nothing cached attends among its own tokens
    (`packed_attention`); every other step reads K/V through the block tables (`paged_attention`)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype):
        super().__init__()
        self.scale = head_dim ** -0.5
        self.block_size = block_size

    def construct(self, q, k, v, k_cache, v_cache, ctx, prefill: bool):
        slot_mapping, block_tables, _, _, token_seq, token_len, _ = ctx
        at = ops.stack((slot_mapping // self.block_size, slot_mapping % self.block_size), -1)
        written = ops.depend(ops.scatter_nd_update(k_cache, at, k), ops.scatter_nd_update(v_cache, at, v))
        q = ops.depend(q, written)
        if prefill:
            return packed_attention(q, k, v, token_seq, self.scale)
        return paged_attention(q, k_cache, v_cache, ops.gather(block_tables, token_seq, 0), token_len, self.scale)


class MsOps:
    """The network's operators in portable MindSpore primitives (`model.ops: portable`): any
    device target, no kernel of ours, dynamic shapes. The base of the other devices' seams."""
    name = "portable"
    # Weights as Hugging Face stores them, MindSpore's MatMul (transpose_b) and Gather.
    linear_op = embed_op = pack_weight = None
    glu_linear_op = None      # gate/up projection and silu-mul in one (CpuOps)
    # a sparse layer's experts grouped by routing, and their weights' order (CpuOps, AscendOps;
    # without: every expert on every token, sharding.layers.FusedExperts)
    moe_op = pack_experts = None
    pad_id = 0          # the token id of a step's padding rows (worker/runner.py): any valid id
    dynamic_shapes = True     # one graph per step kind (worker/runner.py); False: power-of-two buckets
    paged_mask = False        # whether paged steps take an additive causal mask input (AscendOps)
    fused_attention = False   # True: the attention op takes the qkv projection whole (CpuOps)
    jit_options: dict = {}    # options of mindspore.jit for the step graphs
    phases: dict | None = None   # step kind -> the network's `phase` while it runs (AscendOps)
    # MindSpore's CPU kernel for an elementwise op between tensors of different shapes builds an
    # index table per output element when it first runs a shape (seconds, and ~19 MB a kernel at
    # 2048 x 576, kept for the graph's life). Every operand is therefore broadcast explicitly,
    # which costs one copy, and the elementwise ops all see equal shapes.

    @staticmethod
    def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple:
        return (num_blocks, block_size, kv_heads, head_dim)

    @staticmethod
    def rms_norm_op(eps: float):
        """A cell (x [..., H], weight [H]) -> x normalized over H, times weight."""
        return RmsNorm(eps)

    @staticmethod
    def rope_tables(cos, sin, heads):
        """cos/sin [N, D/2] -> the tables `rotary` takes, built once per step: [N, heads, D/2]."""
        shape = (cos.shape[0], heads, cos.shape[1])
        return ops.broadcast_to(cos.expand_dims(1), shape), ops.broadcast_to(sin.expand_dims(1), shape)

    @staticmethod
    def rotary(x, cos, sin):
        """x [N, heads, D]; cos/sin from `rope_tables`."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return ops.concat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    @staticmethod
    def silu_mul(gate_up):
        """[N, 2I] (gate | up) -> silu(gate) * up [N, I]."""
        half = gate_up.shape[-1] // 2
        return ops.silu(gate_up[:, :half]) * gate_up[:, half:]

    @staticmethod
    def rows(x, index):
        """x [N, H] -> rows index [M] of it; an index of -1 (a padding row) may give any row."""
        return ops.gather(x, ops.maximum(index, ops.zeros_like(index)), 0)

    @staticmethod
    def attention(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype):
        """A cell (q [N, H, D], k and v [N, KV, D] (rotated), k_cache, v_cache, ctx, prefill) -> [N, H, D]
        that writes the new K/V rows and attends; ctx is CausalLM's step context."""
        return PortableAttention(heads, kv_heads, head_dim, block_size, dtype)

    @staticmethod
    def moe_router(k: int):
        """A cell (router logits [N, E]) -> (the top k of their softmax [N, k] float32, largest
        first, not renormalized; their experts [N, k] int32), as transformers routes."""
        return TopKRouter(k)


class TopKRouter(nn.Cell):
    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def construct(self, logits):
        weights, ids = ops.topk(ops.softmax(logits.astype(ms.float32), -1), self.k)
        return weights, ids.astype(ms.int32)


# The kernels' library and primitives, set by `load_kernels` before any network that uses them
# is built.
_LIBRARY = _RMS_NORM = _SILU_MUL = _ROWS = None


class CpuRmsNorm(nn.Cell):
    def __init__(self, eps: float):
        super().__init__()
        self.eps = Tensor(np.array([eps], np.float32))

    def construct(self, x, weight):
        return _RMS_NORM(x, weight, self.eps)


class CpuOps(MsOps):
    """MsOps with the kernels of worker/csrc/kernels.cc (see its header) in place of the
    elementwise chains, attention, every matmul and the embedding lookup (over packed weights).
    MindSpore 2.10 runs custom operators in static shapes only ("The pointer[value] is null" at the
    first call of a dynamic-shape graph), so steps run in power-of-two buckets (worker/runner.py)."""
    name = "cpu"
    # Padding rows embed to zeros, every kernel keeps a zero row zero (attention gives zeros for a
    # token that sees nothing) and `linear` skips zero rows: a padded step costs its real tokens.
    # (A layer with a bias makes them non-zero from there on; they are then computed, as before.)
    pad_id = -1
    dynamic_shapes = False

    @staticmethod
    def cache_shape(num_blocks, block_size, kv_heads, head_dim):
        return (num_blocks * block_size * kv_heads, head_dim)   # row (slot * KV + head), the same bytes

    @staticmethod
    def rms_norm_op(eps):
        return CpuRmsNorm(eps)

    @staticmethod
    def rope_tables(cos, sin, heads):
        return cos, sin                       # the kernel reads [N, D/2] for every head

    @staticmethod
    def rows(x, index):
        return _ROWS(x, index)                # -1 gives a zero row, which `linear` then skips

    @staticmethod
    def silu_mul(gate_up):
        return _SILU_MUL(gate_up)

    fused_attention = True

    @staticmethod
    def attention_op(q_size: int):
        """(qkv [N, (H + 2 KV) D], q_norm [D], k_norm [D], (eps, qk norm?) [2], cos, sin, k_cache,
        v_cache, slots, block_tables, token_seq, token_len, meta) -> [N, H D]: q/k norm, rotary,
        cache write and attention in one kernel (kernels.cc), straight from the qkv projection."""
        return _custom("PagedAttention", lambda qkv, *_: [qkv[0], q_size])

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
        """(x [N, H], ids [N, k] int32, weights [N, k], w13 [E, 2I, H], w2 [E, H, I] packed by
        `pack_experts`, meta (first expert held, glu) [2] int32) -> [N, H]: each held expert's
        tokens gathered and passed through its weights once (sharding.layers.FusedExperts)."""
        return _custom("MoeExperts", lambda x, *_: x)

    @classmethod
    def pack_experts(cls, w: np.ndarray, glu: bool = False):
        """Stacked expert weights [E, N, K] -> each expert packed as `pack` (`pack_glu`) packs a
        weight, and the unpack. Panels of the weight's dtype only: the grouped kernel has no tiles."""
        pack, unpack = (cls.pack_glu, cls.unpack_glu) if glu else (cls.pack, cls.unpack)
        return (np.stack([pack(e) for e in w]) if len(w) else w,
                lambda t: np.stack([unpack(e) for e in t]) if len(t) else t)

    @staticmethod
    def embed_op():
        """(w [V, H] packed, ids [N]) -> rows [N, H], zeros for ids outside [0, V); float32 from a
        table in bfloat16 tiles."""
        return _custom("Embed", lambda w, ids: [ids[0], w[1]],
                       lambda w, ids: ms.float32 if w.element_type() == ms.int16 else w)

    # Whether Linear and Embed take bfloat16 weights in AMX tiles (kernels.cc, amx_rows): set by
    # load_kernels; MSINFER_AMX=0 turns it off.
    amx = False

    @classmethod
    def pack_weight(cls, w: np.ndarray, glu: bool = False):
        """A loaded weight [N, K] in the order the kernels read -> (packed array, its unpack).
        A float32 weight whose values are all bfloat16 (a bfloat16 checkpoint's, unless an adapter
        was merged into it), with N and K multiples of 32, goes to bfloat16 AMX tiles where the CPU
        has them (int16, half the bytes; products still at float32 accuracy); any other to panels
        of its own dtype. glu: gate and up rows of LinearGlu, interleaved GLU_GROUP at a time."""
        N, K = w.shape
        if cls.amx and w.dtype == np.float32 and N % TILE == 0 and K % TILE == 0 and is_bfloat16(w):
            if glu:
                return cls.pack_tiles(cls.interleave_glu(w)), lambda t: cls.deinterleave_glu(cls.unpack_tiles(t))
            return cls.pack_tiles(w), cls.unpack_tiles
        return (cls.pack_glu(w), cls.unpack_glu) if glu else (cls.pack(w), cls.unpack)

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
        return (bits.astype(np.uint32) << 16).view(np.float32)

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


def bfloat16_bits(w: np.ndarray) -> np.ndarray:
    """The bfloat16 bits (uint16) of float32 values, truncated: exact for values that are bfloat16."""
    return (np.ascontiguousarray(w, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def is_bfloat16(w: np.ndarray) -> bool:
    """Whether every value of a float32 array is a bfloat16 value (its low 16 bits zero)."""
    bits = np.ascontiguousarray(w).view(np.uint16).reshape(-1, 2)
    return not bits[:, 0].any()          # little-endian: the low half of each float32 comes first


def _custom(func: str, out_shape, out_dtype=lambda x, *_: x):
    """Kernel `func` of the library as a MindSpore operator; its output has the first input's
    dtype unless out_dtype says otherwise."""
    return ops.Custom(f"{_LIBRARY}:{func}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot")


def load_kernels(threads: int = 0) -> None:
    """Builds (once per machine) and loads the CPU kernels; `threads` of theirs, the caller's
    included (0: every core), as many as the worker gives MindSpore."""
    global _LIBRARY, _RMS_NORM, _SILU_MUL, _ROWS
    _LIBRARY = kernel_library("kernels")
    lib = ctypes.CDLL(_LIBRARY)                        # the same library MindSpore opens
    lib.SetThreads(ctypes.c_int(threads or os.cpu_count() or 1))
    CpuOps.amx = bool(lib.AmxReady()) and os.environ.get("MSINFER_AMX", "1") != "0"
    _RMS_NORM = _custom("RmsNorm", lambda x, *_: x)
    _SILU_MUL = _custom("SiluMul", lambda x: [*x[:-1], x[-1] // 2])
    _ROWS = _custom("Rows", lambda x, index: [index[0], x[1]])


def select_ops(device: str, ops_choice: str = "auto", threads: int = 0, emulate: bool = False):
    """The device seam of a worker: `model.ops` portable, or the device's fastest (auto): the CPU
    kernels, or Ascend's fused kernels (their CPU stand-ins with `emulate`)."""
    if ops_choice == "portable":
        return MsOps
    if device == "ascend":
        from msinfer.worker.ascend import AscendOps, EmulatedAscendOps
        return EmulatedAscendOps if emulate else AscendOps
    load_kernels(threads)
    return CpuOps
