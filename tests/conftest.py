"""Shared, expensive fixtures: the small checkpoints, transformers' references, one Ray instance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("GLOG_v", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.checkpoints import build_checkpoint  # noqa: E402
from msinfer.worker.imports import import_mindspore  # noqa: E402

import_mindspore()      # as a worker does (Worker.join): its objects frozen, out of every later collection


def suite_cache() -> None:
    """Points MSINFER_CACHE at a folder of the run's own, removed when it ends, so that the graphs
    the tests compile and the kernel verdicts they keep stay out of the user's cache. The CPU
    kernel library (~12 s to build) and the demo model (`make test` converts it first) are the
    user's, linked in. Set by the first process (pytest's, or pytest-xdist's controller); its
    workers, their Ray workers and the commands the tests start inherit it."""
    import atexit
    import shutil
    import tempfile
    from msinfer.sharding.config import cache_root
    from scripts.make_demo_model import MODEL_NAME
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    user = cache_root()
    folder = Path(tempfile.mkdtemp(prefix="msinfer-tests-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (user / "kernels").mkdir(parents=True, exist_ok=True)
    (folder / "kernels").symlink_to(user / "kernels", target_is_directory=True)
    if (user / MODEL_NAME).is_dir():
        (folder / MODEL_NAME).symlink_to(user / MODEL_NAME, target_is_directory=True)
    os.environ["MSINFER_CACHE"] = str(folder)


suite_cache()

PROMPTS = [[5, 17, 33, 9, 100, 7], [44, 3], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]


def cache_with_kernels(folder: Path) -> str:
    """`folder` as an MSINFER_CACHE for a job of its own that shares the CPU kernel library this
    session built (named by its sources, flags and CPU) instead of building it again (~12 s)."""
    from msinfer.worker.build import kernel_library
    built = Path(kernel_library("kernels")).parent
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "kernels").exists():
        (folder / "kernels").symlink_to(built, target_is_directory=True)
    return str(folder)


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
    from msinfer.launcher.replica import init_ray, shutdown_ray
    import ray
    init_ray(None, 4, npus=4)        # emulated Ascend cards for tests of that path (tests/test_ascend.py)
    yield ray
    shutdown_ray()


# Test tiers, by what a test starts (`pytest -m unit` runs only the first):
#   unit         this process's Python and small MindSpore cells or kernels, no network built
#   integration  networks built and compiled in this process against transformers, Ray actors
#   slow         other processes: the msinfer command, Ray clusters, Slurm, the real demo model
# They run in that order, so the quick tiers fail fast; within a tier the longest files first
# (LONGEST_FIRST), and within a file the Ray-backed tests last.
UNIT = {"test_spec", "test_scheduler", "test_writer", "test_inputs", "test_tokenizer", "test_sampler",
        "test_device_sampler", "test_sharding", "test_kernels"}
SLOW = {"test_cli", "test_reruns", "test_faults", "test_scale_out", "test_real_model"}
TIERS = ("unit", "integration", "slow")
# The files that take longest (`make test`'s seconds per file on 2 cores, most first): pytest-xdist
# gives each process a whole file at a time, so a long file dealt last keeps one process busy
# after the other has run out of files.
LONGEST_FIRST = ("test_quant", "test_scale_out", "test_faults", "test_engine", "test_ascend", "test_moe",
                 "test_cli", "test_reruns", "test_tp", "test_real_model")


def tier(item) -> str:
    """An explicit tier marker on the test (or its class or module) wins; otherwise its file's tier."""
    marked = next((m.name for m in item.iter_markers() if m.name in TIERS), None)
    if marked is not None:
        return marked
    name = item.path.stem
    if name in SLOW:
        return "slow"
    return "unit" if name in UNIT and "ray_local" not in getattr(item, "fixturenames", ()) else "integration"


def pytest_configure(config):
    for name in TIERS:
        config.addinivalue_line("markers", f"{name}: a test of the {name} tier (tests/conftest.py)")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(tier(item))
    def weight(it) -> int:
        return LONGEST_FIRST.index(it.path.stem) if it.path.stem in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=lambda it: (TIERS.index(tier(it)), weight(it), "ray_local" in getattr(it, "fixturenames", ())))


# ---- the command line, as a user runs it (tests/test_cli.py, tests/test_faults.py) ------------------

def msinfer_command() -> list[str]:
    script = Path(sys.executable).with_name("msinfer")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "msinfer.launcher.cli"]


class Cli:
    def __init__(self, env: dict):
        self.env = env

    def environment(self, env: dict | None) -> dict:
        """The session's environment with `env` over it; a variable given as None is removed."""
        return {k: v for k, v in {**self.env, **(env or {})}.items() if v is not None}

    def run(self, *args, timeout: float = 180, env: dict | None = None, prefix: tuple = (),
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        p = subprocess.run([*prefix, *msinfer_command(), *map(str, args)], capture_output=True, text=True,
                           env=self.environment(env), timeout=timeout, cwd=cwd)
        assert "Traceback" not in p.stderr, p.stderr
        return p

    def start(self, *args, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen([*msinfer_command(), *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.environment(env),
                                start_new_session=True)


@pytest.fixture(scope="session")
def cli(tmp_path_factory) -> Cli:
    base = tmp_path_factory.getbasetemp()
    return Cli({**os.environ, "MSINFER_CACHE": cache_with_kernels(base / "msinfer-cache"), "GLOG_v": "3",
                "HF_MODULES_CACHE": str(base / "hf-modules"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="session")
def model(checkpoint) -> Path:
    """The CLI tests' checkpoint: 4 heads, 2 KV heads, intermediate 128 (tensor parallel 1, 2 or 4)."""
    return checkpoint("llama_gqa_tied")
