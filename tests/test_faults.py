"""Issue 6: a killed worker, a killed controller or a broken file loses nothing.

The fault tests run `msinfer run` in a subprocess and kill processes of the running job: a
worker (its pid read from `<output>.status.json`), or msinfer itself. The bad-input tests each
break one thing, run the job over a results file that holds earlier results, and check the
message (it names the key, file or tensor), exit code 2, that those results are untouched and
that Ray never started.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from msinfer.launcher.errors import UserError
from msinfer.launcher.job import plan_job
from msinfer.launcher.replica import wait_gone
from msinfer.launcher.spec import load_spec
from msinfer.launcher.writer import ResultWriter
from tests.test_cli import Job, assert_ray_never_started, line_count, no_ray, records, said, wait_for
from tests.test_writer import holds


def running(job: Job, workers: int) -> dict | None:
    s = job.status()
    return s if s and s["state"] == "running" and len(s["workers"]) == workers else None


def stop(proc: subprocess.Popen) -> None:
    """Ends a job the test started (its own process group), if a failed assertion left it running."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def listener(port: int) -> psutil._common.sconn | None:
    return next((c for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port), None)


def whole_lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data.endswith(b"\n"), "the results file ends in a partial line"
    return [json.loads(line) for line in data.splitlines()]


# ---- a killed worker ----------------------------------------------------------------------------

