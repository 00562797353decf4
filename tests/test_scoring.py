"""Scoring (task: score) and generation log-probabilities against transformers.

The engine returns log p(token | everything before it) for each continuation token from a prefill
(in the worker: only the floats cross the wire), chunked like any prompt, batched with
generations; `sampling.logprobs: k` adds the top k of each generated token."""

from __future__ import annotations

import json

import numpy as np

from msinfer.launcher.scheduler import Scheduler, Sequence
from tests.conftest import PROMPTS, cache_with_kernels
from tests.test_parity import runner_for
from msinfer.worker.protocol import SamplingParams

LOGPROB_ATOL = 1e-4        # float32 on both sides; observed differences are ~1e-5
N_NEW = 8
CONTINUATIONS = [[44, 3, 8, 9, 10], [7, 7, 200, 31, 5, 6]]
_HF: dict = {}


def hf_log_softmax(path, ids) -> np.ndarray:
    """transformers: log_softmax of the logits at each of the tokens ids [len(ids), vocab]."""
    import torch
    import transformers
    if str(path) not in _HF:
        _HF[str(path)] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return _HF[str(path)](torch.tensor([list(ids)])).logits[0].double().log_softmax(-1).numpy()


def hf_logprobs(path, prompt, continuation) -> list[float]:
    """transformers: log_softmax of the logits over prompt + continuation, at each continuation token."""
    lp = hf_log_softmax(path, list(prompt) + list(continuation))
    return [lp[len(prompt) - 1 + i, t] for i, t in enumerate(continuation)]


def scoring_sequence(prompt, continuation, max_model_len=128) -> Sequence:
    seq = Sequence(list(prompt) + list(continuation), SamplingParams(max_new_tokens=4), max_model_len=max_model_len)
    seq.num_score_tokens = len(continuation)
    return seq


# ---- tier 1: the scheduler --------------------------------------------------------------------

def test_scheduler_asks_for_each_continuation_token_once_across_chunks_and_samples_nothing():
    prompt, cont = list(range(10, 27)), [40, 41, 42, 43, 44, 45]         # 23 tokens, budget 8: 3 chunks
    sched = Scheduler(num_blocks=16, block_size=4, max_batch_size=4, max_batched_tokens=8, max_model_len=64)
    seq = scoring_sequence(prompt, cont, 64)
    sched.add(seq)
    asked = []
    while sched.has_work():
        steps, is_prefill, seqs = sched.schedule()
        assert is_prefill and not steps[0].sample
        assert len(steps[0].targets) == len(steps[0].token_ids)
        for j, t in enumerate(steps[0].targets):
            if t >= 0:
                position = steps[0].num_cached + j
                asked.append(t)
                assert seq.token_ids[position + 1] == t
        sched.postprocess(seqs, [-1])
    assert asked == cont
    assert seq.finish_reason == "scored" and seq.output_token_ids == [] and sched.block_manager.num_free == 16


def test_scheduler_scores_a_sequence_that_fills_max_model_len_and_rejects_a_longer_one():
    sched = Scheduler(num_blocks=16, block_size=4, max_batch_size=4, max_batched_tokens=64, max_model_len=12)
    fits, too_long = scoring_sequence([1] * 8, [2] * 4, 12), scoring_sequence([1] * 9, [2] * 4, 12)
    sched.add(fits)
    sched.add(too_long)
    steps, _, seqs = sched.schedule()
    assert seqs == [fits]
    assert too_long.finish_reason == "error" and "13 tokens do not fit within max_model_len 12" in too_long.error


def job_sequences(path, task, records):
    """An engine's records -> Sequences (launcher.records), no workers: (sequences, results
    for bad records)."""
    from msinfer.launcher.inputs import parse_record
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.records import RecordCodec
    from msinfer.launcher.spec import JobSpec
    spec = JobSpec.model_validate({"task": task, "model": {"path": str(path), "max_model_len": 32},
                                   "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"},
                                   "sampling": {"max_new_tokens": 4}})
    plan = plan_job(spec, check_io=False)
    codec = RecordCodec(plan.spec, plan.model, plan.tokenizer)
    out = [codec.sequences(parse_record(r, n), n) for n, r in enumerate(records, 1)]
    seqs = [seq for x in out if not isinstance(x, tuple) for seq in x]
    results = [json.loads(x.line) for x in out if isinstance(x, tuple)]
    return seqs, results


