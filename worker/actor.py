"""The Ray actors of one tensor-parallel group: a `Worker` per rank, and on cards the MindSpore
scheduler.

The controller creates them (launcher/replica.py wraps these classes with `ray.remote`), then:
    host, port = workers[0].rendezvous()      # CPU: rank 0's TCPStore; cards: scheduler.start()
    [w.join(engine_config, host, port)]       # every rank joins the group,
    [w.load(engine_config)]                   # then loads its shard
    [w.step(seqs, is_prefill, index)]         # every rank runs the same step and samples the same
                                              # tokens; rank 0 returns them. Steps run in index order
Nothing but plain dataclasses (worker.protocol) crosses the wire.
"""

from __future__ import annotations

import os
import resource
import threading
import time

from msinfer.sharding.layout import TPInfo
from msinfer.worker.device import (CPU_ENVIRONMENT, apply_environment, free_port, init_communication,
                                   join_through_store, preflight, select_device, start_scheduler_thread)
from msinfer.worker.imports import import_mindspore, own_process
from msinfer.worker.protocol import DecodeChain, DecodeStep, StepOutput, unpack_step


# Fault injection, for tests (docs/spec.md): a worker whose step input holds this token id aborts
# (SIGABRT) at once, as a process a kernel crash takes down does. Read once, and only where it is set.
POISON_ENV = "MSINFER_FAULT_POISON_TOKEN"
POISON_TOKEN = int(os.environ[POISON_ENV]) if os.environ.get(POISON_ENV) else None
# and one whose every step takes this many seconds more, as a slow card's would (a job lasts long
# enough that a test can take its node away while every replica still has records to run)
DELAY_ENV = "MSINFER_FAULT_STEP_DELAY_S"
STEP_DELAY_S = float(os.environ[DELAY_ENV]) if os.environ.get(DELAY_ENV) else None


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def allocator() -> str:
    """The malloc this process runs on: the file name of a preloaded allocator it maps (jemalloc,
    which Ray ships and its raylet passes to workers: launcher.replica.WORKER_ALLOCATOR_ENV; or a
    user's own, e.g. tcmalloc), else "glibc"."""
    try:
        with open("/proc/self/maps") as f:
            names = {os.path.basename(line.split()[-1]) for line in f if line.rstrip().endswith(".so")
                     or ".so." in line}
    except OSError:
        return "unknown"
    return next((n for n in sorted(names) if any(k in n for k in ("jemalloc", "tcmalloc", "mimalloc"))), "glibc")


def node_facts() -> dict:
    import ray
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


def rendezvous_address() -> tuple[str, int]:
    """Where a group's rendezvous listens: this node's address and a free port on it."""
    import ray
    host = ray.util.get_node_ip_address()
    return host, free_port(host)


class CommScheduler:
    """MindSpore's communication scheduler (its cluster's rendezvous, MS_ROLE=MS_SCHED) for one
    group; not the batch scheduler (launcher.scheduler). Lives until the actor is killed."""

    def __init__(self, world: int):
        self.world = world
        self.thread = None

    def start(self) -> tuple[str, int]:
        host, port = rendezvous_address()
        self.thread = start_scheduler_thread(host, port, self.world)
        return host, port


