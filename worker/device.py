"""Which device a worker computes on, and how a rank joins its communication group.

On Ascend, Ray hands each worker one `NPU` and sets ASCEND_RT_VISIBLE_DEVICES to that card, so the
card is device 0 of what the process can see; without Ray's assignment we fall back to the card
listed for this rank. On the CPU there is no device id.

A tensor-parallel group is one MindSpore cluster started without msrun: one scheduler process
(`MS_ROLE=MS_SCHED`) and one worker process per rank (`MS_ROLE=MS_WORKER`, `MS_NODE_ID`=rank),
all pointed at the scheduler's host and port. Every process calls `communication.init()` once in
its life, so a restarted group gets fresh processes and a fresh port.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceChoice:
    target: str            # "CPU" or "Ascend"
    device_id: int | None  # Ascend card index as this process sees it


def select_device(device: str, env: dict | None = None, rank: int = 0) -> DeviceChoice:
    env = os.environ if env is None else env
    if device in ("auto", ""):
        device = "ascend" if env.get("ASCEND_RT_VISIBLE_DEVICES") or env.get("ASCEND_HOME_PATH") else "cpu"
    if device == "cpu":
        return DeviceChoice("CPU", None)
    if device != "ascend":
        raise ValueError(f"parallel.device '{device}' is not one of auto, cpu, ascend")
    visible = [v for v in env.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if len(visible) == 1:           # Ray assigned exactly this card: it is device 0 of this process
        return DeviceChoice("Ascend", 0)
    if visible:                     # several cards visible: take this rank's
        return DeviceChoice("Ascend", rank % len(visible))
    return DeviceChoice("Ascend", int(env.get("DEVICE_ID", rank)))


def cluster_env(role: str, host: str, port: int, world: int, rank: int | None = None) -> dict[str, str]:
    env = {"MS_ROLE": role, "MS_SCHED_HOST": host, "MS_SCHED_PORT": str(port), "MS_WORKER_NUM": str(world),
           # registration retries at a random 3-5 s by default; 1 s cuts group start-up by seconds
           "MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}
    if rank is not None:
        env["MS_NODE_ID"] = str(rank)
    return env


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_communication(host: str, port: int, world: int, rank: int) -> None:
    os.environ.update(cluster_env("MS_WORKER", host, port, world, rank))
    from mindspore.communication import init
    init()


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