def test_killed_worker_restarts_its_replica_and_requeues_its_records(cli, model, hf_greedy, tmp_path):
    """pp 2 x tp 2: SIGKILL of stage 1's rank 1 mid-job. The whole replica goes (the other ranks
    and with them both stages' rendezvous, each rank 0's TCPStore), a new one starts with
    rendezvous on fresh ports, listening on the node's address, and the lost records are computed
    again: every record exactly once with transformers' tokens, the job exits 0. The prompts share
    a cached block (prefix caching), and records 4-7 repeat the prompts of 0-3."""
    n = 8
    shared = [(7 * j) % 200 + 3 for j in range(16)]                # one full block of 16 tokens
    lines = [{"id": f"r{i:02d}", "prompt_token_ids": shared + [20 + i % 4] * (1 + i % 4)} for i in range(n)]
    job = Job(tmp_path, model, lines, parallel={"tensor_parallel": 2, "pipeline_parallel": 2},
              sampling={"max_new_tokens": 24}, fault={"max_replica_restarts": 2})
    proc = cli.start("run", job.spec_path, "--no-progress")
    try:
        before = wait_for(lambda: running(job, 4), 180, "four running workers", proc)["workers"]
        old_pids = [w["pid"] for w in before]
        node_ip = before[0]["node_ip"]
        ports = {w["stage"]: w["ms_rendezvous"] for w in before}
        assert len(set(ports.values())) == 2, ports                     # a communication group per stage
        listeners = []
        for stage, address in ports.items():
            host, port = address.rsplit(":", 1)
            assert host == node_ip and host not in ("0.0.0.0", "::", "")
            sock = listener(int(port))
            assert sock is not None and sock.laddr.ip == node_ip, f"the rendezvous listens on {sock}"
            assert sock.pid == next(w["pid"] for w in before if w["stage"] == stage and w["rank"] == 0)
            listeners.append(sock.pid)
        wait_for(lambda: line_count(job.output) >= 1, 120, "a first result", proc)

        victim = next(w for w in before if w["stage"] == 1 and w["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        after = wait_for(lambda: (s := running(job, 4)) and s["replica_restarts"] == 1
                         and not {w["pid"] for w in s["workers"]} & set(old_pids) and s, 180,
                         "the restarted replica", proc)["workers"]
        assert wait_gone([*old_pids, *listeners], 30), "the failed replica's processes outlived it"
        assert not {w["ms_rendezvous"] for w in after} & set(ports.values())
        out, err = proc.communicate(timeout=180)
    finally:
        stop(proc)
    assert proc.returncode == 0, err
    assert sorted(job.ids()) == [r["id"] for r in lines]
    results = {r["id"]: r for r in job.results()}
    assert all(r["error"] is None and r["completion_tokens"] == 24 for r in results.values())
    for line in lines:
        assert results[line["id"]]["output_token_ids"] == hf_greedy("llama_gqa_tied", line["prompt_token_ids"], 24)[0]
    summary = job.summary()
    # one restart for the kill; a second only where the new group's MindSpore store failed to start
    # (seen once with the other test process loading both cores), which the job restarts too
    reasons = summary["restart_reasons"]
    assert summary["records_done"] == n
    assert summary["replica_restarts"] == len(reasons)
    assert len(reasons) == 1 or (len(reasons) == 2 and "Failed to initialize the master node" in reasons[1]), reasons
    assert summary["steps"]["cached_prompt_tokens"] >= 16
    assert re.fullmatch(rf"replica 0 failed \(a worker process died: rank \d \(pid {victim['pid']} on {node_ip}\)\)",
                        reasons[0]), reasons      # SIGKILL: no log line


# ---- a killed controller ------------------------------------------------------------------------

def test_killed_controller_leaves_whole_lines_and_the_next_run_resumes(cli, model, tmp_path):
    n = 16
    job = Job(tmp_path, model, records(n), sampling={"max_new_tokens": 40})
    proc = cli.start("run", job.spec_path, "--no-progress")
    try:
        workers = [w["pid"] for w in wait_for(lambda: running(job, 1), 180, "a running worker", proc)["workers"]]
        wait_for(lambda: line_count(job.output) >= 3, 120, "three results", proc)
        # Ray's GCS and raylet die with their parent (PR_SET_PDEATHSIG) and the workers with the
        # raylet; Ray's dashboard and runtime-env agents linger idle until their GCS reconnect
        # timeout (60 s) and are not waited for here
        ray_core = [c.pid for c in psutil.Process(proc.pid).children() if c.name() in ("gcs_server", "raylet")]
        proc.kill()                                           # SIGKILL: no cleanup of any kind
        proc.wait(30)
    finally:
        stop(proc)
    kept = whole_lines(job.output)
    assert 3 <= len(kept) < n and len({r["id"] for r in kept}) == len(kept)
    assert len(ray_core) == 2 and wait_gone(ray_core + workers, 30), "Ray outlived the killed controller"

    p = cli.run("run", job.spec_path, "--no-progress")
    assert p.returncode == 0, p.stderr
    assert whole_lines(job.output)[:len(kept)] == kept
    assert sorted(job.ids()) == [r["id"] for r in records(n)]
    summary = job.summary()
    assert summary["records_skipped"] == len(kept) and summary["records_done"] == n - len(kept)


def test_wedged_step_fails_its_replica_and_past_the_restart_limit_the_job_stops(cli, model, tmp_path):
    """A stopped worker (SIGSTOP) is a wedged step: after fault.step_timeout_s it is a failure of
    its replica. With fault.max_replica_restarts: 0 that failure stops the job: exit 3, a message,
    every finished record kept whole for the next run to resume after. (Rank 0 of a replica of
    two ranks, whose engine runs in the driver's process: a replica of one rank runs its engine
    in that rank's process, which SIGSTOP stops too, and the driver then finds it unanswering
    after step_timeout_s + 60 s.)"""
    n = 16
    job = Job(tmp_path, model, records(n), sampling={"max_new_tokens": 40}, parallel={"tensor_parallel": 2},
              fault={"max_replica_restarts": 0, "step_timeout_s": 6}, scheduler={"decode_steps": 2})
    proc = cli.start("run", job.spec_path, "--no-progress")
    stopped = None
    try:
        worker = wait_for(lambda: running(job, 2), 180, "running workers", proc)["workers"][0]["pid"]
        wait_for(lambda: line_count(job.output) >= 1, 120, "a first result", proc)
        os.kill(worker, signal.SIGSTOP)
        stopped = worker
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=120)
        waited = time.monotonic() - t0
    finally:
        stop(proc)
        if stopped is not None and psutil.pid_exists(stopped):   # a stopped process ignores its raylet's end
            os.kill(stopped, signal.SIGKILL)
    assert proc.returncode == 3, err
    assert waited >= 5, f"the job stopped {waited:.1f}s after the worker did, before the step timeout"
    msg = said(err)
    assert "Traceback" not in err
    # (greedy decode steps go 2 to a call here: a chain's wedged call waits 2 x step_timeout_s)
    assert re.search(r"replica 0 failed \(TimeoutError: a step ran longer than fault\.step_timeout_s=6s( \(a chain "
                     r"of 2 decode steps, scheduler\.decode_steps, ran longer than 2 times it\))?\); restarting it "
                     r"would be restart 1, more than fault\.max_replica_restarts=0", msg), msg
    assert "Every finished record is in the results file: run the same job again to resume" in msg
    kept = whole_lines(job.output)
    assert 1 <= len(kept) < n and len({r["id"] for r in kept}) == len(kept)
    assert all(r["error"] is None and r["completion_tokens"] == 40 for r in kept)
    assert job.status()["state"] == "failed" and job.status()["replica_restarts"] == 0
    summary = job.summary()         # the failed run's figures, its stop's reason beside them
    assert summary["stopped"]["state"] == "failed" and "replica 0 failed (TimeoutError" in summary["stopped"]["why"]
    assert summary["records_done"] == len(kept) and summary["replica_restarts"] == 0
    assert json.loads(out.splitlines()[-1])["records_done"] == len(kept)        # its line on stdout
    with ResultWriter(job.output) as w:            # what the next run skips
        assert holds(w.done_ids, {r["id"] for r in kept}) and not w.cut_partial_line


