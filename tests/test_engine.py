"""The engines (launcher.engine) and the driver that deals them records (launcher.controller),
on stand-in workers (launcher.simulate): tokens drawn by each prompt, so a record gets the same
tokens on any replica, in any run, and results can be compared across runs; and, where tokens
must come from a model, an engine on a rank of the real network in this process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from msinfer.launcher.engine import STEP_FIGURES
from msinfer.launcher.errors import OutputError
from msinfer.launcher.inputs import parse_record
from msinfer.launcher.job import plan_job, run_job
from msinfer.launcher.simulate import StandIn, StandInWorker
from msinfer.launcher.spec import JobSpec
from tests.engine_driver import exchange_until_done


@pytest.fixture(scope="module")
def demo():
    from scripts.make_demo_model import ensure_demo_model
    return ensure_demo_model()


def job_spec(demo, tmp_path, records, **sections) -> JobSpec:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = {"model": {"path": str(demo), "max_model_len": 128},
            "input": {"path": str(tmp_path / "in.jsonl"), "chat_template": False},
            "output": {"path": str(tmp_path / "out.jsonl")},
            "sampling": {"max_new_tokens": 6, "ignore_eos": True},
            "scheduler": {"max_batch_size": 4, "max_batched_tokens": 64}}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return JobSpec.model_validate(spec)


def results(path) -> dict[str, dict]:
    lines = [json.loads(x) for x in open(path).read().splitlines()]
    ids = [x["id"] for x in lines]
    assert len(ids) == len(set(ids)), "a record was written twice"
    return {x["id"]: x for x in lines}


def test_the_embedded_ray_starts_only_what_a_job_uses_and_keeps_the_ledger_in_its_store(ray_local):
    """init_ray's instance (the ray_local fixture's) runs its GCS and raylet and no autoscaler
    monitor, log monitor or dashboard server (launcher.replica._lean_head), and its raylet starts
    no worker processes ahead of the actors (LEAN_RAY_ENV). The job's ledger of
    running records lives in the GCS's store: a replica's last entry comes back once to whoever
    takes it, and one job's entries are apart from another's."""
    from msinfer.launcher.engine import Ledger
    node = ray_local._private.worker._global_node
    started = set(node.all_processes)
    assert {"gcs_server", "raylet"} <= started and not started & {"monitor", "log_monitor", "dashboard"}
    session = node.get_session_dir_path().encode()
    commands = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            commands.append(path.read_bytes())
    ours = [c for c in commands if session in c]
    assert any(b"raylet" in c for c in ours)
    assert not [c for c in ours if b"monitor.py" in c or b"dashboard.py" in c]
    raylet = Path(f"/proc/{node.all_processes['raylet'][0].process.pid}/environ").read_bytes().split(b"\0")
    assert b"RAY_prestart_worker_first_driver=0" in raylet

    a, b = Ledger("job-a"), Ledger("job-b")
    a.put(0, {3, 1})
    a.put(0, {1, 2, 3})
    a.put(1, {5})
    b.put(0, {9})
    assert a.take(0) == [1, 2, 3] and a.take(0) == []
    a.clear()
    assert a.take(1) == [] and b.take(0) == [9]


def test_an_embedded_ray_asks_for_its_node_once_registered_and_leaves_ray_as_it_was(monkeypatch):
    """launcher.replica._raylet_awaited: Ray's look-up of the node it started comes once the GCS
    lists the node alive (here on the third asking), not after a second's sleep in Ray; where the
    GCS cannot be asked, Ray's own look-up runs as it would have (it waits and says what is
    wrong); after ray.init, Ray's function is back."""
    import ray
    from ray._private import services
    from ray.core.generated.gcs_pb2 import GcsNodeInfo
    from msinfer.launcher.replica import _raylet_awaited
    node = ray.NodeID.from_random()
    answers = [{}, {ray.NodeID.from_random(): GcsNodeInfo(state=GcsNodeInfo.ALIVE)},
               {node: GcsNodeInfo(state=GcsNodeInfo.ALIVE)}]
    asked, calls = [], []

    class Gcs:
        def __init__(self, address):
            if address == "unreachable":
                raise ConnectionError(address)

        def get_all_node_info(self, timeout=None):
            asked.append(timeout)
            return answers[min(len(asked), len(answers)) - 1]
    monkeypatch.setattr(ray._raylet, "GcsClient", Gcs)
    monkeypatch.setattr(services, "get_node", lambda address, node_id: calls.append((address, node_id)) or "info")
    ray_own = services.get_node
    with _raylet_awaited():
        assert services.get_node("gcs:1", node.hex()) == "info" and len(asked) == 3
        assert services.get_node("unreachable", node.hex()) == "info" and len(asked) == 3
    assert calls == [("gcs:1", node.hex()), ("unreachable", node.hex())] and services.get_node is ray_own


def test_an_engine_in_process_gives_each_record_one_result_the_same_with_and_without_async_scheduling(
        demo, tmp_path, ray_local):
    """The engine's loop on a stand-in rank: every record once, each with the tokens its
    max_new_tokens asks for; async scheduling (the next step submitted while one runs) changes
    no token; a bad record is its own error result and the others go on."""
    from msinfer.launcher.engine import Engine, EngineSetup
    from msinfer.launcher.replica import Replica, ReplicaConfig

    records = [{"id": f"r{i}", "prompt_token_ids": [10 + i] * (3 + i), "sampling": {"max_new_tokens": 2 + i % 5}}
               for i in range(9)] + [{"id": "bad", "prompt_token_ids": [10**7]}]
    got = {}
    for async_scheduling in (True, False):
        spec = job_spec(demo, tmp_path, records, scheduler={"async_scheduling": async_scheduling})
        plan = plan_job(spec, weights=False)
        replica = Replica(0, ReplicaConfig(1, worker_cls=StandInWorker, worker_options={"timing": StandIn(step_ms=2)},
                                           cpus_per_worker=0.01))
        replica.start(plan.engine)
        engine = Engine(EngineSetup(plan.spec, plan.model, plan.engine), 0)
        try:
            engine.attach(replica.workers)
            done = exchange_until_done(engine, [parse_record(r, n) for n, r in enumerate(records, 1)])
        finally:
            engine.close()
            replica.shutdown()
        assert sorted(d.serial for d in done) == list(range(len(records)))
        lines = {json.loads(d.line)["id"]: json.loads(d.line) for d in done}
        for i in range(9):
            assert lines[f"r{i}"]["completion_tokens"] == 2 + i % 5 and lines[f"r{i}"]["finish_reason"] == "length"
        assert "outside the vocabulary" in lines["bad"]["error"]["message"]
        assert engine.step_s["decode"][0] > 0
        got[async_scheduling] = lines
    assert got[True] == got[False]


