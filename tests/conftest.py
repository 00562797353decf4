"""Shared, expensive fixtures: the small checkpoints, transformers' references, one Ray instance."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("GLOG_v", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.checkpoints import VARIANTS, build_checkpoint  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 100, 7], [44, 3], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session")
def checkpoint(ckpt_root):
    """checkpoint(name) -> path of a small random checkpoint (built once per session)."""
    return lambda name: build_checkpoint(name, ckpt_root)


_HF_CACHE: dict = {}


@pytest.fixture(scope="session")
def hf_greedy(checkpoint):
    """hf_greedy(name, prompt, n) -> (transformers' greedy token ids, its logits at each step)."""
    def run(name, prompt, n=10):
        key = (name, tuple(prompt), n)
        if key not in _HF_CACHE:
            import torch
            import transformers
            model = _HF_CACHE.setdefault(("model", name), transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint(name), dtype=torch.float32).eval())
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                     eos_token_id=None, pad_token_id=0, output_logits=True,
                                     return_dict_in_generate=True)
            _HF_CACHE[key] = (out.sequences[0, len(prompt):].tolist(),
                              [lg[0].float().numpy() for lg in out.logits])
        return _HF_CACHE[key]
    return run


@pytest.fixture(scope="session")
def ray_local():
    from msinfer.launcher.replica import init_ray
    import ray
    init_ray(None, 4, npus=4)        # emulated Ascend cards for tests of that path (tests/test_ascend.py)
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(items):
    # Ray-backed tests last, so the pure-Python tiers fail fast.
    items.sort(key=lambda it: 1 if "ray_local" in getattr(it, "fixturenames", ()) else 0)
