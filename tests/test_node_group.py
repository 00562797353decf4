"""The all-reduce and all-gather of a tensor-parallel group whose ranks share a node
(worker/csrc/collective.h, worker.device.join_node_group): processes that map one segment sum
their tensors to numpy's sum in rank order, bit for bit on every rank, and gather them, in steps
smaller than the tensor; a rank at another call site or one that never comes fails the call
instead of summing; and the ranks use the segment only when all of them can (else they all keep
MCCL), leaving nothing in /dev/shm.
The groups of Ray workers that run through it: tests/test_tp.py, test_moe.py, test_quant.py."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest

from msinfer.worker import cpu, device
from msinfer.worker.cpu import bfloat16_rounded, bfloat16_values, load_kernels
from scripts.measure_bf16 import Call

SLOT = 4096          # bytes: a float32 tensor of 2,500 values is three steps


def rank_main(library: str, path: str, rank: int, world: int, timeout_s: float, calls: list, out) -> None:
    """One rank's process: maps the segment at `path`, attaches, runs `calls` ((dtype name, x, tag),
    an all-reduce, or (dtype name, x, tag, "gather")) in order and puts (rank, [(return code, y,
    seconds)])."""
    import mmap
    cpu._LIBRARY = library
    lib = ctypes.CDLL(library)
    fd = os.open(path, os.O_RDWR)
    segment = mmap.mmap(fd, os.path.getsize(path))
    os.close(fd)
    assert cpu.attach_node_group(memoryview(segment), rank, world, SLOT, timeout_s)
    results = []
    for dtype, x, tag, *gather in calls:
        y = np.zeros((world * x.shape[0], *x.shape[1:]) if gather else x.shape, x.dtype)
        call = Call(lib.NodeAllGather if gather else lib.NodeAllReduce, x, np.array([tag], np.int32), y,
                    dtypes=[dtype, "int32", dtype])
        t0 = time.perf_counter()
        code = call.code()
        results.append((code, y, time.perf_counter() - t0))
    out.put((rank, results))


def run_group(tmp_path, world: int, calls_of, ranks=None, timeout_s: float = 60.0) -> dict:
    """The results of ranks `ranks` (all of `world` by default) each running calls_of(rank)."""
    load_kernels(1)
    path = tmp_path / "segment"
    path.write_bytes(bytes(device.node_segment_bytes(world, SLOT)))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(cpu._LIBRARY, str(path), r, world, timeout_s, calls_of(r), out))
             for r in (range(world) if ranks is None else ranks)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return got


def test_ranks_of_a_node_group_sum_in_rank_order_to_the_same_bits_on_each(tmp_path):
    """An all-reduce of each dtype, one of a few values and ones of several steps, after and before
    gathers: every rank gets numpy's float32 sum in rank order, rounded once, and the gathers
    every rank's tensor, rank after rank."""
    rng = np.random.default_rng(0)
    world = 3
    # (dtype name, numpy array of each rank): a few values, several steps of a slot with a remainder,
    # float16 and bfloat16 (uint16 bits) summed in float32 and rounded once
    shapes = [("float32", (5,)), ("float32", (50, 50)), ("float16", (3000,)), ("bfloat16", (1000,)),
              ("float32", (7,))]
    values = {}
    for k, (dtype, shape) in enumerate(shapes):
        xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(world)]
        if dtype == "float16":
            xs = [x.astype(np.float16) for x in xs]
        elif dtype == "bfloat16":
            xs = [bfloat16_rounded(x) for x in xs]
        values[k] = xs
    gathered = [rng.standard_normal((2, 3)).astype(np.float32), rng.integers(0, 9, (700, 3)).astype(np.int32)]
    got = run_group(tmp_path, world, lambda r: [("float32", gathered[0] + r, 1, "gather")] + [
        (d, values[k][r], 10 + k) for k, (d, _) in enumerate(shapes)] + [("int32", gathered[1] * r, 2, "gather")])
    for r in range(world):
        first, *sums, last = got[r]
        assert first[0] == last[0] == 0
        np.testing.assert_array_equal(first[1], np.concatenate([gathered[0] + q for q in range(world)]))
        np.testing.assert_array_equal(last[1], np.concatenate([gathered[1] * q for q in range(world)]))
        got[r] = sums
    for k, (dtype, _) in enumerate(shapes):
        xs = values[k]
        wide = [bfloat16_values(x) if dtype == "bfloat16" else x.astype(np.float32) for x in xs]
        total = wide[0].copy()
        for x in wide[1:]:
            total += x                                          # float32, rank after rank
        ref = bfloat16_rounded(total) if dtype == "bfloat16" else total.astype(xs[0].dtype)
        for r in range(world):
            code, y, _ = got[r][k]
            assert code == 0, (dtype, r)
            np.testing.assert_array_equal(y, ref, err_msg=f"{dtype} {xs[0].shape} rank {r}")


def test_a_rank_at_another_call_site_or_one_that_never_comes_fails_the_call(tmp_path):
    x = np.ones(16, np.float32)
    got = run_group(tmp_path, 2, lambda r: [("float32", x, 1 + r)])        # tags 1 and 2
    assert [got[r][0][0] for r in range(2)] == [3, 3]
    got = run_group(tmp_path, 2, lambda r: [("float32", x, 1)], ranks=[0], timeout_s=0.5)
    code, _, seconds = got[0][0]
    assert code == 2 and 0.5 <= seconds < 10


