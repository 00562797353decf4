import errno
import json
import os
import threading
import time
import zlib

import pytest

from msinfer.launcher.errors import OutputError, UserError
from msinfer.launcher import writer as writer_module
from msinfer.launcher.records import error_result, ok_result
from msinfer.launcher.writer import (ResultsLock, ResultWriter, Stats, check_output, lock_path, status_path, summary_path,
                                     write_json_atomic)



def holds(done_ids, ids: set) -> bool:
    """Whether a writer's done_ids (launcher.idset.IdSet) holds exactly `ids`."""
    return len(done_ids) == len(ids) and all(i in done_ids for i in ids)

def lines(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_result_builders():
    r = ok_result("a", [5, 6], "héllo", "stop", 3, {"logprobs": [[-0.1], [-0.2]]})
    assert list(r) == ["id", "output_text", "output_token_ids", "finish_reason", "prompt_tokens",
                       "completion_tokens", "logprobs", "error"]
    assert r["completion_tokens"] == 2 and r["error"] is None
    assert "output_text" not in ok_result("b", [1], None, "length", 1)
    assert error_result("c", "invalid_record", "line 3: bad") == {
        "id": "c", "error": {"type": "invalid_record", "message": "line 3: bad"}}


def test_write_then_resume_skips_done_ids(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultWriter(path) as w:
        assert holds(w.done_ids, set())
        w.write(ok_result("a", [1], "ü", "stop", 2))
        w.write(error_result("b", "invalid_record", "x"))
    assert "ü" in path.read_text(encoding="utf-8")  # ensure_ascii=False
    with ResultWriter(path) as w:
        assert holds(w.done_ids, {"a", "b"}) and not w.cut_partial_line
        w.write(ok_result("c", [1], None, "stop", 2))
    assert [r["id"] for r in lines(path)] == ["a", "b", "c"]


def test_resume_knows_every_id_however_it_is_spelled(tmp_path):
    """Resume reads msinfer's own lines by their first bytes and parses anything else as JSON:
    ids with quotes, backslashes, control characters or non-ASCII letters come back exactly."""
    path = tmp_path / "out.jsonl"
    ids = ['plain', 'a"b', 'c\\d', 'é✓ 名', 'tab\there', '", "x']
    with ResultWriter(path) as w:
        for rid in ids:
            w.write(ok_result(rid, [1], "x", "stop", 1))
        w.write(error_result("err", "invalid_record", "bad"))
    with open(path, "ab") as f:
        f.write(b'{"id": 7, "output_token_ids": []}\n')        # a line msinfer did not write
    with ResultWriter(path) as w:
        assert holds(w.done_ids, {*ids, "err", "7"}) and not w.cut_partial_line


def test_each_result_reaches_the_file_at_once_and_disk_syncs_are_grouped(tmp_path, monkeypatch):
    """Group commit: every line is in the file as soon as it is written (a second reader sees it:
    a crash of msinfer loses nothing), while fsync runs at most once per fsync_interval_s and at
    close; with an interval of 0, once per line."""
    import msinfer.launcher.writer as writer_module
    syncs = []
    monkeypatch.setattr(writer_module.os, "fsync", lambda fd: syncs.append(fd))
    path = tmp_path / "out.jsonl"
    w = ResultWriter(path, fsync_interval_s=3600)
    for i in range(50):
        w.write(ok_result(f"r{i}", [1], "x", "length", 1))
        assert len(lines(path)) == i + 1
    assert syncs == []
    w.close()
    assert len(syncs) == 1
    with ResultWriter(path, fsync_interval_s=0) as w:
        for i in range(50, 55):
            w.write(ok_result(f"r{i}", [1], "x", "length", 1))
    assert len(syncs) == 1 + 5 + 1


@pytest.mark.parametrize("tail", [b'{"id": "c", "output_tok', b'{"id": "c"}', b'\n', b'{"id": "c", \xff\n'])
def test_resume_after_truncated_last_line_yields_each_id_once(tmp_path, tail):
    path = tmp_path / "out.jsonl"
    with ResultWriter(path) as w:
        for rid in "ab":
            w.write(ok_result(rid, [1], "x", "stop", 1))
    with open(path, "ab") as f:
        f.write(tail)  # a crash in the middle of writing record c
    with ResultWriter(path) as w:
        assert holds(w.done_ids, {"a", "b"}) and w.cut_partial_line
        for rid in ["a", "b", "c", "d"]:  # the caller skips done ids
            if rid not in w.done_ids:
                w.write(ok_result(rid, [1], "x", "stop", 1))
    ids = [r["id"] for r in lines(path)]
    assert ids == ["a", "b", "c", "d"]


def test_bad_line_in_the_middle_is_not_cut(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(OutputError, match="out.jsonl, line 2: not a whole JSON result, and more lines follow"):
        ResultWriter(path)
    assert path.read_text() == '{"id": "a"}\nnot json\n{"id": "b"}\n'


def test_overwrite_truncates(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "old"}\n')
    with ResultWriter(path, overwrite=True) as w:
        assert holds(w.done_ids, set())
        w.write(error_result("new", "t", "m"))
    assert [r["id"] for r in lines(path)] == ["new"]


def test_each_line_is_one_write_and_fsynced_with_interval_zero(tmp_path, monkeypatch):
    calls = []
    real_write, real_fsync = os.write, os.fsync
    monkeypatch.setattr(os, "write", lambda fd, data: calls.append(("write", bytes(data))) or real_write(fd, data))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync",)) or real_fsync(fd))
    with ResultWriter(tmp_path / "out.jsonl", fsync_interval_s=0) as w:
        w.write(ok_result("a", [1, 2], "two\nlines", "stop", 1))
        assert [c[0] for c in calls] == ["write", "fsync"]
    assert calls[0][1].endswith(b"\n") and calls[0][1].count(b"\n") == 1


def test_lines_are_written_at_once_and_synced_together_off_the_callers_thread(tmp_path, monkeypatch):
    """Group commit: each line is one write() as it comes; one fsync on the writer's own thread
    covers every line written in its interval, and closing syncs the rest."""
    calls, writes = [], []
    real_fsync, real_write = os.fsync, os.write
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(threading.current_thread().name) or real_fsync(fd))
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    path = tmp_path / "out.jsonl"
    w = ResultWriter(path, fsync_interval_s=0.3)
    for rid in "abc":
        w.write_line(rid, json.dumps(ok_result(rid, [1], "x", "stop", 1)))
    assert writes == [] and "a" not in w.done_ids
    w.flush()                                        # the driver's loop, once per pass
    assert len(writes) == 1 and writes[0].count(b"\n") == 3 and w.lines_written == 3
    assert [r["id"] for r in lines(path)] == ["a", "b", "c"] and calls == []     # in the file, not synced yet
    time.sleep(1.0)
    assert calls == ["results-fsync"]                # one sync for the three lines; none while nothing new came
    w.write(ok_result("d", [1], "x", "stop", 1))
    w.close()
    assert calls[-1] == threading.current_thread().name and [r["id"] for r in lines(path)] == ["a", "b", "c", "d"]


def test_a_failed_sync_stops_the_next_write_keeping_what_was_written(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    w = ResultWriter(path, fsync_interval_s=0.1)
    w.write(ok_result("a", [1], "x", "stop", 1))

    def io_error(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", io_error)
    deadline = time.monotonic() + 5
    while w.sync_error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(OutputError, match="Input/output error.*1 results written so far are kept"):
        w.write(ok_result("b", [1], "y", "stop", 1))
    assert [r["id"] for r in lines(path)] == ["a"]


def test_enospc_keeps_previous_lines_and_closes(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    w = ResultWriter(path)
    w.write(ok_result("a", [1], "x", "stop", 1))
    real_write = os.write

    def disk_full(fd, data):  # the disk takes a few bytes, then is full
        real_write(fd, bytes(data[:7]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(OutputError) as e:
        w.write(ok_result("b", [1], "y", "stop", 1))
    msg = str(e.value)
    assert str(path) in msg and "No space left on device" in msg and "1 results written so far are kept" in msg
    monkeypatch.setattr(os, "write", real_write)
    with pytest.raises(OutputError, match="is closed"):
        w.write(ok_result("c", [1], "z", "stop", 1))
    assert [r["id"] for r in lines(path)] == ["a"]  # the partial line was cut back
    assert holds(ResultWriter(path).done_ids, {"a"})


def test_check_output(tmp_path):
    assert check_output(tmp_path / "new/deeper/out.jsonl") == tmp_path / "new/deeper/out.jsonl"
    assert os.listdir(tmp_path) == []               # plan checks; it makes nothing
    assert check_output(tmp_path / "new/deeper/out.jsonl", keep_folder=True)
    assert (tmp_path / "new/deeper").is_dir() and os.listdir(tmp_path / "new/deeper") == []
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(OutputError, match="file.txt is a file, not a folder"):
        check_output(tmp_path / "file.txt/out.jsonl")
    with pytest.raises(OutputError, match="file.txt is a file, not a folder"):
        check_output(tmp_path / "file.txt/sub/out.jsonl")
    with pytest.raises(OutputError, match="is a folder"):
        check_output(tmp_path / "new")


def test_check_output_unwritable_folder(tmp_path, monkeypatch):
    import tempfile

    def denied(*a, **k):  # tests run as root, which ignores chmod: simulate EACCES
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(OutputError, match=r"output folder .* is not writable \(Permission denied\)"):
        check_output(tmp_path / "out.jsonl")


def test_write_json_atomic(tmp_path, monkeypatch):
    out = tmp_path / "res.jsonl"
    status = status_path(out)
    assert status.name == "res.jsonl.status.json" and summary_path(out).name == "res.jsonl.summary.json"
    write_json_atomic(status, {"done": 1})
    write_json_atomic(status, {"done": 2, "name": "ü"})
    assert json.loads(status.read_text()) == {"done": 2, "name": "ü"}

    def crash(*a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OutputError, match="status.json: No space left"):
        write_json_atomic(status, {"done": 3})
    assert json.loads(status.read_text()) == {"done": 2, "name": "ü"}  # old file whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.jsonl.status.json"]  # no temp file left


def test_stats_summary():
    s = Stats(skipped=4)
    for i in range(1, 11):
        s.count(False, 5, 10, ttft_s=i / 10)
    s.count(True, 0, 0)
    out = s.summary(startup_s=2.0, generation_s=4.0)
    assert out["records_done"] == 10 and out["records_failed"] == 1 and out["records_skipped"] == 4
    assert out["prompt_tokens"] == 50 and out["completion_tokens"] == 100
    assert out["tokens_per_s"] == 25.0 and out["records_per_s"] == 2.5
    assert out["ttft_p50_s"] == 0.55 and out["ttft_p95_s"] == pytest.approx(0.955)
    assert json.dumps(out)
    assert Stats().summary(0.0, 0.0)["ttft_p50_s"] is None
    import tracemalloc                      # what the driver keeps a record for the summary: a number
    tracemalloc.start()
    big = Stats()
    for i in range(100_000):
        big.count(False, 5, 10, ttft_s=i * 1e-3)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert held < 12 * 100_000 and big.summary(1.0, 1.0)["ttft_p50_s"] == 49.9995


def test_resume_reads_the_file_in_chunks_with_lines_across_their_edges(tmp_path, monkeypatch):
    """Resume reads a chunk at a time (a regular expression over msinfer's own lines, anything
    else line by line): with chunks smaller than a line, the same ids, the partial last line cut,
    and a bad line in the middle refused, as with one chunk for the whole file."""
    import msinfer.launcher.writer as writer_module
    path = tmp_path / "out.jsonl"
    ids = [f"r{i}" for i in range(40)] + ['q"uote', "é✓"]
    with ResultWriter(path) as w:
        for i, rid in enumerate(ids):
            w.write(ok_result(rid, [1, 2, 3], "x" * (i * 7 % 50), "stop", 1))
    whole = path.read_bytes()
    for chunk in (7, 64, 1000, 1 << 22):
        monkeypatch.setattr(writer_module, "RESUME_CHUNK", chunk)
        path.write_bytes(whole + b'{"id": "late", "output_tok')
        with ResultWriter(path) as w:
            assert holds(w.done_ids, set(ids)) and w.cut_partial_line, chunk
        assert path.read_bytes() == whole
        lines_ = whole.split(b"\n")
        path.write_bytes(b"\n".join(lines_[:5] + [b"not json"] + lines_[5:]))
        with pytest.raises(OutputError, match="line 6: not a whole JSON result, and more lines follow"):
            ResultWriter(path)


def test_retry_failed_drops_the_error_lines_so_their_records_run_again(tmp_path):
    """A resume keeps error lines (and counts them); with retry_failed the file is rewritten
    without them, so only their ids are computed again, and a partial last line is still cut."""
    path = tmp_path / "out.jsonl"
    with ResultWriter(path) as w:
        w.write(ok_result("a", [1], 'says "error": {', "stop", 1))       # escaped in JSON: not an error
        w.write(error_result("b", "InvalidRecord", "too long"))
        w.write(ok_result("c", [2], "z", "stop", 1))
    with open(path, "ab") as f:
        f.write(b'{"id": "d", "outp')
    kept = ResultWriter(path)
    assert holds(kept.done_ids, {"a", "b", "c"}) and kept.failed_lines == 1 and kept.dropped_failed == 0
    kept.close()
    with open(path, "ab") as f:
        f.write(b'{"id": "d", "outp')
    os.chmod(path, 0o640)                   # the user's: the rewrite keeps it (mkstemp's file is 0o600)
    retry = ResultWriter(path, retry_failed=True)
    assert holds(retry.done_ids, {"a", "c"}) and retry.dropped_failed == 1 and retry.failed_lines == 0
    retry.write(ok_result("b", [3], "y", "stop", 1))
    retry.close()
    assert [r["id"] for r in lines(path)] == ["a", "c", "b"] and not [r for r in lines(path) if r["error"]]
    assert os.stat(path).st_mode & 0o777 == 0o640


def test_files_written_through_a_temporary_file_get_a_new_file_s_mode_or_keep_theirs(tmp_path):
    """The summary, status and bench files are written to a temporary file and renamed: they get
    the mode a new file gets (0o644 less the umask), not mkstemp's 0o600, and keep one they have."""
    path = tmp_path / "s.json"
    writer_module.write_json_atomic(path, {"a": 1})
    assert os.stat(path).st_mode & 0o777 == 0o644 & ~writer_module.umask()
    os.chmod(path, 0o600)
    writer_module.write_json_atomic(path, {"a": 2})
    assert os.stat(path).st_mode & 0o777 == 0o600 and json.loads(path.read_text()) == {"a": 2}
    old = os.umask(0o077)
    try:
        assert writer_module.umask() == 0o077
    finally:
        os.umask(old)


def test_each_result_s_input_digest_is_kept_beside_it_the_last_one_for_an_id_counting(tmp_path):
    """<output>.inputs holds a line per result that came with its record's input digest, an error
    line marked; a result line dropped (--retry-failed, --redo-changed) drops its digest, and a
    record computed again gives a new one; a crash's partial line is no digest;
    a results file started afresh (--overwrite, or removed) starts the digests afresh too; merging
    shards carries theirs."""
    from msinfer.launcher.shards import in_shard, merge_shards, shard_path
    from msinfer.launcher.writer import inputs_path, read_input_digests
    path = tmp_path / "out.jsonl"
    with ResultWriter(path) as w:
        w.write_line("a", json.dumps(ok_result("a", [1], "x", "stop", 1)), "00aa")
        w.write_line('b "q"', json.dumps(error_result('b "q"', "t", "m")), "00bb")
        w.write_line("c", json.dumps(ok_result("c", [1], "x", "stop", 1)))         # no digest: not kept
    assert read_input_digests(path) == {"a": "00aa", 'b "q"': "00bb!"}
    ResultWriter(path, retry_failed=True).close()           # its error line dropped, and not computed yet
    assert read_input_digests(path) == {"a": "00aa"}
    ResultWriter(path, redo_ids=frozenset({"a"})).close()
    assert read_input_digests(path) == {}
    with ResultWriter(path) as w:
        w.write_line('b "q"', json.dumps(ok_result('b "q"', [1], "x", "stop", 1)), "00cc")
        w.write_line("a", json.dumps(ok_result("a", [1], "x", "stop", 1)), "00aa")
    with open(inputs_path(path), "ab") as f:
        f.write(b'00dd\t0\t"a')
    assert read_input_digests(path) == {"a": "00aa", 'b "q"': "00cc"}
    with ResultWriter(path, overwrite=True) as w:
        w.write_line("z", json.dumps(ok_result("z", [1], "x", "stop", 1)), "00ee")
    assert read_input_digests(path) == {"z": "00ee"}
    path.unlink()
    with ResultWriter(path) as w:
        w.write_line("y", json.dumps(ok_result("y", [1], "x", "stop", 1)), "00ff")
    assert read_input_digests(path) == {"y": "00ff"}

    ids = [f"r{i}" for i in range(6)]
    out = str(tmp_path / "merged.jsonl")
    for k in range(2):
        with ResultWriter(shard_path(out, k, 2)) as w:
            for i in ids:
                if in_shard(i, k, 2):
                    w.write_line(i, json.dumps(ok_result(i, [1], "x", "stop", 1)), f"d{i}")
    with open(inputs_path(shard_path(out, 0, 2)), "ab") as f:
        f.write(b'00dd\t0\t"r')                      # a crash's partial line, which must not join the next shard's
    merge_shards(ids, out, 2, "id")
    assert read_input_digests(out) == {i: f"d{i}" for i in ids}


def test_a_second_lock_on_one_results_file_names_the_first_and_a_released_lock_is_free(tmp_path):
    out = tmp_path / "out.jsonl"
    with ResultsLock(out) as first:
        held = json.loads(lock_path(out).read_text())
        assert held["pid"] == os.getpid() and held["host"] == first.info["host"]
        with pytest.raises(OutputError, match=rf"another msinfer run \(host .*, pid {os.getpid()}, started "):
            ResultsLock(out)
    assert not lock_path(out).exists()
    with ResultsLock(out, "simulate"):
        with pytest.raises(OutputError, match="another msinfer simulate"):
            ResultsLock(out)


def test_a_dead_runs_lock_is_taken_over_and_another_machines_only_once_stale(tmp_path, monkeypatch):
    """On this machine a lock whose process is gone is taken over at once; a lock of another
    machine only once it has not been renewed for LOCK_STALE_S."""
    import subprocess
    import sys
    out = tmp_path / "out.jsonl"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    me = ResultsLock(out)
    me.release()
    dead = {**me.info, "pid": int(gone.stdout)}
    lock_path(out).write_text(json.dumps(dead))
    with ResultsLock(out) as taken:
        assert json.loads(lock_path(out).read_text())["pid"] == taken.info["pid"] == os.getpid()
    elsewhere = {**me.info, "host": "node-7", "boot_id": "other"}
    lock_path(out).write_text(json.dumps(elsewhere))
    with pytest.raises(OutputError, match="host node-7"):
        ResultsLock(out)
    old = time.time() - writer_module.LOCK_STALE_S - 5
    os.utime(lock_path(out), (old, old))
    with ResultsLock(out):
        assert json.loads(lock_path(out).read_text())["host"] != "node-7"


# ---- shards of one input, and their merge (launcher.shards) --------------------------------------

def test_shards_split_the_ids_alike_everywhere_and_name_their_results_files():
    from msinfer.launcher.shards import in_shard, parse_shard, resolve_shard, shard_path
    ids = [f"rec-{i}" for i in range(600)] + ["ünï", ""]
    shards = [[i for i in ids if in_shard(i, k, 3)] for k in range(3)]
    assert sorted(sum(shards, [])) == sorted(ids)                       # each id in exactly one
    assert all(150 <= len(s) <= 250 for s in shards), [len(s) for s in shards]
    assert in_shard("rec-0", *parse_shard("1/3")) == (zlib.crc32(b"rec-0") % 3 == 1)    # CRC-32: any machine
    assert shard_path("/o/results.jsonl", 2, 4) == "/o/results.2-of-4.jsonl"
    assert shard_path("/o/results.2-of-4.jsonl", 2, 4) == "/o/results.2-of-4.jsonl"
    assert shard_path("/o/{shard}/out.jsonl", 0, 4) == "/o/0-of-4/out.jsonl"
    env = {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "5", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert resolve_shard("auto", env) == (2, 4) and resolve_shard(None, env) is None
    for bad in ("3/3", "a/b", "-1/3", "1/0", "2"):
        with pytest.raises(ValueError, match="K/N|K must be"):
            parse_shard(bad)
    with pytest.raises(UserError, match=r"input.shard: auto .* \(SLURM_ARRAY_TASK_ID and "
                                        r"SLURM_ARRAY_TASK_COUNT\), and they are not set"):
        resolve_shard("auto", {})


def test_merge_writes_the_shards_in_input_order_or_names_what_is_missing_and_doubled(tmp_path):
    from msinfer.launcher.shards import in_shard, merge_shards, shard_path
    ids = [f"r{i}" for i in range(20)]
    out = str(tmp_path / "results.jsonl")
    for k in range(3):
        with open(shard_path(out, k, 3), "w") as f:
            f.writelines(json.dumps({"id": i, "k": k}) + "\n" for i in reversed(ids) if in_shard(i, k, 3))
    assert merge_shards(ids, out, 3, "id") == {"records": 20, "shards": 3, "path": out}
    merged = [json.loads(line) for line in open(out)]
    assert [m["id"] for m in merged] == ids and all(in_shard(m["id"], m["k"], 3) for m in merged)
    os.remove(out)
    first = shard_path(out, 0, 3)
    kept = open(first).read().splitlines(keepends=True)
    gone = json.loads(kept[0])["id"]
    open(first, "w").writelines(kept[1:] + [kept[1], kept[0][:9]])     # one line lost (partial), one doubled
    with pytest.raises(UserError) as e:
        merge_shards(ids, out, 3, "id")
    assert f"1 record(s) have no line: {gone}" in str(e.value)
    assert f"1 record(s) have more than one line: {json.loads(kept[1])['id']} (results.0-of-3.jsonl:1 and " \
           f"results.0-of-3.jsonl:{len(kept)})" in str(e.value)
    assert not os.path.exists(out)
    open(first, "w").writelines(kept + [json.dumps({"id": "stray", "k": 0}) + "\n"])
    with pytest.raises(UserError, match=r"do not hold each of the input's 20 records exactly once: 1 line\(s\) name "
                                        r"records the input does not have: stray. Nothing was written"):
        merge_shards(iter(ids), out, 3, "id")
    assert not os.path.exists(out) and not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # nor half of it
    os.remove(shard_path(out, 2, 3))
    with pytest.raises(UserError, match=r"results.2-of-3.jsonl: shard 2 of 3 has no results file"):
        merge_shards(ids, out, 3, "id")


def test_shards_named_by_a_shard_placeholder_merge_into_the_path_with_merged_in_its_place(tmp_path):
    """output.path with {shard}: shard K writes the path with K-of-N there, and merge reads them and
    writes the path with `merged` there (it refused such a path and could merge them no other way)."""
    from msinfer.launcher.shards import in_shard, merge_shards, shard_path
    ids = [f"r{i}" for i in range(12)]
    template = str(tmp_path / "res-{shard}" / "out.jsonl")
    for k in range(2):
        os.makedirs(os.path.dirname(shard_path(template, k, 2)), exist_ok=True)
        with open(shard_path(template, k, 2), "w") as f:
            f.writelines(json.dumps({"id": i}) + "\n" for i in ids if in_shard(i, k, 2))
    assert shard_path(template, 1, 2) == str(tmp_path / "res-1-of-2" / "out.jsonl")
    merged = str(tmp_path / "res-merged" / "out.jsonl")
    os.makedirs(os.path.dirname(merged))
    assert merge_shards(ids, template, 2, "id") == {"records": 12, "shards": 2, "path": merged}
    assert [json.loads(line)["id"] for line in open(merged)] == ids


@pytest.mark.unit
def test_the_input_digests_held_compactly_answer_as_the_dict_of_them(tmp_path):
    """launcher.writer.input_digest_index holds `<output>.inputs` as launcher.idset does: each id's
    latest line wins, also over runs that merged and within one batch; a dropped line, an error
    line and a digest that is not hexadecimal read as read_input_digests reads them."""
    import random
    from msinfer.launcher.idset import IdSet
    from msinfer.launcher.writer import (DIGEST_DROPPED, digest_value, input_digest_index, input_line, inputs_path,
                                         read_input_digests)
    rng = random.Random(3)
    out = tmp_path / "out.jsonl"
    with open(inputs_path(out), "wb") as f:
        for _ in range(3000):
            rid = f"r{rng.randrange(700)}"
            kind = rng.random()
            digest = None if kind < 0.1 else "zz-not-hex" if kind < 0.12 else f"{rng.getrandbits(64):016x}"
            f.write(input_line(rid, digest, rng.random() < 0.2))
        f.write(b'0123456789abcdef\t0\t"partial"')                 # a crash's line: left out
    want = read_input_digests(out)
    index = input_digest_index(out)
    ids = [f"r{i}" for i in range(700)] + ["partial"]
    for rid, value in zip(ids, index.lookup(ids)):
        if rid not in want:
            assert value in (-1, DIGEST_DROPPED), rid
        else:
            digest, failed = want[rid].rstrip("!"), want[rid].endswith("!")
            assert value == digest_value(digest, failed) and value & 1 == failed, rid
            if digest != "zz-not-hex":
                assert value >> 1 == int(digest, 16) >> 3
    s = IdSet()
    s.update(["a", "b", "a"], [1, 2, 3])
    for k in range(20):                                           # runs merge as they grow
        s.update([f"x{k}-{j}" for j in range(50)] + ["b"], [0] * 50 + [100 + k])
    assert s.lookup(["a", "b", "x3-7", "nope"]) == [3, 119, 0, -1] and "x19-49" in s and "nope" not in s
