"""Tier 3: the CLI as a user runs it -- `msinfer run job.yaml` in a subprocess, a results file out.

Every job here shares one small checkpoint (the `model` fixture) and one engine shape
(max_model_len, batch size); `cli` (tests/conftest.py) runs the command with one MSINFER_CACHE for
the test session. `Job` and the helpers are shared with tests/test_faults.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml


ENGINE = {"model": {"max_model_len": 64}, "scheduler": {"max_batch_size": 2}}  # one engine shape for all jobs


def prompt(i: int) -> list[int]:
    return [5 + i, 17, 33, 9][:2 + i % 3]


def records(n: int) -> list[dict]:
    return [{"id": f"r{i:02d}", "prompt_token_ids": prompt(i)} for i in range(n)]


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Job:
    """A job folder: job.yaml, in.jsonl (dicts as JSON lines, bytes as raw lines) and
    out/results.jsonl with its status and summary files."""

    def __init__(self, folder: Path, model: Path, lines: list, **sections):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.spec_path = self.dir / "job.yaml"
        self.input = self.dir / "in.jsonl"
        self.output = self.dir / "out" / "results.jsonl"
        with open(self.input, "wb") as f:
            for line in lines:
                f.write(line if isinstance(line, bytes) else json.dumps(line).encode() + b"\n")
        base = {"model": {"path": str(model)}, "input": {"path": "in.jsonl"},
                "sampling": {"max_new_tokens": 4, "ignore_eos": True},
                "output": {"path": "out/results.jsonl", "status_interval_s": 0.2}}
        self.spec = merge(merge(base, ENGINE), sections)
        self.write_spec()

    def write_spec(self, text: str | None = None) -> Path:
        self.spec_path.write_text(text if text is not None else yaml.safe_dump(self.spec, sort_keys=False))
        return self.spec_path

    def results(self) -> list[dict]:
        return [json.loads(line) for line in self.output.read_bytes().splitlines()]

    def ids(self) -> list[str]:
        return [r["id"] for r in self.results()]

    def status(self) -> dict | None:
        return _json(Path(f"{self.output}.status.json"))

    def summary(self) -> dict | None:
        return _json(Path(f"{self.output}.summary.json"))

    def write_prior_results(self, n: int = 2) -> bytes:
        """Results of an earlier run, to check that a failing run leaves them alone."""
        self.output.parent.mkdir(parents=True, exist_ok=True)
        data = b"".join(json.dumps({"id": f"prior{i}", "output_token_ids": [7, 8], "finish_reason": "length",
                                    "prompt_tokens": 2, "completion_tokens": 2, "error": None}).encode() + b"\n"
                        for i in range(n))
        self.output.write_bytes(data)
        return data


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being replaced
        return None


def said(p: subprocess.CompletedProcess | str) -> str:
    """stderr as one line: the CLI wraps its paragraph at 100 columns (textwrap: at spaces, or
    after a hyphen, which the line then ends with)."""
    text = p if isinstance(p, str) else p.stderr
    return " ".join(re.sub(r"(?<=-)\n +", "", text).split())


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, every: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"msinfer exited ({proc.returncode}) while waiting for {what}:\n{out}\n{err}")
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def line_count(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def no_ray() -> dict:
    """An env with a fresh, empty Ray temp dir: if it stays empty, Ray never started."""
    return {"RAY_TMPDIR": tempfile.mkdtemp(prefix="msi-ray-", dir="/tmp")}


def assert_ray_never_started(env: dict) -> None:
    started = os.listdir(env["RAY_TMPDIR"])
    assert not started, f"Ray started: {started}"
    os.rmdir(env["RAY_TMPDIR"])


# ---- a job in, a results file out; interrupted and run again -------------------------------------

BAD_RECORDS = [   # (input line, what the error message of its result says)
    (b'{"id": "broken", "prompt_token_ids": [1, 2\n', "invalid JSON"),
    ({"id": "no-prompt", "sampling": {"temperature": 0}}, "no prompt"),
    ({"id": "empty", "prompt": ""}, "'prompt' is empty"),
    ({"id": "too-long", "prompt_token_ids": [3] * 64}, "the prompt has 64 tokens; model.max_model_len is 64"),
    (b'{"id": "latin1", "prompt": "caf\xe9"}\n', "not valid UTF-8"),
    ({"id": "text", "prompt": "hello"}, "the model has no tokenizer, so records need 'prompt_token_ids'"),
]


def test_run_interrupt_and_run_again(cli, model, tmp_path, hf_greedy):
    """A user's job: good records, bad ones (invalid JSON, no prompt, empty prompt, too long, not
    UTF-8, text without a tokenizer) and a --set override. SIGTERM in the middle: the job drains
    (exit 75), then the same command again: it skips what finished, computes the rest and exits 0;
    every record has exactly one result line, the good ones transformers' tokens, the bad ones an
    error naming their id and problem. Run as a user's shell runs it (no LD_PRELOAD: `make test`
    preloads jemalloc), the ranks malloc with the jemalloc Ray ships; the interrupted run, with
    RAY_LD_PRELOAD_ON_WORKERS=0, with glibc's. The CPU ranks launch their steps without MindSpore's
    graph pipeline (worker.device.CPU_ENVIRONMENT), unless the user's MS_DEV_RUNTIME_CONF (the
    interrupted run's) says otherwise."""
    from msinfer.worker.device import CPU_ENVIRONMENT
    user = {"LD_PRELOAD": None, "MS_DEV_RUNTIME_CONF": None}
    good = records(16)
    good[5]["sampling"] = {"max_new_tokens": 2}               # a record's own sampling beats --set
    bad = [line for line, _ in BAD_RECORDS]
    lines = good[:1] + bad[:3] + good[1:9] + bad[3:] + good[9:]
    job = Job(tmp_path, model, lines)                          # the spec says max_new_tokens: 4
    command = ("run", job.spec_path, "--no-progress", "--set", "sampling.max_new_tokens=40")

    proc = cli.start(*command, env={**user, "RAY_LD_PRELOAD_ON_WORKERS": "0",
                                    "MS_DEV_RUNTIME_CONF": "graph_pipeline:True"})
    wait_for(lambda: job.output.exists() and job.output.read_bytes().count(b'"error": null') >= 2,
             120, "two results", proc)
    proc.send_signal(signal.SIGTERM)              # a scheduler's stop: the records in flight finish
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert "Traceback" not in err and "PC: @" not in err, err
    assert "drained (SIGTERM received: stopped dealing records, and the records in flight finished)" in said(err)
    assert "running the same job again resumes" in said(err)
    assert "record(s) stopped at their length limit before the model ended them" in said(err)   # drained or not
    assert job.status()["state"] == "drained"
    assert job.summary()["drained"]["records_in_flight_abandoned"] == 0
    assert [s["allocator"] for s in job.summary()["setup"]] == ["glibc"]
    assert [s.get("environment_set") for s in job.summary()["setup"]] == [None]     # the user's value stood
    kept = job.output.read_bytes()
    assert kept.endswith(b"\n")
    done_before = job.ids()
    assert len(done_before) < len(lines), "the interrupt came too late to test a resume"
    # not started: handed back by the engine, read ahead for the dealing order, or never read
    assert job.summary()["drained"]["records_not_dealt"] == len(lines) - len(done_before)

    p = cli.run(*command, env=user)
    assert p.returncode == 0, p.stderr
    printed = json.loads(p.stdout.strip().splitlines()[-1])
    assert printed["records_skipped"] == len(done_before)
    assert printed["records_done"] + printed["records_failed"] == len(lines) - len(done_before)
    assert printed["records_cut"] == printed["records_done"] > 0             # each stopped at max_new_tokens
    assert (f"msinfer: note: {printed['records_cut']} of {printed['records_done']} record(s) stopped at their length "
            f"limit before the model ended them (finish_reason 'length': sampling.max_new_tokens, 40 for the job's "
            f"records, or model.max_model_len") in said(p)
    assert job.output.read_bytes().startswith(kept)           # what was written stays as it was
    results = {r["id"]: r for r in job.results()}
    assert len(results) == len(job.results()) == len(lines)   # each record exactly once
    for rec in good:
        r = results[rec["id"]]
        n = 2 if rec is good[5] else 40
        assert r["error"] is None and r["finish_reason"] == "length"
        assert len(r["output_token_ids"]) == r["completion_tokens"] == n
        assert r["output_token_ids"] == hf_greedy("llama_gqa_tied", rec["prompt_token_ids"], 40)[0][:n], rec["id"]
    for line, message in BAD_RECORDS:
        n = lines.index(line) + 1                  # a line that cannot be read has its line number as id
        r = results[line["id"] if isinstance(line, dict) else str(n)]
        assert r["error"]["type"] == "InvalidRecord" and message in r["error"]["message"]
        assert f"line {n}: " in r["error"]["message"] or f"record '{r['id']}'" in r["error"]["message"]
    summary = job.summary()
    assert summary["spec"]["sampling"]["max_new_tokens"] == 40
    assert summary["records_skipped"] == len(done_before)
    assert [s["allocator"] for s in summary["setup"]] == ["libjemalloc.so"]
    assert [s["fused_layers"] for s in summary["setup"]] == [2]     # both layers: one kernel call each
    assert [s.get("environment_set") for s in summary["setup"]] == [CPU_ENVIRONMENT]
    steps = summary["steps"]          # the controller's, the worker's and the network's share of each step
    for kind in ("prefill", "decode"):
        assert steps[f"{kind}_steps"] > 0
        assert 0 < steps[f"{kind}_model_s"] <= steps[f"{kind}_worker_s"]
    # greedy decoding samples on the device: a token id (4 bytes) per row of the step leaves it, no
    # logits (the CPU kernels' smallest decode shape has 8 rows)
    assert 0 < steps["decode_host_bytes"] <= 4 * 8 * steps["decode_seqs"]
    # the controller's seconds are the replica's wall time (steps overlap with async scheduling),
    # which the two kinds of step share
    assert steps["prefill_worker_s"] + steps["decode_worker_s"] <= steps["prefill_s"] + steps["decode_s"]
    assert steps["graphs_compiled"] == len(steps["graphs"]) > 0
    status = job.status()
    assert status["state"] == "done" and status["workers"][0]["pid"] > 0


