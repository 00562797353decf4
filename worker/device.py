"""Which device a worker computes on, and how a rank joins its communication group.

On Ascend, Ray hands each worker one `NPU` and sets ASCEND_RT_VISIBLE_DEVICES to that card, so the
card is device 0 of what the process can see. With RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES
set, Ray leaves the variable as the node had it and the worker finds its card by the id Ray
assigned; without any assignment we fall back to the card listed for this rank. On the CPU there
is no device id.

A tensor-parallel group is one MindSpore cluster started without msrun. On the CPU, rank 0 serves
a TCPStore on its node and every rank joins through it (`join_through_store`): on the CPU kernels
the ranks of one node then sum through shared memory and MindSpore's MCCL is not started
(`join_node_group`), elsewhere they start MCCL. On cards
(HCCL), one scheduler process (`MS_ROLE=MS_SCHED`) and one worker process per rank
(`MS_ROLE=MS_WORKER`, `MS_NODE_ID`=rank) are all pointed at the scheduler's host and port
(`init_communication`). Every process joins once in its life, so a restarted group gets fresh
processes and a fresh port.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
from dataclasses import dataclass

import numpy as np

from msinfer.sharding.config import resolve_device


@dataclass(frozen=True)
class DeviceChoice:
    target: str            # "CPU" or "Ascend"
    device_id: int | None  # Ascend card index as this process sees it


def select_device(device: str, env: dict | None = None, rank: int = 0,
                  assigned: list[str] | None = None) -> DeviceChoice:
    """`assigned`: the NPU ids Ray gave this worker; None asks Ray when `env` is this process's."""
    live, env = env is None, os.environ if env is None else env
    device = resolve_device(device, env)
    if device == "cpu":
        return DeviceChoice("CPU", None)
    if device != "ascend":
        raise ValueError(f"parallel.device '{device}' is not one of auto, cpu, ascend")
    visible = [v.strip() for v in env.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(visible) == 1:           # Ray assigned exactly this card: it is device 0 of this process
        return DeviceChoice("Ascend", 0)
    if assigned is None and live:
        assigned = ray_npu_ids()
    card = str(assigned[0]).strip() if assigned else None
    if card is not None and card in visible:    # Ray's card among several visible (NOSET mode)
        return DeviceChoice("Ascend", visible.index(card))
    if card is not None and not visible:
        return DeviceChoice("Ascend", int(card))
    if visible:                     # several cards visible, none assigned: take this rank's
        return DeviceChoice("Ascend", rank % len(visible))
    return DeviceChoice("Ascend", int(env.get("DEVICE_ID", rank)))


def select_ops(device: str, ops_choice: str = "auto", threads: int = 0, emulate: bool = False):
    """The device seam of a worker (worker/ops.py's contract): `model.ops` portable, or the
    device's fastest (auto): the CPU kernels, or Ascend's fused kernels (their CPU stand-ins with
    `emulate`). Chosen here, not in worker/ops.py, which the implementations import."""
    if ops_choice == "portable":
        from msinfer.worker.ops import MsOps
        return MsOps
    if device == "ascend":
        from msinfer.worker.ascend import AscendOps, EmulatedAscendOps
        return EmulatedAscendOps if emulate else AscendOps
    from msinfer.worker.cpu import CpuOps, load_kernels
    load_kernels(threads)
    return CpuOps


def ray_npu_ids() -> list[str]:
    """The NPU ids Ray assigned to this worker process ([] outside Ray or without NPUs)."""
    try:
        import ray
        if not ray.is_initialized():
            return []
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("NPU", [])]
    except Exception:
        return []


