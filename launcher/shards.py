"""One input split across N jobs (`input.shard`), for a Slurm job array, and the shards' results
merged into one file (`msinfer merge`).

Shard K of N takes the records whose id hashes (CRC-32 of its UTF-8 bytes) to K modulo N: the same
split on every run and machine, with no coordination between the tasks; each task reads the whole
input to find them. With `input.shard_by: file`, where input.path is a folder or a pattern of many
files, shard K takes the files K, K+N, K+2N, ... in name order and reads only those (a dataset of
many files read by many tasks: each reads its share). Each writes its own
results file, `<output.path>` with `.K-of-N` before its suffix (results.jsonl ->
results.0-of-3.jsonl), or `{shard}` in output.path replaced by `K-of-N`. Each shard resumes on
its own, like any job.

`msinfer merge job.yaml` reads the input's ids and every shard's results file, and writes the
merged results to output.path in input order, once every record has exactly one line; otherwise it
names the missing and the duplicated ids and writes nothing.
"""

from __future__ import annotations

import array
import os
import zlib
from pathlib import Path

from msinfer.launcher.errors import OutputError, SpecError
from msinfer.launcher.idset import CHUNK, IdSet, chunks, place, unplace
from msinfer.launcher.inputs import input_files, read_records
from msinfer.launcher.spec import parse_shard
from msinfer.launcher.writer import Replacement, inputs_path, result_id

SHOWN = 10          # ids named in a merge's report, of each kind


def resolve_shard(value: str | None, env: dict | None = None) -> tuple[int, int] | None:
    """input.shard as (K, N), `auto` from Slurm's array variables; None without a shard."""
    if value is None:
        return None
    if value != "auto":
        return parse_shard(value)
    env = os.environ if env is None else env
    task, count = env.get("SLURM_ARRAY_TASK_ID"), env.get("SLURM_ARRAY_TASK_COUNT")
    if task is None or count is None:
        raise SpecError("input.shard: auto takes this task's shard from a Slurm job array (SLURM_ARRAY_TASK_ID "
                        "and SLURM_ARRAY_TASK_COUNT), and they are not set; submit with sbatch --array=0-<N-1>, "
                        "or set input.shard: K/N")
    first = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
    try:
        return parse_shard(f"{int(task) - first}/{int(count)}")
    except ValueError as e:
        raise SpecError(f"input.shard: auto: {e} (SLURM_ARRAY_TASK_ID {task}, SLURM_ARRAY_TASK_MIN {first}, "
                        f"SLURM_ARRAY_TASK_COUNT {count}); the array must be --array=0-<N-1> or another "
                        f"run of N consecutive numbers") from None


def in_shard(record_id: str, k: int, n: int) -> bool:
    return zlib.crc32(record_id.encode("utf-8")) % n == k


def shard_path(path: str, k: int, n: int) -> str:
    """A shard's results file: `{shard}` in the path replaced by K-of-N, else .K-of-N before the
    suffix (a path that has it already is kept)."""
    tag = f"{k}-of-{n}"
    if "{shard}" in path:
        return path.replace("{shard}", tag)
    p = Path(path)
    return path if p.stem.endswith(f".{tag}") else str(p.with_name(f"{p.stem}.{tag}{p.suffix}"))


def merged_path(path: str) -> str:
    """Where `msinfer merge` writes the shards of output.path `path`: the path itself, or where it
    has `{shard}` (each shard's K-of-N), that replaced by `merged`."""
    return path.replace("{shard}", "merged")


def for_shard(spec):
    """The job spec of this task's shard: input.shard as K/N (auto resolved) and output.path its
    results file. A spec without a shard is returned as it is."""
    shard = resolve_shard(spec.input.shard)
    if shard is None:
        return spec
    k, n = shard
    inp = spec.input.model_copy(update={"shard": f"{k}/{n}"})
    out = spec.output.model_copy(update={"path": shard_path(spec.output.path, k, n)})
    return spec.model_copy(update={"input": inp, "output": out})


def shard_files(spec):
    """The `pick` of input.path's files (launcher.inputs.read_records) of the spec's shard
    (for_shard resolved it) with shard_by file; None: every file is read."""
    if spec.input.shard is None or spec.input.shard_by != "file":
        return None
    k, n = parse_shard(spec.input.shard)
    return lambda files: files[k::n]


def shard_input(spec):
    """The records of the spec's shard, read (for_shard resolved it); all of them without one."""
    records = read_records(spec.input.path, shard_files(spec))
    if spec.input.shard is None or spec.input.shard_by == "file":
        return records
    k, n = parse_shard(spec.input.shard)
    return (r for r in records if in_shard(r.id, k, n))


def check_shard_by(spec) -> None:
    """shard_by file needs a shard, and input.path's files at least one a task: a SpecError."""
    if spec.input.shard_by != "file":
        return
    if spec.input.shard is None:
        raise SpecError("input.shard_by: file deals input.path's files to the tasks of input.shard, and the spec "
                        "sets no input.shard; set it (K/N, or auto under a Slurm array), or leave shard_by unset")
    files, root = input_files(spec.input.path)
    k, n = parse_shard(spec.input.shard)
    if root is None or len(files) < n:
        raise SpecError(f"input.shard_by: file deals input.path's files to the {n} tasks of input.shard, and "
                        f"{spec.input.path} is {'one file' if root is None else f'{len(files)} file(s)'}: task {k} "
                        f"would read {'nothing' if k >= len(files) else 'a share of fewer tasks than asked'}. "
                        f"Give a folder or pattern of at least {n} files, or shard_by: record (each task then reads "
                        f"every file and takes its records by id)")


