"""Tier 2: greedy tokens and logits of the engine equal transformers' (torch CPU, float32) on small
random checkpoints, one per architecture feature; prefill and decode alternate freely."""

from __future__ import annotations

import numpy as np
import pytest

from tests.checkpoints import VARIANTS
from tests.conftest import PROMPTS
from tests.engine_driver import Driver
from msinfer.worker.model import STEP_INPUTS
from msinfer.worker.protocol import SamplingParams, StepOutput
from msinfer.sharding.config import EngineConfig
from msinfer.worker.runner import ModelRunner

LOGIT_ATOL = 2e-4   # float32 on both sides; observed differences are ~1e-5
# bfloat16 linear layers on both sides: most steps' logits within ~5e-7 (float32's are 0.014-0.05
# away); once a value on a rounding boundary rounds the other way, that sequence's later steps
# differ by 1e-4 to ~1.5e-2
BF16_LOGIT_ATOL, BF16_FLIP_ATOL = 1e-3, 5e-2
N_NEW = 8
_RUNNERS: dict = {}


def runner_for(path, graph_mode=True) -> ModelRunner:
    key = (str(path), graph_mode)
    if key not in _RUNNERS:
        _RUNNERS[key] = ModelRunner(EngineConfig(str(path), max_model_len=128, max_batch_size=8,
                                                 graph_mode=graph_mode))
    return _RUNNERS[key]


class Recording:
    """Greedy steps that keep each step's logits."""

    def __init__(self, runner):
        self.runner, self.logits = runner, []

    def step(self, seqs, is_prefill):
        logits = self.runner.forward(seqs, is_prefill)
        self.logits.append(logits)
        return StepOutput([int(t) for t in logits.argmax(-1)])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_tokens_and_logits_match_transformers(name, checkpoint, hf_greedy):
    rec = Recording(runner_for(checkpoint(name)))
    out = Driver(rec).generate(dict(enumerate(PROMPTS)), N_NEW)
    for i, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = hf_greedy(name, prompt, N_NEW)
        assert out[i] == ref_tokens, f"{name} prompt {i}"
        for step in (0, N_NEW - 1):          # after prefill, and the last decode step
            diff = np.abs(rec.logits[step][i] - ref_logits[step]).max()
            assert diff < LOGIT_ATOL, f"{name} prompt {i} step {step}: max |logit diff| {diff}"


def test_a_bfloat16_checkpoint_stays_bfloat16_and_gives_the_tokens_of_float32_panels(checkpoint, monkeypatch):
    """The weights of a bfloat16 checkpoint stay bfloat16, half float32's bytes, in every matmul
    and the tied embedding: in AMX tiles (int16 parameters) where the CPU has them, else in
    bfloat16 panels (uint16), widened to float32 as they are read. The parity test above holds
    them to transformers' logits. With MSINFER_AMX=0 and MSINFER_BF16_PANELS=0 (how a user turns
    them off) the weights are float32 panels and give the same tokens; bfloat16 panels give the
    very same logits, as their products and sums are the float32 panels' own. `plan` counts the
    weights a rank holds either way, as the rank counts them."""
    import mindspore as ms
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import JobSpec
    from msinfer.worker.cpu import CpuOps, load_kernels
    name = "llama_gqa_tied_bfloat16"

    def planned() -> int:
        spec = JobSpec.model_validate({"model": {"path": str(checkpoint(name)), "max_model_len": 128},
                                       "sampling": {"max_new_tokens": N_NEW},
                                       "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"}})
        return plan_job(spec, check_io=False).weight_bytes_per_rank
    halved = Recording(runner_for(checkpoint(name)))
    assert planned() == halved.runner.load_stats["bytes"]
    kind = ms.int16 if CpuOps.amx else ms.uint16
    params = list(halved.runner.model.get_parameters())
    held = [p.name for p in params if p.dtype == kind and not p.name.startswith("stack.")]
    assert len(held) == 4 * halved.runner.cfg.num_layers + 1          # qkv, o, gate_up, down; embedding = LM head
    # the layers in one call (CausalLM.fuse) read each kind from one [layers, ...] Parameter, in the same dtype
    stacks = [p for p in params if p.name.startswith("stack.") and p.dtype == kind]
    assert len(stacks) == 4 and all(p.shape[0] == halved.runner.cfg.num_layers for p in stacks)
    monkeypatch.setenv("MSINFER_AMX", "0")
    monkeypatch.setenv("MSINFER_BF16_PANELS", "0")
    panels = Recording(ModelRunner(EngineConfig(str(checkpoint(name)), max_model_len=128, max_batch_size=8)))
    assert planned() == panels.runner.load_stats["bytes"]
    monkeypatch.undo()
    load_kernels()
    assert not any(p.dtype in (ms.int16, ms.uint16) for p in panels.runner.model.get_parameters())
    assert halved.runner.load_stats["bytes"] < panels.runner.load_stats["bytes"]
    prompts = dict(enumerate(PROMPTS))
    assert Driver(halved).generate(prompts, N_NEW) == Driver(panels).generate(prompts, N_NEW)
    if not CpuOps.amx:
        for a, b in zip(halved.logits, panels.logits):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(halved.runner.model.weights()["lm_head.weight"],
                                  panels.runner.model.weights()["lm_head.weight"])


