"""What sampling does to a row of logits, in numpy on the host: the changes some parameters make
first (`Adjustments`, which the device sampler applies, worker.device_sampler.VocabSampler.process),
and the filters and the draw that the device sampler computes shard by shard (`sample_row`: the
reference its tests hold it to, in float64 over the whole row).

A row's logits go through, in vLLM's order: the structured-output grammar's token mask
(llguidance, from the tokens so far), allowed_token_ids (everything else masked),
bad_words (a word's last token masked where the tokens before it end the output), min_tokens
(the end-of-sequence and stop token ids masked until that many tokens are out), logit_bias, and
the penalties: repetition (a logit of a token in the prompt or the output divided by it when
positive, multiplied when negative), frequency (minus the penalty times the token's count in
the output) and presence (minus the penalty once for a token in the output). Greedy takes the
argmax of that; otherwise temperature, min_p (tokens below min_p times the most likely one's
probability dropped), top-k and top-p, and a draw.

The draw takes the sequence's uniform u of this step (worker.device_sampler.uniforms, from its
record's stream key, its count of generated tokens and its sample index) through the inverse CDF
of the kept tokens in token-id order, as the device sampler does.
"""

from __future__ import annotations

import hashlib

import numpy as np

from msinfer.worker.protocol import SamplingParams


class History:
    """What a sequence's penalties, bad words and grammar look back at, kept by the worker
    between steps: the distinct tokens of its prompt and output (`seen`, sorted: repetition_penalty's
    tokens), its output tokens, and its grammar's matcher (llguidance.LLMatcher) fed those tokens.
    `add` takes each token sampled here, so no step sorts the prompt again. With a `gate` token
    (SamplingParams.structured_after: the end of a reasoning model's thinking) the grammar starts
    after the first one in the output: the tokens up to it are free, the matcher is fed the rest."""

    __slots__ = ("seen", "out", "matcher", "gate")

    def __init__(self, prompt: list[int], out: list[int], matcher=None, gate: int = -1):
        self.seen = np.unique(np.asarray(list(prompt) + list(out), np.int64))
        self.out = list(out)
        self.matcher = matcher
        self.gate = gate
        if gate >= 0 and gate in out:
            self.gate, out = -1, out[out.index(gate) + 1:]
        if matcher is not None and out and self.gate < 0:
            matcher.consume_tokens(list(out))

    @property
    def active(self):
        """The matcher that constrains the next token: None without a grammar, before its gate,
        or in error (which then constrains nothing)."""
        if self.matcher is None or self.gate >= 0 or self.matcher.is_error():
            return None
        return self.matcher

    def add(self, token: int) -> None:
        self.out.append(token)
        self.seen = insert_sorted(self.seen, np.array([token], np.int64))
        if self.gate >= 0:
            if token == self.gate:
                self.gate = -1
        elif self.matcher is not None and not self.matcher.is_error():
            self.matcher.consume_token(token)

    def allowed(self, vocab: int) -> np.ndarray | None:
        """The tokens the grammar allows next, as a bool mask over the vocabulary (None: no
        grammar, before its gate, or a matcher in error)."""
        if self.active is None:
            return None
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        mask = np.zeros(vocab, bool)
        n = min(vocab, len(bits))
        mask[:n] = bits[:n].astype(bool)
        return mask


class Adjustments:
    """What `process` does to one row, as data: `allowed` (a bool mask over the vocabulary of
    the grammar's and allowed_token_ids' tokens, or None: all), and per token in `ids` (sorted,
    int64) x -> rep(x + add) + sub, where rep(v) = v / r if v > 0 else v * r: bans are an add of
    -inf, logit_bias an add, repetition_penalty r, frequency and presence penalties in sub. The
    device sampler applies the same (worker.device_sampler.VocabSampler.process)."""

    __slots__ = ("allowed", "ids", "add", "r", "sub")

    def __init__(self, p: SamplingParams, num_generated: int, hist: History | None, vocab: int,
                 grammar: bool = True):
        self.allowed = None
        if grammar and hist is not None and hist.active is not None:      # (grammar=False: the caller's)
            self.allowed = hist.allowed(vocab)
        if p.allowed_token_ids:
            keep = np.zeros(vocab, bool)
            keep[np.asarray(p.allowed_token_ids, np.int64)] = True
            self.allowed = keep if self.allowed is None else self.allowed & keep
        add: dict[int, float] = {}                   # bans and logit_bias: a few tokens
        out = hist.out if hist is not None else []
        for word in p.bad_words_ids:
            k = len(word) - 1
            if k == 0 or (len(out) >= k and tuple(out[-k:]) == tuple(word[:-1])):
                add[word[-1]] = -np.inf
        if num_generated < p.min_tokens and p.min_tokens_ban:
            for t in p.min_tokens_ban:
                add[t] = -np.inf
        for t, b in p.logit_bias:
            add[t] = add.get(t, 0.0) + b
        rep = sub_ids = counts = None
        if hist is not None:
            if p.repetition_penalty != 1.0:
                rep = hist.seen
            if hist.out and (p.frequency_penalty or p.presence_penalty):
                sub_ids, counts = np.unique(np.asarray(hist.out, np.int64), return_counts=True)
        few = np.unique(np.fromiter(add.keys(), np.int64, len(add)))
        if rep is not None:             # the output's tokens are among the seen ones
            self.ids = insert_sorted(rep, few)
        else:
            self.ids = np.union1d(few, sub_ids) if sub_ids is not None else few
        self.add = np.zeros(len(self.ids))
        self.r = np.ones(len(self.ids))
        self.sub = np.zeros(len(self.ids))
        if add:
            self.add[np.searchsorted(self.ids, list(add.keys()))] = list(add.values())
        if rep is not None:
            self.r[np.searchsorted(self.ids, rep)] = p.repetition_penalty
        if sub_ids is not None:
            self.sub[np.searchsorted(self.ids, sub_ids)] = -(p.frequency_penalty * counts + p.presence_penalty)

    def apply(self, x: np.ndarray) -> np.ndarray:
        """x (float64, one row) changed in place, and returned."""
        if self.allowed is not None:
            x[~self.allowed] = -np.inf
        if len(self.ids):
            v = x[self.ids] + self.add
            x[self.ids] = np.where(v > 0, v / self.r, v * self.r) + self.sub
        return x


