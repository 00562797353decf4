"""Tier 2: the portable network (`model.ops: portable`) and the Ascend path emulated on the CPU
(MSINFER_ASCEND_EMULATE=1: Ascend's fused kernels stood in, worker/ascend.py) generate what
transformers generates, feed their kernels what the CPU kernels see, call the installed
MindSpore primitives as their signatures and MindSpore's own graph compiler accept, and compile
each step kind once with dynamic shapes."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

from tests.checkpoints import VARIANTS
from tests.conftest import PROMPTS
from tests.engine_driver import Driver
from tests.test_parity import Recording
from tests.test_scoring import hf_log_softmax, hf_logprobs
from msinfer.worker.protocol import SamplingParams, SeqStep
from msinfer.sharding.config import EngineConfig
from msinfer.worker.runner import ModelRunner

N_NEW = 8
LOGIT_ATOL = 2e-4
# the fused kernels take float16 and bfloat16 only (a card's bfloat16 is emulated in float16)
# (the start-up kernel check is tested on its own: these runners take the stand-ins as documented)
PATHS = {"portable": dict(ops="portable"),
         "ascend-emulated": dict(device="ascend", emulate=True, dtype="float16", kernel_check=False)}
_RUNNERS: dict = {}


def runner_for(path, path_kind: str, **extra) -> ModelRunner:
    key = (str(path), path_kind, tuple(sorted(extra.items())))
    if key not in _RUNNERS:
        _RUNNERS[key] = ModelRunner(EngineConfig(str(path), max_model_len=128, max_batch_size=8,
                                                 **{**PATHS[path_kind], **extra}))
    return _RUNNERS[key]


# The Ascend path on every checkpoint but the Qwen2-MoE one (test_moe runs it at tp 2 on this
# path) and DeepSeek-V2 (whose kernels are DeepSeek-V3's: it differs in routing, which runs in
# portable operators); the portable operators, which the Ascend stand-ins share but for attention,
# norms and the experts, on one dense checkpoint of each attention kind and the MoEs.
CASES = [(v, "ascend-emulated") for v in VARIANTS if not v.endswith("_bfloat16")
         and v not in ("qwen2_moe_top4_shared_tied", "deepseek_v2_groups_no_q_lora")]
CASES += [(v, "portable") for v in ("llama_gqa_tied", "qwen3_qknorm_odd_head_dim", "qwen2_moe_top4_shared_tied",
                                    "deepseek_v2_groups_no_q_lora")]


# largest |logit - transformers' float32 logit| accepted: float32, and float16 (the emulated fused
# kernels' dtype; 4-7e-3 measured on these checkpoints, up to 1.5e-2 on DeepSeek-V3's, whose
# routed_scaling_factor 2.5 scales its experts' float16 rounding: 2e-2 there)
ATOL = {"portable": LOGIT_ATOL, "ascend-emulated": 1.5e-2}
MLA_FLOAT16_ATOL = 2e-2


def assert_greedy_parity(label: str, tokens: list[int], logits: list | None, ref_tokens: list[int],
                         ref_logits: list, atol: float) -> None:
    """Greedy tokens are transformers' and their logits (where given) within atol of its float32
    ones, up to a step where transformers' two best tokens are within 2 atol of each other:
    rounding may pick either there (float16 does, once in these tests), and the sequences part
    after it."""
    assert len(tokens) == len(ref_tokens), label
    for j, (t, r) in enumerate(zip(tokens, ref_tokens)):
        if logits is not None:
            diff = np.abs(logits[j] - ref_logits[j]).max()
            assert diff < atol, f"{label} step {j}: max |logit diff| {diff}"
        if t != r:
            second, first = np.sort(ref_logits[j])[-2:]
            assert first - second < 2 * atol, f"{label} step {j}: token {t}, transformers {r} by a margin of " \
                                              f"{first - second:.4g}"
            return


@pytest.mark.parametrize("name,path_kind", CASES)
def test_greedy_tokens_and_logits_match_transformers(name, path_kind, checkpoint, hf_greedy):
    """GQA, MQA, q/k/v and MLP biases, q/k norms with head_dim 24, tied embeddings, mixtures of
    experts; prefill (all prompts at once, nothing cached) and decode steps; the emulated fused
    kernels in float16, the portable operators in float32."""
    rec = Recording(runner_for(checkpoint(name), path_kind))
    out = Driver(rec).generate(dict(enumerate(PROMPTS)), N_NEW)
    for i, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = hf_greedy(name, prompt, N_NEW)
        atol = MLA_FLOAT16_ATOL if name.startswith("deepseek") and path_kind == "ascend-emulated" else ATOL[path_kind]
        assert_greedy_parity(f"{name} {path_kind} prompt {i}", out[i], [step[i] for step in rec.logits], ref_tokens,
                             ref_logits, atol)


@pytest.mark.parametrize("path_kind,dtype,atol", [("portable", "float32", 1e-4), ("portable", "float16", 2e-2),
                                                   ("ascend-emulated", "float16", 2e-2)])
def test_scoring_log_probabilities_match_transformers(path_kind, dtype, atol, checkpoint):
    """Scoring runs as a prefill of the paged (decode) kind; in float16 the log-probabilities stay
    within 2e-2 of transformers' float32 ones, on both paths; in float32 the alternatives of
    `prompt_logprobs: 3` are transformers' three most likely tokens."""
    name = "qwen2_qkv_bias"
    tokens = PROMPTS[2] + PROMPTS[0]
    runner = runner_for(checkpoint(name), path_kind, dtype=dtype)
    step = SeqStep(0, tokens, 0, list(range(8)), targets=tokens[1:] + [-1], sample=False)
    _, scores = runner.execute([step], True)
    np.testing.assert_allclose([lp for lp, _ in scores[0]], hf_logprobs(checkpoint(name), tokens[:1], tokens[1:]),
                               atol=atol)
    if dtype == "float32":
        step = SeqStep(1, tokens, 0, list(range(8, 16)), SamplingParams(prompt_logprobs=3), targets=tokens[1:] + [-1],
                       sample=False)
        _, scores = runner.execute([step], True)
        lp = hf_log_softmax(checkpoint(name), tokens)
        for j, (chosen, rank, top) in enumerate(scores[0]):
            assert abs(chosen - lp[j, tokens[j + 1]]) < atol
            assert rank == (lp[j] >= lp[j, tokens[j + 1]]).sum()           # vLLM's rank, as transformers ranks it
            assert [t for t, _ in top] == np.argsort(-lp[j], kind="stable")[:3].tolist()


