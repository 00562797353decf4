"""The device sampler (worker/device_sampler.py) on vocabulary shards, compiled as a worker runs it,
with MindSpore's primitives and with the CPU kernels, the tp ranks simulated in one process (R
shards, the collectives a transpose and a sum): the same tokens at tp 1 and 3 (a padded last
shard) and 2, the whole-row answers (argmax, log-softmax), and draws that follow the
distribution the filters define."""

from __future__ import annotations

import dataclasses

import mindspore as ms
import numpy as np
import pytest

from msinfer.sharding.layout import TPInfo
from msinfer.worker import sampler
from msinfer.worker.device_sampler import VocabSampler, process_inputs, uniforms
from msinfer.worker.protocol import SamplingParams

pytestmark = pytest.mark.unit
V = 103                     # no tp of 2 or 3 divides it: the last shard is padded


def shards(logits: np.ndarray, tp: int) -> ms.Tensor:
    """[M, V] -> [tp, M, per], as the ranks' LM heads hold them (padding columns zero)."""
    per = -(-V // tp)
    out = np.zeros((tp, logits.shape[0], per), np.float32)
    for r in range(tp):
        part = logits[:, r * per: (r + 1) * per]
        out[r, :, : part.shape[1]] = part
    return ms.Tensor(out)


_COMPILED = {}


def cpu_kernels():
    from msinfer.worker.cpu import SamplerKernels, load_kernels
    load_kernels()
    return SamplerKernels


@pytest.fixture(params=["primitives", "cpu kernels"])
def kernels(request):
    """The passes over whole rows as MindSpore primitives (portable, Ascend) or the CPU kernels."""
    return None if request.param == "primitives" else cpu_kernels()


def run(tp: int, fn: str, logits: np.ndarray, *args, candidates: int = 64, logprobs: int = 0, kernels=None,
        passes=(True, True), masked=False):
    key = (tp, fn, candidates, logprobs, kernels, passes, masked)
    if key not in _COMPILED:
        cell = VocabSampler(V, TPInfo(0, tp), candidates, logprobs, simulate_ranks=True, kernels=kernels,
                            mass_pass=passes[0], draw_pass=passes[1], masked=masked)
        _COMPILED[key] = ms.jit(getattr(cell, fn))
    out = _COMPILED[key](shards(logits, tp), *(ms.Tensor(a) for a in args))
    return tuple(o.asnumpy() for o in out) if isinstance(out, tuple) else out.asnumpy()


def split(out, K: int = 3):
    """`sample`'s (tokens, figures) -> tokens, chosen log-probabilities, top-K ones, their ids."""
    tokens, figures = out
    return tokens, figures[:, 0], figures[:, 1: 1 + K], figures[:, 1 + K:].astype(np.int32)


def log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


def draw_args(params: list[SamplingParams], seeds) -> tuple:
    """The per-row arrays of `sample`, as ModelRunner.sample builds them."""
    f32 = np.float32
    return (np.array([p.temperature for p in params], f32), np.array([p.top_k for p in params], np.int32),
            np.array([p.top_p for p in params], f32), np.array([p.min_p for p in params], f32),
            uniforms(np.asarray(seeds), np.zeros(len(params)), np.zeros(len(params))).astype(f32))


def test_greedy_full_rows_and_scores_are_those_of_the_whole_vocabulary_at_any_tp(kernels):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (6, V)).astype(np.float32)
    logits[0, [10, 60, 90]] = 9.0                    # a tie across shards: the lowest id wins, as argmax
    logits[1, 102] = 9.0                             # the last token, next to the padding columns
    targets = np.array([60, 102, 50, 0, 3, 99], np.int32)
    want_lp = log_softmax(logits)[np.arange(6), targets]
    # vLLM's rank: the tokens whose logit is at least the target's (row 0's target ties two others
    # in three shards at tp 3; row 1's is the most likely, beside the padding columns)
    want_rank = (logits >= logits[np.arange(6), targets][:, None]).sum(-1)
    assert want_rank[0] == 3 and want_rank[1] == 1 and want_rank[2:].min() > 1
    for tp in (1, 3):
        greedy = run(tp, "greedy", logits, kernels=kernels)
        assert greedy.tolist() == logits.argmax(-1).tolist() and greedy[0] == 10
        np.testing.assert_array_equal(run(tp, "full", logits), logits)
        scored = run(tp, "score", logits, targets, kernels=kernels)
        np.testing.assert_allclose(scored[:, 0], want_lp, atol=1e-5)
        np.testing.assert_array_equal(run(tp, "logprob", logits, targets, kernels=kernels), scored[:, 0])
        assert scored[:, 1].tolist() == want_rank.tolist()


