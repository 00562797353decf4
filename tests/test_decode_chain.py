"""Greedy decode steps chained into one call (scheduler.decode_steps, worker.runner.ModelRunner.chain):
the same tokens as steps one at a time and as transformers, whatever stops a sequence inside a
chain, and no chain where a step's sampling is the host's."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from msinfer.launcher.engine import decode_steps
from msinfer.launcher.job import plan_job
from msinfer.launcher.spec import JobSpec
from msinfer.worker.protocol import SAMPLED, DecodeChain, DecodeStep, SamplingParams, SeqStep, chains


def job(path, decode_steps=None, scheduler=None, **sampling) -> JobSpec:
    return JobSpec.model_validate({
        "model": {"path": str(path), "max_model_len": 64}, "input": {"path": "in.jsonl"},
        "output": {"path": "out.jsonl"},
        "sampling": {"max_new_tokens": 14, "ignore_eos": True, **sampling},
        "scheduler": {"max_batch_size": 3, "decode_steps": decode_steps, **(scheduler or {})}})


def test_chained_decode_steps_give_each_record_the_tokens_of_steps_one_at_a_time(checkpoint):
    """Records stopping inside a chain (a stop token, their own max_new_tokens), records admitted
    as others finish, a cache too small for every chain, and records that draw (seeded, top_k,
    top_p) or ask for log-probabilities (which keep their batches' steps out of chains) beside
    greedy ones: every result is the one decode_steps 1 gives (the real network, a small test
    checkpoint), and the batches did run as chains, greedy and drawing."""
    from tests.engine_driver import run_engine
    path = checkpoint("llama_gqa_tied")
    records = [{"id": f"r{i:02d}", "prompt_token_ids": [5 + i, 17, 33, 9][:2 + i % 3],
                "sampling": {"max_new_tokens": 5 + 3 * i}} for i in range(7)]

    def run(k, records=records, **options):
        lines, engine = run_engine(plan_job(job(path, k, **options), check_io=False), records)
        runner = engine.workers[0].runner
        chained = [key for key in runner.compile_s if key.startswith("chain")]
        return {rid: (r["output_token_ids"], r["finish_reason"], r.get("logprobs")) for rid, r in lines.items()}, \
            chained

    base, none = run(1)
    assert not none
    stop = sorted({out[4] for out, _, _ in base.values() if len(out) > 4})[:2]
    for k, options in ((4, {}), (3, {"scheduler": {"kv_cache_blocks": 16, "block_size": 4}}),
                       (4, {"stop_token_ids": stop})):
        want = run(1, **options)[0] if options else base
        got, chained = run(k, **options)
        assert chained, (k, options)
        assert got == want, (k, options)
    stopped = run(4, stop_token_ids=stop)[0]
    assert sum(reason == "stop" for _, reason, _ in stopped.values()) >= 2

    mixed = [{**r, "sampling": {**r["sampling"], **extra}} for r, extra in zip(
        records, [{}, {"temperature": 0.8, "seed": 3}, {}, {"logprobs": 2}, {"temperature": 0.7, "top_k": 5}, {},
                  {"temperature": 1.0, "top_p": 0.9}])]
    got, chained = run(4, mixed)
    assert got == run(1, mixed)[0]
    assert any(key.endswith("sampled") for key in chained), chained     # batches that draw chained too


@pytest.mark.parametrize("name", ["llama_gqa_tied", "llama_gqa_tied_bfloat16"])
def test_a_chain_of_greedy_steps_matches_transformers_and_single_steps(checkpoint, hf_greedy, name, monkeypatch):
    """ModelRunner.chain on a DecodeChain as the engine sends it (SAMPLED after the first step):
    one compiled call of decode_steps, the tokens transformers' greedy generate gives, and the
    next step (one at a time) continues from the chain's last tokens. A checkpoint saved in
    bfloat16, where the CPU has VDPBF16PS, picks its chains' tokens with GreedyHead (the LM head
    in bfloat16 pairs, CausalLM.pack_greedy_head): the tokens of the float32 logits' GreedyRows
    (MSINFER_GREEDY_HEAD=0) and transformers', and after `msinfer bench --skip-load` fills the
    weights with random values, the same tokens as GreedyRows over those."""
    from msinfer.sharding.config import EngineConfig
    from msinfer.worker.cpu import CpuOps
    from msinfer.worker.runner import ModelRunner
    path = checkpoint(name)
    prompts = [[5, 17, 33], [9, 4], [11, 12, 13, 14]]
    got = chain_tokens(ModelRunner(EngineConfig(str(path), max_model_len=64, max_batch_size=4)), prompts)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(name, p, 10)[0]
    if name.endswith("bfloat16") and CpuOps.greedy_head:
        # `msinfer bench --skip-load`: random weights, GreedyHead's tables made again from them
        from types import SimpleNamespace

        from msinfer.worker.actor import Worker
        runner = ModelRunner(EngineConfig(str(path), max_model_len=64, max_batch_size=4))
        Worker.fill_random(SimpleNamespace(tp=SimpleNamespace(rank=0), runner=runner), scale=0.5)
        pairs, norms = CpuOps.greedy_head_tables(runner.model.lm_head.weight.asnumpy())
        np.testing.assert_array_equal(runner.model.head_pairs.asnumpy(), pairs)
        np.testing.assert_array_equal(runner.model.head_norms.asnumpy(), norms)
        got_random = chain_tokens(runner, prompts)
        monkeypatch.setenv("MSINFER_GREEDY_HEAD", "0")          # (read as a runner loads the kernels)
        assert chain_tokens(ModelRunner(EngineConfig(str(path), max_model_len=64, max_batch_size=4)), prompts,
                            head=False) == got
        runner = ModelRunner(EngineConfig(str(path), max_model_len=64, max_batch_size=4))
        Worker.fill_random(SimpleNamespace(tp=SimpleNamespace(rank=0), runner=runner), scale=0.5)
        assert chain_tokens(runner, prompts, head=False) == got_random


def chain_tokens(runner, prompts, head=None):
    """The tokens of a prefill, a chain of 5 steps, one of 3 and a single step on `runner` (which
    picks with GreedyHead where `head`, None: as the CPU and checkpoint allow)."""
    from msinfer.worker.cpu import CpuOps
    want = head if head is not None else (CpuOps.greedy_head and runner.model.lm_head.weight.dtype == ms.uint16)
    assert (runner.model.greedy_head is not None) == bool(want)
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(prompts))]
    out = runner.step([SeqStep(i, p, 0, tables[i]) for i, p in enumerate(prompts)], True)
    got = [[t] for t in out.token_ids]
    ids = list(range(len(prompts)))
    for k0 in (1, 6):           # a chain of 5, then one of 3 whose blocks grow in its second step
        K = 5 if k0 == 1 else 3
        steps = [DecodeStep(ids, [SAMPLED] * len(ids), [len(p) + k0 - 1 + k for p in prompts],
                            [k0 + k] * len(ids), {}) for k in range(K)]
        outs = runner.step(DecodeChain(steps), False)
        assert len(outs) == K
        for o in outs:
            for g, t in zip(got, o.token_ids):
                g.append(t)
    assert any(key.startswith("chain") and key.endswith("K=5") for key in runner.compile_s)
    one = runner.step(DecodeStep(ids, [SAMPLED] * len(ids), [len(p) + 8 for p in prompts], [9] * len(ids), {}), False)
    for g, t in zip(got, one.token_ids):
        g.append(t)
    return got


def test_a_chain_runs_step_by_step_where_a_sequence_samples_on_the_hosts_terms(checkpoint):
    """A DecodeChain whose sequences are not all greedy without logit changes, or whose steps are
    not each the one before a position further, runs its steps one at a time (no chain graph),
    with the results of those steps."""
    from msinfer.sharding.config import EngineConfig
    from msinfer.worker.runner import ModelRunner
    path = checkpoint("llama_gqa_tied")
    runner = ModelRunner(EngineConfig(str(path), max_model_len=64, max_batch_size=2))
    penalised = SamplingParams(repetition_penalty=1.3)
    out = runner.step([SeqStep(0, [5, 17, 33], 0, [0, 1]), SeqStep(1, [9, 4], 0, [2, 3], penalised,
                                                                     history=([9, 4], []))], True)
    steps = [DecodeStep([0, 1], [SAMPLED, SAMPLED], [3 + k, 2 + k], [1 + k, 1 + k], {}) for k in range(3)]
    assert not runner.chainable(DecodeChain(steps))
    outs = runner.step(DecodeChain(steps), False)
    assert len(outs) == 3 and all(len(o.token_ids) == 2 for o in outs)
    assert not [key for key in runner.compile_s if key.startswith("chain")]
    skipping = [steps[0], DecodeStep([0], [SAMPLED], [5], [2], {})]
    assert not runner.chainable(DecodeChain(skipping))
    assert out.token_ids[0] >= 0
    wide = SamplingParams(temperature=0.8, top_k=65)          # more candidates than a chain's sampler draws from
    runner.step([SeqStep(5, [5, 17], 0, [6, 7], wide)], True)
    assert not runner.chainable(DecodeChain([DecodeStep([5], [SAMPLED], [2 + k], [1 + k], {}) for k in range(2)]))


def test_a_chain_draws_the_tokens_steps_one_at_a_time_draw(checkpoint):
    """Sequences that draw (temperature, top_k, top_p, min_p, each its own stream) run as one
    chain and get the tokens that the same steps one at a time draw (the same uniforms: by their
    stream, tokens generated so far and sample index), the greedy one beside them too."""
    from msinfer.sharding.config import EngineConfig
    from msinfer.worker.runner import ModelRunner
    path = checkpoint("llama_gqa_tied")
    runner = ModelRunner(EngineConfig(str(path), max_model_len=64, max_batch_size=4))
    prompts = [[5, 17, 33], [9, 4], [11, 12, 13, 14], [7, 7]]
    params = [SamplingParams(temperature=1.0, draw_key=11), SamplingParams(temperature=0.7, top_k=8, draw_key=12),
              SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02, draw_key=13, index=1), SamplingParams()]
    K = 6
    got = {}
    for base, chained in ((0, True), (10, False)):
        ids = [base + i for i in range(len(prompts))]
        out = runner.step([SeqStep(base + i, p, 0, list(range(4 * i, 4 * i + 4)), params[i])     # (the same blocks)
                           for i, p in enumerate(prompts)], True)
        tokens = [[t] for t in out.token_ids]
        steps = [DecodeStep(ids, [SAMPLED] * len(ids), [len(p) + k for p in prompts], [1 + k] * len(ids), {})
                 for k in range(K)]
        outs = runner.step(DecodeChain(steps), False) if chained else [runner.step(st, False) for st in steps]
        for o in outs:
            for row, t in zip(tokens, o.token_ids):
                row.append(t)
        got[chained] = tokens
    assert any(key.endswith(f"K={K} sampled") for key in runner.compile_s)
    assert got[True] == got[False]
    assert len({tuple(row) for row in got[True][:3]}) == 3


def test_which_sequences_chain_and_how_many_steps_a_job_chains(checkpoint):
    """Sequences without logit changes or log-probabilities chain, those that draw where the
    device draws a chain's steps (tp 1); the default is 4 steps on the CPU kernels, where the
    spec's value wins; with the portable operators, 1 whatever the spec says."""
    assert chains(SamplingParams(), False) and chains(SamplingParams(temperature=0.7, top_p=0.8), True)
    assert not chains(SamplingParams(temperature=0.7), False)
    for params in (SamplingParams(logprobs=1), SamplingParams(presence_penalty=0.5),
                   SamplingParams(structured="start: /[a-z]+/"), SamplingParams(logit_bias=((3, 1.0),))):
        assert not chains(params, True), params
    path = checkpoint("llama_gqa_tied")
    plan = plan_job(job(path), check_io=False)
    assert decode_steps(plan.spec, plan.engine) == 4
    plan = plan_job(job(path, 7), check_io=False)
    assert decode_steps(plan.spec, plan.engine) == 7
    asked = job(path, 7)               # (the portable operators' graphs of dynamic shapes chain nothing)
    portable = asked.model_copy(update={"model": asked.model.model_copy(update={"ops": "portable"})})
    plan = plan_job(portable, check_io=False)
    assert decode_steps(plan.spec, plan.engine) == 1


