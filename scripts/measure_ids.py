"""What the driver holds for each record: the ids it checks for repeats (launcher.inputs,
`_unique_ids`, over launcher.idset) against a dict of every id and its place, as it held them
before; and, at a re-run, the input digests of the results file's records (`<output>.inputs`:
launcher.writer.input_digest_index against read_input_digests' dict). Ids like
`record-00000001`; the two ways alternate round by round; tracemalloc's peak over the pass,
divided by the records, and the microseconds a record (a pass without tracing: tracing slows
Python down several-fold).

    python scripts/measure_ids.py [--records 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msinfer.launcher.inputs import Record, _unique_ids, input_digest  # noqa: E402
from msinfer.launcher.writer import input_digest_index, input_line, inputs_path, read_input_digests  # noqa: E402


def records(n: int):
    for i in range(n):
        yield Record(id=f"record-{i:08d}", line=i + 1, source="part-0001.jsonl")


def held_in_a_dict(recs, unit):
    """The way before: every id and its place in a dict (no repeats in this input)."""
    first = {}
    for r in recs:
        first[r.id] = (r.source, r.line)
        yield r


def one_pass(fn, n: int, trace: bool) -> float:
    if trace:
        tracemalloc.start()
    t = time.perf_counter()
    held = fn(n)
    dt = time.perf_counter() - t
    del held
    if not trace:
        return dt / n * 1e6
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    output = Path(tempfile.mkdtemp()) / "out.jsonl"
    with open(inputs_path(output), "wb") as f:
        for i in range(a.records):
            f.write(input_line(f"record-{i:08d}", input_digest(f"prompt {i}")))

    def checked(fn):
        return lambda n: sum(1 for _ in fn(records(n), "line"))

    ways = {"dict of ids": checked(held_in_a_dict), "id index": checked(_unique_ids),
            "digests' dict": lambda n: read_input_digests(output), "digests' index": lambda n: input_digest_index(output)}
    got = {name: {"bytes": [], "us": []} for name in ways}
    for r in range(a.rounds):
        for name, fn in ways.items():
            got[name]["bytes"].append(one_pass(fn, a.records, True))
            got[name]["us"].append(one_pass(fn, a.records, False))
            print(f"round {r} {name}: peak {got[name]['bytes'][-1]:.1f} bytes a record, "
                  f"{got[name]['us'][-1]:.2f} us a record (making the records, or reading the file, included)", flush=True)
    for name, v in got.items():
        print(f"{name}: median peak {statistics.median(v['bytes']):.1f} bytes a record, "
              f"{statistics.median(v['us']):.2f} us a record")


if __name__ == "__main__":
    main()
