"""Tier 3: running a job again, as a user does -- one run per results file (a second stops at
once), error lines kept or retried, a re-run with nothing left to do, the exit codes of an
interrupt -- and Ascend from the command line where no card is: no NPU resource, and the
emulated card's kernel check. The helpers are tests/test_cli.py's."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli import Job, assert_ray_never_started, no_ray, records, said, wait_for


def test_one_run_per_results_file_retry_failed_and_a_rerun_with_nothing_to_do(cli, model, tmp_path):
    """A second run on a results file in use stops at once (exit 2, naming the first), even with
    --overwrite, and the first writes every record once. A re-run keeps an error line and says so;
    with nothing left it starts no Ray; --retry-failed after the cause is fixed computes the failed
    record again, and every id has one line."""
    lines = records(12) + [{"id": "long", "prompt_token_ids": [3] * 70}]      # longer than max_model_len 64
    job = Job(tmp_path, model, lines, sampling={"max_new_tokens": 40})
    command = ("run", job.spec_path, "--no-progress")
    first = cli.start(*command)
    lock = Path(f"{job.output}.lock")
    wait_for(lock.exists, 60, "the first run's lock", first)
    second = cli.run(*command, "--overwrite")
    assert second.returncode == 2, second.stderr
    assert "is being written by another msinfer run" in said(second) and f"pid {first.pid}," in said(second)
    out, err = first.communicate(timeout=180)
    assert first.returncode == 0, err
    assert not lock.exists()
    results = job.results()
    assert sorted(r["id"] for r in results) == sorted(r["id"] for r in lines)     # each once
    assert [r["id"] for r in results if r["error"]] == ["long"]

    env = no_ray()
    again = cli.run(*command, "--set", "scheduler.max_batch_size=8", env=env)
    assert again.returncode == 0, again.stderr
    # the note names the results file and a command that computes them again in it, --set included
    assert f"1 record(s) already in {job.output} are error lines" in said(again)
    assert f"`msinfer run {job.spec_path} --set scheduler.max_batch_size=8 --retry-failed`" in said(again)
    summary = job.summary()
    assert summary["nothing_to_do"] and summary["records_skipped"] == len(lines) and summary["records_done"] == 0
    assert summary["records_skipped_failed"] == 1 and "steps" not in summary
    assert summary["last_run"]["records_done"] == len(lines) - 1 and summary["last_run"]["steps"]["decode_steps"] > 0
    again = cli.run(*command, env=env)          # the last run that ran stays `last_run`
    assert again.returncode == 0 and job.summary()["last_run"] == summary["last_run"]
    assert_ray_never_started(env)

    p = cli.run(*command, "--retry-failed", "--set", "model.max_model_len=128")
    assert p.returncode == 0, p.stderr
    results = job.results()
    assert sorted(r["id"] for r in results) == sorted(r["id"] for r in lines)
    assert not [r for r in results if r["error"]]
    assert {r["id"]: r for r in results}["long"]["completion_tokens"] == 40
    assert job.summary()["records_retried"] == 1 and job.summary()["records_done"] == 1


@pytest.mark.unit
def test_ctrl_c_and_sigterm_stop_with_their_own_exit_codes_and_one_paragraph(monkeypatch, capsys, tmp_path):
    """The command's answer to an interrupt that stops a run at once (test_cli's jobs are stopped
    by real signals): Ctrl-C exits 130; a second SIGTERM (raised as Terminated by the command's
    handler) 143; a SIGTERM or SIGUSR1 before any record was in flight counts as drained, 75; each
    with one paragraph and no traceback."""
    from msinfer.launcher import cli, job as job_module
    from msinfer.launcher.errors import Terminated
    spec = Job(tmp_path, tmp_path, records(1)).spec_path
    monkeypatch.setattr(cli.SIGNALS, "install", lambda: None)      # this process keeps its own handlers
    for raised, code, word in ((KeyboardInterrupt(), 130, "error: interrupted;"),
                               (Terminated(), 143, "error: terminated (SIGTERM while draining: stopped at once);"),
                               (Terminated("SIGUSR1", drained=True), 75,
                                "drained (SIGUSR1 before any record was in flight): stopped;")):
        def stop(*a, **k):
            raise raised
        monkeypatch.setattr(job_module, "run_job", stop)
        assert cli.main(["run", str(spec)]) == code
        err = capsys.readouterr().err
        assert err.startswith(f"msinfer: {word}") and "Traceback" not in err
    # a run started with --overwrite: typing the same command again would start over
    assert cli.main(["run", str(spec), "--overwrite"]) == 75
    assert "running the same job again (without --overwrite, which starts over) resumes after them" in \
        " ".join(capsys.readouterr().err.split())


def test_a_sigterm_while_ray_starts_is_the_command_s_once_ray_has_started(monkeypatch):
    """ray.init sets a SIGTERM handler of its own (sys.exit(15)) as it begins, and a signal that
    stopped it in its middle left a half-made driver that crashed the command at its exit. A
    SIGTERM (or SIGUSR1, Ctrl-C) while Ray starts is held until ray.init returns, and then reaches
    the command's handler (Terminated: a drained stop, exit 75, a status); Ray's handler is never
    set, and the command's stays in force."""
    import os
    import signal

    import ray

    from msinfer.launcher import replica
    from msinfer.launcher.drain import Signals
    from msinfer.launcher.errors import Terminated
    command = Signals()
    previous = signal.signal(signal.SIGTERM, command.handle)
    went_on = []

    def ray_init_meets_a_sigterm(*args):
        ray._private.utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))     # as ray.init does
        os.kill(os.getpid(), signal.SIGTERM)
        went_on.append(True)             # (the signal did not stop it here)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(replica, "_init_ray", ray_init_meets_a_sigterm)
    monkeypatch.setattr(replica, "INIT_CUT", False)
    try:
        with pytest.raises(Terminated) as e:
            replica.init_ray(None, 1)
        assert went_on and e.value.drained and signal.getsignal(signal.SIGTERM) == command.handle
        assert not replica.INIT_CUT

        def ray_init_that_hangs(*args):        # a second SIGTERM acts at once
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            went_on.append(False)
        monkeypatch.setattr(replica, "_init_ray", ray_init_that_hangs)
        with pytest.raises(Terminated):
            replica.init_ray(None, 1)
        assert went_on == [True] and signal.getsignal(signal.SIGTERM) == command.handle
        assert replica.INIT_CUT          # (the command's process then ends without Ray's exit handler)
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.unit
def test_a_setting_added_to_msinfer_since_a_results_file_was_written_does_not_stop_its_re_run(tmp_path):
    """The settings a results file's status keeps are compared key by key: a key the earlier run
    did not keep (a sampling key msinfer added since) is not a change, while a value that became a
    section (a LoRA adapter where there was none) and a changed value are. A key added since whose
    value earlier runs had (model.kv_cache_dtype: auto) is a change where the re-run sets another."""
    import json
    from msinfer.launcher.errors import OutputError
    from msinfer.launcher.job import check_same_settings
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a"}\n')
    before = {"model": {"lora": None, "dtype": "float32"}, "sampling": {"temperature": 0.0}}
    Path(f"{out}.status.json").write_text(json.dumps({"settings": before}))
    check_same_settings(str(out), {**before, "sampling": {"temperature": 0.0, "include_stop_str_in_output": False}})
    with pytest.raises(OutputError, match=r"\(model.lora None then, \{'adapter': 'ab12'\} now\)"):
        check_same_settings(str(out), {**before, "model": {"lora": {"adapter": "ab12"}, "dtype": "float32"}})
    with pytest.raises(OutputError, match=r"sampling.temperature 0.0 then, 0.5 now"):
        check_same_settings(str(out), {**before, "sampling": {"temperature": 0.5, "include_stop_str_in_output": False}})
    # a run from before msinfer took the model's recommended sampling: the message says where it comes from
    with pytest.raises(OutputError, match=r"\(sampling.temperature 0.0 then, 0.6 now\) \(sampling.temperature now "
                                          r"from the model's generation_config.json: set it in the spec's sampling "
                                          r"section, or model.generation_config: msinfer, to keep the run's\)"):
        check_same_settings(str(out), {**before, "sampling": {"temperature": 0.6}}, ("temperature", "top_p"))
    check_same_settings(str(out), {**before, "model": {**before["model"], "kv_cache_dtype": "auto"}})
    with pytest.raises(OutputError, match=r"\(model.kv_cache_dtype 'auto' then, 'bfloat16' now\)"):
        check_same_settings(str(out), {**before, "model": {**before["model"], "kv_cache_dtype": "bfloat16"}})
    # msinfer simulate's stand-in lines and a run's never share a results file, either way round
    check_same_settings(str(out), {**before, "simulate": False})
    with pytest.raises(OutputError, match=r"holds a run's results; msinfer simulate would add stand-in lines to them"):
        check_same_settings(str(out), {**before, "simulate": True})
    Path(f"{out}.status.json").write_text(json.dumps({"settings": {**before, "simulate": True}}))
    with pytest.raises(OutputError, match=r"holds stand-in results of msinfer simulate, no model's; a run would skip"):
        check_same_settings(str(out), {**before, "simulate": False})
    # a section where there was a value: named once, as it is (a structured output where none was)
    Path(f"{out}.status.json").write_text(json.dumps({"settings": {"sampling": {"structured_outputs": None}}}))
    with pytest.raises(OutputError, match=r"\(sampling.structured_outputs None then, \{'json_object': False, 'choice': "
                                          r"\['yes', 'no'\]\} now\)\. A re-run"):
        check_same_settings(str(out), {"sampling": {"structured_outputs": {"json_schema": None, "json_object": False,
                                                                           "choice": ["yes", "no"], "grammar": None}}})
    # a setting kept under a name of its own says where it comes from
    Path(f"{out}.status.json").write_text(json.dumps({"settings": {"model": {"matmul_dtype": "float32"}}}))
    with pytest.raises(OutputError, match=r"\(model.matmul_dtype \(the linear layers' dtype, from model.dtype\) "
                                          r"'float32' then, 'bfloat16' now\)"):
        check_same_settings(str(out), {"model": {"matmul_dtype": "bfloat16"}})


