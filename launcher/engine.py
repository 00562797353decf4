"""One replica's engine: it does everything per step and per token, in the replica's rank 0
process, so that the driver (launcher.controller) only deals records and writes results.

    driver ── exchange(records) ──> rank 0: Engine ── step ──> rank 0's step (a thread, no Ray call)
           <── results, want ──────               ── step(...) ──> ranks 1 .. tp-1 (Ray calls)

An engine turns the records it is dealt into sequences (tokenizing them; launcher.records), keeps
its replica's scheduler, runs the step loop with async scheduling (the next step scheduled and
submitted while the current one runs, see launcher/scheduler.py), postprocesses every sampled
token, matches stop strings and formats each finished record's result line. Its loop runs in a
thread of its own; `exchange` hands it new records and returns what finished meanwhile, the
number of records it can take (`want`), and streamed text.

Where it lives: in rank 0's worker process (`engine_host` mixes `EngineHost` into rank 0's
class), so that rank 0's steps cost it no Ray call (measured here: about 1 ms of the caller's
CPU per call at a 256-sequence step) and a replica adds no process. Its Python shares the GIL
with rank 0's step preparation and sampling there. One replica of several ranks on an embedded
Ray is the exception: its engine runs in the driver's process (`LocalEngine`), which has the
tokenizer loaded already; rank 0's process, busy with its share of the start-up, would only
start later (tp 3 on this machine's 2 cores: the first result 1-3 s later, no more tokens a
second). A replica of one rank keeps its engine: its steps then go without a Ray call (8% more
tokens a second at tp 1 here, docs/benchmarks.md).

A worker that dies, a step that outlives fault.step_timeout_s or an error in the loop fails the
engine: its next `exchange` raises EngineFailed (or the driver's call finds rank 0 dead), and the
driver deals its unfinished records to the other replicas and restarts it.
"""

from __future__ import annotations

import json
import pickle
import sys
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait as futures_wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.experimental import internal_kv

from msinfer.launcher.errors import gist
from msinfer.launcher.records import Done, RecordCodec
from msinfer.launcher.scheduler import Scheduler
from msinfer.sharding.config import cpu_kernels
from msinfer.worker.protocol import SAMPLED, DecodeChain, DecodeStep, StepOutput, chains, pack_step

if TYPE_CHECKING:
    from msinfer.launcher.spec import JobSpec
    from msinfer.sharding.config import EngineConfig, ModelConfig

STEP_KINDS = ("prefill", "decode")
# per kind of step: how many, the replica's wall-clock seconds they account for (from the later of
# the call that submits the step and the result before it, to its result), of which rank 0 spent
# in the step, of which on the device (network and sampler); the sequences the steps carried, and
# the bytes rank 0 copied from the device in them
STEP_FIGURES = ("steps", "s", "worker_s", "model_s", "seqs", "host_bytes")
COUNTS = ("steps", "seqs", "host_bytes")


class EngineFailed(RuntimeError):
    """The replica cannot go on (a worker died, a step timed out); the message says why."""


@dataclass(frozen=True)
class Ledger:
    """replica -> the serials of the records its steps have run and not finished (Engine._report),
    kept in the Ray cluster's key-value store (its GCS, on the head node), which outlives any
    replica and any worker's process and costs no process of its own: a job's engines write their
    replica's entry, the driver takes it when that replica fails. `job` keeps one job's entries
    apart from another's on a shared cluster."""
    job: str

    NAMESPACE = "msinfer-ledger"

    def _key(self, replica: int) -> bytes:
        return f"{self.job}/{replica}".encode()

    def put(self, replica: int, running: set[int]) -> None:
        internal_kv._internal_kv_put(self._key(replica), json.dumps(sorted(running)).encode(), overwrite=True,
                                     namespace=self.NAMESPACE)

    def take(self, replica: int) -> list[int]:
        """What replica ran when it failed; it starts again with nothing."""
        value = internal_kv._internal_kv_get(self._key(replica), namespace=self.NAMESPACE)
        internal_kv._internal_kv_del(self._key(replica), namespace=self.NAMESPACE)
        return json.loads(value) if value else []

    def clear(self) -> None:
        internal_kv._internal_kv_del(f"{self.job}/".encode(), del_by_prefix=True, namespace=self.NAMESPACE)


