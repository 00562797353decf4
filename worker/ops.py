"""The device seam: the handful of per-device operators the network uses, chosen once per worker.

`CpuOps` (runs here, and anywhere) composes portable MindSpore primitives:
    rms_norm      x * rsqrt(mean(x^2) + eps) * w, in float32
    rotary        q*cos + rotate_half(q)*sin (the Hugging Face, non-interleaved layout)
    cache write   ScatterUpdate of the new K/V rows into the flat cache ([slots * kv_heads, D])
    attention     a paged-attention kernel of our own (worker/csrc), a MindSpore AOT custom
                  operator: each token reads its sequence's K/V rows through the block table,
                  with no gathered copy and no mask; compiled with the machine's C++ compiler
                  on first use and cached (`kernel_library`)
`AscendOps` swaps in MindSpore's fused Ascend kernels where they exist (RmsNorm); it needs an
Ascend card and is not exercised on the CPU. Its attention still has to be wired to MindSpore's
Ascend PagedAttention kernel, which takes the same block tables.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
import platform
import shutil
import subprocess

import mindspore as ms
from mindspore import ops

CSRC = Path(__file__).with_name("csrc")
CXXFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-pthread")


def kernel_library(name: str) -> str:
    """Path of csrc/<name>.cc built as a shared library for this machine. Built once per source,
    flags and CPU (-march=native), into $MSINFER_CACHE or ~/.cache/msinfer/kernels; a build by
    another process at the same time is harmless (each writes its own file, then renames)."""
    src = CSRC / f"{name}.cc"
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError(f"msinfer's CPU attention kernel ({src.name}) needs a C++ compiler: install g++ "
                           "or set CXX")
    cpu = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith("flags")), "")
    key = hashlib.sha256(src.read_bytes() + " ".join((cxx, *CXXFLAGS, platform.machine(), cpu)).encode())
    root = Path(os.environ.get("MSINFER_CACHE") or Path.home() / ".cache" / "msinfer") / "kernels"
    lib = root / f"{name}-{key.hexdigest()[:16]}.so"
    if not lib.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        run = subprocess.run([cxx, *CXXFLAGS, str(src), "-o", str(tmp)], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"building {src} with {cxx} failed:\n{run.stderr[-2000:]}")
        os.replace(tmp, lib)
    return str(lib)


class CpuOps:
    name = "cpu"

    # MindSpore's CPU kernel for an elementwise op between tensors of different shapes builds an
    # index table per output element when it first runs a shape (seconds, and ~19 MB a kernel at
    # 2048 x 576, kept for the graph's life). Every operand is therefore broadcast explicitly,
    # which costs one copy, and the elementwise ops all see equal shapes.

    @staticmethod
    def rms_norm(x, weight, eps):
        x32 = x.astype(ms.float32)
        var = ops.mean(x32 * x32, -1, keep_dims=True)
        y = (x32 * ops.broadcast_to(ops.rsqrt(var + eps), x32.shape)).astype(x.dtype)
        return y * ops.broadcast_to(weight, y.shape)

    @staticmethod
    def rotary(x, cos, sin):
        """x [N, heads, D]; cos/sin [N, heads, D/2] (broadcast once per step, see `rope_tables`)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return ops.concat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    @staticmethod
    def rope_tables(cos, sin, heads):
        """cos/sin [N, D/2] -> [N, heads, D/2], as `rotary` takes them."""
        shape = (cos.shape[0], heads, cos.shape[1])
        return ops.broadcast_to(cos.expand_dims(1), shape), ops.broadcast_to(sin.expand_dims(1), shape)

    @staticmethod
    def write_index(slots, kv_heads):
        """The cache is [slots * kv_heads, D], head-minor: the rows a step's new K/V go to, [N, KV]."""
        N = slots.shape[0]
        heads = ops.arange(kv_heads, dtype=ms.int32)
        return ops.broadcast_to(slots.reshape(N, 1) * kv_heads, (N, kv_heads)) + \
            ops.broadcast_to(heads.reshape(1, kv_heads), (N, kv_heads))

    @staticmethod
    def write_cache(cache, index, rows):
        """cache [slots*KV, D] (a Parameter, updated in place); index [N, KV]; rows [N, KV, D]."""
        return ops.scatter_update(cache, index, rows)

    @staticmethod
    def attention_op():
        """The paged-attention operator (worker/csrc/paged_attention.cc, built on first use):
        (q [N, H, D], k_cache, v_cache, block_tables [M, MB], rows [N], lens [N], meta [3]) -> [N, H, D].
        Each token attends over the first lens[n] positions of sequence rows[n], read from the cache
        through its block table."""
        return ops.Custom(f"{kernel_library('paged_attention')}:PagedAttention",
                          out_shape=lambda q, *_: q, out_dtype=lambda q, *_: q, func_type="aot")


class AscendOps(CpuOps):
    """Fused Ascend kernels (MindSpore's LLM inference tutorial). Not runnable on the CPU."""
    name = "ascend"

    @staticmethod
    def rms_norm(x, weight, eps):
        return ops.rms_norm(x, weight, eps)[0]


def select_ops(device: str):
    return AscendOps if device == "ascend" else CpuOps