@pytest.mark.parametrize("path_kind", list(PATHS))
def test_chunked_prefill_joining_decodes_gives_the_cpu_kernels_logits(path_kind, checkpoint, hf_greedy):
    """A step that mixes a prefill chunk after cached tokens (PagedAttention with q_seq_lens and the
    causal mask on Ascend) with decodes of other sequences: the same logits as the CPU kernels
    (`model.ops: auto` on the CPU) to the path's tolerance (float32, or float16 emulated), and
    then transformers' tokens."""
    name = "llama_gqa_tied"
    path = checkpoint(name)
    cpu = ModelRunner(EngineConfig(str(path), max_model_len=128, max_batch_size=8))
    other = runner_for(path, path_kind)
    long_prompt = PROMPTS[2]
    logits = {}
    for kind, runner in (("cpu", cpu), (path_kind, other)):
        d = Driver(runner)
        d.prefill({0: PROMPTS[0], 1: PROMPTS[1]})
        first = runner.step([SeqStep(2, long_prompt[:10], 0, d.table(2), sample=False)], True)   # chunk 1
        assert first.token_ids == [-1] and first.host_bytes == 0      # nothing sampled: nothing copied
        assert 0 < first.model_s <= first.worker_s                      # the device's time, waited for
        mixed = [SeqStep(2, long_prompt[10:], 10, d.table(2))] + [
            SeqStep(s, [d.seqs[s]["gen"][-1]], len(d.seqs[s]["prompt"]), d.table(s), num_generated=1) for s in (0, 1)]
        logits[kind] = runner.forward(mixed, True)
        assert runner.kind(mixed, True) == "decode"
    np.testing.assert_allclose(logits[path_kind], logits["cpu"], atol=ATOL[path_kind])
    assert int(logits[path_kind][0].argmax()) == hf_greedy(name, long_prompt, N_NEW)[0][0]


def test_lora_on_the_emulated_ascend_path_gives_transformers_tokens(checkpoint, tmp_path):
    """A PEFT adapter merged as the shards load (worker/lora.py), on the emulated Ascend path."""
    import peft
    import torch
    import transformers
    name = "qwen2_qkv_bias"
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(name), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                          "down_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path / "adapter")
    merged = model.merge_and_unload().eval()
    with torch.no_grad():
        expected = merged.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=N_NEW, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(PROMPTS[0]):].tolist()
    runner = runner_for(checkpoint(name), "ascend-emulated", lora_path=str(tmp_path / "adapter"))
    assert Driver(runner).generate({0: PROMPTS[0]}, N_NEW)[0] == expected