@pytest.mark.unit
def test_results_whose_settings_file_is_gone_are_resumed_with_a_note_that_says_so(tmp_path):
    """Results copied without their status file (or with it removed) cannot have their settings
    checked: a re-run says so instead of adopting its own settings for them in silence."""
    import json
    from msinfer.launcher.job import unknown_settings
    out = tmp_path / "out.jsonl"
    assert unknown_settings(str(out)) is None                   # nothing to resume
    out.write_text('{"id": "a"}\n')
    status = Path(f"{out}.status.json")
    status.write_text(json.dumps({"settings": {"sampling": {"temperature": 0.0}}}))
    assert unknown_settings(str(out)) is None
    status.unlink()
    note = unknown_settings(str(out))
    assert note is not None and f"{status}, which keeps the settings they were computed with, is missing" in note
    assert "their settings are not checked against this run's" in note


def test_ascend_without_a_card_fails_in_seconds_naming_the_resource_and_emulation(cli, model, tmp_path):
    job = Job(tmp_path, model, records(2), parallel={"device": "ascend"})
    t0 = time.monotonic()
    p = cli.run("run", job.spec_path, "--no-progress", env={"MSINFER_ASCEND_EMULATE": ""})
    assert p.returncode == 2, p.stderr
    assert "this machine's embedded Ray advertises 0 'NPU' resource(s), and a replica of 1 ranks (tensor_parallel x pipeline_parallel) needs 1" \
        in said(p) and "MSINFER_ASCEND_EMULATE=1" in said(p)
    assert time.monotonic() - t0 < 60 and job.status()["state"] == "failed"