@dataclass
class EngineSetup:
    """What every engine of a job needs, sent once when it starts."""
    spec: JobSpec
    model: ModelConfig
    engine_config: EngineConfig     # the cache's blocks, max_model_len
    output_format: str = "msinfer"
    stream: bool = False            # report the text of running sequences as it grows
    local: bool = False             # run the engine in the driver's process (LocalEngine)
    # how long a finished result may wait in the engine for others to join it: each exchange
    # costs the driver a Ray call (about 1 ms of its CPU on this machine), so results go in batches;
    # a LocalEngine's exchange costs a thread hand-off, and a job's only engine makes few calls,
    # so their results go sooner
    flush_s: float = 0.5
    # the longest an exchange waits with nothing to report (an engine still computing its
    # records answers this often, to tell the driver its room for more)
    wait_s: float = 1.0
    ledger: Ledger | None = None        # which records each replica runs

    @staticmethod
    def intervals(data_parallel: int, local: bool) -> dict:
        """flush_s and wait_s for a job of `data_parallel` engines: the driver answers each
        exchange with a Ray call, so they grow with the engines' number and keep the driver's
        calls at about 64 result batches and 16 empty answers a second, however many engines.
        One engine sends results every 0.05 s at most, 20 calls a second."""
        return {"flush_s": 0.05 if local or data_parallel == 1 else max(0.5, data_parallel / 64),
                "wait_s": max(1.0, data_parallel / 16)}

    @property
    def queue_target(self) -> int:
        """Records an engine keeps queued: about two batches."""
        return 2 * self.spec.scheduler.max_batch_size


@dataclass
class InFlight:
    """A submitted step."""
    refs: list                      # one per rank; refs[0] resolves to rank 0's StepOutput
    seqs: list
    is_prefill: bool
    submitted: float
    others: set                     # refs of ranks > 0 not yet seen to finish
    outs: list | None = None        # pipeline stages: the last stage's rank 0 output per micro-batch
    chain: list | None = None       # a DecodeChain: the sequences of each of its steps (`seqs`: its first's)


def submit_step(workers: list, seqs, is_prefill: bool, index: int, released: list[int] = ()) -> list:
    """Starts one step on every rank, after the steps submitted before it (`index` orders them);
    element 0 resolves to rank 0's StepOutput. `seqs`: SeqSteps, or a DecodeStep. The step goes
    as one pickle (worker.protocol.pack_step): Ray's own serializer walks a list of dataclasses
    object by object, ~10x slower at 256 sequences. `released`: sequences finished or preempted
    since the step before, which the ranks forget (worker.protocol.StepReader)."""
    payload = pack_step(seqs, released)
    ref = ray.put(payload) if sum(not isinstance(w, LocalRank) for w in workers) > 1 else payload
    return [w.step.remote(payload if isinstance(w, LocalRank) else ref, is_prefill, index) for w in workers]


# scheduler.decode_steps where the spec leaves it unset: on the CPU kernels, where a step's call costs
# ~1 ms besides its kernels (docs/benchmarks.md, "Decode steps in one call")
CPU_DECODE_STEPS = 4


def decode_steps(spec, ec) -> int:
    """How many decode steps the engine chains into one call (a DecodeChain): the spec's
    scheduler.decode_steps, by default CPU_DECODE_STEPS, on the CPU kernels; 1 elsewhere, where a
    runner would run a chain's steps one at a time (its graphs of dynamic shapes: Ascend's, the
    portable operators'), and for a replica of pipeline stages (Pipeline sends its micro-batches
    step by step)."""
    if len(ec.pipeline) > 1 or not cpu_kernels(ec.device, ec.ops) or ec.shapes == "dynamic":
        return 1
    k = spec.scheduler.decode_steps
    return CPU_DECODE_STEPS if k is None else k


