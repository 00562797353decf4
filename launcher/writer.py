"""The results file (one JSON line per record) and its companions `<output>.status.json`,
`<output>.summary.json`, `<output>.inputs` (what input each result answers, `ResultWriter`) and,
while a run writes it, `<output>.lock` (`ResultsLock`).

Crash safety: results are written in whole lines, a batch of them in one write() at each pass of
the driver's loop; a thread of the writer syncs the file to disk at most every
output.fsync_interval_s (group commit), so the driver's loop never waits for the disk. A process
killed mid-write leaves at most a partial last line; the next run's ResultWriter cuts it away, and
the ids on the whole lines (`done_ids`) are not computed again. Companion files are replaced
atomically, so a reader sees the old or the new file, never half of one.
"""

from __future__ import annotations

import array
import datetime
import errno
import functools
import json
import os
import re
import socket
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from msinfer.launcher.errors import OutputError
from msinfer.launcher.idset import IdSet, chunks


# what marks an error result in a line as msinfer writes it: `"error": {` (its own format) or a
# response body's (OpenAI's); a text or id holding those characters is escaped (\"error\") in JSON
FAILED = b'"error": {'
FLUSH_LINES = 4096          # lines a batch holds at most before it is written
RESUME_CHUNK = 1 << 20      # bytes a resume reads at a time (peak memory grows with it: 16 MiB, +80 MB)


def status_path(output: str | Path) -> Path:
    return Path(f"{output}.status.json")


def summary_path(output: str | Path) -> Path:
    return Path(f"{output}.summary.json")


def lock_path(output: str | Path) -> Path:
    return Path(f"{output}.lock")


def kept_settings(output: str | Path) -> dict | None:
    """The settings the status file beside a results file keeps (None: none, or no such file)."""
    before = (read_summary(status_path(output)) or {}).get("settings")     # (any JSON object file)
    return before if isinstance(before, dict) else None


def holds_results(output: str | Path) -> bool:
    """Whether the results file is there with something in it: what a re-run resumes and checks."""
    path = Path(output)
    return path.is_file() and path.stat().st_size > 0


def inputs_path(output: str | Path) -> Path:
    return Path(f"{output}.inputs")


def input_line(record_id: str, digest: str | None, failed: bool = False) -> bytes:
    """A line of `<output>.inputs` (`read_input_digests`); digest None: the record's result line
    was dropped (`ResultWriter._drop_lines`), so that it has none."""
    return f"{digest or '-'}\t{int(failed)}\t{json.dumps(record_id)}\n".encode()


def read_input_digests(output: str | Path) -> dict[str, str]:
    """The `<output>.inputs` file of a results file: record id -> the `input_digest`
    (launcher.inputs) of the input its result line answers, with "!" after it where that line is
    an error. Lines are appended as results are, so a later one for an id (a record computed
    again) replaces an earlier one; a line that is not whole (a crash's) is left out, and a record
    without one is not checked. Empty where there is no such file (results written before msinfer
    kept one). A re-run's check holds them as `input_digest_index`."""
    digests: dict[str, str] = {}
    for rid, digest, failed in _input_lines(output):
        if digest is None:              # its result line was dropped
            digests.pop(rid, None)
        else:
            digests[rid] = digest + ("!" if failed else "")
    return digests


DIGEST_DROPPED = 1 << 62            # input_digest_index's value of a record whose result line was dropped
DIGEST_UNREAD = DIGEST_DROPPED + 2  # and of a digest that is not hexadecimal (never equal to a record's)


def input_digest_index(output: str | Path) -> IdSet:
    """What `read_input_digests` reads, held compactly (launcher.idset), as each id's value: its
    digest's first 61 bits, shifted left by one, with 1 added where its line is an error
    (`digest_value`); DIGEST_DROPPED where its line was dropped since."""
    index = IdSet()
    for chunk in chunks(_input_lines(output)):
        index.update([rid for rid, _, _ in chunk], [DIGEST_DROPPED if digest is None else digest_value(digest, failed)
                                                    for _, digest, failed in chunk])
    return index


