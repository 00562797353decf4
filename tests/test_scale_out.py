"""Scale out: data-parallel replicas, groups across nodes, the node and Slurm scripts, Ascend cards.

The two-node cluster is `ray.cluster_utils.Cluster` in a helper process, and every job runs as
`msinfer run ... --set ray.address=<cluster>` in a subprocess, as a user would run it: the pytest
process never joins that cluster, so the session's embedded Ray (`ray_local`) and this cluster
cannot disturb each other. Ray's temporary folders go to private short paths (TMPDIR), so nothing
here touches /tmp/ray, and nothing calls `ray stop`, which would stop every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime
from pathlib import Path

import pytest

from msinfer.launcher.spec import load_spec
from msinfer.worker.device import DeviceChoice, select_device
from tests.conftest import cache_with_kernels
from tests.test_cli import wait_for

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MSINFER = str(BIN / "msinfer")
NODE_SH = str(ROOT / "scripts" / "msinfer-node.sh")
SLURM_SH = str(ROOT / "scripts" / "msinfer.slurm")
CKPT = "llama_gqa_tied"            # 2 KV heads: tp 2 splits them
N_RECORDS, N_NEW = 12, 8
TOKEN = secrets.token_hex(32)

CLUSTER_HELPER = textwrap.dedent("""
    import json, sys
    from ray.cluster_utils import Cluster
    nodes, cpus = int(sys.argv[1]), int(sys.argv[2])
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=cpus, include_dashboard=False))
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    ids = [n.node_id for n in cluster.list_all_nodes()]
    print(json.dumps({"address": cluster.address, "node_ids": ids}), flush=True)
    try:
        for command in sys.stdin:   # until the test closes stdin, or dies
            if command.strip() == "remove":         # a worker node (not the head), as a host lost
                cluster.remove_node(next(iter(cluster.worker_nodes)), allow_graceful=False)
            elif command.strip() == "add":
                cluster.add_node(num_cpus=cpus)
                cluster.wait_for_nodes()
            print(json.dumps([n.node_id for n in cluster.list_all_nodes()]), flush=True)
    finally:
        cluster.shutdown()
""")


def short_tmp(prefix: str) -> str:
    # Ray's socket paths live under its temp folder and must stay under ~100 characters
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def clean_env(**extra) -> dict:
    """This process's environment without what an embedded Ray (`ray_local`) may have put there,
    with a token of these tests' own: every cluster here runs token authentication, as `ray start`
    does, and nothing reads or writes ~/.ray."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(GLOG_v="3", TOKENIZERS_PARALLELISM="false", RAY_AUTH_TOKEN=TOKEN, **extra)
    return env


def processes_under(path: str) -> list[int]:
    import psutil
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(path in part for part in p.info["cmdline"] or ()):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


# ---- shared fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_nodes():
    """A two-node Ray cluster on this machine, one CPU per node: a one-CPU worker fits a node once."""
    tmp = short_tmp("msc")
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER_HELPER, "2", "1"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env=clean_env(TMPDIR=tmp, RAY_TMPDIR=tmp, RAY_AUTH_MODE="token"))
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"the two-node cluster did not start (exit status {proc.wait(30)})")

        def command(what: str) -> list[str]:
            """'remove' (a worker node) or 'add' (a node like the others): the node ids after it."""
            proc.stdin.write(what + "\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())
        yield {**json.loads(line), "command": command}
    finally:
        proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert not processes_under(tmp), "the cluster's Ray processes outlived it"
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, checkpoint) -> Path:
    """A job folder: the checkpoint, N_RECORDS token-id records, a job spec writing results/."""
    d = tmp_path_factory.mktemp("scale_out")
    rng = random.Random(0)
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(N_RECORDS):
            f.write(json.dumps({"id": f"r{i}", "prompt_token_ids": [rng.randrange(3, 256)
                                                                   for _ in range(3 + i % 6)]}) + "\n")
    (d / "job.yaml").write_text(textwrap.dedent(f"""\
        model:
          path: {checkpoint(CKPT)}
          max_model_len: 128
        parallel:
          device: cpu
        input:
          path: prompts.jsonl
        sampling:
          max_new_tokens: {N_NEW}
          ignore_eos: true
        scheduler:
          max_batch_size: 4
        output:
          path: results/out.jsonl
        """))
    return d


