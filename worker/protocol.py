"""What crosses the wire between the controller (launcher) and the workers: plain dataclasses of
ints, floats and lists, no tensors. Imported on both sides; no MindSpore here.

A step is a list of `SeqStep`s. Each names the new tokens of one sequence and how many of its
tokens the cache already holds; the worker derives every position and index from that.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1                        # samples of the record (launcher.records; the workers see one sequence each)
    index: int = 0                    # which of them: with the seed, picks the random stream
    max_new_tokens: int = 256
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = whole vocabulary
    seed: int = 0
    stop: tuple[str, ...] = ()        # stop strings (matched by the controller on decoded text)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0                 # top-k log-probabilities per generated token (0: none)

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
    num_generated: int = 0            # tokens sampled so far: with the seed, fixes the random stream
    sample: bool = True               # False for a prefill chunk that is not the prompt's last
    # scoring: per token of token_ids, the next token whose log-probability to return (-1: none)
    targets: list[int] | None = None


@dataclass
class StepOutput:
    token_ids: list[int]              # one sampled token per SeqStep (-1 where sample=False)
    logprobs: list | None = None      # per SeqStep: (chosen logprob, [(token, logprob), ...]) or None
    scores: list | None = None        # per SeqStep: log-probabilities of its targets >= 0, or None
    worker_s: float = 0.0             # the step on rank 0, from its call to its return
    model_s: float = 0.0              # of which in the compiled network (to its logits in numpy)


def pack_step(seqs: list[SeqStep]) -> bytes:
    """A step's SeqSteps as they cross the wire: one pickle (protocol 5), from and to msinfer's
    own processes only."""
    return pickle.dumps(seqs, protocol=5)


def unpack_step(payload: bytes) -> list[SeqStep]:
    return pickle.loads(payload)