ROWS = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.5, top_k=20, top_p=0.6, min_p=0.02)]


def test_tokens_and_logprobs_are_the_same_at_any_tp_and_on_either_path():
    """240 rows of every kind of sampling: the same tokens and top ids at tp 1 and 3 with the CPU
    kernels (at tp 1 one kernel call, SampleRows) and with the primitives; greedy tokens and
    log-probabilities those of the whole rows, also from `greedy_logprobs`."""
    rng = np.random.default_rng(1)
    n = 240
    logits = rng.normal(0, 2, (n, V)).astype(np.float32)
    params = [ROWS[i % len(ROWS)] for i in range(n)]
    args = draw_args(params, np.arange(n))
    kernels = cpu_kernels()
    got = {(tp, k): split(run(tp, "sample", logits, *args, logprobs=3, kernels=k))
           for tp in (1, 3) for k in (None, kernels)}
    tokens, chosen, top, ids = got[1, kernels]
    for other in got.values():
        np.testing.assert_array_equal(other[0], tokens)
        np.testing.assert_array_equal(other[3], ids)
        np.testing.assert_allclose(other[1], chosen, atol=1e-5)
    lp = log_softmax(logits)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    np.testing.assert_array_equal(tokens[greedy], logits[greedy].argmax(-1))
    np.testing.assert_allclose(chosen, lp[np.arange(n), tokens], atol=1e-5)
    np.testing.assert_array_equal(ids, np.argsort(-lp, -1, kind="stable")[:, :3])
    np.testing.assert_allclose(top, np.take_along_axis(lp, ids, -1), atol=1e-5)
    for tp, k in ((1, kernels), (3, None)):
        g_tokens, g_chosen, g_top, g_ids = split(run(tp, "greedy_logprobs", logits, candidates=3, logprobs=3,
                                                     kernels=k))
        np.testing.assert_array_equal(g_tokens, logits.argmax(-1))
        np.testing.assert_allclose(g_chosen, lp.max(-1), atol=1e-5)
        np.testing.assert_array_equal(g_ids, ids)
        np.testing.assert_allclose(g_top, top, atol=1e-5)


def test_a_rows_token_does_not_depend_on_the_passes_its_step_runs():
    """The host compiles `sample` without the pass over the rows for min_p alone, or without the
    draw over the whole vocabulary, when no row of the step needs it: the rows that do not need
    them draw the same tokens in either variant, at tp 3 on either path (at tp 1 the CPU kernels
    run one call, SampleRows, whatever the variant; the primitives the same code as at tp 3)."""
    rng = np.random.default_rng(3)
    n = 60
    logits = rng.normal(0, 2, (n, V)).astype(np.float32)
    kinds = {(False, False): [ROWS[0], ROWS[2], ROWS[3], ROWS[5]],      # greedy, top_k, top_p, all of them
             (False, True): [ROWS[1], ROWS[2], ROWS[3]],                 # temperature alone: the whole vocabulary
             (True, False): [dataclasses.replace(ROWS[4], top_p=0.9), ROWS[3]]}   # min_p alone, with top_p
    for passes, kinds_ in kinds.items():
        params = [kinds_[i % len(kinds_)] for i in range(n)]
        args = draw_args(params, np.arange(n) + 7)
        for k in (None, cpu_kernels()):
            want = split(run(3, "sample", logits, *args, logprobs=3, kernels=k))
            got = split(run(3, "sample", logits, *args, logprobs=3, kernels=k, passes=passes))
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_allclose(got[1], want[1], atol=1e-6)


def test_draws_follow_the_filtered_softmax_and_equal_the_host_samplers():
    """Many draws of one row (one uniform each) per kind of sampling, at tp 2 with the CPU kernels
    (the primitives draw the same tokens, above): the frequencies of the filtered,
    temperature-scaled softmax (worker.sampler.filter_logits, which sorts nothing away) within 4
    standard errors, and the host sampler's token for every uniform (a sequence may move between
    the two)."""
    row = np.random.default_rng(2).normal(0, 1.5, V).astype(np.float32)
    n = 4000
    params = [p for p in ROWS[1:] for _ in range(n)]
    args = draw_args(params, np.arange(len(params)))
    tokens = run(2, "sample", np.repeat(row[None], len(params), 0), *args, kernels=cpu_kernels())
    for k, p in enumerate(ROWS[1:]):
        got = tokens[k * n: (k + 1) * n]
        x = sampler.filter_logits(row.astype(np.float64), p)
        want = np.exp(x - x.max())
        want /= want.sum()
        freq = np.bincount(got, minlength=V) / n
        assert np.all(freq[want == 0] == 0), p
        assert np.abs(freq - want).max() < 4 * np.sqrt(want * (1 - want) / n).max() + 1e-3, p
        host = [sampler.sample_row(row, p, 0, float(u)) for u in args[4][k * n: (k + 1) * n]]
        assert host == got.tolist(), p


