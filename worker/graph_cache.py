"""MindSpore's compile cache for a rank's step graphs (EngineConfig.compile_cache; the spec's
`model.compile_cache`), so that a second run of a job loads its graphs instead of compiling them.

MindSpore saves each graph it compiles with MS_COMPILER_CACHE_ENABLE=1 under
MS_COMPILER_CACHE_PATH/rank_N/graph_cache as `compile_cache_<k>.mindir`, k the process's count of
graphs compiled so far, and on a later compile with the same k loads that file instead, checking
only a hash of the entry script's dependencies (in a Ray actor, Ray's own script). One folder
shared by every graph would hand a graph another's file whenever a job compiles its graphs in
another order (a scoring record first, a new shape), and any graph a stale one after msinfer
changes. So each graph gets a folder of its own, keyed by everything its compiled form depends on
(`graph_folder`: msinfer's and MindSpore's versions, the model, the rank's EngineConfig, kernel
conventions and parameters, the graph's kind and shapes), and the cache is on only while that
graph compiles (`compiling`): a folder only ever holds its own graph, under whatever k it was
compiled at.

The ranks of replicas on one node compile the same graphs at once: a file lock per folder lets
one compile and save while the others wait and then load it. A compile that did not finish (its
process killed mid-write) leaves no `complete` mark, and the next one empties the folder first.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
from pathlib import Path

from msinfer.sharding.config import cache_root

ENABLE, PATH = "MS_COMPILER_CACHE_ENABLE", "MS_COMPILER_CACHE_PATH"
PACKAGE = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """The network's code as this process runs it: msinfer's worker and sharding sources (the
    CPU kernels' too) and MindSpore's version."""
    import mindspore
    h = hashlib.sha256(mindspore.__version__.encode())
    for f in sorted(p for d in ("worker", "sharding") for p in (PACKAGE / d).rglob("*")
                    if p.suffix in (".py", ".cc", ".h") and p.is_file()):
        h.update(str(f.relative_to(PACKAGE)).encode() + f.read_bytes())
    return h.hexdigest()


def graph_folder(*parts) -> Path:
    """The folder of the graph that `parts` describe (their reprs, which must name everything the
    compiled graph depends on beyond msinfer's source)."""
    key = hashlib.sha256(repr((source_digest(), *parts)).encode()).hexdigest()[:32]
    return cache_root() / "compile" / key


def entry_script_readable() -> bool:
    """Whether MindSpore's compile cache can hash the process's entry script (sys.argv[0], which
    it opens; none at all it accepts)."""
    from mindspore.graph import api
    path = getattr(api, "entry_script_path", None)
    return path is None or os.path.isfile(path)


@contextlib.contextmanager
def compiling(folder: Path | None):
    """MindSpore's compile cache on, in `folder`, for the one graph compiled inside; a no-op for
    None, and where MindSpore could not read its entry script (a process started as `python -c`:
    it would fail the compile on a file named "-c")."""
    if folder is None or not entry_script_readable():
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in (ENABLE, PATH)}
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / "complete"
        if not done.exists():            # nothing saved, or a save cut short: start clean
            for p in folder.iterdir():
                if p.name != "lock":
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        os.environ[ENABLE], os.environ[PATH] = "1", str(folder)
        try:
            yield
            done.touch()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