def recorded_ids(output: str | Path):
    """The ids of `<output>.inputs`' whole lines, in order (a dropped line's too: an id may come
    more than once; `input_digest_index` holds each one's latest)."""
    return (rid for rid, _, _ in _input_lines(output))


def digest_value(digest: str, failed: bool = False) -> int:
    """An input digest (16 hexadecimal digits) as `input_digest_index` holds it."""
    try:
        return (int(digest, 16) >> 3) << 1 | failed
    except ValueError:
        return DIGEST_UNREAD | failed


def _input_lines(output: str | Path):
    """(id, digest or None for a dropped line, whether its line is an error) of each whole line
    of `<output>.inputs`, in order."""
    try:
        with open(inputs_path(output), "rb") as f:
            for raw in f:
                parts = raw.split(b"\t", 2)
                if len(parts) != 3 or not raw.endswith(b"\n") or parts[1] not in (b"0", b"1"):
                    continue
                try:
                    rid = json.loads(parts[2])
                except ValueError:
                    continue
                if not isinstance(rid, str):
                    continue
                digest = None if parts[0] == b"-" else parts[0].decode("ascii", "replace")
                yield rid, digest, parts[1] == b"1"
    except FileNotFoundError:
        return
    except OSError as e:
        raise OutputError(f"{inputs_path(output)} cannot be read: {e.strerror or e}") from None


LOCK_REFRESH_S = 10.0       # a run touches its lock file this often
LOCK_STALE_S = 120.0        # a lock of another machine's run not touched for this long is a dead run's
LOCK_UNREAD_S = 10.0        # a lock file without its JSON this long after it was made: a run died making it


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> float | None:
    """When the process `pid` of this machine started (None: there is none)."""
    import psutil
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


