"""Sampling on the device, vocabulary-parallel: each rank holds the logits of its own vocabulary
shard and reduces them to a few figures per sequence; only those cross ranks, never a row of
logits, and only the sampled tokens (and the log-probabilities asked for) go to the host.

A step's logits [M, per] (this rank's `per` vocabulary columns, sharding.layout.vocab_shard)
go through these functions (ModelRunner.sample):
- `greedy`, inside the network's own graph (worker.model), so that a greedy step runs one graph:
  each rank's (max, argmax) per row; one all-gather; the first rank with the largest max wins,
  so a tie goes to the lowest token id, as numpy's argmax does on the whole row.
- `score`, inside the scoring step's graph: log p(target) per row, from each rank's max,
  normalizer part and the target's logit where the rank holds it (one all-gather).
The others are compiled graphs of their own, run on the network's output where a step needs them:
- `greedy_logprobs`, when every row is greedy but asks for log-probabilities: each rank's max,
  normalizer part and K largest, one all-gather.
- `sample`: temperature, min_p, top-k and top-p (vLLM's order), greedy rows among them, and the
  log-probabilities. Four collectives per step:
  1. all-gather of each rank's max, argmax, sum of exp(x - max) (the log-softmax normalizer)
     and its C largest logits with their ids; every rank then holds the global C largest
     (`candidates`), the same on every rank and at every tp.
  2. The filters as one threshold on the temperature-scaled logits: top-k keeps the k-th
     candidate and above (exact: C >= k); min_p keeps x/T >= max/T + log(min_p); top-p walks
     the candidates, most likely first, until their mass reaches top_p of what min_p and top-k
     keep (whose total is the second all-gather: each rank's sum under that threshold).
  3. The draw: one uniform u per sequence (from the host, `uniforms`), an inverse CDF in token-id
     order over the kept tokens' weights exp((x - max)/T): the third all-gather (each rank's sum
     of kept weights) names the rank whose range holds u x total, that rank finds the token in
     its shard by a cumulative sum, and an all-reduce (zeros from the other ranks) gives every
     rank the token and its logit. The token for a given u is the same at any tp and in any
     batch, up to float32 rounding of the sums near a boundary.
  With the CPU kernels at tp 1, all of it is one kernel call (SampleRows, csrc/sampling.h), in
  the same float32 steps.
  Top-p differs from sorting the whole distribution in one case: when the C candidates hold less
  than top_p of the mass (after min_p and top-k), the kept set is those C tokens, a subset of the
  exact one; the distribution then differs by at most 1 - (their mass / the exact set's mass)
  in total variation. With C = 64 that needs a distribution flatter than top-p users sample from.
- `full`: the whole logits, gathered (a row whose sampling reads them on the host, worker.sampler).

Each function works on R local shards [R, M, per] at once: R = 1 in a worker (the other shards
are on the other ranks, reached by the collectives), R = tp with `simulate_ranks`, where the
"collectives" are a transpose and a sum over R: the same code, at any tp, in one process (tests).
"""

from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from msinfer.sharding.layout import TPInfo, vocab_shard

CANDIDATES = 64               # per row, for top-k, top-p and top_logprobs (more when a top_k asks for more)
OFF = -1e30                   # a threshold that keeps everything; the logit of a vocabulary padding column