def run_job(job_dir: Path, name: str, *sets: str, address: str | None = None, timeout: float = 240) -> tuple:
    """`msinfer run` in a subprocess; returns (results by id, summary)."""
    out = job_dir / "results" / f"{name}.jsonl"
    args = [MSINFER, "run", str(job_dir / "job.yaml"), "--overwrite", "--no-progress",
            "--set", f"output.path={out}", *[a for s in sets for a in ("--set", s)]]
    if address:
        args += ["--set", f"ray.address={address}"]
    r = subprocess.run(args, cwd=job_dir, capture_output=True, text=True, timeout=timeout,
                       env=clean_env(MSINFER_CACHE=cache_with_kernels(job_dir / f"cache-{name}"),
                                     RAY_AUTH_MODE="token"))
    assert r.returncode == 0, f"msinfer run failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return read_results(out), json.loads(Path(f"{out}.summary.json").read_text())


def read_results(path: Path) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ids = [r["id"] for r in lines]
    assert len(ids) == len(set(ids)), f"records written more than once: {sorted(ids)}"
    return {r["id"]: r for r in lines}


@pytest.fixture(scope="module")
def dp2_run(two_nodes, job_dir):
    return run_job(job_dir, "dp2", "parallel.data_parallel=2", "parallel.tensor_parallel=1",
                   "parallel.placement=pack", "ray.num_cpus_per_worker=1", address=two_nodes["address"])


# ---- data parallel over two nodes -----------------------------------------------------------------

def test_dp2_puts_one_replica_on_each_node_and_writes_every_record_once(two_nodes, dp2_run):
    results, summary = dp2_run
    assert sorted(results) == sorted(f"r{i}" for i in range(N_RECORDS))
    assert all(r.get("finish_reason") == "length" and len(r["output_token_ids"]) == N_NEW for r in results.values()), \
        list(results.values())[0]
    assert summary["records_done"] == N_RECORDS and summary["records_failed"] == 0
    ranks = summary["replicas"]
    assert sorted(r["replica"] for r in ranks) == [0, 1]
    assert {r["node_id"] for r in ranks} == set(two_nodes["node_ids"]), ranks
    assert all(r["node_ip"] and r["pid"] and r["device"] == "cpu" for r in ranks)


def test_tp2_spread_spans_both_nodes_and_generates_what_tp1_generates(two_nodes, job_dir, dp2_run):
    tp1, _ = dp2_run
    results, summary = run_job(job_dir, "tp2", "parallel.data_parallel=1", "parallel.tensor_parallel=2",
                               "parallel.placement=spread", "ray.num_cpus_per_worker=1",
                               address=two_nodes["address"])
    ranks = sorted(summary["replicas"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["node_id"] for r in ranks} == set(two_nodes["node_ids"]), ranks
    # the group's rendezvous (rank 0's TCPStore) listens on rank 0's node, and both ranks were pointed at it
    assert [r["ms_rendezvous"].rsplit(":", 1)[0] for r in ranks] == [ranks[0]["node_ip"]] * 2
    assert {k: r["output_token_ids"] for k, r in results.items()} == {k: r["output_token_ids"] for k, r in tp1.items()}


N_LOST = 32
STEP_DELAY_S = 0.03      # 16 records of 32 tokens, two at a time: a replica's share lasts 8 s or more


def test_a_lost_node_s_replica_is_placed_again_and_every_record_comes_back_once_and_correct(
        two_nodes, job_dir, dp2_run, hf_greedy, tmp_path):
    """dp 2 over the two nodes; mid-job the node of replica 1 is removed (as a host lost: its
    raylet and workers gone at once) and another node joins. Replica 1 fails and is placed again
    where there is room, its records go to replica 0 meanwhile, and every record is written once
    with transformers' tokens. Runs after the other tests of the cluster: it changes its nodes.
    Every step takes STEP_DELAY_S more (MSINFER_FAULT_STEP_DELAY_S), so the node goes while both
    replicas still have records to run on any machine (a replica that finished its share first,
    with nothing dealt, is not missed: no restart)."""
    prompts = [[(13 * i + 7 * j) % 250 + 3 for j in range(4 + i)] for i in range(5)]
    n_new = 32
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"id": f"n{i:02d}", "prompt_token_ids": prompts[i % 5]}) + "\n" for i in range(N_LOST)))
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [MSINFER, "run", str(job_dir / "job.yaml"), "--no-progress", "--set", f"input.path={tmp_path / 'in.jsonl'}",
         "--set", f"output.path={out}", "--set", f"sampling.max_new_tokens={n_new}",
         "--set", "parallel.data_parallel=2", "--set", "ray.num_cpus_per_worker=1",
         "--set", f"ray.address={two_nodes['address']}", "--set", "scheduler.max_batch_size=2"],
        cwd=job_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=clean_env(MSINFER_CACHE=cache_with_kernels(tmp_path / "cache"), RAY_AUTH_MODE="token",
                      MSINFER_FAULT_STEP_DELAY_S=str(STEP_DELAY_S)))
    status = Path(f"{out}.status.json")
    try:
        end = time.time() + 180
        while time.time() < end:                 # both replicas running, a first result written
            st = json.loads(status.read_text()) if status.exists() else {}
            if (st.get("state") == "running" and len(st.get("workers", [])) == 2 and out.exists()
                    and out.read_text().count("\n") >= 1):
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        else:
            pytest.fail("the job did not get both replicas running and a first result")
        head = two_nodes["node_ids"][0]
        lost = next(w for w in st["workers"] if w["node_id"] != head)
        nodes = two_nodes["command"]("remove")
        assert lost["node_id"] not in nodes
        joined = set(two_nodes["command"]("add")) - set(nodes)
        assert len(joined) == 1
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-8000:]
    results = read_results(out)
    assert sorted(results) == [f"n{i:02d}" for i in range(N_LOST)]
    for i in range(N_LOST):
        assert results[f"n{i:02d}"]["output_token_ids"] == hf_greedy(CKPT, prompts[i % 5], n_new)[0], i
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    assert summary["replica_restarts"] == 1, summary["restart_reasons"]
    assert re.fullmatch(rf"replica {lost['replica']} failed \(.*\)", summary["restart_reasons"][0])
    assert {r["node_id"] for r in summary["replicas"] if r["replica"] == lost["replica"]} == joined   # placed there