def process(logits: np.ndarray, p: SamplingParams, num_generated: int, hist: History | None) -> np.ndarray:
    """One row's logits (float64, a copy) after the grammar's mask, allowed_token_ids,
    bad_words, min_tokens, logit_bias and the penalties."""
    return Adjustments(p, num_generated, hist, len(logits)).apply(logits.astype(np.float64))


def draw_key(seed: int, record_id: str | None = None) -> int:
    """The key of a record's random stream, a 63-bit int: of (the job's sampling.seed, the record's
    id), so that records with the same prompt draw independently and a re-run or a resume draws
    the same tokens again; or, for a record that sets its own sampling.seed (`record_id` None), of
    that seed alone, as vLLM's per-request seed: the same seed and prompt give the same tokens in
    any record. BLAKE2b, so the key is the same on every machine and Python version."""
    h = hashlib.blake2b(digest_size=8, person=b"msinfer-stream")
    if record_id is None:
        h.update(b"own\0" + str(seed).encode())
    else:
        h.update(b"job\0" + str(seed).encode() + b"\0" + record_id.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little") >> 1


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of each uint64 of x (wrapping arithmetic): a well-spread hash of
    values that differ in a few bits (worker.device_sampler.uniforms' draws, the simulator's
    stand-in tokens)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def insert_sorted(ids: np.ndarray, new: np.ndarray) -> np.ndarray:
    """ids (sorted, distinct) with those of new (sorted, distinct) that it lacks, in order."""
    at = np.searchsorted(ids, new)
    has = (at < len(ids)) & (ids[np.minimum(at, len(ids) - 1)] == new) if len(ids) else np.zeros(len(new), bool)
    return np.insert(ids, at[~has], new[~has]) if (~has).any() else ids


def filter_logits(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature-scaled logits of one row with everything outside min_p, top-k and top-p set
    to -inf (x: float64, changed in place)."""
    x /= p.temperature
    if p.min_p > 0.0:
        # probabilities relative to the most likely token's: p_i / p_max = exp(x_i - x_max)
        x[np.exp(x - x.max()) < p.min_p] = -np.inf
    if 0 < p.top_k < x.shape[-1]:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x[x < kth] = -np.inf
    if p.top_p < 1.0:
        top_p_mask(x, p.top_p)
    return x


def top_p_mask(x: np.ndarray, top_p: float) -> None:
    """Sets to -inf every logit outside the smallest set of most likely tokens whose mass reaches
    top_p (the token that crosses it included; ties in index order). Sorts only the candidates at
    or above the k-th largest logit, k growing until their mass reaches top_p: the same set as
    sorting the whole row, which costs milliseconds at a vocabulary of 50,000 and more."""
    n = x.shape[-1]
    w = np.exp(x - x.max())
    total = w.sum()
    k = min(n, 64)
    while True:
        cand = np.flatnonzero(x >= np.partition(x, n - k)[n - k]) if k < n else np.arange(n)
        cand = cand[np.lexsort((cand, -x[cand]))]           # most likely first, ties by index
        probs = w[cand] / total
        mass = np.cumsum(probs)
        if mass[-1] >= top_p or k == n:
            break
        k = min(n, k * 8)
    keep = np.zeros(n, bool)
    keep[cand[mass - probs < top_p]] = True
    x[~keep] = -np.inf


def draw(weights: np.ndarray, u: float) -> int:
    """The token whose range of the cumulative weights (token-id order) holds u x their total."""
    cum = np.cumsum(weights)
    j = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return j if j < len(cum) and weights[j] > 0 else int(np.flatnonzero(weights)[-1])


def sample_row(logits: np.ndarray, p: SamplingParams, num_generated: int, u: float, hist: History | None = None) -> int:
    x = process(logits, p, num_generated, hist) if p.processes else logits.astype(np.float64)
    if p.greedy:
        return int(np.argmax(x))
    x = filter_logits(x, p)
    return draw(np.exp(x - x.max()), u)


def sample(logits: np.ndarray, params: list[SamplingParams], num_generated: list[int], u,
           histories: list[History | None] | None = None) -> list[int]:
    """Per row: its token, from its logits after `process` and the filters, and its uniform u."""
    histories = histories or [None] * len(params)
    return [sample_row(row, p, n, x, h) for row, p, n, x, h in zip(logits, params, num_generated, u, histories)]