def test_each_step_kind_compiles_once_whatever_the_token_counts(checkpoint):
    """Dynamic shapes: prefills and decodes of many different token and sequence counts, scoring
    and chunks in between, and MindSpore compiles one graph per step kind and one for the device
    sampler's whole logits, each once (its own count of the graphs it built,
    mindspore.graph.api.ms_compile_cache)."""
    from mindspore.graph import api
    import msinfer.worker.runner as runner_module
    runner_module.SAMPLER_FNS.clear()           # compiled by an earlier test's runner of this vocabulary
    runner = ModelRunner(EngineConfig(str(checkpoint("llama_mqa")), max_model_len=128, max_batch_size=8,
                                      ops="portable"))
    assert runner.dynamic
    before = len(api.ms_compile_cache)
    rng = np.random.default_rng(0)
    d = Driver(runner)
    for sid, n in enumerate((3, 17, 5, 30)):
        d.prefill({sid: [int(t) for t in rng.integers(3, 200, n)]})
        for _ in range(sid + 1):
            d.decode()
    runner.execute([SeqStep(9, [5, 6, 7, 8], 0, d.table(7), targets=[6, 7, 8, -1], sample=False)], True)
    runner.execute([SeqStep(9, [5, 6, 7, 8, 9], 0, d.table(7), targets=[6, 7, 8, 9, -1], sample=False)], True)
    assert len(api.ms_compile_cache) - before == 3 + 1
    assert set(runner.compile_s) == {"prefill", "decode", "score"}


def test_a_step_copies_to_the_host_only_its_tokens_and_the_log_probabilities_asked_for(checkpoint):
    """Sampling on the device, dynamic shapes (no padding rows): a greedy or sampled decode copies
    4 bytes a sequence (its token), one with logprobs k also the token's log-probability and the
    top k's values and ids; one whose logits a bias or a token mask changes, no more than that
    and the tokens and their scores once more."""
    d = Driver(runner_for(checkpoint("llama_gqa_tied"), "ascend-emulated"))
    d.prefill({0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[2]})
    assert d.decode().host_bytes == 4 * 3
    for sid, seq in d.seqs.items():
        seq["sampling"] = SamplingParams(temperature=0.8, top_p=0.9, seed=sid)
    assert d.decode().host_bytes == 4 * 3
    d.seqs[1]["sampling"] = SamplingParams(temperature=0.8, seed=1, logprobs=2)
    out = d.decode()
    assert out.host_bytes == (4 + 4 + 8 * 2) * 3 and len(out.logprobs[1][1]) == 2 and out.logprobs[0] is None
    # logits changed on the device first (a bias, a token mask): still no logits copied; the
    # log-probabilities are the model's own, so the tokens drawn and their scores come out too
    d.seqs[0]["sampling"] = SamplingParams(logit_bias=((7, 50.0),))
    d.seqs[1]["sampling"] = SamplingParams(temperature=0.8, seed=1, allowed_token_ids=(3, 4), logprobs=2)
    out = d.decode()
    assert out.token_ids[0] == 7 and out.token_ids[1] in (3, 4)
    assert out.logprobs[1][0] < 0 and out.host_bytes <= (4 + 4 + 8 * 2) * 3 + 2 * 4 * 3


def test_the_stand_ins_take_the_installed_primitives_signatures():
    """Each stand-in's constructor and call take exactly the installed MindSpore primitive's
    parameters, with its defaults: code that runs with the stand-ins calls the real kernels the
    same way."""
    from mindspore.ops import auto_generate
    from msinfer.worker.ascend import KERNELS, MOE_KERNELS, StandIns

    def params(fn):
        return [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]

    for name in KERNELS + MOE_KERNELS:
        real, stand_in = getattr(auto_generate, name), getattr(StandIns, name)
        assert params(stand_in.__init__) == params(real.__init__), name
        assert params(stand_in.construct) == params(real.__call__), name


