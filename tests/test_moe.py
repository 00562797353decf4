"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE): transformers' greedy tokens at tp 2 and 4 in both
expert layouts, with chunked prefill, each rank holding exactly its slices or its experts; what
plan says of the layouts and what it refuses. (tp 1 on every device path: test_parity and
test_ascend run every checkpoint of tests/checkpoints.py, these included.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from msinfer.sharding.config import EngineConfig, ModelConfig
from msinfer.sharding.layout import LayoutError, bytes_per_rank, check_tp, plan_tensors
from tests.conftest import PROMPTS
from tests.engine_driver import Driver
from tests.test_ascend import ATOL, assert_greedy_parity
from msinfer.worker.protocol import SeqStep

N_NEW = 8
QWEN3 = "qwen3_moe_top2_dense_layer"        # 8 experts of 32, top 2 renormalized; layer 1 dense
QWEN2 = "qwen2_moe_top4_shared_tied"        # 6 experts of 24, top 4, a shared expert of 96
DEEPSEEK_V3 = "deepseek_v3_yarn_groups"     # latent attention; 8 experts of 32 in 4 groups; layer 0 dense
DEEPSEEK_V2 = "deepseek_v2_groups_no_q_lora"  # 6 experts of 24 in 3 groups, two shared


@pytest.mark.parametrize("name,tp,ep,device", [(QWEN3, 4, False, "cpu"), (QWEN2, 2, True, "ascend"),
                                               (DEEPSEEK_V3, 2, True, "cpu"), (DEEPSEEK_V2, 2, False, "cpu")])
def test_experts_sliced_or_whole_per_rank_generate_what_transformers_generates(name, tp, ep, device, checkpoint,
                                                                               hf_greedy, ray_local):
    """Mixed-length prompts decoded together (async scheduling's SAMPLED feeds), then a prompt
    prefilled in two chunks, the second after its cached first: transformers' tokens at every
    step, on the CPU kernels and on the emulated Ascend kernels (whose grouped matmuls leave out
    the pairs of experts another rank holds). Each rank holds exactly the rows, columns or whole
    experts its layout gives it. DeepSeek's routing (groups chosen before the experts) runs on
    every rank before the experts split, and its latent attention splits by heads."""
    from msinfer.launcher.replica import Replica, ReplicaConfig, wait_gone
    path = checkpoint(name)
    r = Replica(0, ReplicaConfig(tp, device=device))
    emulated = device == "ascend"           # the fused kernels' float16, against transformers' float32
    r.start(EngineConfig(str(path), max_model_len=128, max_batch_size=4, expert_parallel=ep, device=device,
                         emulate=emulated, dtype="float16" if emulated else "float32", kernel_check=False))
    try:
        d = Driver(r, feed_sampled=True)
        out = d.generate(dict(enumerate(PROMPTS)), N_NEW)
        for i, prompt in enumerate(PROMPTS):
            label = f"{name} tp {tp} ep {ep} prompt {i}"
            if emulated:
                assert_greedy_parity(label, out[i], None, *hf_greedy(name, prompt, N_NEW), ATOL["ascend-emulated"])
            else:
                assert out[i] == hf_greedy(name, prompt, N_NEW)[0], label
        long = PROMPTS[2]
        first = r.step([SeqStep(3, long[:9], 0, d.table(3), sample=False)], True)
        assert first.token_ids == [-1]
        second = r.step([SeqStep(3, long[9:], 9, d.table(3))], True)
        assert second.token_ids == hf_greedy(name, long, N_NEW)[0][:1]
        check_ranks_hold_their_experts(r, path, tp, ep)
    finally:
        pids = r.pids()
        r.shutdown()
    assert wait_gone(pids)


def check_ranks_hold_their_experts(replica, path, tp, ep):
    import ray
    full = load_file(str(path / "model.safetensors"))
    cfg = ModelConfig.from_dir(path)
    E, I, i = cfg.num_experts, cfg.moe_intermediate_size, cfg.sparse_layers[0]
    for rank, p in enumerate(ray.get([w.loaded_params.remote() for w in replica.workers])):
        dtype = p[f"layers.{i}.mlp.experts.w13"].dtype          # the checkpoint's float32, cast as it loads
        full = {k: v.astype(dtype) for k, v in full.items()} if rank == 0 else full
        layer = f"model.layers.{i}.mlp."
        held = range(rank * E // tp, (rank + 1) * E // tp) if ep else range(E)
        cols = slice(None) if ep else slice(rank * I // tp, (rank + 1) * I // tp)
        w13 = np.stack([np.concatenate([full[f"{layer}experts.{e}.gate_proj.weight"][cols],
                                        full[f"{layer}experts.{e}.up_proj.weight"][cols]]) for e in held])
        w2 = np.stack([full[f"{layer}experts.{e}.down_proj.weight"][:, cols] for e in held])
        np.testing.assert_array_equal(p[f"layers.{i}.mlp.experts.w13"], w13)
        np.testing.assert_array_equal(p[f"layers.{i}.mlp.experts.w2"], w2)
        np.testing.assert_array_equal(p[f"layers.{i}.mlp.gate.weight"], full[f"{layer}gate.weight"])   # replicated
        if cfg.shared_expert_size:                                  # sliced like a dense MLP in both layouts
            S = cfg.shared_expert_size // tp
            down = full[f"{layer}{cfg.shared_expert_key}.down_proj.weight"][:, rank * S:(rank + 1) * S]
            np.testing.assert_array_equal(p[f"layers.{i}.mlp.shared_expert.down_proj.weight"], down)
        if cfg.mla is not None:      # kv_b_proj's rows of the rank's heads; the latent's projection whole
            attn, m = f"model.layers.{i}.self_attn.", cfg.mla
            rows = cfg.num_heads // tp * (m.qk_nope_head_dim + m.v_head_dim)
            np.testing.assert_array_equal(p[f"layers.{i}.self_attn.kv_b_proj.weight"],
                                          full[attn + "kv_b_proj.weight"][rank * rows:(rank + 1) * rows])
            np.testing.assert_array_equal(p[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"],
                                          full[attn + "kv_a_proj_with_mqa.weight"])


QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_both_layouts_hold_the_same_bytes_differently_and_refuse_sizes_that_do_not_divide():
    """Qwen3-30B-A3B at tp 8: every expert's 768 columns split 8 ways, or 16 whole experts per
    rank; the same bytes per rank either way, only the layouts' divisors differ."""
    m = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert m.sparse_layers == tuple(range(48)) and m.num_experts == 128 and m.norm_topk_prob
    experts_total = 48 * 128 * 3 * 2048 * 768 * 2                 # bfloat16
    for ep in (False, True):
        assert bytes_per_rank(m, 8, 2, ep, experts=True) == experts_total // 8
    assert bytes_per_rank(m, 8, 2, False, experts=False) == bytes_per_rank(m, 8, 2, True, experts=False)
    plans = {p.name: p for p in plan_tensors(m, 8, ep=True)}
    assert plans["model.layers.0.mlp.experts.15.down_proj.weight"].rank_shape == (2048, 768)     # rank 0's
    assert plans["model.layers.0.mlp.experts.16.down_proj.weight"].rank_shape == (2048, 0)       # rank 1's
    assert plans["model.layers.0.mlp.experts.16.gate_proj.weight"].full_shape == (768, 2048)
    sliced = {p.name: p for p in plan_tensors(m, 8)}
    assert sliced["model.layers.0.mlp.experts.16.gate_proj.weight"].rank_shape == (96, 2048)
    with pytest.raises(LayoutError, match=r"num_experts=128 is not divisible by 3 \(expert parallel\)"):
        check_tp(m, 3, ep=True)
    with pytest.raises(LayoutError, match="moe_intermediate_size=768 is not divisible by 5"):
        check_tp(m, 5)
    dense = ModelConfig.from_dict({**QWEN3_30B_A3B, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(LayoutError, match="has no experts"):
        check_tp(dense, 2, ep=True)


def test_a_card_too_small_for_the_experts_is_refused_naming_the_tensor_parallel_that_fits(tmp_path):
    """Qwen3-30B-A3B in bfloat16 on 64 GB cards: 56.9 GiB of weights leave one card no room for a
    sequence; the plan names tp 2 (28.45 GiB a card), and sizes the cache of tp 8 in both layouts
    alike (the same bytes per rank)."""
    from msinfer.launcher.job import card_plan
    from tests.test_ascend import ascend_spec
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    m = ModelConfig.from_dir(str(tmp_path))
    engine = EngineConfig(str(tmp_path), max_model_len=8192, max_batch_size=64, block_size=128, device="ascend")
    one = ascend_spec(tmp_path, tmp_path, parallel={"tensor_parallel": 1})
    with pytest.raises(LayoutError, match=r"weights 56.87 GiB .*parallel.tensor_parallel 2 fits \(28.45 GiB of "
                                          r"weights a card\)"):
        card_plan(one, m, engine, bytes_per_rank(m, 1, 2), 2)
    blocks = [card_plan(ascend_spec(tmp_path, tmp_path, parallel={"expert_parallel": ep}), m, engine,
                        bytes_per_rank(m, 8, 2, ep), 2).blocks for ep in (False, True)]
    assert blocks[0] == blocks[1] == 64 * 8192 // 128


def test_plan_describes_the_experts_of_both_layouts(checkpoint, tmp_path):
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import load_spec
    spec = tmp_path / "job.yaml"
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt_token_ids": [5, 6]}) + "\n")
    spec.write_text(f"model: {{path: {checkpoint(QWEN2)}}}\ninput: {{path: {tmp_path / 'in.jsonl'}}}\n"
                    f"output: {{path: {tmp_path / 'out.jsonl'}}}\nparallel: {{tensor_parallel: 2, expert_parallel: "
                    f"true}}\n")
    plan = plan_job(load_spec(str(spec)))
    assert plan.engine.expert_parallel
    text = plan.describe()
    assert "experts 6/2 whole per rank" in text
    line = next(x for x in text.splitlines() if x.startswith("experts"))
    assert "6 per sparse layer (2 of 2), top 4" in line and "expert parallel (chosen)" in line and "sliced:" in line


def test_an_adapter_on_routed_experts_is_refused_by_name(checkpoint, tmp_path):
    from safetensors.numpy import save_file
    from msinfer.worker.lora import AdapterError, check_adapter
    module = "model.layers.0.mlp.experts.3.gate_proj"
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2, "target_modules": ["gate_proj"],
                                                              "peft_type": "LORA"}))
    save_file({f"base_model.model.{module}.lora_A.weight": np.zeros((2, 64), np.float32),
               f"base_model.model.{module}.lora_B.weight": np.zeros((24, 2), np.float32)},
              str(tmp_path / "adapter_model.safetensors"))
    path = checkpoint(QWEN2)
    with pytest.raises(AdapterError, match=f"'{module}' is a routed expert"):
        check_adapter(str(tmp_path), 1.0, plan_tensors(ModelConfig.from_dir(path), 1))


def test_an_adapter_on_the_attention_of_a_mixture_of_experts_merges_as_peft_merges_it(checkpoint, tmp_path):
    """LoRA on q, v and o of Qwen2-MoE (dense modules beside the experts and the shared expert):
    the tokens of PEFT's merged model."""
    import peft
    import torch
    import transformers
    from msinfer.worker.runner import ModelRunner
    path = checkpoint(QWEN2)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                                      init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    merged = model.merge_and_unload().eval()
    with torch.no_grad():
        ref = {i: merged.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(p):].tolist() for i, p in enumerate(PROMPTS)}
    runner = ModelRunner(EngineConfig(str(path), max_model_len=128, max_batch_size=8,
                                      lora_path=str(tmp_path / "adapter")))
    assert Driver(runner).generate(dict(enumerate(PROMPTS)), N_NEW) == ref


def test_bench_takes_either_layout_and_names_its_flag_when_it_does_not_fit(checkpoint, tmp_path, capsys):
    from msinfer.launcher.cli import main
    code = main(["bench", "--model", str(checkpoint(QWEN3)), "--tp", "3", "--expert-parallel",
                 "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "num_experts=8 is not divisible by 3 (expert parallel)" in " ".join(err.split())
    assert "(--expert-parallel: false): 1, 2, 4" in " ".join(err.split())
