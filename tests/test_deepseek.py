"""DeepSeek-V2/V3 (latent attention, grouped routing, YaRN): what the other files do not cover.
Greedy tokens against transformers run in test_parity (CPU kernels), test_ascend (emulated Ascend,
portable operators) and test_moe (tp 2, experts sliced and whole); prefix caching with preemption
in test_prefix_cache. Here: scoring over the latent cache, a checkpoint's multi-token prediction
layer left out, the plan's figures for DeepSeek-V3 itself (from its config.json alone), and the
errors a config or a checkpoint gets."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from msinfer.launcher.cli import main
from msinfer.launcher.job import RUNTIME_BYTES, plan_job
from msinfer.sharding.config import ModelConfig, ModelConfigError
from msinfer.sharding.layout import LayoutError
from msinfer.worker.protocol import SeqStep
from tests.conftest import PROMPTS, ROOT
from tests.test_scoring import hf_logprobs
from tests.test_parity import runner_for

V3 = "deepseek_v3_yarn_groups"
V2 = "deepseek_v2_groups_no_q_lora"


def with_mtp_layer(path, out):
    """A copy of checkpoint `path` holding, as DeepSeek-V3's does, a multi-token prediction layer
    after the decoder layers (model.layers.<num_hidden_layers>.*: its projection and a layer)."""
    shutil.copytree(path, out)
    tensors = load_file(str(out / "model.safetensors"))
    n = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    extra = {k.replace(f"layers.{n - 1}.", f"layers.{n}."): v for k, v in tensors.items() if f"layers.{n - 1}." in k}
    extra[f"model.layers.{n}.eh_proj.weight"] = np.ones((64, 128), np.float32)
    save_file({**tensors, **extra}, str(out / "model.safetensors"))
    return out


def test_scoring_over_the_latent_cache_gives_transformers_log_probabilities(checkpoint, tmp_path):
    """A prompt scored in two chunks, the second reading the first's latents through the block
    table (the absorbed, paged kind), on a checkpoint that also holds a multi-token prediction
    layer, which is not loaded."""
    path = with_mtp_layer(checkpoint(V3), tmp_path / "with-mtp")
    runner = runner_for(path)
    assert not any(".2." in name for name in runner.model.weights())        # the MTP layer left out
    tokens = PROMPTS[2] + PROMPTS[0]
    targets = tokens[1:] + [-1]
    _, first = runner.execute([SeqStep(0, tokens[:9], 0, [0, 1], targets=targets[:9], sample=False)], True)
    _, second = runner.execute([SeqStep(0, tokens[9:], 9, [0, 1], targets=targets[9:], sample=False)], True)
    got = [lp for lp, _ in first[0] + second[0]]          # (the last token has no target)
    np.testing.assert_allclose(got, hf_logprobs(checkpoint(V3), tokens[:1], tokens[1:]), atol=1e-4)


def deepseek_v3_spec(tmp_path, *overrides):
    from msinfer.launcher.spec import load_spec
    return load_spec(ROOT / "configs" / "ascend-deepseek-v3-pp4-tp8.yaml",
                     [f"output.path={tmp_path / 'out.jsonl'}", *overrides])


def test_plan_of_deepseek_v3_counts_the_latent_cache_and_names_the_stages_that_fit(tmp_path):
    """configs/ascend-deepseek-v3-pp4-tp8.yaml from DeepSeek-V3's config.json alone: each token
    caches 576 values a layer (kv_lora_rank 512 + qk_rope_head_dim 64) on every rank, and the plan
    prints and counts exactly that; on two machines (pp 2) its bfloat16 weights leave no room, and
    the refusal names pipeline_parallel 4."""
    plan = plan_job(deepseek_v3_spec(tmp_path), sizing=True)
    text = plan.describe()
    assert "576 values per token per layer, x 61 layers x 2 bytes = 70272 bytes per token, 71x less" in text
    assert plan.model.kv_bytes(1, 2) == 576 * 61 * 2
    assert "multi-token prediction layer(s) (model.layers.61" in text
    # a rank of the last stage (16 layers): 16 x 576 values x 2 bytes a token, whatever tp is
    assert plan.model.kv_bytes(16, 2, 8, 16) == 16 * 576 * 2 * 16 == plan.model.kv_bytes(16, 2, 1, 16)
    assert plan.kv_bytes_per_rank == plan.model.kv_bytes(16, 2, 8, 16) * (plan.engine.blocks() + 1)
    with pytest.raises(LayoutError, match="parallel.pipeline_parallel 4 fits at tensor_parallel 8"):
        plan_job(deepseek_v3_spec(tmp_path, "parallel.pipeline_parallel=2"), sizing=True)
    # stages of other sizes: the one with the most layers (16, the embedding's) is not the one with
    # the most weights (15 and the LM head): each card holds its own stage's weights and KV blocks,
    # so the blocks are what the tightest card leaves (20342: (51.2 GiB - 40.82 - 3.14 - 2) / 15
    # layers' blocks, where 16 layers' blocks beside the heaviest weights gave 19070), and the
    # plan's "per rank" and experts figures are that card's own
    uneven = plan_job(deepseek_v3_spec(tmp_path, "parallel.pipeline_layers=[16,15,15,15]",
                                       "parallel.memory_fraction=0.8"), sizing=True)
    room = int(0.8 * 64 * 1024 ** 3) - uneven.card.activations - RUNTIME_BYTES - uneven.weight_bytes_per_rank
    assert uneven.card.blocks == room // (15 * 16 * 576 * 2) - 1 == 20342
    assert uneven.kv_bytes_per_rank == 15 * 16 * 576 * 2 * 20343
    assert "experts 39.375 GiB + the rest 1.445 GiB per rank" in uneven.describe()


def test_a_checkpoint_whose_latent_shapes_disagree_with_its_config_is_refused_naming_the_tensor(
        checkpoint, tmp_path, capsys):
    path = tmp_path / "bad"
    shutil.copytree(checkpoint(V2), path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[name] = tensors[name][:-4]
    save_file(tensors, str(path / "model.safetensors"))
    (tmp_path / "in.jsonl").write_text('{"prompt_token_ids": [1, 2]}\n')
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: {{path: {path}}}\ninput: {{path: {tmp_path / 'in.jsonl'}}}\n"
                    f"output: {{path: {tmp_path / 'out.jsonl'}}}\n")
    assert main(["plan", str(spec)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"'{name}' has shape [124, 32], the config implies [128, 32]" in err and "Traceback" not in err


def v3_config(**changes) -> dict:
    d = json.loads((ROOT / "configs" / "sizing" / "DeepSeek-V3" / "config.json").read_text())
    return {**d, **changes}


@pytest.mark.parametrize("changes,message", [
    (dict(topk_group=9), "topk_group=9: .* topk_group between 1 and n_group"),
    (dict(n_group=3), "n_routed_experts=256 in n_group=3 groups"),
    (dict(num_experts_per_tok=200), "num_experts_per_tok=200 must be between 1 and the 128 experts"),
    (dict(topk_method="greedy"), "topk_method 'greedy' with scoring_func 'sigmoid' is not how DeepseekV3"),
    (dict(scoring_func="softmax"), "scoring_func 'softmax' is not how DeepseekV3ForCausalLM routes"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(qk_rope_head_dim=63), "qk_rope_head_dim=63 must be even"),
    (dict(kv_lora_rank=None), "required key 'kv_lora_rank' is missing"),
    (dict(rope_scaling={"type": "yarn", "factor": 40}), "yarn needs 'original_max_position_embeddings'"),
    # FP8 with one scale per tensor (DeepSeek's release has blocks, tests/test_quant.py runs them)
    (dict(quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}),
     "fp8 without weight_block_size"),
])
def test_a_deepseek_config_msinfer_cannot_serve_is_refused_naming_the_key(changes, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(v3_config(**changes), "config.json")


def test_yarn_stays_refused_where_only_deepseek_is_verified():
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
             "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}
    with pytest.raises(ModelConfigError, match="rope type 'yarn' is not supported for LlamaForCausalLM"):
        ModelConfig.from_dict(llama, "config.json")


def test_on_the_emulated_ascend_path_latent_attention_calls_the_kernels_as_vllm_mindspore_does(
        checkpoint, hf_greedy, monkeypatch):
    """Recording stand-ins, run eagerly through a prefill, a chunk after cached tokens and a
    decode: one cache written by ReshapeAndCache with the latent as the key and no value, and
    PagedAttention in MLA mode (one KV head, mla_v_dim kv_lora_rank, the cache as key and value
    cache), each call bound to the installed primitive's signature; transformers' tokens."""
    import inspect

    import mindspore as ms
    from mindspore.ops import auto_generate
    import msinfer.worker.ascend as ascend
    from msinfer.sharding.config import EngineConfig
    from msinfer.worker.runner import ModelRunner
    from tests.engine_driver import Driver
    calls = []

    def recording(name):
        base, real = getattr(ascend.StandIns, name), getattr(auto_generate, name)

        class Recorder(base):
            def __init__(self, *args, **kwargs):
                calls.append((name + ".__init__", inspect.signature(real.__init__).bind(None, *args, **kwargs).arguments))
                super().__init__(*args, **kwargs)

            def construct(self, *args, **kwargs):
                calls.append((name, inspect.signature(real.__call__).bind(None, *args, **kwargs).arguments))
                return super().construct(*args, **kwargs)
        return Recorder

    class Recording(ascend.StandIns):
        ReshapeAndCache, PagedAttention = recording("ReshapeAndCache"), recording("PagedAttention")

    path, cfg = checkpoint(V3), ModelConfig.from_dir(checkpoint(V3))
    monkeypatch.setattr(ascend.EmulatedAscendOps, "kernels", Recording)
    runner = ModelRunner(EngineConfig(str(path), max_model_len=128, max_batch_size=8, device="ascend", emulate=True,
                                      dtype="float16", kernel_check=False, graph_mode=False))
    d = Driver(runner)
    first = d.prefill({0: PROMPTS[0], 1: PROMPTS[1]}).token_ids
    runner.step([SeqStep(2, PROMPTS[2][:5], 0, d.table(2), sample=False)], True)
    chunk = runner.step([SeqStep(2, PROMPTS[2][5:], 5, d.table(2))], True).token_ids
    second = d.decode().token_ids
    want = [hf_greedy(V3, prompt, 2)[0] for prompt in PROMPTS]
    assert (first, second, chunk) == ([w[0] for w in want[:2]], [w[1] for w in want[:2]], want[2][:1])
    width, values = cfg.mla.cache_width, cfg.mla.kv_lora_rank
    inits = [args for name, args in calls if name == "PagedAttention.__init__"]
    assert inits and all(a["kv_head_num"] == 1 and a["mla_v_dim"] == values and a["head_num"] == cfg.num_heads
                         for a in inits)
    writes = [args for name, args in calls if name == "ReshapeAndCache"]
    reads = [args for name, args in calls if name == "PagedAttention"]
    assert len(writes) == 4 * cfg.num_layers and len(reads) == 2 * cfg.num_layers     # the chunk and the decode
    cache_shape = (runner.num_blocks + 1, runner.block_size, 1, width)
    for args in writes:
        assert args["value"] is None and args["value_cache"] is None and args["key"].shape[1] == width
        assert isinstance(args["key_cache"], ms.Parameter) and args["key_cache"].shape == cache_shape
    for args in reads:
        assert args["key_cache"] is args["value_cache"] and args["key_cache"].shape == cache_shape
        assert args["query"].shape[1] == cfg.num_heads * width


def test_the_start_up_check_settles_the_latent_kernels_and_the_tokens_stay(checkpoint, hf_greedy, monkeypatch):
    """With a PagedAttention stand-in that applies no causal mask within a chunk (pa_wrong), the
    start-up check of the latent kernels (PagedAttention's MLA mode, ReshapeAndCache with one cache)
    finds it wrong and replaces it by the portable operators, and a chunk after cached tokens gets
    transformers' logits; as documented, the kernels pass the same check."""
    from msinfer.sharding.config import EngineConfig
    from msinfer.worker import ascend, kernel_check
    from msinfer.worker.runner import ModelRunner
    from tests.test_ascend import MLA_FLOAT16_ATOL
    monkeypatch.setenv("MSINFER_CACHE", str(checkpoint(V3).parent / "kernel-cache"))
    path = checkpoint(V3)
    checked = ModelRunner(EngineConfig(str(path), max_model_len=128, max_batch_size=8, device="ascend", emulate=True,
                                       dtype="float16", emulate_variants=("pa_wrong",)))
    verdicts = checked.kernel_check
    assert kernel_check.conventions(verdicts) == {"PagedAttention": "portable", "ReshapeAndCache": "ok",
                                                  "RmsNorm": "ok"}
    assert verdicts["PagedAttention"]["max_error"] > 10 * kernel_check.TOLERANCE["float16"]
    checked.step([SeqStep(0, PROMPTS[2][:6], 0, [0, 1], sample=False)], True)
    chunk = checked.forward([SeqStep(0, PROMPTS[2][6:], 6, [0, 1])], True)
    assert np.abs(chunk[0] - hf_greedy(V3, PROMPTS[2], 1)[1][0]).max() < MLA_FLOAT16_ATOL
    monkeypatch.setattr(ascend, "VARIANTS_IN_FORCE", ())
    documented = kernel_check.check_kernels(ascend.EmulatedAscendOps, *kernel_check.check_shapes(
        ModelConfig.from_dir(path), 1, 16, "float16"))
    assert set(kernel_check.conventions(documented).values()) == {"ok"}