def test_every_kernel_call_passes_arguments_the_installed_primitives_accept(checkpoint, monkeypatch):
    """Recording stand-ins, run eagerly (PyNative) through a prefill, a chunk and a decode: every
    constructor and call binds to the installed primitive's signature, lengths are int32 and the
    caches are the layer's Parameters in [blocks, block_size, KV, D]."""
    import mindspore as ms
    from mindspore.ops import auto_generate
    import msinfer.worker.ascend as ascend
    calls = []

    def recording(name):
        base = getattr(ascend.StandIns, name)
        real = getattr(auto_generate, name)

        class Recorder(base):
            def __init__(self, *args, **kwargs):
                inspect.signature(real.__init__).bind(None, *args, **kwargs)
                super().__init__(*args, **kwargs)

            def construct(self, *args, **kwargs):
                bound = inspect.signature(real.__call__).bind(None, *args, **kwargs)
                calls.append((name, {k: v for k, v in bound.arguments.items() if k != "self"}))
                return super().construct(*args, **kwargs)
        return Recorder

    class Recording:
        ReshapeAndCache, FlashAttentionScore = recording("ReshapeAndCache"), recording("FlashAttentionScore")
        PagedAttention, RmsNorm = recording("PagedAttention"), recording("RmsNorm")

    monkeypatch.setattr(ascend.EmulatedAscendOps, "kernels", Recording)
    runner = ModelRunner(EngineConfig(str(checkpoint("llama_mqa")), max_model_len=128, max_batch_size=8,
                                      device="ascend", emulate=True, graph_mode=False, dtype="float16",
                                      kernel_check=False))
    d = Driver(runner)
    d.prefill({0: PROMPTS[0], 1: PROMPTS[1]})
    runner.step([SeqStep(2, PROMPTS[2][:5], 0, d.table(2), sample=False)], True)
    runner.step([SeqStep(2, PROMPTS[2][5:], 5, d.table(2))], True)
    d.decode()
    kinds = {name for name, _ in calls}
    assert kinds == {"ReshapeAndCache", "FlashAttentionScore", "PagedAttention", "RmsNorm"}
    cache_shape = (runner.num_blocks + 1, runner.block_size, 1, 16)
    for name, args in calls:
        if name == "ReshapeAndCache":
            assert isinstance(args["key_cache"], ms.Parameter) and args["key_cache"].shape == cache_shape
            assert args["slot_mapping"].dtype == ms.int32
        if name == "PagedAttention":
            assert isinstance(args["key_cache"], ms.Parameter)
            assert args["context_lens"].dtype == args["q_seq_lens"].dtype == args["block_tables"].dtype == ms.int32
        if name == "FlashAttentionScore":
            assert args["actual_seq_qlen"].dtype == ms.int32 and args["attn_mask"].shape == (128, 128)


def test_a_mixture_of_experts_calls_its_kernels_as_vllm_mindspore_does(checkpoint, hf_greedy, monkeypatch):
    """The routed experts of a sparse layer on the emulated Ascend path, recorded eagerly through a
    prefill and a decode: each call binds to the installed primitive's signature; expert ids are
    int32, group_list int64 counts of the experts held, weights [E, in, out]; the unpermute's
    probs are in the activation's dtype. Expert parallel at tp 1 holds every expert."""
    import mindspore as ms
    from mindspore.ops import auto_generate
    import msinfer.worker.ascend as ascend
    calls = []

    def recording(name):
        base, real = getattr(ascend.StandIns, name), getattr(auto_generate, name)

        class Recorder(base):
            def construct(self, *args, **kwargs):
                bound = inspect.signature(real.__call__).bind(None, *args, **kwargs)
                calls.append((name, {k: v for k, v in bound.arguments.items() if k != "self"}))
                return super().construct(*args, **kwargs)
        return Recorder

    kernels = type("Recording", (ascend.StandIns,), {name: recording(name) for name in ascend.MOE_KERNELS})
    monkeypatch.setattr(ascend.EmulatedAscendOps, "kernels", kernels)
    name = "qwen2_moe_top4_shared_tied"
    runner = ModelRunner(EngineConfig(str(checkpoint(name)), max_model_len=128, max_batch_size=8, device="ascend",
                                      emulate=True, graph_mode=False, expert_parallel=True, dtype="float16",
                                      kernel_check=False))
    out = Driver(runner).generate({0: PROMPTS[0], 1: PROMPTS[1]}, N_NEW)
    for i in (0, 1):
        assert_greedy_parity(f"{name} prompt {i}", out[i], None, *hf_greedy(name, PROMPTS[i], N_NEW),
                             ATOL["ascend-emulated"])
    assert {n for n, _ in calls} == set(ascend.MOE_KERNELS)
    for kernel, args in calls:
        if kernel == "MoeGatingTopKSoftmax":
            assert args["k"] == 4 and args["x"].shape[1] == 6
        if kernel == "MoeInitRoutingV2":
            assert args["expert_idx"].dtype == ms.int32 and args["expert_num"] == 7 and args["drop_pad_mode"] == 0
        if kernel == "GroupedMatmulV4":
            assert args["group_list"].dtype == ms.int64 and args["group_list"].shape == (6,)
            assert args["weight"][0].shape in ((6, 64, 48), (6, 24, 64))          # [E, in, out]
            assert (args["split_item"], args["group_type"], args["group_list_type"]) == (3, 0, 1)
        if kernel == "MoeTokenUnpermute":
            assert args["probs"].dtype == args["permuted_tokens"].dtype == ms.float16