@pytest.mark.unit
@pytest.mark.parametrize("log, want", [
    (":actor_name:WorkerWithEngine\n*** SIGFPE received at time=1795977046 on cpu 1 ***\n"
     "PC: @     0x7fecc45cee46  (unknown)  PagedAttention\n    @     0x7feed025a050       3904  (unknown)\n"
     "Fatal Python error: Floating point exception\n\nCurrent thread 0x00007fb0f67fc6c0 (most recent call first):\n"
     "  <no Python frame>\n\nThread 0x00007fb1 (most recent call first):\n"
     '  File "/x/worker/runner.py", line 360 in _call\n', "SIGFPE in PagedAttention"),
    ("*** SIGABRT received at time=1 on cpu 0 ***\nPC: @     0x7fd4bcca8eec  (unknown)  (unknown)\n"
     "Fatal Python error: Aborted\n\nStack (most recent call first):\n"
     '  File "/x/worker/actor.py", line 189 in step\n  File "/y/ray/worker.py", line 7 in main\n',
     "SIGABRT, Python at actor.py:189 in step"),
    ("Fatal Python error: Segmentation fault\n\nCurrent thread 0x01 (most recent call first):\n"
     '  File "/x/loader.py", line 12 in load\n',
     "Fatal Python error: Segmentation fault, Python at loader.py:12 in load"),
    (":actor_name:Worker\nINFO a line\n", None),
])
def test_a_dead_workers_log_tells_the_signal_and_where_it_was(log, want):
    """launcher.worker_logs.crash_note reads a worker's Ray log (its stderr) as Ray's failure handler
    and Python's faulthandler leave it: the signal, the native function it came in, and the
    crashing thread's innermost Python frame (not another thread's)."""
    from msinfer.launcher.worker_logs import crash_note
    assert crash_note(log) == want


