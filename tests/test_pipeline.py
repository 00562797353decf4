"""Pipeline parallel (parallel.pipeline_parallel): a replica as stages of decoder layers, each
stage loading only its own tensors, hidden states passed stage to stage, the last stage sampling.
The stages in turn, in this process, against transformers for every architecture; a replica of
2 stages x tp 2 over Ray, through the engine's micro-batches, against one stage."""

from __future__ import annotations

import json
import re

import pytest

from msinfer.launcher.errors import SpecError
from msinfer.launcher.job import plan_job
from msinfer.launcher.spec import JobSpec
from msinfer.sharding.config import EngineConfig, ModelConfig
from msinfer.sharding.layout import LayoutError, stage_layers
from msinfer.worker.protocol import pack_step, unpack_step
from tests.conftest import PROMPTS
from tests.engine_driver import Driver, run_engine

N_NEW = 8


class StageChain:
    """A replica's stages run one after the other in this process, as the engine's Pipeline runs
    them over Ray: each gets the step as it crosses the wire, a stage but the first the stage
    before's hidden states, the first the tokens the last sampled in the step before."""

    def __init__(self, runners):
        self.runners, self.sampled = runners, None

    def step(self, seqs, is_prefill):
        payload, out = pack_step(seqs), None
        for i, runner in enumerate(self.runners):
            steps, released = unpack_step(payload)
            out = runner.step(steps, is_prefill, released=released, hidden=None if i == 0 else out.hidden,
                              sampled=self.sampled if i == 0 else None)
            assert (out.hidden is None) == (i == len(self.runners) - 1)
        self.sampled = out.sampled
        return out


def stage_runners(path, pp: int, layers=None) -> list:
    from msinfer.worker.runner import ModelRunner
    ranges = stage_layers(ModelConfig.from_dir(path).num_layers, pp, layers)
    return [ModelRunner(EngineConfig(str(path), max_model_len=128, max_batch_size=8, pipeline=ranges, stage=s))
            for s in range(pp)]


@pytest.mark.parametrize("name,pp,layers", [("llama_mqa", 2, None), ("qwen2_tied_5_layers", 3, None),
                                            ("qwen2_tied_5_layers", 2, [4, 1]),
                                            ("qwen3_qknorm_odd_head_dim", 2, None),
                                            ("qwen3_moe_top2_dense_layer", 2, None)])
def test_stages_in_turn_generate_what_transformers_generates(name, pp, layers, checkpoint, hf_greedy):
    """Greedy tokens equal transformers' with the stages run in turn; each stage holds its own
    layers, the first the embedding, the last the final norm and the LM head (a tied one as a copy
    of the embedding, loaded from its tensor)."""
    path = checkpoint(name)
    runners = stage_runners(path, pp, layers)
    out = Driver(StageChain(runners), feed_sampled=True).generate(dict(enumerate(PROMPTS)), N_NEW)
    for i, prompt in enumerate(PROMPTS):
        assert out[i] == hf_greedy(name, prompt, N_NEW)[0], f"{name} pp {pp} prompt {i}"
    cfg = ModelConfig.from_dir(path)
    held = [r.model.weights() for r in runners]
    for s, (lo, hi) in enumerate(stage_layers(cfg.num_layers, pp, layers)):
        numbers = {int(k.split(".")[1]) for k in held[s] if k.startswith("layers.")}
        assert numbers == set(range(hi - lo)), (s, numbers)       # the stage's own layers, numbered from 0
        assert ("embed_tokens.weight" in held[s]) == (s == 0)
        assert ("norm.weight" in held[s]) == (s == pp - 1)
    if cfg.tie_word_embeddings:
        import numpy as np
        np.testing.assert_array_equal(held[-1]["lm_head.weight"], held[0]["embed_tokens.weight"])


def spec_for(path, tmp_path, **parallel) -> JobSpec:
    return JobSpec.model_validate({"model": {"path": str(path), "max_model_len": 128},
                                   "parallel": parallel, "input": {"path": str(tmp_path / "in.jsonl")},
                                   "output": {"path": str(tmp_path / "out.jsonl")},
                                   "sampling": {"max_new_tokens": N_NEW, "ignore_eos": True},
                                   "scheduler": {"max_batch_size": 4, "max_batched_tokens": 64}})


