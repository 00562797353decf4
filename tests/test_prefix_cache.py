"""Prefix caching and n samples per record on the real network: an engine (launcher.engine) with
its scheduler, async scheduling and chunked prefill, on ranks that run the test checkpoints.
Greedy tokens with the cache equal transformers'; n samples share one prefill of their prompt.
The cache's bookkeeping itself is tested against a fake model in tests/test_scheduler.py."""

from __future__ import annotations

import pytest

from msinfer.launcher.engine import Engine, EngineSetup
from msinfer.launcher.inputs import parse_record
from msinfer.launcher.job import plan_job
from msinfer.launcher.spec import JobSpec
from tests.engine_driver import run_engine as run

N_NEW = 6
NAME = "qwen3_qknorm_odd_head_dim"
PREFIX = [(7 * i + 3) % 250 + 1 for i in range(37)]           # 9 blocks of 4 and a token
TAILS = [[], [11], [12, 13, 14], [5] * 9, [200, 201]]


def spec_for(path, **scheduler) -> JobSpec:
    return JobSpec.model_validate({
        "model": {"path": str(path), "max_model_len": 64},
        "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"},
        "sampling": {"max_new_tokens": N_NEW, "ignore_eos": True},
        "scheduler": {"max_batch_size": 4, "max_batched_tokens": 24, "block_size": 4, **scheduler}})


def shared_prefix_records() -> list[dict]:
    return [{"id": f"r{i}", "prompt_token_ids": PREFIX + tail} for i, tail in enumerate(TAILS)]


@pytest.mark.parametrize("name,kv_cache_blocks", [(NAME, None), (NAME, 16), ("deepseek_v3_yarn_groups", 16)],
                         ids=["ample", "tight", "tight-latent"])
def test_records_sharing_a_prefix_get_transformers_greedy_tokens_from_cached_blocks(
        name, kv_cache_blocks, checkpoint, hf_greedy):
    """Five prompts share 37 tokens; chunks of 24 tokens, async scheduling, and (tight) a cache of
    16 blocks of 4 that preempts; DeepSeek's latent cache as well."""
    path = checkpoint(name)
    plan = plan_job(spec_for(path, kv_cache_blocks=kv_cache_blocks), check_io=False)
    lines, engine = run(plan, shared_prefix_records())
    for i, tail in enumerate(TAILS):
        assert lines[f"r{i}"]["output_token_ids"] == hf_greedy(name, PREFIX + tail, N_NEW)[0], f"r{i}"
    stats = engine.engine_stats()
    # all but the first record start after the 9 blocks of the prefix (or their own preempted blocks)
    assert stats["cached_tokens"] >= 4 * 36
    if kv_cache_blocks:
        assert stats["preemptions"] > 0


def test_with_prefix_caching_off_every_prompt_token_is_prefilled(checkpoint, hf_greedy):
    plan = plan_job(spec_for(checkpoint(NAME), prefix_caching=False), check_io=False)
    lines, engine = run(plan, shared_prefix_records()[:2])
    assert lines["r1"]["output_token_ids"] == hf_greedy(NAME, PREFIX + TAILS[1], N_NEW)[0]
    stats = engine.engine_stats()
    assert stats["cached_tokens"] == 0 and stats["prompt_tokens"] == 2 * len(PREFIX) + 1


def test_tp2_ranks_read_the_blocks_they_share_from_their_own_shards(checkpoint, hf_greedy, ray_local):
    from msinfer.launcher.replica import Replica, ReplicaConfig
    path = checkpoint(NAME)
    plan = plan_job(spec_for(path), check_io=False)
    replica = Replica(0, ReplicaConfig(2))
    try:
        replica.start(plan.engine)
        lines, engine = run(plan, shared_prefix_records(), replica.workers)
    finally:
        replica.shutdown()
    for i, tail in enumerate(TAILS):
        assert lines[f"r{i}"]["output_token_ids"] == hf_greedy(NAME, PREFIX + tail, N_NEW)[0], f"r{i}"
    assert engine.engine_stats()["cached_tokens"] >= 4 * 36


def test_n_samples_share_one_prefill_are_seeded_and_differ(checkpoint):
    """n = 4 at temperature 1: the prompt is prefilled once, each further sample feeds only the
    prompt's last partial block; sample i draws from stream i of the record's seed, so the samples
    differ, a re-run in another batch gives the same ones, and sample 0 is the record at n = 1."""
    plan = plan_job(spec_for(checkpoint(NAME), max_batch_size=8), check_io=False)
    prompt = PREFIX[:21]                                     # 5 blocks of 4 and a token
    record = {"id": "many", "prompt_token_ids": prompt, "sampling": {"n": 4, "temperature": 1.0, "seed": 7}}
    lines, engine = run(plan, [record])
    outputs = lines["many"]["outputs"]
    assert [o["index"] for o in outputs] == [0, 1, 2, 3]
    assert all(o["completion_tokens"] == N_NEW and o["finish_reason"] == "length" for o in outputs)
    assert lines["many"]["completion_tokens"] == 4 * N_NEW and lines["many"]["prompt_tokens"] == 21
    assert len({tuple(o["output_token_ids"]) for o in outputs}) > 1
    stats = engine.engine_stats()
    assert stats["prompt_tokens"] - stats["cached_tokens"] == 21 + 3 * 1
    others = [{"id": f"o{i}", "prompt_token_ids": [9, i + 1, 4], "sampling": {"temperature": 1.0}} for i in range(3)]
    single = {**record, "id": "one", "sampling": {**record["sampling"], "n": 1}}
    again, _ = run(plan, others + [record, single])
    assert again["many"]["outputs"] == outputs
    assert again["one"]["output_token_ids"] == outputs[0]["output_token_ids"] and "outputs" not in again["one"]


def test_n_with_a_scored_record_is_that_records_error(checkpoint):
    spec = spec_for(checkpoint(NAME)).model_copy(update={"task": "score"})
    plan = plan_job(spec, check_io=False)
    engine = Engine(EngineSetup(plan.spec, plan.model, plan.engine), 0, plan.tokenizer)
    rec = parse_record({"id": "s", "prompt_token_ids": [1, 2], "continuation_token_ids": [3],
                        "sampling": {"n": 2}}, 1)
    done = engine.codec.sequences(rec, 0)
    assert done.failed and "sampling.n is 2, but a scored record generates nothing" in done.line
