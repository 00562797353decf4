"""Sampling on the device, vocabulary-parallel: each rank holds the logits of its own vocabulary
shard and reduces them to a few figures per sequence; only those cross ranks, never a row of
logits, and only the sampled tokens (and the log-probabilities asked for) go to the host.

A step's logits [M, per] (this rank's `per` vocabulary columns, sharding.layout.vocab_shard)
go through these functions (ModelRunner.sample):
- `greedy`, inside the network's own graph (worker.model), so that a greedy step runs one graph:
  each rank's (max, argmax) per row; one all-gather; the first rank with the largest max wins,
  so a tie goes to the lowest token id, as numpy's argmax does on the whole row.
- `score`, inside the scoring step's graph: log p(target) per row, from each rank's max,
  normalizer part and the target's logit where the rank holds it (one all-gather), and the
  target's rank, each rank's count of tokens at or above that logit (a second all-gather);
  `logprob`, the first half alone, for the tokens a step drew from changed logits.
The others are compiled graphs of their own, run on the network's output where a step needs them:
- `greedy_logprobs`, when every row is greedy but asks for log-probabilities: each rank's max,
  normalizer part and K largest, one all-gather.
- `sample`: temperature, min_p, top-k and top-p (vLLM's order), greedy rows among them, and the
  log-probabilities, per row (temperature T, y = (x - max) / T):
  1. One all-gather of each rank's max, argmax, sum of exp(x - max) (the log-softmax normalizer),
     sum of exp((x - max) / T) and its C largest logits with their ids: every rank then holds
     the global C largest (the candidates), the same on every rank and at every tp.
  2. With top_k or top_p on, the kept tokens are among the candidates: those at or above top_k's
     k-th y and log(min_p); top_p then keeps them, most likely first, while the mass before them
     is under top_p of the mass min_p and top_k keep (that of the kept candidates with top_k; of
     the whole vocabulary otherwise: the ranks' sums of exp(y), or with min_p a pass over the
     rows and a second all-gather). The draw is the inverse CDF of one uniform u per sequence
     (from the host, `uniforms`) over them in token-id order, on every rank alike: nothing more
     crosses ranks. top_k is exact (a token tied with the k-th beyond the candidates aside).
  3. With neither, the draw is over the whole vocabulary (above log(min_p)): the ranks' sums, in
     rank order, name the rank whose range holds u x their total; that rank finds the token by
     a running sum over its shard, and an all-reduce (zeros from the other ranks) gives every
     rank the token and its logit.
  So a step takes one collective when its sampled rows all use top_k or top_p (without min_p
  alone), two when some draw over the whole vocabulary, three with min_p alone; the host picks
  that variant from the rows (`mass_pass`, `draw_pass`), and a row's token does not depend on it.
  The token for a given u is the same at any tp and in any batch, up to float32 rounding of the
  sums near a boundary. With the CPU kernels, everything after the gather is one kernel call
  (SampleMerge), and at tp 1 all of it (SampleRows): csrc/sampling.h, in the same float32 steps.
  Top-p differs from sorting the whole distribution in one case: when the C candidates hold less
  than top_p of the mass (after min_p and top-k), the kept set is those C tokens, a subset of the
  exact one; the distribution then differs by at most 1 - (their mass / the exact set's mass)
  in total variation. With C = 64 that needs a distribution flatter than top-p users sample from.
- `process`, before the others for a step with sequences whose logits change first (the
  penalties, logit_bias, bad words, min_tokens, allowed_token_ids, a grammar): the token mask
  and the per-token changes of worker.sampler.Adjustments, which every rank builds alike from
  its copy of each sequence's history; each applies the entries that fall in its shard.
- `full`: the whole logits, gathered (tests and measurements; worker.sampler samples them on the
  host as the reference the device is held to).

Each function works on R local shards [R, M, per] at once: R = 1 in a worker (the other shards
are on the other ranks, reached by the collectives), R = tp with `simulate_ranks`, where the
"collectives" are a transpose and a sum over R: the same code, at any tp, in one process (tests).
"""