def merge_shards(input_ids, output_path: str, n: int, id_key: str) -> dict:
    """Checks that every input id (an iterable, in input order) has exactly one line across the N
    shards' results files of output.path `output_path` (shard_path), then writes them to its
    merged_path in input order (atomically), and the
    shards' `<output>.inputs` beside it. A line that is not a whole result (a crash's partial last
    line) is no line. Returns counts; raises OutputError naming the missing, duplicated and
    foreign ids, or a shard file that is not there, and writes nothing then.

    Nothing here grows with the results' size: each line's place is held as the id's hash with
    (shard, line number) in an index (launcher.idset) and each line's byte offset in an array,
    about 32 bytes a record, and the lines are copied from the shards' files as the input's order
    asks for them."""
    paths = [shard_path(output_path, k, n) for k in range(n)]
    output_path = merged_path(output_path)
    where, starts = IdSet(), []         # each id's place (launcher.idset.place: shard, line); each shard's lines' offsets
    doubled: dict[str, list[int]] = {}  # the places of an id found on more than one line
    distinct = 0

    def named(v: int) -> str:
        k, line = unplace(v)
        return f"{Path(paths[k]).name}:{line}"

    def add(ids: list[str], values: list[int]) -> None:
        nonlocal distinct
        fresh: dict[str, int] = {}
        for rid, v, before in zip(ids, values, where.lookup(ids)):
            before = before if before >= 0 else fresh.get(rid)
            if before is not None:
                doubled.setdefault(rid, [before]).append(v)
            else:
                fresh[rid] = v
        where.update(list(fresh), list(fresh.values()))
        distinct += len(fresh)

    for k, path in enumerate(paths):
        offsets, ids, values, offset = array.array("Q"), [], [], 0
        try:
            with open(path, "rb") as f:
                for number, line in enumerate(f, 1):
                    offsets.append(offset)
                    offset += len(line)
                    rid = result_id(line, id_key)
                    if rid is None:         # a blank line, or a crash's partial last one: not a result
                        continue
                    ids.append(rid)
                    values.append(place(k, number))
                    if len(ids) >= CHUNK:
                        add(ids, values)
                        ids, values = [], []
        except FileNotFoundError:
            raise OutputError(f"{path}: shard {k} of {n} has no results file; run it (input.shard: {k}/{n})") from None
        add(ids, values)
        starts.append(offsets)

    missing, total, matched, wanted = [], 0, 0, IdSet()
    shards = [open(path, "rb") for path in paths]
    try:
        with Replacement(output_path, binary=True, suffix=".merging") as merged:
            out = merged.file
            for chunk in chunks(input_ids):
                total += len(chunk)
                wanted.update(chunk)
                for rid, v in zip(chunk, where.lookup(chunk)):
                    if v < 0:
                        missing.append(rid)
                        continue
                    matched += 1
                    if not missing and not doubled:
                        k, line = unplace(v)
                        shards[k].seek(starts[k][line - 1])
                        out.write(shards[k].readline())
            foreign = _foreign(paths, id_key, wanted) if distinct > matched else []
            if missing or doubled or foreign:
                parts = []
                if missing:
                    parts.append(f"{len(missing)} record(s) have no line: {', '.join(missing[:SHOWN])}"
                                 + (" ..." if len(missing) > SHOWN else "") + " (run their shards again to resume them)")
                if doubled:
                    parts.append(f"{len(doubled)} record(s) have more than one line: "
                                 + ", ".join(f"{i} ({' and '.join(map(named, w))})"
                                             for i, w in list(doubled.items())[:SHOWN])
                                 + (" ..." if len(doubled) > SHOWN else ""))
                if foreign:
                    parts.append(f"{distinct - matched} line(s) name records the input does not have: "
                                 f"{', '.join(foreign[:SHOWN])}")
                raise OutputError(f"msinfer merge: the {n} shards of {output_path} do not hold each of the input's "
                                  f"{total} records exactly once: " + "; ".join(parts) + ". Nothing was written")
            with open(inputs_path(output_path), "wb") as inputs:  # (the shards' digests, for a re-run on the merged file)
                for path in paths:
                    _copy_whole_lines(inputs_path(path), inputs)
    finally:
        for f in shards:
            f.close()
    return {"records": total, "shards": n, "path": output_path}


def _foreign(paths: list[str], id_key: str, wanted: IdSet) -> list[str]:
    """The first SHOWN ids of the shards' lines that the input does not have."""
    found: list[str] = []
    for path in paths:
        with open(path, "rb") as f:
            for part in chunks(rid for line in f if (rid := result_id(line, id_key)) is not None):
                found += [rid for rid, v in zip(part, wanted.lookup(part)) if v < 0]
                if len(found) >= SHOWN:
                    return found[:SHOWN]
    return found


def _copy_whole_lines(source: Path, out) -> None:
    """A shard's `<output>.inputs` into the merged one's, whole lines only (a crash may have cut
    its last), so that one shard's partial line cannot join the next shard's first."""
    try:
        f = open(source, "rb")
    except FileNotFoundError:
        return
    with f:
        whole = out.tell()              # where the last whole line copied ends
        while block := f.read(1 << 20):
            out.write(block)
            if (cut := block.rfind(b"\n")) >= 0:
                whole = out.tell() - len(block) + cut + 1
    out.truncate(whole)
    out.seek(whole)
