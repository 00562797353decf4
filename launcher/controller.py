"""The driver's loop: data-parallel replicas, each with its engine (launcher.engine), fed records.

    while records remain:
        to each engine with no exchange in flight: as many records as it wants (its queue short
            of two batches), in one `exchange` call
        wait for any exchange to return; hand its results on (the results file); note its want

The driver's work is per record: it reads a record, deals it, and writes its result line, which
the engine has already formatted.

Records whose prompts begin alike go to the same replica, where prefix caching finds the blocks
of their common beginning (`scheduler.route_by_prefix`, with prefix caching). A record's
beginning (its prompt's first ROUTE_PREFIX_CHARS characters, or first ROUTE_PREFIX_TOKENS token
ids; a shorter prompt is dealt by load) is hashed, and the hash names its replica. The first
record with a beginning goes to the engine being dealt to (a beginning seen once is dealt by
load, so records that share none are never held back); a later one is held for its replica,
unless that one already has a queue's worth held (or is restarting): then it goes to the engine
being dealt to, which caches the prefix too. A group too large for one replica overflows to the
others.

Scheduling, steps, sampled tokens, stop strings and detokenizing happen in the engines, one per
replica.

A replica whose engine reports a failure (a worker died, a step outlived step_timeout_s), whose
engine dies, or whose exchange outlives step_timeout_s, is torn down; the records it had been
dealt and not finished go to the other replicas at once (or to itself once restarted, if it is
the only one), and it restarts in the background on a fresh placement. Past `max_restarts` the
job stops (JobFailed), and everything already handed to the caller stays handed.

Poison records: each engine tells the job's ledger (launcher.engine.Ledger: an entry a replica in
the cluster's key-value store) which records its steps run before a step first runs them, so that a
replica that dies (its engine with it, where the engine lives in rank 0's process) leaves word of
what it was running. The records running in a failure become suspects: dealt again, each engine
admits them one at a time (Engine.probation), beside any other records, so that no step runs two
suspects. A record running in `max_record_failures` failures is quarantined: its result is an error
line (type "quarantined", naming the failures' causes) and it is not dealt again. A suspect may
share its step with a second poison record not yet suspected, so a record that reaches the count
beside other records runs alone first (alone_due): one replica is dealt nothing more until its
records finish (Slot.clearing), then that record alone, and only a failure then quarantines it
(with max_record_failures 1, every record running in a failure is quarantined at once). A batch
that died with a poison record loses no other record. The failures a quarantined record caused are
not charged to `max_restarts`, nor is one in which a record became due to run alone: the job goes
on while healthy replicas serve the rest.

The tail: once every record has been read and dealt, while replicas have run out of records,
as many of the others, the most loaded, are asked (Engine.ask_back) for the records they hold
queued and not started (a slower card, a node with a busier neighbour, or just the last batches'
luck): each one's exchange in flight returns with them (as a drain's do), and they are dealt to
the idle replicas, so that no replica waits while records wait in another's queue. A record given
back keeps its serial; its latency counts from its first dealing. `rebalance=False` turns this
off (scripts/measure_tail.py).

Stopping early (`stop`, a launcher.drain.Drain): once it says no more dealing (a signal, or a
deadline near), nothing more is dealt, not even the records of a failed replica, and a replica
that fails is not restarted; each engine hands back the records it has queued and not started
(its next exchange's give_back), which count as not dealt; the loop ends when the records under
way have finished, or when the drain's time is up, whichever is first. Before that, a record a
deadline leaves no time for is not dealt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import pickle
import sys
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait as futures_wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import ray
from ray.exceptions import RayError, RayTaskError

from msinfer.launcher.engine import (COUNTS, STEP_FIGURES, STEP_KINDS, WORKER_DIED, EngineFailed, EngineSetup, Ledger,
                                     describe, fetch, wait_any)
from msinfer.launcher.errors import JobFailed, UserError  # noqa: F401  (raised here, imported from here)
from msinfer.launcher.inputs import Record
from msinfer.launcher.records import Done, error_result
from msinfer.launcher.replica import LaunchError, NoRoom, Replica, ReplicaConfig

if TYPE_CHECKING:
    from ray import ObjectRef

    from msinfer.launcher.drain import Drain
    from msinfer.sharding.config import EngineConfig


ROUTE_PREFIX_CHARS = 256       # about 50-60 tokens of text: three blocks of 16 and more
ROUTE_PREFIX_TOKENS = 48
ROUTE_KEYS_KEPT = 100_000      # beginnings remembered, the oldest forgotten first
STARTS_END_S = 10.0            # how long a shutdown waits for the replicas' starts under way to end
ASK_EVERY_S = 0.5              # the tail: how often a replica may be asked for the records it has not started


def route_key(rec: Record) -> int | None:
    """A hash of the record's prompt's beginning. None for a prompt no longer than that beginning
    (dealt by load: holding short prompts for a replica costs more than the few blocks they could
    share; measured with `msinfer simulate` at dp 16) or no prompt."""
    if rec.prompt_token_ids is not None and rec.messages is None and rec.prompt is None:
        if len(rec.prompt_token_ids) <= ROUTE_PREFIX_TOKENS:
            return None
        return hash(tuple(rec.prompt_token_ids[:ROUTE_PREFIX_TOKENS]))
    if rec.messages is not None and isinstance(rec.messages, list):
        parts, size = [], 0
        for m in rec.messages:
            part = f"{m.get('role')}\0{m.get('content')}\0" if isinstance(m, dict) else str(m)
            parts.append(part)
            size += len(part)
            if size > ROUTE_PREFIX_CHARS:
                return hash("".join(parts)[:ROUTE_PREFIX_CHARS])
        return None
    if isinstance(rec.prompt, str) and len(rec.prompt) > ROUTE_PREFIX_CHARS:
        return hash(rec.prompt[:ROUTE_PREFIX_CHARS])
    return None


@dataclass
class ControllerConfig:
    engine_config: EngineConfig                # each rank's (Replica.start)
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)   # what each replica is made of
    data_parallel: int = 1
    max_restarts: int = 3
    max_record_failures: int = 2
    step_timeout_s: float = 600.0


@dataclass
class Slot:
    """One data-parallel replica, its engine, and what the driver has dealt to it."""
    index: int
    replica: Replica
    outstanding: dict = field(default_factory=dict)    # serial -> (serial, Record): dealt, no result yet
    pending: ObjectRef | Future | None = None   # its exchange in flight (a LocalEngine's: a Future)
    sent: float = 0.0                      # when that exchange was sent
    want: int = 0                          # records it can take, as its last exchange said
    starting: Future | None = None
    restarts: int = 0
    held: deque = field(default_factory=deque)         # (serial, Record) read while dealing to another, for it
    kv_usage: float = 0.0                  # share of its engine's KV cache blocks in use, as it last said
    given_back: bool = False               # a drain asked its engine for the records not started yet
    asked_at: float = 0.0                  # the tail: when its engine was last asked for the records not started
    clearing: bool = False                 # dealt nothing more until its records finish, for one to run alone
    alone: int | None = None               # the serial of the record it runs alone (Controller.alone_due)


@dataclass
class Controller:
    cfg: ControllerConfig
    slots: list[Slot] = field(default_factory=list)
    restarts: int = 0
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(8))
    restart_log: list[str] = field(default_factory=list)
    serials: Iterator[int] = field(default_factory=itertools.count)
    requeue: deque = field(default_factory=deque)      # (serial, Record) of failed replicas, dealt first
    seen: dict = field(default_factory=dict)           # hashes of the prompt beginnings seen, oldest first
    retired: list = field(default_factory=list)        # engine figures of replicas that went down
    on_stage: Callable[[str], None] | None = None      # replicas' start-up stages (launcher.replica)
    ledger: Ledger | None = None                       # which records each replica runs (with an engine setup)
    starts: list[Future] = field(default_factory=list)  # the replicas' first starts (`start`)
    failures: dict = field(default_factory=dict)       # serial -> [(failure number, why, its kind)] it ran in
    blamed: set = field(default_factory=set)           # failure numbers a quarantined record caused
    quarantine: deque = field(default_factory=deque)   # (Done, Record) of quarantined records, to hand on
    quarantined: int = 0
    dealt_at: dict = field(default_factory=dict)       # serial -> when it was first dealt (record latency)
    on_latency: Callable[[float], None] | None = None  # a record's seconds from its first dealing to its result
    no_room_since: dict = field(default_factory=dict)  # replica -> when its restart first found no room
    room_waits: list = field(default_factory=list)     # (replica, seconds it waited for room), ended waits
    stop: Drain | None = None                          # when to stop early (a run's)
    abandoned: int = 0                                 # records dealt and not finished when the loop stopped
    rebalance: bool = True                             # the tail: idle replicas take others' queued records
    given: deque = field(default_factory=deque)        # (serial, Record) handed back at the tail, for idle replicas
    rebalanced: int = 0                                # records so moved
    alone_due: set = field(default_factory=set)        # serials at max_record_failures that never ran alone
    waiting_alone: deque = field(default_factory=deque)  # (serial, Record) of those, until a replica is clear

    def _new_replica(self, index: int) -> Replica:
        return Replica(index, self.cfg.replica, self.on_stage)

    def start(self) -> None:
        """Starts every replica and its engine at once; returns when all are ready."""
        # (replicas need Ray, which the job has started; stand-in replicas without it keep no ledger)
        replica = self.cfg.replica
        if replica.engine_setup is not None and replica.engine_setup.ledger is None and ray.is_initialized():
            self.ledger = Ledger(uuid.uuid4().hex)
            replica.engine_setup = dataclasses.replace(replica.engine_setup, ledger=self.ledger)
        want = replica.engine_setup.queue_target
        self.slots = [Slot(i, self._new_replica(i), want=want) for i in range(self.cfg.data_parallel)]
        self.starts = [self.pool.submit(s.replica.start, self.cfg.engine_config) for s in self.slots]
        try:
            for f in self.starts:
                f.result()
        except BaseException as e:        # (Ctrl-C or a signal too: the starts end before Ray does)
            self.shutdown()
            if not isinstance(e, Exception):
                raise
            raise launch_error(e) from None

    def configure(self, spec, stream: bool = False) -> None:
        """The spec new records are read with and whether text streams, on every engine (the
        Python API's per-call sampling)."""
        for call in [s.replica.engine.configure.remote(spec, stream) for s in self.slots if s.replica.engine]:
            fetch(call)

    def engine_stats(self) -> list[dict]:
        """Each engine's figures (launcher.engine.Engine.engine_stats), of the replicas up now and of
        those that went down."""
        live = [s for s in self.slots if s.replica.engine is not None and s.starting is None]
        try:
            got = [fetch(call, 30) for call in [s.replica.engine.engine_stats.remote() for s in live]]
        except Exception:                   # an engine that is down: its figures are lost, not the summary
            got = []
        return got + self.retired

    def step_stats(self) -> dict:
        """Steps run and their seconds by kind: as the engines saw them (submit to result), of
        which rank 0 spent in the step and on the device (`{kind}_model_s`), the sequences they
        carried (`{kind}_seqs`) and the bytes rank 0 copied from the device (`{kind}_host_bytes`); the
        engines' CPU-seconds; the prompt tokens admitted, of which found in the prefix cache, and
        preemptions; and the graphs each replica's rank 0 compiled, with their first-call seconds."""
        out = {f"{k}_{x}": 0 if x in COUNTS else 0.0 for k in STEP_KINDS for x in STEP_FIGURES}
        out.update(engine_cpu_s=0.0, prompt_tokens=0, cached_prompt_tokens=0, preemptions=0, graphs_compiled=0,
                   compile_s=0.0)
        for st in self.engine_stats():
            for kind in STEP_KINDS:
                for x, v in zip(STEP_FIGURES, st["steps"][kind]):
                    out[f"{kind}_{x}"] += v
            out["engine_cpu_s"] += st["cpu_s"]
            out["prompt_tokens"] += st["prompt_tokens"]
            out["cached_prompt_tokens"] += st["cached_tokens"]
            out["preemptions"] += st["preemptions"]
        out["prefix_cache_hit_rate"] = out["cached_prompt_tokens"] / max(1, out["prompt_tokens"])
        out["host_bytes"] = sum(out[f"{kind}_host_bytes"] for kind in STEP_KINDS)
        for s in self.slots:
            try:
                compiled = ray.get(s.replica.workers[0].stats.remote(), timeout=30)["compile_s"]
            except Exception:                # a replica that is down: its figures are lost, not the summary
                continue
            out["graphs_compiled"] += len(compiled)
            out["compile_s"] += sum(compiled.values())
            out.setdefault("graphs", {}).update({f"replica {s.index} {k}": round(v, 2) for k, v in compiled.items()})
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}

    def ranks(self) -> list[dict]:
        return [{"replica": s.index, **r} for s in self.slots for r in s.replica.ranks]

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, records: Iterator[Record], on_done: Callable[[Done, Record], None],
            on_stream: Callable[[str, str], None] | None = None, on_tick: Callable[[], None] | None = None,
            tick_s: float = 1.0) -> bool:
        """Deals `records` (read lazily) to the engines; `on_done(result, record)` once per
        record, `on_stream(key, text)` for streamed text, `on_tick()` once per pass of the loop,
        before it waits (so at least once every `tick_s` seconds, and after the results of the
        pass before).
        Returns whether every record was handed on (False where `stop` ended the loop first;
        `abandoned` then counts the records dealt and not finished)."""
        exhausted = False
        setup = self.cfg.replica.engine_setup
        route = (setup is not None and len(self.slots) > 1 and setup.spec.scheduler.prefix_caching
                 and setup.spec.scheduler.route_by_prefix)
        hold = setup.queue_target if route else 0
        stop = self.stop
        while True:
            dealing = stop is None or stop.dealing()
            idle = self._ask_for_queued() if self.rebalance and dealing and exhausted else set()
            if not dealing:                 # a drain: an exchange in flight returns the queued records now
                self._ask_back_all()
            for slot in self.slots:
                self._poll_restart(slot)
                if slot.starting is not None or slot.pending is not None:
                    continue
                chunk = []
                share = -(-len(self.given) // len(idle)) if slot.index in idle else 0
                if self.waiting_alone and slot.alone is None and not any(s.clearing for s in self.slots):
                    slot.clearing = True            # (one replica at a time clears for them)
                    self.requeue.extend(slot.held)
                    slot.held.clear()
                if slot.clearing or slot.alone is not None:
                    # a record that reached max_record_failures beside others runs alone before it is
                    # quarantined: this replica is dealt nothing else until it has run
                    if slot.clearing and not slot.outstanding and self.waiting_alone and dealing:
                        item = self.waiting_alone.popleft()
                        chunk.append(item)
                        slot.alone, slot.clearing = item[0], False
                while dealing and len(chunk) < slot.want and not slot.clearing and slot.alone is None:
                    if self.requeue:
                        item = self.requeue.popleft()
                    elif share and self.given:
                        item = self.given.popleft()
                        share -= 1
                    elif slot.held:
                        item = slot.held.popleft()
                    else:
                        rec = None if exhausted else next(records, None)
                        if rec is None:
                            exhausted = True
                            break
                        item = (next(self.serials), rec)
                        if route and self._hold(item, slot, hold):
                            continue
                    if item[0] in self.alone_due:
                        self.waiting_alone.append(item)
                        continue
                    if stop is not None and not stop.fits(item[1]):
                        self.dealt_at.pop(item[0], None)
                        continue
                    chunk.append(item)
                if not chunk and not slot.outstanding and (not slot.held or not dealing):
                    continue
                slot.outstanding.update((c[0], c) for c in chunk)
                now = time.perf_counter()
                for c in chunk:
                    self.dealt_at.setdefault(c[0], now)
                more = dealing and (not exhausted or bool(self.requeue) or bool(slot.held) or bool(self.given)
                                    or bool(self.waiting_alone))
                suspects = tuple(c[0] for c in chunk if c[0] in self.failures)
                give_back = not dealing and not slot.given_back          # (a drain's first exchange)
                slot.given_back |= give_back
                slot.pending = slot.replica.engine.exchange.remote(pickle.dumps(chunk, protocol=5) if chunk else None,
                                                                  more, suspects, give_back)
                slot.sent, slot.want = time.perf_counter(), 0
            while self.quarantine:
                done, rec = self.quarantine.popleft()
                self.dealt_at.pop(done.serial, None)
                on_done(done, rec)
            if stop is not None and (stop.over() or not stop.dealing() and not any(s.outstanding for s in self.slots)):
                # in flight: dealt to an engine and not answered; the records held for a replica,
                # given back, or of a failed replica waiting to be dealt again were not running
                self.abandoned = sum(len(s.outstanding) for s in self.slots)
                stop.left += (sum(len(s.held) for s in self.slots) + len(self.requeue) + len(self.given)
                              + len(self.waiting_alone))
                exhausted = exhausted or not stop.count_unread(records)
                return exhausted and not self.abandoned and not stop.left
            if on_tick is not None:
                on_tick()
            pending = {s.pending: s for s in self.slots if s.pending is not None}
            if not pending:
                # (a replica waiting for room on the cluster has nothing dealt: the job ends without it)
                if exhausted and not self.requeue and not self.given and not self.waiting_alone and not any(
                        (s.starting and s.index not in self.no_room_since) or s.held for s in self.slots):
                    return stop is None or not stop.left
                time.sleep(0.05)            # a replica restarting, or one whose queue is full
                continue
            for ref in wait_any(list(pending), tick_s):
                self._receive(pending[ref], ref, on_done, on_stream)
            now = time.perf_counter()
            for slot in pending.values():   # an engine that does not answer: wedged, or its node gone
                if slot.pending is not None and now - slot.sent > self.cfg.step_timeout_s + 60:
                    self._fail(slot, TimeoutError(f"its engine did not answer for {now - slot.sent:.0f}s"))

    def _ask_back_all(self) -> None:
        """A drain's word to each engine whose exchange is in flight (Engine.ask_back, once): it
        returns with the records queued there and not started, instead of at its own time (up to
        four times wait_s at the job's tail), while the engine would start them."""
        for slot in self.slots:
            if slot.pending is not None and slot.starting is None and not slot.given_back:
                slot.given_back = True
                with contextlib.suppress(Exception):        # (a replica gone: its failure tells)
                    slot.replica.engine.ask_back.remote()

    def _ask_for_queued(self) -> set[int]:
        """The tail (see the module's docstring): the replicas idle now (serving, nothing dealt to
        them, nothing held for them), by index; while there are such and none of the records handed
        back waits for them, as many of the others as there are idle ones, those with the most
        records, are asked for the records they have not started (Engine.ask_back; each at most
        every ASK_EVERY_S, so that a thousand replicas' tail costs the driver a few calls a second):
        each one's exchange in flight returns with them, and an engine that has started them all
        gives back none."""
        idle = {s.index for s in self.slots if s.starting is None and s.pending is None and not s.outstanding
                and not s.held}
        if idle and not self.given and not self.requeue:
            now = time.perf_counter()
            busy = [s for s in self.slots if s.outstanding and s.starting is None and s.alone is None
                and now - s.asked_at > ASK_EVERY_S]
            for s in sorted(busy, key=lambda s: len(s.outstanding), reverse=True)[:len(idle)]:
                s.asked_at = now
                s.replica.engine.ask_back.remote()
        return idle

    def _hold(self, item: tuple, slot: Slot, hold: int) -> bool:
        """Whether the record, read while dealing to `slot`, is held for the replica its prompt's
        beginning names (see the module's docstring)."""
        key = route_key(item[1])
        if key is None:
            return False
        if key not in self.seen:
            if len(self.seen) >= ROUTE_KEYS_KEPT:
                del self.seen[next(iter(self.seen))]
            self.seen[key] = None
            return False
        to = self.slots[key % len(self.slots)]
        if to is slot or to.starting is not None or len(to.held) >= hold:
            return False
        to.held.append(item)
        return True

    def _receive(self, slot: Slot, ref, on_done, on_stream) -> None:
        slot.pending = None
        try:
            done, slot.want, streamed, slot.kv_usage, returned = pickle.loads(fetch(ref))
        except RayTaskError as e:
            if isinstance(e.cause, UserError):      # a SystemicError: not this replica's fault
                raise e.cause from None
            self._fail(slot, e)
            return
        except (RayError, EngineFailed) as e:       # its engine died, or failed (a local engine)
            self._fail(slot, e)
            return
        if on_stream is not None:           # (a record's last text before its result: StreamPrinter.end)
            for key, text in streamed:
                on_stream(key, text)
        now = time.perf_counter()
        for d in done:
            if d.serial == slot.alone:
                slot.alone = None
            item = slot.outstanding.pop(d.serial, None)
            if item is not None:
                dealt = self.dealt_at.pop(d.serial, None)
                if dealt is not None:
                    if self.on_latency is not None:
                        self.on_latency(now - dealt)
                    if self.stop is not None and not d.failed:
                        self.stop.finished(item[1], now - dealt)
                on_done(d, item[1])
        draining = self.stop is not None and not self.stop.dealing()
        for serial in returned:             # not started: a drain's, not dealt after all; else the tail's
            if serial == slot.alone:
                slot.alone = None
            item = slot.outstanding.pop(serial, None)
            if item is None:
                continue
            if draining:
                self.dealt_at.pop(serial, None)
                self.stop.left += 1
            else:
                self.given.append(item)
                self.rebalanced += 1

    # ---- faults ---------------------------------------------------------------------------------
    def _fail(self, slot: Slot, error: Exception) -> None:
        cause = getattr(error, "cause", None)
        if isinstance(error, EngineFailed) and not isinstance(error, RayTaskError):    # a local engine's
            cause = error
        reason = kind = str(cause) if isinstance(cause, EngineFailed) else describe(error)
        if reason == WORKER_DIED:
            try:
                death = slot.replica.death()
            except Exception:               # (the reason stays as it is)
                death = None
            if death is not None:           # the kind, without the rank, process and log: failures alike
                reason, kind = f"{reason}: {death[0]}", f"{reason}: {death[1]}" if death[1] else reason
        why = f"replica {slot.index} failed ({reason})"
        self.restart_log.append(why)
        number = len(self.restart_log)
        poison = self._quarantine(slot, number, reason, kind)
        charged = sum(1 for n in range(1, number) if n not in self.blamed)      # failures before this one
        draining = self.stop is not None and not self.stop.dealing()
        if charged >= self.cfg.max_restarts and not poison and not draining:
            raise JobFailed(f"{why}; restarting it would be restart {self.restarts + 1}, more than "
                            f"fault.max_replica_restarts={self.cfg.max_restarts}. Every finished record is in "
                            f"the results file: run the same job again to resume", reason)
        if not draining:
            self.restarts += 1
            slot.restarts += 1
        # its records go to the healthy replicas at once, in input order, not after its restart;
        # they are computed again from their prompts: its cache is gone
        self.requeue.extendleft(sorted([*slot.outstanding.values(), *slot.held], key=lambda c: c[0], reverse=True))
        slot.outstanding.clear()
        slot.held.clear()
        slot.pending = None
        slot.alone, slot.clearing = None, False
        slot.kv_usage = 0.0                 # (its cache went with it: the metrics say so)
        try:
            self.retired.append(fetch(slot.replica.engine.engine_stats.remote(), 5))
        except Exception:
            pass
        slot.replica.shutdown()
        if draining:                        # nothing more is dealt: no need of it
            return
        slot.replica = self._new_replica(slot.index)
        slot.want = self.cfg.replica.engine_setup.queue_target
        slot.starting = self.pool.submit(slot.replica.start, self.cfg.engine_config)

    def _quarantine(self, slot: Slot, number: int, reason: str, kind: str) -> bool:
        """Failure `number` of the job took `slot` down: each record it was running (the ledger's
        word, of those dealt to it) counts one; those now at max_record_failures are quarantined
        (taken out of its records, their error lines queued) and the failures they were running
        in blamed on them, or, where one failed beside others, left to run alone first
        (alone_due). Whether any was."""
        if self.ledger is None:
            return False
        try:
            running = self.ledger.take(slot.index)
        except Exception:                   # no word: every record is dealt again
            return False
        found = False
        ran = set(running) & set(slot.outstanding)      # the records of this failure, as dealt to it
        for serial in running:
            if serial not in slot.outstanding:
                continue
            seen = self.failures.setdefault(serial, [])
            seen.append((number, reason, kind))
            if len(seen) < self.cfg.max_record_failures:
                continue
            if self.cfg.max_record_failures > 1 and ran != {serial}:
                # it failed beside other records, any of which may have been the cause (a suspect
                # runs beside records not yet suspected): it runs alone first
                self.alone_due.add(serial)
                found = True                # (not charged to max_restarts now: it is likely a poison record's)
                continue
            _, rec = slot.outstanding.pop(serial)
            self.blamed.update(n for n, *_ in seen)
            self.quarantine.append((quarantined_done(serial, rec, seen, self.cfg.replica.engine_setup), rec))
            self.quarantined += 1
            found = True
        return found

    def _poll_restart(self, slot: Slot) -> None:
        if slot.starting is None or not slot.starting.done():
            return
        future, slot.starting = slot.starting, None
        try:
            future.result()
        except NoRoom as e:
            if any(s.starting is None for s in self.slots if s is not slot):
                self._wait_for_room(slot, e)
            else:
                self._fail(slot, e)
        except Exception as e:
            self._fail(slot, e)
        else:
            since = self.no_room_since.pop(slot.index, None)
            if since is not None:
                self.room_waits.append((slot.index, time.perf_counter() - since))

    def _wait_for_room(self, slot: Slot, error: NoRoom) -> None:
        """A restart found no room on the cluster (its node lost, no other free) while other
        replicas serve: it is not charged to max_restarts, the job goes on with the others, and
        the replica tries again, for as long as the job lasts, so that a node that joins (or
        comes back) gets it."""
        if slot.index not in self.no_room_since:
            self.no_room_since[slot.index] = time.perf_counter()
            serving = sum(1 for s in self.slots if s.starting is None and s is not slot)
            print(f"msinfer: note: {str(error).split('; cluster resources')[0]}; the job goes on with {serving} "
                  f"replica(s), and the replica is placed as soon as a node has room", file=sys.stderr, flush=True)
        slot.replica.shutdown()
        slot.replica = self._new_replica(slot.index)
        slot.starting = self.pool.submit(slot.replica.start, self.cfg.engine_config)

    def waits_for_room(self) -> list[str]:
        """The summary's words on replicas that had no room to restart in (see _wait_for_room)."""
        now = time.perf_counter()
        return ([f"replica {i} waited {t:.0f} s for room on the cluster, then ran again" for i, t in self.room_waits]
                + [f"replica {i} found no room on the cluster for its last {now - t:.0f} s; the job finished "
                   f"without it" for i, t in sorted(self.no_room_since.items())])

    def shutdown(self) -> None:
        """Stops every replica, and waits (up to STARTS_END_S) for the starts under way to see it
        (launcher.replica.Replica._wait): the caller shuts Ray down next."""
        for slot in self.slots:
            slot.replica.shutdown()
        if self.ledger is not None:
            with contextlib.suppress(Exception):        # (the cluster may be gone with the job)
                self.ledger.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)
        futures_wait([f for f in [*self.starts, *(s.starting for s in self.slots)] if f is not None],
                     timeout=STARTS_END_S)