def test_a_stop_string_ends_a_record_where_it_starts(demo, tmp_path, ray_local, capsys):
    """Stop strings are matched in the engine on the decoded text: the output is cut before the
    first occurrence (after it, with include_stop_str_in_output), finish_reason stop, and the
    record generates no further. As in vLLM, a stop string completed by the last token that
    max_new_tokens allows still cuts the text (finish_reason stop, not length), one that ends
    within the first min_tokens tokens' text is not looked for, and --stream holds back the
    start of a stop string that the next token may complete: it prints each record's text."""
    from msinfer.launcher.simulate import StandInRunner
    from msinfer.launcher.tokenizer import load_tokenizer

    tok = load_tokenizer(demo)
    prompt = "Once upon a time"
    spec = job_spec(demo, tmp_path, [])
    tokens = StandInRunner(plan_job(spec, weights=False).engine, StandIn()).tokens(tok.encode(prompt), 24)
    text = tok.decode(tokens)
    ends = [len(tok.decode(tokens[:n])) for n in range(12, 20)]     # where tokens end, mid-text
    # a stop string across two tokens' text, and its first occurrence
    stop = next(text[b - 1:b + 2] for b in ends if text[b - 1:b + 2].strip() and text.find(text[b - 1:b + 2]) == b - 1)
    at = next(n for n in range(1, 25) if stop in tok.decode(tokens[:n]))     # the token that completes it
    seen = len(tok.decode(tokens[:at]))             # min_tokens `at`: the first occurrence is in this text
    later = text.find(stop, seen - len(stop) + 1)
    spec = job_spec(demo, tmp_path, [{"id": "s", "prompt": prompt, "sampling": {"max_new_tokens": 24, "stop": [stop]}},
                                     {"id": "kept", "prompt": prompt, "sampling": {
                                         "max_new_tokens": 24, "stop": [stop], "include_stop_str_in_output": True}},
                                     {"id": "last", "prompt": prompt, "sampling": {"max_new_tokens": at, "stop": [stop]}},
                                     {"id": "min", "prompt": prompt, "sampling": {
                                         "max_new_tokens": 24, "stop": [stop], "min_tokens": at}}])
    capsys.readouterr()
    run_job(spec, progress=False, stream=True, simulate=StandIn(step_ms=1.0))
    streamed = capsys.readouterr().err.splitlines()
    got = results(tmp_path / "out.jsonl")
    for rid, r in got.items():
        assert "\n".join(x[len(f"[{rid}] "):] for x in streamed if x.startswith(f"[{rid}] ")) == r["output_text"]
    cut = got["s"]
    assert cut["finish_reason"] == "stop" and cut["output_text"] == text[:text.find(stop)]
    assert cut["completion_tokens"] == at < 24
    # vLLM's include_stop_str_in_output: the same tokens, the text up to the stop string's end
    kept = got["kept"]
    assert kept["output_text"] == text[:text.find(stop) + len(stop)] and kept["finish_reason"] == "stop"
    assert kept["output_token_ids"] == cut["output_token_ids"]
    assert {k: got["last"][k] for k in ("output_text", "finish_reason", "output_token_ids")} == {
        k: cut[k] for k in ("output_text", "finish_reason", "output_token_ids")}
    late = got["min"]
    assert late["output_text"] == (text[:later] if later >= 0 else text), (stop, text)
    assert late["finish_reason"] == ("stop" if later >= 0 else "length")
    assert late["completion_tokens"] > at
    # vLLM's stop_reason: the stop string that ended it (none where the length limit did)
    assert cut["stop_reason"] == kept["stop_reason"] == got["last"]["stop_reason"] == stop
    assert late.get("stop_reason") == (stop if later >= 0 else None)


class DiesOnce(StandInWorker):
    """A stand-in rank that kills its process at its fifth step, once per test (the first rank of
    any replica to get there)."""
    flag = ""

    def step(self, payload, is_prefill, index):
        if index == 4:
            try:
                os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
                os._exit(1)
            except FileExistsError:
                pass
        return super().step(payload, is_prefill, index)


def test_a_failed_replicas_records_go_to_the_healthy_one_and_each_result_is_written_once(
        demo, tmp_path, ray_local):
    """A rank dies mid-job at dp 2: its engine reports it, the driver deals its unfinished records
    to the other replica at once and restarts it; every record is written exactly once, with the
    same tokens as in a run without the failure."""
    from ray import cloudpickle

    from msinfer.launcher.simulate import StandInRunner

    records = [{"id": f"r{i}", "prompt_token_ids": [20 + i, 7, 8]} for i in range(24)]
    spec = job_spec(demo, tmp_path, records, parallel={"data_parallel": 2})
    runner = StandInRunner(plan_job(spec, weights=False).engine, StandIn())
    DiesOnce.flag = str(tmp_path / "died")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])     # the workers cannot import tests/
    summary = run_job(spec, progress=False, simulate=StandIn(step_ms=2.0, worker_cls=DiesOnce))
    assert os.path.exists(DiesOnce.flag)
    assert summary["replica_restarts"] == 1
    # an exit, no signal: the rank named by its pid, its log telling nothing more
    assert re.fullmatch(r"replica [01] failed \(a worker process died: rank 0 \(pid \d+ on [\d.]+\)\)",
                        *summary["restart_reasons"])
    out = results(tmp_path / "out.jsonl")
    assert {k: v["output_token_ids"] for k, v in out.items()} == {
        r["id"]: runner.tokens(r["prompt_token_ids"], 6) for r in records}