def test_a_rank_killed_without_a_word_is_named_without_waiting_for_the_live_ranks(ray_local):
    """Replica.death asks each rank's node how the rank ended, giving a process that is still
    exiting up to wait_s. Once a rank is found gone without a log line (SIGKILL, the OOM killer),
    the ranks still alive, which the replica's shutdown kills next, are not waited for."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace
    from msinfer.launcher.replica import Replica
    ray = ray_local
    context = ray.get_runtime_context()
    node = {"node_id": context.get_node_id(), "node_ip": ray.util.get_node_ip_address()}
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        t0 = time.monotonic()
        found = Replica.death(SimpleNamespace(ranks=[{"pid": alive.pid, **node}, {"pid": gone.pid, **node}]),
                              wait_s=20)
        took = time.monotonic() - t0
    finally:
        alive.kill()
        alive.wait()
    assert found == (f"rank 1 (pid {gone.pid} on {node['node_ip']})", None)
    assert took < 10, f"waited {took:.1f} s for a live rank"


# ---- a poison record ----------------------------------------------------------------------------

def test_a_poison_record_is_quarantined_and_every_other_record_gets_its_tokens(cli, model, hf_greedy, tmp_path):
    """MSINFER_FAULT_POISON_TOKEN: a worker whose step input holds the token aborts at once, as a
    kernel crash takes a process down; record r03's prompt holds it. The first failure takes down
    the batch r03 ran in; its records run again one suspect at a time, and the second failure
    names r03 alone (or, where other records still ran beside it then, a third failure with r03
    run alone does): its result is a "quarantined" error line, every other record gets
    transformers' tokens, and the job exits 0, its restarts not charged to
    fault.max_replica_restarts (1). Each failure's reason names the signal and the Python frame
    it came in, from the worker's log. At tp 1: a group's failure and restart is the
    killed-worker test's."""
    n, new = 8, 8
    lines = [{"id": f"r{i:02d}", "prompt_token_ids": [(7 * i + 3 * j) % 200 + 3 for j in range(5 + i)]}
             for i in range(n)]
    want = {line["id"]: hf_greedy("llama_gqa_tied", line["prompt_token_ids"], new)[0] for line in lines}
    seen = {t for line in lines for t in line["prompt_token_ids"]} | {t for w in want.values() for t in w}
    poison = max(set(range(256)) - seen)          # in no other prompt, and generated by no record
    lines[3]["prompt_token_ids"][2] = poison
    job = Job(tmp_path, model, lines, sampling={"max_new_tokens": new}, fault={"max_replica_restarts": 1})
    p = cli.run("run", job.spec_path, "--no-progress", env={"MSINFER_FAULT_POISON_TOKEN": str(poison)}, timeout=400)
    assert p.returncode == 0, p.stderr
    results = {r["id"]: r for r in job.results()}
    assert sorted(job.ids()) == sorted(results) == sorted(want)
    error = results.pop("r03")["error"]
    said = re.search(r"was running when a replica failed, (\d+) times", error["message"])
    assert error["type"] == "quarantined" and said is not None, error
    # 2 where r03 ran alone on probation; 3 where its probation step had records not yet suspected
    # in it (the others still running on a loaded machine), after which it runs alone first
    failures = int(said[1])
    assert failures in (2, 3), error
    for rid, r in results.items():
        assert r["error"] is None and r["output_token_ids"] == want[rid], rid
    summary = job.summary()
    assert summary["replica_restarts"] == failures and summary["records_quarantined"] == 1
    assert summary["records_failed"] == 1 and len(summary["restart_reasons"]) == failures
    for why in summary["restart_reasons"]:          # the signal, from the worker's log, and where that is
        assert re.fullmatch(r"replica 0 failed \(a worker process died: rank 0 \(pid \d+ on [\d.]+\): SIGABRT, Python at "
                            r"actor\.py:\d+ in step; its log: /\S+/worker-\S+\.err\)", why), why



def test_a_crash_that_takes_down_every_record_stops_the_job_without_their_error_lines(cli, model, tmp_path):
    """Every record holds the poison token: each crash is quarantined on the records it ran
    (fault.max_record_failures 1), and as every record then failed alike, for the same crash in
    the same place, that is no record's fault: the job stops, naming the crash, and writes no
    error line, so that a run after the fix computes every record."""
    lines = [{"id": f"r{i}", "prompt_token_ids": [11 + i, 12, 13, 250]} for i in range(2)]
    job = Job(tmp_path, model, lines, fault={"max_record_failures": 1})
    p = cli.run("run", job.spec_path, "--no-progress", env={"MSINFER_FAULT_POISON_TOKEN": "250"}, timeout=300)
    assert p.returncode == 2, p.stderr
    assert re.search(r"all 2 records failed alike \(record 'r\d' was the first\): a record was running when a "
                     r"replica failed, 1 times \(a worker process died: SIGABRT, Python at actor\.py:\d+ in step\)",
                     said(p)), said(p)
    assert not job.output.exists() or job.results() == []


# ---- bad input: a clear message, nothing lost, nothing started ---------------------------------

def fails_before_ray(cli, job: Job, *args, prefix: tuple = ()) -> str:
    """Runs the job over earlier results; returns the error message (on one line)."""
    prior = job.write_prior_results() if not job.output.exists() else job.output.read_bytes()
    env = no_ray()
    p = cli.run("run", job.spec_path, "--no-progress", *args, env=env, prefix=prefix)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith("msinfer: error: ") and p.stdout == ""
    assert job.output.read_bytes() == prior
    assert job.status() is None
    assert_ray_never_started(env)
    return said(p)


