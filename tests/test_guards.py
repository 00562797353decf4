"""Edges a job relies on that no other file's tests reach: records held for a replica that
fails, the vocabulary's last id, the default cache's size, the spec's bounds at equality, and
one prefill for a record's n samples. Pure Python: no network, no Ray."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from msinfer.launcher.controller import Controller, ControllerConfig, route_key
from msinfer.launcher.engine import EngineFailed, EngineSetup
from msinfer.launcher.inputs import Record
from msinfer.launcher.records import Done, RecordCodec
from msinfer.launcher.replica import ReplicaConfig
from msinfer.launcher.scheduler import Scheduler, Sequence
from msinfer.launcher.spec import JobSpec
from msinfer.sharding.config import EngineConfig
from msinfer.worker.protocol import SamplingParams
from tests.test_scheduler import FakeModel, drive, reference

pytestmark = pytest.mark.unit


def job_spec(sampling: dict | None = None, scheduler: dict | None = None, max_model_len: int = 64) -> JobSpec:
    return JobSpec.model_validate({"model": {"path": "model", "max_model_len": max_model_len},
                                   "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"},
                                   "sampling": {"max_new_tokens": 8, **(sampling or {})},
                                   "scheduler": scheduler or {}})


# ---- records held for a replica that fails ------------------------------------------------------

def completed(value) -> Future:
    f = Future()
    f.set_result(value)
    return f


class Call:
    """A method as a Ray actor handle offers it (`.remote(...)`), answered with a Future as a
    LocalEngine's is."""

    def __init__(self, fn):
        self.remote = fn


class FakeReplica:
    """A replica whose engine finishes every record it is dealt at once, except the first engine
    of replica 1: its first exchange stays in flight until the test fails it (`doomed`)."""
    doomed: list[Future] = []

    def __init__(self, index: int):
        self.index, self.engine = index, None

    def start(self, engine_config) -> list:
        self.engine = SimpleNamespace(exchange=Call(self.exchange), engine_stats=Call(lambda: completed({})))
        return []

    def exchange(self, payload: bytes | None, more: bool, suspects: tuple = (), give_back: bool = False) -> Future:
        if self.index == 1 and not FakeReplica.doomed:
            FakeReplica.doomed.append(Future())
            return FakeReplica.doomed[0]
        done = [Done(serial, rec.id, False, len(rec.prompt_token_ids), 1, None)
                for serial, rec in (pickle.loads(payload) if payload else ())]
        return completed(pickle.dumps((done, 4, [], 0.0, []), protocol=5))

    def shutdown(self) -> None:
        self.engine = None


class FakeController(Controller):
    """A controller whose replicas are `replica_cls`'s (the fakes here)."""
    replica_cls: type = FakeReplica

    def _new_replica(self, index: int):
        return self.replica_cls(index)


def test_records_held_for_a_replica_that_fails_are_dealt_again_and_each_is_done_once():
    """Route by prefix at dp 2: records whose prompts begin alike (longer than the routed
    beginning) are held in the driver for the replica their beginning names while its exchange is
    in flight. That replica fails then: the records it was dealt and those held for it go to the
    other replica or its restart, and every record's result comes exactly once."""
    spec = job_spec(scheduler={"max_batch_size": 2})           # a queue of 4: 4 held at most
    prefix = next(p for p in ([t] * 48 for t in range(1, 100))
                  if route_key(Record("x", 1, prompt_token_ids=p + [0])) % 2 == 1)    # replica 1's
    records = [Record(f"r{i:02d}", i + 1, prompt_token_ids=prefix + [i]) for i in range(16)]
    FakeReplica.doomed = []
    controller = FakeController(ControllerConfig(None, ReplicaConfig(engine_setup=EngineSetup(spec, None, None)),
                                                 data_parallel=2))
    held_when_it_failed = []
    passes = 0

    def tick():             # once per pass of the driver's loop, after it dealt to every replica
        nonlocal passes
        passes += 1
        # replica 1 dies once records are held for it; after 20 passes without, it dies anyway, so
        # that a driver that holds nothing fails the first assertion instead of waiting forever
        doomed = FakeReplica.doomed[0] if FakeReplica.doomed else None
        if doomed is not None and not doomed.done() and (controller.slots[1].held or passes > 20):
            held_when_it_failed.extend(rec.id for _, rec in controller.slots[1].held)
            doomed.set_exception(EngineFailed("a worker process died"))

    done = []
    controller.start()
    try:
        controller.run(iter(records), lambda d, rec: done.append((d.line, rec.id)), on_tick=tick)
    finally:
        controller.shutdown()
    assert held_when_it_failed, "no record was held for replica 1 when it failed"
    assert controller.restarts == 1 and controller.restart_log == ["replica 1 failed (a worker process died)"]
    assert all(line == rid for line, rid in done)
    assert Counter(rid for _, rid in done) == Counter(r.id for r in records)


