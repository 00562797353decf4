"""A routed mixture-of-experts layer against a dense MLP with the same active parameters, on the
CPU kernels, in one process: one Qwen3-30B-A3B layer (hidden 2048, 128 experts of 768, top 8)
and an MLP of 8 x 768 = 6144, at a decode step of 16 tokens and a prefill of 256, the two sides
alternating round by round. Random weights, float32 and rounded to bfloat16 values (as a bfloat16
checkpoint's are; they go to AMX tiles where the CPU has them); the router's weights are random
too, so tokens spread over the experts about evenly. With --portable also the portable
operators' experts (every expert on every token), at 16 tokens only.
    With --w8a8, the same layer's experts as an int8 checkpoint holds them (int8 weights with a
scale per output channel), against the float32 experts: weight-only (W8A16) in int8 panels
(MoeExperts); with inputs quantized per token before gate|up and before down (W8A8), in int8
panels with the rows taken to their levels and back (a CPU without VNNI), in VNNI panels with
the int8 products summed with VNNI (worker.cpu.CpuExperts, where the CPU has it), and the
portable operators' way (every expert on every token, weights dequantized; at 16 tokens only).
    With --w4a16, the layer's experts as a W4A16 checkpoint holds them (int4 weights with a scale
per group of 128 inputs, float inputs), held as the model holds them (worker.model.
hold_int4_experts: two levels a byte on a CPU with AVX-512), against the same weights
dequantized to float32 panels.

    python scripts/measure_moe.py [--rounds 5] [--steps 5] [--experts 128] [--portable | --w8a8 | --w4a16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLOG_v", "3")

import numpy as np  # noqa: E402

from msinfer.sharding.config import ModelConfig  # noqa: E402
from msinfer.sharding.layout import TPInfo  # noqa: E402

LAYER = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
         "moe_intermediate_size": 768, "num_experts_per_tok": 8, "norm_topk_prob": True, "num_hidden_layers": 1,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936}


def build(cfg: ModelConfig, dev, sparse: bool, rng, bfloat16: bool = False):
    import mindspore as ms
    from mindspore import Parameter, Tensor
    from msinfer.worker.cpu import bfloat16_bits
    from msinfer.worker.model import MLP, SparseMoeBlock
    cell = SparseMoeBlock(cfg, TPInfo(), ms.float32, dev) if sparse else MLP(cfg, TPInfo(), ms.float32, dev)
    cell.set_train(False)
    for _, sub in cell.cells_and_names():
        for attr in ("weight", "w13", "w2"):
            p = getattr(sub, attr, None)
            if not isinstance(p, Parameter) or attr == "weight" and not hasattr(sub, "matmul"):
                continue
            w = (rng.standard_normal(p.shape, np.float32) / np.sqrt(p.shape[-1])).astype(np.float32)
            if bfloat16:
                w = (bfloat16_bits(w).astype(np.uint32) << 16).view(np.float32)
            if dev.pack_weight is not None:
                if attr == "weight":
                    w, _ = dev.pack_weight(w, getattr(sub, "glu", False))
                else:
                    w, _ = dev.pack_experts(w, sub.glu and attr == "w13")
            setattr(sub, attr, Parameter(Tensor(w), name=p.name, requires_grad=False))
    return cell


def sparse_block(cfg: ModelConfig, dev, rng):
    """The layer's sparse block on `dev`, its router's weights random (packed as the device packs
    a weight), its experts' as built: the caller sets them."""
    import mindspore as ms
    from mindspore import Parameter, Tensor
    from msinfer.worker.model import SparseMoeBlock
    cell = SparseMoeBlock(cfg, TPInfo(), ms.float32, dev)
    cell.set_train(False)
    gate = (rng.standard_normal(cell.gate.weight.shape, np.float32) / np.sqrt(cfg.hidden_size)).astype(np.float32)
    packed_gate = dev.pack_weight(gate)[0] if dev.pack_weight is not None else gate
    cell.gate.weight = Parameter(Tensor(packed_gate), name=cell.gate.weight.name, requires_grad=False)
    return cell


def int8_experts(cfg: ModelConfig, dev, rng, held: str | None, inputs: bool = True):
    """A sparse block whose experts are int8 per output channel, with int8 inputs per token
    (W8A8, compressed-tensors' arithmetic: max|x| / 127.5, halves to even) or without (W8A16):
    held as `held` says ("vnni", "panels": CpuOps.int8_experts' layouts) or dequantized (None)."""
    from mindspore import Parameter, Tensor
    from msinfer.sharding.layers import PerTokenInt8
    cell = sparse_block(cfg, dev, rng)
    experts = cell.experts
    levels, scales = {}, {}
    for attr in ("w13", "w2"):
        shape = getattr(experts, attr).shape
        levels[attr] = rng.integers(-127, 128, shape).astype(np.int8)
        scales[attr] = (rng.uniform(0.5, 1.5, shape[:2]) / (127 * np.sqrt(shape[2]))).astype(np.float32)
    if inputs:
        experts.x_quant, experts.h_quant = PerTokenInt8(0, 127.5), PerTokenInt8(0, 127.5)
        if experts.op is not None:
            experts.op.x_quant, experts.op.h_quant = experts.x_quant, experts.h_quant
    if held == "panels":
        experts.hold_int8(dev.pack_experts(levels["w13"], experts.glu, scales["w13"])[0],
                          dev.pack_experts(levels["w2"], False, scales["w2"])[0])
        return cell
    if held == "vnni":
        p13, _ = dev.pack_experts(levels["w13"], experts.glu)
        p2, _ = dev.pack_experts(levels["w2"])
        experts.hold_int8(p13, p2, Tensor(dev.expert_scales(scales["w13"], experts.glu)),
                          Tensor(dev.expert_scales(scales["w2"])))
        return cell
    for attr, glu in (("w13", experts.glu), ("w2", False)):
        w = levels[attr].astype(np.float32) * scales[attr][..., None]
        if dev.pack_experts is not None and experts.op is not None:
            w, _ = dev.pack_experts(w, glu)
        setattr(experts, attr, Parameter(Tensor(w), name=getattr(experts, attr).name, requires_grad=False))
    return cell