def test_a_folder_of_input_files_with_integer_ids_runs_as_one_input_and_a_re_run_computes_only_a_new_file(
        demo, tmp_path, ray_local):
    """input.path a folder of .jsonl files: every record of every file once, a record without an
    id named "<file>:<line>". An integer id stays an integer in its line (it came back as "7",
    and a user's lookup of results by their input's ids found none, with no error); 7 and "7"
    are still one id (the second is refused as a duplicate). A re-run after a file is added
    computes that file's records alone; a results file inside the folder is refused before
    anything starts."""
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.simulate import StandInRunner
    folder = tmp_path / "shards"
    folder.mkdir()
    first = [{"prompt_token_ids": [20 + i, 7, 8]} for i in range(2)]
    second = [{"id": 7, "prompt_token_ids": [30, 7, 8]},
              {"id": -3, "prompt_token_ids": [31, 7, 8], "sampling": {"n": 2}},
              {"id": 9, "prompt_token_ids": [32, 7, 8], "sampling": {"min_tokens": 99}},
              {"id": "7", "prompt_token_ids": [33, 7, 8]}]
    for name, records in (("part-0.jsonl", first), ("part-1.jsonl", second)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = job_spec(demo, tmp_path, [], input={"path": str(folder)})
    runner = StandInRunner(plan_job(spec, weights=False).engine, StandIn())
    summary = run_job(spec, progress=False, simulate=StandIn(step_ms=1.0))
    assert (summary["records_done"], summary["records_failed"]) == (4, 2)
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted((x["id"] for x in lines), key=str) == [-3, 7, "7@part-1.jsonl:4", 9, "part-0.jsonl:1",
                                                         "part-0.jsonl:2"]
    out = {x["id"]: x for x in lines}
    assert out["part-0.jsonl:2"]["output_token_ids"] == runner.tokens([21, 7, 8], 6)
    assert out[7]["error"] is None and len(out[-3]["outputs"]) == 2
    assert "min_tokens (99) must be at most max_new_tokens" in out[9]["error"]["message"]
    assert ("part-1.jsonl line 4: id '7' was already used on part-1.jsonl line 1"
            in out["7@part-1.jsonl:4"]["error"]["message"])
    (folder / "part-2.jsonl").write_text(json.dumps({"prompt_token_ids": [40, 7, 8]}) + "\n")
    again = run_job(spec, progress=False, simulate=StandIn(step_ms=1.0))
    assert (again["records_skipped"], again["records_done"]) == (6, 1)
    assert set(results(tmp_path / "out.jsonl")) == {*out, "part-2.jsonl:1"}
    inside = job_spec(demo, tmp_path, [], input={"path": str(folder)}, output={"path": str(folder / "out.jsonl")})
    with pytest.raises(SpecError, match=r"output.path .*shards/out.jsonl would be one of the files of input.path"):
        plan_job(inside)


class SlowOne(StandInWorker):
    """A stand-in rank twenty times slower than the others: the first rank of the test to step
    claims it (a card slowed by heat, a node shared with another job). Its first step also waits
    until `written` lines are in the results file `results` (at most a minute): the others' steps
    take their 2 ms and the driver's calls on top, so on a loaded machine the others are not
    twenty times faster, and they have run every record but the slow one's before it goes on."""
    flag = results = ""
    written = 0

    def step(self, payload, is_prefill, index):
        if index == 0:
            try:
                os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
                self.timing = StandIn(step_ms=20 * self.timing.step_ms)
                self.runner.timing = self.timing
                end = time.monotonic() + 60
                while time.monotonic() < end and lines_in(self.results) < self.written:
                    time.sleep(0.01)
            except FileExistsError:
                pass
        return super().step(payload, is_prefill, index)


def lines_in(path) -> int:
    # tests/test_cli.py's line_count, which SlowOne cannot call: the Ray workers take this module
    # by value (cloudpickle) and cannot import tests/
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def test_at_the_tail_an_idle_replica_takes_the_records_a_slow_one_has_queued(demo, tmp_path, ray_local):
    """dp 2, one replica twenty times slower: once every record is dealt, the fast replica runs
    out while the slow one still has records queued and not started; it hands them back and the
    fast one runs them, instead of idling while they wait. Every record is written once, with the
    tokens it gets anywhere."""
    from ray import cloudpickle

    from msinfer.launcher.simulate import StandInRunner
    records = [{"id": f"r{i}", "prompt_token_ids": [20 + i, 7, 8]} for i in range(20)]
    spec = job_spec(demo, tmp_path, records, parallel={"data_parallel": 2},
                    scheduler={"max_batch_size": 2, "prefix_caching": False})
    runner = StandInRunner(plan_job(spec, weights=False).engine, StandIn())
    # the slow replica holds its batch (2) and two batches queued (Engine.queue_target) at most:
    # 14 records are the others' once every record is dealt
    SlowOne.flag, SlowOne.results, SlowOne.written = str(tmp_path / "slow"), str(tmp_path / "out.jsonl"), 14
    cloudpickle.register_pickle_by_value(sys.modules[__name__])     # the workers cannot import tests/
    summary = run_job(spec, progress=False, simulate=StandIn(step_ms=2.0, worker_cls=SlowOne))
    assert os.path.exists(SlowOne.flag)
    assert summary["records_rebalanced"] > 0 and summary["records_done"] == 20
    out = results(tmp_path / "out.jsonl")
    assert {k: v["output_token_ids"] for k, v in out.items()} == {
        r["id"]: runner.tokens(r["prompt_token_ids"], 6) for r in records}


def test_longest_first_deals_long_records_first_and_every_record_gets_the_line_arrival_order_gives(
        demo, tmp_path, ray_local):
    """20 short records, then 2 eight times longer, at batch 4: dealt as read, the long ones start
    last and are the last lines written; longest first, they are dealt first and finish while
    short records are still dealt. Every record's line is the same in both orders."""
    records = [{"id": f"s{i}", "prompt_token_ids": [30 + i, 5, 6]} for i in range(20)] + [
        {"id": f"L{i}", "prompt_token_ids": [70 + i, 5, 6], "sampling": {"max_new_tokens": 48}} for i in range(2)]
    lines = {}
    for order in ("arrival", "longest_first"):
        spec = job_spec(demo, tmp_path, records, input={"order": order})
        run_job(spec, overwrite=True, progress=False, simulate=StandIn(step_ms=1.0))
        written = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        lines[order] = {x["id"]: x for x in written}
        last = {x["id"] for x in written[-2:]}
        assert (last == {"L0", "L1"}) == (order == "arrival"), [x["id"] for x in written]
    assert lines["arrival"] == lines["longest_first"]
    assert [lines["arrival"][f"L{i}"]["completion_tokens"] for i in range(2)] == [48, 48]


def test_three_shards_give_every_record_once_with_one_jobs_lines_and_merge_into_its_file(demo, tmp_path, ray_local):
    """input.shard 0/3, 1/3, 2/3 on stand-ins: each writes results.K-of-3.jsonl, together every
    record once with the tokens one job gives it (the stand-ins' tokens follow the prompt), and
    `msinfer merge` writes them as one file in input order. With shard_by file a shard reads only
    its files."""
    from msinfer.launcher.cli import merge_job
    from msinfer.launcher.simulate import StandInRunner
    records = [{"id": f"q{i}", "prompt_token_ids": [50 + i, 5, 6]} for i in range(30)]
    got = {}
    for k in range(3):
        spec = job_spec(demo, tmp_path, records, input={"shard": f"{k}/3"})
        summary = run_job(spec, progress=False, simulate=StandIn(step_ms=1.0))
        part = results(tmp_path / f"out.{k}-of-3.jsonl")
        assert summary["records_done"] == len(part) > 0 and not set(part) & set(got)
        got.update(part)
    runner = StandInRunner(plan_job(spec, weights=False).engine, StandIn())
    assert {k: v["output_token_ids"] for k, v in got.items()} == {
        r["id"]: runner.tokens(r["prompt_token_ids"], 6) for r in records}
    (tmp_path / "out.jsonl").write_text('{"id": "earlier", "error": null}\n')     # a run's results at that path
    with pytest.raises(OutputError, match=r"out.jsonl holds results that are not a merge of these 3 shards"):
        merge_job(spec)
    assert (tmp_path / "out.jsonl").read_text() == '{"id": "earlier", "error": null}\n'
    (tmp_path / "out.jsonl").unlink()
    assert merge_job(spec)["records"] == 30 and merge_job(spec)["records"] == 30       # (a merge merges again)
    assert [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()] == [got[r["id"]] for r in records]
    # a run on the merged file with nothing to do leaves it a merge: merged again, it is replaced
    assert run_job(job_spec(demo, tmp_path, records), progress=False, simulate=StandIn(step_ms=1.0))["nothing_to_do"]
    assert merge_job(spec)["records"] == 30
    # the merged file keeps the shards' settings: a run on it with others stops, as on a run's file
    with pytest.raises(OutputError, match=r"out.jsonl holds results of a run with other settings "
                                          r"\(sampling.max_new_tokens 6 then, 5 now\)"):
        run_job(job_spec(demo, tmp_path, records, sampling={"max_new_tokens": 5}), progress=False,
                simulate=StandIn(step_ms=1.0))
    # and shards computed with other settings than the spec's are not merged
    run_job(job_spec(demo, tmp_path, records, input={"shard": "1/3"}, sampling={"max_new_tokens": 5}),
            overwrite=True, progress=False, simulate=StandIn(step_ms=1.0))
    with pytest.raises(OutputError, match=r"msinfer merge: shard 1 of 3 \(.*out.1-of-3.jsonl\) holds results of a "
                                          r"run with other settings than the spec's \(sampling.max_new_tokens 5 then, "
                                          r"6 now\); .* Nothing was written"):
        merge_job(spec)
    # shards of which some are stand-ins and some a run's: named as such, whichever comes first
    status = tmp_path / "out.2-of-3.jsonl.status.json"
    kept = json.loads(status.read_text())
    status.write_text(json.dumps({**kept, "settings": {**kept["settings"], "simulate": False}}))
    with pytest.raises(OutputError, match=r"msinfer merge: shard\(s\) 0, 1 of 3 hold stand-in results of msinfer "
                                          r"simulate, and shard\(s\) 2 a run's; .* Nothing was written"):
        merge_job(spec)

    # input.shard_by file: shard 1 of 2 reads b.jsonl and d.jsonl only; c.jsonl is not even UTF-8
    folder = tmp_path / "files"
    folder.mkdir()
    for name in "abcd":
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"prompt_token_ids": [60 + i, ord(name) % 50]}) + "\n"
                                                     for i in range(3)))
    (folder / "c.jsonl").write_bytes(b"\xff\xfe not a record\n")
    spec = job_spec(demo, tmp_path, records, input={"path": str(folder), "shard": "1/2", "shard_by": "file"},
                    output={"path": str(tmp_path / "by-file.jsonl")})
    summary = run_job(spec, progress=False, simulate=StandIn(step_ms=1.0))
    part = results(tmp_path / "by-file.1-of-2.jsonl")
    assert summary["records_done"] == 6 and sorted(part) == [f"{f}.jsonl:{n}" for f in "bd" for n in (1, 2, 3)]
    assert all(r["error"] is None for r in part.values())


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, float] | None:
    """The samples of a Prometheus text page, by name and labels; None where nothing answers."""
    import urllib.error
    import urllib.request
    try:
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_the_metrics_endpoint_answers_during_a_job_with_counters_that_grow_and_closes_after_it(
        demo, tmp_path, ray_local):
    """output.metrics_port: scraped while a dp 2 job runs, the counters grow and end at the
    summary's figures; the gauges name both replicas; after the job nothing listens. A port in
    use is refused by the plan (exit 2), naming the key."""
    import threading

    port = free_port()
    records = [{"id": f"r{i}", "prompt_token_ids": [40 + i] * 20, "sampling": {"max_new_tokens": 12}}
               for i in range(24)]
    spec = job_spec(demo, tmp_path, records, output={"metrics_port": port}, parallel={"data_parallel": 2})
    url = f"http://127.0.0.1:{port}/metrics"
    seen, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            got = scrape(url)
            if got is not None:
                seen.append(got)
            stop.wait(0.05)
    t = threading.Thread(target=poll)
    t.start()
    try:
        summary = run_job(spec, progress=False, simulate=StandIn(step_ms=15.0))
    finally:
        stop.set()
        t.join()
    done = [s["msinfer_records_done_total"] for s in seen]
    assert done == sorted(done) and done[0] < done[-1] <= 24, done
    assert any(0 < d < 24 for d in done), done               # seen mid-job
    assert any(s["msinfer_records_in_flight"] > 0 for s in seen)
    assert any(s.get('msinfer_kv_cache_usage{replica="0"}', 0) > 0 for s in seen)
    assert all(s["msinfer_replicas_alive"] == 2 for s in seen if 'msinfer_kv_cache_usage{replica="1"}' in s)
    last = seen[-1]
    if last["msinfer_records_done_total"] == 24:             # the last scrape came after the last result
        assert last["msinfer_generated_tokens_total"] == summary["completion_tokens"] == 24 * 12
        assert last["msinfer_prompt_tokens_total"] == 24 * 20
        assert last["msinfer_record_latency_seconds_count"] == 24
        assert last["msinfer_records_cut_total"] == summary["records_cut"] == 24     # each at max_new_tokens
    assert "msinfer_records_rebalanced_total" in last
    assert max(s["msinfer_record_latency_seconds_count"] for s in seen) >= 1
    assert scrape(url) is None                                 # closed with the job
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with pytest.raises(OutputError, match=rf"output.metrics_port {taken}: the metrics endpoint cannot listen"):
            plan_job(job_spec(demo, tmp_path, records, output={"metrics_port": taken}), weights=False)
    # a host that is no address (or not this machine's) is the host's fault, not the port's
    for host in ("999.1.1.1", "198.51.100.7"):
        with pytest.raises(OutputError, match=rf"output.metrics_host {host}: .* give an address of this machine"):
            plan_job(job_spec(demo, tmp_path, records, output={"metrics_port": 9421, "metrics_host": host}),
                     weights=False)


