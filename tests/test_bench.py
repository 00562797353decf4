"""`msinfer bench`: flag parsing and case order (units), then a tiny run on random weights through
the CLI and the job's controller and engine, with one case that cannot run and one whose worker
dies mid-way."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil

import pytest

from msinfer.launcher import bench, bench_report
from msinfer.launcher.bench import BenchError, make_cases, parse_sizes
from msinfer.launcher.cli import main


@pytest.mark.parametrize("text, expected", [("4", [4]), ("1,2,4", [1, 2, 4]), ("[1,2,4]", [1, 2, 4]),
                                            (" [8, 1] ", [8, 1]), ("2,2,1", [2, 1])])
def test_list_flag_forms(text, expected):
    assert parse_sizes(text, "--batch-size") == expected


@pytest.mark.parametrize("flag, value", [("--batch-size", "x"), ("--input-len", "[1,0]"), ("--output-len", "1,,2"),
                                         ("--batch-size", "[]"), ("--tensor-parallel", "two")])
def test_bad_value_names_the_flag(flag, value, capsys, tmp_path):
    with pytest.raises(BenchError, match=flag):
        parse_sizes(value, flag) if flag != "--tensor-parallel" else bench.parse_one(value, flag)
    code = main(["bench", "--model", str(tmp_path), flag, value, "--output", str(tmp_path)])   # flags first
    err = capsys.readouterr().err
    assert code == 2 and flag in err and "Traceback" not in err


def test_cases_are_the_product_in_kv_bytes_order():
    cases = make_cases([4, 1], [128, 32], [32], kv_bytes_per_token=10)
    assert [(c.batch_size, c.input_len) for c in cases] == [(1, 32), (1, 128), (4, 32), (4, 128)]
    assert [c.kv_bytes for c in cases] == [10 * b * (i + 32) for b, i in ((1, 32), (1, 128), (4, 32), (4, 128))]


def test_error_column_keeps_the_gist_of_a_mindspore_error():
    message = ("TypeError: \n-----\n- Kernel select failed:\n-----\nSelect CPU operator[Gather] fail! "
               "Unsupported data type!\nThe supported data types are ...")
    assert bench_report.gist(message) == "TypeError: Select CPU operator[Gather] fail! Unsupported data type!"
    assert bench_report.gist("a worker process died") == "a worker process died"
    # a framework error's: what failed, not the request to report it (a replica's restart reason)
    from msinfer.launcher.engine import describe
    framework = RuntimeError("\n" + "-" * 52 + "\n- Framework Unexpected Exception Raised:\n" + "-" * 52 +
                             "\nThis exception is caused by framework's unexpected error. Please create an issue at "
                             "https://gitee.com/mindspore/mindspore/issues to get help.\n\n" + "-" * 52 +
                             "\n- Runtime error info: (For framework developers)\n" + "-" * 52 +
                             "\nThe value input to flatten tensor not supported for type \n")
    assert describe(framework) == "RuntimeError: The value input to flatten tensor not supported for type"


def test_tiny_run_records_every_case_and_goes_on_after_failures(checkpoint, ray_local, tmp_path, monkeypatch):
    model = tmp_path / "config-only"                  # --skip-load needs no weights
    model.mkdir()
    shutil.copy(checkpoint("llama_gqa_tied") / "config.json", model)
    out = tmp_path / "bench"

    real_run_case = bench.run_case
    def run_case(engine, case, repeats):             # the worker dies during the first case
        if case.batch_size == 1:
            ray_local.kill(engine.workers[0], no_restart=True)
        return real_run_case(engine, case, repeats)
    monkeypatch.setattr(bench, "run_case", run_case)

    # max_position_embeddings is 512: input 510 + output 4 cannot run
    code = main(["bench", "--model", str(model), "--skip-load", "--batch-size", "[2,1]", "--input-len", "16,510",
                 "--output-len", "4", "--output", str(out), "--no-progress"])
    assert code == 0

    with open(out / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    kv = [int(r["kv_cache_bytes"]) for r in rows]
    assert len(rows) == 4 and kv == sorted(kv)
    # 2 layers x 2 kv heads x head_dim 16 x 2 (K and V) x 4 bytes = 512 bytes per token
    assert [(int(r["batch_size"]), int(r["input_len"])) for r in rows] == \
        [(1, 16), (2, 16), (1, 510), (2, 510)]
    assert kv[0] == 512 * 1 * (16 + 4)
    status = {(r["batch_size"], r["input_len"]): (r["status"], r["error"]) for r in rows}
    assert status["1", "16"] == ("error", "a worker process died")
    assert status["2", "16"] == ("ok", "")                                      # on a fresh replica
    assert all(status[b, "510"][0] == "error" and "max model len 512" in status[b, "510"][1] for b in "12")
    r = rows[1]
    assert float(r["decode_tok_s"]) > 0 and float(r["e2e_tok_s"]) > 0 and float(r["prefill_ms"]) > 0
    assert float(r["ttft_ms"]) >= float(r["prefill_ms"]) and float(r["peak_mem_mib"]) > 100
    assert int(r["graphs_compiled"]) >= 1 and float(r["compile_s"]) > 0
    # the job's scheduler took the case's batch: one prefill step of both prompts, then one decode
    # step per further token
    assert (int(r["prefill_steps"]), int(r["decode_steps"])) == (1, 3)

    doc = json.loads((out / "bench.json").read_text())
    assert [(c["batch_size"], c["input_len"], c["status"]) for c in doc["cases"]] == \
        [(int(r["batch_size"]), int(r["input_len"]), r["status"]) for r in rows]
    assert doc["bench"]["weights"].startswith("random") and len(doc["bench"]["replica_starts"]) == 2
    if importlib.util.find_spec("matplotlib"):
        assert (out / "bench.png").stat().st_size > 0


def test_plan_and_bench_refuse_alike_what_this_machine_cannot_hold(checkpoint, tmp_path):
    """One memory plan for both: `plan` refuses a KV cache the machine's memory cannot hold, and
    `bench` records the case that needs one, each with the same account of it."""
    import psutil
    from msinfer.launcher.bench import BenchError, plan_bench
    from msinfer.launcher.cli import _parser
    from msinfer.launcher.job import host_memory_problem, plan_job
    from msinfer.launcher.spec import JobSpec
    from msinfer.sharding.layout import LayoutError
    have = psutil.virtual_memory().total
    assert host_memory_problem(2, 1000, 1000) is None
    assert "4 worker(s) x (weights" in host_memory_problem(4, have // 8, have // 8)
    path = str(checkpoint("llama_gqa_tied"))               # 8 KiB of K/V a block of 16 tokens
    spec = JobSpec.model_validate({"model": {"path": path, "max_model_len": 512}, "input": {"path": "in.jsonl"},
                                   "output": {"path": "out.jsonl"}, "scheduler": {"kv_cache_blocks": have // 8192}})
    with pytest.raises(LayoutError, match=r"1 worker\(s\) x \(weights 0.00 GiB \+ KV cache [0-9.]+ GiB\) = [0-9.]+ GiB "
                                          r"is more than 80% of this machine's .* lower scheduler.kv_cache_blocks"):
        plan_job(spec, check_io=False)
    batch = have // (384 * 512) + 1                        # 512 bytes of K/V a token: more than the machine
    args = _parser().parse_args(["bench", "--model", path, "--batch-size", f"1,{batch}", "--input-len", "256",
                                 "--output-len", "128", "--output", str(tmp_path / "out")])
    plan = plan_bench(args)
    huge = next(c for c in plan.cases if c.batch_size == batch)
    assert list(plan.rejected) == [huge]
    assert plan.rejected[huge].startswith("does not fit in memory: 1 worker(s) x (weights 0.00 GiB + KV cache ")
    # no case that can run: bench's own flags are named, before anything is planned for a case that cannot
    positions = plan.model.max_position_embeddings
    args = _parser().parse_args(["bench", "--model", path, "--input-len", "16", "--output-len", str(positions),
                                 "--output", str(tmp_path / "out")])
    with pytest.raises(BenchError, match=rf"no case can run: B=1 in=16 out={positions}: input_len \+ output_len = "
                                         rf"{positions + 16} exceeds the max model len {positions} "
                                         rf"\(max_position_embeddings\)$"):
        plan_bench(args)
    args = _parser().parse_args(["bench", "--model", path, "--input-len", "16", "--output-len", str(positions),
                                 "--max-model-len", str(positions + 16), "--output", str(tmp_path / "out")])
    assert plan_bench(args).job.spec.model.max_model_len == positions + 16      # asked for: allowed


def test_a_max_model_len_past_the_positions_the_model_is_made_for_is_refused_unless_allowed(checkpoint):
    """As vLLM refuses it without VLLM_ALLOW_LONG_MAX_MODEL_LEN: positions past what the model was
    trained for give tokens it would not give. The limit counts a RoPE scaling as vLLM does."""
    from pathlib import Path

    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import JobSpec
    from msinfer.sharding.config import ModelConfig
    sizing = Path(__file__).resolve().parents[1] / "configs" / "sizing"
    limits = {name: ModelConfig.from_dir(sizing / name).context_positions()
              for name in ("DeepSeek-V3", "Llama-3.1-405B-W4A16", "Qwen3-235B-A22B")}
    assert limits == {"DeepSeek-V3": 40 * 4096, "Llama-3.1-405B-W4A16": 131072, "Qwen3-235B-A22B": 40960}
    linear = json.loads((sizing / "Qwen3-235B-A22B" / "config.json").read_text())
    linear["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    assert ModelConfig.from_dict(linear, "config.json").context_positions() == 2 * 40960

    path = str(checkpoint("llama_gqa_tied"))               # max_position_embeddings 512
    spec = lambda **model: JobSpec.model_validate({"model": {"path": path, **model}, "input": {"path": "in.jsonl"},
                                                   "output": {"path": "out.jsonl"}})
    assert plan_job(spec(max_model_len=512), check_io=False).spec.model.max_model_len == 512
    with pytest.raises(SpecError, match=r"model.max_model_len \(1024\) is more than the 512 positions the model is "
                                        r"made for \(max_position_embeddings, config.json\).* set "
                                        r"model.allow_long_max_model_len: true"):
        plan_job(spec(max_model_len=1024), check_io=False)
    plan = plan_job(spec(max_model_len=1024, allow_long_max_model_len=True), check_io=False)
    assert any("exceeds the 512 positions the model is made for" in n for n in plan.notes)


@pytest.mark.unit
def test_the_host_memory_refusal_says_when_the_weights_alone_do_not_fit():
    """Workers on this machine (the CPU, or emulated cards) whose weights alone are more than
    its share: no KV cache setting helps, and the message says so instead of naming those keys."""
    import psutil

    from msinfer.launcher.job import host_memory_problem
    have = psutil.virtual_memory().total
    assert "(the weights alone " in host_memory_problem(8, have // 8, 0)
    assert "weights alone" not in host_memory_problem(1, have // 2, have // 2)
    assert host_memory_problem(1, have // 4, have // 4) is None


def test_a_card_s_memory_keys_on_the_cpu_are_named_as_unused_in_the_plan(checkpoint):
    """parallel.device_memory_gb and memory_fraction size a card's KV cache; on the CPU the plan
    says they do nothing there (instead of leaving a user to think the cache follows them)."""
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import JobSpec

    def notes(**parallel):
        spec = JobSpec.model_validate({"model": {"path": str(checkpoint("llama_gqa_tied"))}, "parallel": parallel,
                                       "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"}})
        return [n for n in plan_job(spec, check_io=False).notes if "not used on the CPU" in n]
    assert notes() == []
    assert notes(memory_fraction=0.5) == [
        "parallel.memory_fraction sizes an accelerator card's memory and is not used on the CPU: there the KV cache is "
        "scheduler.kv_cache_blocks (or max_batch_size sequences of max_model_len), and every worker's weights and KV "
        "cache must fit in 80% of this machine's memory"]
    assert notes(device_memory_gb=8, memory_fraction=0.9)[0].startswith(
        "parallel.device_memory_gb and parallel.memory_fraction size an accelerator card's memory and are not used")


def test_the_sampling_keys_a_spec_leaves_unset_take_the_model_s_generation_config_as_in_vllm(checkpoint, tmp_path):
    """vLLM's generation_config "auto": a checkpoint's generation_config.json recommends sampling
    defaults (Qwen3: temperature 0.6, top_p 0.95, top_k 20), taken for the keys a job leaves unset,
    and said so, every one the file gives (one at transformers' old default too, as vLLM 0.33 with
    transformers 5 reads the file; the penalties and skip_special_tokens too); keys the spec sets win;
    model.generation_config: msinfer leaves them out; a value the spec would refuse names the file."""
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import JobSpec

    model = tmp_path / "model"
    model.mkdir()
    for f in checkpoint("llama_gqa_tied").iterdir():
        (model / f.name).symlink_to(f)
    (model / "generation_config.json").unlink(missing_ok=True)
    recommended = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7,
                   "presence_penalty": 0.5, "skip_special_tokens": False, "eos_token_id": [2, 5]}
    (model / "generation_config.json").write_text(json.dumps(recommended))

    def plan(sampling=None, **m):
        return plan_job(JobSpec.model_validate({"model": {"path": str(model), **m}, "sampling": sampling or {},
                                                "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"}}),
                        check_io=False)
    s = plan({"top_k": 5}).spec.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.presence_penalty, s.skip_special_tokens) == \
        (0.6, 0.95, 5, 7, 0.5, False)
    assert plan().model.eos_token_ids[-1] == 5
    assert any(n.startswith("sampling defaults from the model's generation_config.json, as vLLM takes them: "
                            "presence_penalty 0.5, temperature 0.6, top_p 0.95, max_new_tokens 7")
               for n in plan({"top_k": 5}).notes)
    (model / "generation_config.json").write_text(json.dumps({"top_k": 50, "temperature": 1.0,
                                                              "repetition_penalty": 1.0}))
    s = plan().spec.sampling
    assert (s.top_k, s.temperature, s.repetition_penalty) == (50, 1.0, 1.0)
    (model / "generation_config.json").write_text(json.dumps(recommended))
    # a max_new_tokens the model recommends above max_model_len (resolved from the checkpoint:
    # 512) is capped as the default is, not refused as one the user wrote
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 8192}))
    long = plan()
    assert (long.spec.sampling.max_new_tokens, long.spec.model.max_model_len) == (8192, 512)
    (model / "generation_config.json").write_text(json.dumps(recommended))
    s = plan(generation_config="msinfer").spec.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.0, 1.0, 0, 256)
    (model / "generation_config.json").write_text(json.dumps({**recommended, "top_p": 0.0}))
    with pytest.raises(SpecError, match=r"model/generation_config.json recommends sampling defaults the sampling "
                                        r"section refuses: sampling.top_p: expected a number > 0, got 0"):
        plan()


def test_the_job_s_chat_template_variables_are_checked_and_rendered_by_plan(checkpoint):
    """input.chat_template_kwargs: plan renders the template with them once, and a variable that
    is a parameter of the rendering is refused naming it, before any worker starts."""
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import JobSpec

    def plan(kwargs):
        return plan_job(JobSpec.model_validate({"model": {"path": str(checkpoint("llama_gqa_tied"))},
                                                "input": {"path": "in.jsonl", "chat_template_kwargs": kwargs},
                                                "output": {"path": "out.jsonl"}}), check_io=False)
    assert plan({"enable_thinking": False}).spec.input.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(SpecError, match=r"'input.chat_template_kwargs' cannot set 'add_generation_prompt'"):
        plan({"add_generation_prompt": False})


def test_the_job_s_token_ids_outside_the_vocabulary_are_refused_by_plan(checkpoint):
    """sampling.logit_bias and allowed_token_ids for the whole job: a token id outside the model's
    vocabulary would fail every record alike, so plan refuses it, naming the key and the range."""
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import JobSpec

    def plan(**sampling):
        return plan_job(JobSpec.model_validate({"model": {"path": str(checkpoint("llama_gqa_tied"))},
                                                "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"},
                                                "sampling": sampling}), check_io=False)
    vocab = plan().model.vocab_size
    assert plan(logit_bias={vocab - 1: 5.0}, allowed_token_ids=[0, vocab - 1]).spec.sampling.logit_bias
    with pytest.raises(SpecError, match=rf"sampling.logit_bias: token id {vocab} is outside the model's "
                                        rf"vocabulary \(0..{vocab - 1}\)"):
        plan(logit_bias={str(vocab): 5.0})
    with pytest.raises(SpecError, match=rf"sampling.allowed_token_ids: token id {vocab + 7} is outside"):
        plan(allowed_token_ids=[1, vocab + 7])