def test_top_p_beyond_the_candidates_keeps_the_candidates(kernels):
    """A flat distribution whose C candidates hold less than top_p: the kept set is those C
    tokens (the documented difference from sorting the whole row), drawn by their weights."""
    row = np.linspace(0.0, 0.3, V).astype(np.float32)      # the 8 largest hold under 10%
    p = SamplingParams(temperature=1.0, top_p=0.5)
    n = 2000
    tokens = run(1, "sample", np.repeat(row[None], n, 0), *draw_args([p] * n, np.arange(n)), candidates=8,
                 kernels=kernels)
    assert set(tokens.tolist()) == set(range(V - 8, V))


def test_uniforms_are_uniform_and_differ_by_seed_token_and_sample():
    seeds = np.repeat(np.arange(100), 100)
    counters = np.tile(np.arange(100), 100)
    u = uniforms(seeds, counters, np.zeros(10000))
    assert ((0 <= u) & (u < 1)).all() and len(np.unique(u)) == 10000
    counts = np.bincount((u * 10).astype(int), minlength=10)
    assert np.abs(counts - 1000).max() < 4 * np.sqrt(1000 * 0.9)
    assert uniforms(np.array([5]), np.array([3]), np.array([1]))[0] != uniforms(np.array([5]), np.array([3]),
                                                                               np.array([0]))[0]
    np.testing.assert_array_equal(uniforms(seeds, counters, np.zeros(10000)), u)


def test_small_and_zero_inputs_give_uniform_draws_not_a_fixed_point():
    """Every combination of small stream keys, steps and sample indices, (0, 0, 0) among them (the
    first draw of stream 0): none is 0, and together they pass a Kolmogorov-Smirnov test against
    U(0, 1). A finalizer without added constants maps (0, 0, 0) to 0, the first candidate."""
    from scipy import stats
    grid = np.stack(np.meshgrid(np.arange(64), np.arange(32), np.arange(4), indexing="ij"), -1).reshape(-1, 3)
    u = uniforms(grid[:, 0], grid[:, 1], grid[:, 2])
    assert (u > 0).all() and uniforms(np.zeros(1), np.zeros(1), np.zeros(1))[0] > 1e-6
    assert stats.kstest(u, "uniform").pvalue > 1e-3


def test_stream_keys_are_per_record_unless_the_record_sets_its_seed():
    keys = {sampler.draw_key(0, f"r{i}") for i in range(1000)}
    assert len(keys) == 1000 and all(0 <= k < 1 << 63 for k in keys)
    assert sampler.draw_key(0, "a") != sampler.draw_key(1, "a")
    assert sampler.draw_key(7) == sampler.draw_key(7) != sampler.draw_key(8)
    assert sampler.draw_key(7) != sampler.draw_key(7, "")         # a record's own seed is its own stream
    # BLAKE2b of the documented bytes: the same key on every machine and Python version, so a
    # resume elsewhere draws the same tokens (Python's own hash() of a str is salted per process)
    assert sampler.draw_key(3, "q1") == 0x6C91D7AD86579E20 and sampler.draw_key(3) == 0x6760457A16F89D0A


DEVICE_PATHS = ["portable", "ascend (emulated)", "cpu"]


def device_kernels(path: str):
    """The sampler's passes over whole rows as each device path runs them: its ops class's
    `sampler_kernels` (worker/ops.py seam)."""
    if path == "cpu":
        return cpu_kernels()
    if path == "portable":
        from msinfer.worker.ops import MsOps
        return MsOps.sampler_kernels
    from msinfer.worker.ascend import AscendOps
    return AscendOps.sampler_kernels


