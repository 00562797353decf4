"""LoRA adapters (PEFT format) merged while loading: greedy tokens equal transformers + peft with the
adapter merged, at tensor parallel 1 and 2; a bad adapter fails before any worker starts, naming
the module."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.conftest import PROMPTS
from tests.engine_driver import Driver
from msinfer.worker.lora import AdapterError, LoraAdapter, check_adapter
from msinfer.sharding.config import EngineConfig
from msinfer.worker.runner import ModelRunner

NAME = "qwen2_qkv_bias"            # fused q/k/v with biases, GQA: every shard id and both split dims
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, ALPHA = 4, 8
N_NEW = 8


def peft_adapter(path, out, targets):
    """An adapter of checkpoint `path` on `targets`, as peft saves it, into `out`, and the greedy tokens
    per prompt of transformers + peft with it merged (which differ from the base model's)."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets,
                                                      lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():                  # lora_B starts at zero: make the adapter matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(out)
    merged = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), out).merge_and_unload().eval()
    expected = [greedy(merged, p) for p in PROMPTS]
    plain = [greedy(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), p)
             for p in PROMPTS]
    assert expected != plain, "the adapter does not change the greedy tokens: the test would prove nothing"
    return out, expected


@pytest.fixture(scope="session")
def adapter(checkpoint, tmp_path_factory):
    """(adapter folder, transformers + peft merged greedy tokens per prompt)."""
    return peft_adapter(checkpoint(NAME), tmp_path_factory.mktemp("lora") / "adapter", TARGETS)


def greedy(model, prompt):
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_config(path, adapter_dir, scale=1.0):
    return EngineConfig(str(path), max_model_len=128, max_batch_size=4, lora_path=str(adapter_dir), lora_scale=scale)


def test_tp1_greedy_tokens_equal_transformers_with_the_merged_adapter(adapter, checkpoint):
    adapter_dir, expected = adapter
    runner = ModelRunner(engine_config(checkpoint(NAME), adapter_dir))
    out = Driver(runner).generate(dict(enumerate(PROMPTS)), N_NEW)
    assert [out[i] for i in range(len(PROMPTS))] == expected


def test_pipeline_stages_each_merge_the_adapter_s_modules_of_their_own_layers(adapter, checkpoint):
    """pipeline_parallel 2: each stage holds its own layers, and merges the adapter into them; the
    stages in turn give transformers' tokens with the adapter merged."""
    import dataclasses

    from msinfer.sharding.config import ModelConfig
    from msinfer.sharding.layout import stage_layers
    from tests.test_pipeline import StageChain
    adapter_dir, expected = adapter
    ranges = stage_layers(ModelConfig.from_dir(checkpoint(NAME)).num_layers, 2, None)
    runners = [ModelRunner(dataclasses.replace(engine_config(checkpoint(NAME), adapter_dir), pipeline=ranges, stage=s))
               for s in range(2)]
    out = Driver(StageChain(runners), feed_sampled=True).generate(dict(enumerate(PROMPTS)), N_NEW)
    assert [out[i] for i in range(len(PROMPTS))] == expected


def test_tp2_greedy_tokens_equal_transformers_with_the_merged_adapter(adapter, checkpoint, ray_local):
    """Each rank merges only its slice: its rows of B for q/k/v and gate/up, its columns of A for
    o_proj and down_proj."""
    from msinfer.launcher.replica import Replica, ReplicaConfig
    adapter_dir, expected = adapter
    r = Replica(0, ReplicaConfig(2))
    try:
        r.start(engine_config(checkpoint(NAME), adapter_dir))
        out = Driver(r).generate(dict(enumerate(PROMPTS)), N_NEW)
    finally:
        r.shutdown()
    assert [out[i] for i in range(len(PROMPTS))] == expected


def test_scale_multiplies_the_adapters_own_alpha_over_r(adapter, checkpoint):
    """W' = W + scale * alpha/r * B @ A, checked on the loaded parameters (no graph runs)."""
    adapter_dir, _ = adapter
    runner = ModelRunner(engine_config(checkpoint(NAME), adapter_dir, scale=0.5))
    params = runner.model.weights()
    base = load_file(str(checkpoint(NAME) / "model.safetensors"))
    lora = load_file(str(adapter_dir / "adapter_model.safetensors"))

    def merged(module):
        a = lora[f"base_model.model.{module}.lora_A.weight"]
        b = lora[f"base_model.model.{module}.lora_B.weight"]
        return base[f"{module}.weight"] + 0.5 * ALPHA / R * (b @ a)

    p = "model.layers.1."
    qkv = np.concatenate([merged(p + f"self_attn.{s}_proj") for s in "qkv"])
    np.testing.assert_allclose(params["layers.1.self_attn.qkv_proj.weight"], qkv, atol=1e-6)
    np.testing.assert_allclose(params["layers.1.mlp.down_proj.weight"], merged(p + "mlp.down_proj"), atol=1e-6)
    # biases and norms are the base model's
    np.testing.assert_array_equal(params["layers.1.input_layernorm.weight"], base[p + "input_layernorm.weight"])


