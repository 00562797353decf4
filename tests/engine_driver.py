"""Drives a ModelRunner (or a Replica) step by step the way the controller does, for tests."""

from __future__ import annotations

from worker.protocol import SAMPLED, SamplingParams, SeqStep


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
        steps = [SeqStep(sid, list(p), 0, self.table(sid), sampling) for sid, p in prompts.items()]
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
