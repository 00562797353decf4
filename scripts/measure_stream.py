"""What the kernel library's pair micro-kernel (VDPBF16PS) reaches over the demo model's 120 linear
layers at M rows without the library's glue (scripts/stream_layers.cc: two threads each held to
its run of every matmul's panels, a spin barrier after each matmul, x rounded once), from memory
in 2 MB pages, in 4 KB pages and in cache; then, with --library, the library's own Linear calls
over the same shapes (scripts/measure_bf16.py --by-kind), so that the two stand side by side.
The difference is what the library spends around its micro-kernels (the pool's hand-off, x
rounded by the caller and read by the helper from the caller's cache, the threads' waits, the
gate/up activation), with measure_bf16's Python calls through ctypes.

    python scripts/measure_stream.py [--rows 16] [--rounds 3] [--library]

The program is built with the kernels' compiler and flags (worker/build.py) for this machine's
CPU; a CPU without AVX512-BF16 has nothing to measure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16, help="rows of x (default 16: a decode step of 16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--library", action="store_true", help="then the library's Linear calls (measure_bf16.py --by-kind)")
    args = ap.parse_args()
    if args.rows < 1 or args.rounds < 1:
        ap.error("--rows and --rounds must be 1 or more")
    from msinfer.worker.build import compiler, cxxflags
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "stream_layers"
        built = subprocess.run([compiler(), *cxxflags(), str(ROOT / "scripts/stream_layers.cc"), "-o", str(exe)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"measure_stream: building scripts/stream_layers.cc failed:\n{built.stderr[-2000:]}")
        ran = subprocess.run([str(exe), str(args.rows), str(args.rounds)])
        if ran.returncode != 0:
            return ran.returncode
    if args.library:
        return subprocess.run([sys.executable, str(ROOT / "scripts/measure_bf16.py"), "--rows", str(args.rows),
                               "--rounds", str(args.rounds), "--by-kind"]).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