def edited_adapter(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors:
        t = load_file(str(src / "adapter_model.safetensors"))
        save_file(tensors(t), str(dst / "adapter_model.safetensors"))
    return dst


def test_adapter_for_a_module_the_model_lacks_fails_naming_it(adapter, checkpoint, tmp_path):
    from msinfer.sharding.config import ModelConfig
    from msinfer.sharding.layout import plan_tensors
    adapter_dir, _ = adapter
    plans = plan_tensors(ModelConfig.from_dir(checkpoint(NAME)), 2)
    assert check_adapter(str(adapter_dir), 1.0, plans) == 2 * len(TARGETS)

    in_config = edited_adapter(adapter_dir, tmp_path / "a", config={"target_modules": TARGETS + ["c_attn"]})
    with pytest.raises(AdapterError, match="target module 'c_attn' is not a module of the base model"):
        check_adapter(str(in_config), 1.0, plans)

    def rename(t):
        key = "base_model.model.model.layers.0.mlp.up_proj.lora_{}.weight"
        for ab in "AB":
            t[key.format(ab).replace("layers.0", "layers.7")] = t.pop(key.format(ab))
        return t
    in_tensors = edited_adapter(adapter_dir, tmp_path / "b", tensors=rename)
    with pytest.raises(AdapterError, match=r"target module 'model\.layers\.7\.mlp\.up_proj' is not in the base"):
        check_adapter(str(in_tensors), 1.0, plans)


def test_shape_mismatch_fails_naming_the_module_before_and_while_loading(adapter, checkpoint, tmp_path):
    from msinfer.sharding.config import ModelConfig
    from msinfer.sharding.layout import plan_tensors
    adapter_dir, _ = adapter

    def shrink(t):
        key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
        t[key] = t[key][:16]                              # one KV head's rows, the model has two
        return t
    bad = edited_adapter(adapter_dir, tmp_path / "bad", tensors=shrink)
    message = r"target module 'model\.layers\.1\.self_attn\.k_proj': the adapter's B @ A is \[16, 64\]"
    with pytest.raises(AdapterError, match=message):
        check_adapter(str(bad), 1.0, plan_tensors(ModelConfig.from_dir(checkpoint(NAME)), 1))
    with pytest.raises(AdapterError, match=message):        # a worker given it anyway
        ModelRunner(engine_config(checkpoint(NAME), bad))


def test_unsupported_adapters_are_refused_with_the_reason(adapter, tmp_path):
    adapter_dir, _ = adapter
    with pytest.raises(AdapterError, match="use_dora is true"):
        LoraAdapter(edited_adapter(adapter_dir, tmp_path / "dora", config={"use_dora": True}))
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        LoraAdapter(tmp_path)


def test_an_adapter_whose_file_and_config_disagree_is_refused_as_peft_would_not_apply_it(adapter, tmp_path):
    """PEFT applies the matrices of the modules its config targets and refuses a rank other than
    the config's; merging every matrix in the file regardless gave other tokens than peft's."""
    adapter_dir, _ = adapter
    assert len(LoraAdapter(adapter_dir).modules) == 2 * len(TARGETS)
    for name, config, said in [
            ("fewer", {"target_modules": ["q_proj"]}, r"module 'model\.layers\.0\.mlp\.down_proj' has LoRA "
                                                      r"matrices, but adapter_config.json does not target it "
                                                      r"\(target_modules \['q_proj'\]\): PEFT would leave them out"),
            ("layers", {"layers_to_transform": [0]}, r"module 'model\.layers\.1\..*layers_to_transform \[0\]"),
            ("excluded", {"exclude_modules": ["down_proj"]}, r"module 'model\.layers\.0\.mlp\.down_proj' has LoRA"),
            ("rank", {"r": 8}, r"down_proj': lora_A \[4, 128\] is of rank 4, where adapter_config.json gives r 8"),
            ("pattern", {"rank_pattern": {"o_proj": 2}}, r"o_proj': lora_A \[4, 64\] is of rank 4, where "
                                                         r"adapter_config.json gives r 2 \(rank_pattern\)")]:
        with pytest.raises(AdapterError, match=said):
            LoraAdapter(edited_adapter(adapter_dir, tmp_path / name, config=config))
    for name, config in [("regex", {"target_modules": r".*\.(q|k|v|o|gate|up|down)_proj"}),
                         ("all", {"target_modules": "all-linear"}), ("every layer", {"layers_to_transform": [0, 1]}),
                         ("own pattern", {"rank_pattern": {"o_proj": 4}})]:
        assert len(LoraAdapter(edited_adapter(adapter_dir, tmp_path / name, config=config)).modules) == 14


def test_which_modules_an_adapter_targets_is_peft_s_own_answer():
    """worker.lora._targeted against peft's check_target_module_exists, over the ways a config
    names its modules."""
    import peft
    from peft.tuners.tuners_utils import check_target_module_exists
    from msinfer.worker.lora import _targeted
    keys = [f"model.layers.{i}.{m}" for i in (0, 1, 12) for m in
            ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "mlp.gate", "mlp.shared_expert.up_proj")]
    keys.append("lm_head")
    configs = [dict(target_modules=["q_proj", "down_proj"]), dict(target_modules=".*\\.(o|q)_proj"),
               dict(target_modules=["q_proj", "up_proj"], layers_to_transform=[1, 12]),
               dict(target_modules=["q_proj"], layers_to_transform=0, layers_pattern="layers"),
               dict(target_modules=["q_proj", "mlp.down_proj"], exclude_modules=["model.layers.1.self_attn.q_proj"]),
               dict(target_modules=["model.layers.0.mlp.down_proj", "lm_head"], layers_to_transform=[1]),
               dict(target_modules=["q_proj"], target_parameters=["gate.weight"])]
    for config in configs:
        cfg = peft.LoraConfig(**config)
        for key in keys:
            want = check_target_module_exists(cfg, key)
            want = bool(want) and type(want).__name__ != "_ExcludedModule"
            if config.get("target_parameters") and key.endswith("mlp.gate"):
                want = True                    # (peft wraps the router's weight as a parameter)
            assert _targeted(config, key) == want, (config, key)


