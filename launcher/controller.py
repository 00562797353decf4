"""The controller loop: data-parallel replicas, one scheduler each, steps driven asynchronously.

    while work remains:
        refill each replica's queue from the source, least outstanding work first (Scheduler.load)
        for each replica with fewer than 2 steps in flight: steps = scheduler.schedule(); submit
        wait for any replica's oldest step to finish; postprocess; hand finished sequences on

Async scheduling (on unless `async_scheduling=False`): a replica's next step is scheduled and
submitted while its current one runs (see launcher/scheduler.py), so that its workers go from one
step to the next without waiting for the controller: the Ray round trip, the postprocessing and
the scheduling of a step all happen while the one after it runs.

A replica whose actor dies, or whose step outlives `step_timeout_s`, is torn down and restarted
on a fresh scheduler port in the background while the others keep working; its unfinished
sequences are re-queued from their prompts, on the healthy replicas at once where there are any.
Past `max_restarts` the job stops (JobFailed), and everything already handed to the caller stays
handed.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from launcher.errors import UserError
from launcher.replica import LaunchError, Replica
from launcher.scheduler import Scheduler, Sequence


class JobFailed(UserError):
    """Replicas failed more often than fault.max_replica_restarts allows."""


STEP_KINDS = ("prefill", "decode")
# per kind of step: how many, the replica's wall-clock seconds they account for (from the later of
# the step's submit and the result before it, to its result), of which rank 0 spent in the step, of
# which in the compiled network
STEP_FIGURES = ("steps", "s", "worker_s", "model_s")


@dataclass
class ControllerConfig:
    engine_config: object                  # worker.runner.EngineConfig
    tensor_parallel: int = 1
    data_parallel: int = 1
    device: str = "cpu"
    placement: str = "pack"
    cpus_per_worker: float = 1
    threads_per_worker: int = 0
    max_batch_size: int = 32
    max_batched_tokens: int = 512
    max_restarts: int = 3
    step_timeout_s: float = 600.0
    startup_timeout_s: float = 900.0       # each start-up stage of a replica (launcher.replica)
    async_scheduling: bool = True          # a replica's next step submitted while its current one runs
    worker_cls: type | None = None         # None: worker.actor.Worker (launcher.simulate: stand-ins)
    worker_options: dict = field(default_factory=dict)

    @property
    def max_in_flight(self) -> int:
        return 2 if self.async_scheduling else 1


@dataclass
class InFlight:
    """A submitted step."""
    refs: list                             # one per rank; refs[0] resolves to rank 0's StepOutput
    seqs: list
    is_prefill: bool
    submitted: float
    others: set                            # refs of ranks > 0 not yet seen to finish


@dataclass
class Slot:
    """One data-parallel replica and its scheduler."""
    index: int
    replica: Replica
    scheduler: Scheduler
    in_flight: deque = field(default_factory=deque)   # InFlight steps, oldest first
    last_result: float = 0.0                # when its last step's result came in
    starting: Future | None = None
    restarts: int = 0
    # kind -> figures in the order of STEP_FIGURES
    step_s: dict = field(default_factory=lambda: {k: [0 if x == "steps" else 0.0 for x in STEP_FIGURES]
                                                          for k in STEP_KINDS})


@dataclass
class Controller:
    cfg: ControllerConfig
    slots: list[Slot] = field(default_factory=list)
    restarts: int = 0
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(8))
    restart_log: list[str] = field(default_factory=list)

    def _new_scheduler(self) -> Scheduler:
        ec = self.cfg.engine_config
        return Scheduler(ec.blocks(), ec.block_size, self.cfg.max_batch_size, self.cfg.max_batched_tokens,
                         ec.max_model_len)

    def _new_replica(self, index: int) -> Replica:
        c = self.cfg
        extra = {"worker_cls": c.worker_cls, "worker_options": c.worker_options} if c.worker_cls else {}
        return Replica(index, c.tensor_parallel, c.device, c.placement, c.cpus_per_worker, c.threads_per_worker,
                       startup_timeout_s=c.startup_timeout_s, **extra)

    def start(self) -> None:
        """Starts every replica at once; returns when all ranks are ready."""
        self.slots = [Slot(i, self._new_replica(i), self._new_scheduler()) for i in range(self.cfg.data_parallel)]
        futures = [self.pool.submit(s.replica.start, self.cfg.engine_config) for s in self.slots]
        try:
            for f in futures:
                f.result()
        except Exception as e:
            self.shutdown()
            raise launch_error(e) from None

    def step_stats(self) -> dict:
        """Steps run and their seconds by kind: as the controller saw them (submit to result), of
        which rank 0 spent in the step and in the compiled network (`{kind}_model_s`); and the
        graphs each replica's rank 0 compiled, with their first-call seconds."""
        out = {f"{k}_{x}": 0 if x == "steps" else 0.0 for k in STEP_KINDS for x in STEP_FIGURES}
        out.update(graphs_compiled=0, compile_s=0.0)
        for s in self.slots:
            for kind in STEP_KINDS:
                for x, v in zip(STEP_FIGURES, s.step_s[kind]):
                    out[f"{kind}_{x}"] += v
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
    def run(self, source: Iterator[Sequence], on_step: Callable[[list[Sequence]], None],
            on_finish: Callable[[Sequence], None]) -> None:
        """Pulls sequences from `source` lazily; `on_step(seqs)` after every step (stop strings,
        streaming: it may call `finish`); `on_finish(seq)` once per sequence."""
        exhausted = False
        while True:
            exhausted = exhausted or self._refill(source)
            for slot in self.slots:
                self._poll_restart(slot)
                while (slot.starting is None and len(slot.in_flight) < self.cfg.max_in_flight
                       and slot.scheduler.has_work() and self._submit(slot, on_finish)):
                    pass
            busy = [s for s in self.slots if s.in_flight]
            if not busy:
                if exhausted and not any(s.scheduler.has_work() or s.starting for s in self.slots):
                    return
                if any(s.starting for s in self.slots):
                    time.sleep(0.05)
                continue
            self._wait(busy, on_step, on_finish)

    def _refill(self, source: Iterator[Sequence]) -> bool:
        """Keeps about two batches queued per replica, giving each new sequence to the replica with
        the least outstanding work. Returns True once the source is exhausted."""
        target = 2 * self.cfg.max_batch_size
        while True:
            slot = min(self.slots, key=lambda s: (s.starting is not None, s.scheduler.load))
            if slot.scheduler.num_waiting >= target:
                return False
            seq = next(source, None)
            if seq is None:
                return True
            seq.t_added = time.perf_counter()
            seq.t_first = None
            slot.scheduler.add(seq)

    def _submit(self, slot: Slot, on_finish) -> bool:
        """Schedules and submits the replica's next step (ahead of the one in flight, if any);
        False when there is none to submit now."""
        steps, is_prefill, seqs = slot.scheduler.schedule(ahead=bool(slot.in_flight))
        for seq in slot.scheduler.take_rejected():
            on_finish(seq)
        if not steps:
            return False
        refs = slot.replica.submit(steps, is_prefill)
        slot.in_flight.append(InFlight(refs, seqs, is_prefill, time.perf_counter(), set(refs[1:])))
        return True

    def _wait(self, busy: list[Slot], on_step, on_finish) -> None:
        by_ref = {s.in_flight[0].refs[0]: s for s in busy}
        others = {r: (s, step) for s in busy for step in s.in_flight for r in step.others}
        ready, _ = ray.wait(list(by_ref) + list(others), num_returns=1, timeout=1.0)
        now = time.perf_counter()
        for ref in ready:
            if ref in others:               # a rank > 0 finished first: only an error matters here
                slot, step = others[ref]
                step.others.discard(ref)
                try:
                    ray.get(ref)
                except RayError as e:          # a dead actor, a failed task, the node out of memory
                    self._fail(slot, e)
                continue
            slot = by_ref[ref]
            step = slot.in_flight[0]
            seqs, is_prefill = step.seqs, step.is_prefill
            try:
                out = ray.get(step.refs, timeout=self.cfg.step_timeout_s)[0]
            except RayError as e:              # also GetTimeoutError
                self._fail(slot, e)
                continue
            slot.in_flight.popleft()
            figures = slot.step_s["prefill" if is_prefill else "decode"]
            done = time.perf_counter()
            for i, v in enumerate((1, done - max(step.submitted, slot.last_result), out.worker_s, out.model_s)):
                figures[i] += v
            slot.last_result = done
            # a sequence that finished while this step was in flight (async scheduling: it stopped in
            # the step before) gets nothing from it
            live = [not seq.is_finished for seq in seqs]
            for seq, tok, ok in zip(seqs, out.token_ids, live):
                if ok and tok >= 0 and seq.t_first is None:
                    seq.t_first = now
            for seq, lp, ok in zip(seqs, out.logprobs or (), live):
                if ok and lp is not None:
                    seq.logprobs = getattr(seq, "logprobs", []) + [lp]
            for seq, scores, ok in zip(seqs, out.scores or (), live):
                if ok and scores:           # a scoring chunk: log-probabilities of the continuation tokens it saw
                    seq.continuation_logprobs = getattr(seq, "continuation_logprobs", []) + scores
            finished = slot.scheduler.postprocess(seqs, out.token_ids)
            seqs = [seq for seq, ok in zip(seqs, live) if ok]
            on_step(seqs)
            for seq in finished:
                on_finish(seq)
            for seq in seqs:                # finished by on_step (stop strings)
                if seq.finish_reason == "stop" and seq not in finished and seq.is_finished:
                    on_finish(seq)
        for slot in busy:                   # a wedged step (a peer stuck in a collective)
            if slot.in_flight and now - max(slot.in_flight[0].submitted, slot.last_result) > self.cfg.step_timeout_s:
                self._fail(slot, TimeoutError(f"a step ran longer than fault.step_timeout_s="
                                              f"{self.cfg.step_timeout_s:g}s"))

    def finish(self, seq: Sequence, reason: str) -> None:
        for slot in self.slots:
            if seq in slot.scheduler.running or seq in slot.scheduler.waiting:
                slot.scheduler.finish(seq, reason)
                return

    # ---- faults ---------------------------------------------------------------------------------
    def _fail(self, slot: Slot, error: Exception) -> None:
        why = f"replica {slot.index} failed ({describe(error)})"
        self.restart_log.append(why)
        if self.restarts >= self.cfg.max_restarts:
            raise JobFailed(f"{why}; restarting it would be restart {self.restarts + 1}, more than "
                            f"fault.max_replica_restarts={self.cfg.max_restarts}. Every finished record is in "
                            f"the results file: run the same job again to resume")
        self.restarts += 1
        slot.restarts += 1
        old = slot.scheduler
        unfinished = list(old.waiting) + list(old.running)
        for step in slot.in_flight:
            unfinished += [s for s in step.seqs if s not in unfinished and not s.is_finished]
        slot.in_flight.clear()
        slot.replica.shutdown()
        slot.scheduler = self._new_scheduler()
        # its records go to the healthy replicas at once, least loaded first, not after its restart
        healthy = [s for s in self.slots if s is not slot and s.starting is None]
        for seq in unfinished:              # recompute from the prompt: the replica's cache is gone
            fresh = Sequence(seq.prompt_token_ids, seq.sampling, seq.key, seq.eos_token_ids, seq.max_model_len)
            fresh.t_added, fresh.t_first = getattr(seq, "t_added", time.perf_counter()), None
            fresh.num_score_tokens = seq.num_score_tokens
            if hasattr(seq, "request"):     # how its OpenAI Batch output line answers it (launcher.job)
                fresh.request = seq.request
            if hasattr(seq, "stop_matcher"):    # a new matcher: the old one has scanned the lost output
                fresh.stop_matcher = seq.stop_matcher and type(seq.stop_matcher)(seq.stop_matcher.stop)
            (min(healthy, key=lambda s: s.scheduler.load) if healthy else slot).scheduler.add(fresh)
        slot.replica = self._new_replica(slot.index)
        slot.starting = self.pool.submit(slot.replica.start, self.cfg.engine_config)

    def _poll_restart(self, slot: Slot) -> None:
        if slot.starting is None or not slot.starting.done():
            return
        future, slot.starting = slot.starting, None
        try:
            future.result()
        except Exception as e:
            self._fail(slot, e)

    def shutdown(self) -> None:
        for slot in self.slots:
            slot.replica.shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)


def describe(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if isinstance(e, RayTaskError) and cause is not None:
        return f"{type(cause).__name__}: {cause}"
    if isinstance(e, RayActorError):
        return "a worker process died"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def launch_error(e: BaseException) -> Exception:
    if isinstance(e, (LaunchError, UserError)):
        return e
    cause = getattr(e, "cause", None)
    if isinstance(cause, (ValueError, OSError)):
        return LaunchError(f"a worker failed to start: {type(cause).__name__}: {cause}")
    return LaunchError(f"a worker failed to start: {describe(e)}")