class Worker:
    communicates = True          # joins its group's MindSpore communication cluster (tp > 1)

    def __init__(self, rank: int, world: int, device: str):
        own_process()            # transformers without torch, should this process import it
        self.tp = TPInfo(rank, world)
        self.device = select_device(device, rank=rank)
        self.runner = None
        self.all_reduce = None           # how the group sums (join): shared_memory, mccl, hccl; None at tp 1
        self.environment: dict = {}          # what this worker set (worker.device: card_environment, CPU_ENVIRONMENT)
        self.turn = threading.Condition()       # steps run one at a time, in order (see step)
        self.next_index = 0

    def info(self) -> dict:
        return {"rank": self.tp.rank, **node_facts(), "device": self.device.target.lower()
                + ("" if self.device.device_id is None else f":{self.device.device_id}")}

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 of a CPU group: where its TCPStore will listen, for every rank's `join`
        (worker.device.join_through_store)."""
        return rendezvous_address()

    def join(self, engine_config, sched_host: str | None, sched_port: int | None, timeout_s: float = 300.0) -> float:
        """Start-up stage 1: the device, and the group's communication cluster (tp > 1): on the CPU
        (and Ascend emulated) through rank 0's TCPStore at sched_host:sched_port, on the CPU kernels
        as a node group that sums through shared memory where the ranks share a node (else MCCL:
        worker.device.join_through_store); on a card through the group's MindSpore scheduler there.
        timeout_s: how long a rank waits for the others. Returns its seconds."""
        t0 = time.perf_counter()
        if self.device.target == "Ascend" and not engine_config.emulate:     # before MindSpore starts
            self.environment = apply_environment(engine_config.card_env)
        elif engine_config.on_cpu:
            self.environment = apply_environment(CPU_ENVIRONMENT)
        ms = import_mindspore()
        if engine_config.emulate:             # Ascend's path on the CPU (worker/ascend.py)
            ms.set_device("CPU")
        elif self.device.device_id is None:
            ms.set_device(self.device.target)
        else:
            ms.set_device(self.device.target, self.device.device_id)
        if engine_config.threads:
            from mindspore.device_context.cpu import threads_num
            threads_num(engine_config.threads)
        if self.tp.size > 1 and engine_config.on_cpu:
            if engine_config.cpu_kernels:           # their library sums through shared memory
                from msinfer.worker.cpu import load_kernels
                load_kernels(engine_config.threads)
            self.all_reduce = join_through_store(sched_host, sched_port, self.tp.size, self.tp.rank, timeout_s,
                                                 node_group=engine_config.cpu_kernels)
        elif self.tp.size > 1:
            init_communication(sched_host, sched_port, self.tp.size, self.tp.rank)
            self.all_reduce = "hccl"
        self.comm_s = time.perf_counter() - t0
        return self.comm_s

    def preflight(self) -> None:
        """Start-up stage after join (tp > 1): a small all-reduce over the group."""
        preflight(self.tp.size)

    def card_memory(self, engine_config) -> dict:
        """Start-up stage between join and load on a card: its total memory and what is in use on
        it already (bytes), as the device reports them (MindSpore's get_device_properties), or an
        emulated card's size (EngineConfig.emulate_memory, nothing in use); {} where unknown. For
        a quantized checkpoint, `int8`: whether the card's int8 matmuls (of linear layers, of
        experts) pass the start-up kernel check (worker.kernel_check.int8_usable), which decides
        the weights' bytes."""
        card = self.measure_card(engine_config)
        if card:
            from msinfer.worker.kernel_check import int8_usable
            usable = int8_usable(engine_config, self.tp.size)
            if usable is not None:
                card["int8"] = usable
        return card

    def measure_card(self, engine_config) -> dict:
        if engine_config.emulate:
            m = engine_config.emulate_memory
            return {} if m is None else {"total": m, "in_use": 0, "source": "MSINFER_ASCEND_EMULATE_MEMORY_GB"}
        if self.device.target != "Ascend":
            return {}
        import mindspore as ms
        try:
            props = ms.hal.get_device_properties(self.device.device_id or 0)
        except Exception:                   # an old driver or CANN: the plan's figure stands
            return {}
        total, free = getattr(props, "total_memory", 0), getattr(props, "free_memory", None)
        if not total:
            return {}
        return {"total": int(total), "in_use": int(total - free) if free is not None else 0, "source": "device"}

    def load(self, engine_config) -> dict:
        """Start-up stage 2: the network, this rank's shard of the checkpoint, the KV cache."""
        t0 = time.perf_counter()
        from msinfer.worker.runner import ModelRunner
        self.tp = TPInfo(self.tp.rank, self.tp.size, engine_config.expert_parallel)
        self.runner = ModelRunner(engine_config, self.tp)
        card = {}
        if engine_config.card is not None:      # the card's plan (measured where the card said) and what it holds
            card["memory"] = {**engine_config.card, "weights_loaded": self.runner.load_stats["bytes"],
                              "kv_cache_allocated": self.runner.kv_bytes()}
        if self.environment:
            card["environment_set"] = self.environment
        return {**card, "rank": self.tp.rank, "comm_init_s": self.comm_s, "load_s": self.runner.load_s,
                "setup_s": self.comm_s + time.perf_counter() - t0, "param_bytes": self.runner.load_stats["bytes"],
                "peak_rss_bytes": peak_rss_bytes(), "allocator": allocator(), "num_blocks": self.runner.num_blocks,
                "dtype": self.runner.dtype, "fused_layers": self.runner.fused_layers, "all_reduce": self.all_reduce,
                **({"kernel_check": self.runner.kernel_check} if self.runner.kernel_check is not None else {})}

    def step(self, seqs: bytes, is_prefill: bool, index: int = -1, *inputs: StepOutput) -> StepOutput | list | None:
        """Step `index` of this group (0, 1, ...; -1: unordered, when no other is in flight). With
        async scheduling two steps are in flight and the actor has threads for both: each waits for
        the one before it. `seqs` as launcher.replica sends them (protocol.pack_step); a
        DecodeChain's steps answer a list of StepOutputs, one a step.
        A pipeline stage's `inputs` (launcher.engine.Pipeline): the stage before's rank 0 output
        (its hidden states), or for the first stage the last stage's outputs of the step before
        (the tokens of its SAMPLED inputs)."""
        seqs, released = unpack_step(seqs)
        fed = ([t for st in seqs.steps for t in st.token_ids] if isinstance(seqs, DecodeChain) else
               seqs.token_ids if isinstance(seqs, DecodeStep) else [t for s in seqs for t in s.token_ids])
        if POISON_TOKEN is not None and POISON_TOKEN in fed:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))        # (no core file of a test's fault)
            os.abort()                      # as a kernel crash would (fault injection, tests only)
        hidden = next((o.hidden for o in inputs if o.hidden is not None), None)
        sampled = {k: v for o in inputs if o.sampled for k, v in o.sampled.items()}
        with self.turn:
            if index >= 0:
                self.turn.wait_for(lambda: self.next_index == index)
            try:
                if STEP_DELAY_S is not None:    # (fault injection, tests only)
                    time.sleep(STEP_DELAY_S * (len(seqs.steps) if isinstance(seqs, DecodeChain) else 1))
                # every rank samples (the same tokens: the logits are whole on each) for SAMPLED
                out = self.runner.step(seqs, is_prefill, logprobs=self.tp.rank == 0, released=released,
                                       hidden=hidden, sampled=sampled)
            finally:
                if index >= 0:
                    self.next_index = index + 1
                    self.turn.notify_all()
        return out if self.tp.rank == 0 else None

    def fill_random(self, scale: float = 0.02, seed: int = 0) -> int:
        """Small random values in every weight, for EngineConfig(random_weights=True), which loads
        none (msinfer bench --skip-load). The KV cache stays as it is. Returns the bytes filled."""
        import numpy as np
        from mindspore import Tensor
        rng = np.random.default_rng([seed, self.tp.rank])
        filled = 0
        model = self.runner.model
        stacked = model.stacked      # (a layer's weight held in its stack: never written)
        made = {id(p) for p in (model.head_pairs, model.head_norms) if p is not None}   # (from the LM head, below)
        for p in model.get_parameters():
            if "cache" not in p.name and p.name != "freq_matrix" and p.name not in stacked and id(p) not in made:
                p.set_data(Tensor(random_values(p.shape, p.dtype, rng, scale), dtype=p.dtype))
                filled += p.nbytes
        if made:
            model.refresh_greedy_head()
        return filled

    def loaded_params(self) -> dict:
        """name -> numpy value of every parameter this rank holds (tests check the slices)."""
        return self.runner.model.weights()

    def stats(self) -> dict:
        return {"rank": self.tp.rank, "peak_rss_bytes": peak_rss_bytes(),
                "compile_s": dict(self.runner.compile_s) if self.runner else {}}


def random_values(shape, dtype, rng, scale: float):
    """Normal values of standard deviation `scale` for a parameter of `shape` held as `dtype` (a
    MindSpore dtype): bfloat16 bits where the kernels hold bfloat16 (int16 tiles, uint16 panels:
    CpuOps.pack_weight; uint32 pairs, two values a word: CpuOps.pack_pairs), else the values."""
    import mindspore as ms
    import numpy as np
    from msinfer.worker.cpu import bfloat16_bits
    if dtype == ms.uint32:
        shape = (*shape[:-1], 2 * shape[-1])
    values = rng.standard_normal(shape, np.float32) * scale
    if dtype in (ms.int16, ms.uint16, ms.uint32):
        view = {ms.int16: np.int16, ms.uint16: np.uint16, ms.uint32: np.uint32}[dtype]
        values = np.ascontiguousarray(bfloat16_bits(values)).view(view)
    return values
