"""Token sampling on the host (numpy): greedy, temperature, top-k, top-p.

Each sequence draws from its own stream, `default_rng([seed, num_generated])` (sample i > 0 of a
record with n samples: `[seed, num_generated, i]`), so a seeded record samples the same tokens
whatever else shares its batch, and again after a replica restart.
"""

from __future__ import annotations

import numpy as np

from worker.protocol import SamplingParams


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def filter_logits(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature-scaled logits of one row with everything outside top-k / top-p set to -inf."""
    x = logits.astype(np.float64) / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x = np.where(x < kth, -np.inf, x)
    if p.top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        probs = np.exp(x[order] - x[order[0]])
        probs /= probs.sum()
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        keep = np.cumsum(probs) - probs < p.top_p
        x[order[~keep]] = -np.inf
    return x


def sample_row(logits: np.ndarray, p: SamplingParams, num_generated: int) -> int:
    if p.greedy:
        return int(np.argmax(logits))
    x = filter_logits(logits, p)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    rng = np.random.default_rng([p.seed & 0xFFFFFFFF, num_generated] + ([p.index] if p.index else []))
    return int(rng.choice(probs.shape[-1], p=probs))


def sample(logits: np.ndarray, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
    if all(p.greedy for p in params):
        return [int(t) for t in np.argmax(logits, -1)]
    return [sample_row(row, p, n) for row, p, n in zip(logits, params, num_generated)]


def top_logprobs(logits: np.ndarray, chosen: list[int], k: int) -> list:
    """Per row: (log-probability of the chosen token, [(token, logprob)] of the k most likely)."""
    lp = log_softmax(logits.astype(np.float64))
    out = []
    for row, tok in zip(lp, chosen):
        top = np.argsort(-row, kind="stable")[:k] if k else []
        out.append((float(row[tok]), [(int(t), float(row[t])) for t in top]))
    return out
