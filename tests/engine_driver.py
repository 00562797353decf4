"""Drives a ModelRunner (or a Replica) step by step the way the controller does, for tests;
and runs records through a whole engine (launcher.engine) on ranks in this process."""

from __future__ import annotations

import json
import pickle
import time

from msinfer.worker.protocol import SAMPLED, SamplingParams, SeqStep


class Driver:
    """Greedy/sampled generation over an engine with `step(seqs, is_prefill)`; each sequence
    gets its own blocks so sequences can join and leave at any time."""

    def __init__(self, engine, block_size: int = 16, blocks_per_seq: int = 8, feed_sampled: bool = False):
        """feed_sampled: decodes feed SAMPLED, as async scheduling does, for the engine to take the
        tokens it sampled in the step before."""
        self.engine, self.bs, self.per = engine, block_size, blocks_per_seq
        self.feed_sampled = feed_sampled
        self.seqs: dict[int, dict] = {}

    def table(self, sid):
        return list(range(sid * self.per, (sid + 1) * self.per))

    def prefill(self, prompts: dict[int, list[int]], sampling: SamplingParams | None = None):
        sampling = sampling or SamplingParams()
        steps = [SeqStep(sid, list(p), 0, self.table(sid), sampling,     # what penalties and grammars look back at
                         history=(list(p), []) if sampling.looks_back else None) for sid, p in prompts.items()]
        out = self.engine.step(steps, True)
        for (sid, p), tok in zip(prompts.items(), out.token_ids):
            self.seqs[sid] = {"prompt": list(p), "gen": [tok], "sampling": sampling}
        return out

    def decode(self, sids=None):
        sids = list(self.seqs) if sids is None else sids
        steps = [SeqStep(s, [SAMPLED if self.feed_sampled else self.seqs[s]["gen"][-1]],
                         len(self.seqs[s]["prompt"]) + len(self.seqs[s]["gen"]) - 1,
                         self.table(s), self.seqs[s]["sampling"], num_generated=len(self.seqs[s]["gen"]))
                 for s in sids]
        out = self.engine.step(steps, False)
        for s, tok in zip(sids, out.token_ids):
            self.seqs[s]["gen"].append(tok)
        return out

    def generate(self, prompts: dict[int, list[int]], n: int, sampling=None) -> dict[int, list[int]]:
        self.prefill(prompts, sampling)
        for _ in range(n - 1):
            self.decode(list(prompts))
        return {s: self.seqs[s]["gen"][:n] for s in prompts}


def in_process_rank(engine_config):
    """Rank 0 of a tp 1 group in this process: its runner, called as the worker actor calls it."""
    from msinfer.launcher.engine import LocalRank
    from msinfer.worker.protocol import unpack_step
    from msinfer.worker.runner import ModelRunner
    runner = ModelRunner(engine_config)

    def step(payload, is_prefill, index):
        seqs, released = unpack_step(payload)
        return runner.step(seqs, is_prefill, released=released)
    rank = LocalRank(step)
    rank.runner = runner
    return rank


def exchange_until_done(engine, records, more=False, timeout=60) -> list:
    """Deals `records` to an in-process engine (launcher.engine.Engine) in one exchange and
    collects every result (launcher.records.Done)."""
    done, payload = [], pickle.dumps(list(enumerate(records)))
    t_end = time.monotonic() + timeout
    while len(done) < len(records) and time.monotonic() < t_end:
        out, want, _, _, _ = pickle.loads(engine.exchange(payload, more))
        payload = None
        done += out
        assert want >= 0
    return done


def run_engine(plan, records, workers=None, after=None) -> tuple:
    """Deals records to an engine on `workers` (default: a rank in this process) in one exchange;
    returns the result lines by id and the engine. after: the engine that ran on these workers
    before, whose step indices this one's continue (the ranks run steps in index order)."""
    from msinfer.launcher.engine import Engine, EngineSetup
    from msinfer.launcher.inputs import parse_record
    engine = Engine(EngineSetup(plan.spec, plan.model, plan.engine), 0, plan.tokenizer)
    engine.attach(workers or [in_process_rank(plan.engine)])
    if after is not None:               # before the first exchange: nothing is submitted yet
        engine.submitted = after.submitted
        if engine.pipeline is not None:
            engine.pipeline.index = after.pipeline.index
    try:
        done = exchange_until_done(engine, [parse_record(r, i + 1) for i, r in enumerate(records)], timeout=120)
    finally:
        engine.close(wait_s=60)
    lines = [json.loads(d.line) for d in done]
    assert len(lines) == len(records) and not [x for x in lines if x["error"]]
    return {x["id"]: x for x in lines}, engine