def micro_batches(steps, parts: int) -> list:
    """A step's sequences as up to `parts` contiguous micro-batches of near equal size (SeqSteps,
    or a DecodeStep's columns with the block tables of its own sequences)."""
    n = len(steps)
    parts = max(1, min(parts, n))
    cuts = [n * k // parts for k in range(parts + 1)]
    if not isinstance(steps, DecodeStep):
        return [steps[a:b] for a, b in zip(cuts, cuts[1:])]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        ids = steps.seq_ids[a:b]
        out.append(DecodeStep(ids, steps.token_ids[a:b], steps.num_cached[a:b], steps.num_generated[a:b],
                              {i: steps.tables[i] for i in ids if i in steps.tables}))
    return out


class Pipeline:
    """The steps of a replica of pipeline stages (EngineConfig.pipeline): `workers` stage after
    stage, `stages` groups of equal size. A step goes as micro-batches, one per stage (fewer
    with fewer sequences), each through every stage in turn, so that stage s works on micro-batch
    k while stage s+1 works on k-1. Everything moves by Ray's object references, not through
    this process: a stage's call takes the stage before's rank 0 output (its hidden states) as an
    argument, so Ray runs it once that exists and copies it worker to worker; the first stage's
    call takes the last stage's outputs of the step before that sampled its SAMPLED tokens (async
    scheduling), and waits for nothing else. Every rank runs its stage's micro-batches in the
    order of their index (Worker.step)."""

    def __init__(self, workers: list, stages: int):
        self.workers, self.stages = list(workers), stages
        self.tp = len(self.workers) // stages
        self.index = 0
        self.sampled_by: dict[int, object] = {}      # seq_id -> the last stage's output that sampled its token

    def submit(self, steps, is_prefill: bool, released=()) -> tuple[list, list, list]:
        """Starts one step: (the last stage's rank 0 output of each micro-batch, in order; the
        calls of ranks > 0, which return None; the other stages' rank 0 outputs, hidden states
        for the next stage, which nothing else fetches)."""
        outs, others, relays = [], [], []
        for k, part in enumerate(micro_batches(steps, self.stages)):
            released_now = list(released) if k == 0 else []
            for seq_id in released_now:
                self.sampled_by.pop(seq_id, None)
            payload = ray.put(pack_step(part, released_now))
            ids = part.seq_ids if isinstance(part, DecodeStep) else [st.seq_id for st in part]
            tokens = part.token_ids if isinstance(part, DecodeStep) else [st.token_ids for st in part]
            deps = list({id(r): r for i, t in zip(ids, tokens) if t == SAMPLED or t == [SAMPLED]
                         for r in [self.sampled_by.get(i)] if r is not None}.values())
            before = deps
            for st in range(self.stages):
                ranks = self.workers[st * self.tp:(st + 1) * self.tp]
                refs = [w.step.remote(payload, is_prefill, self.index, *before) for w in ranks]
                others += refs[1:]
                before = [refs[0]]
                if st < self.stages - 1:
                    relays.append(refs[0])
            outs.append(before[0])
            for i in ids:
                self.sampled_by[i] = before[0]
            self.index += 1
        return outs, others, relays


def merge_outputs(outs: list) -> StepOutput:
    """The StepOutputs of a step's micro-batches as one, its sequences in order."""
    if len(outs) == 1:
        return outs[0]
    tokens = [t for o in outs for t in o.token_ids]

    def column(name):
        if all(getattr(o, name) is None for o in outs):
            return None
        return [x for o in outs for x in (getattr(o, name) or [None] * len(o.token_ids))]
    return StepOutput(tokens, column("logprobs"), column("scores"), sum(o.worker_s for o in outs),
                      sum(o.model_s for o in outs), sum(o.host_bytes for o in outs))


class MergedOutputs:
    """A pipelined step's outputs as Replica.submit returns them: `get` merges them."""

    def __init__(self, refs: list):
        self.refs = refs

    def get(self, timeout: float | None = None) -> StepOutput:
        return merge_outputs(ray.get(self.refs, timeout=timeout))


WORKER_DIED = "a worker process died"


def describe(e: BaseException) -> str:
    """A failure in one line: its type and the message's first informative line, whole
    (launcher.errors.gist)."""
    cause = getattr(e, "cause", None)
    if isinstance(e, RayTaskError) and cause is not None:
        e = cause
    elif isinstance(e, RayActorError):
        return WORKER_DIED
    return gist(f"{type(e).__name__}: {e}", limit=None)


class Engine:
    def __init__(self, setup: EngineSetup, index: int, tokenizer=False):
        """tokenizer: the job's (launcher.tokenizer.Tokenizer or None), where the caller has it
        loaded already; False: load it here."""
        from msinfer.launcher.tokenizer import load_tokenizer

        spec, ec = setup.spec, setup.engine_config
        self.setup = setup
        self.index, self.stream = index, setup.stream
        tok = tokenizer if tokenizer is not False else load_tokenizer(
            spec.model.tokenizer_path, spec.model.trust_remote_code, spec.input.template_text())
        self.codec = RecordCodec(spec, setup.model, tok, setup.output_format)
        self.scheduler = Scheduler(ec.blocks(), ec.block_size, spec.scheduler.max_batch_size,
                                   spec.scheduler.max_batched_tokens, ec.max_model_len,
                                   spec.scheduler.prefix_caching)
        self.max_in_flight = 2 if spec.scheduler.async_scheduling else 1
        self.decode_steps = decode_steps(spec, setup.engine_config)
        self.step_timeout_s = spec.fault.step_timeout_s
        self.target = setup.queue_target
        self.flush_s, self.wait_s = setup.flush_s, setup.wait_s
        self.cond = threading.Condition()
        self.inbox: deque = deque()           # new sequences, for the loop to admit
        self.outbox: list[Done] = []
        self.outbox_t = 0.0                   # when the oldest result in the outbox came
        self.streamed: dict = {}              # key -> characters of its text reported so far
        self.stream_out: list = []            # (key, new text)
        self.unfinished = 0                   # records received whose result has not been produced
        self.failure: BaseException | None = None
        self.closing = False
        self.in_flight: deque[InFlight] = deque()
        self.last_result = 0.0
        self.step_s = {k: [0 if x in COUNTS else 0.0 for x in STEP_FIGURES] for k in STEP_KINDS}
        self.workers: list = []
        self.submitted = 0
        self.thread: threading.Thread | None = None
        self.loop_cpu = self.exchange_cpu = 0.0
        self.reported: set[int] = set()       # serials running here, as the ledger has them or will
        # records that were running when a replica failed, (serial, sequences): admitted one at a
        # time, so that no step runs two of them and a second failure names one record, not a batch
        self.probation: deque = deque()
        self.on_probation: int | None = None  # the serial of the one admitted
        self.ledger_lost = False
        # a drain, or the job's tail: the records not started yet go back to the driver (`exchange`'s
        # give_back, `ask_back`)
        self.giving_back = False
        self.returned: list[int] = []         # their serials, for the next exchange to report

    # ---- the driver's calls ---------------------------------------------------------------------
    def attach(self, workers: list) -> None:
        """Starts the loop on the replica's ranks (their actor handles, rank 0 first)."""
        self.workers, self.submitted = list(workers), 0
        stages = max(1, len(self.setup.engine_config.pipeline))
        self.pipeline = Pipeline(self.workers, stages) if stages > 1 else None
        self.thread = threading.Thread(target=self._loop, name=f"engine-{self.index}", daemon=True)
        self.thread.start()

    def configure(self, spec, stream: bool = False) -> None:
        """The job spec that new records are read with (its sampling, async scheduling, the
        scheduler's batch limits within the cache the replica has), and whether their text streams:
        the Python API's per-call options and msinfer bench's cases."""
        self.codec.spec, self.stream = spec, stream
        self.max_in_flight = 2 if spec.scheduler.async_scheduling else 1
        self.decode_steps = decode_steps(spec, self.setup.engine_config)
        self.scheduler.set_limits(spec.scheduler.max_batch_size, spec.scheduler.max_batched_tokens)

    def exchange(self, payload: bytes | None, more: bool, suspects: tuple = (), give_back: bool = False) -> bytes:
        """Takes records (a pickled list of (serial, Record)), returns (results, want, streamed
        text, kv_usage, serials given back) pickled, once there is something to report: results
        that waited flush_s or make a batch, room for half a queue of new records while the driver
        has `more`, records given back, nothing left to do, or wait_s passed. A SystemicError while
        reading a record (a cause that is not the record's) is raised to the driver, which stops
        the job. `suspects`: serials of records that were running when a replica failed; they run
        one at a time (`probation`). `give_back` (a drain): the records none of whose sequences
        holds anything yet leave the queue, and their serials go back to the driver, unanswered."""
        cpu0 = time.thread_time()
        try:
            return self._exchange(payload, more, set(suspects), give_back)
        finally:
            self.exchange_cpu += time.thread_time() - cpu0

    def ask_back(self) -> None:
        """The driver's word at a job's tail (launcher.controller): the records none of whose
        sequences holds anything yet go back to it, with the exchange in flight (which returns
        with them) or the next."""
        with self.cond:
            self.giving_back = True
            self.cond.notify_all()

    def _exchange(self, payload: bytes | None, more: bool, suspects: set, give_back: bool = False) -> bytes:
        # every record of the call encoded before the loop sees any: admitted together, they
        # share a prefill step instead of trickling into several
        items = [(serial, self.codec.sequences(rec, serial))
                 for serial, rec in (pickle.loads(payload) if payload else ())]
        if items:
            with self.cond:
                for serial, item in items:
                    self.unfinished += 1
                    if isinstance(item, Done):
                        self._put(item)
                    elif serial in suspects:
                        self.probation.append((serial, item))
                    else:
                        self.inbox.extend(item)
                self.cond.notify_all()
        if give_back:
            with self.cond:
                self.giving_back = True
                self.cond.notify_all()
        # with nothing left to deal, the driver needs no word of the room for more
        deadline = time.perf_counter() + (self.wait_s if more else 4 * self.wait_s)
        with self.cond:
            while True:
                if self.failure is not None:
                    raise EngineFailed(describe(self.failure))
                now = time.perf_counter()
                if self.outbox and (not self.unfinished or len(self.outbox) >= self.target // 2
                                    or now - self.outbox_t >= self.flush_s):
                    break
                if (more and self.want >= self.target // 2) or not self.unfinished or now >= deadline:
                    break
                if self.returned:
                    break
                if self.giving_back:            # the loop hands them over at its next pass
                    self.cond.wait(self.flush_s)
                    continue
                if self.stream_out and now - self.outbox_t >= self.flush_s:
                    break
                self.cond.wait(min(self.flush_s, deadline - now))
            out, self.outbox = self.outbox, []
            streamed, self.stream_out = self.stream_out, []
            returned, self.returned = self.returned, []
            self.outbox_t = time.perf_counter()
            return pickle.dumps((out, self.want, streamed, self.kv_usage, returned), protocol=5)

    @property
    def want(self) -> int:
        return max(0, self.target - len(self.inbox) - len(self.probation) - self.scheduler.num_waiting)

    @property
    def kv_usage(self) -> float:
        """The share of the KV cache's blocks that sequences hold (blocks only the prefix cache
        keeps count as free: an allocation takes them)."""
        bm = self.scheduler.block_manager
        return 1.0 - bm.num_free / bm.num_blocks if bm.num_blocks else 0.0

    def engine_stats(self) -> dict:
        """Steps by kind (STEP_FIGURES), the CPU-seconds of the engine's own threads (its loop and
        its exchange calls; not the Ray threads of the process it lives in), the prompt tokens of
        the sequences it admitted and how many of them it found in its prefix cache."""
        sched = self.scheduler
        return {"steps": {k: list(v) for k, v in self.step_s.items()}, "cpu_s": self.loop_cpu + self.exchange_cpu,
                "prompt_tokens": sched.prompt_tokens, "cached_tokens": sched.cached_tokens,
                "preemptions": sched.num_preemptions}

    def close(self, wait_s: float | None = None) -> None:
        """Stops the loop at its next check. With wait_s, waits up to that long for the loop to end,
        and so for the steps it has in flight on a rank in this process (LocalRank) to finish: a
        runner of this process whose graph starts while another's still runs fails MindSpore's JIT
        ("Nested execution ... is not supported"), as a replica started again in this process would."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        thread = self.thread
        if wait_s is not None and thread is not None and thread is not threading.current_thread():
            thread.join(timeout=wait_s)

    # ---- the loop -------------------------------------------------------------------------------
    def _put(self, done: Done) -> None:
        """With self.cond held."""
        if not self.outbox:
            self.outbox_t = time.perf_counter()
        self.outbox.append(done)
        self.unfinished -= 1
        self.reported.discard(done.serial)
        if done.serial == self.on_probation:
            self.on_probation = None

    def _loop(self) -> None:
        try:
            while True:
                self.loop_cpu = time.thread_time()
                with self.cond:
                    if self.closing:
                        return
                    new = list(self.inbox)
                    self.inbox.clear()
                    if self.on_probation is None and self.probation:
                        self.on_probation, seqs = self.probation.popleft()
                        new += seqs
                    giving_back = self.giving_back
                for seq in new:
                    self.scheduler.add(seq)
                if giving_back:
                    self._give_back()
                while (len(self.in_flight) < self.max_in_flight and self.scheduler.has_work()
                       and not self._chain_first() and self._submit()):
                    pass
                if not self.in_flight:
                    with self.cond:
                        if not self.inbox and not self.closing:
                            self.cond.wait(0.05)
                    continue
                self._wait()
        except BaseException as e:      # the replica cannot go on: the next exchange reports it
            with self.cond:
                self.failure = e
                self.cond.notify_all()
        finally:
            local = [f for step in self.in_flight for f in step.refs if isinstance(f, Future)]
            futures_wait(local, timeout=self.step_timeout_s)

    def _chain_first(self) -> bool:
        """Whether the next step waits for the chain in flight (a DecodeChain) to end: while records
        wait for a place in the batch, so that those its sequences leave are taken at once, not after
        a chain scheduled ahead of it (up to 2 K - 1 steps of a place unused, against K - 1)."""
        return bool(self.in_flight) and self.in_flight[-1].chain is not None and self.scheduler.num_waiting > 0

    def _give_back(self) -> None:
        """A drain or the job's tail (ask_back): the records none of whose sequences holds anything
        yet leave the queue (those on probation too), their serials for the driver; a record with a
        sample under way stays whole."""
        by_serial: dict[int, list] = {}
        for seq in self.scheduler.withdraw_unstarted():
            by_serial.setdefault(seq.record.serial, []).append(seq)
        returned = []
        for serial, seqs in by_serial.items():
            if len(seqs) == seqs[0].sampling.n:
                returned.append(serial)
            else:
                for seq in seqs:
                    self.scheduler.add(seq)
        with self.cond:
            returned += [serial for serial, _ in self.probation]
            self.probation.clear()
            if self.on_probation in returned:   # (admitted, not started): the next suspect may come in
                self.on_probation = None
            for serial in returned:
                self.unfinished -= 1
                self.reported.discard(serial)       # (preempted): the ledger hears it ended here
            self.returned += returned
            self.giving_back = False
            self.cond.notify_all()

    def _submit(self) -> bool:
        """Schedules and submits the next step (ahead of the one in flight, if any); False when
        there is none to submit now."""
        steps, is_prefill, seqs = self.scheduler.schedule(ahead=bool(self.in_flight))
        rejected = self.scheduler.take_rejected()
        if rejected:
            self._finished(rejected)
        if not steps:
            return False
        self._report(seqs)
        # a step's time counts from the call that submits it: a rank (LocalRank's thread, an idle
        # actor) may start the step before that call returns
        if self.pipeline is not None:
            at = time.perf_counter()
            outs, others, relays = self.pipeline.submit(steps, is_prefill, self.scheduler.take_released())
            self.submitted = self.pipeline.index
            self.in_flight.append(InFlight([*outs, *others, *relays], seqs, is_prefill, at, set(others), outs))
            return True
        more = []
        draws = self.setup.spec.parallel.tensor_parallel == 1
        if not is_prefill and self.decode_steps > 1 and all(chains(seq.sampling, draws) for seq in seqs):
            more = self.scheduler.schedule_more_decodes(steps, self.decode_steps - 1)
        chain = None
        if more:     # (a chain cut short runs step by step: each chain length would be a graph of its own)
            whole = len(more) == self.decode_steps - 1 and more[-1][0].seq_ids == steps.seq_ids
            steps, chain = DecodeChain([steps] + [step for step, _ in more], not whole), [seqs] + [p for _, p in more]
        at = time.perf_counter()
        refs = submit_step(self.workers, steps, is_prefill, self.submitted, self.scheduler.take_released())
        self.submitted += 1
        self.in_flight.append(InFlight(refs, seqs, is_prefill, at, set(refs[1:]), chain=chain))
        return True

    def _report(self, seqs: list) -> None:
        """Before a step runs records that no step of this replica ran before, the ledger hears of
        them (and of the records finished since): the replica's records running, so that if the
        step takes the replica down the driver knows which they were (launcher.controller, poison
        records); a step of records it knows costs no call."""
        if self.setup.ledger is None or self.ledger_lost:
            return
        with self.cond:                       # (_put, in either thread, takes finished ones out)
            new = {s.record.serial for s in seqs} - self.reported
            if not new:
                return
            self.reported |= new
            running = set(self.reported)
        try:
            self.setup.ledger.put(self.index, running)
        except Exception as e:      # the cluster's store unreachable: records run on, unrecorded (no quarantine)
            self.ledger_lost = True
            print(f"msinfer: note: replica {self.index} cannot write the job's ledger of running records "
                  f"({type(e).__name__}: {e}); a record that takes a replica down is no longer quarantined",
                  file=sys.stderr, flush=True)

    def _wait(self) -> None:
        """Waits up to a second for the oldest step in flight; a rank > 0 that fails first fails
        the engine at once (its peers may be stuck in a collective with it)."""
        step = self.in_flight[0]
        if step.outs is not None:
            self._wait_pipelined(step)
            return
        first = step.refs[0]
        if isinstance(first, Future):       # rank 0 is this process (LocalRank)
            ready = [first] if futures_wait([first], timeout=0.2 if step.others else 1.0).done else []
            if step.others:
                ready = ray.wait(list(step.others), num_returns=len(step.others), timeout=0)[0] + ready
        else:
            ready, _ = ray.wait([first, *step.others], num_returns=1, timeout=1.0)
        for ref in ready:
            if ref in step.others:
                step.others.discard(ref)
                ray.get(ref)                # raises a dead actor's or a failed task's error
                continue
            out = fetch(first, self.step_timeout_s)
            if len(step.refs) > 1:
                ray.get(step.refs[1:], timeout=self.step_timeout_s)
            self._completed(step, out)
            return
        self._check_timeout(step)

    def _wait_pipelined(self, step: InFlight) -> None:
        """_wait for a step of micro-batches (Pipeline): done when every call of it is; a failed
        call of a rank > 0 fails the engine at once, one of a stage's rank 0 when the stages after
        it fail for want of its output (its hidden states are not fetched here)."""
        pending = [r for r in step.refs if r not in step.others] + list(step.others)
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        for ref in ready:
            if ref in step.others:
                step.others.discard(ref)
                ray.get(ref)                # raises a dead actor's or a failed task's error
        if len(ready) == len(pending):
            self._completed(step, merge_outputs(ray.get(step.outs, timeout=self.step_timeout_s)))
            return
        self._check_timeout(step)

    def _check_timeout(self, step: InFlight) -> None:
        steps = len(step.chain) if step.chain is not None else 1        # a chain: each of its steps its own time
        if time.perf_counter() - max(step.submitted, self.last_result) > self.step_timeout_s * steps:
            raise TimeoutError(f"a step ran longer than fault.step_timeout_s={self.step_timeout_s:g}s" + (
                f" (a chain of {steps} decode steps, scheduler.decode_steps, ran longer than {steps} times it)"
                if steps > 1 else ""))

    def _completed(self, step: InFlight, out) -> None:
        self.in_flight.popleft()
        done = time.perf_counter()
        figures = self.step_s["prefill" if step.is_prefill else "decode"]
        parts, outs = (step.chain, out) if step.chain is not None else ([step.seqs], [out])
        elapsed = (done - max(step.submitted, self.last_result)) / len(parts)
        for seqs, part in zip(parts, outs):
            for i, v in enumerate((1, elapsed, part.worker_s, part.model_s, len(seqs), part.host_bytes)):
                figures[i] += v
        self.last_result = done
        for seqs, part in zip(parts, outs):         # a chain's steps in their order, as if one at a time
            self._postprocess(seqs, part, done, step.is_prefill)

    def _postprocess(self, seqs: list, out, now: float, is_prefill: bool) -> None:
        # a sequence that finished while this step was in flight (async scheduling: it stopped in
        # the step before) gets nothing from it
        fresh = [seq for seq in seqs if not seq.is_finished]
        live = fresh if self.stream else None
        if is_prefill:                      # a sequence's first token comes from a prefill
            for seq, tok in zip(seqs, out.token_ids):
                if tok >= 0 and seq.record.t_first is None and not seq.is_finished:
                    seq.record.t_first = now
        for seq, lp in zip(seqs, out.logprobs or ()):
            if lp is not None and not seq.is_finished:
                seq.record.logprobs.append(lp)
        for seq, scores in zip(seqs, out.scores or ()):
            if scores is None or seq.is_finished:
                continue
            if seq.sampling.pooling:            # embed, classify: what the chunk's tokens pool (launcher.embed)
                pool(seq, scores)
            elif scores:                        # log-probabilities of the continuation (or prompt) tokens it saw
                (seq.record.continuation_logprobs if seq.is_scoring else seq.record.prompt_logprobs).extend(scores)
        finished = self.scheduler.postprocess(seqs, out.token_ids)
        # A stop string in a sequence's new text ends it, "stop" also where its length limit ends it
        # at the same token (as vLLM: the text is cut all the same). One that a stop token ended
        # got no new text (the token is not in its text).
        for seq in fresh:
            if seq.record.stop_matcher is not None and seq.finish_reason in (None, "length") \
                    and self.codec.stop_string(seq):
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
                    finished.append(seq)
        if live and self.codec.tok is not None:
            self._stream(live)
        self._finished(finished)

    def _finished(self, seqs: list) -> None:
        results = []
        for seq in seqs:
            samples = seq.record.samples
            if samples is None:
                results.append(self.codec.result(seq))
            elif samples.closed:                # a sibling failed: the record's error is out already
                continue
            elif seq.finish_reason in ("error", "abort"):
                samples.closed = True           # one error line for the record; its other samples stop
                for sibling in samples.seqs:
                    self.scheduler.finish(sibling, "abort")
                results.append(self.codec.result(seq))
            else:
                samples.num_finished += 1
                if samples.num_finished == len(samples.seqs):
                    samples.closed = True
                    results.append(self.codec.samples_result(samples))
        if not results:
            return
        if self.streamed:
            for seq in seqs:
                self.streamed.pop(stream_key(seq), None)
        with self.cond:
            for done in results:
                self._put(done)
            self.cond.notify_all()

    def _stream(self, seqs: list) -> None:
        new = []
        for seq in seqs:
            text = self.codec.text(seq)
            if not seq.is_finished and seq.record.stop_matcher is not None:
                text = text[:max(0, len(text) - seq.record.stop_matcher.held)]
            key = stream_key(seq)
            done = self.streamed.get(key, 0)
            if len(text) > done:
                new.append((key, text[done:]))
                self.streamed[key] = len(text)
        if new:
            with self.cond:
                if not self.stream_out and not self.outbox:
                    self.outbox_t = time.perf_counter()
                self.stream_out.extend(new)


def pool(seq, part) -> None:
    """Adds a prefill chunk's pooled hidden states (worker.runner.forward_pooled) to its pooling
    sequence's (task embed or classify): the chunk's sum (mean), or its row where it has one
    (last, cls; a classifier's logits of its last token). A chunk from the prompt's start
    (seq.num_cached is the chunk's start until the scheduler takes the step) starts over: the
    sequence was preempted and is prefilled again."""
    state = seq.record
    if seq.num_cached == 0 or state.pooled is None or seq.sampling.pooling != "mean":
        state.pooled = part
    else:
        state.pooled = state.pooled + part


def stream_key(seq) -> str:
    """What streamed text is reported under: the record's id, and the sample's index when the
    record has n > 1 samples."""
    return seq.key if seq.record.samples is None else f"{seq.key}[{seq.sampling.index}]"


class PoolCall:
    """An actor method's `.remote(*args)`, run on a thread pool of this process instead: the
    answer is a Future (see `fetch`, `wait_any`)."""

    def __init__(self, pool: ThreadPoolExecutor, fn):
        self.pool, self.fn = pool, fn

    def remote(self, *args) -> Future:
        return self.pool.submit(self.fn, *args)


class LocalEngine:
    """An engine in the driver's process, with the calls of its Ray actor handle:
    `engine.exchange.remote(...)` returns a Future (launcher.controller waits on either). Used
    for one replica on an embedded Ray, where a process of its own would only add its start-up
    (loading the tokenizer again) to the job's time to first result."""

    def __init__(self, setup: EngineSetup, index: int, tokenizer=False):
        self.engine = Engine(setup, index, tokenizer)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix=f"engine-{index}-calls")

    def __getattr__(self, name: str) -> PoolCall:
        return PoolCall(self.pool, getattr(self.engine, name))

    # How long `kill` waits for the engine's loop to stop.
    STOP_WAIT_S = 5.0

    def kill(self) -> None:
        """Stops the engine's loop and waits for it (up to STOP_WAIT_S; it checks between steps):
        a loop still in a Ray call when the job then shuts Ray down makes Ray end this process
        (its core worker is gone, exit 1) before the job has said why it stopped."""
        self.engine.close(self.STOP_WAIT_S)
        self.pool.shutdown(wait=False, cancel_futures=True)


def fetch(pending, timeout: float | None = None):
    """The result of an engine call: a Ray ObjectRef, or a LocalEngine's Future."""
    if isinstance(pending, Future):
        return pending.result(timeout)
    return ray.get(pending, timeout=timeout)


def wait_any(pending: list, timeout: float) -> list:
    """Those of `pending` (all ObjectRefs, or all Futures) that are done, waiting up to
    `timeout` for the first."""
    if pending and isinstance(pending[0], Future):
        done, _ = futures_wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        return list(done)
    ready, rest = ray.wait(pending, num_returns=1, timeout=timeout)
    if ready and rest:
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
        ready += more
    return ready


class LocalRank:
    """Rank 0 as its engine sees it from inside the same process (EngineHost): `step.remote`
    runs the rank's step on a thread of its own, in the order called, and returns a Future. No
    Ray call: on this machine one costs the caller about 1 ms of CPU at a 256-sequence step."""

    def __init__(self, step_fn):
        self.step = PoolCall(ThreadPoolExecutor(1, thread_name_prefix="rank0-steps"), step_fn)


class EngineHost:
    """Mixed into rank 0's worker class (`engine_host`): the replica's engine lives in rank 0's
    process, calls rank 0's step without Ray, and answers the driver's calls."""

    def start_engine(self, setup: EngineSetup, index: int, peers: list) -> None:
        """peers: the actor handles of ranks 1.. of the replica. With pipeline stages, this rank's
        steps go through its own actor handle too: the next stage's call takes its output by
        reference (Pipeline)."""
        self.engine = Engine(setup, index)
        me = ray.get_runtime_context().current_actor if setup.engine_config.pipeline else LocalRank(self.step)
        self.engine.attach([me, *peers])

    def exchange(self, payload: bytes | None, more: bool, suspects: tuple = (), give_back: bool = False) -> bytes:
        return self.engine.exchange(payload, more, suspects, give_back)

    def ask_back(self) -> None:
        self.engine.ask_back()

    def configure(self, spec, stream: bool = False) -> None:
        self.engine.configure(spec, stream)

    def engine_stats(self) -> dict:
        return self.engine.engine_stats()


def engine_host(worker_cls: type) -> type:
    """Rank 0's class: `worker_cls` with the replica's engine in it."""
    return type(f"{worker_cls.__name__}WithEngine", (EngineHost, worker_cls), {"__module__": __name__})