def without_root_override() -> tuple:
    """A command prefix under which file permissions apply (root reads and writes anything)."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions cannot be made to apply")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search")


def broken_copy(model: Path, folder: Path) -> Path:
    out = folder / "broken-model"
    shutil.copytree(model, out)
    return out


def test_malformed_yaml(cli, model, tmp_path):
    job = Job(tmp_path, model, records(1))
    job.write_spec(f"model:\n  path: {model}\n  dtype: [float32\ninput:\n  path: in.jsonl\n")
    msg = fails_before_ray(cli, job)
    assert f"{job.spec_path}:4:" in msg and "malformed YAML" in msg


def test_wrong_types(cli, model, tmp_path):
    job = Job(tmp_path, model, records(1), sampling={"max_new_tokens": "ten", "temperature": "hot"})
    msg = fails_before_ray(cli, job)
    assert "2 problems in the job spec" in msg
    assert "sampling.max_new_tokens: expected an integer, got 'ten'" in msg
    assert "sampling.temperature: expected a number, got 'hot'" in msg
    line = job.spec_path.read_text().splitlines().index("  max_new_tokens: ten") + 1
    assert f"{job.spec_path}:{line}: sampling.max_new_tokens" in msg


def test_unknown_keys(cli, model, tmp_path):
    job = Job(tmp_path, model, records(1), sampling={"max_tokens": 4}, faults={"max_replica_restarts": 1})
    msg = fails_before_ray(cli, job)
    assert "sampling.max_tokens: unknown key; did you mean 'max_new_tokens'?" in msg
    assert "faults: unknown key; did you mean 'fault'?" in msg


def test_missing_model_folder(cli, model, tmp_path):
    job = Job(tmp_path, tmp_path / "no-such-model", records(1))
    msg = fails_before_ray(cli, job)
    assert f"model.path {tmp_path / 'no-such-model'} does not exist" in msg


def test_model_path_is_a_file(cli, model, tmp_path):
    job = Job(tmp_path, model / "config.json", records(1))
    assert f"model.path {model / 'config.json'} is a file, not a folder" in fails_before_ray(cli, job)


def test_unreadable_model_folder(cli, model, tmp_path):
    broken = broken_copy(model, tmp_path)
    job = Job(tmp_path, broken, records(1))
    broken.chmod(0o000)
    try:
        msg = fails_before_ray(cli, job, prefix=without_root_override())
    finally:
        broken.chmod(0o755)
    assert f"model folder {broken} cannot be read: Permission denied" in msg


def test_truncated_safetensors_names_the_file(cli, model, tmp_path):
    broken = broken_copy(model, tmp_path)
    weights = broken / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    msg = fails_before_ray(cli, Job(tmp_path, broken, records(1)))
    assert f"{weights}: not a readable safetensors file" in msg and "truncated or corrupted" in msg


def test_corrupted_safetensors_header_names_the_file(cli, model, tmp_path):
    broken = broken_copy(model, tmp_path)
    weights = broken / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(8)
        f.write(b"}not json{")
    msg = fails_before_ray(cli, Job(tmp_path, broken, records(1)))
    assert f"{weights}: not a readable safetensors file" in msg


def test_config_missing_a_required_key(cli, model, tmp_path):
    broken = broken_copy(model, tmp_path)
    config = json.loads((broken / "config.json").read_text())
    del config["num_hidden_layers"]
    (broken / "config.json").write_text(json.dumps(config))
    msg = fails_before_ray(cli, Job(tmp_path, broken, records(1)))
    assert f"{broken / 'config.json'}: required key 'num_hidden_layers' is missing" in msg


def test_tokenizer_that_does_not_load(cli, model, tmp_path):
    broken = broken_copy(model, tmp_path)
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {')
    msg = fails_before_ray(cli, Job(tmp_path, broken, records(1)))
    assert f"the tokenizer files in {broken} do not load" in msg


def test_missing_weight_tensor_is_named(cli, model, tmp_path):
    from safetensors.numpy import load_file, save_file
    broken = broken_copy(model, tmp_path)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    msg = fails_before_ray(cli, Job(tmp_path, broken, records(1)))
    assert "weight tensor 'model.layers.1.mlp.up_proj.weight' is missing from the checkpoint" in msg


def test_weight_tensor_with_a_wrong_shape_is_named(cli, model, tmp_path):
    import numpy as np
    from safetensors.numpy import load_file, save_file
    broken = broken_copy(model, tmp_path)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    save_file(tensors, broken / "model.safetensors")
    msg = fails_before_ray(cli, Job(tmp_path, broken, records(1)))
    assert ("model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape [16, 64], "
            "the config implies [32, 64]") in msg


def test_missing_input_file(cli, model, tmp_path):
    job = Job(tmp_path, model, records(1))
    job.input.unlink()
    assert f"input file {job.input} does not exist" in fails_before_ray(cli, job)


def test_unreadable_input_file(cli, model, tmp_path):
    job = Job(tmp_path, model, records(1))
    job.input.chmod(0o000)
    msg = fails_before_ray(cli, job, prefix=without_root_override())
    assert f"input file {job.input} cannot be read: Permission denied" in msg


def test_output_folder_that_cannot_be_written_is_found_before_workers_start(cli, model, tmp_path):
    job = Job(tmp_path, model, records(1))
    job.write_prior_results()
    job.output.parent.chmod(0o555)
    try:
        msg = fails_before_ray(cli, job, prefix=without_root_override())
    finally:
        job.output.parent.chmod(0o755)
    assert f"output folder {job.output.parent} is not writable (Permission denied)" in msg


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (needs root and mount); skipped where it cannot be mounted."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(folder: Path, leave_bytes: int) -> None:
    """Fills the file system of `folder`, then frees `leave_bytes` again."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(filler, filler.stat().st_size - leave_bytes)