def int4_experts(cfg: ModelConfig, dev, rng, held: bool, group: int = 128):
    """A sparse block whose experts are W4A16 (int4 levels, a scale per group of `group` inputs),
    their values loaded dequantized with the scales beside them, as the loader leaves them; held as
    int4 (`hold_int4_experts`) or as float32 panels."""
    from mindspore import Parameter, Tensor
    from msinfer.worker.model import hold_int4_experts
    cell = sparse_block(cfg, dev, rng)
    experts = cell.experts
    for attr, glu in (("w13", experts.glu), ("w2", False)):
        p = getattr(experts, attr)
        E, N, K = p.shape
        scales = (rng.uniform(0.5, 1.5, (E, N, K // group)) / (7 * np.sqrt(K))).astype(np.float32)
        w = rng.integers(-8, 8, p.shape).astype(np.float32) * np.repeat(scales, group, axis=-1)
        if held:
            p.set_data(Tensor(w))
            p.group_scales = scales
        else:
            setattr(experts, attr, Parameter(Tensor(dev.pack_experts(w, glu)[0]), name=p.name, requires_grad=False))
    if held and hold_int4_experts(dev, experts) is None:
        raise SystemExit("the int4 experts' layout does not take this layer's sizes")
    return cell


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--portable", action="store_true")
    ap.add_argument("--w8a8", action="store_true")
    ap.add_argument("--w4a16", action="store_true")
    args = ap.parse_args()
    import mindspore as ms
    from mindspore import Tensor
    from msinfer.worker.cpu import CpuOps, load_kernels
    from msinfer.worker.ops import MsOps
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    load_kernels()
    cfg = ModelConfig.from_dict({**LAYER, "num_experts": args.experts})
    rng = np.random.default_rng(0)
    if args.w8a8:
        sides = {"routed": build(cfg, CpuOps, True, rng),
                 "W8A16 int8 panels": int8_experts(cfg, CpuOps, rng, "panels", inputs=False),
                 "W8A8 int8 panels": int8_experts(cfg, CpuOps, rng, "panels"),
                 "W8A8 portable": int8_experts(cfg, MsOps, rng, None)}
        if CpuOps.vnni:
            sides["W8A8 int8, VNNI"] = int8_experts(cfg, CpuOps, rng, "vnni")
    elif args.w4a16:
        if not CpuOps.int4:
            raise SystemExit("no AVX-512 on this CPU (or MSINFER_INT4=0): W4A16 experts are dequantized")
        sides = {"W4A16 dequantized": int4_experts(cfg, CpuOps, rng, False),
                 "W4A16 int4": int4_experts(cfg, CpuOps, rng, True),
                 "W8A16 int8 panels": int8_experts(cfg, CpuOps, rng, "panels", inputs=False)}
    else:
        sides = {"routed": build(cfg, CpuOps, True, rng), "dense": build(cfg, CpuOps, False, rng),
                 "routed bfloat16": build(cfg, CpuOps, True, rng, True),
                 "dense bfloat16": build(cfg, CpuOps, False, rng, True)}
    if args.portable:
        sides["portable experts"] = build(cfg, MsOps, True, rng)
    inputs = {n: Tensor(rng.standard_normal((n, cfg.hidden_size), np.float32)) for n in (16, 256)}
    cases = [(s, n) for s in sides for n in inputs if not ("portable" in s and n > 16)]
    for s, n in cases:                                       # compile each shape first
        sides[s](inputs[n]).asnumpy()
    times = {c: [] for c in cases}
    for rnd in range(args.rounds):
        for s, n in (cases if rnd % 2 == 0 else cases[::-1]):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                sides[s](inputs[n]).asnumpy()
            times[(s, n)].append((time.perf_counter() - t0) / args.steps * 1e3)
    active = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    print(f"{args.experts} experts of {cfg.moe_intermediate_size}, top {cfg.num_experts_per_tok}; dense MLP "
          f"{cfg.intermediate_size}; active parameters per token {active / 1e6:.1f} M on both sides")
    for (s, n), ts in times.items():
        print(f"{s:18s} {n:4d} tokens: ms per call " + " ".join(f"{t:.2f}" for t in ts)
              + f"  median {statistics.median(ts):.2f}")


if __name__ == "__main__":
    main()
