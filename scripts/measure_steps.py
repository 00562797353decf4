"""Two variants of the CPU engine's decode steps in one process, alternating every few steps: a
measure that resolves a difference of 1-2% on a machine whose separate runs minutes apart differ
by 10-15% (docs/benchmarks.md, "A method that resolves 2%").

    python scripts/measure_steps.py --a kv_cache_dtype=auto --b kv_cache_dtype=bfloat16
    python scripts/measure_steps.py --switch SetAlone=1,0 --batch-size 64
    python scripts/measure_steps.py ... [--model DIR] [--dtype float32] [--batch-size 16] [--prompt 32]
                                        [--steps 120] [--chunk 5] [--rounds 4]

A variant is either a ModelRunner of its own, built with the EngineConfig fields --a or --b give
(KEY=VALUE, VALUE read as YAML), or, with --switch NAME=A,B, one runner whose kernel library's
exported setter NAME (SetAlone, SetBf16Dot, SetSteal, SetThreads: worker/csrc/kernels.cc) is
called with A or B before each of the variant's steps. --dtype bfloat16 is a job's `model.dtype:
bfloat16` on the CPU: a float32 network whose linear layers compute in bfloat16 pairs over a
bfloat16 KV cache (EngineConfig dtype float32, matmul_dtype and kv_cache_dtype bfloat16).

Each round prefills the same --batch-size random prompts of --prompt tokens in each variant, their
blocks scattered over the cache as a running engine's are, then decodes --steps greedy steps,
the variants taking turns every --chunk steps (which goes first alternates), so that both see
the machine's same minutes. A round's figure is each variant's median ms a step; the summary
gives every round, the medians and in how many rounds B was faster. The tokens of the two
variants are compared: a variant that changes the numerics (a cache's dtype) may pick others,
which is said, not refused. A first round, untimed, compiles every graph.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_v", "3")
# as the workers run the CPU kernels (worker.device.CPU_ENVIRONMENT), before MindSpore starts
os.environ.setdefault("MS_DEV_RUNTIME_CONF", "graph_pipeline:False")


def fields(pairs: list[str], flag: str) -> dict:
    """KEY=VALUE strings as a dict of EngineConfig fields, each VALUE read as YAML."""
    from dataclasses import fields as dataclass_fields

    from msinfer.sharding.config import EngineConfig
    known = {f.name for f in dataclass_fields(EngineConfig)}
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in known:
            sys.exit(f"measure_steps: {flag} {pair!r}: expected KEY=VALUE with KEY an EngineConfig field "
                     f"({', '.join(sorted(known))})")
        out[key] = yaml.safe_load(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/msinfer/SmolLM2-135M-Instruct"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--steps", type=int, default=120, help="decode steps a round (default 120)")
    ap.add_argument("--chunk", type=int, default=5, help="steps a variant takes before the other's turn (default 5)")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds (default 4)")
    ap.add_argument("--a", nargs="*", default=[], metavar="KEY=VALUE", help="variant A's EngineConfig fields")
    ap.add_argument("--b", nargs="*", default=[], metavar="KEY=VALUE", help="variant B's EngineConfig fields")
    ap.add_argument("--switch", default=None, metavar="NAME=A,B",
                    help="one runner; the kernels' setter NAME called with A, or B, before each variant's steps")
    args = ap.parse_args()
    for name in ("batch_size", "prompt", "steps", "chunk", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be 1 or more, not {getattr(args, name)}")
    if bool(args.switch) == bool(args.a or args.b):
        ap.error("give either --switch NAME=A,B or the variants' fields (--a and/or --b), one of the two")
    import mindspore as ms
    import numpy as np

    from msinfer.sharding.config import EngineConfig
    from msinfer.worker import cpu
    from msinfer.worker.protocol import SeqStep
    from msinfer.worker.runner import ModelRunner
    ms.set_device("CPU")
    B, P = args.batch_size, args.prompt
    max_len = P + args.steps + 16
    blocks = -(-max_len // EngineConfig.block_size)     # (the default: neither variant may set it)
    # with --switch both variants' sequences are in the one runner's cache, on blocks of their own
    base = dict(dtype="float32", max_model_len=max_len, max_batch_size=B, graph_mode=True,
                num_blocks=2 * B * blocks if args.switch else 0)
    if args.dtype == "bfloat16":
        base.update(matmul_dtype="bfloat16", kv_cache_dtype="bfloat16")

    def runner(extra: dict) -> ModelRunner:
        if "block_size" in extra or "num_blocks" in extra:
            sys.exit("measure_steps: the variants keep the cache's blocks as they are (block_size, num_blocks)")
        try:
            return ModelRunner(EngineConfig(args.model, **{**base, **extra}))
        except TypeError as e:
            sys.exit(f"measure_steps: {e}")

    if args.switch:
        name, sep, values = args.switch.partition("=")
        parts = values.split(",")
        if not sep or len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            ap.error(f"--switch {args.switch!r}: expected NAME=A,B with A and B integers, e.g. SetAlone=1,0")
        one = runner({})
        setter = getattr(ctypes.CDLL(cpu._LIBRARY), name, None)        # (the library MindSpore opened)
        if setter is None:
            ap.error(f"--switch: the kernel library has no function {name}")
        setter.argtypes = (ctypes.c_int,)
        variants = [(one, lambda v=int(parts[0]): setter(v)), (one, lambda v=int(parts[1]): setter(v))]
        labels = [f"{name}({parts[0]})", f"{name}({parts[1]})"]
    else:
        a, b = fields(args.a, "--a"), fields(args.b, "--b")
        variants = [(runner(a), lambda: None), (runner(b), lambda: None)]
        labels = [" ".join(args.a) or "A (defaults)", " ".join(args.b) or "B (defaults)"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, P).tolist() for _ in range(B)]
    order = rng.permutation(B * blocks)             # each sequence's blocks scattered over the cache
    shared = variants[0][0] is variants[1][0]
    # variant k's sequence ids and block tables (in one runner: B's after A's)
    seq_ids = [[k * B * shared + i for i in range(B)] for k in (0, 1)]
    tables = [[(order[i * blocks:(i + 1) * blocks] + k * B * blocks * shared).tolist() for i in range(B)]
              for k in (0, 1)]

    def one_round() -> tuple[list[list[float]], list[list[list[int]]]]:
        times, tokens = [[], []], []
        for k, (r, use) in enumerate(variants):
            use()
            out = r.step([SeqStep(seq_ids[k][i], p, 0, tables[k][i]) for i, p in enumerate(prompts)], is_prefill=True,
                         logprobs=False)
            tokens.append([[t] for t in out.token_ids])
        for c0 in range(1, args.steps, args.chunk):
            for k in ((0, 1) if (c0 // args.chunk) % 2 == 0 else (1, 0)):
                r, use = variants[k]
                use()
                for step in range(c0, min(args.steps, c0 + args.chunk)):
                    seqs = [SeqStep(seq_ids[k][i], [tokens[k][i][-1]], P + step - 1, tables[k][i], num_generated=step)
                            for i in range(B)]
                    t0 = time.perf_counter()
                    picked = r.step(seqs, is_prefill=False, logprobs=False).token_ids
                    times[k].append(time.perf_counter() - t0)
                    for seq, t in zip(tokens[k], picked):
                        seq.append(t)
        variants[0][1]()
        return times, tokens

    one_round()                                     # compiles every graph
    medians, same = [], True
    print(f"{args.dtype}, {B} sequences of {P} prompt tokens, {args.steps} decode steps a round, turns of "
          f"{args.chunk}; A: {labels[0]}; B: {labels[1]}")
    for r in range(args.rounds):
        times, tokens = one_round()
        a_ms, b_ms = (1e3 * statistics.median(t) for t in times)
        medians.append((a_ms, b_ms))
        same = same and tokens[0] == tokens[1]
        print(f"round {r + 1}: A {a_ms:.2f} ms, B {b_ms:.2f} ms a step ({(b_ms / a_ms - 1) * 100:+.1f}%)", flush=True)
    a_med, b_med = (statistics.median(m[i] for m in medians) for i in (0, 1))
    wins = sum(b < a for a, b in medians)
    print(f"medians: A {a_med:.2f} ms, B {b_med:.2f} ms ({(b_med / a_med - 1) * 100:+.1f}%); B faster in {wins} of "
          f"{args.rounds} rounds; " + ("the same tokens" if same else "the tokens differ between the variants"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