def test_disk_that_fills_up_mid_job_stops_it_keeping_what_was_written(cli, model, tmp_path, small_disk):
    n = 60
    job = Job(tmp_path, model, records(n), sampling={"max_new_tokens": 16},
              output={"path": str(small_disk / "results.jsonl"), "status_interval_s": 1000})
    job.output = small_disk / "results.jsonl"
    prior = job.write_prior_results()
    fill(small_disk, 3 * 4096)      # room for the lock file, the status file (and its replacement) and a page of results
    p = cli.run("run", job.spec_path, "--no-progress")
    assert p.returncode == 2, p.stderr
    msg = said(p)
    assert f"cannot write to results file {job.output}: No space left on device" in msg
    assert "results written so far are kept" in msg and "run the same job again to resume" in msg
    data = job.output.read_bytes()
    assert data.startswith(prior)
    kept = whole_lines(job.output)
    assert 2 < len(kept) < n + 2, "the disk should fill up in the middle of the job"
    assert all(r["error"] is None and r["completion_tokens"] == 16 for r in kept[2:])
    with ResultWriter(job.output) as w:            # the next run resumes after every kept line
        assert holds(w.done_ids, {r["id"] for r in kept}) and not w.cut_partial_line


# ---- security -----------------------------------------------------------------------------------

def test_pickle_weights_are_refused_unless_allowed(cli, model, tmp_path):
    import numpy as np
    import torch
    from safetensors.numpy import load_file
    from msinfer.worker.loader import open_weights
    pickled = broken_copy(model, tmp_path)
    tensors = load_file(pickled / "model.safetensors")
    (pickled / "model.safetensors").unlink()
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, pickled / "pytorch_model.bin")
    job = Job(tmp_path, pickled, records(1))
    msg = fails_before_ray(cli, job)
    assert f"{pickled}: holds only pickle weights (pytorch_model.bin), which can run code when loaded" in msg
    assert "unless model.allow_pickle: true" in msg

    plan = plan_job(load_spec(job.spec_path, ["model.allow_pickle=true"]))
    assert plan.checkpoint_bytes == (pickled / "pytorch_model.bin").stat().st_size
    with open_weights(pickled / "pytorch_model.bin") as f:   # what the workers read
        assert sorted(f.keys()) == sorted(tensors)
        for name, value in tensors.items():
            np.testing.assert_array_equal(f.get_slice(name), value)