def test_an_lm_head_adapter_as_peft_saves_it_merges_to_peft_s_tokens(checkpoint, tmp_path):
    """peft saves its own copy of lm_head's base weight beside the LoRA matrices
    (save_embedding_layers); equal to the checkpoint's, it changes nothing, and one that differs
    (a weight trained with the adapter) is refused rather than left out."""
    adapter_dir, expected = peft_adapter(checkpoint(NAME), tmp_path / "head", ["q_proj", "lm_head"])
    copy = "base_model.model.lm_head.base_layer.weight"
    assert copy in load_file(str(adapter_dir / "adapter_model.safetensors"))
    out = Driver(ModelRunner(engine_config(checkpoint(NAME), adapter_dir))).generate(dict(enumerate(PROMPTS)), N_NEW)
    assert [out[i] for i in range(len(PROMPTS))] == expected

    def trained(t):
        t[copy] = t[copy] * 1.01
        return t
    with pytest.raises(AdapterError, match=f"tensor '{copy}' holds a weight of 'lm_head' other than the checkpoint's"):
        ModelRunner(engine_config(checkpoint(NAME), edited_adapter(adapter_dir, tmp_path / "trained", tensors=trained)))


def test_a_router_adapter_as_peft_saves_it_merges_to_peft_s_tokens(checkpoint, tmp_path):
    """peft names a mixture's router among target_parameters (its weight is no linear module in
    transformers); its matrices merge as a linear module's."""
    name = "qwen3_moe_top2_dense_layer"
    adapter_dir, expected = peft_adapter(checkpoint(name), tmp_path / "router", ["q_proj", "gate"])
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["target_parameters"] == ["gate.weight"]
    out = Driver(ModelRunner(engine_config(checkpoint(name), adapter_dir))).generate(dict(enumerate(PROMPTS)), N_NEW)
    assert [out[i] for i in range(len(PROMPTS))] == expected


def test_plan_job_checks_the_adapter_before_workers_start(adapter, checkpoint, tmp_path):
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import JobSpec
    adapter_dir, _ = adapter
    (tmp_path / "in.jsonl").write_text('{"prompt_token_ids": [1, 2]}\n')
    spec = {"model": {"path": str(checkpoint(NAME)), "max_model_len": 64, "lora": {"path": str(adapter_dir),
                                                                                  "scale": 2.0}},
            "input": {"path": str(tmp_path / "in.jsonl")}, "output": {"path": str(tmp_path / "out.jsonl")},
            "sampling": {"max_new_tokens": 8}}
    plan = plan_job(JobSpec.model_validate(spec))
    assert (plan.engine.lora_path, plan.engine.lora_scale) == (str(adapter_dir), 2.0)
    spec["model"]["lora"]["path"] = str(edited_adapter(adapter_dir, tmp_path / "x",
                                                       config={"target_modules": ["c_attn"]}))
    with pytest.raises(AdapterError, match="'c_attn'"):
        plan_job(JobSpec.model_validate(spec))


def test_prompts_found_in_the_prefix_cache_give_the_adapters_tokens(adapter, checkpoint):
    """The engine's cache holds K/V of the merged weights: each prompt a second time starts after
    its cached blocks and gives the same tokens."""
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import JobSpec
    from tests.engine_driver import run_engine as run
    adapter_dir, expected = adapter
    spec = JobSpec.model_validate({
        "model": {"path": str(checkpoint(NAME)), "max_model_len": 64, "lora": {"path": str(adapter_dir)}},
        "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"},
        "sampling": {"max_new_tokens": N_NEW, "ignore_eos": True},
        "scheduler": {"max_batch_size": 4, "block_size": 4, "max_batched_tokens": 32}})   # waits for 1 block
    records = [{"id": f"{k}{i}", "prompt_token_ids": p} for k in "ab" for i, p in enumerate(PROMPTS)]
    lines, engine = run(plan_job(spec, check_io=False), records)
    for k in "ab":
        assert [lines[f"{k}{i}"]["output_token_ids"] for i in range(len(PROMPTS))] == expected
    assert engine.engine_stats()["cached_tokens"] == 4 + 0 + 16      # the full blocks of each prompt