class RoomlessReplica:
    """Replica `doomed`'s first engine fails at its first exchange, and its next two starts find
    no room on the cluster (a node lost): Replica.start's NoRoom. Every other exchange finishes
    its records at once."""
    starts: Counter = Counter()
    doomed = 1

    def __init__(self, index: int):
        self.index, self.engine = index, None

    def start(self, engine_config) -> list:
        from msinfer.launcher.replica import NoRoom
        mine = self.index == RoomlessReplica.doomed
        RoomlessReplica.starts[self.index] += 1
        if mine and RoomlessReplica.starts[self.index] in (2, 3):
            raise NoRoom(f"replica {self.index}: Ray could not place 1 workers of {{'CPU': 1}} (STRICT_PACK) within "
                         "fault.startup_timeout_s=1s; cluster resources: {}")
        first = mine and RoomlessReplica.starts[self.index] == 1
        self.engine = SimpleNamespace(exchange=Call(self.failing if first else self.exchange),
                                      engine_stats=Call(lambda: completed({})))
        return []

    def failing(self, payload, more, suspects=(), give_back=False) -> Future:
        f = Future()
        f.set_exception(EngineFailed("a worker process died"))
        return f

    def exchange(self, payload, more, suspects=(), give_back=False) -> Future:
        done = [Done(serial, rec.id, False, 1, 1, None) for serial, rec in (pickle.loads(payload) if payload else ())]
        return completed(pickle.dumps((done, 1, [], 0.0, []), protocol=5))

    def shutdown(self) -> None:
        self.engine = None


class RoomlessController(FakeController):
    replica_cls = RoomlessReplica


@pytest.mark.parametrize("dp", [2, 1])
def test_a_replica_without_room_waits_while_others_serve_and_is_charged_when_none_does(dp, capsys):
    """After its last replica fails (charged: max_replica_restarts 1 allows it), its restarts
    find no room twice. At dp 2 the other replica serves meanwhile: the waits are not charged,
    every record is done once, and the replica runs again; the summary's words and a note say
    so. At dp 1 nothing serves: the first wait is charged, and the job stops."""
    import time

    from msinfer.launcher.controller import JobFailed
    RoomlessReplica.starts, RoomlessReplica.doomed = Counter(), dp - 1
    setup = EngineSetup(job_spec(), None, None)
    controller = RoomlessController(ControllerConfig(None, ReplicaConfig(engine_setup=setup), data_parallel=dp,
                                                     max_restarts=1))
    records = [Record(f"r{i:03d}", i + 1, prompt_token_ids=[i + 1]) for i in range(300)]
    done = []

    def run():
        controller.run(iter(records), lambda d, rec: done.append(rec.id), on_tick=lambda: time.sleep(0.001))
    controller.start()
    try:
        if dp == 1:
            with pytest.raises(JobFailed, match=r"replica 0 failed \(NoRoom: replica 0: Ray could not place"):
                run()
            return
        run()
    finally:
        controller.shutdown()
    assert Counter(done) == Counter(r.id for r in records)
    assert controller.restarts == 1 and RoomlessReplica.starts[1] == 4
    assert [w.split(" waited")[0] for w in controller.waits_for_room()] == ["replica 1"]
    assert "the job goes on with 1 replica(s)" in capsys.readouterr().err


