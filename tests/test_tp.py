"""Tier 2 over Ray: a tensor-parallel group of worker actors, each loading only its own slices,
generates exactly what tp 1 and transformers generate."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from msinfer.launcher.replica import Replica, ReplicaConfig, wait_gone
from tests.conftest import PROMPTS
from tests.engine_driver import Driver
from tests.test_parity import runner_for
from msinfer.sharding.config import EngineConfig
from msinfer.worker.protocol import SamplingParams

N_NEW = 8


def start(path, tp):
    r = Replica(0, ReplicaConfig(tp))
    r.start(EngineConfig(str(path), max_model_len=128, max_batch_size=4))
    return r


@pytest.mark.parametrize("name", ["llama_mqa", "llama_gqa_tied_bfloat16"])
def test_tp2_generates_what_transformers_generates(name, checkpoint, hf_greedy, ray_local):
    """MQA at tp 2 replicates the single KV head (llama_mha_bias's q/k/v and MLP biases, and its
    row-parallel o_proj/down_proj biases added once, after the all-reduce: tests/test_quant.py's
    tp 2 test, quantized; Qwen2's q/k/v biases at tp 2: test_moe); the bfloat16
    checkpoint's shards go to AMX tiles where the CPU has them. Decodes feed SAMPLED (async
    scheduling): each rank must have sampled the token rank 0 returned. Each layer runs as the
    two kernel calls of its halves, around the o and down projections' all-reduces, which sum
    through the node's shared memory."""
    r = start(checkpoint(name), 2)
    try:
        out = Driver(r, feed_sampled=True).generate(dict(enumerate(PROMPTS)), N_NEW)
        for i, prompt in enumerate(PROMPTS):
            assert out[i] == hf_greedy(name, prompt, N_NEW)[0], f"{name} prompt {i}"
        assert ray_get([w.__ray_call__.remote(fused_layers) for w in r.workers]) == [2, 2]
        # the row-parallel layers' sums go through the node's shared memory (worker/csrc/collective.h)
        assert [i["all_reduce"] for i in r.setup_info] == [node_group()] * 2
        if name.endswith("_bfloat16"):   # qkv, o, gate_up, down of 2 layers; the embedding = LM head
            for w in r.workers:
                amx, (tiles,) = ray_get([w.__ray_call__.remote(grants_amx),
                                         w.__ray_call__.remote(count_dtypes, "int16")])
                assert tiles == (2 * 4 + 1 if amx else 0)
        if name == "llama_mqa":
            check_rank_holds_exactly_its_slices(r, checkpoint(name))
            tp1 = runner_for(checkpoint(name))
            # seeded sampling on the vocabulary shards: the tokens of tp 1, in a batch or alone, with
            # the candidates alone (top_k, top_p); and with logits changed first (a bias, a token
            # mask), the pass for min_p's kept mass, a draw over the whole vocabulary and logprobs
            for s in (SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7),
                      SamplingParams(temperature=1.0, min_p=0.05, logit_bias=((5, 2.0), (200, 3.0)), seed=8,
                                     allowed_token_ids=tuple(range(0, 256, 3)) + (5,), logprobs=2)):
                sampled = Driver(r, feed_sampled=True).generate(dict(enumerate(PROMPTS)), N_NEW, s)
                alone = Driver(tp1).generate({1: PROMPTS[1]}, N_NEW, s)
                assert sampled[1] == alone[1], s
    finally:
        pids = r.pids()
        r.shutdown()
    assert wait_gone(pids), "worker processes outlived the replica"


def test_tp2_in_bfloat16_gives_the_tokens_of_transformers_rounding_the_same(checkpoint, ray_local):
    """model.dtype bfloat16 at tp 2 (a mixture: its experts sliced over I, a shared expert, the
    tied embedding and LM head split by vocabulary): every rank holds its slices of the linear
    layers, experts and the table in bfloat16 pairs and its KV heads' cache in bfloat16, and the
    replica gives the greedy tokens of transformers with its layers and cache rounded as the
    kernels round them (tests/test_parity.py's reference; the row-parallel sums add in another
    order, so, as at tp 1, a value on a rounding boundary may round the other way: every
    prompt's first token, and all the tokens of all prompts but one)."""
    from tests.test_parity import generate_rounding_the_cache, transformers_in_bfloat16_linears
    name = "qwen2_moe_top4_shared_tied"
    path = checkpoint(name)
    r = Replica(0, ReplicaConfig(2))
    r.start(EngineConfig(str(path), max_model_len=128, max_batch_size=4, matmul_dtype="bfloat16"))
    try:
        out = Driver(r, feed_sampled=True).generate(dict(enumerate(PROMPTS)), N_NEW)
        for pairs, caches in ray_get([w.__ray_call__.remote(count_dtypes, "uint32", "uint16") for w in r.workers]):
            # 2 layers of qkv, o, the router, the shared expert's 3 and the experts' 2; the table
            assert pairs == 2 * (6 + 2) + 1
            assert caches == 2 * 2                  # each layer's K and V in bfloat16 bits
    finally:
        pids = r.pids()
        r.shutdown()
    assert wait_gone(pids), "worker processes outlived the replica"
    model = transformers_in_bfloat16_linears(path)
    same = []
    for i, prompt in enumerate(PROMPTS):
        ref = generate_rounding_the_cache(model, prompt, N_NEW)[0, len(prompt):].tolist()
        assert out[i][0] == ref[0], f"prompt {i}"
        same.append(out[i] == ref)
    assert sum(same) >= len(PROMPTS) - 1, same