@pytest.mark.parametrize("name,fused,stacked", [
    ("llama_gqa_tied", 2, True), ("qwen3_qknorm_odd_head_dim", 2, True), ("qwen2_qkv_bias", 2, True),
    ("qwen3_moe_top2_dense_layer", 2, False), ("deepseek_v3_yarn_groups", 1, False), ("llama_mha_bias", 0, False)])
def test_layers_and_their_halves_run_as_kernel_calls_giving_their_operators_logits(name, fused, stacked, checkpoint,
                                                                                   monkeypatch):
    """On the CPU kernels a layer's attention and MLP halves run as one kernel call each where they
    can (LayerBase.fuse), and a layer with both as one DecoderLayer call: both layers of a Llama,
    of a Qwen3 with qk norm and a head size of 24 and of a Qwen2 (a qkv bias); the dense layer of
    a mixture of experts whole and its sparse layer's attention; the MLP of DeepSeek-V3's dense
    layer (latent attention keeps its operators, as do the experts); nothing of a Llama with
    biases in its o and MLP projections. Where every layer is one call, all of them are one
    DecoderStack call (CausalLM.fuse). With MSINFER_FUSED_LAYERS=0 every layer runs its
    operators one by one, and the tokens and every step's logits are the same to the bit (the
    parity test above holds the fused ones to transformers)."""
    from msinfer.worker.cpu import CpuOps, load_kernels
    one = Recording(runner_for(checkpoint(name)))
    assert one.runner.fused_layers == fused
    assert (one.runner.model.stack is not None) == stacked
    if not fused:
        return
    monkeypatch.setenv("MSINFER_FUSED_LAYERS", "0")
    load_kernels()
    assert CpuOps.decoder_layer_op() is None
    apart = Recording(ModelRunner(EngineConfig(str(checkpoint(name)), max_model_len=128, max_batch_size=8)))
    monkeypatch.undo()
    load_kernels()
    assert apart.runner.fused_layers == 0 and apart.runner.model.stack is None
    assert CpuOps.decoder_layer_op() is not None
    prompts = dict(enumerate(PROMPTS))
    assert Driver(one).generate(prompts, N_NEW) == Driver(apart).generate(prompts, N_NEW)
    assert len(one.logits) == len(apart.logits) == N_NEW          # a prefill and the decode steps
    for a, b in zip(one.logits, apart.logits):
        np.testing.assert_array_equal(a, b)


def transformers_in_bfloat16_linears(path):
    """transformers' model (float32) computing each linear layer, each expert's projections and
    the LM head as the CPU kernels do with model.dtype bfloat16: inputs and weights rounded to the
    nearest bfloat16 (torch's cast: ties to even), the products summed in float32; the
    embedding's rows rounded (its table is the LM head's, or held as one); everything else in
    float32. A mixture's router (a linear layer in msinfer) is rounded too."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    embed = model.get_input_embeddings()
    embed.weight.data = embed.weight.data.bfloat16().float()
    for name, module in model.named_modules():
        router = type(module).__name__.endswith("Router") and getattr(module, "weight", None) is not None
        if (isinstance(module, torch.nn.Linear) or router) and ".experts." not in name:
            module.weight.data = module.weight.data.bfloat16().float()
            module.register_forward_pre_hook(lambda m, args: (args[0].bfloat16().float(), *args[1:]))
        if hasattr(module, "gate_up_proj"):          # a mixture's experts, stacked
            module.gate_up_proj.data = module.gate_up_proj.data.bfloat16().float()
            module.down_proj.data = module.down_proj.data.bfloat16().float()
            module.forward = experts_rounding_inputs(module)
    return model


def generate_rounding_the_cache(model, prompt, n, **kwargs):
    """transformers' greedy generate with its KV cache holding K and V rounded to bfloat16, as
    msinfer's cache holds them in a job computing in bfloat16."""
    import torch
    from transformers import DynamicCache

    class Rounded(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kw):
            return super().update(key_states.bfloat16().float(), value_states.bfloat16().float(), layer_idx, *args,
                                  **kw)
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0, cache=Rounded(config=model.config), **kwargs)