@pytest.mark.parametrize("kernel", ["MoeGatingTopKSoftmax", "MoeInitRoutingV2", "GroupedMatmulV4",
                                    "MoeTokenUnpermute"])
def test_the_installed_moe_primitives_compile_as_called_and_fail_only_at_kernel_selection(kernel, checkpoint,
                                                                                         monkeypatch):
    """The real MoE primitives (every kernel before `kernel` stood in) go through MindSpore's graph
    compiler as msinfer calls them and stop only where the CPU has no kernel; the error names the
    kernel and what it was given."""
    from mindspore.ops import auto_generate
    import msinfer.worker.ascend as ascend
    from msinfer.worker.ascend import KernelError
    chain = ascend.MOE_KERNELS
    mixed = type("Mixed", (ascend.StandIns,), {k: getattr(auto_generate, k) for k in chain[chain.index(kernel):]})
    monkeypatch.setattr(ascend.AscendOps, "kernels", mixed)
    runner = ModelRunner(EngineConfig(str(checkpoint("qwen3_moe_top2_dense_layer")), max_model_len=128,
                                      max_batch_size=8, device="ascend", dtype="float16"))
    with pytest.raises(KernelError) as failed:
        Driver(runner).prefill({0: PROMPTS[0]})
    message, cause = str(failed.value), str(failed.value.__cause__)
    assert re.search(rf"Unsupported op \[(Inner)?{kernel}\] on CPU", cause)
    assert f"the Ascend kernel {kernel} failed" in message and "model.ops: portable" in message
    first = {"MoeGatingTopKSoftmax": "x [6, 8] float16, finished None, k 2",
             "MoeInitRoutingV2": "x [6, 64] float16, expert_idx [6, 2] int32, expert_num 9",
             "GroupedMatmulV4": "x [[12, 64 or 32]] float16, weight [[8, 64, 64] or [8, 32, 64]] float16, "
                                "group_list [8] int64",
             "MoeTokenUnpermute": "permuted_tokens [12, 64] float16, sorted_indices [12] int32, probs [6, 2]"}[kernel]
    assert f"msinfer gave it {first}" in message


@pytest.mark.parametrize("kernel,standing_in", [("ReshapeAndCache", ()),
                                                ("FlashAttentionScore", ("ReshapeAndCache",)),
                                                ("PagedAttention", ("ReshapeAndCache", "FlashAttentionScore"))])