def uniforms(seeds: np.ndarray, counters: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per sequence for its draw of this step, from (seed, tokens generated
    so far, sample index) alone: SplitMix64's finalizer over the three, so a seeded record draws
    the same tokens whatever shares its batch, at any tp and after a replica restart."""
    with np.errstate(over="ignore"):
        x = (seeds.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             ^ counters.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
             ^ indices.astype(np.uint64) * np.uint64(0x94D049BB133111EB))
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            x = (x ^ (x >> np.uint64(shift))) * np.uint64(mult)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class VocabSampler(nn.Cell):
    """The functions above over this rank's vocabulary shard; `candidates` (C) and `logprobs` (K,
    the top_logprobs returned per row, 0: none) fix one compiled variant of `sample`. The passes
    over whole rows (`stats`, `kept`, `draw`) are MindSpore primitives, or the device's own
    kernels (`kernels`: worker.cpu.SamplerKernels), which compute the same figures."""

    def __init__(self, vocab: int, tp: TPInfo, candidates: int = CANDIDATES, logprobs: int = 0,
                 simulate_ranks: bool = False, kernels=None):
        super().__init__()
        start, _, per = vocab_shard(vocab, tp)
        R = tp.size if simulate_ranks else 1
        self.vocab, self.per, self.tp_size, self.R = vocab, per, tp.size, R
        self.C = min(max(candidates, logprobs, 1), per)
        self.K = logprobs
        starts = np.arange(R) * per if simulate_ranks else np.array([start])
        self.starts = Tensor(starts.reshape(R, 1).astype(np.float32))
        self.rank_ids = Tensor((np.arange(R) if simulate_ranks else np.array([tp.rank])).reshape(R, 1).astype(np.int32))
        columns = starts[:, None] + np.arange(per)[None]
        self.padded = bool((columns >= vocab).any())
        self.padding = Tensor(np.where(columns < vocab, 0, OFF).reshape(R, 1, per).astype(np.float32))
        self.kernels = kernels
        if kernels is not None:
            self.stats_ops = {c: kernels.stats(c) for c in {1, self.C}}
            self.kept_op, self.draw_op = kernels.kept(), kernels.draw()
            real = np.clip(vocab - starts, 0, per).astype(np.int32)            # real columns of each shard
            self.meta_sum = Tensor(np.stack((real, np.ones(R, np.int32)), -1))
            self.meta = Tensor(np.stack((real, np.zeros(R, np.int32)), -1))
            if tp.size == 1:
                self.sample_op = kernels.sample(self.K)
                self.meta_c = Tensor(np.array([[vocab, self.C]], np.int32))
        self.all_gather = self.all_reduce = None
        if tp.size > 1 and not simulate_ranks:
            self.all_gather, self.all_reduce = ops.AllGather(), ops.AllReduce()

    # ---- the two collectives, over [R, M, k] ----------------------------------------------------
    def gather(self, x):
        """[R, M, k] from each rank -> [M, tp, k], every rank's, the same on every rank."""
        if self.all_gather is None:
            return x.transpose(1, 0, 2)
        k = x.shape[-1]
        return self.all_gather(x[0]).reshape(self.tp_size, -1, k).transpose(1, 0, 2)

    def reduce(self, x):
        """[R, M, k] -> [M, k], summed over every rank."""
        if self.all_reduce is None:
            return x.sum(0)
        return self.all_reduce(x[0])

    def local(self, logits):
        """The network's [M, per] (or [R, M, per] simulated) with padding columns at OFF."""
        if self.R == 1 and logits.ndim == 2:
            logits = logits.expand_dims(0)
        return logits + self.padding if self.padded else logits

    # ---- the passes over whole rows -------------------------------------------------------------
    def stats(self, x, C: int, with_sum: bool):
        """Per row of each shard, [R, M]: the max, its column (the first), sum exp(x - max) (only
        `with_sum`); and with C > 0 the C largest [R, M, C] with their columns. Columns as float32,
        with the shard's offset. x: the network's logits (`local` for the primitives)."""
        if self.kernels is not None:
            n = max(C, 1)
            out = self.stats_ops[n](self.rows(x), self.meta_sum if with_sum else self.meta)
            out = out.reshape(self.R, -1, 3 + 2 * n)
            m, arg, s, top, ids = out[:, :, 0], out[:, :, 1], out[:, :, 2], out[:, :, 3: 3 + n], out[:, :, 3 + n:]
        else:
            x = self.local(x)
            m = ops.amax(x, -1)
            arg = ops.argmax(x, -1).astype(ms.float32)
            s = ops.exp(x - ops.broadcast_to(m.expand_dims(-1), x.shape)).sum(-1) if with_sum else m
            top, ids = ops.topk(x, C) if C else (m, m)
            ids = ids.astype(ms.float32)
        return m, arg + self.starts, s, top, (ids + self.starts.expand_dims(-1)) if C else ids

    def rows(self, logits):
        """The network's [M, per] as it is (R = 1), or [R, M, per] as [R M, per]: the kernels' rows."""
        return logits if logits.ndim == 2 else logits.reshape(-1, self.per)

    def scaled(self, x, g, t):
        """(x - g) / t over [R, M, per], with g and t per row [M]."""
        return (x - ops.broadcast_to(g.reshape(1, -1, 1), x.shape)) / ops.broadcast_to(t.reshape(1, -1, 1), x.shape)

    def kept_weights(self, x, g, t, tau):
        xs = self.scaled(x, g, t)
        return ops.exp(xs) * (xs >= ops.broadcast_to(tau.reshape(1, -1, 1), x.shape)).astype(ms.float32)

    def kept(self, x, g, t, tau):
        """Per row [R, M]: the sum of exp((x - g) / t) where (x - g) / t >= tau (g, t, tau per row [M])."""
        if self.kernels is not None:
            return self.kept_op(self.rows(x), ops.stack((g, t, tau), -1), self.meta).reshape(self.R, -1)
        return self.kept_weights(self.local(x), g, t, tau).sum(-1)

    def draw(self, x, g, t, tau, target):
        """Per row [R, M]: the first column where the running sum of the kept weights (see `kept`)
        exceeds target [R, M] (or the last with a positive weight), int32 in the shard; x there."""
        if self.kernels is not None:
            out = self.draw_op(self.rows(x), ops.stack((g, t, tau), -1), target.reshape(-1), self.meta)
            out = out.reshape(self.R, -1, 2)
            return out[:, :, 0].astype(ms.int32), out[:, :, 1]
        x = self.local(x)
        w = self.kept_weights(x, g, t, tau)
        hit = ops.cumsum(w, 2) > ops.broadcast_to(target.expand_dims(-1), w.shape)
        j = self.first_or_last(hit, w > 0, 2)
        return j, ops.gather_elements(x, 2, j.expand_dims(-1)).squeeze(-1)

    # ---- the functions ------------------------------------------------------------------------
    def greedy(self, logits):
        """-> token ids [M] int32."""
        if self.tp_size == 1 and self.kernels is not None:    # the fewest operators: in every step's graph
            return self.stats_ops[1](self.rows(logits), self.meta)[:, 1].astype(ms.int32)
        if self.tp_size == 1:
            return ops.argmax(self.rows(logits), -1).astype(ms.int32)
        m, arg, _, _, _ = self.stats(logits, 0, False)
        g = self.gather(ops.stack((m, arg), -1))                                # [M, tp, 2]
        best = ops.argmax(g[:, :, 0], -1).expand_dims(-1)
        return ops.gather_elements(g[:, :, 1], 1, best).squeeze(-1).astype(ms.int32)

    def full(self, logits):
        """-> the whole logits [M, vocab]."""
        x = self.local(logits)
        g = self.gather(x)                                                      # [M, tp, per]
        return g.reshape(g.shape[0], -1)[:, : self.vocab]

    def score(self, logits, targets):
        """targets [S] int32 -> log p(target) [S] float32 under each row's log-softmax."""
        m, _, s, _, _ = self.stats(logits, 0, True)
        x = self.local(logits)
        at = targets.expand_dims(0) - self.starts.astype(ms.int32)               # [R, S]
        inside = ops.logical_and(at >= 0, at < self.per)
        at = ops.clip_by_value(at, 0, self.per - 1)
        own = ops.gather_elements(x, 2, at.expand_dims(-1)).squeeze(-1) * inside.astype(ms.float32)
        g = self.gather(ops.stack((m, s, own), -1))                             # [S, tp, 3]
        top = ops.amax(g[:, :, 0], -1)
        log_z = top + ops.log((g[:, :, 1] * ops.exp(g[:, :, 0] - top.expand_dims(-1))).sum(-1))
        return g[:, :, 2].sum(-1) - log_z

    def candidates(self, x, C: int):
        """Per row over the whole vocabulary: the largest logit [M], its token (float32), the
        log-softmax normalizer log Z [M] and the C largest logits [M, C] with their tokens
        (float32), the same on every rank."""
        m, arg, s, top, top_ids = self.stats(x, C, True)
        if self.tp_size == 1:            # one shard: its figures are the global ones, its candidates sorted
            return m[0], arg[0], m[0] + ops.log(s[0]), top[0], top_ids[0]
        g = self.gather(ops.concat((ops.stack((m, arg, s), -1), top, top_ids), -1))   # [M, tp, 3 + 2C]
        maxes = g[:, :, 0]
        g_max = ops.amax(maxes, -1)
        winner = ops.argmax(maxes, -1).expand_dims(-1)
        token = ops.gather_elements(g[:, :, 1], 1, winner).squeeze(-1)
        log_z = g_max + ops.log((g[:, :, 2] * ops.exp(maxes - g_max.expand_dims(-1))).sum(-1))
        v, pos = ops.topk(g[:, :, 3: 3 + C].reshape(-1, self.tp_size * C), C)   # the global top C
        return g_max, token, log_z, v, ops.gather_elements(g[:, :, 3 + C:].reshape(-1, self.tp_size * C), 1, pos)

    def greedy_logprobs(self, logits):
        """`sample`'s answer (K > 0) when every row is greedy, from one pass over the rows: the
        greedy tokens [M] int32 and `figures`."""
        if self.tp_size == 1 and self.kernels is not None:       # SampleRows, every row at temperature 0
            return self.fused(logits, ops.zeros((logits.shape[-2], 5), ms.float32))
        g_max, token, log_z, v, v_ids = self.candidates(logits, self.C)
        K = self.K
        return token.astype(ms.int32), self.figures(g_max - log_z, v[:, :K] - log_z.expand_dims(-1), v_ids[:, :K])

    def sample(self, logits, temperature, top_k, top_p, min_p, u):
        """Per row [M]: temperature (0: greedy) float32, top_k (0: off) int32, top_p (1: off),
        min_p (0: off), u in [0, 1) float32 -> token ids [M] int32, and with K > 0 also their
        `figures`: the chosen token's log-probability, the K most likely tokens' and their ids
        (the model's own distribution: log-softmax of the logits, before any of the filters)."""
        C = self.C
        f32 = ms.float32
        if self.tp_size == 1 and self.kernels is not None:       # all of it in one kernel call
            return self.fused(logits, ops.stack((temperature, top_k.astype(f32), top_p, min_p, u), -1))
        x = logits                       # the network's; each pass takes it as it needs (`local`, `rows`)
        g_max, greedy_token, log_z, v, v_ids = self.candidates(x, C)

        greedy = temperature <= 0
        t = ops.select(greedy, ops.ones_like(temperature), temperature)         # [M]
        y = (v - g_max.expand_dims(-1)) / t.expand_dims(-1)                      # scaled, 0 for the largest
        kth = ops.gather_elements(y, 1, (ops.clip_by_value(top_k, 1, C) - 1).expand_dims(-1)).squeeze(-1)
        off = ops.full_like(g_max, OFF)
        tau = ops.maximum(ops.select(top_k > 0, kth, off),
                          ops.select(min_p > 0, ops.log(ops.maximum(min_p, ops.full_like(min_p, 1e-30))), off))
        kept_mass = self.gather(self.kept(x, g_max, t, tau).expand_dims(-1)).sum((1, 2))
        wc = ops.exp(y) * (y >= tau.expand_dims(-1)).astype(f32)
        before = ops.cumsum(wc, 1) - wc
        keep = ops.logical_and(before < (top_p * kept_mass).expand_dims(-1), wc > 0)
        tau_p = ops.amin(ops.select(keep, y, ops.full_like(y, -OFF)), -1)
        tau = ops.select(top_p < 1, ops.maximum(tau, tau_p), tau)

        if self.tp_size == 1:
            target = u * self.kept(x, g_max, t, tau)                             # [1, M]
            j, logit = self.draw(x, g_max, t, tau, target)
            drawn = ops.stack((j[0].astype(f32) + 1, logit[0]), -1)
        else:
            per_rank = self.gather(self.kept(x, g_max, t, tau).expand_dims(-1)).squeeze(-1)   # [M, tp]
            cum = ops.cumsum(per_rank, 1)
            target = u * cum[:, -1]
            owner = self.first_or_last(cum > target.expand_dims(-1), per_rank > 0, 1)   # [M]
            start = ops.gather_elements(cum - per_rank, 1, owner.expand_dims(-1)).squeeze(-1)
            j, logit = self.draw(x, g_max, t, tau, ops.broadcast_to((target - start).expand_dims(0), (self.R, -1)))
            mine = (owner.expand_dims(0) == self.rank_ids).astype(f32)
            drawn = self.reduce(ops.stack(((j.astype(f32) + self.starts + 1) * mine, logit * mine), -1))   # [M, 2]
        token = ops.select(greedy, greedy_token, drawn[:, 0] - 1).astype(ms.int32)
        if self.K == 0:
            return token
        chosen = ops.select(greedy, g_max, drawn[:, 1]) - log_z
        return token, self.figures(chosen, v[:, : self.K] - log_z.expand_dims(-1), v_ids[:, : self.K])

    def fused(self, logits, prm):
        """`sample` at tp 1 with the CPU kernels: one call of SampleRows (csrc/sampling.h), which
        takes the per-row parameters as prm [M, 5] and computes the same float32 steps. The
        out [M, 2 + 2K] is the token and `figures`."""
        out = self.sample_op(self.rows(logits), prm, self.meta_c)
        token = out[:, 0].astype(ms.int32)
        if self.K == 0:
            return token
        return token, out[:, 1:]

    @staticmethod
    def figures(chosen, top, ids):
        """The log-probabilities of a step as one output [M, 1 + 2K] float32: the chosen token's,
        the K most likely tokens', their ids (exact in float32). Outputs are few on purpose: on
        the CPU each sliced output costs more than its bytes (a step with four took 3-5 ms more)."""
        return ops.concat((chosen.expand_dims(-1), top, ids.astype(ms.float32)), -1)

    def first_or_last(self, hit, present, axis: int):
        """Along `axis`: the first position where `hit`, or, where none is (float rounding of a
        target at the very end), the last position where `present`."""
        n = hit.shape[axis]
        shape = [1] * hit.ndim
        shape[axis] = n
        positions = ops.arange(n, dtype=ms.int32).reshape(tuple(shape))
        first = ops.argmax(hit.astype(ms.int32), axis)
        last = ops.argmax(ops.select(present, ops.broadcast_to(positions, hit.shape),
                                     ops.full_like(hit, -1, dtype=ms.int32)), axis)
        return ops.select(hit.any(axis), first, last).astype(ms.int32)