def against_the_rounded_cache(model, out, rec, f32, name: str) -> tuple[list, list, list]:
    """Each prompt's greedy tokens `out` (a Recording `rec` kept their logits) against transformers'
    `model` generating with its cache rounded to bfloat16 (generate_rounding_the_cache): the first
    tokens equal, and while the tokens agree each step's largest logit difference under
    BF16_FLIP_ATOL. Returns those differences, the float32 runner `f32`'s at the same steps, and
    whether each prompt's tokens are all the same."""
    diffs, aways, same = [], [], []
    for i, prompt in enumerate(PROMPTS):
        ref = generate_rounding_the_cache(model, prompt, N_NEW, output_logits=True, return_dict_in_generate=True)
        tokens = ref.sequences[0, len(prompt):].tolist()
        assert out[i][0] == tokens[0], f"{name} prompt {i}"
        for step in range(N_NEW):
            if out[i][:step] != tokens[:step]:          # (a near tie the two sides broke apart)
                break
            diff = np.abs(rec.logits[step][i] - ref.logits[step][0].numpy()).max()
            away = np.abs(f32.logits[step][i] - ref.logits[step][0].numpy()).max()
            assert diff < BF16_FLIP_ATOL, f"{name} prompt {i} step {step}: {diff} (float32's: {away})"
            diffs.append(diff)
            aways.append(away)
        same.append(out[i] == tokens)
    return diffs, aways, same


