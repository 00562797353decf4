"""When a run stops dealing records, and when it stops waiting for those it has dealt: SIGTERM or
SIGUSR1 (a scheduler's stop: Slurm's preemption, time limit or `--signal`, Kubernetes ending a
pod), `run.deadline`, or the end of a Slurm allocation.

- **A signal** (the first SIGTERM or SIGUSR1 of a run that is dealing): no record is dealt from
  then on; the records in flight may finish for up to `fault.drain_s`; then the run writes what is
  done and exits with EXIT_DRAINED (75), status `drained`. A second signal stops at once (exit
  143). A signal before the replicas are up, with nothing in flight to wait for, ends the run at
  once as drained.
- **A deadline** (`run.deadline`, and the allocation's end under Slurm, whichever is first): the
  run ends STOP_MARGIN_S before it. Until then, a record is dealt only where it is expected to
  finish in time: its expected tokens (launcher.inputs.expected_length) times the seconds a token
  has taken, measured on the records finished so far (the RATE_QUANTILE of each record's seconds
  from dealing to result per expected token, over the last RATE_WINDOW). Before any record has
  finished, every record is dealt. A record that will not fit is left for the next run, and the
  next is tried (read longest first, the records that follow are shorter), until MISFITS_MAX in a
  row did not fit: then dealing stops.

Whatever is not finished is not written: running the same job again resumes after the records
that were, as after any stop.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from datetime import datetime

from msinfer.launcher.errors import Terminated

STOP_MARGIN_S = 10.0       # a deadline's run ends this much before it: results flushed, Ray shut down
RATE_WINDOW = 256
RATE_QUANTILE = 0.9
MISFITS_MAX = 256
# How long a stopped run spends counting the records of its input it did not read (its summary's
# records_not_dealt), well inside STOP_MARGIN_S.
UNREAD_COUNT_S = 2.0
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def parse_deadline(value: str, now: float | None = None) -> float:
    """run.deadline -> the Unix time it names. A duration from `now` ("90s", "45m", "2h", "1h30m",
    "1d", or seconds as a bare number), or a date and time in ISO 8601 ("2026-11-27T06:00", with
    or without a UTC offset; without one it is local time). ValueError where it is neither, or
    not in the future."""
    now = time.time() if now is None else now
    text = str(value).strip()
    m = _DURATION.fullmatch(text)
    if text and m and any(m.groups()):
        d, h, mi, s = (float(g or 0) for g in m.groups())
        seconds = ((d * 24 + h) * 60 + mi) * 60 + s
    else:
        try:
            seconds = float(text)
        except ValueError:
            try:
                seconds = datetime.fromisoformat(text).timestamp() - now
            except ValueError:
                raise ValueError(f"expected a duration ('90s', '45m', '2h', '1h30m') or a date and time "
                                 f"('2026-11-27T06:00'), got {value!r}") from None
            if seconds <= 0:
                here = datetime.fromtimestamp(now).isoformat('T', 'seconds')
                raise ValueError(f"{value!r} is in the past (it is {here} here)")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"a deadline must be a finite time later than now, got {value!r}")
    return now + seconds


def slurm_time_left(env: dict | None = None, run=subprocess.run) -> tuple[float, str] | None:
    """Inside a Slurm job: its allocation's end as (Unix time, where that came from): Slurm's
    SLURM_JOB_END_TIME where it sets it, else `squeue -j $SLURM_JOB_ID -o %L` (the time left).
    None outside Slurm, for a job without a limit, or where neither answers (a note says so)."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    end = env.get("SLURM_JOB_END_TIME", "")
    if end.isdigit() and int(end) > 0:
        return float(end), "SLURM_JOB_END_TIME"
    try:
        p = run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            raise OSError(f"squeue exited {p.returncode}: {(p.stderr or '').strip()[:200]}")
        left = parse_slurm_time(p.stdout.strip())
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        print(f"msinfer: note: Slurm job {job}: its time limit could not be read ({e}); the run does not stop "
              f"before it on its own (run.deadline does)", file=sys.stderr, flush=True)
        return None
    return None if left is None else (time.time() + left, f"squeue -j {job}")


def parse_slurm_time(text: str) -> float | None:
    """Slurm's time left, "[days-]hours:minutes:seconds", "minutes:seconds" or "seconds", as
    seconds; None for "UNLIMITED" and "NOT_SET". ValueError for anything else."""
    if text.upper() in ("UNLIMITED", "NOT_SET", "INFINITE"):
        return None
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not (1 <= len(parts) <= 3) or not all(p.isdigit() for p in parts) or (days and not days.isdigit()):
        raise ValueError(f"unexpected time from squeue: {text!r}")
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return seconds + int(days or 0) * 86400