def test_a_systemic_error_in_an_engine_stops_the_job(ray_local):
    """A cause that is not the record's (SystemicError from the tokenizer) raised in an engine
    stops the job with that error, instead of failing the replica over and over."""
    import ray
    from msinfer.launcher.controller import Controller, ControllerConfig, Slot
    from msinfer.launcher.errors import SystemicError
    from msinfer.launcher.inputs import Record

    @ray.remote
    class Raises:
        def exchange(self, payload, more, suspects=(), give_back=False):
            raise SystemicError("the tokenizer cannot encode records: ImportError: jinja2")

    class Stub:
        engine = Raises.remote()

        def shutdown(self):
            pass

    c = Controller(ControllerConfig(engine_config=None))
    c.slots = [Slot(0, Stub(), want=1)]
    with pytest.raises(SystemicError, match="jinja2"):
        c.run(iter([Record("a", 1, prompt="x")]), lambda done, rec: None)
    assert c.restarts == 0


def test_records_that_all_fail_alike_stop_the_job_without_their_error_lines(demo, tmp_path, ray_local):
    """When the first 100 records all failed with one cause (here: inputs made for another
    vocabulary), or every record of a smaller job, the job stops with that cause instead of writing an error line per record, and
    writes none of them, so that a re-run computes them. One good record before them (its result
    comes after theirs), and the failures are the records' own: written, and the job goes on."""
    from msinfer.launcher.errors import SystemicError
    from msinfer.launcher.job import SAME_CAUSE_STOP

    bad = [{"id": f"b{i}", "prompt_token_ids": [1, 10**6]} for i in range(SAME_CAUSE_STOP + 20)]
    spec = job_spec(demo, tmp_path, bad)
    with pytest.raises(SystemicError, match=rf"the first {SAME_CAUSE_STOP} records all failed alike \(record 'b0' "
                                            r"was the first\): a record: token id 1000000 is outside the vocabulary"):
        run_job(spec, progress=False, simulate=StandIn(step_ms=1.0))
    assert not (tmp_path / "out.jsonl").read_text()
    with pytest.raises(SystemicError, match=r"all 3 records failed alike \(record 'b0' was the first\)"):
        run_job(job_spec(demo, tmp_path, bad[:3]), progress=False, simulate=StandIn(step_ms=1.0))  # a small job
    assert not (tmp_path / "out.jsonl").read_text()
    one = run_job(job_spec(demo, tmp_path, bad[:1]), progress=False, simulate=StandIn(step_ms=1.0))
    assert one["records_failed"] == 1           # one record is not "alike": its error line is written

    spec = job_spec(demo, tmp_path, [{"id": "good", "prompt_token_ids": [1, 2, 3]}] + bad)
    summary = run_job(spec, overwrite=True, progress=False, simulate=StandIn(step_ms=1.0))
    assert summary["records_done"] == 1 and summary["records_failed"] == len(bad)
    assert len(results(tmp_path / "out.jsonl")) == len(bad) + 1