def experts_rounding_inputs(experts):
    """The forward of transformers' stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I])
    with each projection's input rows rounded to bfloat16: each token's routed experts' outputs,
    weighted, summed."""
    import torch

    def forward(hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(experts.gate_up_proj.shape[0]):
            token, pos = torch.where(top_k_index == e)
            if len(token):
                x = hidden[token].bfloat16().float()
                gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
                h = (experts.act_fn(gate) * up).bfloat16().float()
                y = torch.nn.functional.linear(h, experts.down_proj[e]) * top_k_weights[token, pos, None]
                out.index_add_(0, token, y)
        return out
    return forward


@pytest.mark.parametrize("name", ["llama_mha_bias", "qwen3_qknorm_odd_head_dim", "qwen2_moe_top4_shared_tied"])
def test_bfloat16_linear_layers_give_the_tokens_of_transformers_rounding_the_same(name, checkpoint):
    """model.dtype bfloat16 on the CPU kernels: every linear layer and the LM head round their
    inputs and weights to bfloat16 and sum in float32 (bfloat16 pairs, VDPBF16PS where the CPU
    has it), the embedding's rows are bfloat16, the KV cache holds K and V rounded to bfloat16
    (half float32's bytes, as the plan counts them), the rest of the network float32. Against
    transformers with its layers and its cache rounded the same way (bias, q/k norms, a router
    and a shared expert's gate narrower than a panel, routed experts, tied and untied LM heads):
    the logits of most steps within BF16_LOGIT_ATOL, where float32's are all far outside it,
    and the greedy tokens of all prompts but at most one. Exactness is the kernels' (tests/
    test_kernels.py): here the two sides' attention and norms differ in float32's last bits,
    and a value that lies on a bfloat16 rounding boundary may round the other way, after which
    that sequence's logits differ by up to ~1e-2. The plan counts the weights the rank holds,
    half of float32's; the portable operators refuse bfloat16 by name."""
    import mindspore as ms
    from msinfer.launcher.job import LayoutError, plan_job
    from msinfer.launcher.spec import JobSpec
    from msinfer.sharding.layers import FusedExperts, LinearBase, VocabParallelEmbedding
    path = checkpoint(name)

    def spec(**model):
        return JobSpec.model_validate({"model": {"path": str(path), "max_model_len": 128, **model},
                                       "sampling": {"max_new_tokens": N_NEW},
                                       "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"}})
    plan = plan_job(spec(dtype="bfloat16"), check_io=False)
    assert plan.engine.dtype == "float32" and plan.engine.matmul_dtype == "bfloat16"
    runner = ModelRunner(plan.engine.__class__(str(path), max_model_len=128, max_batch_size=8,
                                               matmul_dtype="bfloat16"))
    assert plan.weight_bytes_per_rank == runner.load_stats["bytes"]
    float32 = {p.name: p for p in runner_for(path).model.get_parameters()}
    linear = {c.weight.name for _, c in runner.model.cells_and_names()
              if isinstance(c, (LinearBase, VocabParallelEmbedding))}
    experts = {w.name for _, c in runner.model.cells_and_names() if isinstance(c, FusedExperts) for w in (c.w13, c.w2)}
    assert len(experts) == (2 * runner.cfg.num_layers if "moe" in name else 0)
    pairs = {p.name: p for p in runner.model.get_parameters()             # (not the layers' stacks: fuse)
             if p.dtype == ms.uint32 and not p.name.startswith("stack.")}
    assert set(pairs) == linear | experts and len(linear) >= 4 * runner.cfg.num_layers + 1
    for key, p in pairs.items():            # half float32's bytes, an odd input padded
        *lead, rows, cols = float32[key].shape
        count = int(np.prod(lead))
        assert p.nbytes == 4 * count * rows * ((cols + 1) // 2) and p.nbytes <= float32[key].nbytes / 2 + 2 * count * rows
    caches = [c for layer in runner.model.layers for c in layer.self_attn.caches()]
    assert len(caches) == 2 * runner.cfg.num_layers and all(c.dtype == ms.uint16 for c in caches)
    assert runner.kv_bytes() == plan.model.kv_bytes(runner.block_size, 2) * (runner.num_blocks + 1)
    assert plan.kv_bytes_per_rank == plan.model.kv_bytes(plan.engine.block_size, 2) * (plan.engine.blocks() + 1)
    with pytest.raises(LayoutError, match="model.dtype bfloat16 does not run on the CPU with model.ops portable"):
        plan_job(spec(dtype="bfloat16", ops="portable"), check_io=False)
    rec, f32 = Recording(runner), Recording(runner_for(path))
    out = Driver(rec).generate(dict(enumerate(PROMPTS)), N_NEW)
    Driver(f32).generate(dict(enumerate(PROMPTS)), N_NEW)
    diffs, aways, same = against_the_rounded_cache(transformers_in_bfloat16_linears(path), out, rec, f32, name)
    assert np.median(diffs) < BF16_LOGIT_ATOL < min(aways), (diffs, aways)
    assert sum(same) >= len(PROMPTS) - 1, same


def test_a_bfloat16_kv_cache_in_a_float32_job_gives_the_tokens_of_transformers_rounding_its_cache(checkpoint):
    """model.kv_cache_dtype bfloat16 (vLLM's kv_cache_dtype) in a float32 job on the CPU kernels:
    the cache holds K and V rounded to the nearest bfloat16, half float32's bytes as the plan
    counts them, and the linear layers stay float32. Against transformers in float32 with its
    cache rounded the same way: the logits of most steps within BF16_LOGIT_ATOL, where the
    float32 cache's are outside it, and the greedy tokens of all prompts but at most one (a
    value on a rounding boundary may round the other way). Where the cache is bfloat16 already
    (model.dtype bfloat16) the key changes nothing; where it cannot be bfloat16 the plan names
    the key and why."""
    import mindspore as ms
    from msinfer.launcher.job import LayoutError, plan_job
    from msinfer.launcher.spec import JobSpec
    from msinfer.sharding.config import ModelConfig, cpu_kv_cache_dtype
    name = "llama_gqa_tied"
    path = checkpoint(name)

    def spec(path=path, **model):
        return JobSpec.model_validate({"model": {"path": str(path), "max_model_len": 128, **model},
                                       "sampling": {"max_new_tokens": N_NEW},
                                       "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"}})
    plan, f32_plan = (plan_job(spec(kv_cache_dtype=kv), check_io=False) for kv in ("bfloat16", "auto"))
    assert (plan.engine.dtype, plan.engine.matmul_dtype, plan.engine.kv_cache_dtype) == ("float32", "float32",
                                                                                         "bfloat16")
    assert 2 * plan.kv_bytes_per_rank == f32_plan.kv_bytes_per_rank
    assert plan.weight_bytes_per_rank == f32_plan.weight_bytes_per_rank
    assert "compute dtype float32 (KV cache bfloat16)" in plan.describe()
    assert "compute dtype float32 (linear layers and KV cache bfloat16)" in \
        plan_job(spec(dtype="bfloat16"), check_io=False).describe()         # the CPU kernels in bfloat16
    assert plan_job(spec(dtype="bfloat16", kv_cache_dtype="bfloat16"), check_io=False).engine == \
        plan_job(spec(dtype="bfloat16"), check_io=False).engine
    for model, why in [({"ops": "portable"}, "the portable operators"),
                       ({"dtype": "float16"}, "not a float16 one")]:
        with pytest.raises(LayoutError, match=f"model.kv_cache_dtype bfloat16: .*{why}"):
            plan_job(spec(kv_cache_dtype="bfloat16", **model), check_io=False)
    with pytest.raises(LayoutError, match="latent attention's cache"):
        plan_job(spec(checkpoint("deepseek_v3_yarn_groups"), kv_cache_dtype="bfloat16"), check_io=False)
    cfg = ModelConfig.from_dir(path)
    with pytest.raises(ValueError, match="Ascend's attention kernels read a cache of the compute dtype"):
        cpu_kv_cache_dtype("bfloat16", cfg, "ascend", "float16", "float32")
    assert cpu_kv_cache_dtype("bfloat16", cfg, "ascend", "bfloat16", "float32") == "auto"

    runner = ModelRunner(EngineConfig(str(path), max_model_len=128, max_batch_size=8, kv_cache_dtype="bfloat16"))
    caches = [c for layer in runner.model.layers for c in layer.self_attn.caches()]
    assert len(caches) == 2 * runner.cfg.num_layers and all(c.dtype == ms.uint16 for c in caches)
    assert all(p.dtype != ms.uint32 for p in runner.model.get_parameters())          # no bfloat16 pairs
    rec, f32 = Recording(runner), Recording(runner_for(path))
    out = Driver(rec).generate(dict(enumerate(PROMPTS)), N_NEW)
    Driver(f32).generate(dict(enumerate(PROMPTS)), N_NEW)
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    diffs, aways, same = against_the_rounded_cache(model, out, rec, f32, name)
    assert np.median(diffs) < BF16_LOGIT_ATOL < np.median(aways), (diffs, aways)
    assert sum(same) >= len(PROMPTS) - 1, same