def test_a_score_job_scores_records_with_a_continuation_and_generates_the_others(checkpoint):
    path = checkpoint("llama_gqa_tied")
    records = [{"id": "s", "prompt_token_ids": [1, 2, 3], "continuation_token_ids": [4, 5]},
               {"id": "g", "prompt_token_ids": [1, 2, 3]},
               {"id": "text", "prompt_token_ids": [1, 2], "continuation": " Paris"},
               {"id": "long", "prompt_token_ids": [1] * 30, "continuation_token_ids": [4, 5, 6]}]
    seqs, errors = job_sequences(path, "score", records)
    assert [(s.key, s.token_ids, s.num_score_tokens) for s in seqs] == [("s", [1, 2, 3, 4, 5], 2), ("g", [1, 2, 3], 0)]
    assert {e["id"]: e["error"]["message"] for e in errors} == {
        "text": "record 'text': the model has no tokenizer, so the continuation must be given as "
                "'continuation_token_ids'",
        "long": "record 'long': the prompt and continuation have 33 tokens; model.max_model_len is 32"}
    seqs, errors = job_sequences(path, "generate", records[:1])
    assert not seqs and "set task: score" in errors[0]["error"]["message"]


# ---- tier 2: the engine at tp 1 -----------------------------------------------------------------

def run_with_scheduler(engine, seqs, max_batched_tokens):
    """The controller's loop in miniature, keeping what it attaches to sequences."""
    sched = Scheduler(engine.num_blocks, engine.block_size, 8, max_batched_tokens, 128)
    for s in seqs:
        s.scores, s.logprobs = [], []
        sched.add(s)
    while sched.has_work():
        steps, is_prefill, batch = sched.schedule()
        out = engine.step(steps, is_prefill)
        for seq, scores in zip(batch, out.scores or ()):
            seq.scores += scores or []
        for seq, lp in zip(batch, out.logprobs or ()):
            if lp is not None:
                seq.logprobs.append(lp)
        sched.postprocess(batch, out.token_ids)


def test_scores_equal_transformers_chunked_and_batched_with_a_generation(checkpoint, hf_greedy):
    """Two scored records (one long enough to be cut into chunks) share prefill steps with a
    generation that asks for top-3 log-probabilities; all three equal transformers'."""
    name = "llama_gqa_tied"
    path = checkpoint(name)
    scored = [scoring_sequence(PROMPTS[0], CONTINUATIONS[0]), scoring_sequence(PROMPTS[2], CONTINUATIONS[1])]
    gen = Sequence(PROMPTS[1], SamplingParams(max_new_tokens=N_NEW, logprobs=3, ignore_eos=True))
    run_with_scheduler(runner_for(path), [scored[0], gen, scored[1]], max_batched_tokens=16)

    for seq, prompt, cont in zip(scored, (PROMPTS[0], PROMPTS[2]), CONTINUATIONS):
        assert seq.finish_reason == "scored" and len(seq.scores) == len(cont)
        np.testing.assert_allclose([lp for lp, _ in seq.scores], hf_logprobs(path, prompt, cont), atol=LOGPROB_ATOL)
        # each token's rank: the tokens transformers gives a log-probability at least its own
        lp = hf_log_softmax(path, list(prompt) + list(cont))[len(prompt) - 1:]
        assert [rank for _, rank in seq.scores] == [int((row >= row[t]).sum()) for row, t in zip(lp, cont)]

    ref_tokens, ref_logits = hf_greedy(name, PROMPTS[1], N_NEW)
    assert gen.output_token_ids == ref_tokens and len(gen.logprobs) == N_NEW
    for (chosen, top), tok, logits in zip(gen.logprobs, ref_tokens, ref_logits):
        ref = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
        order = np.argsort(-ref)[:3]
        assert abs(chosen - ref[tok]) < LOGPROB_ATOL
        assert [t for t, _ in top] == order.tolist()
        np.testing.assert_allclose([v for _, v in top], ref[order], atol=LOGPROB_ATOL)


def test_prompt_logprobs_after_a_decode_step_equal_transformers(checkpoint):
    """Any record of a job may ask for prompt_logprobs, between other records' decode steps: a
    scoring prefill whose graph runs again after a decode step's graph compiled (a graph of fewer
    inputs) gives transformers' figures, as its first run did. A runner of its own, so that the
    decode graph compiles between the two."""
    from msinfer.sharding.config import EngineConfig
    from msinfer.worker.protocol import SeqStep
    from msinfer.worker.runner import ModelRunner
    path = checkpoint("llama_gqa_tied")
    runner = ModelRunner(EngineConfig(str(path), max_model_len=128, max_batch_size=8))
    n = len(PROMPTS[0])
    for i, prompt in enumerate((PROMPTS[0], PROMPTS[2][:n])):        # the same shapes: the same graphs
        sp = SamplingParams(prompt_logprobs=2, max_new_tokens=4)
        blocks = list(range(8 * i, 8 * i + 8))
        out = runner.step([SeqStep(i, list(prompt), 0, blocks, sp, targets=list(prompt[1:]) + [-1])], True)
        lp = hf_log_softmax(path, prompt)
        assert len(out.scores[0]) == n - 1
        for j, (chosen, rank, top) in enumerate(out.scores[0]):
            assert abs(chosen - lp[j, prompt[j + 1]]) < LOGPROB_ATOL and rank == (lp[j] >= lp[j, prompt[j + 1]]).sum()
            assert [t for t, _ in top] == np.argsort(-lp[j], kind="stable")[:2].tolist()
        runner.step([SeqStep(i, [out.token_ids[0]], n, blocks, sp, num_generated=1)], False)


