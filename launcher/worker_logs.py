"""What a dead worker's Ray log says of its end, read on the worker's own node.

Ray writes each worker process's stderr to `worker-<id>-<job>-<pid>.err` in the session's log
folder of the node it ran on. A worker killed by a signal leaves there the lines of Ray's failure
handler (`*** SIGFPE received at time=...`, then `PC: @ 0x... (unknown) PagedAttention`) and of
Python's faulthandler (`Fatal Python error: ...`, then the crashing thread's Python frames,
innermost first). A small task placed on the rank's node reads the log's tail
(`read_worker_log`), so the driver can tell the end of a rank on any node of the cluster.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import ray

from msinfer.worker.graph_cache import pid_alive

_SIGNAL = re.compile(r"\*\*\* (SIG[A-Z]+) received at time=")
_PC = re.compile(r"PC: @\s+0x[0-9a-f]+\s+\S+\s+(\S+)")
_FATAL = re.compile(r"^Fatal Python error: (.+)$", re.MULTILINE)
_FRAME = re.compile(r'\(most recent call first\):\n\s+File "([^"]+)", line (\d+) in (\S+)')
TAIL_BYTES = 65536


def crash_note(log: str) -> str | None:
    """The end a worker's log tells (the last it tells): "SIGFPE in PagedAttention", "SIGABRT,
    Python at actor.py:189 in step", "Fatal Python error: ..."; None where it tells none."""
    signals = list(_SIGNAL.finditer(log))
    fatal = list(_FATAL.finditer(log))
    if signals:
        last = signals[-1]
        pc = _PC.search(log, last.end())
        where = pc.group(1) if pc is not None and pc.group(1) != "(unknown)" else None
        note = f"{last.group(1)} in {where}" if where else last.group(1)
    elif fatal:
        note = f"Fatal Python error: {fatal[-1].group(1).strip()}"
    else:
        return None
    first = log.find("(most recent call first):", fatal[-1].end()) if fatal else -1
    frame = _FRAME.match(log, first) if first >= 0 else None      # the crashing thread's, not another's
    if frame is not None:
        note += f", Python at {Path(frame.group(1)).name}:{frame.group(2)} in {frame.group(3)}"
    return note


def worker_log(pid: int, tail_bytes: int = TAIL_BYTES) -> tuple[Path, str] | None:
    """This node's Ray log of the worker process `pid` (its stderr) and its last bytes, if found."""
    try:
        logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    except Exception:                   # no Ray session here
        return None
    for path in logs.glob(f"worker-*-{pid}.err"):
        try:
            with open(path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
                return path, f.read().decode("utf-8", "replace")
        except OSError:
            continue
    return None


@ray.remote(num_cpus=0, max_retries=0)
def read_worker_log(pid: int, wait_s: float) -> tuple[bool, str, str | None]:
    """On the worker's node: (whether the process is still alive after up to `wait_s`, its log's
    path or "", what the log says of its end). A process whose connection Ray has lost may still
    be writing its last lines (faulthandler's) and exiting: it is given that time."""
    end = time.monotonic() + wait_s
    while pid_alive(pid):
        if time.monotonic() >= end:
            return True, "", None
        time.sleep(0.05)
    found = worker_log(pid)
    return False, str(found[0]) if found else "", crash_note(found[1]) if found else None