def chi_square_pvalue(tokens: np.ndarray, want: np.ndarray) -> float:
    """Pearson's chi-square of the token counts against the probabilities `want`, tokens expected
    fewer than 5 times pooled into one bin."""
    from scipy import stats
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(want)).astype(np.float64)
    big = want * n >= 5
    obs, exp = list(counts[big]), list(want[big] * n)
    if (~big).any() and want[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(want[~big].sum() * n)
    if len(obs) == 1:                   # one bin: every draw in it is the only outcome
        return 1.0 if obs[0] == n else 0.0
    return stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("path", DEVICE_PATHS)
@pytest.mark.parametrize("tp", [1, 2])
def test_first_draws_of_a_jobs_records_follow_the_filtered_softmax(path, tp):
    """The first token of 3,000 records with one prompt, at the job's default seed 0 (each
    record's stream: draw_key(0, its id), step 0, sample 0), for each kind of sampling: a
    chi-square test against softmax(logits / T) renormalized over the tokens min_p, top_k and
    top_p keep (worker.sampler.filter_logits), and nothing drawn outside them."""
    row = np.random.default_rng(5).normal(0, 1.5, V).astype(np.float32)
    n = 3000
    keys = np.array([sampler.draw_key(0, f"record-{i}") for i in range(n)], np.int64)
    # each keeps 5 to 43 tokens: within the candidates at tp 2 (C is at most a shard's 52 columns
    # here; top_p beyond the candidates is the documented difference, tested above)
    kinds = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
             SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.1),
             SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)]
    params = [p for p in kinds for _ in range(n)]
    f32 = np.float32
    args = (np.array([p.temperature for p in params], f32), np.array([p.top_k for p in params], np.int32),
            np.array([p.top_p for p in params], f32), np.array([p.min_p for p in params], f32),
            np.tile(uniforms(keys, np.zeros(n), np.zeros(n)), len(kinds)).astype(f32))
    tokens = run(tp, "sample", np.repeat(row[None], len(params), 0), *args, kernels=device_kernels(path))
    for k, p in enumerate(kinds):
        got = tokens[k * n: (k + 1) * n]
        x = sampler.filter_logits(row.astype(np.float64), p)
        want = np.exp(x - x.max())
        want /= want.sum()
        assert np.all(want[got] > 0) and (want > 0).sum() >= 3, p
        assert chi_square_pvalue(got, want) > 1e-3, p


class FixedMask:
    """A grammar's matcher as worker.sampler.History reads it (llguidance.LLMatcher's calls),
    allowing the same tokens at every step."""

    def __init__(self, allowed: np.ndarray):
        self.bits = np.packbits(allowed, bitorder="little").tobytes()

    def consume_tokens(self, tokens):
        pass

    def is_error(self) -> bool:
        return False

    def compute_bitmask(self) -> bytes:
        return self.bits


def test_changed_logits_on_the_device_sample_what_the_host_reference_samples(kernels):
    """Penalties, logit_bias, bad words, min_tokens, allowed_token_ids and a token mask applied by
    `process` on each shard (tp 1 and 3): the logits of worker.sampler.Adjustments.apply, and the
    host sampler's token for every row's uniform, greedy and sampled."""
    rng = np.random.default_rng(4)
    n = 24
    logits = rng.normal(0, 2, (n, V)).astype(np.float32)
    kinds = [SamplingParams(repetition_penalty=1.3), SamplingParams(temperature=0.9, frequency_penalty=0.4,
                                                                    presence_penalty=0.2),
             SamplingParams(temperature=1.0, top_k=10, logit_bias=((3, 5.0), (50, -2.0), (102, 8.0))),
             SamplingParams(temperature=0.8, top_p=0.9, allowed_token_ids=(1, 7, 40, 41, 99)),
             SamplingParams(min_tokens=3, min_tokens_ban=(0, 60), bad_words_ids=((5,), (9, 11))),
             SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=0.8, logit_bias=((11, 1.5),))]
    params = [kinds[i % len(kinds)] for i in range(n)]
    hists = [sampler.History(rng.integers(0, V, 6).tolist(), rng.integers(0, V, 4).tolist() + [9],
                             FixedMask(rng.random(V) < 0.5) if i % 5 == 0 else None) for i in range(n)]
    adjustments = {i: sampler.Adjustments(p, 1, h, V) for i, (p, h) in enumerate(zip(params, hists))}
    want = np.stack([adjustments[i].apply(logits[i].astype(np.float64)) for i in range(n)])
    entries, mask, _ = process_inputs(adjustments, n, V, static=kernels is not None)
    u = draw_args(params, np.arange(n))[4]
    host = [sampler.sample_row(want[i], SamplingParams(**{f: getattr(p, f) for f in ("temperature", "top_k", "top_p",
                                                                                        "min_p")}), 0, float(u[i]))
            for i, p in enumerate(params)]
    for tp in (1, 3):
        got = run(tp, "process", logits, entries, mask, kernels=kernels, masked=True)
        got = np.concatenate(list(got), -1)[:, :V] if got.ndim == 3 else got[:, :V]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
        assert np.array_equal(np.isinf(got), np.isinf(want))
        tokens = run(tp, "sample", got, *draw_args(params, np.arange(n)), kernels=kernels)
        assert tokens.tolist() == host
