"""Ray placement of tensor-parallel groups ("replicas").

One placement group per replica, one bundle per rank (`CPU` here, `NPU` + `CPU` on Ascend),
packed on one node unless `placement: spread`. Each replica is its own MindSpore cluster of one
`Worker` per rank, which meet at rank 0's node: at a TCPStore in rank 0's process on the CPU, at a
scheduler actor on rank 0's bundle on cards. For a job, its engine (launcher.engine) runs in rank
0's process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from msinfer.launcher.engine import LocalEngine, MergedOutputs, Pipeline, engine_host, submit_step
# raised here, and imported from here by the callers
from msinfer.launcher.errors import LaunchError, NoRoom, StartupTimeout  # noqa: F401
from msinfer.worker.actor import CommScheduler, Worker
from msinfer.worker.graph_cache import pid_alive

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from msinfer.launcher.engine import EngineSetup
    from msinfer.launcher.tokenizer import Tokenizer
    from msinfer.sharding.config import EngineConfig

QUIET_ENV = {"GLOG_v": "3", "GLOG_logtostderr": "1", "TOKENIZERS_PARALLELISM": "false",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
# Ray starts its own processes with the jemalloc it ships (ray/core/libjemalloc.so) in LD_PRELOAD,
# where LD_PRELOAD is unset, and its raylet takes it off the workers' environment unless this is
# "1". A rank's graph compile spends about a fifth of its time in glibc's malloc: with jemalloc the
# demo job's compile took 2.8-3.3 s instead of 3.9-4.2 s (docs/benchmarks.md). CANN's installation
# guide recommends jemalloc for inference on cards too. A user's own LD_PRELOAD (e.g. tcmalloc) is
# what the workers get instead; RAY_LD_PRELOAD_ON_WORKERS=0 keeps glibc's malloc.
WORKER_ALLOCATOR_ENV = {"RAY_LD_PRELOAD_ON_WORKERS": "1"}
# An embedded instance's raylet starts no workers ahead of the job's actors. Ray (2.60) starts a
# worker process per CPU when the first driver connects (prestart_worker_first_driver), each
# importing Ray (about half a CPU-second here) and holding its memory for the instance's life: a
# job whose actors are fewer than the node's CPUs (tp 1 here; any job on a large node) leaves
# the rest idle. Each actor's worker starts as the actor is placed instead: a tp 1 job of the
# tests' model started in 3.49-4.24 s (`startup_s`, median 3.62) against 3.56-4.85 (3.80), six
# alternating rounds each.
LEAN_RAY_ENV = {"RAY_prestart_worker_first_driver": "0"}


# start-up stages as the progress bar names them; compiling happens in the first steps
STOP_POLL_S = 0.5       # how soon a replica's start sees its shutdown (Replica._wait)
STAGE_NAMES = {"its communication scheduler's start": "starting workers",
               "its communication rendezvous": "starting workers", "process start": "starting workers",
               "device and communication init": "joining the communication group",
               "communication pre-flight": "checking the communication group",
               "measuring the card": "measuring the cards",
               "load": "loading weights, then compiling"}


# Held while Ray starts (init_ray), then handed to the handler in force before
HELD_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# A second signal stopped ray.init in its middle: the command's process then ends without Ray's
# exit handler, which crashes on the half-made driver (launcher.cli.entry)
INIT_CUT = False


def init_ray(address: str | None, num_cpus_needed: int, dashboard: bool = False, npus: int = 0) -> None:
    """Embedded local Ray (address None) or join an existing cluster. `npus`: the embedded node
    advertises that many `NPU`s (emulated Ascend cards; Ray sets ASCEND_RT_VISIBLE_DEVICES for each
    worker it places on one, as on a real node).

    A SIGTERM, SIGUSR1 or Ctrl-C that comes while Ray starts is held until ray.init returns, then
    handed to the handler in force before (the command's, launcher.drain: a status, and exit 75
    where nothing was in flight). One that stopped ray.init in its middle left its driver half
    made, which Ray's own exit handler then crashed on (SIGSEGV in CoreWorker::RecordMetrics, or
    SIGABRT through Ray's failure handler, at the command's exit). ray.init sets a SIGTERM handler
    of its own as it begins (sys.exit): not while the signals are held. The same signal a second
    time acts at once (a Ray that does not start must not hold the command)."""
    if ray.is_initialized():
        return
    if threading.current_thread() is not threading.main_thread():     # (signals reach the main thread alone)
        _init_ray(address, num_cpus_needed, dashboard, npus)
        return
    held: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in HELD_SIGNALS}

    def deliver(signum: int, frame=None) -> None:
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:         # its default action: the process ends by it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def hold(signum: int, frame) -> None:
        global INIT_CUT
        if signum in held:                      # (handed on now, and not again once Ray has started)
            held.clear()
            INIT_CUT = True
            deliver(signum, frame)
        held.append(signum)
    utils = ray._private.utils
    ray_sets = utils.set_sigterm_handler
    try:
        for sig in HELD_SIGNALS:
            signal.signal(sig, hold)
        utils.set_sigterm_handler = lambda handler: None
        _init_ray(address, num_cpus_needed, dashboard, npus)
    finally:
        utils.set_sigterm_handler = ray_sets
        for sig, handler in previous.items():
            if handler is not None:             # (None: a handler not set from Python, which stays)
                signal.signal(sig, handler)
        if held:
            deliver(held[0])


def shutdown_ray() -> None:
    """ray.shutdown(), without its second of waiting on the autoscaler's monitor. Ray (2.60,
    Node.kill_all_processes) stops the GCS before the monitor, whose SIGTERM handler then reports
    its end to the gone GCS until Ray kills it a second later. init_ray's embedded instance runs
    no monitor (_lean_head); one that a plain ray.init started (the scripts' stand-in runs) has
    one, which keeps nothing, so it is killed first. A driver joined to a cluster owns none."""
    node = getattr(ray._private.worker, "_global_node", None)
    for info in (getattr(node, "all_processes", None) or {}).get("monitor", ()):
        with contextlib.suppress(OSError, AttributeError, subprocess.TimeoutExpired):
            if info.process.poll() is None:
                info.process.kill()
                info.process.wait(timeout=5)
    # A thread still in a replica's start (Replica._wait gives it up within STOP_POLL_S) must not
    # find Ray gone and start it anew (Ray's auto-init, which can join a stale cluster address
    # and retry for ever, the command then never exiting): Ray calls after this one fail instead.
    # (ray._private.auto_init_hook reads RAY_ENABLE_AUTO_CONNECT once, at its import.)
    from ray._private import auto_init_hook
    auto_init_hook.enable_auto_connect = False
    ray.shutdown()


def _init_ray(address: str | None, num_cpus_needed: int, dashboard: bool, npus: int) -> None:
    if address:
        # a cluster's workers get the environment of its raylets; the fault-injection variables
        # (MSINFER_FAULT_*, docs/spec.md) set where the job is submitted go to them too
        faults = {k: v for k, v in os.environ.items() if k.startswith("MSINFER_FAULT_")}
        env = {"env_vars": {**QUIET_ENV, **faults}}
        check_reachable(address)
        with _stderr_collected() as said:
            try:
                ray.init(address=address, runtime_env=env, log_to_driver=False, logging_level="ERROR")
                failure = None
            except (ConnectionError, RuntimeError, ValueError) as e:
                failure = e
        if failure is not None:
            why = (str(failure).strip().splitlines() or [type(failure).__name__])[0]
            heard = f"; Ray said: {said[-1]}" if said else ""
            hint = "" if os.environ.get("RAY_AUTH_MODE") else (
                "; if the cluster uses token authentication (`ray start` does when a token exists), export "
                "RAY_AUTH_MODE=token, with the cluster's token in ~/.ray/auth_token or RAY_AUTH_TOKEN")
            raise LaunchError(f"ray.address {address}: cannot join the Ray cluster ({why}){heard}{hint}")
        return
    if npus:    # emulated cards: Ray's look-up of their type (CANN's acl module) can only fail, loudly
        logging.getLogger("ray._private.accelerators.npu").setLevel(logging.CRITICAL)
    # The embedded instance's processes inherit this one's environment, so the variables go there:
    # a job-wide runtime_env would make Ray start the workers apart from its ready pool, through
    # its runtime-env agent (1.5-1.8 s more to a first actor here, three rounds each way)
    for key, value in {**QUIET_ENV, **WORKER_ALLOCATOR_ENV, **LEAN_RAY_ENV}.items():
        os.environ.setdefault(key, value)
    # address="local": a new embedded instance even when `ray start` runs on this machine
    with _lean_head(dashboard), _raylet_awaited():
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, num_cpus_needed), include_dashboard=dashboard,
                 resources={"NPU": npus} if npus else None,
                 dashboard_host="127.0.0.1", log_to_driver=False,
                 logging_level="ERROR", configure_logging=True)


@contextlib.contextmanager
def _lean_head(dashboard: bool):
    """An embedded instance without three processes that a job on its own one-node instance never
    uses: the autoscaler's monitor (there is nothing to scale), the log monitor (it sends the
    workers' output to drivers that ask for it, and msinfer's driver does not: log_to_driver off)
    and the dashboard's API server (Ray's job server and state API, which nothing calls here).
    Ray (2.60, Node.start_head_processes and start_ray_processes) starts them on every head, each
    a Python process importing Ray: together about 1.5 CPU-seconds of a start on this machine,
    taken while the job's own processes start, and the monitors wake every few seconds for the
    instance's life. With `ray.dashboard` on, the head is Ray's whole (the dashboard shows the
    autoscaler's state and the logs); a cluster that `ray start` or msinfer-node.sh starts keeps
    them too."""
    if dashboard:
        yield
        return
    from ray._private.node import Node
    saved = Node.start_monitor, Node.start_log_monitor, Node.start_api_server

    def no_api_server(self, *, include_dashboard, raise_on_failure):
        self._webui_url = None

    Node.start_monitor = Node.start_log_monitor = lambda self: None
    Node.start_api_server = no_api_server
    try:
        yield
    finally:
        Node.start_monitor, Node.start_log_monitor, Node.start_api_server = saved


REGISTRATION_POLL_S = 0.02


@contextlib.contextmanager
def _raylet_awaited():
    """ray.init of an embedded instance without its idle second: after starting the raylet, Ray
    (2.60, Node.__init__) sleeps 0.1 s and asks the GCS for the node (services.get_node), whose
    C++ side (GlobalStateAccessor::GetNode) sleeps a whole second each time the node has not
    registered yet. The raylet registers once the dashboard agent it starts has imported Ray and
    written its ports: 0.6-0.8 s here, so each start waited until 1.1 s. Here the GCS is asked
    every 20 ms first, and Ray's own call comes once the node is there (or after Ray's own wait
    when asking fails). A tp 1 job of the tests' model started in 2.94-3.72 s (`startup_s`,
    median 3.23) against 3.63-4.16 (3.77), six alternating rounds each."""
    from ray._private import services
    saved = services.get_node

    def get_node(gcs_address, node_id):
        deadline = time.monotonic() + float(os.environ.get("RAY_raylet_start_wait_time_s", 30))
        try:
            client = ray._raylet.GcsClient(address=gcs_address)
            while time.monotonic() < deadline and not any(
                    n.hex() == node_id and info.state == info.ALIVE
                    for n, info in client.get_all_node_info(timeout=5).items()):
                time.sleep(REGISTRATION_POLL_S)
        except Exception:           # (Ray's own call below waits, and says what is wrong)
            pass
        return saved(gcs_address, node_id)
    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = saved


def late_names(late: list[int], workers: int, tp: int, pp: int) -> str:
    """Who a start-up stage (Replica._stage) waited for in vain, by their calls' places: a rank
    (with pipeline stages, its stage and rank), or past the ranks the engine's start in rank 0's
    process (the load stage's last call, where the engine is hosted there)."""
    ranks = [r for r in late if r < workers]
    names = ", ".join(f"stage {r // tp} rank {r % tp}" if pp > 1 else str(r) for r in ranks)
    who = [f"rank{'s' if len(ranks) > 1 else ''} {names}"] if ranks else []
    if len(ranks) < len(late):
        who.append("its engine's start (in rank 0's process)")
    return " and ".join(who)


# How long Replica.death waits for another rank's word once a rank is found gone without one.
SILENT_GRACE_S = 0.5
_LOG_LINE = re.compile(r"^\[[^\]]*\] \S+\.cc:\d+: (.*)$")


@contextlib.contextmanager
def _stderr_collected():
    """What Ray's C++ client writes to this process's stderr while it joins a cluster (a line a
    second while it retries, e.g. a refused token), kept out of the terminal: yields a list that
    receives its distinct messages, in order, when the block ends, for the caller's one message."""
    said: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for raw in sink.read().decode("utf-8", "replace").splitlines():
                m = _LOG_LINE.match(raw.strip())
                message = (m.group(1) if m else raw).strip()
                if message and message not in said:
                    said.append(message)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fails in seconds where no Ray head listens: `ray.init(address=host:port)` would retry for
    minutes, deaf to Ctrl-C."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"ray.address '{address}': expected host:port of a Ray head (e.g. 10.0.0.1:6379), "
                          f"or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise LaunchError(f"ray.address {address}: no Ray head answers there ({e.strerror or e}); start one "
                          f"with `ray start --head --port={port}` or scripts/msinfer-node.sh, or correct the "
                          f"address") from None