def test_the_installed_primitives_compile_as_called_and_fail_only_at_kernel_selection(
        kernel, standing_in, checkpoint, monkeypatch):
    """The real primitives (the kernels before `kernel` stood in, so that the graph reaches it) go
    through MindSpore's graph compiler with msinfer's keyword calls, shapes and dtypes, and stop
    only where the CPU has no kernel for them. The compiled node reads the step's graph inputs by
    their names (batch_valid_length, q_seq_lens, slot_mapping); the error a user sees names the
    kernel, what it was given, and model.ops: portable."""
    from mindspore.ops import auto_generate
    import msinfer.worker.ascend as ascend
    from msinfer.worker.ascend import KernelError

    class Mixed:
        RmsNorm = ascend.StandIns.RmsNorm       # the first kernel of every layer: stood in to reach the others
    for name in ("ReshapeAndCache", "FlashAttentionScore", "PagedAttention"):
        setattr(Mixed, name, getattr(ascend.StandIns if name in standing_in else auto_generate, name))
    monkeypatch.setattr(ascend.AscendOps, "kernels", Mixed)
    # (no start-up check: it would find the kernels that fail here wanting and put the portable
    # operators in their place)
    runner = ModelRunner(EngineConfig(str(checkpoint("llama_gqa_tied")), max_model_len=128, max_batch_size=8,
                                      device="ascend", dtype="float16", kernel_check=False))
    d = Driver(runner)
    with pytest.raises(KernelError) as failed:
        d.prefill({0: PROMPTS[0]})
        d.decode()
    message, cause = str(failed.value), str(failed.value.__cause__)
    assert f"Unsupported op [{kernel}] on CPU" in cause
    assert f"the Ascend kernel {kernel} failed" in message and "model.ops: portable" in message
    node = next(line for line in cause.splitlines() if f"PrimFunc_{kernel}" in line)
    wanted = {"ReshapeAndCache": ["param_layers.0.self_attn.k_cache", "param_slot_mapping"],
              "FlashAttentionScore": ["Tensor(shape=[128, 128], dtype=Float16"],
              "PagedAttention": ["param_block_tables", "param_batch_valid_length", "param_attn_mask",
                                 "param_q_seq_lens"]}[kernel]
    positions = [node.index(w) for w in wanted]
    assert positions == sorted(positions), f"{kernel}: its inputs are not in the order of its call signature"
    first = {"ReshapeAndCache": "key [6, 32] float16", "FlashAttentionScore": "query [6, 64] float16",
             "PagedAttention": "query [1, 64] float16"}[kernel]          # 6 prompt tokens, 4 heads x 16
    assert f"msinfer gave it {first}" in message and "int32" in message


def test_kernel_failures_elsewhere_stay_as_they_are():
    from msinfer.worker.ascend import kernel_error
    assert kernel_error(RuntimeError("out of memory"), {}, "decode", None, (1, 1), "float16", 16) is None


def test_tp2_on_the_emulated_ascend_path(checkpoint, hf_greedy, ray_local):
    """Ranks on Ray's (emulated) NPUs: each worker gets its card through ASCEND_RT_VISIBLE_DEVICES as
    on a node; MQA replicates the single KV head on both ranks. (The portable operators share this
    path's embedding and collectives; test_moe runs a tp 2 mixture of experts on it too.)"""
    from msinfer.launcher.replica import Replica, ReplicaConfig, wait_gone
    name = "llama_mqa"
    r = Replica(0, ReplicaConfig(2, device="ascend"))
    try:
        r.start(EngineConfig(str(checkpoint(name)), max_model_len=128, max_batch_size=4, **PATHS["ascend-emulated"]))
        out = Driver(r, feed_sampled=True).generate(dict(enumerate(PROMPTS)), N_NEW)
        for i, prompt in enumerate(PROMPTS):
            assert_greedy_parity(f"{name} prompt {i}", out[i], None, *hf_greedy(name, prompt, N_NEW),
                                 ATOL["ascend-emulated"])
        assert [info["device"] for info in r.ranks] == ["ascend:0", "ascend:0"]
    finally:
        pids = r.pids()
        r.shutdown()
    assert wait_gone(pids)


QWEN3_14B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120,
             "intermediate_size": 17408, "num_hidden_layers": 40, "num_attention_heads": 40,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
             "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def ascend_spec(model_dir, tmp_path, **sections):
    from msinfer.launcher.spec import JobSpec
    spec = {"model": {"path": str(model_dir), "max_model_len": 8192}, "input": {"path": str(tmp_path / "in.jsonl")},
            "output": {"path": str(tmp_path / "out.jsonl")},
            "parallel": {"tensor_parallel": 8, "device": "ascend"},
            "scheduler": {"max_batch_size": 64, "max_batched_tokens": 8192, "block_size": 128}}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return JobSpec.model_validate(spec)


