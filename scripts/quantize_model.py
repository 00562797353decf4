"""Quantizes a float Hugging Face checkpoint with compressed-tensors, as llm-compressor's min-max
observers would (a symmetric scale per output channel or per group from the weights' range), and
saves it in compressed-tensors' own format, written by its ModelCompressor: the checkpoints
msinfer reads (sharding/quant.py), for tests and benchmarks. The LM head stays float, and so do
MoE experts that transformers holds fused (3-D parameters, not Linear layers, which is how
transformers 5 holds every MoE here): the config's `ignore` names them, so that it says what the
checkpoint holds.

    python scripts/quantize_model.py SRC DST --scheme w8a8     # w8a8 | w8a16 | w4a16 | w4a16g64 | mixed
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

INT8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
INT4_GROUP16 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
INT4_GROUP64 = {**INT4_GROUP16, "group_size": 64}       # a real checkpoint's groups are 64-128
INT8_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
# scheme -> (format, {targets: (weights, input activations)})
SCHEMES = {
    "w8a8": ("int-quantized", {"Linear": (INT8_CHANNEL, INT8_TOKEN)}),
    "w8a16": ("pack-quantized", {"Linear": (INT8_CHANNEL, None)}),
    "w4a16": ("pack-quantized", {"Linear": (INT4_GROUP16, None)}),
    "w4a16g64": ("pack-quantized", {"Linear": (INT4_GROUP64, None)}),
    # attention W8A8 and the MLP W4A16: at tp 2 a row-parallel input of each kind is split
    "mixed": ("pack-quantized", {"re:.*self_attn\\..*": (INT8_CHANNEL, INT8_TOKEN),
                                 "re:.*mlp\\..*": (INT4_GROUP16, None)}),
}


def prepared(src: Path, scheme: str):
    """src's float model with compressed-tensors' `scheme` applied and each layer's weight scale set
    from its weights' range: (model, its `ignore` list). Its forward quantizes the weights, and
    the inputs where the scheme says so, as it runs: what the compressed checkpoint computes, for
    a reference where transformers cannot load that checkpoint (fused MoE experts)."""
    import torch
    import transformers
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    fmt, groups = SCHEMES[scheme]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    fused = any(name.endswith(".experts") and not any(isinstance(m, torch.nn.Linear) for m in module.modules())
                for name, module in model.named_modules())
    ignore = ["lm_head"] + ([r"re:.*\.experts(\..*)?$"] if fused else [])
    config = QuantizationConfig.model_validate({"format": fmt, "ignore": ignore, "config_groups": {
        f"group_{i}": {"targets": [target], "weights": w, **({"input_activations": a} if a else {})}
        for i, (target, (w, a)) in enumerate(groups.items())}})
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            scheme_of = getattr(module, "quantization_scheme", None)
            if scheme_of is None:
                continue
            w, g = module.weight, scheme_of.weights.group_size
            v = w.reshape(w.shape[0], -1, g) if g else w.unsqueeze(1)
            scale, _ = calculate_qparams(v.amin(-1), v.amax(-1), scheme_of.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
    return model, ignore


def quantize(src: Path, out: Path, scheme: str) -> Path:
    """src quantized as `scheme` into the folder `out` (written beside it, then renamed into place)."""
    from compressed_tensors.compressors import ModelCompressor

    fmt = SCHEMES[scheme][0]
    model, ignore = prepared(src, scheme)
    fused = len(ignore) > 1
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    compressor.update_config(tmp)
    if fused:                               # the compressor lists only the Linear layers it left float
        config_file = tmp / "config.json"
        written = json.loads(config_file.read_text())
        written["quantization_config"]["ignore"] += ignore[1:]
        config_file.write_text(json.dumps(written, indent=2))
    for f in Path(src).iterdir():              # the tokenizer and generation config, as they are
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                                 "model.safetensors.index.json"):
            if not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--scheme", choices=sorted(SCHEMES), default="w8a16")
    args = ap.parse_args()
    print(quantize(args.src, args.dst, args.scheme))


if __name__ == "__main__":
    sys.exit(main())