def test_a_sampling_key_at_the_top_of_a_record_fails_it_and_records_alike_stop_the_job(demo, tmp_path, ray_local):
    """{"prompt": ..., "max_tokens": 5} (OpenAI's and vLLM's place and name) would be run with the
    job's sampling without a word: the record fails instead, its error line naming the key and
    where it belongs, and a job whose records all do it stops (alike, whatever their values).
    Other keys at the top of a record stay the user's own and are not read."""
    from msinfer.launcher.errors import SystemicError

    records = [{"id": "meta", "prompt_token_ids": [1, 2, 3], "source": "wiki"},
               {"id": "top", "prompt_token_ids": [1, 2, 3], "max_tokens": 2, "temperature": 0.7},
               {"id": "good", "prompt_token_ids": [4, 5], "sampling": {"max_new_tokens": 2}}]
    summary = run_job(job_spec(demo, tmp_path, records), progress=False, simulate=StandIn(step_ms=1.0))
    assert summary["records_done"] == 2 and summary["records_failed"] == 1
    got = results(tmp_path / "out.jsonl")
    assert len(got["meta"]["output_token_ids"]) == 6 and len(got["good"]["output_token_ids"]) == 2
    assert got["top"]["error"]["message"] == (
        "record 'top': keys at the top of the record that belong inside others: 'max_tokens' (meant as "
        "sampling.max_new_tokens?), 'temperature' (meant as sampling.temperature?). A record's sampling is read "
        "from its 'sampling' object only, and its chat template's variables from its 'chat_template_kwargs'")
    alike = [{"id": f"r{i}", "prompt_token_ids": [1, 2], "max_tokens": i + 1} for i in range(3)]
    with pytest.raises(SystemicError, match=r"all 3 records failed alike \(record 'r0' was the first\): a record: "
                                            r"keys at the top of the record that belong inside others: "
                                            r"'max_tokens'"):
        run_job(job_spec(demo, tmp_path, alike), overwrite=True, progress=False, simulate=StandIn(step_ms=1.0))


def test_a_re_run_with_other_settings_on_a_results_file_stops_instead_of_keeping_the_old_results(
        demo, tmp_path, ray_local):
    """A re-run skips the records its results file holds: with other sampling (or another model,
    dtype, ...) they would keep the first run's results without a word. It stops (exit 2) naming
    what changed; the same settings resume, a model moved to another folder is the same model,
    and --overwrite starts over."""

    records = [{"id": f"r{i}", "prompt_token_ids": [1, 2, 3 + i]} for i in range(3)]
    records.append({"id": "bad", "prompt_token_ids": [10**6]})          # an error line
    first = run_job(job_spec(demo, tmp_path, records), progress=False, simulate=StandIn(step_ms=1.0))
    assert first["records_done"] == 3 and first["records_failed"] == 1
    written = (tmp_path / "out.jsonl").read_text()
    other = job_spec(demo, tmp_path, records, sampling={"max_new_tokens": 3, "temperature": 0.5})
    with pytest.raises(OutputError, match=r"out.jsonl holds results of a run with other settings "
                                          r"\(sampling.max_new_tokens 6 then, 3 now, sampling.temperature 0.0 then, "
                                          r"0.5 now\)\. .* Run with --overwrite"):
        run_job(other, progress=False, simulate=StandIn(step_ms=1.0), retry_failed=True)
    assert (tmp_path / "out.jsonl").read_text() == written         # its error line kept too
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in demo.iterdir():
        (moved / f.name).symlink_to(f)
    again = job_spec(demo, tmp_path, records, model={"path": str(moved)})
    assert run_job(again, progress=False, simulate=StandIn(step_ms=1.0))["records_skipped"] == 4
    fresh = run_job(other, overwrite=True, progress=False, simulate=StandIn(step_ms=1.0))
    assert fresh["records_done"] == 3
    assert [len(r["output_token_ids"]) for i, r in sorted(results(tmp_path / "out.jsonl").items()) if i != "bad"] \
        == [3, 3, 3]