def test_remote_code_does_not_run_without_trust_remote_code(cli, model, tmp_path):
    custom = broken_copy(model, tmp_path)
    marker = tmp_path / "REMOTE_CODE_RAN"
    (custom / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "CustomTokenizer", "auto_map": {"AutoTokenizer": ["custom.CustomTokenizer", None]}}))
    (custom / "custom.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                      f"from transformers import PreTrainedTokenizer as CustomTokenizer\n")
    job = Job(tmp_path, custom, records(1))
    msg = fails_before_ray(cli, job)
    assert f"the tokenizer files in {custom} do not load" in msg and "trust_remote_code" in msg
    assert not marker.exists()


def test_trust_remote_code_reaches_transformers(monkeypatch, tmp_path):
    import transformers
    from msinfer.launcher.tokenizer import load_tokenizer
    seen = []

    def from_pretrained(path, **kw):
        seen.append(kw)
        raise ValueError("stop here")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    (tmp_path / "tokenizer.json").write_text("{}")
    for trust in (False, True):
        with pytest.raises(UserError):
            load_tokenizer(tmp_path, trust_remote_code=trust)
    assert [kw["trust_remote_code"] for kw in seen] == [False, True]
    assert all(kw["local_files_only"] for kw in seen)


def test_ray_dashboard_is_off_unless_asked_for_and_then_on_localhost(monkeypatch):
    import ray
    from msinfer.launcher import replica
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    replica.init_ray(None, 2)
    replica.init_ray(None, 2, dashboard=True)
    assert calls[0]["include_dashboard"] is False
    assert calls[1]["include_dashboard"] is True and calls[1]["dashboard_host"] == "127.0.0.1"


def test_mindspore_scheduler_listens_on_the_node_address_not_every_interface(monkeypatch):
    import ray
    from msinfer.worker import actor
    from msinfer.worker.device import cluster_env
    started = []
    monkeypatch.setattr(actor, "start_scheduler_thread", lambda host, port, world: started.append((host, port)))
    host, port = actor.CommScheduler(2).start()
    assert started == [(host, port)]
    assert host == ray.util.get_node_ip_address() and host not in ("0.0.0.0", "::", "")
    env = cluster_env("MS_SCHED", host, port, 2)
    assert env["MS_SCHED_HOST"] == host and env["MS_SCHED_PORT"] == str(port)


def never_joins():
    """A stand-in worker whose rank 1 never returns from its communication init."""
    import sys
    from ray import cloudpickle
    from msinfer.launcher.simulate import StandInWorker

    class NeverJoins(StandInWorker):
        def join(self, engine_config, sched_host=None, sched_port=None):
            if self.tp.rank == 1:
                time.sleep(3600)
            return 0.0

    cloudpickle.register_pickle_by_value(sys.modules[__name__])     # the workers cannot import tests/
    return NeverJoins


def test_ctrl_c_while_replicas_start_ends_their_starts_before_the_command_stops_ray(model, ray_local, tmp_path):
    """Ctrl-C (or a signal) while the replicas start: the controller shuts them down, and each
    start still waiting on its ranks (here for a join that never ends, under a startup timeout of
    10 minutes) ends within a second or so, before the command shuts Ray down: a start thread
    that outlived Ray crashed the command, or had Ray start anew and waited on that for ever."""
    import threading
    from msinfer.launcher.controller import Controller, ControllerConfig
    from msinfer.launcher.engine import EngineSetup
    from msinfer.launcher.errors import LaunchError
    from msinfer.launcher.replica import ReplicaConfig
    from msinfer.sharding.config import EngineConfig
    setup = EngineSetup(load_spec(Job(tmp_path, model, records(1)).spec_path), None, None)
    c = Controller(ControllerConfig(EngineConfig(str(model)), ReplicaConfig(
        2, worker_cls=never_joins(), startup_timeout_s=600, cpus_per_worker=0.01, engine_setup=setup)))
    began = []

    def ctrl_c_once_the_ranks_run():
        wait_for(lambda: c.slots and len(c.slots[0].replica.ranks) == 2, 120, "the ranks' processes")
        began.append(time.monotonic())
        # to the main thread: a process's signal may land in any thread, and one that lands here
        # leaves the main thread asleep in its wait (Python runs handlers there, woken by EINTR)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    # (a process started in the background by a shell without job control ignores SIGINT: Python
    # then keeps SIG_IGN, and the signal would never stop the start)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=ctrl_c_once_the_ranks_run, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            c.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert began and time.monotonic() - began[0] < 15
    assert c.starts[0].done() and isinstance(c.starts[0].exception(), LaunchError)
    assert "replica 0: stopped while starting" in str(c.starts[0].exception())


def test_a_rank_that_never_finishes_its_init_ends_the_start_with_the_replica_rank_and_stage(
        model, tmp_path, ray_local):
    """fault.startup_timeout_s bounds each start-up stage: a rank whose communication init hangs
    (here a stand-in worker that never returns from it) ends the replica's start with a
    StartupTimeout naming replica, rank and stage, and its processes are gone."""
    from msinfer.launcher.replica import Replica, ReplicaConfig, StartupTimeout
    from msinfer.sharding.config import EngineConfig
    # long enough for the processes to start on a busy machine (the suite runs two tests at once)
    r = Replica(3, ReplicaConfig(2, worker_cls=never_joins(), startup_timeout_s=8, cpus_per_worker=0.01))
    t0 = time.perf_counter()
    with pytest.raises(StartupTimeout, match=r"replica 3: rank 1 \(on node [0-9.]+\) did not finish device and "
                                             r"communication init within fault.startup_timeout_s=8s"):
        r.start(EngineConfig(str(model)))
    assert time.perf_counter() - t0 < 30
    pids = r.pids()
    r.shutdown()
    assert len(pids) == 2 and wait_gone(pids)


def test_a_rank_that_dies_in_its_init_ends_the_start_at_once_while_the_others_wait_for_it(
        model, tmp_path, ray_local):
    """A rank whose process dies while the others wait for it in their communication init (here
    stand-in workers: rank 1 exits, rank 0 waits an hour) fails the replica's start when it dies,
    not after fault.startup_timeout_s (120 s here): the controller restarts the replica or stops
    the job at once."""
    import sys
    from ray import cloudpickle
    from ray.exceptions import RayActorError
    from msinfer.launcher.replica import Replica, ReplicaConfig
    from msinfer.launcher.simulate import StandInWorker
    from msinfer.sharding.config import EngineConfig

    class DiesInJoin(StandInWorker):
        def join(self, engine_config, sched_host=None, sched_port=None):
            if self.tp.rank == 1:
                os._exit(1)
            time.sleep(3600)
            return 0.0

    cloudpickle.register_pickle_by_value(sys.modules[__name__])     # the workers cannot import tests/
    r = Replica(4, ReplicaConfig(2, worker_cls=DiesInJoin, startup_timeout_s=120, cpus_per_worker=0.01))
    t0 = time.perf_counter()
    with pytest.raises(RayActorError):
        r.start(EngineConfig(str(model)))
    assert time.perf_counter() - t0 < 60
    pids = r.pids()
    r.shutdown()
    assert len(pids) == 2 and wait_gone(pids)


def test_a_signal_that_lands_in_a_ray_wait_keeps_its_exit_code(ray_local, monkeypatch, capsys, tmp_path):
    """A SIGTERM that stops a run at once while the command's main thread waits in ray.get reaches
    Python as the plain KeyboardInterrupt Ray raises in place of the handler's exception. The
    command still answers as for that SIGTERM: 143 while draining, 75 before any record was in
    flight, never Ctrl-C's 130."""
    import threading
    from types import SimpleNamespace
    from msinfer.launcher import cli, job as job_module

    @ray_local.remote(num_cpus=0)
    def slow():
        time.sleep(60)

    spec = Job(tmp_path, tmp_path, records(1)).spec_path
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        for draining, code, word in ((True, 143, "error: terminated (SIGTERM while draining: stopped at once);"),
                                     (False, 75, "drained (SIGTERM before any record was in flight): stopped;")):
            seen = []

            def run(*a, **k):
                # the first signal of a draining run has already been handled
                cli.SIGNALS.drain = SimpleNamespace(requested="SIGTERM received") if draining else None
                cli.SIGNALS.signalled = int(draining)
                ref = slow.remote()
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
                try:
                    ray_local.get(ref, timeout=30)
                except BaseException as e:
                    seen.append(type(e))
                    raise
                finally:
                    ray_local.cancel(ref, force=True)

            monkeypatch.setattr(job_module, "run_job", run)
            assert cli.main(["run", str(spec)]) == code
            assert seen == [KeyboardInterrupt]          # what Ray raised, not the handler's Terminated
            err = capsys.readouterr().err
            assert err.startswith(f"msinfer: {word}") and "Traceback" not in err, err
    finally:
        cli.SIGNALS.drain, cli.SIGNALS.signalled, cli.SIGNALS.raised = None, 0, None
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