@dataclass
class ReplicaConfig:
    """What every replica of a job is made of: the driver's part of the configuration
    (launcher.controller.ControllerConfig.replica); each rank's is the EngineConfig its start takes."""
    tensor_parallel: int = 1
    device: str = "cpu"                 # "cpu" | "ascend" | "auto"
    placement: str = "pack"             # "pack" | "spread"
    cpus_per_worker: float = 1
    startup_timeout_s: float = 900     # each start-up stage's deadline (fault.startup_timeout_s)
    worker_cls: type = Worker           # launcher.simulate.StandInWorker for `msinfer simulate`
    worker_options: dict = field(default_factory=dict)     # its constructor's keyword arguments
    engine_setup: EngineSetup | None = None   # start the replica's engine too
    tokenizer: Tokenizer | None | bool = False   # a local engine's, loaded already (False: it loads its own)
    # on cards: (total, in use, source, int8 matmuls usable (of linear layers, of experts)) as the
    # ranks measured them -> the EngineConfig whose KV cache that card holds (launcher.job.
    # card_replanner); raises LaunchError where the card is too small
    card_planner: Callable[..., EngineConfig] | None = None


@dataclass
class Replica:
    index: int
    cfg: ReplicaConfig = field(default_factory=ReplicaConfig)
    on_stage: Callable[[str], None] | None = None   # as each start-up stage begins (the progress bar)
    workers: list = field(default_factory=list)
    engine: ActorHandle | LocalEngine | None = None   # its engine: rank 0's actor, or in this process
    scheduler: ActorHandle | None = None   # stage 0's MindSpore scheduler actor (tp > 1 on cards)
    schedulers: list = field(default_factory=list)     # every stage's
    pgs: list = field(default_factory=list)            # a placement group per pipeline stage
    pp: int = 1                         # pipeline stages (EngineConfig.pipeline)
    pipeline: Pipeline | None = None    # of `submit`
    ranks: list = field(default_factory=list)
    setup_info: list = field(default_factory=list)
    submitted: int = 0                  # steps submitted: the next one's index (Worker.step)
    stopping: bool = False              # `shutdown` began: a start under way ends at its next wait

    def bundle(self) -> dict:
        if self.cfg.device == "ascend":
            return {"NPU": 1, "CPU": self.cfg.cpus_per_worker}
        return {"CPU": self.cfg.cpus_per_worker}

    def start(self, engine_config) -> list[dict]:
        """Places the group, starts its communication cluster, loads every rank's shard. Each stage
        must end within startup_timeout_s, or StartupTimeout names the ranks and the stage.
        With pipeline stages (engine_config.pipeline), each stage is a group of tensor_parallel ranks of
        its own: its own placement group (packed on one node with `pack`), its own MindSpore
        cluster; `workers` lists them stage after stage."""
        strategy = "STRICT_PACK" if self.cfg.placement == "pack" else "SPREAD"
        self.pp = pp = max(1, len(engine_config.pipeline))
        tp = self.cfg.tensor_parallel
        self._announce("placing workers")
        self.pgs = [placement_group([self.bundle() for _ in range(tp)], strategy=strategy) for _ in range(pp)]
        ready, _ = self._wait([pg.ready() for pg in self.pgs], pp, time.monotonic() + self.cfg.startup_timeout_s)
        if len(ready) < pp:
            need = self.bundle()
            raise NoRoom(
                f"replica {self.index}: Ray could not place {tp * pp} workers of {need} "
                f"({strategy}{f', {pp} stages of {tp}' if pp > 1 else ''}) within fault.startup_timeout_s="
                f"{self.cfg.startup_timeout_s:g}s; cluster resources: {ray.cluster_resources()}")

        def on(stage, bundle):
            return PlacementGroupSchedulingStrategy(self.pgs[stage], placement_group_bundle_index=bundle)

        local = self.cfg.engine_setup is not None and self.cfg.engine_setup.local
        hosted = self.cfg.engine_setup is not None and not local       # the engine in rank 0's process
        res = {"resources": {"NPU": 1}} if self.cfg.device == "ascend" else {}
        self.submitted, self.pipeline = 0, None
        # 2 steps in flight (of up to pp micro-batches each, launcher.engine.Pipeline) + a query;
        # rank 0 with an engine: an exchange and queries (its steps are local calls without stages)
        calls = 2 * pp + 1
        self.workers = []
        for st in range(pp):
            for r in range(tp):
                host = hosted and st == 0 and r == 0
                cls = ray.remote(engine_host(self.cfg.worker_cls) if host else self.cfg.worker_cls)
                self.workers.append(cls.options(num_cpus=self.cfg.cpus_per_worker, scheduling_strategy=on(st, r),
                                                max_concurrency=calls + (1 if host else 0), **res)
                                    .remote(r, tp, self.cfg.device, **self.cfg.worker_options))
        addresses = [(None, None)] * pp
        communicates = tp > 1 and self.cfg.worker_cls.communicates
        if communicates and engine_config.on_cpu:      # the CPU: rank 0 of each stage serves its group's store
            addresses = self._stage("its communication rendezvous", [self.workers[st * tp].rendezvous.remote()
                                                                     for st in range(pp)])
        elif communicates:                              # HCCL: a MindSpore scheduler per stage
            self.schedulers = [ray.remote(CommScheduler).options(num_cpus=0, scheduling_strategy=on(st, 0))
                               .remote(tp) for st in range(pp)]
            self.scheduler = self.schedulers[0]
            addresses = self._stage("its communication scheduler's start", [c.start.remote() for c in self.schedulers])
        self.ranks = self._stage("process start", [w.info.remote() for w in self.workers])
        for i, r in enumerate(self.ranks):
            if pp > 1:
                r["stage"] = i // tp
            host, port = addresses[i // tp]
            if port is not None:            # in the status file: where this group's rendezvous listens
                r["ms_rendezvous"] = f"{host}:{port}"
        def per_rank(ec) -> list:         # each rank's EngineConfig: its stage's
            return [dataclasses.replace(ec, stage=i // tp) if pp > 1 else ec for i in range(len(self.workers))]
        configs = per_rank(engine_config)
        wait = {"timeout_s": self.cfg.startup_timeout_s} if communicates else {}
        self._stage("device and communication init",
                    [w.join.remote(configs[i], *addresses[i // tp], **wait) for i, w in enumerate(self.workers)])
        if addresses[0][1] is not None:
            self._stage("communication pre-flight", [w.preflight.remote() for w in self.workers])
        setup = self.cfg.engine_setup
        if self.cfg.card_planner is not None:
            cards = [c for c in self._stage("measuring the card", [w.card_memory.remote(engine_config)
                                                                   for w in self.workers]) if c]
            if cards:                   # the smallest card and the most in use bound every rank's cache
                engine_config = self.cfg.card_planner(min(c["total"] for c in cards), max(c["in_use"] for c in cards),
                                                  cards[0]["source"],
                                                  tuple(all(c.get("int8", (True, True))[i] for c in cards)
                                                        for i in range(2)))
                setup = dataclasses.replace(setup, engine_config=engine_config) if setup is not None else None
                configs = per_rank(engine_config)
        if local:
            self.engine = LocalEngine(setup, self.index, self.cfg.tokenizer)
        loads = [w.load.remote(configs[i]) for i, w in enumerate(self.workers)]
        if hosted:      # its tokenizer loads while the weights do
            loads.append(self.workers[0].start_engine.remote(setup, self.index, self.workers[1:]))
        self.setup_info = self._stage("load" + (" and its engine's start" if hosted else ""), loads)[:len(self.workers)]
        if local:
            self.engine.engine.attach(self.workers)
        elif hosted:
            self.engine = self.workers[0]
        return self.ranks

    def _announce(self, stage: str) -> None:
        if self.on_stage is not None:
            self.on_stage(stage)

    def _stage(self, stage: str, refs: list) -> list:
        """The results of one start-up stage (a call per rank), within startup_timeout_s. A rank
        whose call fails (its process died, say) fails the stage as soon as it does: the other
        ranks may be waiting for it (a group's join), and would until the timeout."""
        self._announce(STAGE_NAMES.get(stage.split(" and ")[0], stage))
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        pending = list(refs)
        while pending:
            done, pending = self._wait(pending, 1, deadline)
            if not done:
                break
            ray.get(done)
        if pending:
            late = [r for r, ref in enumerate(refs) if ref in pending]
            nodes = sorted({self.ranks[r]["node_ip"] for r in late if r < len(self.ranks) and "node_ip" in self.ranks[r]})
            where = f" (on node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)})" if nodes else ""
            raise StartupTimeout(
                f"replica {self.index}: {late_names(late, len(self.workers), self.cfg.tensor_parallel, self.pp)}"
                f"{where} did not finish {stage} within fault.startup_timeout_s={self.cfg.startup_timeout_s:g}s (a "
                f"hung HCCL/MCCL init, an unreachable node or a stalled load); the job stops")
        return ray.get(refs)

    def _wait(self, refs: list, num_returns: int, deadline: float) -> tuple[list, list]:
        """ray.wait for `num_returns` of `refs` until `deadline` (time.monotonic), in slices of
        STOP_POLL_S, so that a start is given up soon after `shutdown` (a Ctrl-C while it starts):
        the caller may shut Ray down next, and a thread still inside a Ray call then could crash
        the process, or, once Ray is down, start a new one and wait for it for ever."""
        while True:
            left = deadline - time.monotonic()
            if not self.stopping:
                done, pending = ray.wait(refs, num_returns=num_returns, timeout=max(0.0, min(left, STOP_POLL_S)))
            if self.stopping:       # (its ranks killed: their calls end as failures, not the start's cause)
                raise LaunchError(f"replica {self.index}: stopped while starting")
            if len(done) >= num_returns or left <= STOP_POLL_S:
                return done, pending

    def submit(self, seqs, is_prefill: bool) -> list:
        """Starts one step on every rank (launcher.engine.submit_step), from the caller's process:
        `msinfer bench` and the measuring scripts, which drive steps without an engine. With
        pipeline stages, its micro-batches (launcher.engine.Pipeline); element 0 resolves to their
        StepOutputs, merged."""
        if self.pp > 1:
            if self.pipeline is None:            # start() made new workers
                self.pipeline = Pipeline(self.workers, self.pp)
            outs, others, relays = self.pipeline.submit(seqs, is_prefill)
            self.submitted = self.pipeline.index
            return [MergedOutputs(outs), *others]     # a relay that fails fails the outputs after it
        index, self.submitted = self.submitted, self.submitted + 1
        return submit_step(self.workers, seqs, is_prefill, index)

    def step(self, seqs, is_prefill: bool):
        refs = self.submit(seqs, is_prefill)
        if isinstance(refs[0], MergedOutputs):
            ray.get(refs[1:])
            return refs[0].get()
        return ray.get(refs)[0]

    def pids(self) -> list[int]:
        return [r["pid"] for r in self.ranks]

    def death(self, wait_s: float = 5.0) -> tuple[str, str | None] | None:
        """Which of this replica's ranks died and how, as each rank's node tells it: a task on the
        node waits up to `wait_s` for the rank's process to be gone and reads its Ray log
        (launcher.worker_logs). (its words: "rank 1 (pid 4242 on 10.0.0.2): SIGFPE in
        PagedAttention; its log: PATH", or a dead rank whose log tells nothing by its pid; what
        the log told: "SIGFPE in PagedAttention", or None). None where no node says a rank is dead
        (a lost node answers nothing). Once a rank is found gone without a word (SIGKILL), the
        others are waited for SILENT_GRACE_S more, not wait_s: those still alive are killed next."""
        from msinfer.launcher.worker_logs import read_worker_log
        asked = {}
        for rank, info in enumerate(self.ranks):
            if "pid" in info and "node_id" in info:
                on_its_node = NodeAffinitySchedulingStrategy(info["node_id"], soft=False)
                asked[read_worker_log.options(scheduling_strategy=on_its_node).remote(info["pid"], wait_s)] = rank
        told, silent = [], []
        pending, end = list(asked), time.monotonic() + wait_s + 5
        while pending and not told and time.monotonic() < end:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, end - time.monotonic()))
            for ref in done:
                try:
                    alive, path, note = ray.get(ref)
                except Exception:                 # its node is gone
                    continue
                info = self.ranks[asked[ref]]
                who = f"rank {asked[ref]} (pid {info['pid']} on {info.get('node_ip', '?')})"
                if note:
                    told.append((f"{who}: {note}; its log: {path}", note))
                elif not alive:
                    silent.append((who, None))
                    # gone without a word (SIGKILL): the others, alive, are waited for only briefly
                    end = min(end, time.monotonic() + SILENT_GRACE_S)
        for ref in pending:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        found = told or silent
        return ("; ".join(words for words, _ in found), found[0][1]) if found else None

    def shutdown(self) -> None:
        self.stopping = True
        if isinstance(self.engine, LocalEngine):
            self.engine.kill()
        for a in [*self.workers, *self.schedulers]:
            if a is not None:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # already dead
                    pass
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.workers, self.scheduler, self.schedulers, self.pgs, self.engine = [], None, [], [], None


def wait_gone(pids: list[int], timeout_s: float = 10) -> bool:
    """True once none of the local pids is alive (for tests and teardown checks)."""
    end = time.time() + timeout_s
    while time.time() < end:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False