def test_plan_prints_the_layout_and_starts_nothing(cli, model, tmp_path):
    job = Job(tmp_path, model, records(2))
    env = no_ray()
    p = cli.run("plan", job.spec_path, "--set", "parallel.tensor_parallel=2", "--set", "parallel.data_parallel=2",
                env=env)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert f"model       {model}" in out
    assert "LlamaForCausalLM: 2 layers, hidden 64, heads 4 (kv 2, head_dim 16), vocab 256" in out
    assert "2 replica(s) x tensor parallel 2 = 4 worker(s) on cpu" in out
    assert "q heads 4/2 per rank" in out and "kv heads split" in out
    assert "max_model_len 64" in out and "(no tokenizer: prompt_token_ids only)" in out
    assert not job.output.parent.exists() and job.status() is None    # not even the output folder
    assert_ray_never_started(env)


def test_bad_tensor_parallel_size_fails_before_ray_naming_the_sizes_that_work(cli, model, tmp_path):
    job = Job(tmp_path, model, records(2))
    env = no_ray()
    p = cli.run("run", job.spec_path, "--set", "parallel.tensor_parallel=3", env=env)
    assert p.returncode == 2
    msg = said(p)
    assert msg.startswith("msinfer: error: parallel.tensor_parallel=3 does not fit LlamaForCausalLM")
    assert "num_attention_heads=4 is not divisible by 3" in msg and "Sizes that work: 1, 2, 4" in msg
    assert job.status() is None and not job.output.exists()
    assert_ray_never_started(env)