def check_rank_holds_exactly_its_slices(replica, path):
    full = load_file(str(path / "model.safetensors"))
    params = [ray_get(w.loaded_params.remote()) for w in replica.workers]
    H = 64
    for rank, p in enumerate(params):
        D = 16
        q = full["model.layers.0.self_attn.q_proj.weight"][rank * 2 * D:(rank + 1) * 2 * D]
        k = full["model.layers.0.self_attn.k_proj.weight"]               # 1 KV head: replicated
        v = full["model.layers.0.self_attn.v_proj.weight"]
        qkv = p["layers.0.self_attn.qkv_proj.weight"]
        assert qkv.shape == (2 * D + 2 * D, H)
        np.testing.assert_array_equal(qkv, np.concatenate([q, k, v]))
        down = full["model.layers.1.mlp.down_proj.weight"][:, rank * 64:(rank + 1) * 64]
        np.testing.assert_array_equal(p["layers.1.mlp.down_proj.weight"], down)
        emb = full["model.embed_tokens.weight"][rank * 128:(rank + 1) * 128]
        np.testing.assert_array_equal(p["embed_tokens.weight"], emb)
        assert p["layers.1.mlp.gate_up_proj.weight"].shape == (128, H)   # 2 x 128/2 rows


def count_dtypes(worker, *dtypes: str) -> tuple[int, ...]:
    """How many of the rank's parameters hold each dtype (MindSpore's names: int16 for AMX tiles,
    uint32 for bfloat16 pairs, uint16 for a KV cache of bfloat16 bits)."""
    import mindspore as ms
    params = list(worker.runner.model.get_parameters())
    return tuple(sum(p.dtype == getattr(ms, d) for p in params) for d in dtypes)


def node_group() -> str:
    """How a CPU group of this machine sums: through /dev/shm where it has room for a segment
    (worker.device.join_node_group), else MCCL."""
    import os
    from msinfer.worker.device import node_segment_bytes
    if not os.path.isdir("/dev/shm"):
        return "mccl"
    fs = os.statvfs("/dev/shm")
    return "shared_memory" if fs.f_bavail * fs.f_frsize >= 8 * node_segment_bytes(3) else "mccl"


def fused_layers(worker) -> int:
    return worker.runner.fused_layers


def grants_amx(worker) -> bool:
    from msinfer.worker.cpu import CpuOps
    return CpuOps.amx


def ray_get(ref):
    import ray
    return ray.get(ref)


def test_tp3_on_the_demo_model_answers_like_transformers_and_follows_structured_outputs(ray_local):
    """SmolLM2 (9 heads, 3 KV heads) split over 3 workers, one KV head each, in one replica:
    - greedy, it answers the capital of France with transformers' tokens;
    - through the engine, each rank fills the grammar masks of its own vocabulary shard
      (llguidance, from the tokenizer) and every rank feeds the token the collectives chose:
      greedy outputs that satisfy a regex and a choice."""
    import re
    import torch
    import transformers
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import JobSpec
    from scripts.make_demo_model import ensure_demo_model
    from tests.engine_driver import run_engine

    path = ensure_demo_model()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
    spec = JobSpec.model_validate({"model": {"path": str(path), "max_model_len": 128},
                                   "parallel": {"tensor_parallel": 3},
                                   "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"},
                                   "sampling": {"max_new_tokens": 16},
                                   "scheduler": {"max_batch_size": 2, "max_batched_tokens": 128}})
    plan = plan_job(spec, check_io=False)
    r = Replica(0, ReplicaConfig(3))
    r.start(plan.engine)
    try:
        lines, engine = run_engine(plan, [
            {"id": "regex", "prompt": "Write a time of day.",
             "sampling": {"structured_outputs": {"regex": "[0-2][0-9]:[0-5][0-9]"}}},
            {"id": "choice", "messages": [{"role": "user", "content": "Is Paris in France?"}],
             "sampling": {"structured_outputs": {"choice": ["yes", "no"]}}}], r.workers)
        r.submitted = engine.submitted          # the ranks run steps in the order of their index
        out = Driver(r).generate({0: prompt}, 10)[0]
        info = r.setup_info
    finally:
        pids = r.pids()
        r.shutdown()
    assert "Paris" in tok.decode(out)
    assert out[:len(ref)] == ref            # transformers stops at EOS; the driver does not
    # each rank holds a third of the sharded weights plus the replicated norms
    assert len({i["param_bytes"] for i in info}) == 1
    assert [i["all_reduce"] for i in info] == [node_group()] * 3
    assert all(v["finish_reason"] == "stop" for v in lines.values()), lines
    assert re.fullmatch(r"[0-2][0-9]:[0-5][0-9]", lines["regex"]["output_text"])
    assert lines["choice"]["output_text"] in ("yes", "no")
    assert wait_gone(pids)