from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, mint, nn, ops

from msinfer.sharding.layers import HALVES, LAST, SPLIT, TOPK, all_gather, all_reduce
from msinfer.sharding.layout import TPInfo, vocab_shard
from msinfer.worker.ops import int_range
from msinfer.worker.sampler import mix64

CANDIDATES = 64               # per row, for top-k, top-p and top_logprobs (more when a top_k asks for more)
OFF = -1e30                   # a threshold that keeps everything; the logit of a vocabulary padding column


def uniforms(streams: np.ndarray, counters: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per sequence for its draw of this step, from (its record's stream key,
    tokens generated so far, sample index) alone (worker.sampler.draw_key): so a record draws the
    same tokens whatever shares its batch, at any tp and after a replica restart or a resume. Each
    of the three goes into its own round of SplitMix64's finalizer with a constant added first, so
    no input is a fixed point (the finalizer alone maps 0 to 0, which would make every first draw
    of stream 0 take the first candidate)."""
    with np.errstate(over="ignore"):
        x = mix64(streams.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
        x = mix64(x + (counters.astype(np.uint64) + np.uint64(1)) * np.uint64(0xBF58476D1CE4E5B9))
        x = mix64(x + (indices.astype(np.uint64) + np.uint64(1)) * np.uint64(0x94D049BB133111EB))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def process_inputs(adjustments: dict, M: int, vocab: int, static: bool,
                   grammar: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
    """`VocabSampler.process`'s inputs for a step of M rows from {row: worker.sampler.Adjustments}
    and the grammars' masks of its first rows (int32 [m, W], all bits set where a row has none):
    entries [E, 5] float32 (row, token, add, r, sub; padded with row -1 to a power of two when
    `static`, for the CPU kernels' static shapes), the token masks [M, W] int32 (bits; W = 1,
    all set, when no row has one), and whether any row has one (`masked`)."""
    rows = [np.stack((np.full(len(a.ids), i), a.ids, a.add, a.r, a.sub), -1) for i, a in adjustments.items()
            if len(a.ids)]
    rows = np.concatenate(rows) if rows else np.zeros((0, 5))
    n = max(len(rows), 1)
    if static:
        n = 1 << max(4, (n - 1).bit_length())
    entries = np.zeros((n, 5), np.float32)
    entries[:, 0] = -1
    entries[: len(rows)] = rows
    masks = {i: a.allowed for i, a in adjustments.items() if a.allowed is not None}
    masked = bool(masks) or grammar is not None
    words = -(-vocab // 32)
    mask = np.full((M, words) if masked else (M, 1), -1, np.int32)
    if grammar is not None:
        mask[: len(grammar)] = grammar
    for i, allowed in masks.items():
        bits = np.packbits(allowed, bitorder="little")
        mask[i] &= np.pad(bits, (0, 4 * words - len(bits))).view(np.int32)
    return entries, mask, masked


class VocabSampler(nn.Cell):
    """The functions above over this rank's vocabulary shard; `candidates` (C) and `logprobs` (K,
    the top_logprobs returned per row, 0: none) fix one compiled variant of `sample`. The passes
    over whole rows (`stats`, `kept`, `draw`) are MindSpore primitives, or the device's own
    kernels (`kernels`: worker.cpu.SamplerKernels), which compute the same figures."""

    def __init__(self, vocab: int, tp: TPInfo, candidates: int = CANDIDATES, logprobs: int = 0,
                 simulate_ranks: bool = False, kernels=None, mass_pass: bool = False, draw_pass: bool = False,
                 masked: bool = False):
        super().__init__()
        start, _, per = vocab_shard(vocab, tp)
        R = tp.size if simulate_ranks else 1
        self.vocab, self.per, self.tp_size, self.R = vocab, per, tp.size, R
        self.C = min(max(candidates, logprobs, 1), per)
        self.K = logprobs
        self.mass_pass, self.draw_pass, self.masked = mass_pass, draw_pass, masked
        self.words = -(-vocab // 32)                  # of a token mask: bit t % 32 of word t / 32
        starts = np.arange(R) * per if simulate_ranks else np.array([start])
        self.starts = Tensor(starts.reshape(R, 1).astype(np.float32))
        self.rank_ids = Tensor((np.arange(R) if simulate_ranks else np.array([tp.rank])).reshape(R, 1).astype(np.int32))
        columns = starts[:, None] + np.arange(per)[None]
        self.int_starts = Tensor(starts.reshape(R, 1).astype(np.int32))
        self.word_of = Tensor(np.minimum(columns // 32, self.words - 1).reshape(-1).astype(np.int32))
        self.bit_of = Tensor((columns % 32).reshape(R, 1, per).astype(np.int32))
        self.padded = bool((columns >= vocab).any())
        self.padding = Tensor(np.where(columns < vocab, 0, OFF).reshape(R, 1, per).astype(np.float32))
        self.kernels = kernels
        if kernels is not None:
            self.stats_ops = {c: kernels.stats(c) for c in {1, self.C}}
            self.greedy_op = kernels.greedy()
            self.stats_t_op = kernels.stats(self.C, temperature=True)
            self.kept_op, self.draw_op, self.merge_op = kernels.kept(), kernels.draw(), kernels.merge(self.K)
            self.count_op = kernels.count()
            self.process_op = kernels.process()
            self.all_starts = Tensor((np.arange(tp.size) * per).astype(np.float32))
            real = np.clip(vocab - starts, 0, per).astype(np.int32)            # real columns of each shard
            self.meta_sum = Tensor(np.stack((real, np.ones(R, np.int32)), -1))
            self.meta = Tensor(np.stack((real, np.zeros(R, np.int32)), -1))
            self.meta_process = Tensor(np.stack((starts.astype(np.int32), real, np.full(R, int(masked), np.int32)), -1))
            if tp.size == 1:
                self.sample_op = kernels.sample(self.K)
                self.meta_c = Tensor(np.array([[vocab, self.C]], np.int32))
        self.all_gather = self.all_reduce = None
        if tp.size > 1 and not simulate_ranks:
            self.all_gather, self.all_reduce = all_gather(), all_reduce()

    # ---- the two collectives, over [R, M, k] ----------------------------------------------------
    def gather(self, x):
        """[R, M, k] from each rank -> [M, tp, k], every rank's, the same on every rank."""
        if self.all_gather is None:
            return x.transpose(1, 0, 2)
        k = x.shape[-1]
        return self.all_gather(x[0]).reshape(self.tp_size, -1, k).transpose(1, 0, 2)

    def gather_rows(self, x):
        """[R M, ...] from each rank -> [tp M, ...], rank after rank (the kernels' layout)."""
        return x if self.all_gather is None else self.all_gather(x)

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
    def stats(self, x, C: int, with_sum: bool, t=None):
        """Per row of each shard, [R, M]: the max, its column (the first), sum exp(x - max) (only
        `with_sum`), sum exp((x - max) / t) (with t [M] per row; else the max again); and with
        C > 0 the C largest [R, M, C] with their columns. Columns as float32, with the shard's
        offset. x: the network's logits (`local` for the primitives)."""
        if self.kernels is not None:
            n = max(C, 1)
            meta = self.meta_sum if with_sum else self.meta
            if t is None:
                out = self.stats_ops[n](self.rows(x), meta)
            else:
                out = self.stats_t_op(self.rows(x), t, meta)
            m, arg, s, s_t, top, ids = SPLIT(out.reshape(self.R, -1, 4 + 2 * n), (1, 1, 1, 1, n, n), 2)
            m, arg, s, s_t = LAST(m), LAST(arg), LAST(s), LAST(s_t)
        else:
            x = self.local(x)
            m = ops.amax(x, -1)
            arg = ops.argmax(x, -1).astype(ms.float32)
            d = x - ops.broadcast_to(m.expand_dims(-1), x.shape)
            s = ops.exp(d).sum(-1) if with_sum else m
            s_t = ops.exp(d / ops.broadcast_to(t.reshape(1, -1, 1), x.shape)).sum(-1) if t is not None else m
            top, ids = TOPK(x, C) if C else (m, m)
            ids = ids.astype(ms.float32)
        return m, arg + self.starts, s, s_t, top, (ids + self.starts.expand_dims(-1)) if C else ids

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
            j, at_j = HALVES(out.reshape(self.R, -1, 2))
            return LAST(j).astype(ms.int32), LAST(at_j)
        x = self.local(x)
        w = self.kept_weights(x, g, t, tau)
        hit = ops.cumsum(w, 2) > ops.broadcast_to(target.expand_dims(-1), w.shape)
        j = self.first_or_last(hit, w > 0, 2)
        return j, ops.gather_elements(x, 2, j.expand_dims(-1)).squeeze(-1)

    # ---- the functions ------------------------------------------------------------------------
    def greedy(self, logits):
        """-> token ids [M] int32."""
        if self.tp_size == 1 and self.kernels is not None:    # one operator: in every step's graph
            return self.greedy_op(self.rows(logits), self.meta)
        if self.tp_size == 1:
            return ops.argmax(self.rows(logits), -1).astype(ms.int32)
        m, arg, _, _, _, _ = self.stats(logits, 0, False)
        maxes, args = HALVES(self.gather(ops.stack((m, arg), -1)))               # [M, tp, 2]
        best = ops.argmax(LAST(maxes), -1).expand_dims(-1)
        return LAST(ops.gather_elements(LAST(args), 1, best)).astype(ms.int32)

    def process(self, logits, entries, mask):
        """The logits as a step's sampling parameters leave them (worker.sampler.Adjustments):
        mask [M, W] int32, each row's token mask as bits (used when `masked`); entries [E, 5]
        float32 (row, token, add, r, sub), each x -> rep(x + add) + sub with rep(v) = v / r if
        v > 0 else v * r, where this rank holds the token (row -1: none). Same shape as logits."""
        if self.kernels is not None:
            return self.process_op(self.rows(logits), entries, mask, self.meta_process).reshape(logits.shape)
        x = self.local(logits)                                                  # [R, M, per]
        if self.masked:
            words = ops.gather(mask, self.word_of, 1).reshape(-1, self.R, self.per).transpose(1, 0, 2)
            bits = ops.bitwise_and(ops.bitwise_right_shift(words, ops.broadcast_to(self.bit_of, words.shape)),
                                   ops.ones_like(words))
            x = ops.select(bits == 1, x, -float("inf"))
        row = entries[:, 0].astype(ms.int32)
        at = entries[:, 1].astype(ms.int32).expand_dims(0) - self.int_starts     # [R, E]: the token's column here
        valid = ops.logical_and(ops.logical_and(at >= 0, at < self.per), (row >= 0).expand_dims(0))
        E = entries.shape[0]
        index = ops.stack((ops.broadcast_to(int_range(self.R).reshape(-1, 1), at.shape),
                           ops.broadcast_to(ops.clip_by_value(row, 0, None).expand_dims(0), at.shape),
                           ops.clip_by_value(at, 0, self.per - 1)), -1).reshape(-1, 3)
        old = ops.gather_nd(x, index).reshape(self.R, E)
        v = old + entries[:, 2].expand_dims(0)
        r = ops.broadcast_to(entries[:, 3].expand_dims(0), v.shape)
        new = ops.select(v > 0, v / r, v * r) + entries[:, 4].expand_dims(0)
        delta = ops.select(ops.logical_and(valid, ops.isfinite(old)), new - old, ops.zeros_like(old))
        x = ops.tensor_scatter_add(x, index, delta.reshape(-1))
        return x[0] if logits.ndim == 2 else x

    def full(self, logits):
        """-> the whole logits [M, vocab]."""
        x = self.local(logits)
        g = self.gather(x)                                                      # [M, tp, per]
        g = mint.flatten(g, 1)                                                  # [M, tp * per]
        # no slice where no shard is padded: MindSpore's CPU StridedSlice copies a [16, 49152]
        # float32 array in ~30 ms
        return g if g.shape[1] == self.vocab else g[:, : self.vocab]

    def _scored(self, logits, targets):
        """`logprob`'s and `score`'s common part: (this rank's rows `local`, each target's logit
        [S], each row's log-softmax normalizer log Z [S]), from each rank's max, normalizer part
        and the target's logit where the rank holds it (one all-gather)."""
        m, _, s, _, _, _ = self.stats(logits, 0, True)
        x = self.local(logits)
        at = targets.expand_dims(0) - self.starts.astype(ms.int32)               # [R, S]
        inside = ops.logical_and(at >= 0, at < self.per)
        at = ops.clip_by_value(at, 0, self.per - 1)
        own = ops.gather_elements(x, 2, at.expand_dims(-1)).squeeze(-1) * inside.astype(ms.float32)
        maxes, sums, owns = SPLIT(self.gather(ops.stack((m, s, own), -1)), (1, 1, 1), 2)    # [S, tp, 1] each
        maxes, sums, owns = LAST(maxes), LAST(sums), LAST(owns)
        top = ops.amax(maxes, -1)
        log_z = top + ops.log((sums * ops.exp(maxes - top.expand_dims(-1))).sum(-1))
        return x, owns.sum(-1), log_z

    def logprob(self, logits, targets):
        """targets [S] int32 -> log p(target) [S] float32 under each row's log-softmax."""
        _, target, log_z = self._scored(logits, targets)
        return target - log_z

    def score(self, logits, targets):
        """targets [S] int32 -> [S, 2] float32: `logprob`, and the target's rank as vLLM counts it,
        the tokens whose logit is at least the target's (1: no other is as likely). The rank takes
        a second all-gather: each rank counts the tokens of its shard at or above the target's
        logit, which the first made known to every rank."""
        x, target, log_z = self._scored(logits, targets)
        if self.kernels is not None:
            above = self.count_op(self.rows(logits), target, self.meta).reshape(self.R, -1)     # [R, S]
        else:
            above = (x >= ops.broadcast_to(target.reshape(1, -1, 1), x.shape)).astype(ms.float32).sum(-1)
        rank = LAST(self.gather(above.expand_dims(-1))).sum(-1)
        return ops.stack((target - log_z, rank), -1)

    def candidates(self, x, C: int, t=None):
        """Per row over the whole vocabulary: the largest logit [M], its token (float32), the
        log-softmax normalizer log Z [M] and the C largest logits [M, C] with their tokens
        (float32), the same on every rank; and each rank's max and sum exp((x - max) / t)
        [M, tp] (`stats`)."""
        m, arg, s, s_t, top, top_ids = self.stats(x, C, True, t)
        if self.tp_size == 1:            # one shard: its figures are the global ones, its candidates sorted
            return m[0], arg[0], m[0] + ops.log(s[0]), top[0], top_ids[0], m.transpose(1, 0), s_t.transpose(1, 0)
        g = self.gather(ops.concat((ops.stack((m, arg, s, s_t), -1), top, top_ids), -1))   # [M, tp, 4 + 2C]
        maxes, args, sums, sums_t, tops, tops_ids = SPLIT(g, (1, 1, 1, 1, C, C), 2)
        maxes, args, sums, sums_t = LAST(maxes), LAST(args), LAST(sums), LAST(sums_t)
        g_max = ops.amax(maxes, -1)
        winner = ops.argmax(maxes, -1).expand_dims(-1)
        token = LAST(ops.gather_elements(args, 1, winner))
        log_z = g_max + ops.log((sums * ops.exp(maxes - g_max.expand_dims(-1))).sum(-1))
        v, pos = TOPK(tops.reshape(-1, self.tp_size * C), C)                    # the global top C
        v_ids = ops.gather_elements(tops_ids.reshape(-1, self.tp_size * C), 1, pos)
        return g_max, token, log_z, v, v_ids, maxes, sums_t

    def greedy_logprobs(self, logits):
        """`sample`'s answer (K > 0) when every row is greedy, from one pass over the rows: the
        greedy tokens [M] int32 and `figures`."""
        if self.tp_size == 1 and self.kernels is not None:       # SampleRows, every row at temperature 0
            return self.fused(logits, ops.zeros((logits.shape[-2], 5), ms.float32))
        g_max, token, log_z, v, v_ids, _, _ = self.candidates(logits, self.C)
        K = self.K
        return token.astype(ms.int32), self.figures(g_max - log_z, v[:, :K] - log_z.expand_dims(-1), v_ids[:, :K])

    def sample(self, logits, temperature, top_k, top_p, min_p, u):
        """Per row [M]: temperature (0: greedy) float32, top_k (0: off) int32, top_p (1: off),
        min_p (0: off), u in [0, 1) float32 -> token ids [M] int32, and with K > 0 also their
        `figures`: the chosen token's log-probability, the K most likely tokens' and their ids
        (the model's own distribution: log-softmax of the logits, before any of the filters)."""
        f32 = ms.float32
        prm = ops.stack((temperature, top_k.astype(f32), top_p, min_p, u), -1)
        if self.tp_size == 1 and self.kernels is not None:       # all of it in one kernel call
            return self.fused(logits, prm)
        greedy = temperature <= 0
        t = ops.select(greedy, ops.ones_like(temperature), temperature)         # [M]
        tau_min_p = ops.select(min_p > 0, ops.log(ops.maximum(min_p, 1e-30)), OFF)
        if self.kernels is not None:
            return self.merged(logits, prm, t, tau_min_p)
        x = logits                       # the network's; each pass takes it as it needs (`local`, `rows`)
        g_max, greedy_token, log_z, v, v_ids, maxes, s_t = self.candidates(x, self.C, t)
        part = s_t * ops.exp((maxes - g_max.expand_dims(-1)) / t.expand_dims(-1))   # [M, tp]: each rank's kept sum
        if self.mass_pass:
            kept = self.gather(self.kept(x, g_max, t, tau_min_p).expand_dims(-1)).squeeze(-1)
            part = ops.select(ops.broadcast_to((min_p > 0).expand_dims(-1), part.shape), kept, part)
        total = part.sum(-1)

        # top_k or top_p: the candidates
        y = (v - g_max.expand_dims(-1)) / t.expand_dims(-1)                      # scaled, 0 for the largest
        kth = ops.gather_elements(y, 1, (ops.clip_by_value(top_k, 1, self.C) - 1).expand_dims(-1)).squeeze(-1)
        tau = ops.maximum(ops.select(top_k > 0, kth, OFF), tau_min_p)
        wc = ops.exp(y) * (y >= tau.expand_dims(-1)).astype(f32)
        limit = top_p * ops.select(top_k > 0, wc.sum(-1), total)
        before = ops.cumsum(wc, 1) - wc
        drop = ops.logical_and((top_p < 1).expand_dims(-1), before >= limit.expand_dims(-1))
        wc = ops.select(drop, ops.zeros_like(wc), wc)
        ids_sorted, order = ops.sort(v_ids, -1)                                 # token-id order
        w = ops.gather_elements(wc, 1, order)
        cum = ops.cumsum(w, 1)
        at = self.first_or_last(cum > (u * cum[:, -1]).expand_dims(-1), w > 0, 1).expand_dims(-1)
        pick = ops.gather_elements(order, 1, at)
        token = ops.gather_elements(v_ids, 1, pick).squeeze(-1)
        logit = ops.gather_elements(v, 1, pick).squeeze(-1)

        if self.draw_pass:               # neither: the whole vocabulary
            cum = ops.cumsum(part, 1)
            target = u * total
            owner = self.first_or_last(cum > target.expand_dims(-1), part > 0, 1)   # [M]
            start = ops.gather_elements(cum - part, 1, owner.expand_dims(-1)).squeeze(-1)
            j, x_j = self.draw(x, g_max, t, tau_min_p, ops.broadcast_to((target - start).expand_dims(0), (self.R, -1)))
            mine = (owner.expand_dims(0) == self.rank_ids).astype(f32)
            drawn = self.reduce(ops.stack(((j.astype(f32) + self.starts + 1) * mine, x_j * mine), -1))   # [M, 2]
            whole = ops.logical_and(top_k <= 0, top_p >= 1)
            token = ops.select(whole, drawn[:, 0] - 1, token)
            logit = ops.select(whole, drawn[:, 1], logit)
        token = ops.select(greedy, greedy_token, token).astype(ms.int32)
        if self.K == 0:
            return token
        chosen = ops.select(greedy, g_max, logit) - log_z
        return token, self.figures(chosen, v[:, : self.K] - log_z.expand_dims(-1), v_ids[:, : self.K])

    def merged(self, logits, prm, t, tau_min_p):
        """`sample` with the CPU kernels at tp > 1 (or simulated): the ranks' stats gathered, the
        rest one SampleMerge call on every rank; a draw over the whole vocabulary on the rank
        that owns it (`draw_pass`), summed to every rank."""
        temperature = prm[:, 0]             # a row with top_k keeps only candidates: no sum over its row
        t_sum = ops.select(prm[:, 1] > 0, ops.zeros_like(temperature), ops.relu(temperature))
        st = self.gather_rows(self.stats_t_op(self.rows(logits), t_sum, self.meta_sum))
        M = prm.shape[0]
        if self.mass_pass:
            g_max = ops.amax(st[:, 0].reshape(self.tp_size, M), 0)
            kept = self.gather_rows(self.kept(logits, g_max, t, tau_min_p).reshape(-1))
        else:
            kept = ops.zeros((self.tp_size * M,), ms.float32)
        out = self.merge_op(st, prm, kept, self.all_starts)                    # [M, 2 + 2K + 5]
        token, chosen = out[:, 0], out[:, 1]
        if self.draw_pass:
            d = out[:, 2 + 2 * self.K:]
            owner = d[:, 0].astype(ms.int32)
            target = ops.broadcast_to(d[:, 1].expand_dims(0), (self.R, -1))
            j, x_j = self.draw(logits, d[:, 2], d[:, 3], d[:, 4], target)
            mine = (owner.expand_dims(0) == self.rank_ids).astype(ms.float32)
            drawn = self.reduce(ops.stack(((j.astype(ms.float32) + self.starts) * mine, x_j * mine), -1))
            pending = token < 0
            token = ops.select(pending, drawn[:, 0], token)
            chosen = ops.select(pending, chosen + drawn[:, 1], chosen)
        token = token.astype(ms.int32)
        if self.K == 0:
            return token
        return token, ops.concat((chosen.expand_dims(-1), out[:, 2: 2 + 2 * self.K]), -1)

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
        positions = int_range(n).reshape(tuple(shape))
        first = ops.argmax(hit.astype(ms.int32), axis)
        last = ops.argmax(ops.select(present, ops.broadcast_to(positions, hit.shape), -1), axis)
        return ops.select(hit.any(axis), first, last).astype(ms.int32)
