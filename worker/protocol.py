"""What crosses the wire between the controller (launcher) and the workers: plain dataclasses of
ints, floats and lists, no tensors. Imported on both sides; no MindSpore here.

A step is a list of `SeqStep`s. Each names the new tokens of one sequence and how many of its
tokens the cache already holds; the worker derives every position and index from that. A decode
step crosses the wire as a `DecodeStep` instead, columns of what changes from one step to the
next: each rank keeps every sequence's last SeqStep (`StepReader`) and completes it from there.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1                        # samples of the record (launcher.records; the workers see one sequence each)
    index: int = 0                    # which of them: with `draw_key`, picks its draws
    max_new_tokens: int = 256
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = whole vocabulary
    min_p: float = 0.0
    seed: int = 0                     # the job's sampling.seed, or the record's own (`draw_key`)
    stop: tuple[str, ...] = ()        # stop strings (matched by the controller on decoded text)
    include_stop_str_in_output: bool = False    # the text keeps the stop string it was cut at
    skip_special_tokens: bool = True  # the text leaves the tokenizer's special tokens out (the controller decodes)
    truncate_prompt_tokens: int | None = None   # the prompt's last k tokens only (-1: max_model_len - 1); the controller's
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0                 # top-k log-probabilities per generated token (0: none)
    prompt_logprobs: int | None = None  # 0: the log-probability of each prompt token (the scheduler's targets)
    min_tokens: int = 0               # no end-of-sequence or stop (token or string) before this many tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()     # (token id, added to its logit)
    allowed_token_ids: tuple[int, ...] = ()            # () = every token
    bad_words: tuple[str, ...] = ()
    structured: str = ""              # structured outputs: an llguidance grammar (launcher.spec.StructuredSpec)
    # the grammar applies after this token (a reasoning model's </think>, output.reasoning_parser):
    # the thinking before it is free; -1: from the first token
    structured_after: int = -1
    # filled in by the engine (launcher.records): the bad words' token ids, and the token ids that
    # min_tokens holds back (the end-of-sequence ones and stop_token_ids)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens_ban: tuple[int, ...] = ()
    # the key of the record's random stream (worker.sampler.draw_key): from the seed and the
    # record's id, or from the record's own seed alone; with `index` and the step, it fixes each draw
    draw_key: int = 0
    # task embed or classify (launcher.records): how the prompt's final hidden states pool, "last" |
    # "mean" | "cls" (worker.runner.forward_pooled); None: the sequence generates or scores
    pooling: str | None = None

    # derived once (the sampler reads them for every sequence of every step): whether sampling
    # reads the sequence's earlier tokens (worker.sampler.History), and whether the logits change
    # before sampling (worker.sampler.Adjustments, which the device sampler's `process` applies)
    looks_back: bool = field(init=False, repr=False, compare=False)
    processes: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        looks_back = (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                      or any(len(w) > 1 for w in self.bad_words_ids) or bool(self.structured))
        object.__setattr__(self, "looks_back", looks_back)
        object.__setattr__(self, "processes", bool(
            looks_back or self.allowed_token_ids or self.bad_words_ids or self.logit_bias
            or (self.min_tokens and self.min_tokens_ban)))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


# As a decode's one token: the token the worker sampled for this sequence in the step before
# (async scheduling: the controller schedules a step before it has the results of the one in flight).
SAMPLED = -1


@dataclass
class SeqStep:
    seq_id: int
    token_ids: list[int]              # the tokens this step feeds (a prompt chunk, or one token, or [SAMPLED])
    num_cached: int                   # tokens of this sequence already in the KV cache
    block_table: list[int]            # cache blocks of the sequence, in order
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_generated: int = 0            # tokens sampled so far: with the stream and index, fixes the draw
    sample: bool = True               # False for a prefill chunk that is not the prompt's last
    # scoring: per token of token_ids, the next token whose log-probability to return (-1: none)
    targets: list[int] | None = None
    # with the first step of each admission of a sequence whose sampling looks back: its prompt
    # and its output so far (the worker keeps them, and appends what it samples, until released)
    history: tuple[list[int], list[int]] | None = None

    def __reduce__(self):
        # pickled as its field values in order, not as a dict of names: every step carries one
        # per sequence (256 a decode step: 0.29 -> 0.25 ms to pickle, 0.38 -> 0.18 ms to load on
        # each rank, 35% fewer bytes, measured here)
        return SeqStep, (self.seq_id, self.token_ids, self.num_cached, self.block_table, self.sampling,
                         self.num_generated, self.sample, self.targets, self.history)


@dataclass
class StepOutput:
    token_ids: list[int]              # one sampled token per SeqStep (-1 where sample=False)
    logprobs: list | None = None      # per SeqStep: (chosen logprob, [(token, logprob), ...]) or None
    scores: list | None = None        # per SeqStep: (log-probability, rank) of its targets >= 0, or None
    worker_s: float = 0.0             # the step on rank 0, from its call to its return
    model_s: float = 0.0              # of which on the device: the network and the sampler, to their outputs in numpy
    host_bytes: int = 0               # copied from the device to the host in the step, on rank 0
    # pipeline parallel: a stage but the last returns its hidden states ([tokens, hidden] float32,
    # the step's tokens in order) for the next stage instead of tokens; the last stage returns the
    # tokens it sampled by sequence (seq_id -> token) as well, for the first stage's SAMPLED
    hidden: np.ndarray | None = None
    sampled: dict | None = None


@dataclass
class DecodeStep:
    """A decode step as the engine sends it: one token for each sequence, as columns. What each
    sequence's SeqStep would repeat from its last step (its sampling, and its block table unless
    a block was added) the ranks keep; building and pickling a SeqStep per sequence cost the
    engine most of its time at a 256-sequence step."""
    seq_ids: list[int]
    token_ids: list[int]              # the one token each feeds (SAMPLED: the one its last step sampled)
    num_cached: list[int]
    num_generated: list[int]
    tables: dict[int, list[int]]      # seq_id -> its whole block table, for each whose table grew since
                                      # the last step that carried it

    def __len__(self) -> int:
        return len(self.seq_ids)


@dataclass
class DecodeChain:
    """Decode steps the engine scheduled back to back and sends as one call (scheduler.decode_steps):
    each step after the first feeds the tokens the step before it picks (SAMPLED). The rank runs a
    run of them with the same sequences, each of which `chains`, as one compiled call
    (worker.runner.ModelRunner.chain), and any other step alone; it answers a StepOutput a step.
    `one_by_one`: every step alone (the engine's steps of a chain cut short: one call, so that no
    more calls are in flight than async scheduling's two, which the ranks' threads serve)."""
    steps: list[DecodeStep]
    one_by_one: bool = False

    def __len__(self) -> int:
        return len(self.steps)


def chains(sampling: SamplingParams, draws: bool) -> bool:
    """Whether a sequence's decode steps may go in a DecodeChain: nothing changes its logits
    (penalties, biases, bans, a grammar) and no log-probabilities, so that each step's token is
    what the device picks from the network's logits, which the chain feeds the next step there;
    greedy, or drawing where `draws` (the engine: tp 1; a rank: worker.runner.ModelRunner.samples_in_chains)."""
    return not sampling.processes and not sampling.logprobs and (sampling.greedy or draws)


class StepReader:
    """A rank's side of the wire: a step as the runner takes it, a list of SeqSteps. It keeps each
    sequence's last SeqStep until the engine releases the sequence (it finished, or was preempted
    and is admitted again with a prefill), to complete a DecodeStep's rows from. Steps are read in
    the order the engine scheduled them."""

    def __init__(self):
        self.last: dict[int, SeqStep] = {}

    def read(self, step: list[SeqStep] | DecodeStep, released=()) -> list[SeqStep]:
        last = self.last
        for seq_id in released:
            last.pop(seq_id, None)
        if not isinstance(step, DecodeStep):
            for s in step:
                last[s.seq_id] = s
            return step
        seqs, tables = [], step.tables
        for seq_id, token, cached, generated in zip(step.seq_ids, step.token_ids, step.num_cached,
                                                    step.num_generated):
            before = last.get(seq_id)
            if before is None:
                raise ValueError(f"sequence {seq_id}: a decode step names it, but no step since its "
                                 f"admission did (or it was released)")
            s = SeqStep(seq_id, [token], cached, tables.get(seq_id, before.block_table), before.sampling, generated)
            last[seq_id] = s
            seqs.append(s)
        return seqs


def pack_step(step: list[SeqStep] | DecodeStep, released: list[int] = ()) -> bytes:
    """A step as it crosses the wire, and the ids of the sequences the workers may forget (their
    last step, their sampling history): one pickle (protocol 5), from and to msinfer's own
    processes only."""
    return pickle.dumps((step, list(released)), protocol=5)


def unpack_step(payload: bytes) -> tuple[list[SeqStep] | DecodeStep, list[int]]:
    return pickle.loads(payload)


def one_by_one(step, chain: DecodeChain, logprobs: bool, released=()) -> list:
    """A DecodeChain's steps run one at a time by a runner's `step` (a StepOutput each), where they
    cannot run as one call; the sequences released go with the first."""
    return [step(st, False, logprobs, released if k == 0 else ()) for k, st in enumerate(chain.steps)]