@pytest.mark.parametrize("value, expected", [(0, "expected an integer >= 1, got 0"),
                                             (33, "expected an integer <= 32, got 33")])
def test_decode_steps_out_of_range_is_a_spec_error(tmp_path, value, expected):
    from tests.test_spec import MINIMAL, spec_error
    msg = spec_error(tmp_path, MINIMAL + f"scheduler:\n  decode_steps: {value}\n")
    assert "scheduler.decode_steps" in msg and expected in msg


def test_vllms_num_scheduler_steps_is_named_as_decode_steps(tmp_path):
    from tests.test_spec import MINIMAL, spec_error
    msg = spec_error(tmp_path, MINIMAL + "scheduler:\n  num_scheduler_steps: 8\n")
    assert "scheduler.num_scheduler_steps: unknown key; did you mean 'decode_steps'" in msg


def test_a_chain_cut_short_is_one_call_and_no_more_than_two_are_in_flight(checkpoint, monkeypatch):
    """Where fewer than decode_steps steps can be scheduled (here each record's last tokens),
    the steps go as one call run step by step: never more calls in flight than async
    scheduling's two, which is what the ranks' threads serve in order (more could take every
    thread of a rank while the step they wait for has none). The results are those of
    decode_steps 1."""
    from msinfer.launcher.engine import Engine
    from tests.engine_driver import run_engine
    path = checkpoint("llama_gqa_tied")
    records = [{"id": f"r{i}", "prompt_token_ids": [5 + i, 17, 33], "sampling": {"max_new_tokens": 6 + i}}
               for i in range(4)]
    most, cut = [], []
    submit = Engine._submit

    def counted(self):
        went = submit(self)
        most.append(len(self.in_flight))
        if self.in_flight and isinstance(self.in_flight[-1].chain, list):
            cut.append(len(self.in_flight[-1].chain) < self.decode_steps)
        return went
    monkeypatch.setattr(Engine, "_submit", counted)
    lines = {k: run_engine(plan_job(job(path, k), check_io=False), records)[0] for k in (4, 1)}
    assert max(most) <= 2 and any(cut)
    assert {r: x["output_token_ids"] for r, x in lines[4].items()} == \
        {r: x["output_token_ids"] for r, x in lines[1].items()}