def test_the_card_plan_sizes_the_kv_cache_from_the_cards_memory_and_refuses_what_does_not_fit(tmp_path):
    """Qwen3-14B (the example Ascend config): at tp 8 on 64 GB cards the cache holds what 64
    sequences of 8192 tokens need; on one 32 GB card the bfloat16 weights alone do not fit."""
    import json
    from msinfer.launcher.job import card_plan
    from msinfer.sharding.config import ModelConfig
    from msinfer.sharding.layout import bytes_per_rank
    from msinfer.sharding.layout import LayoutError
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_14B))
    m = ModelConfig.from_dir(str(tmp_path))
    engine = EngineConfig(str(tmp_path), max_model_len=8192, max_batch_size=64, block_size=128, device="ascend")
    spec = ascend_spec(tmp_path, tmp_path)
    card = card_plan(spec, m, engine, bytes_per_rank(m, 8, 2), 2)
    assert card.blocks == 64 * 8192 // 128 and card.assumed
    used = card.weights + card.activations + card.runtime + card.kv
    assert used <= 0.9 * card.memory
    small = ascend_spec(tmp_path, tmp_path, parallel={"tensor_parallel": 1, "device_memory_gb": 32})
    with pytest.raises(LayoutError, match=r"does not fit a 32 GiB card at memory_fraction 0.9: weights 2[0-9.]+ GiB"):
        card_plan(small, m, engine, bytes_per_rank(m, 1, 2), 2)
    few = ascend_spec(tmp_path, tmp_path, parallel={"device_memory_gb": 6.5})     # 3.4 GiB of weights a card
    with pytest.raises(LayoutError, match="a 6.5 GiB card .* room for 0 KV blocks of 128 tokens, and one sequence "
                                          r"of max_model_len 8192 needs 64.*\. It may fit with a larger "
                                          r"parallel.memory_fraction \(now 0.9\); or .*a lower model.max_model_len"):
        card_plan(few, m, engine, bytes_per_rank(m, 8, 2), 2)
    # the blocks asked for are the cause: the refusal names that key first, and no shorter sequence
    import dataclasses
    with pytest.raises(LayoutError, match=r"scheduler.kv_cache_blocks asks for 10000000; .*\. It may fit with "
                                          r"scheduler.kv_cache_blocks \d+ or fewer; or a larger parallel.memory_fraction "
                                          r"\(now 0.9\); or parallel.device_memory_gb, the card's size \(64 GiB "
                                          r"assumed\)") as e:
        card_plan(spec, m, dataclasses.replace(engine, num_blocks=10 ** 7), bytes_per_rank(m, 8, 2), 2)
    assert "max_model_len or" not in str(e.value)
    # msinfer bench words the same refusal in its own flags, and names a job's keys as a job's
    from msinfer.launcher.bench import flag_names
    worded = flag_names(str(e.value))
    assert "no larger --tensor-parallel fits" in worded and "the KV cache 10564 or fewer" in worded
    assert "a job's larger parallel.memory_fraction (bench runs at 0.9)" in worded
    assert "a job's parallel.device_memory_gb, the card's size (bench assumes)" in worded


def test_plan_on_the_emulated_ascend_path_checks_block_size_and_says_how_it_is_verified(
        checkpoint, tmp_path, monkeypatch):
    from msinfer.launcher.job import plan_job
    from msinfer.sharding.layout import LayoutError
    monkeypatch.setenv("MSINFER_ASCEND_EMULATE", "1")
    path = checkpoint("llama_gqa_tied")
    sections = dict(model={"max_model_len": 128}, parallel={"tensor_parallel": 2}, sampling={"max_new_tokens": 8},
                    scheduler={"max_batch_size": 4, "max_batched_tokens": 256})
    with pytest.raises(LayoutError, match="scheduler.block_size 8: Ascend's ReshapeAndCache and PagedAttention "
                                          "take blocks of a multiple of 16"):
        plan_job(ascend_spec(path, tmp_path, **{**sections, "scheduler": {"block_size": 8}}), check_io=False)
    plan = plan_job(ascend_spec(path, tmp_path, **sections), check_io=False)
    text = plan.describe()
    assert plan.engine.emulate and plan.engine.dtype == "float16"       # a float32 checkpoint: bfloat16 on a card
    assert "a card computes this job in bfloat16; the emulation computes it in float16" in text
    assert "ascend EMULATED on the CPU" in text and "card        64 GiB (assumed" in text
    assert "compute dtype float16" in text and "linear layers" not in text    # (no float32 of their own)
    assert "head_dim 16 is not among the head sizes" in text
    portable = plan_job(ascend_spec(path, tmp_path, **{**sections, "model": {"ops": "portable", "max_model_len": 128}}),
                        check_io=False)
    assert "never run on a card here" in portable.describe()
    monkeypatch.delenv("MSINFER_ASCEND_EMULATE")
    assert "verified by emulation against MindSpore's documented contracts" in \
        plan_job(ascend_spec(path, tmp_path, **sections), check_io=False).describe()