def test_a_re_run_whose_records_changed_since_their_results_stops_naming_them_or_redoes_them(
        demo, tmp_path, ray_local):
    """A re-run skips the ids its results file holds: a record edited since (or, where ids are line
    numbers, a .txt file whose lines moved) would keep the answer to its old input without a word.
    The run stops naming them (exit 2, the file as it was), and `msinfer plan` says it would;
    --redo-changed computes just those again; lines appended to the input are only new records; --retry-failed's error lines are not
    counted as changed."""
    from msinfer.launcher.job import resume_summary

    def run(spec, **kw):
        return run_job(spec, progress=False, simulate=StandIn(step_ms=1.0), **kw)

    records = [{"id": f"r{i}", "prompt_token_ids": [1, 2, 3 + i]} for i in range(3)]
    records.append({"id": "bad", "prompt_token_ids": [10**6]})          # an error line
    assert run(job_spec(demo, tmp_path, records))["records_failed"] == 1
    written = (tmp_path / "out.jsonl").read_text()
    assert resume_summary(plan_job(job_spec(demo, tmp_path, records), weights=False), simulate=True) == (
        f"{tmp_path / 'out.jsonl'} holds 4 result line(s), 1 of them errors; `run` resumes after them "
        f"(--overwrite starts over)")                                   # what `msinfer plan` says
    first, rest = written.split("\n", 1)
    (tmp_path / "out.jsonl").write_text("#" + first + "\n" + rest)           # a first line that is not JSON
    assert ("; `run` would stop: results file " + f"{tmp_path / 'out.jsonl'}, line 1: not a whole JSON result") \
        in resume_summary(plan_job(job_spec(demo, tmp_path, records), weights=False), simulate=True)
    (tmp_path / "out.jsonl").write_text(written)
    records[1]["prompt_token_ids"] = [1, 2, 9, 9, 9]
    records[3]["prompt_token_ids"] = [1, 2]                              # fixed
    assert "; `run` would stop: " in resume_summary(plan_job(job_spec(demo, tmp_path, records), weights=False),
                                                    simulate=True)
    with pytest.raises(OutputError, match=r"out.jsonl holds results of 2 record\(s\) whose input in .*in.jsonl "
                                          r"changed since they were written: 'r1' \(line 2\), 'bad' \(line 4\)\. "
                                          r".* Run with --redo-changed"):
        run(job_spec(demo, tmp_path, records))
    with pytest.raises(OutputError, match=r"results of 1 record\(s\) .*: 'r1' \(line 2\)\."):
        run(job_spec(demo, tmp_path, records), retry_failed=True)
    assert (tmp_path / "out.jsonl").read_text() == written
    summary = run(job_spec(demo, tmp_path, records), retry_failed=True, redo_changed=True)
    assert (summary["records_redone"], summary["records_retried"], summary["records_done"]) == (1, 1, 2)
    got = results(tmp_path / "out.jsonl")
    assert {i: r["prompt_tokens"] for i, r in got.items()} == {"r0": 3, "r1": 5, "r2": 3, "bad": 2}
    assert not any(r["error"] for r in got.values())
    assert run(job_spec(demo, tmp_path, records))["records_skipped"] == 4           # nothing changed since

    txt = tmp_path / "p.txt"
    txt.write_text("one two\nthree four five\n")
    spec = job_spec(demo, tmp_path, [], input={"path": str(txt)}, output={"path": str(tmp_path / "txt.jsonl")})
    assert run(spec)["records_done"] == 2
    txt.write_text("one two\nthree four five\nsix\n")                             # appended: a new record
    assert (run(spec)["records_done"], results(tmp_path / "txt.jsonl")["3"]["prompt_tokens"]) == (1, 1)
    txt.write_text("zero\none two\nthree four five\nsix\n")                       # a line inserted: ids move
    with pytest.raises(OutputError, match=r"results of 3 record\(s\) whose input in .*p.txt changed since they "
                                          r"were written: '1' \(line 1\), '2' \(line 2\), '3' \(line 3\)\."):
        run(spec)
    out = tmp_path / "txt.jsonl"            # the user removes two result lines, to compute them again
    out.write_text("".join(x for x in out.read_text().splitlines(keepends=True) if '"id": "3"' in x))
    with pytest.raises(OutputError, match=r"results of 1 record\(s\) .*: '3' \(line 3\)\."):
        run(spec)

    # A line removed, or blanked: the lines after it move up, and the result of the last line
    # (or of the blank one) names a record that is no longer there.
    records = [{"prompt_token_ids": [1, 2, 3 + i]} for i in range(4)]             # ids: line numbers
    spec = job_spec(demo, tmp_path, records, output={"path": str(tmp_path / "lines.jsonl")})
    assert run(spec)["records_done"] == 4
    del records[0]
    spec = job_spec(demo, tmp_path, records, output={"path": str(tmp_path / "lines.jsonl")})
    with pytest.raises(OutputError, match=r"results of 4 record\(s\) .*'1' \(line 1\), '2' \(line 2\), "
                                          r"'3' \(line 3\), '4' \(line 4, no longer a record\)\."):
        run(spec)
    summary = run(spec, redo_changed=True)
    assert (summary["records_redone"], summary["records_removed"], summary["records_done"]) == (3, 1, 3)
    assert sorted(results(tmp_path / "lines.jsonl")) == ["1", "2", "3"]
    assert run(spec)["records_skipped"] == 3                                       # each line answers its record
    (tmp_path / "in.jsonl").write_text("\n".join([json.dumps(records[0]), "", json.dumps(records[2])]) + "\n")
    with pytest.raises(OutputError, match=r"results of 1 record\(s\) .*'2' \(line 2, no longer a record\)\."):
        run(spec)
    assert run(spec, redo_changed=True)["records_removed"] == 1 and sorted(results(tmp_path / "lines.jsonl")) == [
        "1", "3"]

    # An id a record gives itself is no line number ('100' beside the line-numbered error line of
    # a line that is not JSON): a re-run resumes. Once that line holds a record with an id of its
    # own, the error line of line 2 answers no record: named, and dropped with --redo-changed.
    spec = job_spec(demo, tmp_path, [], output={"path": str(tmp_path / "own.jsonl")})
    (tmp_path / "in.jsonl").write_text('{"id": "100", "prompt_token_ids": [1, 2, 3]}\noops\n')
    assert (run(spec)["records_done"], run(spec)["records_skipped"]) == (1, 2)
    (tmp_path / "in.jsonl").write_text('{"id": "100", "prompt_token_ids": [1, 2, 3]}\n'
                                       '{"id": "b3", "prompt_token_ids": [1, 2]}\n')
    with pytest.raises(OutputError, match=r"results of 1 record\(s\) .*'2' \(line 2, no longer a record\)\."):
        run(spec)
    assert run(spec, redo_changed=True)["records_removed"] == 1 and sorted(results(tmp_path / "own.jsonl")) == [
        "100", "b3"]