def test_a_bad_split_is_refused_and_plan_names_each_stages_layers(checkpoint, tmp_path):
    path = checkpoint("qwen2_tied_5_layers")
    assert stage_layers(5, 2) == ((0, 2), (2, 5))           # the remainder on the later stages
    assert stage_layers(5, 3) == ((0, 1), (1, 3), (3, 5))
    assert stage_layers(5, 1) == ()
    for layers, said in (([2, 2], "adds up to 4 layers; the model has 5"),
                         ([5, 0], "every stage needs at least one decoder layer"),
                         ([1, 1, 3], "has 3 entries for pipeline_parallel 2")):
        with pytest.raises((SpecError, LayoutError, ValueError), match=said):
            plan_job(spec_for(path, tmp_path, pipeline_parallel=2, pipeline_layers=layers), check_io=False)
    with pytest.raises(LayoutError, match="6 is more stages than the model's 5 decoder layers"):
        plan_job(spec_for(path, tmp_path, pipeline_parallel=6), check_io=False)
    plan = plan_job(spec_for(path, tmp_path, pipeline_parallel=2, pipeline_layers=[4, 1], tensor_parallel=2),
                    check_io=False)
    text = plan.describe()
    assert "1 replica(s) x pipeline stages 2 x tensor parallel 2 = 4 worker(s)" in text
    assert "stage 0     workers 0-1 on one node, layers 0-3 (4) + the embedding" in text
    assert "stage 1     workers 2-3 on one node, layers 4-4 (1) + the final norm, LM head and sampler" in text
    one = plan_job(spec_for(path, tmp_path, tensor_parallel=2), check_io=False)
    assert plan.weight_bytes_per_rank < one.weight_bytes_per_rank      # the larger stage's share
    assert plan.kv_bytes_per_rank == one.kv_bytes_per_rank * 4 // 5    # its 4 layers of 5


def mixed_records() -> list[dict]:
    """Greedy records, prompts that share a cached block, n = 2 sampled with a penalty,
    log-probabilities, prompt log-probabilities and structured outputs (a regex, a choice)."""
    shared = [(5 * j) % 200 + 3 for j in range(16)]
    return ([{"id": f"g{i}", "prompt_token_ids": p} for i, p in enumerate(PROMPTS)]
            + [{"id": f"c{i}", "prompt_token_ids": shared + [40 + i]} for i in range(3)]
            + [{"id": "n2", "prompt_token_ids": PROMPTS[0],
                "sampling": {"n": 2, "temperature": 0.8, "seed": 3, "logprobs": 2, "presence_penalty": 0.5}},
               {"id": "lp", "prompt_token_ids": PROMPTS[2], "sampling": {"logprobs": 2, "prompt_logprobs": 1}},
               {"id": "regex", "prompt": "hello", "sampling": {"structured_outputs": {"regex": "[a-z]{3} [0-9]{2}"}}},
               {"id": "choice", "prompt": "be brief", "sampling": {"structured_outputs": {
                   "choice": ["hello world", "stop here please"]}}}])