def test_each_layers_loaded_float_weights_are_freed_before_the_next_layer_loads(checkpoint, monkeypatch):
    """A bfloat16 checkpoint loads as float32 and is held in bfloat16 panels (the test above).
    Each decoder layer is packed as its last tensor loads, and the float32 parameters it replaces
    are gone once CausalLM.UNCOLLECTED_BYTES of them wait (here: each layer's), so that loading a
    rank never holds the whole model in float32."""
    import weakref
    from msinfer.sharding.layers import LinearBase
    from msinfer.worker.model import CausalLM
    loaded, alive = [], []
    replaced: list = []
    pack_layer = CausalLM.pack_layer

    def spy(model, index):
        layer = model.layers[model.layer_ids.index(index)]
        replaced.extend(weakref.ref(c.weight) for _, c in layer.cells_and_names() if isinstance(c, LinearBase))
        pack_layer(model, index)
        loaded.append(index)
        alive.append(sum(r() is not None for r in replaced))
    monkeypatch.setattr(CausalLM, "pack_layer", spy)
    monkeypatch.setattr(CausalLM, "UNCOLLECTED_BYTES", 0)       # (this model's layers are small)
    runner = ModelRunner(EngineConfig(str(checkpoint("llama_gqa_tied_bfloat16")), max_model_len=64, max_batch_size=2))
    assert loaded == list(range(runner.cfg.num_layers))
    assert len(replaced) == 4 * runner.cfg.num_layers and alive == [0] * len(loaded)


def test_prefill_decode_and_scoring_alternate_in_any_order(checkpoint, hf_greedy):
    """A generation, then a new prompt joining mid-way, then a scoring-style forward, then more
    decoding: every sequence gets exactly the tokens a fresh model gives it alone."""
    name = "qwen3_qknorm_odd_head_dim"
    runner = runner_for(checkpoint(name))
    d = Driver(runner)
    d.prefill({0: PROMPTS[0]})
    d.decode([0]); d.decode([0])
    d.prefill({1: PROMPTS[1]})                     # joins while 0 decodes
    d.decode([0, 1])
    scored = runner.forward(d_steps_for_scoring(d, 2, PROMPTS[2]), True)   # a forward, nothing sampled
    for _ in range(N_NEW):
        d.decode([0, 1])
    d.prefill({3: PROMPTS[2]})                     # after scoring, a generation of the scored prompt
    for _ in range(N_NEW - 1):
        d.decode([3])
    assert d.seqs[0]["gen"][:N_NEW] == hf_greedy(name, PROMPTS[0], N_NEW)[0]
    assert d.seqs[1]["gen"][:N_NEW] == hf_greedy(name, PROMPTS[1], N_NEW)[0]
    assert d.seqs[3]["gen"][:N_NEW] == hf_greedy(name, PROMPTS[2], N_NEW)[0]
    ref_first = hf_greedy(name, PROMPTS[2], N_NEW)[1][0]
    assert np.abs(scored[0] - ref_first).max() < LOGIT_ATOL