def test_records_whose_prompts_begin_alike_go_to_the_replica_their_beginning_names(demo, tmp_path, ray_local):
    """At dp 2 with prefix caching: 4 groups of 6 records (two groups named to each replica by
    the hash of their beginning), a queue of 16 records per replica. The first record of each
    group goes by load (to the first replica, dealt first); the others to the group's replica. By
    load alone (scheduler.route_by_prefix: false) the second replica gets the last 8 records."""
    from msinfer.launcher.controller import route_key
    from msinfer.launcher.inputs import Record
    from msinfer.launcher.job import start_controller

    groups, g = {0: [], 1: []}, 0
    while min(len(v) for v in groups.values()) < 2:     # two groups for each replica
        prefix = [100 + 7 * g + j for j in range(60)]
        key = route_key(Record("x", 1, prompt_token_ids=prefix + [1, 2, 3]))
        if len(groups[key % 2]) < 2:
            groups[key % 2].append(prefix)
        g += 1
    prefixes = groups[0] + groups[1]                     # groups 0, 1 -> replica 0; 2, 3 -> replica 1
    records = [Record(f"r{i}", i + 1, prompt_token_ids=prefixes[i % 4] + [i + 1, 2, 3]) for i in range(24)]
    for route in (True, False):
        spec = job_spec(demo, tmp_path, [], parallel={"data_parallel": 2},
                        scheduler={"max_batch_size": 8, "route_by_prefix": route})
        controller, _ = start_controller(plan_job(spec, weights=False), StandIn(step_ms=2.0))
        controller.rebalance = False    # the tail's moves (by load) would mix into the dealing asserted
        try:
            done = []
            controller.run(iter(records), lambda d, rec: done.append(rec.id))
            stats = controller.engine_stats()
        finally:
            controller.shutdown()
        assert sorted(done) == sorted(r.id for r in records)
        admitted = [st["prompt_tokens"] // 63 for st in stats]
        cached = sum(st["cached_tokens"] for st in stats) // 48
        if route:       # replica 0: every group's first record and groups 0, 1; replica 1: groups 2, 3
            assert admitted == [4 + 2 * 5, 2 * 5]
            assert cached == 2 * 5 + 2 * 4          # replica 1 computes groups 2 and 3 once more
        else:           # replica 1 takes the last 8 and computes every group's prefix once more
            assert admitted == [16, 8] and cached == 4 * 3 + 4 * 1


def test_async_scheduling_gives_the_same_results_when_sequences_stop(checkpoint):
    """Async scheduling decodes a sequence once more before the engine sees it stop; that token
    must not reach the results: the same tokens, finish reasons and log-probabilities as without
    it, one result per record (the real network, a small test checkpoint)."""
    from tests.engine_driver import run_engine
    path = checkpoint("llama_gqa_tied")
    records = [{"id": f"r{i:02d}", "prompt_token_ids": [5 + i, 17, 33, 9][:2 + i % 3]} for i in range(6)]

    def run(async_scheduling, **sampling):
        spec = JobSpec.model_validate({
            "model": {"path": str(path), "max_model_len": 64}, "input": {"path": "in.jsonl"},
            "output": {"path": "out.jsonl"},
            "sampling": {"max_new_tokens": 12, "logprobs": 1, "ignore_eos": True, **sampling},
            "scheduler": {"max_batch_size": 2, "async_scheduling": async_scheduling}})
        return run_engine(plan_job(spec, check_io=False), records)

    def bytes_per_decode(engine) -> float:
        """Bytes copied from the device per sequence of a decode step (engine.step_s: STEP_FIGURES)."""
        figures = dict(zip(STEP_FIGURES, engine.step_s["decode"]))
        return figures["host_bytes"] / figures["seqs"]

    lines, engine = run(True)
    free = {rid: r["output_token_ids"] for rid, r in lines.items()}
    # sampled on the device: per row the token, its log-probability and the top k's (value and id)
    # leave it; the CPU kernels' static shapes add padding rows (at most one per sequence here)
    assert 4 + 4 + 8 * 1 <= bytes_per_decode(engine) <= 2 * (4 + 4 + 8 * 1)
    assert bytes_per_decode(run(True, logprobs=3)[1]) / bytes_per_decode(engine) == (4 + 4 + 8 * 3) / (4 + 4 + 8 * 1)
    stop = sorted({out[3] for out in free.values()})[:2]      # a token most generations reach early
    runs = {mode: run(mode, stop_token_ids=stop)[0] for mode in (True, False)}
    stopped = 0
    for rid, out in free.items():
        cut = next((i + 1 for i, t in enumerate(out) if t in stop), len(out))
        stopped += cut < len(out)
        for mode, results in runs.items():
            r = results[rid]
            assert r["output_token_ids"] == out[:cut], (mode, rid)
            assert r["finish_reason"] == ("stop" if out[cut - 1] in stop else "length")
            assert len(r["logprobs"]) == cut
        assert runs[True][rid]["logprobs"] == runs[False][rid]["logprobs"]
    assert stopped >= 2


def test_an_engine_closed_with_a_wait_returns_after_the_step_its_rank_in_this_process_runs(checkpoint):
    """Async scheduling leaves a step decoding ahead after a job's last record stops. A runner of
    the same process whose graph starts while it runs fails MindSpore's JIT ("Nested execution
    ... is not supported"), so close(wait_s) returns only once that step has finished."""
    import pickle
    import threading
    import time
    from msinfer.launcher.engine import Engine, EngineSetup
    from tests.engine_driver import in_process_rank
    spec = JobSpec.model_validate({
        "model": {"path": str(checkpoint("llama_gqa_tied")), "max_model_len": 64}, "input": {"path": "in.jsonl"},
        "output": {"path": "out.jsonl"}, "sampling": {"max_new_tokens": 4}})
    plan = plan_job(spec, check_io=False)
    rank = in_process_rank(plan.engine)
    gate, step = threading.Event(), rank.step.fn
    rank.step.fn = lambda *args: (gate.wait(30), step(*args))[1]
    engine = Engine(EngineSetup(plan.spec, plan.model, plan.engine), 0, plan.tokenizer)
    engine.attach([rank])
    engine.exchange(pickle.dumps([(0, parse_record({"id": "r", "prompt_token_ids": [5, 17, 33]}, 1))]), True)
    t_end = time.monotonic() + 30
    while not engine.in_flight and time.monotonic() < t_end:
        time.sleep(0.01)
    running = [f for s in list(engine.in_flight) for f in s.refs]
    assert running and not any(f.done() for f in running)
    threading.Timer(2.5, gate.set).start()      # past the loop's own check for closing (each second)
    engine.close(wait_s=30)
    assert all(f.done() for f in running) and not engine.thread.is_alive()


def test_a_kinds_seconds_cover_its_ranks_steps_even_when_a_step_ends_before_its_submission_returns(checkpoint):
    """The summary's steps.prefill_s and decode_s (the replica's wall time, by kind of step)
    hold the ranks' own time in the steps (worker_s): a step's time counts from before its
    submission, since a rank (LocalRank's thread) may start and even finish it before the call
    that submits it returns. A rank here runs each step inside that call."""
    from concurrent.futures import Future
    from msinfer.launcher.engine import Engine, EngineSetup, LocalRank
    from msinfer.launcher.simulate import StandInRunner
    from msinfer.worker.protocol import unpack_step
    spec = JobSpec.model_validate({
        "model": {"path": str(checkpoint("llama_gqa_tied")), "max_model_len": 64}, "input": {"path": "in.jsonl"},
        "output": {"path": "out.jsonl"}, "sampling": {"max_new_tokens": 6, "ignore_eos": True}})
    plan = plan_job(spec, check_io=False, weights=False)
    runner = StandInRunner(plan.engine, StandIn(step_ms=10))

    class AtOnce:
        def remote(self, payload, is_prefill, index):
            seqs, released = unpack_step(payload)
            done = Future()
            done.set_result(runner.step(seqs, is_prefill, released=released))
            return done
    rank = LocalRank(None)
    rank.step = AtOnce()
    engine = Engine(EngineSetup(plan.spec, plan.model, plan.engine), 0)
    engine.attach([rank])
    try:
        done = exchange_until_done(engine, [parse_record({"id": f"r{i}", "prompt_token_ids": [5 + i, 17, 33]}, i + 1)
                                            for i in range(3)])
    finally:
        engine.close()
    assert len(done) == 3
    figures = {kind: dict(zip(STEP_FIGURES, values)) for kind, values in engine.step_s.items()}
    for kind in ("prefill", "decode"):
        assert figures[kind]["steps"] > 0 and figures[kind]["worker_s"] >= 0.01 * figures[kind]["steps"]
    assert sum(f["worker_s"] for f in figures.values()) <= sum(f["s"] for f in figures.values())


def test_a_drain_takes_back_the_records_an_engine_has_not_started_and_the_rest_finish(checkpoint):
    """The exchange that starts a drain (give_back) takes out of the engine every record none of
    whose sequences holds anything yet (queued; a record of n samples with one under way stays
    whole), and reports their serials, unanswered; every other record finishes with its result:
    each record exactly once, one way or the other (the real network, a small test checkpoint)."""
    import pickle
    import time
    from msinfer.launcher.engine import Engine, EngineSetup
    from tests.engine_driver import in_process_rank
    path = checkpoint("llama_gqa_tied")
    spec = JobSpec.model_validate({
        "model": {"path": str(path), "max_model_len": 64}, "input": {"path": "in.jsonl"},
        "output": {"path": "out.jsonl"}, "sampling": {"max_new_tokens": 32, "ignore_eos": True},
        "scheduler": {"max_batch_size": 2}})
    plan = plan_job(spec, check_io=False)
    engine = Engine(EngineSetup(plan.spec, plan.model, plan.engine), 0, plan.tokenizer)
    engine.attach([in_process_rank(plan.engine)])
    records = [parse_record({"id": f"r{i}", "prompt_token_ids": [5 + i, 17, 33], **(
        {"sampling": {"n": 2, "temperature": 1.0}} if i == 1 else {})}, i + 1) for i in range(24)]
    try:
        # returns with the first results, or after its wait with none: either way under way
        answered, returned = [], []
        out, _, _, _, back = pickle.loads(engine.exchange(pickle.dumps(list(enumerate(records))), False))
        answered += out
        t_end = time.monotonic() + 120
        give_back = True
        while len(answered) + len(returned) < len(records) and time.monotonic() < t_end:
            out, _, _, _, back = pickle.loads(engine.exchange(None, False, (), give_back))
            give_back = False
            answered += out
            returned += back
    finally:
        engine.close()
    done = [d.serial for d in answered]
    assert sorted(done + returned) == list(range(len(records))) and not set(done) & set(returned)
    assert 0 in done and len(returned) >= len(records) // 2, (done, returned)      # batch 2: most queued
    assert all(not d.failed for d in answered) and engine.unfinished == 0


def test_a_suspect_record_given_back_before_it_started_lets_the_next_suspect_run(checkpoint):
    """Records that were running when a replica failed (suspects) run one at a time. One admitted
    but not started when the driver takes queued records back (a drain, or the job's tail) leaves
    the engine: the next suspect dealt to it must still run. It waited forever (the job hung with
    one record left after a replica of sixteen was killed)."""
    import pickle
    import threading
    import time
    from msinfer.launcher.engine import Engine, EngineSetup
    from tests.engine_driver import in_process_rank
    spec = JobSpec.model_validate({
        "model": {"path": str(checkpoint("llama_gqa_tied")), "max_model_len": 64}, "input": {"path": "in.jsonl"},
        "output": {"path": "out.jsonl"}, "sampling": {"max_new_tokens": 24, "ignore_eos": True},
        "scheduler": {"max_batch_size": 1}})
    plan = plan_job(spec, check_io=False)
    engine = Engine(EngineSetup(plan.spec, plan.model, plan.engine), 0, plan.tokenizer)
    engine.attach([in_process_rank(plan.engine)])
    record = [parse_record({"id": f"r{i}", "prompt_token_ids": [5 + i, 17, 33]}, i + 1) for i in range(3)]
    answered, returned = [], []

    def exchange(*args):
        out, _, _, _, back = pickle.loads(engine.exchange(*args))
        answered.extend(out)
        returned.extend(back)
    try:
        # the first record takes the one batch slot; the suspect is admitted behind it
        gate, step = threading.Event(), engine.workers[0].step.fn
        engine.workers[0].step.fn = lambda *args: (gate.wait(60), step(*args))[1]
        exchange(pickle.dumps([(0, record[0])]), True)
        t_end = time.monotonic() + 60
        while not engine.in_flight and time.monotonic() < t_end:
            time.sleep(0.01)
        exchange(pickle.dumps([(1, record[1])]), True, (1,))
        while engine.on_probation is None and time.monotonic() < t_end:
            time.sleep(0.01)
        exchange(None, False, (), True)
        while 1 not in returned and time.monotonic() < t_end:
            exchange(None, False)
        assert returned == [1]                        # the suspect went back, unstarted
        gate.set()
        exchange(pickle.dumps([(2, record[2])]), False, (2,))
        while {0, 2} - {d.serial for d in answered} and time.monotonic() < t_end:
            exchange(None, False)
    finally:
        gate.set()
        engine.close()
    assert {d.serial for d in answered} == {0, 2} and returned == [1], (answered, returned)