class Drain:
    """One run's stop conditions (see the module's docstring). `request` is what the command's
    signal handler calls; the controller asks `dealing`, `fits` and `over` as it loops, and tells
    `finished` each record's seconds."""

    def __init__(self, drain_s: float, deadline: float | None = None, source: str = "", length=None):
        self.drain_s = drain_s
        self.deadline, self.source = deadline, source          # Unix time, and what set it
        self.length = length                                    # record -> expected tokens
        self.requested: float | None = None                     # time.monotonic() of the signal
        self.reason = ""
        self.rates: deque = deque(maxlen=RATE_WINDOW)           # seconds per expected token, per record
        self.quantile: float | None = None                      # of rates, until the next one comes
        self.left = 0        # records not dealt: they would not fit, or an engine gave them back unstarted
        self.unread = 0      # records the run did not read from its input (`count_unread`)
        self.unread_whole = True                                # all of them counted
        self.misfits = 0                                        # of those, in a row
        self.stopped = ""                                       # why the run ended before its records did

    def request(self, reason: str) -> None:
        self.requested, self.reason = time.monotonic(), reason

    def end(self) -> float | None:
        """The Unix time the run ends by, for its deadline."""
        return None if self.deadline is None else self.deadline - STOP_MARGIN_S

    def dealing(self) -> bool:
        if self.requested is not None or self.misfits >= MISFITS_MAX:
            return False
        end = self.end()
        return end is None or time.time() < end

    def rate(self) -> float | None:
        """The RATE_QUANTILE of the seconds per expected token measured (None before 4 records),
        sorted once per record finished, not per record dealt."""
        if self.quantile is None and len(self.rates) >= 4:
            ordered = sorted(self.rates)
            self.quantile = ordered[min(len(ordered) - 1, int(RATE_QUANTILE * len(ordered)))]
        return self.quantile

    def fits(self, rec) -> bool:
        """Whether `rec`, dealt now, is expected to finish before the deadline's end."""
        end = self.end()
        if end is None or self.length is None:          # no deadline: every record is dealt
            return True
        rate = self.rate()
        if rate is None:
            return True
        if time.time() + rate * max(1, self.length(rec)) <= end:
            self.misfits = 0
            return True
        self.left += 1
        self.misfits += 1
        return False

    def count_unread(self, records) -> bool:
        """Counts the records a stopped run did not read (`records`: the rest of its input, less
        those whose results the file holds), for up to UNREAD_COUNT_S seconds: a huge input's
        rest is not read to the end while a time limit nears (`unread_whole` False). Whether
        any is left."""
        until = time.monotonic() + UNREAD_COUNT_S
        for _ in records:
            self.unread += 1
            if self.unread % 256 == 0 and time.monotonic() > until:
                self.unread_whole = False
                break
        return self.unread > 0

    def finished(self, rec, seconds: float) -> None:
        """A record's seconds from dealing to result; measured only for a deadline's estimate."""
        if self.deadline is not None and self.length is not None:
            self.rates.append(seconds / max(1, self.length(rec)))
            self.quantile = None

    def over(self) -> bool:
        """Whether the run stops now, finished or not."""
        if self.requested is not None and time.monotonic() - self.requested >= self.drain_s:
            self.stopped = self.stopped or f"{self.reason}: fault.drain_s ({self.drain_s:g} s) passed"
            return True
        end = self.end()
        if end is not None and time.time() >= end:
            self.stopped = self.stopped or f"{self.deadline_words()} reached"
            return True
        return False

    def deadline_words(self) -> str:
        at = datetime.fromtimestamp(self.deadline).isoformat(" ", "seconds")
        return f"the deadline ({self.source}, {at}, less {STOP_MARGIN_S:g} s to shut down)"

    def why(self) -> str:
        """Why the run stopped dealing records, for its summary and the command's message."""
        if self.stopped:
            return self.stopped
        if self.requested is not None:
            return f"{self.reason}: stopped dealing records, and the records in flight finished"
        return (f"{self.deadline_words()}: records that would not have finished before it were not dealt"
                + (", then dealing stopped" if self.misfits >= MISFITS_MAX else ""))

    def deadline_summary(self) -> dict:
        """The summary's `deadline`: when, and what set it."""
        return {"at": datetime.fromtimestamp(self.deadline).astimezone().isoformat("T", "seconds"),
                "source": self.source}

    def summary(self, abandoned: int) -> dict:
        """records_not_dealt: those read and not dealt (or handed back) and those not read; at least
        that many where the latter were not all counted (records_not_dealt_at_least)."""
        return {"why": self.why(), "records_in_flight_abandoned": abandoned,
                "records_not_dealt": self.left + self.unread,
                **({} if self.unread_whole else {"records_not_dealt_at_least": True}),
                **({"deadline_unix": round(self.deadline, 3), "deadline_source": self.source}
                   if self.deadline is not None else {})}


class Signals:
    """The command's SIGTERM and SIGUSR1 handler: with a run dealing (`armed`), the first signal
    drains it; otherwise, or on a second signal, it raises Terminated in the main thread (the run
    stops at once, its results kept), `drained` where nothing was in flight to wait for.

    A signal that lands while the main thread waits in ray.get or ray.wait reaches the caller as a
    plain KeyboardInterrupt: Ray's C++ wait runs the handler and raises its own exception in place
    of the handler's. `cause` gives back the Terminated raised, so such a stop keeps its meaning
    (exit code and status)."""

    def __init__(self):
        self.drain: Drain | None = None
        self.signalled = 0
        self.raised: Terminated | None = None

    def install(self) -> None:
        self.raised = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame) -> None:
        self.signalled += 1
        name = signal.Signals(signum).name
        if self.drain is not None and self.drain.requested is None:
            self.drain.request(f"{name} received")
            print(f"\nmsinfer: {name}: no new records are dealt; the records in flight finish within "
                  f"fault.drain_s ({self.drain.drain_s:g} s). A second {name} stops at once", file=sys.stderr,
                  flush=True)
            return
        self.raised = Terminated(name, drained=self.signalled == 1)
        raise self.raised

    def cause(self, e: BaseException) -> BaseException:
        """The Terminated this handler raised where `e` is the plain KeyboardInterrupt Ray raised in
        its place; otherwise `e`."""
        if type(e) is KeyboardInterrupt and self.raised is not None:
            return self.raised
        return e


SIGNALS = Signals()