def d_steps_for_scoring(driver, sid, prompt):
    from msinfer.worker.protocol import SeqStep
    return [SeqStep(sid, list(prompt), 0, driver.table(sid), sample=False)]


def test_pynative_debug_mode_gives_the_same_tokens(checkpoint):
    path = checkpoint("llama_gqa_tied")
    prompts = {0: PROMPTS[0], 1: PROMPTS[1]}
    graph = Driver(runner_for(path, True)).generate(prompts, 4)
    eager = Driver(runner_for(path, False)).generate(prompts, 4)
    assert graph == eager


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(checkpoint):
    runner = runner_for(checkpoint("llama_mqa"))
    s = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = Driver(runner).generate({0: PROMPTS[0]}, 6, s)[0]
    others = {i: [(7 * i + j) % 200 + 3 for j in range(3 + i)] for i in range(1, 16)}
    batched = Driver(runner, blocks_per_seq=2).generate({0: PROMPTS[0], **others}, 6, s)[0]     # a batch of 16
    other_seed = Driver(runner).generate({0: PROMPTS[0]}, 6, SamplingParams(temperature=1.0, seed=99))[0]
    assert alone == batched
    assert alone != other_seed


def test_a_prefill_too_large_for_one_packed_step_runs_split_and_gives_the_same_logits(checkpoint, monkeypatch):
    """More prompt tokens than one packed prefill takes (PREFILL_SPLIT_TOKENS): the runner splits
    the step by whole sequences, and each sequence's logits equal a prefill of it alone."""
    import msinfer.worker.runner as runner_module
    from msinfer.worker.protocol import SeqStep
    runner = runner_for(checkpoint("llama_gqa_tied"))
    rng = np.random.default_rng(0)
    steps = [SeqStep(i, [int(t) for t in rng.integers(0, 100, n)], 0, list(range(8 * i, 8 * i + 8)))
             for i, n in enumerate((20, 40, 30))]
    alone = [runner.execute([s], True)[0][0] for s in steps]
    monkeypatch.setattr(runner_module, "PREFILL_SPLIT_TOKENS", 64)   # 90 tokens: run as 20+40, then 30
    network, calls = runner.network, []
    monkeypatch.setattr(runner, "network", lambda seqs, *a: calls.append(len(seqs)) or network(seqs, *a))
    together, scores = runner.execute(steps, True)
    assert calls == [2, 1]
    assert together.shape[0] == 3 and scores is None
    for i in range(3):
        assert np.abs(together[i] - alone[i]).max() < 1e-4, f"prompt {i}"


def test_a_step_runs_padded_in_a_compiled_shape_until_the_padding_would_have_paid_for_a_compile(
        checkpoint, monkeypatch):
    """Ski rental over graph shapes: a step whose own bucket is not compiled runs in the next
    larger compiled one (same logits), until the padding paid that way reaches
    PAD_TOKENS_BEFORE_COMPILE tokens; a shape more than twice too large is never used."""
    import msinfer.worker.runner as runner_module
    from msinfer.worker.protocol import SeqStep
    monkeypatch.setattr(runner_module, "PAD_TOKENS_BEFORE_COMPILE", 100)
    runner = ModelRunner(EngineConfig(str(checkpoint("llama_gqa_tied")), max_model_len=128, max_batch_size=8))
    rng = np.random.default_rng(1)

    def prompt(seq_id, n):
        return SeqStep(seq_id, [int(t) for t in rng.integers(3, 200, n)], 0, list(range(8 * seq_id, 8 * seq_id + 8)))

    runner.forward([prompt(0, 100)], True)
    assert runner.graphs == {(128, 8)}
    short = prompt(1, 40)                                  # its own bucket is 64: runs padded to 128
    padded = runner.forward([short], True)
    assert runner.graphs == {(128, 8)} and runner.pad_debt == {(64, 8): 64}
    inputs = runner.prepare([short], True, reuse=False)[0]
    own = runner.step_fn(*(inputs[name] for name in STEP_INPUTS))[0].asnumpy()[:1]
    assert np.abs(padded - own).max() < 1e-5
    runner.forward([prompt(2, 40)], True)                  # 64 + 64 padded tokens >= 100: compiles 64
    assert runner.graphs == {(128, 8), (64, 8)}
    runner.forward([SeqStep(1, [5], 40, short.block_table)], False)     # 1 token: 64 is 8x too large
    assert (8, 8) in runner.graphs