SPEC_ERRORS = {
    "malformed-yaml": ("model:\n  path: m\n input:\n", (), "job.yaml:3:2: malformed YAML"),
    "unknown-key": (None, ("--set", "scheduler.max_batch=4"),
                    "--set: scheduler.max_batch: unknown key; did you mean 'max_batch_size'"),
    "wrong-type": (None, ("--set", "sampling.max_new_tokens=many"),
                   "--set: sampling.max_new_tokens: expected an integer, got 'many'"),
    "bad-override": (None, ("--set", "sampling.max_new_tokens"), "expected dotted.key=value"),
    "missing-key": ("model:\n  path: m\ninput:\n  path: in.jsonl\n", (), "output: missing required key"),
    "no-room": (None, ("--set", "sampling.max_new_tokens=64"),
                "sampling.max_new_tokens (64) must be less than model.max_model_len (64)"),
    "bad-dtype": (None, ("--set", "model.dtype=fp8"), "model.dtype: expected one of"),
}


@pytest.mark.parametrize("case", SPEC_ERRORS)
def test_spec_errors_exit_2_with_one_message_and_no_traceback(cli, model, tmp_path, case):
    text, overrides, expected = SPEC_ERRORS[case]
    job = Job(tmp_path, model, records(1))
    if text is not None:
        job.write_spec(text)
    p = cli.run("run", job.spec_path, *overrides)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("msinfer: error: ") and expected in said(p), p.stderr
    assert p.stdout == ""


def test_missing_spec_file_exits_2(cli, tmp_path):
    p = cli.run("plan", tmp_path / "nope.yaml")
    assert p.returncode == 2 and "nope.yaml: job spec file not found" in said(p)