class ResultsLock:
    """One run per results file: `<output>.lock`, made with O_EXCL (atomic on local file systems
    and on the shared ones clusters use, NFSv3 and later included), holds the run's host, boot id,
    pid and start time, and its modification time is renewed every LOCK_REFRESH_S while the run
    lives. A second run finds it and stops with an OutputError that names the holder. A lock is
    a dead run's, and is taken over, when its run was on this machine (same host name and boot id)
    and its process is gone (or the pid now names a later process), or when it was on another
    machine and has not been renewed for LOCK_STALE_S."""

    def __init__(self, output: str | Path, command: str = "run"):
        self.output, self.path = Path(output), lock_path(output)
        self.info = {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
                     "process_start_unix": _process_start(os.getpid()), "started_unix": time.time(),
                     "command": command}
        self.stop = threading.Event()
        self._acquire()
        self.refresher = threading.Thread(target=self._refresh, name="results-lock", daemon=True)
        self.refresher.start()

    def _acquire(self) -> None:
        data = (json.dumps(self.info) + "\n").encode()
        deadline = time.monotonic() + LOCK_UNREAD_S + 2
        while time.monotonic() < deadline:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder, age, text = self._holder()
                if holder is not None and not self._dead(holder, age):
                    raise OutputError(
                        f"results file {self.output} is being written by another msinfer {holder.get('command', 'run')}"
                        f" (host {holder.get('host')}, pid {holder.get('pid')}, started "
                        f"{_when(holder.get('started_unix'))}; lock file {self.path}). Wait for it to finish or "
                        f"stop it, or choose another output.path; a lock whose run died is taken over by the next "
                        f"run by itself") from None
                if holder is None and age < LOCK_UNREAD_S:
                    time.sleep(0.2)         # being made by a run that starts now: read it again
                    continue
                self._take_over(text)
                continue
            except OSError as e:
                raise OutputError(f"cannot make the lock file {self.path}: {e.strerror or e}") from None
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            return
        raise OutputError(f"cannot take the lock file {self.path}: other runs keep making it; "
                          f"is another msinfer starting on {self.output}?")

    def _holder(self) -> tuple[dict | None, float, bytes]:
        """The lock file's run ({}: the file is gone; None: not readable, or not made whole yet),
        the file's age in seconds, and its bytes."""
        try:
            age = time.time() - self.path.stat().st_mtime
            text = self.path.read_bytes()
        except FileNotFoundError:
            return {}, float("inf"), b""
        except OSError:
            return None, 0.0, b""
        try:
            holder = json.loads(text)
        except ValueError:
            return None, age, text
        return (holder if isinstance(holder, dict) and holder else None), age, text

    def _take_over(self, stale: bytes) -> None:
        """Moves the dead run's lock file (`stale`, its bytes) aside. Another run may have taken it
        over and made its own since we read it: a file moved aside that is not the one read goes
        back."""
        aside = self.path.with_name(f"{self.path.name}.{os.getpid()}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            if aside.read_bytes() != stale:
                os.link(aside, self.path)       # back, unless yet another run made one meanwhile
        except OSError:
            pass
        finally:
            aside.unlink(missing_ok=True)

    def _dead(self, holder: dict, age: float) -> bool:
        if not holder:                      # gone since we looked
            return True
        if holder.get("host") == self.info["host"] and holder.get("boot_id") == self.info["boot_id"]:
            start = _process_start(int(holder.get("pid") or 0))
            return start is None or (holder.get("process_start_unix") is not None
                                     and abs(start - holder["process_start_unix"]) > 1.0)
        return age > LOCK_STALE_S

    def _refresh(self) -> None:
        while not self.stop.wait(LOCK_REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Removes the lock file if it is still this run's."""
        if self.stop.is_set():
            return
        self.stop.set()
        self.refresher.join()
        try:
            holder = json.loads(self.path.read_bytes())
            if holder.get("pid") == self.info["pid"] and holder.get("started_unix") == self.info["started_unix"]:
                os.remove(self.path)
        except (OSError, ValueError, AttributeError):
            pass

    def __enter__(self) -> ResultsLock:
        return self

    def __exit__(self, *exc):
        self.release()


def _when(unix) -> str:
    try:
        return datetime.datetime.fromtimestamp(float(unix)).astimezone().isoformat(timespec="seconds")
    except (TypeError, ValueError, OverflowError, OSError):
        return "at an unknown time"


def check_output(path: str | Path, keep_folder: bool = False) -> Path:
    """Before any worker starts: the results file's folder exists, or can be made, and takes a
    new file. The folders it makes to find out are removed again unless `keep_folder` (`msinfer
    run`), so that `msinfer plan` leaves nothing behind."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise OutputError(f"output.path {path} is a folder; expected a file name such as {path / 'results.jsonl'}")
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise OutputError(f"output folder {folder} cannot be created: {existing} is a file, not a folder")
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"output folder {folder} cannot be created: {existing} does not take new folders "
                              f"({e.strerror or e}); choose another output.path") from None
        try:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".msinfer-probe-")
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            denied = e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
            raise OutputError(f"output folder {folder} {'is not writable' if denied else 'does not take new files'} "
                              f"({e.strerror or e}); choose another output.path"
                              + (" or fix the folder's permissions" if denied else "")) from None
    finally:
        if not keep_folder:
            for p in made:              # the deepest first
                try:
                    p.rmdir()
                except OSError:
                    break
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"results file {path} exists and is not writable; fix its permissions or choose "
                          f"another output.path")
    return path


class ResultWriter:
    """Appends results to `path`. Without `overwrite`, an existing file is resumed: its whole
    lines stay, their ids are in `done_ids`, and a partial last line (a crash mid-write) is cut
    so that its record is computed again, once. The lines written since are counted
    (`lines_written`), not held: a run reads each record once (its ids are unique,
    launcher.inputs), so only the ids the file held before need looking up, and a job of many
    millions of records keeps no id of theirs.

    Lines go to the file (the kernel) in one write() per pass of the driver's loop, as their
    results come (`write_line`, then `flush`), so a crash of msinfer loses at most the results
    of that pass; the file is synced to disk (group commit) at most every `fsync_interval_s`
    seconds, by a thread of its own, and when it is closed, so a crash of the machine loses at
    most the results of that window (and of a sync under way). The next run computes what was
    lost again. With `fsync_interval_s` 0 every line is written and synced as it comes.

    Beside it, `<output>.inputs` gets a line for each result that comes with its record's input
    digest (`write_line`), `<digest>\t<1 for an error line, else 0>\t<the id in JSON>`, written
    before the results of the same batch (`read_input_digests` reads it). It starts afresh with
    the results file."""

    def __init__(self, path: str | Path, overwrite: bool = False, fsync_interval_s: float = 1.0,
                 id_key: str = "id", retry_failed: bool = False, redo_ids: frozenset = frozenset()):
        """id_key: the key of a result line that holds its record's id ("custom_id" in the
        OpenAI Batch format, launcher.openai_batch). retry_failed: an existing file loses its
        error lines first (`_drop_lines`), so that their records are computed again; redo_ids:
        likewise the lines of these records (whose input changed, launcher.job.changed_records)."""
        self.path = Path(path)
        self.id_key = id_key
        self.fsync_interval_s = fsync_interval_s
        self.synced_size = 0                  # bytes of the file known to be on disk
        self.sync_error: OSError | None = None
        self.stop_syncing = threading.Event()
        self.pending: list[bytes] = []        # lines given, not written yet (`flush`)
        self.syncer: threading.Thread | None = None
        self.done_ids = IdSet()               # the ids on the file's lines when it was opened (launcher.idset)
        self.lines_written = 0                # since
        self.cut_partial_line = False
        self.failed_lines = 0                 # of the lines resumed: error results (their records are not retried)
        self.dropped_failed = 0               # error lines removed for retry_failed
        self.dropped_changed = 0              # lines removed for redo_ids
        self.pending_inputs: list[bytes] = []   # their `<output>.inputs` lines
        self.inputs_unsynced = False          # `<output>.inputs` written since its last fsync
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        fresh = overwrite or not holds_results(self.path)
        if overwrite:
            flags |= os.O_TRUNC
        elif self.path.exists():
            if retry_failed or redo_ids:
                self._drop_lines(retry_failed, redo_ids)
            self._resume()
        self.fd: int | None = None
        try:
            self.inputs_fd: int | None = os.open(inputs_path(self.path), flags | (os.O_TRUNC if fresh else 0), 0o644)
            self.fd = os.open(self.path, flags, 0o644)
            self.size = self.synced_size = os.fstat(self.fd).st_size
        except OSError as e:
            raise OutputError(f"results file {self.path} cannot be opened for writing: {e.strerror or e}") from None
        if fsync_interval_s > 0:
            self.syncer = threading.Thread(target=self._sync_loop, name="results-fsync", daemon=True)
            self.syncer.start()

    def _resume(self):
        """Reads the ids of the whole lines into done_ids, a chunk of the file at a time: in a
        chunk of lines as msinfer writes them (`_id_lines`) one regular expression finds every id;
        any other chunk goes line by line (`result_id`). A line that is not a whole result may
        only be the last (a crash's partial write), which is cut."""
        good = 0            # bytes of the whole result lines read
        bad_line = 0        # the number of a line that is not one
        n = 0               # lines read
        ids_of = _id_lines(self.id_key)
        try:
            with open(self.path, "r+b") as f:
                rest = b""
                while True:
                    chunk = f.read(RESUME_CHUNK)
                    data = rest + chunk
                    cut = data.rfind(b"\n") + 1
                    block, rest = data[:cut], data[cut:]
                    if block and bad_line:
                        raise not_a_result(self.path, bad_line)
                    lines = block.count(b"\n")
                    ids = ids_of.findall(block)
                    try:
                        if len(ids) != lines:
                            raise ValueError("a line msinfer did not write")
                        self.done_ids.update([_id_text(rid) for rid in ids])
                        good, n = good + len(block), n + lines
                        self.failed_lines += block.count(FAILED)
                    except ValueError:      # also UnicodeDecodeError
                        read = []
                        for raw in block.split(b"\n")[:-1]:
                            n += 1
                            if bad_line:
                                raise not_a_result(self.path, bad_line) from None
                            rid = result_id(raw + b"\n", self.id_key)
                            if rid is None:
                                bad_line = n
                                continue
                            read.append(rid)
                            good += len(raw) + 1
                            self.failed_lines += FAILED in raw
                        self.done_ids.update(read)
                    if not chunk:
                        break
                if rest:                    # a last line without its newline
                    if bad_line:
                        raise not_a_result(self.path, bad_line)
                    bad_line = n + 1
                if bad_line:
                    f.truncate(good)
                    f.flush()
                    os.fsync(f.fileno())
                    self.cut_partial_line = True
        except OSError as e:
            raise OutputError(f"results file {self.path} exists but cannot be read and resumed: "
                              f"{e.strerror or e}") from None

    def _drop_lines(self, failed: bool, ids: frozenset) -> None:
        """Rewrites the file without its error lines (a whole line holding FAILED) where `failed`
        and the whole lines of `ids`, through a temporary file and an atomic rename: a crash
        leaves the old file or the new one. Other lines, a partial last one included, stay for
        `_resume` to judge. `<output>.inputs` is told first that their records have no result
        (a crash before the rename leaves them unchecked, never checked against a line gone)."""
        dropped: list[str] = []
        try:
            with open(self.path, "rb") as src, Replacement(self.path, binary=True, suffix=".retry") as out:
                for line in src:
                    error = failed and line.endswith(b"\n") and FAILED in line
                    rid = result_id(line, self.id_key) if error or ids else None
                    if error or rid in ids:
                        self.dropped_failed += error
                        self.dropped_changed += not error
                        dropped.append(rid)
                        continue
                    out.file.write(line)
                if not dropped:
                    out.discard()
                else:
                    with open(inputs_path(self.path), "ab") as inputs:
                        inputs.write(b"".join(input_line(rid, None) for rid in dropped if rid is not None))
                        inputs.flush()
                        os.fsync(inputs.fileno())
        except OSError as e:
            raise OutputError(f"results file {self.path}: cannot rewrite it without the lines of the records to "
                              f"compute again (--retry-failed, --redo-changed): {e.strerror or e}") from None

    def write(self, result: dict):
        """One result, written at once."""
        self.write_line(str(result[self.id_key]), json.dumps(result, ensure_ascii=False))
        self.flush()

    def write_line(self, record_id: str, text: str, digest: str | None = None):
        """One result line already encoded as JSON (no newline), for the record `record_id` whose
        input has `digest` (launcher.inputs.input_digest; None: none kept). It goes to the file
        with the others of its batch at the next `flush` (the driver flushes once per pass of its
        loop, before it waits again), or at once with fsync_interval_s 0."""
        if self.fd is None:
            raise OutputError(f"results file {self.path} is closed; no more results can be written")
        line = (text + "\n").encode("utf-8")
        self.pending.append(line)
        if digest is not None:
            self.pending_inputs.append(input_line(record_id, digest, FAILED in line))
        if self.syncer is None or len(self.pending) >= FLUSH_LINES:
            self.flush()

    def flush(self):
        """Writes the lines given since the last flush in one write() (and syncs them with
        fsync_interval_s 0)."""
        if not self.pending or self.fd is None:
            return
        if self.sync_error is not None:         # the disk refused what was written before
            self._fail(self.sync_error)
        batch = b"".join(self.pending)
        try:
            # the inputs first: a crash between the two leaves a digest without its result,
            # which no re-run reads (its record is computed again), never a result without one
            if self.pending_inputs:
                _write_all(self.inputs_fd, b"".join(self.pending_inputs))
                self.inputs_unsynced = True
                if self.syncer is None:
                    self._sync_inputs()
            _write_all(self.fd, batch)
            if self.syncer is None:
                os.fsync(self.fd)
        except OSError as e:
            self._fail(e)
        self.size += len(batch)
        self.lines_written += len(self.pending)
        self.pending.clear()
        self.pending_inputs.clear()

    def _fail(self, e: OSError):
        self.pending.clear()
        self.pending_inputs.clear()
        try:  # drop the partial batch, if any: what was written before stays whole
            os.ftruncate(self.fd, self.size)
        except OSError:
            pass
        self.close()
        kept = len(self.done_ids) + self.lines_written
        raise OutputError(f"cannot write to results file {self.path}: {e.strerror or e}. The {kept} results written "
                          f"so far are kept; after freeing space or fixing permissions, run the same job again to "
                          f"resume after them") from None

    def _sync_inputs(self) -> None:
        if self.inputs_unsynced:
            self.inputs_unsynced = False
            os.fsync(self.inputs_fd)

    def _sync_loop(self):
        while not self.stop_syncing.wait(self.fsync_interval_s):
            size = self.size
            if size == self.synced_size:
                continue
            try:
                self._sync_inputs()
                os.fsync(self.fd)
                self.synced_size = size
            except OSError as e:
                self.sync_error = e
                return

    def close(self):
        if self.fd is not None and self.pending:
            self.flush()
        if self.syncer is not None:
            self.stop_syncing.set()
            self.syncer.join()
            self.syncer = None
        for name, sync in (("inputs_fd", self.inputs_unsynced), ("fd", True)):
            fd = getattr(self, name, None)
            if fd is not None:
                try:
                    if sync:
                        os.fsync(fd)
                except OSError:
                    pass
                os.close(fd)
                setattr(self, name, None)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc):
        self.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # a regular file takes it all in one write(); loop in case it did not
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(28, os.strerror(28))  # ENOSPC
        view = view[n:]


@functools.lru_cache(maxsize=4)
def _id_lines(key: str) -> re.Pattern:
    """A result line as msinfer writes it (json.dumps: `{"<key>": "<id>", ...}`, the id first,
    without a quote or an escape in it, or an integer id as the input gave it; a closing brace
    last), the id in group 1, with its quotes (`_id_text`): `result_id` matches one line, a resume
    `findall`s a chunk of them."""
    return re.compile(rb'^\{"' + re.escape(key.encode()) + rb'": ("[^"\\\n]*"|-?[0-9]+), [^\n]*\}$', re.MULTILINE)


def _id_text(found: bytes) -> str:
    """An id as `_id_lines` finds it (a quoted string, or an integer's digits) as resume keys it."""
    return found.strip(b'"').decode("utf-8")


def result_id(raw: bytes, key: str = "id") -> str | None:
    """The id of a whole result line, None for anything else (a crash's partial last line).
    A line as msinfer writes it (`_id_lines`) is known by its first bytes, with no JSON parse of
    the rest; any other is parsed."""
    if not raw.endswith(b"\n"):
        return None
    if m := _id_lines(key).match(raw):
        try:
            return _id_text(m.group(1))
        except UnicodeDecodeError:
            return None
    try:
        obj = json.loads(raw)
    except ValueError:  # also UnicodeDecodeError
        return None
    return str(obj[key]) if isinstance(obj, dict) and key in obj else None


def not_a_result(path: str | Path, n: int) -> OutputError:
    """A resume's error for line n of a results file, which is no whole result and not the last."""
    return OutputError(f"results file {path}, line {n}: not a whole JSON result, and more lines follow it, so it "
                       f"is not a crash's partial last line. Fix or remove that line, or pass --overwrite to start "
                       f"the results over")


def held_ids(path: str | Path, wanted: set, key: str = "id") -> set:
    """Which of the ids `wanted` have a whole result line in the results file `path`."""
    held = set()
    with open(path, "rb") as f:
        for raw in f:
            if (rid := result_id(raw, key)) in wanted:
                held.add(rid)
    return held


def read_summary(path: str | Path) -> dict | None:
    """A summary file written before (None: there is none, or it is not one)."""
    try:
        summary = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def keep_mode(tmp: str | Path, path: str | Path) -> None:
    """Gives `tmp`, about to replace `path`, the mode of `path`, or where there is none yet a new
    file's (0o644 less the umask, as the results file is opened): tempfile.mkstemp makes its
    files 0o600, which a file replaced through one would take."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o644 & ~umask()
    os.chmod(tmp, mode)


class Replacement:
    """`with Replacement(path) as r:` write `r.file`; when the block ends without an exception,
    the file (synced to disk first where `durable`, given `path`'s mode) replaces `path` in one
    rename, so that a reader or a crash sees the old file or the new one, never part of either.
    It is written beside `path` (same file system), and removed where the block raises or calls
    `discard()`, which leaves `path` as it was."""

    def __init__(self, path: str | Path, binary: bool = False, durable: bool = True, suffix: str = ".tmp"):
        self.path, self.binary, self.durable, self.suffix = Path(path), binary, durable, suffix
        self.kept = True

    def __enter__(self) -> Replacement:
        fd, self.tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=self.suffix)
        self.file = os.fdopen(fd, "wb") if self.binary else os.fdopen(fd, "w", encoding="utf-8", newline="")
        return self

    def discard(self) -> None:
        self.kept = False

    def __exit__(self, kind, exc, tb) -> None:
        try:
            if kind is None and self.kept:
                self.file.flush()
                if self.durable:
                    os.fsync(self.file.fileno())
                self.file.close()
                keep_mode(self.tmp, self.path)
                os.replace(self.tmp, self.path)
        finally:
            self.file.close()
            try:
                os.remove(self.tmp)         # (not there once it replaced `path`)
            except FileNotFoundError:
                pass


def write_json_atomic(path: str | Path, obj, durable: bool = True) -> None:
    """Replaces `path` with `obj` as JSON; `durable`: synced to disk first (the status file, which
    is rewritten every few seconds and only informs, is not: a sync there stalled the driver's
    loop for half a second at a time on this machine's disk)."""
    try:
        with Replacement(path, durable=durable) as r:
            json.dump(obj, r.file, ensure_ascii=False, indent=2)
            r.file.write("\n")
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None


@dataclass
class Stats:
    done: int = 0
    failed: int = 0
    skipped: int = 0                  # already in the results file when the run started
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cut: int = 0                      # done records that stopped at their length limit (finish_reason "length")
    # every record's time to first token, 8 bytes each (a list of floats would take 32)
    ttft_s: array.array = field(default_factory=lambda: array.array("d"))

    def count(self, failed: bool, prompt_tokens: int, completion_tokens: int, ttft_s: float | None = None,
              cut: bool = False):
        if failed:
            self.failed += 1
            return
        self.done += 1
        self.cut += cut
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if ttft_s is not None:
            self.ttft_s.append(ttft_s)

    def summary(self, startup_s: float, generation_s: float) -> dict:
        def rate(x):
            return round(x / generation_s, 3) if generation_s > 0 else None
        return {
            "records_done": self.done,
            "records_failed": self.failed,
            "records_skipped": self.skipped,
            "records_cut": self.cut,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "startup_s": round(startup_s, 3),
            "generation_s": round(generation_s, 3),
            "tokens_per_s": rate(self.completion_tokens),
            "ttft_p50_s": _percentile(self.ttft_s, 50),
            "ttft_p95_s": _percentile(self.ttft_s, 95),
            "records_per_s": rate(self.done),
        }


def _percentile(xs: array.array, q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    return round(float(np.percentile(np.frombuffer(xs, np.float64), q)), 4)
