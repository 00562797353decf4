"""The CPU kernels' library: worker/csrc/*.cc built with the machine's C++ compiler, once per
version of the sources, flags and CPU, into $MSINFER_CACHE or ~/.cache/msinfer/kernels.

No MindSpore here: the driver of a job on an embedded Ray starts the build (`start_build`) before
Ray, so that it runs while Ray starts and the workers import MindSpore; a worker's own
`kernel_library` call then finds the library built, or waits on the build's lock. A first run on
a new machine otherwise starts building only once a worker loads its model, ~6 s in.

    python -m msinfer.worker.build [NAME]      builds it (what `start_build` runs)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path
import platform
import re
import shutil
import subprocess
import sys
import tempfile

from msinfer.sharding.config import cache_root

CSRC = Path(__file__).with_name("csrc")
CXXFLAGS = ("-fopenmp-simd", "-fno-math-errno", "-ffp-contract=fast", "-std=c++17", "-fPIC", "-pthread")


def cxxflags() -> tuple[str, ...]:
    """The compiler's flags: for this machine's CPU (-march=native), or for the one GCC names in
    MSINFER_KERNEL_ARCH (haswell: AVX2 and FMA without AVX-512), so that this machine runs the
    kernels an older CPU gets (tests/test_kernels.py builds them for Haswell)."""
    arch = os.environ.get("MSINFER_KERNEL_ARCH") or "native"
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", arch):
        raise RuntimeError(f"MSINFER_KERNEL_ARCH={arch!r} is not a CPU name GCC's -march takes (such as haswell)")
    return ("-O3", f"-march={arch}", *CXXFLAGS)


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError(f"msinfer's CPU kernels ({CSRC}/*.cc) need a C++ compiler: install g++ or set CXX")
    return cxx


def library_path(name: str, cxx: str) -> Path:
    """Where library `name` built by `cxx` is cached: named by the sources (the .cc files and their
    headers), the compiler, the flags and the CPU's flags (-march=native)."""
    cpu = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith("flags")), "")
    sources = b"".join(f.read_bytes() for f in sorted(CSRC.glob("*.[ch]*")))
    key = hashlib.sha256(sources + " ".join((cxx, *cxxflags(), platform.machine(), cpu)).encode())
    return cache_root() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"


def kernel_library(name: str) -> str:
    """Path of csrc/*.cc built as one shared library `name` for this machine: the sources compiled
    at once, a process each, then linked (kernels.cc and linear.cc: 11.3 s on 2 cores of a Zen 5,
    against 15.6 s as one unit). Built by one process at a time (a file lock; the others then find
    it built)."""
    cxx = compiler()
    lib = library_path(name, cxx)
    if lib.exists():
        return str(lib)
    root = lib.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:       # the ranks of a node, and the driver, build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            units = sorted(CSRC.glob("*.cc"))
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                objects = [Path(tmp) / f"{src.stem}.o" for src in units]
                builds = [subprocess.Popen([cxx, *cxxflags(), "-c", str(src), "-o", str(obj)], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True) for src, obj in zip(units, objects)]
                said = [b.communicate() for b in builds]
                for src, b, (_, err) in zip(units, builds, said):
                    if b.returncode:
                        raise RuntimeError(f"building {src} with {cxx} failed:\n{err[-2000:]}")
                out = Path(tmp) / lib.name
                run = subprocess.run([cxx, "-shared", "-pthread", *map(str, objects), "-o", str(out)],
                                     capture_output=True, text=True)
                if run.returncode:
                    raise RuntimeError(f"linking {lib.name} with {cxx} failed:\n{run.stderr[-2000:]}")
                os.replace(out, lib)
    return str(lib)


def start_build(name: str = "kernels") -> subprocess.Popen | None:
    """Builds library `name` in a process of its own, unless it is built (or there is no compiler:
    the workers then say so): the process, or None. It goes on if the caller ends first, so a
    library begun is finished; it prints nothing, since a failure is the workers' to report
    (their own `kernel_library` call fails the same way)."""
    try:
        if library_path(name, compiler()).exists():
            return None
    except RuntimeError:
        return None
    return subprocess.Popen([sys.executable, "-m", "msinfer.worker.build", name], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    print(kernel_library(sys.argv[1] if len(sys.argv) > 1 else "kernels"))