# ---- a drain (launcher.drain) --------------------------------------------------------------------

def test_a_drain_deals_nothing_more_and_a_replica_failing_in_it_is_neither_restarted_nor_charged():
    """dp 2, replica 1's first exchange in flight. The drain is requested after 4 results; then
    replica 1 fails. With max_replica_restarts 0 that would stop a job; in a drain it is not
    restarted and not charged: its records wait to be dealt again and are not (they count as not
    dealt, none in flight), replica 0's finish, and not one record is dealt after the request."""
    from msinfer.launcher.drain import Drain
    records = [Record(f"r{i:02d}", i + 1, prompt_token_ids=[i + 1]) for i in range(40)]
    read = []
    FakeReplica.doomed = []
    setup = EngineSetup(job_spec(scheduler={"max_batch_size": 2}), None, None)
    controller = FakeController(ControllerConfig(None, ReplicaConfig(engine_setup=setup), data_parallel=2,
                                                 max_restarts=0))
    controller.stop = drain = Drain(drain_s=60)
    done, read_at_request = [], []

    def tick():
        if len(done) >= 4 and drain.requested is None:
            drain.request("SIGTERM received")
            read_at_request.append(len(read))
        elif drain.requested is not None and FakeReplica.doomed and not FakeReplica.doomed[0].done():
            FakeReplica.doomed[0].set_exception(EngineFailed("a worker process died"))

    def reading():
        for rec in records:
            read.append(rec.id)
            yield rec
    controller.start()
    try:
        complete = controller.run(reading(), lambda d, rec: done.append(rec.id), on_tick=tick)
    finally:
        controller.shutdown()
    assert not complete and controller.restarts == 0 and len(controller.restart_log) == 1
    failed = len(controller.requeue)
    assert failed > 0 and controller.abandoned == 0 and len(done) + failed == read_at_request[0]
    # none dealt after the request; the run's end counts the rest, for the summary's records_not_dealt
    assert drain.unread == len(records) - read_at_request[0]
    assert drain.summary(controller.abandoned)["records_not_dealt"] == drain.unread + failed
    assert Counter(done) == Counter(read[:len(done) + failed]) - Counter(rec.id for _, rec in controller.requeue)


def test_a_drain_ends_when_its_time_is_up_and_a_deadline_deals_only_what_fits():
    import time

    from msinfer.launcher.drain import RATE_WINDOW, STOP_MARGIN_S, Drain
    drain = Drain(drain_s=0.0)
    assert drain.dealing() and not drain.over()
    drain.request("SIGUSR1 received")
    assert not drain.dealing() and drain.over() and drain.why() == "SIGUSR1 received: fault.drain_s (0 s) passed"
    assert not Drain(5.0).over()
    # 100 s to the deadline's end; a token has taken 1 s: a record of 50 tokens fits, one of 150 not
    drain = Drain(30.0, time.time() + 100 + STOP_MARGIN_S, "run.deadline 2m", length=lambda rec: rec)
    assert drain.fits(150)                           # no rate measured yet: everything is dealt
    for _ in range(RATE_WINDOW):
        drain.finished(10, 10.0)
    assert drain.fits(50) and not drain.fits(150) and drain.left == 1 and drain.dealing()
    assert not Drain(30.0, time.time() + STOP_MARGIN_S - 1, "x").dealing()


# ---- the vocabulary's last id -------------------------------------------------------------------