# ---- Ascend: one card per worker from Ray's NPU resource ------------------------------------------

@pytest.mark.parametrize("env, rank, assigned, expected", [
    ({}, 0, None, DeviceChoice("CPU", None)),                                          # auto, no Ascend
    ({"ASCEND_RT_VISIBLE_DEVICES": "5"}, 3, None, DeviceChoice("Ascend", 0)),          # Ray set this card
    ({"ASCEND_RT_VISIBLE_DEVICES": "5"}, 0, ["5"], DeviceChoice("Ascend", 0)),
    ({"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}, 0, ["6"], DeviceChoice("Ascend", 2)),   # NOSET: Ray's card
    ({"ASCEND_RT_VISIBLE_DEVICES": "4, 5,6,7"}, 0, ["5"], DeviceChoice("Ascend", 1)),
    ({"ASCEND_HOME_PATH": "/usr/local/Ascend"}, 1, ["3"], DeviceChoice("Ascend", 3)),  # NOSET, no list
    ({"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}, 2, None, DeviceChoice("Ascend", 2)),    # no Ray: by rank
    ({"ASCEND_RT_VISIBLE_DEVICES": "0,1"}, 3, [], DeviceChoice("Ascend", 1)),
    ({"ASCEND_HOME_PATH": "/usr/local/Ascend", "DEVICE_ID": "7"}, 0, None, DeviceChoice("Ascend", 7)),
    ({"ASCEND_HOME_PATH": "/usr/local/Ascend"}, 2, None, DeviceChoice("Ascend", 2)),
])
def test_select_device_on_auto(env, rank, assigned, expected):
    assert select_device("auto", env, rank=rank, assigned=assigned) == expected


def test_select_device_explicit_choices():
    assert select_device("cpu", {"ASCEND_RT_VISIBLE_DEVICES": "3"}) == DeviceChoice("CPU", None)
    assert select_device("ascend", {}, rank=1) == DeviceChoice("Ascend", 1)
    with pytest.raises(ValueError, match="parallel.device 'gpu'"):
        select_device("gpu", {})


def test_two_replicas_on_one_node_get_different_cards_with_noset():
    """RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES: every worker sees all cards; rank 0 of
    replica 0 and rank 0 of replica 1 must still take the two different cards Ray gave them."""
    env = {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert select_device("ascend", env, rank=0, assigned=["0"]) != select_device("ascend", env, rank=0,
                                                                                   assigned=["4"])


# ---- joining a cluster: a wrong address fails in seconds ------------------------------------------

@pytest.mark.parametrize("address, message", [
    ("10.0.0.1", "expected host:port"),
    ("10.0.0.1:0", "expected host:port"),
    ("127.0.0.1:{closed}", "no Ray head answers there"),
])
def test_joining_a_cluster_where_no_head_listens_fails_fast(address, message):
    from msinfer.launcher.replica import LaunchError, check_reachable
    with pytest.raises(LaunchError, match=message):
        check_reachable(address.format(closed=free_port()), timeout_s=2)
    check_reachable("auto")             # Ray's own lookup: nothing to probe


# ---- the example job specs ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["multinode.yaml", "ascend-qwen3-14b-tp8.yaml"])
def test_example_specs_are_valid(name):
    spec = load_spec(ROOT / "configs" / name)
    if name.startswith("ascend"):
        assert (spec.parallel.device, spec.parallel.tensor_parallel, spec.parallel.placement) == ("ascend", 8, "pack")


# ---- the scripts ----------------------------------------------------------------------------------

def run_script(*args, env=None, cwd=None, timeout=60):
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env or clean_env(), cwd=cwd)


@pytest.mark.parametrize("script", [NODE_SH, SLURM_SH])
def test_scripts_have_help(script):
    r = run_script(script, "--help")
    assert r.returncode == 0 and r.stdout.startswith("Usage:") and "JOB.yaml" in r.stdout


def slurm_env(tmp_path: Path, **extra) -> dict:
    return clean_env(SLURM_JOB_NODELIST=socket.gethostname(), SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1",
                     SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(tmp_path), **extra)


@pytest.mark.parametrize("script, args, env, message", [
    (NODE_SH, ["missing.yaml"], None, "job spec 'missing.yaml' not found"),
    (NODE_SH, ["--join", "nohost", "job.yaml"], None, "--join expects the head's HOST:PORT"),
    (NODE_SH, ["--join"], None, "--join needs a value"),
    (NODE_SH, ["--port", "0"], None, "--port must be between 1 and 65535"),
    (NODE_SH, ["--bogus"], None, "unknown option '--bogus'"),
    (SLURM_SH, [], "slurm", "no job spec given"),
    (SLURM_SH, ["missing.yaml"], "slurm", "job spec 'missing.yaml' not found"),
    (SLURM_SH, ["job.yaml"], None, "SLURM_JOB_NODELIST is not set"),
])
def test_scripts_fail_in_one_line_when_inputs_are_missing(script, args, env, message, tmp_path):
    (tmp_path / "job.yaml").write_text("{}\n")
    r = run_script(script, *args, cwd=tmp_path, env=slurm_env(tmp_path) if env else clean_env())
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and message in r.stderr and "error:" in r.stderr, r.stderr


@pytest.mark.parametrize("restarts", ["0", "1"])
def test_a_requeued_slurm_job_resumes_instead_of_starting_over(restarts, tmp_path):
    """Slurm runs a requeued job's script again with the same options, SLURM_RESTART_COUNT set: the
    script drops --overwrite then, so the run resumes. srun and scontrol here record what they
    are asked (the real ones: test_an_sbatch_array_of_two_...)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/srun.log\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\nhostname\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (tmp_path / "job.yaml").write_text("{}\n")
    env = slurm_env(tmp_path, PATH=f"{bin_dir}:/usr/bin:/bin", MSINFER_NODE_SCRIPT=NODE_SH,
                    SLURM_RESTART_COUNT=restarts)
    r = run_script(SLURM_SH, "--head-ip", "10.0.0.1", "job.yaml", "--overwrite", "--set", "a=b",
                   cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    (head,) = (tmp_path / "srun.log").read_text().splitlines()
    assert head.endswith("job.yaml --set a=b" if restarts == "1" else "job.yaml --overwrite --set a=b"), head
    assert ("restart 1 of this job: --overwrite dropped, the run resumes" in r.stderr) == (restarts == "1")


def test_node_script_needs_ray(tmp_path):
    lone = tmp_path / "msinfer-node.sh"                 # no .venv beside it, no ray on PATH
    shutil.copy(NODE_SH, lone)
    r = run_script(lone, "--head", env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 2 and "'ray' not found on PATH" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=msinfer-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
# sbatch --wait polls the job every 2 s, then 8, then 32, unless MinJobAge / 3 caps the sleep
# below 8: a 20-second job would otherwise be seen done after 42 s
MinJobAge=6
NodeName={host} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def apt_install(*packages: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:                   # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=900)
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, f"apt-get install {' '.join(packages)} failed:\n{r.stderr[-2000:]}"


@pytest.fixture(scope="module")
def slurm():
    """A real one-node Slurm on this machine: Debian's slurm-wlm and munge (installed with apt-get
    when missing), munged, and a slurmctld and slurmd of this test's own (a private config, state
    folder and ports), stopped afterwards. Needs root, as installing and the daemons do."""
    import psutil
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("a real Slurm is installed with apt-get and run as root; this is not a root Debian machine")
    if not all(shutil.which(x) for x in ("sbatch", "slurmctld", "slurmd", "munged")):
        apt_install("slurm-wlm", "munge")
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode != 0:
        for d in ("/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge"):
            os.makedirs(d, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, capture_output=True)
    d = short_tmp("slurm")
    os.makedirs(f"{d}/state")
    os.makedirs(f"{d}/spool")
    host = socket.gethostname().split(".")[0]
    conf = f"{d}/slurm.conf"
    with open(conf, "w") as f:
        f.write(SLURM_CONF.format(host=host, dir=d, ctld_port=free_port(), d_port=free_port(), cpus=os.cpu_count(),
                                  mem_mb=int(psutil.virtual_memory().total / 2**20 * 0.8)))
    env = {**os.environ, "SLURM_CONF": conf}
    try:
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon], env=env, check=True, capture_output=True, timeout=60)
        wait = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True,
                                           timeout=30).stdout:
            assert time.monotonic() < wait, open(f"{d}/slurmctld.log").read()[-2000:]
            time.sleep(0.25)
        yield {"SLURM_CONF": conf}
    finally:
        for daemon in ("slurmd", "slurmctld"):
            try:
                os.kill(int(open(f"{d}/{daemon}.pid").read()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        shutil.rmtree(d, ignore_errors=True)


def test_an_sbatch_array_of_two_runs_the_slurm_script_on_each_shard_and_they_merge(slurm, job_dir, dp2_run, tmp_path):
    """`sbatch --array=0-1 --time=10 scripts/msinfer.slurm job.yaml --set input.shard=auto` on a real
    one-node Slurm: each task's srun step starts Ray, runs its shard to its last line and stops
    Ray; each run read the allocation's end from Slurm (its deadline); `msinfer merge` joins the
    two files into the tokens one job gives."""
    ray_tmp = short_tmp("mss")
    try:
        out = tmp_path / "slurm.jsonl"
        env = clean_env(PATH=f"{BIN}:/usr/bin:/bin:/usr/sbin:/sbin", TMPDIR=ray_tmp, MSINFER_NODE_SCRIPT=NODE_SH,
                        MSINFER_CACHE=cache_with_kernels(tmp_path / "cache"), **slurm)
        log = tmp_path / "slurm-%A_%a.out"
        sets = ["--set", f"output.path={out}", "--set", "ray.num_cpus_per_worker=1"]
        t0 = time.time()
        r = subprocess.run(["sbatch", "--wait", "--array=0-1", "--time=10", "--nodes=1", f"--chdir={tmp_path}",
                            f"--output={log}", "--export=ALL", SLURM_SH, "--port", str(free_port()),
                            str(job_dir / "job.yaml"), "--overwrite", "--no-progress", *sets,
                            "--set", "input.shard=auto"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
        logs = {p.name: p.read_text() for p in tmp_path.glob("slurm-*.out")}
        assert r.returncode == 0, r.stderr + "".join(logs.values())[-3000:]
        assert len(logs) == 2 and all("msinfer.slurm: done (exit status 0)" in text and "stopping the Ray node" in text
                                      for text in logs.values())
        head_ip = subprocess.run(["bash", NODE_SH, "--print-ip"], capture_output=True, text=True).stdout.strip()
        for k in (0, 1):
            summary = json.loads(Path(f"{tmp_path}/slurm.{k}-of-2.jsonl.summary.json").read_text())
            assert summary["spec"]["ray"]["address"].startswith(head_ip + ":")
            assert [r["node_ip"] for r in summary["replicas"]] == [head_ip]
            assert "the Slurm allocation's end" in summary["deadline"]["source"], summary["deadline"]
            end = datetime.fromisoformat(summary["deadline"]["at"]).timestamp()
            assert t0 + 9 * 60 < end < time.time() + 10 * 60 + 60, summary["deadline"]
        m = subprocess.run([MSINFER, "merge", str(job_dir / "job.yaml"), "--set", "input.shard=0/2", *sets],
                           env=env, capture_output=True, text=True, timeout=120)
        assert m.returncode == 0, m.stderr
        assert {k: r["output_token_ids"] for k, r in read_results(out).items()} == \
            {k: r["output_token_ids"] for k, r in dp2_run[0].items()}
        assert list(read_results(out)) == [f"r{i}" for i in range(N_RECORDS)]          # in input order
        assert not processes_under(ray_tmp), "Ray processes outlived the Slurm job"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


# ---- ray job submit: a job sent to a head that stays up ---------------------------------------------

def ray_default_packages(cache: Path) -> Path:
    """A folder with what `ray[default]` adds to msinfer's Ray (the dashboard, its job server and the
    `ray job` CLI: aiohttp, grpcio, opencensus, ...), installed with pip --target, once per Ray
    version, and put on PYTHONPATH only for the processes of the test that needs it: the rest of the
    suite keeps Ray as msinfer installs it."""
    import ray
    folder = cache / f"ray-default-{ray.__version__}"
    if (folder / ".complete").exists():
        return folder
    pip = [sys.executable, "-m", "pip"]
    report = cache / "ray-default-report.json"
    cache.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([*pip, "install", "--dry-run", "--quiet", "--report", str(report),
                        f"ray[default]=={ray.__version__}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"pip could not resolve ray[default]:\n{r.stderr[-2000:]}"
    wanted = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.loads(report.read_text())["install"]]
    shutil.rmtree(folder, ignore_errors=True)
    r = subprocess.run([*pip, "install", "--quiet", "--no-deps", "--target", str(folder), *wanted],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"pip could not install {wanted}:\n{r.stderr[-2000:]}"
    (folder / ".complete").touch()
    return folder


def test_ray_job_submit_runs_a_job_on_a_head_with_the_job_server(job_dir, dp2_run, tmp_path):
    """`msinfer-node.sh --head --dashboard` keeps a head with Ray's job server up, its raylet
    passing jemalloc on to the workers and starting none ahead of the actors; `ray job submit
    -- msinfer run job.yaml --set ray.address=auto` runs the job there (as docs/scale-out.md says)
    and writes the tokens of the cluster run; SIGTERM stops the node."""
    extra = ray_default_packages(Path.home() / ".cache" / "msinfer-tests")
    ray_tmp = short_tmp("msj")
    env = clean_env(PATH=f"{BIN}:/usr/bin:/bin", TMPDIR=ray_tmp, PYTHONPATH=str(extra), RAY_AUTH_MODE="token",
                    MSINFER_CACHE=cache_with_kernels(tmp_path / "cache"))
    for key in ("RAY_LD_PRELOAD_ON_WORKERS", "RAY_prestart_worker_first_driver"):    # (an embedded Ray's, if any)
        env.pop(key, None)
    port, dash = free_port(), free_port()
    node = subprocess.Popen(["bash", NODE_SH, "--head", "--port", str(port), "--dashboard", "--dashboard-port",
                             str(dash), "--num-cpus", "2", "--log", str(tmp_path / "ray.log")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        said = ""
        for line in node.stdout:                # the node script says when the head is up
            said += line
            if "jobs go to: " in line:
                break
        url = re.search(r"--address (http://\S+)", said)
        assert url, f"the head did not start:\n{said}{node.stdout.read() if node.poll() is not None else ''}"
        import psutil
        raylet = [p for p in map(psutil.Process, processes_under(ray_tmp)) if p.name() == "raylet"]
        set_by_script = {"RAY_LD_PRELOAD_ON_WORKERS": "1", "RAY_prestart_worker_first_driver": "0"}
        assert len(raylet) == 1 and set_by_script.items() <= raylet[0].environ().items()
        out = tmp_path / "submitted.jsonl"
        r = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", url.group(1), "--", MSINFER, "run",
                            str(job_dir / "job.yaml"), "--no-progress", "--set", "ray.address=auto",
                            "--set", f"output.path={out}"], capture_output=True, text=True, env=env, timeout=300,
                           cwd=tmp_path)
        assert r.returncode == 0 and "succeeded" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
        results = read_results(out)
        assert {k: r["output_token_ids"] for k, r in results.items()} == \
            {k: r["output_token_ids"] for k, r in dp2_run[0].items()}
        summary = json.loads(Path(f"{out}.summary.json").read_text())
        assert summary["spec"]["ray"]["address"] == "auto" and summary["records_done"] == N_RECORDS
    finally:
        node.terminate()                        # the script stops its node (all at once would take longer)
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        gone = not processes_under(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert gone, "Ray processes outlived the node script"


def test_sigterm_to_the_node_script_drains_its_job_at_once_and_exits_with_the_job_s_code(job_dir, tmp_path):
    """`msinfer-node.sh JOB.yaml` passes SIGTERM on to its job, which drains (exit 75) and stops
    the node. bash held the signal until the whole job had run, then exited 143."""
    ray_tmp = short_tmp("msd")
    env = clean_env(PATH=f"{BIN}:/usr/bin:/bin", TMPDIR=ray_tmp, MSINFER_CACHE=cache_with_kernels(tmp_path / "cache"))
    out = tmp_path / "drained.jsonl"
    node = subprocess.Popen(["bash", NODE_SH, "--port", str(free_port()), "--node-ip", "127.0.0.1", "--num-cpus", "2",
                             "--log", str(tmp_path / "ray.log"), str(job_dir / "job.yaml"), "--no-progress",
                             "--set", f"output.path={out}", "--set", "sampling.max_new_tokens=100",
                             "--set", "scheduler.max_batch_size=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=job_dir,
                            start_new_session=True)
    try:
        wait_for(lambda: out.is_file() and out.read_text().count("\n") >= 1, 240, "the job's first result", node)
        node.send_signal(signal.SIGTERM)
        _, err = node.communicate(timeout=120)
        status = json.loads(Path(f"{out}.status.json").read_text())
        assert node.returncode == 75 and status["state"] == "drained", err[-3000:]
        assert len(read_results(out)) < N_RECORDS and "msinfer: drained (SIGTERM received" in err
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        gone = not processes_under(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert gone, "Ray processes outlived the node script"


# ---- msinfer simulate: the job on stand-in workers ----------------------------------------------

def test_simulate_runs_the_job_on_stand_ins_writes_every_record_once_and_resumes(checkpoint, tmp_path, ray_local):
    """dp 2 x tp 2 of stand-ins that take 5 ms a step and load no weights: every record gets its
    max_new_tokens (the stand-ins never sample eos), each exactly once; a second run resumes and
    skips them all; the summary measures throughput against the stand-ins' ceiling."""
    import json
    from msinfer.launcher.job import run_job
    from msinfer.launcher.simulate import StandIn
    from msinfer.launcher.spec import JobSpec
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [5 + i, 6, 7]}) + "\n"
                                               for i in range(40)))
    spec = JobSpec.model_validate({
        "model": {"path": str(checkpoint("llama_gqa_tied")), "max_model_len": 64},
        "parallel": {"tensor_parallel": 2, "data_parallel": 2},
        "input": {"path": str(tmp_path / "in.jsonl")}, "output": {"path": str(tmp_path / "out.jsonl")},
        "sampling": {"max_new_tokens": 8}, "scheduler": {"max_batch_size": 8, "max_batched_tokens": 64}})
    summary = run_job(spec, progress=False, simulate=StandIn(step_ms=5.0))
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in results) == sorted(f"r{i}" for i in range(40))
    assert all(r["completion_tokens"] == 8 and r["finish_reason"] == "length" for r in results)
    sim = summary["simulate"]
    assert sim["workers"] == 4 and sim["ceiling_tokens_per_s"] == 2 * 8 * 1000 / 5.0
    assert 0 < sim["of_ceiling"] <= 1.0 and sim["driver_cpu_us_per_token"] > 0
    assert 0 < sim["driver_loop_cpu_s"] <= sim["driver_cpu_s"]          # the loop's share of the driver
    assert {r["device"] for r in summary["replicas"]} == {"stand-in"}
    again = run_job(spec, progress=False, simulate=StandIn(step_ms=5.0))
    assert again["records_skipped"] == 40 and again["nothing_to_do"]        # resumed: nothing started