class FakeStore:
    """rank 0's TCPStore as join_node_group uses it (set; get waits for the key), shared by threads
    that stand for the ranks; `offers` changes what a rank reads of rank 0's offer."""

    def __init__(self, offers=None):
        self.values, self.cond, self.offers = {}, threading.Condition(), offers or {}

    def set(self, key, value):
        with self.cond:
            self.values[key] = value.encode() if isinstance(value, str) else value
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout=30), key
            value = self.values[key]
        change = self.offers.get(threading.current_thread().name)
        return change(value) if change and key == "msinfer/node_group" else value


def join_in_threads(world: int) -> list:
    got = [None] * world

    def rank(r):
        got[r] = device.join_node_group(r, world, 5.0)
    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


@pytest.mark.parametrize("why", ["turned off on rank 0", "a rank on another node", "rank 0 cannot create it"])
def test_the_ranks_keep_mccl_together_when_any_cannot_map_the_segment(why, monkeypatch):
    """A rank that cannot map what rank 0 offers (another node's /dev/shm: here, a token it does
    not find) says so, and no rank attaches; MSINFER_NODE_ALLREDUCE=0 on rank 0 offers nothing,
    and so does a rank 0 that cannot create the segment (a /dev/shm it may not write to). Rank 0
    removes a segment that a process no longer alive left, before it creates its own."""
    import subprocess
    from msinfer.sharding import layers
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine: rank 0 offers no segment")
    load_kernels(1)
    done = subprocess.Popen(["true"])
    done.wait()
    stale = f"/dev/shm/msinfer-{done.pid}-0123456789abcdef"        # a segment whose creator died
    open(stale, "wb").close()
    before = set(os.listdir("/dev/shm")) - {os.path.basename(stale)}
    if why == "turned off on rank 0":
        monkeypatch.setenv("MSINFER_NODE_ALLREDUCE", "0")
        store = FakeStore()
    elif why == "rank 0 cannot create it":
        real_open = os.open

        def refuse_to_create(path, flags, *args):
            if flags & os.O_CREAT and str(path).startswith("/dev/shm/msinfer-"):
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, flags, *args)
        monkeypatch.setattr(os, "open", refuse_to_create)
        store = FakeStore()
    else:
        store = FakeStore({"rank2": lambda offer: offer[:-4] + b"0000"})
    monkeypatch.setattr(device, "_STORE", store)
    assert join_in_threads(3) == [False, False, False]
    assert (layers.ALL_REDUCE, layers.ALL_GATHER) == (layers.ops.AllReduce, layers.ops.AllGather)
    assert device._NODE_SEGMENT is None
    offer = store.values["msinfer/node_group"]
    assert (offer == b"none") == (why != "a rank on another node")
    assert [store.values[f"msinfer/node_group/{r}"] for r in range(3)] == (
        [b"0"] * 3 if offer == b"none" else [b"1", b"1", b"0"])
    assert set(os.listdir("/dev/shm")) - {os.path.basename(stale)} == before   # rank 0 unlinked the segment
    # rank 0 removed the stale one before it created its own (when it created one)
    assert os.path.exists(stale) == (why == "turned off on rank 0")
    if os.path.exists(stale):
        os.unlink(stale)


KEEP = []          # a segment the library keeps pointing at after the test below


def test_a_failed_collective_says_why_in_the_step_s_error():
    """A network's NodeAllReduce whose peer never comes: MindSpore's error (the kernel's return
    code) becomes one sentence that says a rank did not come within the timeout."""
    import mmap

    import mindspore as ms
    load_kernels(1)
    segment = mmap.mmap(-1, device.node_segment_bytes(2))
    KEEP.append(segment)
    assert cpu.attach_node_group(memoryview(segment), 0, 2, device.NODE_SLOT_BYTES, 0.3)
    with pytest.raises(RuntimeError) as raised:
        cpu.NodeAllReduce()(ms.Tensor(np.ones(4, np.float32))).asnumpy()
    error = device.node_group_error(raised.value)
    assert str(error) == ("the tensor-parallel group's NodeAllReduce through shared memory failed: a rank of the "
                          "group did not come within fault.startup_timeout_s (it failed or stopped before this "
                          "collective)")
    assert device.node_group_error(RuntimeError("anything else")) is None


def test_a_group_that_keeps_mccl_generates_transformers_tokens(cli, model, hf_greedy, tmp_path):
    """MSINFER_NODE_ALLREDUCE=0 on the driver (an embedded Ray's ranks inherit it): a tp-2 job's
    ranks agree to start MindSpore's MCCL group instead, after their exchange through the store,
    as ranks that cannot map one segment do, and greedy gives transformers' tokens."""
    import json
    from pathlib import Path

    from tests.conftest import PROMPTS
    from tests.test_cli import Job
    lines = [{"id": f"p{i}", "prompt_token_ids": p} for i, p in enumerate(PROMPTS)]
    job = Job(tmp_path, model, lines, parallel={"tensor_parallel": 2}, sampling={"max_new_tokens": 6})
    p = cli.run("run", job.spec_path, "--no-progress", env={"MSINFER_NODE_ALLREDUCE": "0"})
    assert p.returncode == 0, p.stderr
    summary = json.loads(Path(f"{job.output}.summary.json").read_text())
    assert [s["all_reduce"] for s in summary["setup"]] == ["mccl", "mccl"]
    for r in job.results():
        assert r["output_token_ids"] == hf_greedy("llama_gqa_tied", PROMPTS[int(r["id"][1:])], 6)[0], r["id"]