def test_a_prompt_token_id_must_be_below_the_vocabulary_size():
    codec = RecordCodec(job_spec(), SimpleNamespace(vocab_size=100, hidden_size=64, labels=(),
                                                    classifier_activation="", eos_token_ids=(2,)), None)
    ok = codec.sequences(Record("ok", 1, prompt_token_ids=[0, 99]), 0)
    assert isinstance(ok, list) and ok[0].prompt_token_ids == [0, 99]
    bad = codec.sequences(Record("bad", 2, prompt_token_ids=[0, 100]), 1)
    assert isinstance(bad, Done) and bad.failed
    assert "record 'bad': token id 100 is outside the vocabulary (0..99)" in bad.line
    stop = codec.sequences(Record("stop", 3, prompt_token_ids=[0], sampling={"stop_token_ids": [7, 100]}), 2)
    assert isinstance(stop, Done) and stop.failed
    assert "record 'stop': sampling.stop_token_ids: token id 100 is outside the vocabulary (0..99)" in stop.line


def test_the_jobs_logprobs_are_answered_in_openai_lines_where_a_request_asks_for_none():
    """sampling.logprobs in the spec is every record's default: an OpenAI line shows them (they
    are computed), and a request's own logprobs take their place."""
    from msinfer.launcher.inputs import parse_openai
    model = SimpleNamespace(vocab_size=100, hidden_size=64, labels=(), classifier_activation="", eos_token_ids=(2,))
    codec = RecordCodec(job_spec({"logprobs": 2}), model, None, "openai")
    plain = codec.sequences(Record("p", 1, prompt_token_ids=[5, 6]), 0)
    assert plain[0].record.request.top_logprobs == 2 and plain[0].sampling.logprobs == 2
    asked = parse_openai({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": [5, 6], "logprobs": 4}}, 2)
    assert codec.sequences(asked, 1)[0].record.request.top_logprobs == 4
    none = RecordCodec(job_spec(), model, None, "openai").sequences(Record("n", 3, prompt_token_ids=[5]), 2)
    assert none[0].record.request.top_logprobs is None


# ---- the default cache's size -------------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 3])
def test_the_default_cache_holds_max_batch_size_sequences_of_max_model_len(batch):
    """max_model_len 40 is two and a half blocks of 16: the default cache (no
    scheduler.kv_cache_blocks) rounds up, so max_batch_size prompts of 39 tokens and their one
    generated token fit at once, as the engine builds its scheduler."""
    ec = EngineConfig("model", max_model_len=40, max_batch_size=batch, block_size=16)
    sched = Scheduler(ec.blocks(), ec.block_size, batch, 128, ec.max_model_len)
    seqs = [Sequence(list(range(1, 40)), SamplingParams(max_new_tokens=1)) for _ in range(batch)]
    for seq in seqs:
        sched.add(seq)
    steps, is_prefill, admitted = sched.schedule()
    assert is_prefill and admitted == seqs and not sched.take_rejected()
    sched.postprocess(admitted, [7] * batch)
    assert all(s.finish_reason == "length" and s.num_tokens == 40 for s in seqs)


# ---- the spec's bounds at equality --------------------------------------------------------------

def test_min_tokens_may_equal_max_new_tokens_but_not_exceed_it():
    assert job_spec({"max_new_tokens": 8, "min_tokens": 8}).sampling.min_tokens == 8
    with pytest.raises(ValidationError, match=r"min_tokens \(9\) must be at most max_new_tokens \(8\)"):
        job_spec({"max_new_tokens": 8, "min_tokens": 9})


def test_max_new_tokens_must_leave_room_for_a_prompt_token_in_max_model_len():
    assert job_spec({"max_new_tokens": 63}).sampling.max_new_tokens == 63
    with pytest.raises(ValidationError, match=r"sampling.max_new_tokens \(64\) must be less than "
                                              r"model.max_model_len \(64\)"):
        job_spec({"max_new_tokens": 64})


# ---- one prefill for a record's n samples -------------------------------------------------------

@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_a_records_n_samples_prefill_its_prompt_once(ahead):
    """sampling.n 4 on a 6-token prompt, with a budget (64) that would admit all four in one step
    and blocks of one token: the first sample prefills the prompt, the other three find it in the
    prefix cache and feed only its last token, for their own logits."""
    spec = job_spec({"n": 4, "max_new_tokens": 3}, {"max_batched_tokens": 64, "block_size": 1})
    codec = RecordCodec(spec, SimpleNamespace(vocab_size=100, hidden_size=64, labels=(),
                                              classifier_activation="", eos_token_ids=()), None)
    prompt = [5, 17, 33, 9, 60, 7]
    samples = codec.sequences(Record("r", 1, prompt_token_ids=prompt), 0)
    sc = spec.scheduler
    sched = Scheduler(64, sc.block_size, sc.max_batch_size, sc.max_batched_tokens, spec.model.max_model_len,
                      sc.prefix_caching)
    _, feeds, _ = drive(sched, samples, FakeModel(64, sc.block_size), ahead=ahead)
    assert [len(feeds[s.seq_id][0][1].token_ids) for s in samples] == [6, 1, 1, 1]
    assert (sched.prompt_tokens, sched.cached_tokens) == (4 * 6, 3 * 5)
    assert all(s.output_token_ids == reference(prompt)[0][:3] for s in samples)


# ---- records quarantined for the same crash ------------------------------------------------------

def test_records_quarantined_for_the_same_crash_share_their_cause_and_their_lines_name_each_process():
    """Two records each ran in the crashes of two workers (other processes, other logs, the same
    signal in the same function): their error lines name every failure as it happened, and their
    causes, by which the job tells records that fail alike (launcher.job: all alike and none
    succeeded, the job stops without their lines), are one. Another crash is another cause."""
    from msinfer.launcher.controller import quarantined_done
    setup = SimpleNamespace(output_format="msinfer")

    def crash(n: int, pid: int, note: str) -> tuple:
        died = "a worker process died"
        return (n, f"{died}: rank 0 (pid {pid} on 10.0.0.{n}): {note}; its log: /tmp/ray/worker-{pid}.err",
                f"{died}: {note}")

    a = quarantined_done(1, Record(id="a", line=1), [crash(1, 101, "SIGFPE in PagedAttention"),
                                             crash(2, 102, "SIGFPE in PagedAttention")], setup)
    b = quarantined_done(2, Record(id="b", line=2), [crash(3, 103, "SIGFPE in PagedAttention"),
                                             crash(4, 104, "SIGFPE in PagedAttention")], setup)
    c = quarantined_done(3, Record(id="c", line=3), [crash(5, 105, "SIGSEGV in Linear"), crash(6, 106, "SIGSEGV in Linear")],
                         setup)
    message = json.loads(a.line)["error"]["message"]
    assert "pid 101 on 10.0.0.1" in message and "/tmp/ray/worker-102.err" in message and message.startswith(
        "record 'a' was running when a replica failed, 2 times (")
    assert a.cause == b.cause != c.cause and "pid" not in a.cause and "SIGFPE in PagedAttention" in a.cause


def test_a_cluster_without_a_node_that_holds_a_replica_is_named_before_placement_waits(monkeypatch):
    """On a Ray cluster whose nodes have fewer CPU slots than a replica's packed workers ask for
    (a 2-core machine's `ray start` and a tp 3 job), placement would wait fault.startup_timeout_s
    without a word: the run says so first, and what to change."""
    import ray

    from msinfer.launcher.job import cpu_room_note

    def spec(**parallel):
        return JobSpec.model_validate({"model": {"path": "model"}, "input": {"path": "in.jsonl"},
                                       "output": {"path": "out.jsonl"}, "ray": {"address": "10.0.0.1:6379"},
                                       "parallel": parallel})
    nodes = [{"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": False, "Resources": {"CPU": 64.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    note = cpu_room_note(spec(tensor_parallel=3))
    assert note.startswith("the Ray cluster at 10.0.0.1:6379: no node of it has the 3 CPUs that a replica's 3 packed "
                           "workers ask for (its nodes: 2 CPUs), so placement waits") and "--num-cpus N" in note
    assert cpu_room_note(spec(tensor_parallel=1)) is None
    nodes[1]["Alive"] = True
    assert cpu_room_note(spec(tensor_parallel=3)) is None
    nodes[1]["Resources"]["CPU"] = 0.5
    assert "it has 2.5 CPUs in all, and a replica's workers ask for 3" in cpu_room_note(
        spec(tensor_parallel=3, placement="spread"))
    assert cpu_room_note(spec(tensor_parallel=2, placement="spread")) is None


def test_a_start_up_stage_that_times_out_names_the_ranks_and_the_engine_it_waited_for():
    """The load stage's calls are the ranks' loads and, where the engine runs in rank 0's process,
    its start: a late one past the ranks is the engine's, not a rank that does not exist."""
    from msinfer.launcher.replica import late_names
    assert late_names([1], 2, 2, 1) == "rank 1"
    assert late_names([0, 1], 1, 1, 1) == "rank 0 and its engine's start (in rank 0's process)"
    assert late_names([3], 3, 3, 1) == "its engine's start (in rank 0's process)"
    assert late_names([1, 3], 4, 2, 2) == "ranks stage 0 rank 1, stage 1 rank 1"


def test_a_failed_replica_s_kv_cache_usage_reads_zero_until_its_restart_says_otherwise():
    """The metrics' msinfer_kv_cache_usage of a replica that failed: its cache went with it. It kept
    the figure of the replica's last exchange beside msinfer_replicas_alive one less."""
    FakeReplica.doomed = []
    controller = FakeController(ControllerConfig(None, ReplicaConfig(engine_setup=EngineSetup(job_spec(), None, None)),
                                                 data_parallel=2))
    controller.start()
    try:
        slot = controller.slots[1]
        slot.kv_usage = 0.25
        controller._fail(slot, EngineFailed("a worker process died"))
        assert slot.kv_usage == 0.0 and controller.restarts == 1
        slot.starting.result(timeout=10)                # (its restart, which the fake makes at once)
    finally:
        controller.shutdown()


class QueueingReplica:
    """An engine that queues every record dealt to it and answers its exchange only when asked
    for its queued records (ask_back: it gives them all back, unstarted), or after 3 s, as an
    engine at the tail answers at its own time, having started them all (each then finishes)."""

    def __init__(self, index: int):
        self.index, self.engine, self.pending = index, None, None

    def start(self, engine_config) -> list:
        self.engine = SimpleNamespace(exchange=Call(self.exchange), ask_back=Call(self.ask_back),
                                      engine_stats=Call(lambda: completed({})))
        return []

    def exchange(self, payload, more, suspects=(), give_back=False) -> Future:
        import threading
        chunk = pickle.loads(payload) if payload else []
        f = Future()
        if not chunk:
            f.set_result(pickle.dumps(([], 0, [], 0.0, []), protocol=5))
            return f
        self.pending = (f, chunk)
        threading.Timer(3.0, self.answer, (False,)).start()
        return f

    def answer(self, back: bool) -> None:
        if self.pending is None or self.pending[0].done():
            return
        f, chunk = self.pending
        done = [] if back else [Done(serial, rec.id, False, 1, 1, None) for serial, rec in chunk]
        f.set_result(pickle.dumps((done, 0, [], 0.0, [serial for serial, _ in chunk] if back else []), protocol=5))

    def ask_back(self) -> Future:
        self.answer(True)
        return completed(None)

    def shutdown(self) -> None:
        self.engine = None


class QueueingController(FakeController):
    replica_cls = QueueingReplica


def test_a_drain_takes_back_the_records_queued_in_an_exchange_in_flight_and_counts_them_not_dealt():
    """Every record is dealt at the start (dp 2, queues of 8): at the signal, each engine's
    exchange is in flight with its records queued. The drain asks for them at once (they went on
    to start, waiting for the exchange's own answer) and counts them as not dealt, none in flight."""
    from msinfer.launcher.drain import Drain
    records = [Record(f"r{i:02d}", i + 1, prompt_token_ids=[i + 1]) for i in range(12)]
    setup = EngineSetup(job_spec(scheduler={"max_batch_size": 4}), None, None)
    controller = QueueingController(ControllerConfig(None, ReplicaConfig(engine_setup=setup), data_parallel=2))
    controller.stop = drain = Drain(drain_s=60)
    done = []

    def tick():
        if drain.requested is None and all(s.pending is not None for s in controller.slots):
            drain.request("SIGTERM received")
    controller.start()
    try:
        complete = controller.run(iter(records), lambda d, rec: done.append(rec.id), on_tick=tick)
    finally:
        controller.shutdown()
    assert not complete and done == []
    summary = drain.summary(controller.abandoned)
    assert summary["records_in_flight_abandoned"] == 0 and summary["records_not_dealt"] == len(records)


class PoisonReplica:
    """An engine whose exchange fails (its replica down) when a poison record is among the records
    dealt to it, and finishes every other record at once. Its ledger word: every record it held."""
    poison: set = set()

    def __init__(self, index: int):
        self.index, self.engine = index, None

    def start(self, engine_config) -> list:
        self.engine = SimpleNamespace(exchange=Call(self.exchange), ask_back=Call(lambda: completed(None)),
                                      engine_stats=Call(lambda: completed({})))
        return []

    def exchange(self, payload, more, suspects=(), give_back=False) -> Future:
        chunk = pickle.loads(payload) if payload else []
        f = Future()
        if any(rec.id in PoisonReplica.poison for _, rec in chunk):
            f.set_exception(EngineFailed("a worker process died"))
        else:
            f.set_result(pickle.dumps(([Done(serial, rec.id, False, 1, 1, None) for serial, rec in chunk], 4, [], 0.0,
                                       []), protocol=5))
        return f

    def shutdown(self) -> None:
        self.engine = None


class PoisonController(FakeController):
    replica_cls = PoisonReplica


def test_a_record_at_its_failure_limit_beside_others_runs_alone_before_it_is_quarantined():
    """Two poison records among twelve, dealt four at a time at dp 2: each failure takes down the
    records dealt with a poison record, and those dealt again together fail again. A record at
    max_record_failures (2) that failed beside others runs alone first: only the poison records,
    which fail alone too, are quarantined, and every other record finishes. Before, the innocent
    records dealt beside a poison record twice were quarantined with it."""
    from msinfer.launcher.controller import ControllerConfig
    records = [Record(f"r{i:02d}", i + 1, prompt_token_ids=[i + 1]) for i in range(12)]
    PoisonReplica.poison = {"r01", "r06"}
    setup = EngineSetup(job_spec(scheduler={"max_batch_size": 2}), None, None)
    controller = PoisonController(ControllerConfig(None, ReplicaConfig(engine_setup=setup), data_parallel=2,
                                                   max_restarts=2))
    controller.start()
    controller.ledger = SimpleNamespace(take=lambda index: list(controller.slots[index].outstanding),
                                        put=lambda *a: None, clear=lambda: None)
    done = []
    try:
        assert controller.run(iter(records), lambda d, rec: done.append((rec.id, d.failed)))
    finally:
        controller.shutdown()
    assert sorted(rid for rid, failed in done if failed) == ["r01", "r06"]
    assert Counter(rid for rid, _ in done) == Counter(r.id for r in records)
    assert controller.quarantined == 2
