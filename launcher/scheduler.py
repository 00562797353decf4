"""Continuous batching: which sequences run in the next step, and what each one feeds.

A step is either a prefill (prompt chunks, several tokens per sequence) or a decode (one token per
running sequence). Prefill goes first: waiting sequences are admitted in FIFO order while the batch
size, the token budget and the free KV blocks allow. A prompt longer than the remaining budget is
cut into chunks; only the chunk that reaches its end samples a token, and until then it stays at
the head of the queue, so nothing overtakes it. When no prefill fits, every running sequence
decodes its last token; if the cache runs out, the most recently admitted one is preempted (its
blocks freed, its tokens kept) and later re-prefills prompt + generated tokens.

A prefill goes to the workers as a SeqStep per sequence, a decode as one DecodeStep (columns, and
only the block tables that grew: worker/protocol.py); the workers keep what a decode repeats
until `take_released` names the sequence.

Token accounting of a sequence: `num_cached` tokens have their K/V in the cache once the steps
run so far have run; steps in flight feed `num_scheduled` more and will sample `num_pending` more
tokens. Between steps a running sequence has `num_cached == num_tokens - 1` (its last sampled token
is fed next step).

Async scheduling (`schedule(ahead=True)`): while one step is in flight, the next one is scheduled
from what that step will leave behind, so that the workers start it the moment the first ends. A
sequence the step in flight samples for decodes `SAMPLED`, the token the worker sampled for it in
the previous step; a sequence that step is sure to finish (its last scored chunk, its last token
by length) is left out. One that will stop on eos or a stop string is not known yet: it decodes
once more and that token is dropped. A decode that would need a preemption waits for the step in
flight's results (the step goes without it).

Lengths: a sequence ends with "length" once it holds `max_model_len` tokens, where max_model_len is
also capped by the whole cache (num_blocks * block_size); a prompt must leave room for one
generated token, or it is rejected with finish_reason "error" (see `Scheduler.take_rejected`).

Scoring: a sequence with `num_score_tokens = n` holds prompt + continuation as its prompt. It is
prefilled like any other (in chunks if need be), each step asking for the log-probabilities of
the continuation tokens it can see (`SeqStep.targets`), samples nothing, and finishes with
"scored" at the end of its prefill. A sequence of task embed or classify (`sampling.pooling`) is prefilled
the same way, each step pooling the hidden states of the tokens it feeds, and finishes with
"pooled"; with mean or cls pooling it is fed whole, past any cached prefix.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque

from msinfer.worker.protocol import SAMPLED, DecodeStep, SamplingParams, SeqStep


def fits(num_tokens: int, scoring: bool, max_model_len: int) -> bool:
    """Whether a sequence of num_tokens prompt tokens fits within max_model_len: a scored one
    whole (prompt and continuation), a generated one with room for at least one new token."""
    return num_tokens <= max_model_len if scoring else num_tokens < max_model_len


DECODE = (1, True)         # a decode's entry in Sequence.in_flight: one token fed, one sampled


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], sampling: SamplingParams | None = None, key=None,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int = 0, seq_id: int | None = None):
        self.seq_id = next(Sequence._ids) if seq_id is None else seq_id
        self.key = key                                  # opaque to the scheduler (e.g. record id)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling or SamplingParams()
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len              # 0: the scheduler's; capped by it on add
        self.stop_ids: frozenset[int] = frozenset()     # set on add: the tokens that stop it (eos, stop_token_ids)
        self.token_limit = 0                            # and the tokens it ends at, by max_new_tokens or max_model_len
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached = 0
        self.block_keys: list = []                      # prefix caching: its full blocks' keys (BlockManager.keys)
        self.num_registered = 0                         # blocks of block_table the cache knows (or holds elsewhere)
        self.num_cached_tokens = 0                      # tokens found in the prefix cache when it was admitted
        self.on_workers = False                         # its workers keep its last step (worker.protocol.StepReader)
        self.history_sent = False                       # and its sampling history (SeqStep.history)
        self.table_sent = 0                             # the length of its block table as its last step carried it
        self.prefix_wait = False                        # waits for any of its prefix a step being built writes
        self.in_flight: deque[tuple[int, bool]] = deque()   # per step in flight, oldest first: (tokens fed, samples)
        self.num_scheduled = 0                          # tokens the steps in flight feed (the sum over in_flight)
        self.num_pending = 0                            # tokens they sample
        self.finish_reason: str | None = None           # "stop" | "length" | "scored" | "pooled" | "error" | "abort"
        self.num_score_tokens = 0                       # > 0: score the last n prompt tokens, generate nothing
        self.stop_token_id: int | None = None           # the eos / stop token that ended it
        self.error: str | None = None
        self.record = None          # what the engine keeps for its record (launcher.records.RecordState)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def text_token_ids(self) -> list[int]:
        """The completion to detokenize: the eos / stop token stays in output_token_ids but, as in
        vLLM, not in the text, unless include_stop_str_in_output keeps it (its text; an eos that
        is a special token still goes with skip_special_tokens)."""
        if self.stop_token_id is not None and not self.sampling.include_stop_str_in_output:
            return self.output_token_ids[:-1]
        return self.output_token_ids

    @property
    def is_scoring(self) -> bool:
        return self.num_score_tokens > 0

    @property
    def samples_nothing(self) -> bool:
        """It scores, or pools (task embed, classify): the end of its prefill ends it."""
        return self.num_score_tokens > 0 or self.sampling.pooling is not None

    def score_targets(self, start: int, end: int) -> list[int] | None:
        """For tokens start..end-1 fed by a prefill step: the next token whose log-probability to
        return where that token is one of the scored ones (a scoring sequence's continuation, or
        the prompt of one asking for prompt_logprobs), else -1. None: nothing to return there."""
        if self.is_scoring:
            first, last = self.num_tokens - self.num_score_tokens, self.num_tokens
        elif self.sampling.prompt_logprobs is not None and start < self.num_prompt_tokens - 1:
            first, last = 1, self.num_prompt_tokens
        else:
            return None
        toks = self.token_ids
        return [toks[j + 1] if first <= j + 1 < last else -1 for j in range(start, end)]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_completion_tokens}, cached={self.num_cached}, finish={self.finish_reason})")


class BlockManager:
    """KV-cache blocks 0..num_blocks-1. A sequence holds the blocks of its block_table, token i
    in block_table[i // block_size].

    With prefix caching, a full block is also known by its content: its key is (the hash of the
    key of the block before it, its tokens), so equal keys mean equal tokens from the sequence's
    start. A sequence being admitted starts on the longest run of its leading blocks the cache
    holds (`acquire_cached`); a block counts its holders, and one that none holds any more stays
    findable until an allocation needs it, least recently used first. Everything else that
    shapes a block's K/V (weights and adapter, position scheme, dtype) is fixed per engine, and
    an engine's cache starts empty, so the tokens are the whole key.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.free_ids: deque[int] = deque(range(num_blocks))   # held by none, content unknown
        self.evictable: dict[int, None] = {}        # held by none, cached; least recently used first
        self.refs = [0] * num_blocks                # holders of each block
        self.key_of: list = [None] * num_blocks     # a cached block's key
        self.written_in = [0] * num_blocks          # the step that writes a cached block (Scheduler.step_no)
        self.cached: dict = {}                      # key -> block

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def missing(self, seq: Sequence, n_tokens_total: int) -> int:
        """Blocks seq still needs to hold n_tokens_total tokens."""
        return max(0, self.blocks_for(n_tokens_total) - len(seq.block_table))

    def can_allocate(self, n_tokens: int) -> bool:
        """Whether a sequence without blocks could get room for n_tokens now."""
        return self.blocks_for(n_tokens) <= self.num_free

    def can_ensure(self, seq: Sequence, n_tokens_total: int) -> bool:
        return self.missing(seq, n_tokens_total) <= self.num_free

    def ensure(self, seq: Sequence, n_tokens_total: int) -> None:
        need = self.missing(seq, n_tokens_total)
        if need > self.num_free:
            raise RuntimeError(f"sequence {seq.seq_id} needs {need} KV blocks, {self.num_free} free")
        seq.block_table.extend(self._take() for _ in range(need))

    def _take(self) -> int:
        if self.free_ids:
            b = self.free_ids.popleft()
        else:                                       # evict the least recently used cached block
            b = next(iter(self.evictable))
            del self.evictable[b]
            del self.cached[self.key_of[b]]
            self.key_of[b] = None
        self.refs[b] = 1
        return b

    def free(self, seq: Sequence) -> None:
        # the tail first: a sequence's last blocks are the least likely to be shared, so they go first
        refs = self.refs
        for b in reversed(seq.block_table):
            refs[b] -= 1
            if refs[b] == 0:
                if self.key_of[b] is None:
                    self.free_ids.append(b)
                else:
                    self.evictable[b] = None
        seq.block_table = []
        seq.num_registered = 0

    # ---- prefix caching -------------------------------------------------------------------------
    def keys(self, seq: Sequence, n_blocks: int) -> list:
        """The keys of seq's first n_blocks full blocks (of tokens it knows), computed once."""
        keys, bs = seq.block_keys, self.block_size
        if len(keys) < n_blocks:
            tokens = seq.token_ids
            parent = hash(keys[-1]) if keys else 0
            for i in range(len(keys), min(n_blocks, len(tokens) // bs)):
                keys.append((parent, tuple(tokens[i * bs:(i + 1) * bs])))
                parent = hash(keys[-1])
        return keys[:n_blocks]

    def acquire_cached(self, seq: Sequence, max_blocks: int, step_no: int, wait_blocks: int) -> int | None:
        """Gives seq (holding no blocks) the cached blocks of its longest cached run of leading
        full blocks, at most max_blocks; returns how many. A sequence must not read what another
        writes in the same step: the run stops before the first block the step being scheduled
        (step_no) writes, and when at least wait_blocks of the run are such blocks, seq takes
        nothing and None is returned, for it to wait for the next step instead."""
        hits, usable = [], None
        for key in self.keys(seq, max_blocks):
            b = self.cached.get(key)
            if b is None:
                break
            if usable is None and self.written_in[b] == step_no:
                usable = len(hits)
            hits.append(b)
        if usable is not None:
            if len(hits) - usable >= wait_blocks:
                return None
            hits = hits[:usable]
        for b in hits:
            if self.refs[b] == 0:
                del self.evictable[b]
            self.refs[b] += 1
        seq.block_table = hits
        seq.num_registered = len(hits)
        return len(hits)

    def register(self, seq: Sequence, n_tokens: int, step_no: int) -> None:
        """Makes seq's full blocks within its first n_tokens tokens (all of them known) findable,
        written by step step_no (-1: written already). A block whose content another block holds
        already stays private."""
        n_blocks = n_tokens // self.block_size
        if n_blocks <= seq.num_registered:
            return
        keys = self.keys(seq, n_blocks)
        for i in range(seq.num_registered, len(keys)):
            b, key = seq.block_table[i], keys[i]
            if self.key_of[b] is None and key not in self.cached:
                self.cached[key] = b
                self.key_of[b] = key
                self.written_in[b] = step_no
        seq.num_registered = len(keys)


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_batch_size: int, max_batched_tokens: int,
                 max_model_len: int, prefix_caching: bool = False):
        if min(num_blocks, block_size, max_model_len) < 1:
            raise ValueError("num_blocks, block_size and max_model_len must all be >= 1")
        self.block_manager = BlockManager(num_blocks, block_size, prefix_caching)
        self.prefix_caching = prefix_caching
        self.set_limits(max_batch_size, max_batched_tokens)
        self.max_model_len = min(max_model_len, num_blocks * block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []              # in admission order
        self.rejected: list[Sequence] = []
        self.num_preemptions = 0
        self.released: list[int] = []                 # sequences finished or preempted that the workers keep
        self.step_no = 0                               # counts schedule passes (BlockManager.written_in)
        self.prompt_tokens = 0                         # tokens of sequences admitted (again, after a preemption)
        self.cached_tokens = 0                         # of which found in the prefix cache, not prefilled

    def set_limits(self, max_batch_size: int, max_batched_tokens: int) -> None:
        """Sequences a step may carry and prompt tokens a step may feed; they may change between
        steps (msinfer bench runs each case's batch on one engine)."""
        if min(max_batch_size, max_batched_tokens) < 1:
            raise ValueError("max_batch_size and max_batched_tokens must be >= 1")
        if max_batched_tokens < max_batch_size:
            raise ValueError(f"max_batched_tokens ({max_batched_tokens}) must be >= max_batch_size "
                             f"({max_batch_size}): a decode step feeds one token per sequence")
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        # a sequence waits a step for blocks the step being built writes when they hold this many
        # of its tokens; fewer, it computes them again: at most an eighth of a step's budget
        self.wait_tokens = max(self.block_manager.block_size, max_batched_tokens // 8)

    # ---- queue --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.max_model_len = min(seq.max_model_len or self.max_model_len, self.max_model_len)
        # what postprocess checks each token against, combined once
        p = seq.sampling
        seq.stop_ids = frozenset(p.stop_token_ids if p.ignore_eos else (*p.stop_token_ids, *seq.eos_token_ids))
        seq.token_limit = min(seq.num_prompt_tokens + p.max_new_tokens, seq.max_model_len)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def withdraw_unstarted(self) -> list[Sequence]:
        """Takes out of the queue, and returns, every sequence that holds nothing yet: no step ran
        it, or one did and it was preempted before its first token (a drain hands their records
        back, launcher.engine)."""
        taken = [s for s in self.waiting if not s.output_token_ids and not s.block_table and not s.in_flight]
        if taken:
            gone = {id(s) for s in taken}
            self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        return taken

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def take_released(self) -> list[int]:
        """Ids of the sequences finished or preempted since the last call that the workers keep
        (their last step, their sampling history: worker.protocol.StepReader), for the next step
        to release."""
        released, self.released = self.released, []
        return released

    def take_rejected(self) -> list[Sequence]:
        """Sequences finished with "error" by schedule() because they can never fit; seq.error
        says why."""
        rejected, self.rejected = self.rejected, []
        return rejected

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends seq wherever it is (waiting or running) and frees its blocks; a no-op if it has
        already finished."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.on_workers:
            self.released.append(seq.seq_id)

    def abort(self, seq: Sequence) -> None:
        self.finish(seq, "abort")

    # ---- scheduling ---------------------------------------------------------------------------
    def schedule(self, ahead: bool = False) -> tuple[list[SeqStep] | DecodeStep, bool, list[Sequence]]:
        """The next step: (what the workers get: one SeqStep per sequence, or for a decode a
        DecodeStep; is_prefill; the sequences in the same order). Without `ahead` (no step in
        flight), empty only when has_work() is False (possibly because the last waiting ones were
        rejected). With `ahead` (a step in flight: see the module's docstring), empty when nothing
        can be scheduled before that step's results."""
        while self.has_work():
            self.step_no += 1
            progress = (self.num_preemptions, len(self.rejected))
            steps = self._schedule_prefill()
            if steps:
                return [st for _, st in steps], True, [s for s, _ in steps]
            decode = self._schedule_decode(ahead)
            if decode is not None:
                return decode[0], False, decode[1]
            if ahead:
                return [], False, []
            # every running sequence was preempted: the head of the queue now has the whole cache
            if progress == (self.num_preemptions, len(self.rejected)):
                raise RuntimeError(f"scheduler stalled: {self.num_waiting} waiting, "
                                   f"{self.num_running} running, {self.block_manager.num_free} free blocks")
        return [], False, []

    def schedule_more_decodes(self, first: DecodeStep, more: int) -> list[tuple[DecodeStep, list[Sequence]]]:
        """Up to `more` decode steps after `first` (just scheduled), each as the step in flight
        before it leaves it (no prefill in between, no preemption): scheduler.decode_steps chains
        them into one call. It stops after a step whose sequences are not first's (one finished
        by its length, or the cache without a block for the next token); the engine then sends
        the steps one by one."""
        out = []
        for _ in range(more):
            self.step_no += 1
            decode = self._schedule_decode(ahead=True)
            if decode is None:
                break
            out.append(decode)
            if decode[0].seq_ids != first.seq_ids:
                break
        return out

    def _schedule_prefill(self) -> list[tuple[Sequence, SeqStep]]:
        scheduled = []
        budget = self.max_batched_tokens
        # a sequence leaves `waiting` for `running` once its last chunk is scheduled; a partial
        # chunk uses up the budget, so `running` counts every sequence of this batch
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if self._reject_if_impossible(seq):
                continue
            if self.prefix_caching and not seq.block_table and not seq.num_scheduled:
                if not self._start_cached(seq):
                    break
            start = seq.num_cached + seq.num_scheduled
            n = min(seq.num_tokens - start, budget)
            if not self.block_manager.can_ensure(seq, start + n):
                break
            self.block_manager.ensure(seq, start + n)
            budget -= n
            scheduled.append((seq, self._seq_step(seq, n)))
            if start + n < seq.num_tokens:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.prompt_tokens += seq.num_tokens
            self.cached_tokens += seq.num_cached_tokens
        return scheduled

    def _schedule_decode(self, ahead: bool = False) -> tuple[DecodeStep, list[Sequence]] | None:
        """Every running sequence's next token (but those a step in flight is sure to finish), as
        one DecodeStep. This runs for every sequence of every decode step: it reads attributes,
        not properties, and fills the step's columns instead of building a SeqStep each."""
        seqs, ids, tokens, cached, generated, tables = [], [], [], [], [], {}
        bm, running, caching = self.block_manager, self.running, self.prefix_caching
        bs = bm.block_size
        i = 0
        while i < len(running) and len(seqs) < self.max_batch_size:
            seq = running[i]
            pending, out = seq.num_pending, len(seq.output_token_ids)
            num_tokens = len(seq.prompt_token_ids) + out
            # left out when a step in flight is sure to finish it: a scoring sequence's last chunk
            # (it samples nothing, so nothing is pending), the token that reaches max_new_tokens or
            # max_model_len
            if seq.in_flight and (seq.num_cached + seq.num_scheduled >= num_tokens if seq.samples_nothing
                                  else num_tokens + pending >= seq.token_limit):
                i += 1
                continue
            total = num_tokens + pending        # feeding its last token stores it at position total - 1
            if len(seq.block_table) * bs < total:
                while not bm.can_ensure(seq, total):
                    if ahead:                   # preempting would drop a cache a step in flight writes:
                        break                   # the rest wait for that step's results
                    victim = running[-1]
                    self._preempt(victim)
                    if victim is seq:
                        break
                else:
                    bm.ensure(seq, total)
                if len(seq.block_table) * bs < total:
                    break
            start = seq.num_cached + seq.num_scheduled
            if caching and not pending and start + 1 >= (seq.num_registered + 1) * bs:
                bm.register(seq, start + 1, self.step_no)               # it fills a block
            seq.in_flight.append(DECODE)
            seq.num_scheduled += 1
            seq.num_pending += 1
            seqs.append(seq)
            ids.append(seq.seq_id)
            tokens.append(SAMPLED if pending else seq.output_token_ids[-1] if out else seq.prompt_token_ids[-1])
            cached.append(start)
            generated.append(out + pending)
            if len(seq.block_table) != seq.table_sent:
                tables[seq.seq_id] = list(seq.block_table)
                seq.table_sent = len(seq.block_table)
            i += 1
        return (DecodeStep(ids, tokens, cached, generated, tables), seqs) if seqs else None

    def _start_cached(self, seq: Sequence) -> bool:
        """Starts seq, being admitted, after its longest run of cached blocks; False when it must
        wait for the next step (see BlockManager.acquire_cached): when the step being built writes
        at least wait_tokens of its prefix (any of it, for a sequence with `prefix_wait`). Fewer,
        it computes them again in this step rather than wait a step for them. At least one token
        is left to feed, for the logits to sample from, and for a scoring sequence every token
        whose next one is scored."""
        bs = self.block_manager.block_size
        # prompt_logprobs: every prompt token is fed, for the log-probability of the one after it;
        # mean and cls pooling: for its hidden state
        whole = seq.sampling.prompt_logprobs is not None or seq.sampling.pooling in ("mean", "cls")
        feed_from = 0 if whole else seq.num_tokens - seq.num_score_tokens - 1
        wait = 1 if seq.prefix_wait else -(-self.wait_tokens // bs)
        hits = self.block_manager.acquire_cached(seq, feed_from // bs, self.step_no, wait)
        if hits is None:
            return False
        seq.num_cached = seq.num_cached_tokens = hits * bs
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style: drop the cache of seq and queue it to re-prefill prompt + output.
        It goes to the head of the queue, behind a prompt whose chunked prefill is under way (that
        one holds blocks, and must not wait for blocks behind sequences that need them)."""
        assert not seq.in_flight, "preempting a sequence a step in flight feeds"
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_cached = seq.num_cached_tokens = 0
        if seq.on_workers:                           # its next admission sends it all again
            self.released.append(seq.seq_id)
            seq.on_workers = seq.history_sent = False
        seq.status = SequenceStatus.WAITING
        self.waiting.insert(1 if self.waiting and self.waiting[0].block_table else 0, seq)
        self.num_preemptions += 1

    def _reject_if_impossible(self, seq: Sequence) -> bool:
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        limit = (f"the KV cache ({self.block_manager.num_blocks} blocks of {self.block_manager.block_size} "
                 f"tokens)" if seq.max_model_len == capacity else f"max_model_len {seq.max_model_len}")
        if seq.num_prompt_tokens == 0:
            seq.error = "empty prompt"
        elif seq.is_scoring and seq.num_score_tokens >= seq.num_tokens:
            seq.error = "scoring needs at least one prompt token before the continuation"
        elif not fits(seq.num_tokens, seq.samples_nothing, seq.max_model_len):
            seq.error = (f"prompt and continuation of {seq.num_tokens} tokens do not fit within {limit}"
                         if seq.is_scoring else f"prompt of {seq.num_tokens} tokens does not fit within {limit}"
                         if seq.samples_nothing else f"prompt of {seq.num_prompt_tokens} tokens leaves no room for a "
                                                     f"generated token within {limit}")
        else:
            return False
        self.finish(seq, "error")
        self.rejected.append(seq)
        return True

    def _seq_step(self, seq: Sequence, n: int) -> SeqStep:
        """The prefill step feeding seq's next n tokens (a waiting sequence has nothing in flight
        that samples), recorded in seq.in_flight."""
        generated = len(seq.output_token_ids)
        scoring = seq.num_score_tokens > 0
        num_tokens = len(seq.prompt_token_ids) + generated
        start = seq.num_cached + seq.num_scheduled
        end = start + n
        sample = end == num_tokens and not seq.samples_nothing
        if self.prefix_caching and end >= (seq.num_registered + 1) * self.block_manager.block_size:
            self.block_manager.register(seq, end, self.step_no)             # it fills a block
        seq.in_flight.append((n, sample))
        seq.num_scheduled += n
        seq.num_pending += sample
        seq.on_workers, seq.table_sent = True, len(seq.block_table)
        targets = scoring or seq.sampling.prompt_logprobs is not None
        step = SeqStep(seq.seq_id, seq.token_ids[start:end], start, list(seq.block_table), seq.sampling, generated,
                       sample, seq.score_targets(start, end) if targets else None)
        if not seq.history_sent and seq.sampling.looks_back:
            step.history = (seq.prompt_token_ids, list(seq.output_token_ids))
            seq.history_sent = True
        return step

    # ---- results ------------------------------------------------------------------------------
    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Takes the sampled token of each sequence of the oldest step in flight (-1 for a prefill
        chunk that does not sample); returns the sequences this step finished, their blocks
        already freed. Sequences finished or aborted since schedule() are skipped."""
        if len(seqs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} sampled tokens for {len(seqs)} sequences")
        finished = []
        done = SequenceStatus.FINISHED
        caching, block_size = self.prefix_caching, self.block_manager.block_size
        for seq, token in zip(seqs, token_ids):
            if seq.status is done:
                continue
            n, sampled = seq.in_flight.popleft()
            seq.num_scheduled -= n
            seq.num_pending -= sampled
            seq.num_cached += n
            if caching and seq.num_cached >= (seq.num_registered + 1) * block_size:
                self.block_manager.register(seq, seq.num_cached, -1)      # a decode filled a block
            if seq.num_cached < len(seq.prompt_token_ids) + len(seq.output_token_ids):
                continue                               # a prompt chunk short of the prompt's end
            if seq.samples_nothing:                    # scored or pooled: nothing to generate
                self.finish(seq, "scored" if seq.num_score_tokens else "pooled")
                finished.append(seq)
                continue
            if token < 0:
                raise ValueError(f"sequence {seq.seq_id}: no token sampled at the end of its prefill")
            output = seq.output_token_ids
            output.append(token)
            if token in seq.stop_ids:
                seq.stop_token_id = token
                self.finish(seq, "stop")
                finished.append(seq)
            elif len(seq.prompt_token_ids) + len(output) >= seq.token_limit:
                self.finish(seq, "length")
                finished.append(seq)
        return finished