def test_step_graphs_in_mindspore_inference_mode_run_each_shape_in_its_own_graph(checkpoint, monkeypatch):
    """The CPU kernels' step graphs run in MindSpore's inference mode, which keeps one graph per
    value of the network's `phase` whatever the inputs' shapes: prefill and decode steps of three
    shapes, two of them met again after another, give the logits that graphs compiled in the
    default mode (MSINFER_INFER_BOOST=0) give, to the bit."""
    import msinfer.worker.runner as runner_module
    from msinfer.worker.cpu import CpuOps, load_kernels
    from msinfer.worker.ops import INFERENCE_MODE
    from msinfer.worker.protocol import SeqStep
    path = str(checkpoint("llama_gqa_tied"))
    rng = np.random.default_rng(2)
    table = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    prompts = [[int(t) for t in rng.integers(3, 200, n)] for n in (40, 100, 40)]
    steps = [([SeqStep(0, prompts[0], 0, table[0])], True),               # N 64
             ([SeqStep(0, [5], 40, table[0])], False),                    # 8
             ([SeqStep(1, prompts[1], 0, table[1])], True),               # 128
             ([SeqStep(2, prompts[2], 0, table[2])], True),               # 64
             ([SeqStep(0, [6], 41, table[0]), SeqStep(1, [7], 100, table[1])], False)]    # 8

    def logits(runner):
        return [runner.forward(*step) for step in steps]

    assert CpuOps.static_step_jit_options == INFERENCE_MODE
    monkeypatch.setattr(runner_module, "PAD_TOKENS_BEFORE_COMPILE", 0)      # a graph for every bucket
    boosted = ModelRunner(EngineConfig(path, max_model_len=128, max_batch_size=8))
    monkeypatch.setenv("MSINFER_INFER_BOOST", "0")
    load_kernels()
    assert CpuOps.static_step_jit_options is None
    plain = ModelRunner(EngineConfig(path, max_model_len=128, max_batch_size=8))
    monkeypatch.delenv("MSINFER_INFER_BOOST")
    load_kernels()
    assert boosted.graphs == set() and plain.graphs == set()
    for a, b in zip(logits(boosted), logits(plain)):
        np.testing.assert_array_equal(a, b)
    assert boosted.graphs == {(8, 8), (64, 8), (128, 8)}


def test_float16_on_the_cpu_gives_transformers_greedy_tokens(checkpoint, hf_greedy):
    """The CPU kernels' half-precision path (loads and stores in float16, sums in float32), on the
    variant with q/k norms and an odd head_dim; prompts of 2-17 tokens cover single tokens and
    16-token prefill tiles."""
    name = "qwen3_qknorm_odd_head_dim"
    runner = ModelRunner(EngineConfig(str(checkpoint(name)), dtype="float16", max_model_len=128, max_batch_size=8))
    rec = Recording(runner)
    out = Driver(rec).generate(dict(enumerate(PROMPTS)), N_NEW)
    for i, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = hf_greedy(name, prompt, N_NEW)
        assert out[i] == ref_tokens, f"prompt {i}"
        assert np.abs(rec.logits[0][i] - ref_logits[0]).max() < 5e-2 * np.abs(ref_logits[0]).max()


def test_the_cpu_kernels_say_what_they_need_when_they_cannot_be_built(tmp_path, monkeypatch):
    import msinfer.worker.build as build
    monkeypatch.setenv("MSINFER_CACHE", str(tmp_path))           # nothing built there yet
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="need a C.. compiler: install g.. or set CXX"):
        build.kernel_library("kernels")
    assert build.start_build() is None                            # the driver leaves the error to the workers
    monkeypatch.setenv("CXX", "false")                            # a compiler that fails
    with pytest.raises(RuntimeError, match=r"building .*kernels\.cc with false failed"):
        build.kernel_library("kernels")
    assert not list(tmp_path.rglob("*.so"))


