"""MindSpore's compile cache for a rank's step graphs (EngineConfig.compile_cache; the spec's
`model.compile_cache`), so that a second run of a job loads its graphs instead of compiling them.

With MS_COMPILER_CACHE_ENABLE=1 MindSpore saves each graph it compiles as
`<MS_COMPILER_CACHE_PATH>/rank_N/graph_cache/compile_cache_<k>.mindir`, k the process's count of
compiles with the cache on, and for a later compile at the same k loads that file if it is there,
checking only a hash of the entry script's dependencies (in a Ray actor, Ray's own script) and
nothing of the graph: a file of another shape or kind loads and runs, and gives wrong tokens.
It reads the path once per process (a static in its compile_cache_manager.cc), so a folder set
per graph is not where later graphs go: they all land in the first one, by k.

So MindSpore's path is a folder of this process's own (`Staging`), and each graph's file is kept
in a folder of its own under $MSINFER_CACHE/compile, keyed by everything its compiled form depends
on (`graph_folder`: msinfer's and MindSpore's versions, the model, the rank's EngineConfig, kernel
conventions and parameters, the graph's kind and shapes). Before a graph compiles (`compiling`),
the process's folder is emptied of graphs and given that graph's own file, if saved, at the k
MindSpore will look for; after it, the file at whatever k MindSpore used is saved in the graph's
folder. MindSpore can only ever find the graph being compiled; if its k is not the one expected
(another compile in the process with the cache on), it finds nothing, compiles, and the next k
follows from what it saved.

The ranks of replicas on one node compile the same graphs at once: a file lock per folder lets
one compile and save while the others wait and then load it. A save that did not finish (its
process killed mid-write) leaves no `complete` mark, and the next compile empties the folder first.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import os
import re
import shutil
import tempfile
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


GRAPH, HASH = "graph.mindir", "dependency.hash"        # a graph's folder: its file, the dependency hash
# MindSpore's names, behind the process's cluster role in a communication group (MS_WORKER)
MS_GRAPH = re.compile(r"(.*)compile_cache_(\d+)\.mindir")
MS_HASH = "compile_dependency.hash"


class Staging:
    """This process's MS_COMPILER_CACHE_PATH, a temporary folder named after its pid and removed
    when the process exits, or by the next process to make one once the pid is gone (a Ray worker
    killed runs no exit handlers); and the k the next compile with the cache on will have."""
    _process: "Staging | None" = None
    PREFIX = "msinfer-graphs-"

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.PREFIX}{os.getpid()}-"))
        self.k = 0
        self.seen: tuple[Path, str] | None = None       # where MindSpore saved, with its role prefix
        atexit.register(shutil.rmtree, self.root, True)
        for p in self.root.parent.glob(f"{self.PREFIX}*-*"):
            pid = p.name[len(self.PREFIX):].split("-")[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)

    @classmethod
    def get(cls) -> "Staging":
        if cls._process is None:
            cls._process = cls()
        return cls._process

    def where(self) -> tuple[Path, str]:
        """The folder MindSpore reads and writes graphs in and its names' prefix: as it saved the
        last one, else rank_N (MindSpore's rank of the process, 0 outside a communication group)
        and the process's cluster role (MS_ROLE) as the prefix. A wrong guess costs a compile."""
        if self.seen is not None:
            return self.seen
        try:
            from mindspore.communication import get_rank
            rank, role = get_rank(), os.environ.get("MS_ROLE", "")
        except Exception:
            rank, role = 0, ""
        return self.root / f"rank_{rank}" / "graph_cache", role

    def graphs(self) -> dict[int, Path]:
        """The graph files MindSpore's folders hold, by k."""
        return {int(m.group(2)): p for p in self.root.glob("rank_*/graph_cache/*.mindir")
                if (m := MS_GRAPH.fullmatch(p.name))}


def pid_alive(pid: int) -> bool:
    """Whether a process of this machine with that pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # another user's
        return True
    return True


def clear(folder: Path) -> None:
    """Everything in a graph's folder but its lock."""
    for p in folder.iterdir():
        if p.name != "lock":
            shutil.rmtree(p) if p.is_dir() else p.unlink()


@contextlib.contextmanager
def compiling(folder: Path | None):
    """MindSpore's compile cache on for the one graph compiled inside, which loads from `folder`
    or is saved there (module docstring); a no-op for None, where MindSpore could not read its
    entry script (a process started as `python -c`: it would fail the compile on a file named
    "-c"), and where the user turned MindSpore's cache on in the environment."""
    if folder is None or not entry_script_readable() or os.environ.get(ENABLE) is not None:
        yield
        return
    staging = Staging.get()
    folder.mkdir(parents=True, exist_ok=True)
    saved_path = os.environ.get(PATH)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / "complete"
        if not done.exists():            # nothing saved, or a save cut short: start clean
            clear(folder)
        for p in staging.graphs().values():     # MindSpore finds this graph's file or none
            p.unlink()
        at, role = staging.where()
        staged, ms_hash = at / f"{role}compile_cache_{staging.k}.mindir", at / f"{role}{MS_HASH}"
        if done.exists() and (folder / GRAPH).is_file():
            at.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / GRAPH, staged)
            if (folder / HASH).is_file() and not ms_hash.exists():
                shutil.copyfile(folder / HASH, ms_hash)
        before = staged.stat().st_mtime_ns if staged.exists() else None
        os.environ[ENABLE], os.environ[PATH] = "1", str(staging.root)
        try:
            yield
        finally:
            os.environ.pop(ENABLE, None)
            if saved_path is None:
                os.environ.pop(PATH, None)
            else:
                os.environ[PATH] = saved_path
        fresh = {k: p for k, p in staging.graphs().items()
                 if not (p == staged and p.stat().st_mtime_ns == before)}
        if not fresh:
            # Loaded as staged: that took MindSpore's k. Nothing staged and nothing saved: MindSpore
            # compiled without its cache (a second jit of a function and shapes it had compiled,
            # as the emulated Ascend path's kinds can be) and took no k.
            staging.k += before is not None
            return
        k = max(fresh)                   # what MindSpore compiled and saved, at its own k
        written = fresh[k]
        staging.k = k + 1
        at, role = staging.seen = written.parent, MS_GRAPH.fullmatch(written.name).group(1)
        ms_hash = at / f"{role}{MS_HASH}"
        clear(folder)
        shutil.copyfile(written, folder / GRAPH)
        if ms_hash.is_file():
            shutil.copyfile(ms_hash, folder / HASH)
        done.touch()