@pytest.mark.unit
def test_simulate_writes_beside_the_jobs_results_never_into_them(tmp_path):
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.simulate import simulate_output
    from msinfer.launcher.spec import JobSpec
    spec = JobSpec.model_validate({"model": {"path": "m"}, "input": {"path": str(tmp_path / "in.jsonl")},
                                   "output": {"path": str(tmp_path / "out.jsonl")}})
    assert simulate_output(spec).output.path == f"{tmp_path / 'out.jsonl'}.simulate.jsonl"
    assert simulate_output(spec, str(tmp_path / "sim.jsonl")).output.path == str(tmp_path / "sim.jsonl")
    (tmp_path / "link").symlink_to(tmp_path)
    for same in ("out.jsonl", "in.jsonl", "link/out.jsonl", "./link//in.jsonl"):
        with pytest.raises(SpecError, match="that is the job's own"):
            simulate_output(spec, str(tmp_path / same))
    for companion in ("out.jsonl.inputs", "out.jsonl.status.json", "x.summary.json", "out.jsonl.lock"):
        with pytest.raises(SpecError, match="that is the name of a results file's companion"):
            simulate_output(spec, str(tmp_path / companion))
    sharded = spec.model_copy(update={"input": spec.input.model_copy(update={"shard": "0/2"})})
    with pytest.raises(SpecError, match="that is the job's own results file of input.shard"):
        simulate_output(sharded, str(tmp_path / "out.0-of-2.jsonl"))
    # a file that holds a run's results (its status says so, or it has none), this job's or
    # another's, is never written over; one a simulate wrote is its own to resume or overwrite
    real, stand_in, unknown = (tmp_path / f"{n}.jsonl" for n in ("real", "stand-in", "unknown"))
    for results, settings in ((real, {"simulate": False}), (stand_in, {"simulate": True}), (unknown, None)):
        results.write_text('{"id": "a", "error": null}\n')
        if settings is not None:
            (tmp_path / f"{results.name}.status.json").write_text(json.dumps({"settings": settings}))
    for taken in (real, unknown):
        with pytest.raises(SpecError, match="holds results that msinfer simulate did not write; it never writes"):
            simulate_output(spec, str(taken))
    assert simulate_output(spec, str(stand_in)).output.path == str(stand_in)