def test_a_chain_never_takes_a_compiled_shape_of_more_tokens_than_rows(checkpoint):
    """A prefill's compiled shape has more token rows than logit rows (64 tokens of 20 prompts,
    32 rows at max_batch_size 32); a single decode step may run padded in it, a chain may not
    (its steps feed each step's rows to the next as its tokens): the chain of 20 runs in a
    shape of its own and picks the tokens steps one at a time pick."""
    from msinfer.sharding.config import EngineConfig
    from msinfer.worker.runner import ModelRunner
    path = checkpoint("llama_gqa_tied")
    runner = ModelRunner(EngineConfig(str(path), max_model_len=64, max_batch_size=32))
    B = 20
    prompts = [[5 + i, 17, 33] for i in range(B)]
    got = {}
    for base, chained in ((0, True), (100, False)):
        ids = [base + i for i in range(B)]
        runner.step([SeqStep(base + i, p, 0, [i]) for i, p in enumerate(prompts)], True)
        assert (64, 32) in runner.graphs
        steps = [DecodeStep(ids, [SAMPLED] * B, [3 + k] * B, [1 + k] * B, {}) for k in range(2)]
        outs = runner.step(DecodeChain(steps), False) if chained else [runner.step(st, False) for st in steps]
        got[chained] = [o.token_ids for o in outs]
    assert got[True] == got[False]