def test_the_driver_builds_the_kernel_library_where_the_workers_look_for_it(tmp_path, monkeypatch):
    """start_build (a job's driver, before Ray starts) builds in a process of its own the library
    that a worker's kernel_library then finds, and nothing once it is built. The compiler is a
    script that writes what it is asked to and logs each call."""
    import msinfer.worker.build as build
    log = tmp_path / "calls"
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\necho "$@" >> {log}\nwhile [ "$1" != -o ]; do shift; done\necho built > "$2"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("MSINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(cxx))
    proc = build.start_build()
    assert proc is not None and proc.wait(timeout=60) == 0
    lib = build.library_path("kernels", str(cxx))
    assert lib.read_text() == "built\n"
    calls = log.read_text().splitlines()
    assert len(calls) == len(list(build.CSRC.glob("*.cc"))) + 1 and "-shared" in calls[-1]   # compiled, linked
    assert build.kernel_library("kernels") == str(lib) and build.start_build() is None
    assert log.read_text().splitlines() == calls                                  # nothing built again


def test_step_inputs_pack_each_sequences_tokens_and_refuse_a_short_block_table(checkpoint):
    """The step's packed inputs for a prefill chunk and a decode side by side: each token's position,
    cache slot (through its own block table), sequence and context length; the logits row of each
    sequence is its last token's. A block table too short for the tokens, or naming a block the
    cache does not have, is refused by name (its writes would land outside the cache)."""
    from msinfer.worker.protocol import SeqStep
    runner = runner_for(checkpoint("llama_gqa_tied"))
    bs = runner.block_size
    steps = [SeqStep(7, [11, 12, 13], bs - 1, [4, 9]), SeqStep(8, [14], 2 * bs + 5, [1, 2, 6])]
    inputs, first_row = runner.prepare(steps, True)
    ids, rope, slots, tables, token_seq, token_len, out_index = (inputs[k] for k in (
        "input_ids", "positions", "slot_mapping", "block_tables", "token_seq", "token_len", "out_index"))
    assert first_row == [0, 3]
    assert ids.asnumpy()[:4].tolist() == [11, 12, 13, 14]
    positions = [bs - 1, bs, bs + 1, 2 * bs + 5]
    assert rope.asnumpy()[:4, 0].tolist() == positions
    assert slots.asnumpy()[:4].tolist() == [4 * bs + bs - 1, 9 * bs, 9 * bs + 1, 6 * bs + 5]
    assert (slots.asnumpy()[4:] == runner.scratch_block * bs).all()           # padding writes to scratch
    assert token_seq.asnumpy()[:4].tolist() == [0, 0, 0, 1]
    assert token_len.asnumpy()[:4].tolist() == [p + 1 for p in positions]
    assert out_index.asnumpy()[:3].tolist() == [2, 3, -1]
    assert tables.asnumpy()[0, :3].tolist() == [4, 9, runner.scratch_block]
    with pytest.raises(ValueError, match="sequence 8: block table holds 2 blocks, too few for 38 tokens"):
        runner.prepare([steps[0], SeqStep(8, [14], 2 * bs + 5, [1, 2])], True)
    beyond = runner.num_blocks
    with pytest.raises(ValueError, match=f"sequence 9: block table names a block outside the KV cache's "
                                         f"{beyond}: \\[3, {beyond}\\]"):
        runner.prepare([steps[0], SeqStep(9, [14], bs + 2, [3, beyond])], True)


def test_a_chunk_after_cached_tokens_runs_the_prefill_graph_of_its_shape(checkpoint):
    """On the CPU kernels a prefill and a step that reads the cache are one function (attention
    reads the paged cache either way): a prompt's second chunk (kind decode: it has cached tokens)
    in the shape of the first chunk's step runs that step's graph, compiling nothing, and ends with
    the logits the whole prompt in one step gives."""
    from msinfer.worker.protocol import SeqStep
    runner = ModelRunner(EngineConfig(str(checkpoint("llama_gqa_tied")), max_model_len=128, max_batch_size=8))
    prompt = PROMPTS[0] * 3
    table = list(range(-(-len(prompt) // runner.block_size)))
    runner.forward([SeqStep(0, prompt[:5], 0, table)], True)
    compiled = dict(runner.compile_s)
    chunk = [SeqStep(0, prompt[5:], 5, table)]
    assert runner.kind(chunk, True) == "decode"
    chunked = runner.forward(chunk, True)
    assert runner.compile_s == compiled and len(compiled) == 1
    whole = runner.forward([SeqStep(1, prompt, 0, [b + len(table) for b in table])], True)
    np.testing.assert_allclose(chunked, whole, atol=LOGIT_ATOL, rtol=0)