def test_a_second_sigterm_stops_at_once_and_a_deadline_ends_the_run_before_it(cli, model, tmp_path):
    """On stand-ins (25 ms a step, 40 tokens a record, 4 at once: 1 s a record; 150 ms a step in the
    first run, 5 ms in the last; the first SIGTERM's drain is test_run_interrupt_and_run_again's).
    A SIGTERM while draining stops at once: exit 143, status interrupted, every line whole. With
    run.deadline 20 s away, the run stops dealing the records it has no time for and ends before
    the deadline: exit 75, status drained. Then a run without a deadline finishes: every record
    once, with the tokens the stand-ins give its prompt."""
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.simulate import StandIn, StandInRunner
    from msinfer.launcher.spec import load_spec
    lines = [{"id": f"r{i:02d}", "prompt_token_ids": [5 + i, 17, 33]} for i in range(48)]
    job = Job(tmp_path, model, lines, sampling={"max_new_tokens": 40}, scheduler={"max_batch_size": 4})
    out = Path(f"{job.output}.simulate.jsonl")
    command = ("simulate", job.spec_path, "--step-ms", "25", "--no-progress")

    # a drain hands back the records queued; the 4 in flight take 6 s here: time to see it drain
    proc = cli.start(*command, "--step-ms", "150")
    wait_for(lambda: line_count(out) >= 1, 120, "a result", proc)
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: (_json(Path(f"{out}.status.json")) or {}).get("state") == "draining", 30, "draining", proc)
    proc.send_signal(signal.SIGTERM)
    printed, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "PC: @" not in err, err
    assert "terminated (SIGTERM while draining: stopped at once)" in said(err)
    assert _json(Path(f"{out}.status.json"))["state"] == "interrupted"
    assert out.read_bytes().endswith(b"\n")
    first = line_count(out)
    stopped = _json(Path(f"{out}.summary.json"))      # the run's own figures, though it did not finish
    assert stopped["stopped"] == {"state": "interrupted",
                                  "why": "SIGTERM: stopped at once, the records in flight given up"}
    assert stopped["records_done"] == first and stopped["records_skipped"] == 0
    assert json.loads(printed.splitlines()[-1])["records_done"] == first          # and its line on stdout

    p = cli.run(*command, "--set", "run.deadline=20s")
    ended = time.time()
    assert p.returncode == 75, p.stderr
    assert "drained (the deadline (run.deadline 20s, " in said(p)
    summary = _json(Path(f"{out}.summary.json"))
    assert summary["drained"]["deadline_source"] == summary["deadline"]["source"] == "run.deadline 20s"
    assert ended < datetime.fromisoformat(summary["deadline"]["at"]).timestamp()       # the command too
    assert _json(Path(f"{out}.status.json"))["state"] == "drained"
    assert first <= line_count(out) < len(lines)
    left = summary["drained"]
    assert left["records_not_dealt"] + left["records_in_flight_abandoned"] == len(lines) - line_count(out)
    # a deadline inside the time a run keeps to shut down: nothing is started, nothing is lost
    p = cli.run(*command, "--set", "run.deadline=5s")
    summary = _json(Path(f"{out}.summary.json"))
    assert p.returncode == 75 and "drained (the deadline (run.deadline 5s, " in said(p), p.stderr
    assert summary["drained"]["records_not_dealt"] == len(lines) - line_count(out) and "setup" not in summary

    p = cli.run(*command, "--step-ms", "5")         # (the stand-ins' tokens do not depend on their pace)
    assert p.returncode == 0, p.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in results) == [r["id"] for r in lines]     # each exactly once
    stand_in = StandInRunner(plan_job(load_spec(job.spec_path), weights=False).engine, StandIn())
    for rec, r in zip(lines, sorted(results, key=lambda r: r["id"])):
        assert r["output_token_ids"] == stand_in.tokens(rec["prompt_token_ids"], 40), rec["id"]


def test_simulate_from_the_command_line_prints_its_capacity_figures_and_checks_its_flags(cli, model, tmp_path):
    """simulate writes its stand-in tokens beside the job's results file, never into it: a `run`
    after it computes every record."""
    job = Job(tmp_path, model, records(6), sampling={"max_new_tokens": 4})
    bad = cli.run("simulate", job.spec_path, "--step-ms", "0")
    assert bad.returncode == 2 and "--step-ms must be > 0" in bad.stderr
    p = cli.run("simulate", job.spec_path, "--step-ms", "2", "--no-progress")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["records_done"] == 6 and out["simulate"]["step_ms"] == 2.0 and out["simulate"]["tokens_per_s"] > 0
    stand_in = Path(f"{job.output}.simulate.jsonl")
    assert f"stand-in results go to {stand_in}" in said(p)
    assert sorted(r["id"] for r in map(json.loads, stand_in.read_text().splitlines())) == [r["id"] for r in records(6)]
    p = cli.run("simulate", job.spec_path, "--step-ms", "2", "--no-progress", "--set", "input.shard=1/2")
    shard = Path(f"{job.output}.simulate.1-of-2.jsonl")              # the file it names is the file it writes
    assert p.returncode == 0 and f"stand-in results go to {shard}" in said(p) and shard.exists(), p.stderr
    assert not job.output.exists() and Path(f"{stand_in}.summary.json").exists()
    p = cli.run("run", job.spec_path)               # with the progress bar (tqdm disables it off a terminal)
    assert p.returncode == 0, p.stderr
    printed = json.loads(p.stdout.strip().splitlines()[-1])
    assert printed["records_done"] == 6 and printed["records_skipped"] == 0
    assert sorted(job.ids()) == [r["id"] for r in records(6)]