def test_check_device_prints_each_fused_kernels_convention_on_the_emulated_card(cli, model, tmp_path):
    job = Job(tmp_path, model, records(1), parallel={"device": "ascend"})
    env = {"MSINFER_ASCEND_EMULATE": "1", "MSINFER_ASCEND_EMULATE_VARIANT": "fa_cumulative"}
    p = cli.run("check-device", job.spec_path, env=env)
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line.split()[1] for line in p.stdout.splitlines()[2:]}
    assert rows == {"FlashAttentionScore": "cumulative", "PagedAttention": "ok", "ReshapeAndCache": "ok",
                    "RmsNorm": "ok"}
    assert "ascend (emulated): 4 heads, 2 KV heads, head_dim 16, block_size 16, float16" in p.stdout
    cpu = cli.run("check-device", job.spec_path, "--set", "parallel.device=cpu")
    assert cpu.returncode == 2 and "check-device checks Ascend's fused kernels" in said(cpu)


@pytest.mark.unit
def test_a_process_s_compile_cache_folder_is_removed_once_its_process_is_gone(monkeypatch, tmp_path):
    """MindSpore's folder of a process (worker.graph_cache.Staging) is named after its pid; a Ray
    worker killed leaves it behind, and the next process to make one removes it, never the folder
    of a process still running."""
    import os
    import subprocess
    import sys
    import tempfile
    from msinfer.worker.graph_cache import Staging
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    dead, alive = tmp_path / f"{Staging.PREFIX}{gone}-abc", tmp_path / f"{Staging.PREFIX}{os.getppid()}-def"
    for d in (dead, alive):
        (d / "rank_0" / "graph_cache").mkdir(parents=True)
    staging = Staging()
    assert staging.root.parent == tmp_path and staging.root.name.startswith(f"{Staging.PREFIX}{os.getpid()}-")
    assert not dead.exists() and alive.exists()


def test_a_second_run_loads_its_graphs_from_the_compile_cache(cli, model, tmp_path):
    """The first run saves each rank's step graphs in folders of their own under
    $MSINFER_CACHE/compile (worker/graph_cache.py), each marked complete: a prefill of 64 rows,
    decode, then one of 128 rows for the two long prompts dealt last. A second run of the same job
    saves nothing anew (MindSpore loaded each graph: one it compiled again would be written again)
    and gives the same results. A third run makes one token a record, so its second graph is the
    128-row prefill, which the first run compiled third: it must load that graph, not the one the
    first run compiled second (MindSpore loads whatever file is at the index it looks for and runs
    it, and gives wrong tokens); each record gets the first token it had."""
    from tests.conftest import cache_with_kernels
    cache = Path(cache_with_kernels(tmp_path / "cache"))
    env = {"MSINFER_CACHE": str(cache)}
    lines = records(6) + [{"id": f"long{i}", "prompt_token_ids": [5 + (i + j) % 50 for j in range(40)]}
                          for i in range(2)]
    job = Job(tmp_path / "job", model, lines, input={"order": "arrival"},
              sampling={"max_new_tokens": 6, "temperature": 0.0})
    command = ("run", job.spec_path, "--no-progress", "--overwrite")

    def saved() -> dict:
        return {p: p.stat().st_mtime_ns for p in (cache / "compile").rglob("*.mindir")}
    p = cli.run(*command, env=env)
    assert p.returncode == 0, p.stderr
    first, graphs = job.results(), job.summary()["steps"]["graphs"]
    assert list(graphs)[0].endswith("prefill N=64 M=2") and list(graphs)[-1].endswith("prefill N=128 M=2"), graphs
    folders = [f for f in (cache / "compile").iterdir()]
    assert len(folders) == len(graphs) >= 3
    assert all((f / "complete").exists() and (f / "graph.mindir").is_file() for f in folders)
    before = saved()
    assert len(before) == len(graphs)
    p = cli.run(*command, env=env)
    assert p.returncode == 0, p.stderr
    assert saved() == before and job.results() == first

    p = cli.run(*command, "--set", "sampling.max_new_tokens=1", env=env)
    assert p.returncode == 0, p.stderr
    assert list(job.summary()["steps"]["graphs"]) == [list(graphs)[0], list(graphs)[-1]]
    assert saved() == before
    assert {r["id"]: r["output_token_ids"] for r in job.results()} == \
        {r["id"]: r["output_token_ids"][:1] for r in first}
