import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from msinfer.launcher.errors import RecordError, SpecError, UserError
from msinfer.launcher.spec import JobSpec, SamplingSpec, load_spec
from msinfer.worker.protocol import SamplingParams

MINIMAL = """\
model:
  path: models/tiny
input:
  path: prompts.jsonl
output:
  path: out/results.jsonl
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def spec_error(tmp_path, text, overrides=()) -> str:
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, text), list(overrides))
    assert isinstance(e.value, UserError)
    return str(e.value)


def test_minimal_spec_defaults_and_relative_paths(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL))
    assert spec.task == "generate"
    assert spec.model.path == str(tmp_path / "models/tiny")
    assert spec.model.tokenizer_path == spec.model.path
    assert spec.input.path == str(tmp_path / "prompts.jsonl")
    assert spec.output.path == str(tmp_path / "out/results.jsonl")
    assert spec.parallel.tensor_parallel == 1 and spec.parallel.placement == "pack"
    assert spec.scheduler.kv_cache_blocks is None and spec.model.max_model_len is None
    assert spec.sampling.to_params() == SamplingParams()


def test_relative_paths_resolve_against_the_spec_folder_not_cwd(tmp_path, monkeypatch):
    (tmp_path / "jobs").mkdir()
    monkeypatch.chdir(tmp_path)
    spec = load_spec(write(tmp_path / "jobs", MINIMAL))
    assert spec.input.path == str(tmp_path / "jobs/prompts.jsonl")


def test_tilde_and_env_expand(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DATA", "/data/set")
    text = MINIMAL.replace("models/tiny", "~/models/tiny").replace("prompts.jsonl", "${DATA}/p.parquet")
    text += "  status_interval_s: 0.5\n"
    text = text.replace("model:\n", "model:\n  tokenizer: ${DATA}/../tok\n  lora: {path: ~/lora}\n")
    spec = load_spec(write(tmp_path, text))
    assert spec.model.path == str(tmp_path / "home/models/tiny")
    assert spec.model.tokenizer == "/data/tok"
    assert spec.model.lora.path == str(tmp_path / "home/lora") and spec.model.lora.scale == 1.0
    assert spec.input.path == "/data/set/p.parquet"
    monkeypatch.delenv("NO_SUCH_VAR", raising=False)
    monkeypatch.setenv("EMPTY", "")
    text = MINIMAL.replace("models/tiny", "${NO_SUCH_VAR:-~/cache}/tiny").replace("prompts.jsonl", "${EMPTY:-/in}/p.txt")
    spec = load_spec(write(tmp_path, text.replace("out/results", "${DATA:-/unused}/results")))
    assert (spec.model.path, spec.input.path) == (str(tmp_path / "home/cache/tiny"), "/in/p.txt")
    assert spec.output.path.startswith("/data/set/results")


def test_unset_env_var_names_variable_and_key(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_VAR", raising=False)
    msg = spec_error(tmp_path, MINIMAL.replace("out/results", "${NO_SUCH_VAR}/results"))
    assert "output.path" in msg and "NO_SUCH_VAR" in msg and "job.yaml:6" in msg


def test_unknown_key_suggests_closest(tmp_path):
    msg = spec_error(tmp_path, MINIMAL + "scheduler:\n  max_batch: 4\n")
    assert "job.yaml:8: scheduler.max_batch: unknown key; did you mean 'max_batch_size'" in msg
    msg = spec_error(tmp_path, MINIMAL + "samplng:\n  top_k: 4\n")
    assert "samplng: unknown key; did you mean 'sampling'?" in msg
    msg = spec_error(tmp_path, MINIMAL + "parallel:\n  zzz: 4\n")
    assert "parallel.zzz: unknown key; valid keys here: tensor_parallel, data_parallel, device, placement" in msg
    msg = spec_error(tmp_path, MINIMAL.replace("path: models/tiny", "path: m\n  positions: {schem: rope}"))
    assert "model.positions.schem: unknown key; did you mean 'scheme'?" in msg


def test_missing_required_keys_named(tmp_path):
    msg = spec_error(tmp_path, "model:\n  dtype: auto\ninput:\n  path: p.txt\n")
    assert "model.path: missing required key" in msg
    assert "output: missing required key" in msg
    assert msg.startswith("2 problems in the job spec:")


@pytest.mark.parametrize("section, key, value, expected", [
    ("parallel", "tensor_parallel", "0", "expected an integer >= 1, got 0"),
    ("parallel", "tensor_parallel", "'2'", "expected an integer, got '2'"),
    ("parallel", "device", "gpu", "expected one of 'auto', 'cpu' or 'ascend', got 'gpu'"),
    ("sampling", "temperature", "-0.5", "expected a number >= 0, got -0.5"),
    ("sampling", "top_p", "0", "expected a number > 0, got 0"),
    ("sampling", "top_p", "1.5", "expected a number <= 1, got 1.5"),
    ("sampling", "top_k", "-2", "expected an integer >= -1, got -2"),
    ("sampling", "temperature", "2.5", "expected a number <= 2, got 2.5"),
    ("sampling", "max_new_tokens", "0", "expected an integer >= 1, got 0"),
    ("sampling", "stop", "5", "expected a string or a list of strings (a number quoted: '5'), got 5"),
    ("sampling", "temperature", ".nan", "expected a finite number"),
    ("model", "graph_mode", "maybe", "expected true or false, got 'maybe'"),
    ("scheduler", "kv_cache_blocks", "0", "expected an integer >= 1, got 0"),
    ("output", "status_interval_s", "0", "expected a number > 0"),
    ("output", "metrics_port", "-1", "expected an integer >= 1, got -1"),
    ("output", "metrics_port", "70000", "expected an integer <= 65535, got 70000"),
    ("output", "metrics_port", "'9100'", "expected an integer, got '9100'"),
    ("input", "lookahead", "0", "expected an integer >= 1, got 0"),
    ("input", "lookahead", "many", "expected an integer, got 'many'"),
    ("input", "order", "random", "expected one of"),
    ("input", "shard", "3/3", "'3/3': K must be from 0 to N-1 (K 3, N 3)"),
    ("input", "shard", "a/b", "expected 'K/N' (this task's number K, from 0, of N tasks) or 'auto'"),
    ("fault", "drain_s", "-1", "expected a number >= 0, got -1"),
    ("run", "deadline", "2020-01-01T00:00", "'2020-01-01T00:00' is in the past"),
    ("run", "deadline", "'2020-01-01T00:00:00+00:00'", "'2020-01-01T00:00:00+00:00' is in the past"),
    ("run", "deadline", "soon", "expected a duration ('90s', '45m', '2h', '1h30m') or a date and time"),
    ("run", "deadline", "0s", "a deadline must be a finite time later than now, got '0s'"),
    ("run", "deadline", "nan", "a deadline must be a finite time later than now, got 'nan'"),
])
def test_range_and_type_checks(tmp_path, section, key, value, expected):
    text = MINIMAL.replace("model:\n", "model:\n  graph_mode: true\n") if section != "model" else MINIMAL
    if section in ("model", "output", "input"):
        text = text.replace(f"{section}:\n", f"{section}:\n  {key}: {value}\n")
    else:
        text += f"{section}:\n  {key}: {value}\n"
    msg = spec_error(tmp_path, text)
    assert f"{section}.{key}: {expected}" in msg


@pytest.mark.parametrize("value, seconds", [("90s", 90), ("45m", 2700), ("2h", 7200), ("1h30m", 5400),
                                            ("1d", 86400), ("120", 120), ("0.5h", 1800)])
def test_a_deadline_as_a_duration_counts_from_now(value, seconds):
    from msinfer.launcher.drain import parse_deadline
    assert parse_deadline(value, now=1000.0) == 1000.0 + seconds


def test_a_deadline_as_a_date_and_time(tmp_path):
    """Unquoted in YAML it is read as a datetime; a UTC offset is kept; without one it is local time."""
    from datetime import datetime, timedelta, timezone
    from msinfer.launcher.drain import parse_deadline
    later = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=3)
    spec = load_spec(write(tmp_path, MINIMAL + f"run:\n  deadline: {later.isoformat()}\n"))
    assert parse_deadline(spec.run.deadline) == later.timestamp()
    local = (datetime.now() + timedelta(days=1)).replace(microsecond=0)
    assert parse_deadline(local.isoformat()) == local.timestamp()


def test_slurm_time_left_reads_the_allocation_s_end():
    """SLURM_JOB_END_TIME where Slurm sets it, else squeue's time left; nothing outside Slurm or
    for a job without a limit; a squeue that fails leaves the job without a deadline, with a note."""
    from msinfer.launcher.drain import parse_slurm_time, slurm_time_left

    def squeue(answer, code=0):
        def run(cmd, **kw):
            assert cmd[:4] == ["squeue", "-h", "-j", "77"] and cmd[-2:] == ["-o", "%L"]
            return subprocess.CompletedProcess(cmd, code, answer, "")
        return run
    assert [parse_slurm_time(t) for t in ("1-02:03:04", "02:03:04", "03:04", "59", "UNLIMITED", "NOT_SET")] == \
        [93784, 7384, 184, 59, None, None]
    with pytest.raises(ValueError):
        parse_slurm_time("soon")
    assert slurm_time_left({}) is None
    assert slurm_time_left({"SLURM_JOB_ID": "77", "SLURM_JOB_END_TIME": "2000000000"}) == (2e9, "SLURM_JOB_END_TIME")
    end, source = slurm_time_left({"SLURM_JOB_ID": "77"}, squeue("1:00:00\n"))
    assert abs(end - (time.time() + 3600)) < 5 and source == "squeue -j 77"
    assert slurm_time_left({"SLURM_JOB_ID": "77"}, squeue("UNLIMITED\n")) is None
    assert slurm_time_left({"SLURM_JOB_ID": "77"}, squeue("", 1)) is None
    assert slurm_time_left({"SLURM_JOB_ID": "77"}, squeue("garbled\n")) is None


def test_scientific_notation_reads_as_number(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL + "sampling:\n  temperature: 5e-2\n"))
    assert spec.sampling.temperature == 0.05


def test_cross_field_checks(tmp_path):
    msg = spec_error(tmp_path, MINIMAL.replace("path: models/tiny", "path: m\n  max_model_len: 128")
                     + "sampling:\n  max_new_tokens: 256\n")
    assert "sampling.max_new_tokens (256) must be less than model.max_model_len (128)" in msg
    msg = spec_error(tmp_path, MINIMAL.replace("out/results.jsonl", "prompts.jsonl"))
    assert "output.path and input.path are the same file" in msg


def test_max_model_len_resolved_later_is_checked_again(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL + "sampling:\n  max_new_tokens: 300\n"))
    assert spec.with_max_model_len(512).model.max_model_len == 512
    with pytest.raises(SpecError,
                       match=r"sampling.max_new_tokens \(300\) must be less than model.max_model_len \(256\)"):
        spec.with_max_model_len(256)


@pytest.mark.unit
def test_temperature_and_top_k_take_vllms_range_and_its_readings():
    """vLLM's SamplingParams: a temperature in [0, 2], one in (0, 0.01) sampled at 0.01 (below it
    the scaled logits overflow); top_k -1 is "no top-k" (msinfer's 0), also in a record's sampling."""
    assert SamplingSpec(temperature=1e-6).temperature == 0.01
    assert SamplingSpec(temperature=0.005).to_params().temperature == 0.01
    assert SamplingSpec(temperature=0.0).to_params().greedy and SamplingSpec(temperature=2.0).temperature == 2.0
    assert SamplingSpec().merge({"top_k": -1}, "r").top_k == 0
    with pytest.raises(RecordError, match=r"record 'r': sampling.temperature: expected a number <= 2"):
        SamplingSpec().merge({"temperature": 2.5}, "r")
    with pytest.raises(RecordError, match=r"record 'r': sampling.top_k: expected an integer >= -1"):
        SamplingSpec().merge({"top_k": -2}, "r")


def test_the_default_max_new_tokens_does_not_refuse_a_short_max_model_len(tmp_path):
    """max_new_tokens left at its default (256) is capped by max_model_len as a record's own is,
    so a spec with a short max_model_len (written, or resolved from the checkpoint) loads; one
    the user wrote above max_model_len is still refused."""
    short = MINIMAL.replace("path: models/tiny", "path: m\n  max_model_len: 128")
    assert load_spec(write(tmp_path, short)).sampling.max_new_tokens == 256
    assert load_spec(write(tmp_path, MINIMAL)).with_max_model_len(64).model.max_model_len == 64
    assert "sampling.max_new_tokens (200) must be less than model.max_model_len (128)" in spec_error(
        tmp_path, short + "sampling:\n  max_new_tokens: 200\n")


def test_input_suffix_checked(tmp_path):
    msg = spec_error(tmp_path, MINIMAL.replace("prompts.jsonl", "prompts.csv"))
    assert ("input.path: expected a .txt, .jsonl or .parquet file, a folder of such files or a pattern "
            "(data/*.parquet), got 'prompts.csv'") in msg


def test_malformed_yaml_names_file_and_line(tmp_path):
    msg = spec_error(tmp_path, MINIMAL + "sampling:\n  stop: [a, b\n")
    assert "job.yaml:" in msg and "malformed YAML" in msg
    msg = spec_error(tmp_path, MINIMAL + "sampling:\n  top_k: 1\n\tseed: 2\n")
    assert "job.yaml:9:1: malformed YAML: found character '\\t'" in msg


def test_duplicate_key_is_an_error(tmp_path):
    msg = spec_error(tmp_path, MINIMAL + "sampling: {top_k: 1}\nsampling: {top_k: 2}\n")
    assert "job.yaml:8" in msg and "'sampling' appears twice (first on line 7)" in msg


def test_top_level_must_be_mapping(tmp_path):
    assert "top level of the job spec must be a mapping" in spec_error(tmp_path, "- a\n- b\n")
    assert "is empty" in spec_error(tmp_path, "# nothing\n")
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "missing.yaml")


def test_empty_section_means_defaults(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL + "sampling:\nfault:\n"))
    assert spec.sampling == SamplingSpec()


def test_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_spec(write(tmp_path / "", MINIMAL), [
        "parallel.tensor_parallel=2", 'sampling.stop=["\\n", "END"]', "sampling.temperature=0.7",
        "model.lora.path=adapters/a", "model.max_model_len=null", "ray.address=10.0.0.1:6379"])
    assert spec.parallel.tensor_parallel == 2
    assert spec.sampling.stop == ["\n", "END"]
    assert spec.sampling.temperature == 0.7
    assert spec.model.lora.path == str(tmp_path / "adapters/a")
    assert spec.ray.address == "10.0.0.1:6379"
    assert spec.sampling.to_params().stop == ("\n", "END")


def test_override_paths_resolve_against_cwd(tmp_path, monkeypatch):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    spec = load_spec(write(tmp_path / "jobs", MINIMAL), ["output.path=other.jsonl"])
    assert spec.output.path == str(tmp_path / "run/other.jsonl")
    assert spec.input.path == str(tmp_path / "jobs/prompts.jsonl")


def test_override_errors(tmp_path):
    msg = spec_error(tmp_path, MINIMAL, ["scheduler.max_batch=4"])
    assert "--set: scheduler.max_batch: unknown key; did you mean 'max_batch_size'" in msg
    # vLLM's names for msinfer's keys name them
    for key, ours in (("scheduler.max_num_seqs", "max_batch_size"), ("parallel.gpu_memory_utilization",
                                                                      "memory_fraction"),
                      ("scheduler.num_gpu_blocks_override", "kv_cache_blocks")):
        assert f"--set: {key}: unknown key; did you mean '{ours}'?" in spec_error(tmp_path, MINIMAL, [f"{key}=1"])
    msg = spec_error(tmp_path, MINIMAL, ["parallel.tensor_parallel=-1"])
    assert "--set: parallel.tensor_parallel: expected an integer >= 1, got -1" in msg
    assert "--set 'parallel'" in spec_error(tmp_path, MINIMAL, ["parallel"])
    assert "not a valid YAML" in spec_error(tmp_path, MINIMAL, ["sampling.stop=[a"])
    assert "--set: task: expected one of 'generate', 'score', 'embed' or 'classify', got a mapping" in spec_error(
        tmp_path, MINIMAL, ["task.x=1"])
    msg = spec_error(tmp_path, "task: score\n" + MINIMAL, ["task.x=1"])
    assert "--set task.x: 'task' is the scalar 'score', not a section of keys" in msg


def test_resolved_is_json(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL))
    resolved = json.loads(json.dumps(spec.resolved()))
    assert resolved["model"]["path"] == spec.model.path
    assert resolved["sampling"]["stop"] == [] and resolved["ray"]["address"] is None
    assert JobSpec.model_validate(resolved) == spec


def test_sampling_merge():
    base = SamplingSpec(temperature=0.5, stop=["x"])
    merged = base.merge({"top_k": 5, "stop": ["y"]}, "r1")
    assert merged.top_k == 5 and merged.stop == ["y"] and merged.temperature == 0.5
    assert base.merge({}, "r1") is base
    with pytest.raises(RecordError, match=r"record 'r7': sampling.temprature: unknown key; did you mean 'temperature'"):
        base.merge({"temprature": 1.0}, "r7")
    with pytest.raises(RecordError, match=r"record 'r8': sampling.top_p: expected a number <= 1, got 2"):
        base.merge({"top_p": 2}, "r8")
    with pytest.raises(RecordError, match=r"record 'r9': sampling: expected a mapping"):
        base.merge(["x"], "r9")
    # vLLM's stop: one string or a list; a number is neither
    assert SamplingSpec(stop="END").stop == ["END"] and base.merge({"stop": "y"}, "r1").stop == ["y"]
    with pytest.raises(RecordError, match=r"sampling.stop: expected a string or a list of strings .*got 5"):
        base.merge({"stop": 5}, "r2")


def test_to_params_is_hashable_worker_dataclass():
    params = SamplingSpec(stop=["a"], stop_token_ids=[3]).to_params()
    assert isinstance(params, SamplingParams) and params.stop == ("a",) and params.stop_token_ids == (3,)
    hash(params)


def test_env_expansion_does_not_touch_other_strings(tmp_path, monkeypatch):
    monkeypatch.delenv("UNSET_X", raising=False)
    spec = load_spec(write(tmp_path, MINIMAL + "sampling:\n  stop: ['${UNSET_X}']\n"))
    assert spec.sampling.stop == ["${UNSET_X}"]
    assert os.path.isabs(spec.output.path)


def test_every_spec_key_named_like_an_engine_config_field_reaches_the_ranks(checkpoint, tmp_path):
    """A model:, parallel: or scheduler: key that shares its name with an EngineConfig field reaches
    every rank's EngineConfig as set (launcher.job.same_named), so a new key that the workers read
    takes its spec field, the EngineConfig field and its reader: each key here is set away from its
    default, and the planned engine holds it."""
    import dataclasses
    from msinfer.launcher.job import plan_job, same_named
    from msinfer.sharding.config import EngineConfig
    path = checkpoint("qwen3_moe_top2_dense_layer")
    spec = JobSpec.model_validate({
        "model": {"path": str(path), "max_model_len": 96, "allow_pickle": True, "trust_remote_code": True,
                  "graph_mode": False, "ops": "portable", "shapes": "dynamic"},
        "parallel": {"expert_parallel": True},
        "scheduler": {"max_batch_size": 3, "block_size": 32},
        "sampling": {"max_new_tokens": 8},
        "input": {"path": str(tmp_path / "in.jsonl")}, "output": {"path": str(tmp_path / "out.jsonl")}})
    shared = same_named(spec)
    keys = {"max_model_len", "allow_pickle", "trust_remote_code", "graph_mode", "ops", "shapes", "expert_parallel",
            "max_batch_size", "block_size"}
    assert keys <= set(shared)
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    engine = plan_job(spec, check_io=False).engine
    for name in keys:
        assert shared[name] != defaults[name] and getattr(engine, name) == shared[name], name