def quarantined_done(serial: int, rec: Record, failures: list, setup: EngineSetup) -> Done:
    """The error line of a quarantined record, in the job's output format."""
    from msinfer.launcher.openai_batch import openai_line

    def said(words):
        return (f"was running when a replica failed, {len(failures)} times ({'; '.join(dict.fromkeys(words))}); "
                f"it is quarantined: not computed again (fault.max_record_failures)")
    message = f"record '{rec.id}' {said(why for _, why, _ in failures)}"
    openai = setup.output_format == "openai"
    result = error_result(rec.id if openai or rec.given_id is None else rec.given_id, "quarantined", message)
    line = openai_line(result, "", None, "", None) if openai else result
    # its cause, as records that fail alike share it (launcher.job): the failures' kinds, not which
    # process died or where its log is
    return Done(serial, json.dumps(line, ensure_ascii=False), True, 0, 0, None,
                f"a record {said(kind for _, _, kind in failures)}")


def launch_error(e: BaseException) -> Exception:
    if isinstance(e, (LaunchError, UserError)):
        return e
    cause = getattr(e, "cause", None)
    if isinstance(cause, (ValueError, OSError)):
        return LaunchError(f"a worker failed to start: {type(cause).__name__}: {cause}")
    return LaunchError(f"a worker failed to start: {describe(e)}")
