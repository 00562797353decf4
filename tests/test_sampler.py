"""The sampler's logits processing (worker/sampler.py) against vLLM's definitions written out
token by token, and its draws against the distribution they define. No MindSpore."""

from __future__ import annotations

import math

import numpy as np
import pytest

from msinfer.worker import sampler
from msinfer.worker.device_sampler import uniforms
from msinfer.worker.protocol import SamplingParams

V = 40


def u(seed: int, num_generated: int = 0) -> float:
    """The uniform of a sequence's draw (as the runner gives the sampler)."""
    return float(uniforms(np.array([seed]), np.array([num_generated]), np.array([0]))[0])


def reference(logits, p: SamplingParams, prompt, out, num_generated):
    """vLLM's order and formulas, one token at a time."""
    x = [float(v) for v in logits]
    if p.allowed_token_ids:
        x = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    for word in p.bad_words_ids:
        if len(word) == 1 or list(out[len(out) - len(word) + 1:]) == list(word[:-1]) and len(out) >= len(word) - 1:
            x[word[-1]] = -math.inf
    if num_generated < p.min_tokens:
        for t in p.min_tokens_ban:
            x[t] = -math.inf
    for t, b in p.logit_bias:
        x[t] += b
    for t in range(V):
        if t in prompt or t in out:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        count = out.count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return np.array(x)


CASES = {
    "penalties": SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4),
    "bias and allowed": SamplingParams(logit_bias=((3, 5.0), (7, -100.0), (9, 0.25)), allowed_token_ids=(3, 7, 9, 30)),
    "bad words": SamplingParams(bad_words_ids=((5,), (11, 12), (13, 14, 15), (20, 21))),
    "min tokens": SamplingParams(min_tokens=4, min_tokens_ban=(2, 6)),
    "everything": SamplingParams(repetition_penalty=0.8, frequency_penalty=1.5, logit_bias=((12, 2.0),),
                                 bad_words_ids=((14, 15),), min_tokens=9, min_tokens_ban=(1,)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_processing_matches_vllms_definitions(name):
    rng = np.random.default_rng(0)
    p = CASES[name]
    prompt = [int(t) for t in rng.integers(0, V, 12)]
    out = [11, 13, 14, 4, 4, 20, 8, 13, 14]            # ends in the first tokens of two bad words
    for n_out in (0, 1, 3, len(out)):
        logits = rng.normal(0, 3, V).astype(np.float32)
        hist = sampler.History(prompt, out[:n_out])
        got = sampler.process(logits, p, n_out, hist if p.looks_back else None)
        want = reference(logits, p, prompt if p.looks_back else [], out[:n_out] if p.looks_back else [], n_out)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert p.processes


def test_bad_words_without_history_still_ban_single_tokens_and_multi_token_words_need_it():
    assert not SamplingParams(bad_words_ids=((5,),)).looks_back
    assert SamplingParams(bad_words_ids=((5, 6),)).looks_back


def test_greedy_takes_the_argmax_of_the_processed_logits():
    logits = np.zeros((1, V), np.float32)
    logits[0, 7] = 3.0
    p = SamplingParams(logit_bias=((8, 3.5),))
    assert sampler.sample(logits, [p], [0], [0.5]) == [8]
    assert sampler.sample(logits, [SamplingParams()], [0], [0.5]) == [7]
    banned = SamplingParams(min_tokens=2, min_tokens_ban=(7,))
    assert sampler.sample(logits, [banned], [1], [0.5]) != [7] and sampler.sample(logits, [banned], [2], [0.5]) == [7]


def test_min_p_keeps_the_tokens_within_a_share_of_the_most_likely_and_draws_by_their_weights():
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04] + [0.0] * (V - 6)) + 1e-12
    logits = np.log(probs / probs.sum()).astype(np.float32)
    p = SamplingParams(temperature=1.0, min_p=0.3)                  # keeps p >= 0.12: tokens 0, 1, 2
    draws = np.array([sampler.sample_row(logits, p, 0, u(s)) for s in range(3000)])
    assert set(draws) == {0, 1, 2}
    want = probs[:3] / probs[:3].sum()
    got = np.bincount(draws, minlength=3)[:3] / len(draws)
    assert np.abs(got - want).max() < 4 * np.sqrt(want * (1 - want) / len(draws)).max()


def test_draws_follow_the_penalized_distribution():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1, V).astype(np.float32)
    p = SamplingParams(temperature=0.7, presence_penalty=1.0, frequency_penalty=0.5)
    hist = sampler.History([1, 2], [3, 3, 4])
    x = sampler.process(logits, p, 3, hist) / 0.7
    want = np.exp(x - x.max())
    want /= want.sum()
    draws = np.array([sampler.sample_row(logits, p, 3, u(s, 3), hist) for s in range(4000)])
    got = np.bincount(draws, minlength=V) / len(draws)
    assert np.abs(got - want).max() < 4 * np.sqrt(want * (1 - want) / len(draws)).max() + 1e-3


def test_top_p_keeps_the_set_a_full_sort_keeps_ties_included():
    """The candidate search (worker.sampler.top_p_mask) against sorting the whole row."""
    rng = np.random.default_rng(5)
    for trial in range(200):
        n = int(rng.choice([7, 300, 5000]))
        x = rng.normal(0, float(rng.choice([0.3, 1.0, 4.0])), n)
        if trial % 3 == 0:
            x = np.round(x, 1)                                  # many ties
        top_p = float(rng.choice([0.05, 0.5, 0.9, 0.999]))
        order = np.argsort(-x, kind="stable")
        probs = np.exp(x[order] - x[order[0]])
        probs /= probs.sum()
        want = np.zeros(n, bool)
        want[order[np.cumsum(probs) - probs < top_p]] = True
        got = x.copy()
        sampler.top_p_mask(got, top_p)
        assert np.array_equal(np.isfinite(got), want), trial