# ---- tier 3: a scoring job at tp 2 ----------------------------------------------------------------

def test_score_job_at_tp2_writes_transformers_logprobs_and_generates_the_rest(checkpoint, hf_greedy, ray_local,
                                                                              tmp_path, monkeypatch):
    """task: score through run_job: records with a continuation are scored, one without is generated
    (with logprobs, and its prompt's with two alternatives each), and a continuation that does not
    fit is an error line."""
    from msinfer.launcher.job import run_job
    from msinfer.launcher.spec import JobSpec

    monkeypatch.setenv("MSINFER_CACHE", cache_with_kernels(tmp_path / "cache"))
    name = "qwen2_qkv_bias"
    path = checkpoint(name)
    greedy = hf_greedy(name, PROMPTS[0], 4)[0]
    records = [{"id": "s0", "prompt_token_ids": PROMPTS[0], "continuation_token_ids": CONTINUATIONS[0]},
               {"id": "greedy", "prompt_token_ids": PROMPTS[0], "continuation_token_ids": greedy},
               {"id": "g", "prompt_token_ids": PROMPTS[2], "sampling": {"logprobs": 2, "prompt_logprobs": 2}},
               {"id": "s1", "prompt_token_ids": PROMPTS[2], "continuation_token_ids": CONTINUATIONS[1]},
               {"id": "long", "prompt_token_ids": [5] * 60, "continuation_token_ids": [6] * 10}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = JobSpec.model_validate({
        "task": "score",
        "model": {"path": str(path), "max_model_len": 64},
        "parallel": {"tensor_parallel": 2},
        "input": {"path": str(tmp_path / "in.jsonl")}, "output": {"path": str(tmp_path / "out.jsonl")},
        "sampling": {"max_new_tokens": N_NEW, "ignore_eos": True},
        "scheduler": {"max_batch_size": 4, "max_batched_tokens": 16}})
    run_job(spec, progress=False)
    results = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}

    for rid, prompt, cont in (("s0", PROMPTS[0], CONTINUATIONS[0]), ("s1", PROMPTS[2], CONTINUATIONS[1])):
        r = results[rid]
        assert r["error"] is None and r["continuation_token_ids"] == cont and r["prompt_tokens"] == len(prompt)
        ref = hf_logprobs(path, prompt, cont)
        np.testing.assert_allclose(r["continuation_logprobs"], ref, atol=LOGPROB_ATOL)
        assert abs(r["continuation_logprob_sum"] - sum(ref)) < LOGPROB_ATOL * len(cont)
    # lm-eval's is_greedy: every continuation token the most likely there, as transformers' greedy
    # tokens are; an arbitrary continuation is not
    assert results["greedy"]["continuation_greedy"] is True
    assert results["s0"]["continuation_greedy"] is False and results["s1"]["continuation_greedy"] is False
    g = results["g"]
    prompt = PROMPTS[2]
    lp = hf_log_softmax(path, prompt)
    assert g["prompt_logprobs"][0] is None and len(g["prompt_logprobs"]) == len(prompt)
    for j, entry in enumerate(g["prompt_logprobs"][1:]):
        assert abs(entry["logprob"] - lp[j, prompt[j + 1]]) < LOGPROB_ATOL
        assert [t for t, _, *_ in entry["top"]] == np.argsort(-lp[j], kind="stable")[:2].tolist()
        np.testing.assert_allclose([v for _, v, *_ in entry["top"]], np.sort(lp[j])[::-1][:2], atol=LOGPROB_ATOL)
    ref_tokens, ref_logits = hf_greedy(name, prompt, N_NEW)
    assert g["output_token_ids"] == ref_tokens and "continuation_logprobs" not in g
    for entry, tok, logits in zip(g["logprobs"], ref_tokens, ref_logits):
        ref = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
        assert abs(entry["logprob"] - ref[tok]) < LOGPROB_ATOL and entry["top"][0][0] == int(np.argmax(ref))
    assert "70 tokens" in results["long"]["error"]["message"]