def test_two_stages_of_tp2_over_ray_give_each_record_what_one_stage_gives(checkpoint, hf_greedy, tmp_path,
                                                                          ray_local):
    """A replica of 2 stages x tp 2 (4 workers), through the engine: each step goes as micro-
    batches through both stages. Greedy records get transformers' tokens; sampled ones (n = 2,
    a penalty), log-probabilities, prompt log-probabilities, prompts that share a cached block,
    structured outputs (a regex, a choice: the last stage's token masks) and scored
    continuations get what a replica of one stage gives them."""
    from msinfer.launcher.replica import Replica, ReplicaConfig, wait_gone
    name = "qwen2_tied_5_layers"
    path = checkpoint(name)
    records = mixed_records()
    scored = [{"id": f"s{i}", "prompt_token_ids": p, "continuation_token_ids": [44, 3, 8, 9, 10]}
              for i, p in enumerate(PROMPTS)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    one_plan = plan_job(spec_for(path, tmp_path), check_io=False)
    one, _ = run_engine(one_plan, records)
    one.update(run_engine(plan_job(one_plan.spec.model_copy(update={"task": "score"}), check_io=False), scored)[0])
    plan = plan_job(spec_for(path, tmp_path, tensor_parallel=2, pipeline_parallel=2), check_io=False)
    r = Replica(0, ReplicaConfig(2))
    r.start(plan.engine)
    try:
        assert [(x["stage"], x["rank"]) for x in r.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        two, engine = run_engine(plan, records, r.workers)
        two.update(run_engine(plan_job(plan.spec.model_copy(update={"task": "score"}), check_io=False), scored,
                              r.workers, after=engine)[0])
    finally:
        pids = r.pids()
        r.shutdown()
    assert wait_gone(pids)
    for i, prompt in enumerate(PROMPTS):
        assert two[f"g{i}"]["output_token_ids"] == hf_greedy(name, prompt, N_NEW)[0]
    assert one.keys() == two.keys()
    for key, line in one.items():
        assert close(line, two[key]), (key, line, two[key])
    assert re.fullmatch("[a-z]{3} [0-9]{2}", two["regex"]["output_text"])
    assert two["choice"]["output_text"] in ("hello world", "stop here please")
    assert all(len(two[f"s{i}"]["continuation_logprobs"]) == 5 for i in range(len(PROMPTS)))
    assert engine.engine_stats()["cached_tokens"] >= 16
    assert engine.submitted > engine.step_s["prefill"][0] + engine.step_s["decode"][0]    # micro-batches


def close(a, b) -> bool:
    """Equal result lines: the same keys, tokens and texts, log-probabilities within 1e-4."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4 * max(1.0, abs(a))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def test_plan_sizes_a_model_from_its_config_alone_and_names_the_stages_that_fit(tmp_path):
    """configs/ascend-qwen3-235b-pp2-tp8.yaml plans Qwen3-235B-A22B from its config.json alone
    (configs/sizing): at tp 8 on 64 GiB cards the weights leave no room for a sequence, and the
    refusal names pipeline_parallel 2; at pp 2 every card of either stage fits. A run still needs
    the weights."""
    from msinfer.launcher.spec import load_spec
    from msinfer.worker.loader import CheckpointError
    from tests.conftest import ROOT
    spec = load_spec(ROOT / "configs" / "ascend-qwen3-235b-pp2-tp8.yaml",
                     [f"output.path={tmp_path / 'out.jsonl'}"])
    plan = plan_job(spec, sizing=True)
    text = plan.describe()
    assert "checkpoint absent (about 437.90 GiB" in text and "stage 1     workers 8-15 on one node, layers 47-93 (47)" in text
    assert 27 * 1024 ** 3 < plan.weight_bytes_per_rank < 28 * 1024 ** 3 and plan.card.blocks == 32768
    one = load_spec(ROOT / "configs" / "ascend-qwen3-235b-pp2-tp8.yaml",
                    [f"output.path={tmp_path / 'out.jsonl'}", "parallel.pipeline_parallel=1"])
    with pytest.raises(LayoutError, match="weights 54.91 GiB .* parallel.pipeline_parallel 2 fits at tensor_parallel 8"):
        plan_job(one, sizing=True)
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights found"):
        plan_job(spec)                  # what `msinfer run` plans


def test_int4_groups_held_two_a_byte_fit_llama_405b_on_one_node(tmp_path):
    """configs/ascend-llama-405b-w4a16-tp8.yaml: a W4A16 Llama-3.1-405B (groups of 128) at tp 8 on
    64 GiB cards holds its int4 weights two a byte with a bfloat16 scale a group (WeightQuantBatch-
    Matmul), 25.1 GiB a card, and fits one node; in bfloat16, or with its int4 weights dequantized
    (the portable operators), it needs pipeline_parallel 2."""
    from msinfer.launcher.spec import load_spec
    from tests.conftest import ROOT
    name = ROOT / "configs" / "ascend-llama-405b-w4a16-tp8.yaml"
    plan = plan_job(load_spec(name, [f"output.path={tmp_path / 'out.jsonl'}"]), sizing=True)
    assert 25 * 1024 ** 3 < plan.weight_bytes_per_rank < 25.2 * 1024 ** 3 and plan.card.blocks > 512
    assert "int4 groups int4, two a byte (Ascend's quantized matmuls)" in plan.describe()
    # 30265 blocks hold 59 sequences of 8192 tokens: the batch line says so beside max_batch_size 64
    assert "batch <= 64 (the KV cache holds 59 of max_model_len; shorter ones fill the rest)" in plan.describe()
    portable = load_spec(name, [f"output.path={tmp_path / 'out.jsonl'}", "model.ops=portable"])
    with pytest.raises(LayoutError, match="weights 94.5\\d GiB .*pipeline_parallel 2 fits at tensor_parallel 8"):
        plan_job(portable, sizing=True)
    # on smaller cards the layouts it names are weighed as int4 too (they were weighed in bfloat16:
    # tp 32 and pp 4 named, 24.37 and 24.24 GiB a card, where tp 16 and pp 2 fit)
    small = load_spec(name, [f"output.path={tmp_path / 'out.jsonl'}", "parallel.device_memory_gb=32"])
    with pytest.raises(LayoutError, match=r"parallel.tensor_parallel 16 fits \(12.68 GiB of weights a card\); "
                                          r"parallel.pipeline_parallel 2 fits at tensor_parallel 8 \(12.55 GiB"):
        plan_job(small, sizing=True)


def test_simulate_runs_stages_and_reports_each_stages_idle_share(checkpoint, tmp_path, ray_local):
    """`msinfer simulate` with 2 stand-in stages: every record once, the same stand-in tokens as
    one stage, and the pipeline's bubble as each stage's idle share."""
    from msinfer.launcher.job import run_job
    from msinfer.launcher.simulate import StandIn
    records = [{"id": f"r{i}", "prompt_token_ids": [3 + i, 5, 7, 11]} for i in range(12)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    got = {}
    for pp in (1, 2):
        spec = spec_for(checkpoint("qwen2_tied_5_layers"), tmp_path, pipeline_parallel=pp)
        spec = spec.model_copy(update={"output": spec.output.model_copy(update={"path": str(tmp_path / f"{pp}.jsonl")})})
        summary = run_job(spec, simulate=StandIn(step_ms=10), progress=False)
        lines = [json.loads(x) for x in open(tmp_path / f"{pp}.jsonl")]
        assert sorted(x["id"] for x in lines) == sorted(r["id"] for r in records)
        got[pp] = {x["id"]: x["output_token_ids"] for x in lines}
        sim = summary["simulate"]
        assert sim["workers"] == pp
        if pp == 2:
            idle = sim["stage_idle_share"]
            assert len(idle) == 2 and all(0.0 <= x < 1.0 for x in idle)
    assert got[1] == got[2]