def cluster_env(role: str, host: str, port: int, world: int, rank: int | None = None) -> dict[str, str]:
    env = {"MS_ROLE": role, "MS_SCHED_HOST": host, "MS_SCHED_PORT": str(port), "MS_WORKER_NUM": str(world),
           # registration retries at a random 3-5 s by default; 1 s cuts group start-up by seconds
           "MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}
    if rank is not None:
        env["MS_NODE_ID"] = str(rank)
    return env


SCHEDULER_PORTS_FROM = 20000     # above Ray's default worker ports (10002-19999)


def free_port(host: str) -> int:
    """A free port for a group's rendezvous, outside the kernel's ephemeral range
    (ip_local_port_range) where there is room: the port is chosen here and bound later (by rank
    0's TCPStore, or MindSpore's scheduler), and an outgoing connection (Ray opens many) given that
    port as its local one in between would leave the group's ranks waiting for a listener.
    Outside that range only another listener can take it, so a random one rarely clashes."""
    low, high = ephemeral_ports()
    spans = [r for r in (range(SCHEDULER_PORTS_FROM, low), range(high + 1, 65536)) if len(r) >= 1000]
    for _ in range(64 if spans else 0):
        port = random.choice(random.choice(spans))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_ports() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999            # Linux's default


def init_communication(host: str, port: int, world: int, rank: int) -> None:
    """Joins a group through its MindSpore scheduler (MS_ROLE=MS_WORKER; the scheduler is
    launcher.replica's CommScheduler): HCCL on cards."""
    os.environ.update(cluster_env("MS_WORKER", host, port, world, rank))
    from mindspore.communication import init
    init()


_STORE = None       # the group's TCPStore (rank 0 serves it), held for the life of the process


def join_through_store(host: str, port: int, world: int, rank: int, timeout_s: float,
                       node_group: bool = False) -> str:
    """Joins a CPU group without a scheduler process: rank 0 serves a MindSpore TCPStore at
    host:port (on its own node) and the other ranks connect to it, as torch's init_process_group
    does. With `node_group` (the CPU kernels), the ranks first try to sum through shared memory
    (join_node_group); where they do, MindSpore's communication is not started at all, nor the
    3 s below. Returns how the group sums: "shared_memory", or "mccl".
    MindSpore's public `mint.distributed.init_process_group` takes a store for HCCL only;
    `communication.management._init_with_store`, which it calls, takes MCCL too, and is what is
    called here. Against the scheduler (`init_communication`), a group of 3 on 2 cores had its
    first all-reduce done 3.1-3.2 s after init began instead of 6.6 s, and the scheduler's
    process, which imports MindSpore (about 2 CPU-seconds), is not started. About 3 s remain:
    every rank starts MCCL's address exchange (ms_collective_node.cc) as the last one registers
    with the store, puts its own address and asks for rank 0's; a rank that asks before rank 0
    has put it (by ~1 ms here) asks again 3 s later. Each rank needs every other's address, so
    ordering the ranks' starts only moves the wait (docs/benchmarks.md, MCCL's start)."""
    from datetime import timedelta

    from mindspore.communication.management import _init_with_store
    from mindspore.mint.distributed import TCPStore
    global _STORE
    timeout = timedelta(seconds=max(1.0, timeout_s))
    _STORE = TCPStore(host_name=host, port=port, world_size=world, is_master=rank == 0, timeout=timeout)
    if node_group and join_node_group(rank, world, timeout_s):
        return "shared_memory"
    _init_with_store(backend="mccl", timeout=timeout, world_size=world, rank=rank, store=_STORE)
    return "mccl"


# A node group's segment: a slot of each rank in each of two buffers (a call larger than a slot
# runs as several steps), after a header of a 64-byte line per rank. 2 x 3 slots of 1 MiB for the
# demo's group: /dev/shm is 64 MiB in a container by default.
NODE_SLOT_BYTES = 1 << 20
NODE_GROUP_MAX_RANKS = 64    # the library's kNodeMaxRanks (collective.h)
_NODE_SEGMENT = None     # the node group's mapping, held for the life of the process


def node_segment_bytes(world: int, slot_bytes: int = NODE_SLOT_BYTES) -> int:
    return -(-world * 64 // 4096) * 4096 + 2 * world * slot_bytes


def remove_stale_segments() -> None:
    """Node group segments whose creator is gone (killed between creating and unlinking one)."""
    from msinfer.worker.graph_cache import pid_alive
    for name in os.listdir("/dev/shm"):
        pid = name.split("-")[1] if name.startswith("msinfer-") and name.count("-") == 2 else ""
        if pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")


def join_node_group(rank: int, world: int, timeout_s: float) -> bool:
    """Once a CPU group's ranks reach rank 0's TCPStore: sums over the group go through a
    shared-memory segment (worker/csrc/collective.h) when every rank can map it, i.e. the ranks
    share a node (and its /dev/shm), MSINFER_NODE_ALLREDUCE is not 0 on rank 0 and the group has
    at most NODE_GROUP_MAX_RANKS. Rank 0
    creates the segment under a random name and puts the name and a random token in the store;
    each rank maps it and says in the store whether it read the token; only if all did does any
    use it, so the ranks agree (else all start MCCL). Rank 0 then unlinks the file: the mappings
    live on, and nothing is left in /dev/shm when the processes end; before it creates one, it
    removes those that processes no longer alive left (their name holds the creator's pid). Each
    network and sampler built after this sums and gathers with it (sharding.layers.ALL_REDUCE,
    ALL_GATHER). `timeout_s`: how long a rank waits for the others within a call. Returns
    whether the group is in use."""
    import mmap
    import secrets

    from msinfer.sharding import layers
    from msinfer.worker import cpu
    global _NODE_SEGMENT
    size = node_segment_bytes(world)
    path = None
    if rank == 0:
        offer = "none"
        if (os.environ.get("MSINFER_NODE_ALLREDUCE", "1") != "0" and os.path.isdir("/dev/shm")
                and world <= NODE_GROUP_MAX_RANKS):
            remove_stale_segments()
            path, token = f"/dev/shm/msinfer-{os.getpid()}-{secrets.token_hex(8)}", secrets.token_hex(16)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except OSError:                               # (a /dev/shm it may not write to)
                path = None
            else:
                try:
                    os.posix_fallocate(fd, 0, size)       # tmpfs refuses here, not with SIGBUS on first touch
                    os.pwrite(fd, token.encode(), size - len(token))
                    offer = f"{path} {token}"
                except OSError:
                    pass
                finally:
                    os.close(fd)
        _STORE.set("msinfer/node_group", offer)
    offer = _STORE.get("msinfer/node_group").decode()
    segment = None
    if offer != "none":
        where, token = offer.split()
        try:
            fd = os.open(where, os.O_RDWR)
            try:
                segment = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            if segment[size - len(token):] != token.encode():
                segment.close()
                segment = None
        except (OSError, ValueError):
            segment = None
    _STORE.set(f"msinfer/node_group/{rank}", "1" if segment is not None else "0")
    every = all(_STORE.get(f"msinfer/node_group/{r}") == b"1" for r in range(world))
    if path is not None:
        os.unlink(path)
    if not every:
        if segment is not None:
            segment.close()
        return False
    if not cpu.attach_node_group(memoryview(segment), rank, world, NODE_SLOT_BYTES, timeout_s):
        raise RuntimeError(f"the kernel library refused a node group of {world} ranks in {size} bytes")
    _NODE_SEGMENT = segment
    layers.ALL_REDUCE, layers.ALL_GATHER = cpu.NodeAllReduce, cpu.NodeAllGather
    return True


# What the library's NodeAllReduce and NodeAllGather return when a call fails (collective.h)
NODE_GROUP_FAILURES = {
    2: "a rank of the group did not come within fault.startup_timeout_s (it failed or stopped before "
       "this collective)",
    3: "the ranks reached different collectives (their steps ran them in different orders)"}


def node_group_error(error: Exception) -> RuntimeError | None:
    """A step's failure that MindSpore reports as a node group's collective returning a code, said
    in words (the replica is restarted as for any failed step); None for any other failure."""
    import re
    m = re.search(r"function\((NodeAll(?:Reduce|Gather))\) is (\d+)", str(error))
    if m is None:
        return None
    why = NODE_GROUP_FAILURES.get(int(m[2]), f"it returned {m[2]}")
    return RuntimeError(f"the tensor-parallel group's {m[1]} through shared memory failed: {why}")


def start_scheduler_thread(host: str, port: int, world: int) -> threading.Thread:
    """Runs the scheduler role in a daemon thread: its `init()` blocks for the life of the cluster."""
    os.environ.update(cluster_env("MS_SCHED", host, port, world))

    def run():
        import mindspore as ms
        ms.set_device("CPU")
        from mindspore.communication import init
        init()

    t = threading.Thread(target=run, name="ms-scheduler", daemon=True)
    t.start()
    return t


# HCCL's documented ranges for its timeouts (CANN's environment variable reference), in seconds
HCCL_CONNECT_RANGE = (120, 7200)
HCCL_EXEC_RANGE = (1, 17340)


def card_environment(startup_timeout_s: float, step_timeout_s: float) -> dict[str, str]:
    """What a worker on a card sets before MindSpore starts, each only where the variable is not
    set already (a user's value wins), as vllm-mindspore's launch does (its `env_setup`):
    HCCL_CONNECT_TIMEOUT from fault.startup_timeout_s (a rank waits that long for its peers) and
    HCCL_EXEC_TIMEOUT from fault.step_timeout_s (a collective waits that long), both within
    HCCL's ranges; HCCL_OP_EXPANSION_MODE=AIV (collectives expanded on the AI vector cores),
    MS_ENABLE_LCCL=off (HCCL, not MindSpore's LCCL, for the collectives), and
    MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST=FlashAttentionScore,PagedAttention (vllm-mindspore's
    init_env default, and what its native Qwen3 model sets "for best performance": the runtime's
    own internal kernels for the two attention ops, which the start-up self-check then checks)."""
    def within(x: float, bounds: tuple[int, int]) -> str:
        return str(int(min(max(x, bounds[0]), bounds[1])))
    return {"HCCL_CONNECT_TIMEOUT": within(startup_timeout_s, HCCL_CONNECT_RANGE),
            "HCCL_EXEC_TIMEOUT": within(step_timeout_s, HCCL_EXEC_RANGE),
            "HCCL_OP_EXPANSION_MODE": "AIV", "MS_ENABLE_LCCL": "off",
            "MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST": "FlashAttentionScore,PagedAttention"}


# What a worker computing on the CPU sets before MindSpore starts, where the variable is not set
# already (a user's value wins). MindSpore's graph pipeline hands each compiled step from the
# calling thread to a queue thread that launches it while the caller spin-waits; on a CPU both
# threads then compete with the kernels' own threads for the same cores (perf: the queue thread
# and the caller's wait took ~12% of two cores a decode step, and the kernels' calling thread was
# descheduled 15% of the time). Launched by the calling thread itself, a step has those cores.
CPU_ENVIRONMENT = {"MS_DEV_RUNTIME_CONF": "graph_pipeline:False"}


def apply_environment(values: dict[str, str], env: dict | None = None) -> dict[str, str]:
    """Sets each variable not set already; returns what was set."""
    env = os.environ if env is None else env
    new = {k: v for k, v in values.items() if k not in env}
    env.update(new)
    return new


def preflight(world: int) -> None:
    """A small all-reduce over the group that has just joined: every rank's 1 sums to `world`, or
    the communication between the ranks does not work (an HCCL or MCCL link, a firewall); a hang
    here is a start-up stage's timeout, which names the ranks that did not answer."""
    from mindspore import Tensor

    from msinfer.sharding.layers import all_reduce
    got = all_reduce()(Tensor(np.ones(1, np.float32))).asnumpy()
    if abs(float(got[0]) - world) > 1e-3:
        raise RuntimeError(f"the communication pre-flight summed {float(got[0]):g} over {world} ranks")
