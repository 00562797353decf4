"""The scheduler and block manager driven by a fake model, no MindSpore.

The fake model keeps a paged cache of token ids: each step writes the fed tokens through the block
table and reads the whole context back through it, and the next token is a function of that
context. A wrong block table, a wrong num_cached or a block shared by two sequences changes the
tokens, so comparing with a reference generation checks the cache bookkeeping end to end.

Each workload also runs with async scheduling (`ahead`): a step is scheduled while the one before
it is in flight, and the fake model, like the worker, feeds SAMPLED from its previous call.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque

import pytest

from msinfer.launcher.scheduler import BlockManager, Scheduler, Sequence, SequenceStatus
from msinfer.worker.protocol import SAMPLED, DecodeStep, SamplingParams, SeqStep, StepReader

VOCAB = 50


def next_token(context: list[int]) -> int:
    h = 0
    for t in context:                                # a rolling hash: every token, in order, counts
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def reference(prompt, sampling=SamplingParams(), eos=(), max_model_len=10**9):
    out: list[int] = []
    while True:
        t = next_token(prompt + out)
        out.append(t)
        if (t in eos and not sampling.ignore_eos) or t in sampling.stop_token_ids:
            return out, "stop"
        if len(out) >= sampling.max_new_tokens or len(prompt) + len(out) >= max_model_len:
            return out, "length"


class FakeModel:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.cache: list[int | None] = [None] * (num_blocks * block_size)
        self.sampled: dict[int, int] = {}             # seq_id -> its token of the last call
        self.steps = StepReader()                     # a decode step's rows, completed as a rank does

    def slot(self, s: SeqStep, pos: int) -> int:
        return s.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def __call__(self, steps: list[SeqStep] | DecodeStep, released=()) -> list[int]:
        steps = self.steps.read(steps, released)
        out = []
        for s in steps:
            tokens = [self.sampled[s.seq_id]] if s.token_ids == [SAMPLED] else s.token_ids
            for i, t in enumerate(tokens):
                self.cache[self.slot(s, s.num_cached + i)] = t
            context = [self.cache[self.slot(s, p)] for p in range(s.num_cached + len(s.token_ids))]
            out.append(next_token(context) if s.sample else -1)
        self.sampled = {s.seq_id: t for s, t in zip(steps, out) if t >= 0}
        return out


def check_step(sched: Scheduler, steps: list[SeqStep], is_prefill: bool, seqs: list[Sequence]) -> None:
    bm = sched.block_manager
    assert steps and len(steps) == len(seqs) <= sched.max_batch_size
    assert sum(len(s.token_ids) for s in steps) <= sched.max_batched_tokens
    assert len({s.seq_id for s in steps}) == len(steps)
    for step, seq in zip(steps, seqs):
        n = len(step.token_ids)
        assert step.seq_id == seq.seq_id and n >= 1 and seq.in_flight[-1] == (n, step.sample)
        start = seq.num_cached + seq.num_scheduled - n            # after the steps in flight before it
        pending = seq.num_pending - step.sample                   # tokens those steps sample
        assert step.num_cached == start and pending in (0, 1)
        if pending:                                               # a decode of the token in flight
            assert step.token_ids == [SAMPLED] and not is_prefill
        else:
            assert step.token_ids == seq.token_ids[start: start + n]
        assert step.sample == (start + n == seq.num_tokens + pending and not seq.is_scoring)
        assert step.num_generated == seq.num_completion_tokens + pending
        assert step.block_table == seq.block_table and step.block_table is not seq.block_table
        assert len(step.block_table) * bm.block_size >= step.num_cached + n
        if not is_prefill:
            assert n == 1 and step.sample
        # a step writes only blocks its sequence alone holds
        written = {step.block_table[p // bm.block_size] for p in range(start, start + n)}
        assert all(bm.refs[b] == 1 for b in written), f"sequence {seq.seq_id} writes a shared block"
    # block accounting: every block is free, or held by as many live sequences as it counts
    holders = sched.running + [s for s in sched.waiting if s.block_table]
    owned = [b for s in holders for b in s.block_table]
    assert all(len(s.block_table) == len(set(s.block_table)) for s in holders)
    assert set(owned).isdisjoint(bm.free_ids) and set(owned).isdisjoint(bm.evictable)
    assert len(set(owned)) + bm.num_free == bm.num_blocks
    assert all(bm.refs[b] == owned.count(b) for b in set(owned))
    assert all(0 <= b < bm.num_blocks for b in owned)
    if not sched.prefix_caching:
        assert len(owned) == len(set(owned)) and not bm.cached
    # at most one prompt is part-way through its prefill, and it heads the queue
    partial = [s for s in sched.waiting if s.block_table]
    assert not partial or partial == [sched.waiting[0]]
    assert len(sched.running) + len(partial) <= sched.max_batch_size


def drive(sched: Scheduler, seqs: list[Sequence], model: FakeModel, per_step: int | None = None,
          max_steps: int = 20_000, ahead: bool = False):
    """Adds seqs (all at once, or per_step at a time before each step), runs to the end and
    returns (finished in finishing order, the feeds of each seq_id, seq_ids in order of admission).
    With `ahead`, as the controller does with async scheduling: up to two steps in flight, the
    second scheduled before the first's results; the model runs the steps in the order scheduled.
    The model reads each step as a rank does (worker.protocol.StepReader: a decode step's rows
    completed from what the rank keeps) when it runs it; check_step sees it read the same way
    when it is scheduled (starting from what the model's reader holds: steps run before)."""
    reader = StepReader()
    reader.last = dict(model.steps.last)
    pending = list(seqs)
    finished: list[Sequence] = []
    feeds: dict[int, list[tuple[bool, SeqStep]]] = defaultdict(list)
    admitted: list[int] = []
    in_flight: deque = deque()
    for _ in range(max_steps):
        for seq in pending[:per_step or len(pending)]:
            sched.add(seq)
        del pending[:per_step or len(pending)]
        while sched.has_work() and len(in_flight) < (2 if ahead else 1):
            steps, is_prefill, batch = sched.schedule(ahead=bool(in_flight))
            finished += sched.take_rejected()
            if not steps:
                assert in_flight or not sched.has_work()
                break
            assert isinstance(steps, list) == is_prefill        # a decode goes as a DecodeStep
            released = sched.take_released()
            seen = reader.read(steps, released)
            check_step(sched, seen, is_prefill, batch)
            for s in seen:
                if s.seq_id not in feeds:
                    admitted.append(s.seq_id)
                feeds[s.seq_id].append((is_prefill, s))
            in_flight.append((steps, released, batch))
        if not in_flight:
            if not pending:
                break
            continue
        steps, released, batch = in_flight.popleft()
        finished += sched.postprocess(batch, model(steps, released))
    else:
        pytest.fail("the scheduler did not finish")
    assert sched.block_manager.num_free == sched.block_manager.num_blocks
    assert sched.num_waiting == sched.num_running == 0
    # a rank forgets every sequence once a step has carried its release
    released = sched.take_released()
    for r in (reader, model.steps):
        r.read([], released)
        assert not r.last
    return finished, feeds, admitted


def make_sched(num_blocks=64, block_size=4, max_batch_size=4, max_batched_tokens=16, max_model_len=128,
               prefix_caching=False):
    return Scheduler(num_blocks, block_size, max_batch_size, max_batched_tokens, max_model_len, prefix_caching), \
        FakeModel(num_blocks, block_size)


def run_one(prompt, sampling=SamplingParams(), eos=(), ahead=False, **kw) -> Sequence:
    sched, model = make_sched(**kw)
    seq = Sequence(prompt, sampling, eos_token_ids=eos)
    finished, _, _ = drive(sched, [seq], model, ahead=ahead)
    assert finished == [seq] and seq.is_finished
    return seq


def workload(rng: random.Random, n: int, max_prompt: int, eos=(0,)) -> list[Sequence]:
    return [Sequence([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_prompt))],
                     SamplingParams(max_new_tokens=rng.randint(1, 30)), key=i, eos_token_ids=eos)
            for i in range(n)]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def ahead(request) -> bool:
    return request.param


@pytest.fixture(params=[False, True], ids=["no-cache", "prefix-cache"])
def caching(request) -> bool:
    return request.param


# ---- block manager ---------------------------------------------------------------------------------
def test_block_manager_allocates_frees_and_refuses_overdraft():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = Sequence([1]), Sequence([2])
    assert bm.can_allocate(12) and not bm.can_allocate(13)
    bm.ensure(a, 5)
    assert len(a.block_table) == 2 and bm.num_free == 1
    bm.ensure(a, 8)                                  # still fits in two blocks
    assert len(a.block_table) == 2
    assert not bm.can_ensure(b, 5) and bm.can_ensure(b, 4)
    with pytest.raises(RuntimeError, match="needs 2 KV blocks, 1 free"):
        bm.ensure(b, 5)
    bm.ensure(b, 1)
    assert sorted(a.block_table + b.block_table) == [0, 1, 2] and bm.num_free == 0
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 2


def test_scheduler_rejects_a_token_budget_below_the_batch_size():
    with pytest.raises(ValueError, match="max_batched_tokens \\(4\\) must be >= max_batch_size \\(8\\)"):
        Scheduler(16, 4, max_batch_size=8, max_batched_tokens=4, max_model_len=64)


def test_new_batch_limits_take_effect_at_the_next_step():
    """msinfer bench runs each case's batch size and prefill budget on one engine's scheduler."""
    sched, model = make_sched(max_batched_tokens=16, max_batch_size=2, max_model_len=64)
    for i in range(4):
        sched.add(Sequence([i + 1] * 6, SamplingParams(max_new_tokens=2)))
    steps, is_prefill, seqs = sched.schedule()
    assert is_prefill and len(steps) == 2
    sched.postprocess(seqs, model(steps))              # both still running: at the batch limit
    with pytest.raises(ValueError, match="max_batched_tokens \\(3\\) must be >= max_batch_size \\(4\\)"):
        sched.set_limits(4, 3)
    sched.set_limits(4, 24)
    steps, is_prefill, _ = sched.schedule()
    assert is_prefill and len(steps) == 2 and sum(len(s.token_ids) for s in steps) == 12   # the other two


# ---- chunked prefill -------------------------------------------------------------------------------
def test_long_prompt_is_prefilled_in_chunks_and_samples_only_on_the_last():
    sched, model = make_sched(max_batched_tokens=16, max_model_len=128)
    prompt = [(7 * i) % (VOCAB - 1) + 1 for i in range(50)]
    long, short = Sequence(prompt, SamplingParams(max_new_tokens=3)), Sequence([5, 6, 7, 8, 9])
    sched.add(long)
    sched.add(short)
    chunks = []
    for _ in range(4):
        steps, is_prefill, seqs = sched.schedule()
        assert is_prefill and seqs[0] is long
        chunks.append((steps[0].num_cached, steps[0].token_ids, steps[0].sample))
        if len(seqs) > 1:                            # the short prompt only after the long one's end
            assert seqs == [long, short] and chunks[-1][2]
        sched.postprocess(seqs, model(steps))
    assert [(c, len(t), s) for c, t, s in chunks] == [(0, 16, False), (16, 16, False), (32, 16, False),
                                                      (48, 2, True)]
    assert [t for _, ts, _ in chunks for t in ts] == prompt
    assert long.num_cached == 50 and long.num_completion_tokens == 1
    finished, _, _ = drive(sched, [], model)
    assert {s.seq_id for s in finished} == {long.seq_id, short.seq_id}
    assert long.output_token_ids == reference(prompt, long.sampling)[0]
    assert short.output_token_ids == reference([5, 6, 7, 8, 9], short.sampling, max_model_len=128)[0]


def test_prompt_of_max_model_len_minus_one_gets_through_a_small_budget():
    prompt = [3] * 99
    seq = run_one(prompt, max_batched_tokens=8, max_batch_size=2, max_model_len=100)
    assert seq.output_token_ids == reference(prompt)[0][:1] and seq.finish_reason == "length"


# ---- preemption --------------------------------------------------------------------------------------
def test_preempted_sequence_recomputes_prompt_and_output_in_chunks():
    # 4 blocks of 4 tokens: two sequences outgrow 8 tokens each and the later one is preempted
    sched, model = make_sched(num_blocks=4, block_size=4, max_batch_size=2, max_batched_tokens=4)
    sampling = SamplingParams(max_new_tokens=8)
    a, b = Sequence([1, 2, 3, 4], sampling), Sequence([5, 6, 7, 8], sampling)
    finished, feeds, _ = drive(sched, [a, b], model)
    assert sched.num_preemptions >= 1
    assert sorted(s.seq_id for s in finished) == sorted([a.seq_id, b.seq_id])
    for seq in (a, b):
        assert seq.output_token_ids == reference(seq.prompt_token_ids, sampling)[0]
        assert seq.finish_reason == "length"
    # b's second prefill: from num_cached 0, contiguous chunks of <= 4 tokens covering prompt and
    # the tokens generated before preemption, sampling only on the last chunk
    prefills = [s for is_prefill, s in feeds[b.seq_id] if is_prefill]
    restart = next(i for i, s in enumerate(prefills) if i > 0 and s.num_cached == 0)
    redo = prefills[restart:]
    assert all(len(s.token_ids) <= 4 for s in redo)
    assert [s.sample for s in redo] == [False] * (len(redo) - 1) + [True]
    assert [s.num_cached for s in redo] == [sum(len(r.token_ids) for r in redo[:i]) for i in range(len(redo))]
    fed = [t for s in redo for t in s.token_ids]
    assert len(fed) > 4 and fed == b.token_ids[:len(fed)]
    assert redo[-1].num_generated == len(fed) - 4


def test_preemption_gives_the_same_tokens_as_an_ample_cache(ahead, caching):
    def run(num_blocks):
        sched, model = make_sched(num_blocks=num_blocks, block_size=4, max_batch_size=6,
                                  max_batched_tokens=16, max_model_len=48, prefix_caching=caching)
        seqs = workload(random.Random(1), 40, max_prompt=30)
        finished, _, _ = drive(sched, seqs, model, per_step=3, ahead=ahead)
        return sched, {s.key: (s.output_token_ids, s.finish_reason) for s in finished}

    tight, tight_out = run(num_blocks=14)
    ample, ample_out = run(num_blocks=200)
    assert tight.num_preemptions > 0 and ample.num_preemptions == 0
    assert tight_out == ample_out and len(tight_out) == 40


# ---- a long mixed stream ---------------------------------------------------------------------------
def test_mixed_stream_every_sequence_finishes_once_in_fifo_admission_order(ahead, caching):
    rng = random.Random(0)
    sched, model = make_sched(num_blocks=24, block_size=4, max_batch_size=5, max_batched_tokens=24,
                              max_model_len=64, prefix_caching=caching)
    seqs = workload(rng, 80, max_prompt=60)
    seqs += [Sequence([1] * 64, key="too long"), Sequence([2] * 63, key="just fits")]
    rng.shuffle(seqs)
    finished, _, admitted = drive(sched, seqs, model, per_step=2, ahead=ahead)
    assert sched.num_preemptions > 0                 # the cache is tight enough to preempt
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
    assert admitted == [s.seq_id for s in seqs if s.key != "too long"]
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED and not seq.block_table
        if seq.key == "too long":
            assert seq.finish_reason == "error" and seq.output_token_ids == []
            continue
        out, reason = reference(seq.prompt_token_ids, seq.sampling, seq.eos_token_ids, 64)
        assert (seq.output_token_ids, seq.finish_reason) == (out, reason)


# ---- finish reasons ----------------------------------------------------------------------------------
PROMPT = [4, 8, 15, 16, 23, 42]


def first_new_token_at(tokens: list[int], start: int) -> int:
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_eos_finishes_with_stop_and_is_kept_in_tokens_not_text(ahead):
    ref, _ = reference(PROMPT, SamplingParams(max_new_tokens=40))
    i = first_new_token_at(ref, 3)
    seq = run_one(PROMPT, SamplingParams(max_new_tokens=40), eos=(ref[i],), ahead=ahead)
    assert seq.finish_reason == "stop" and seq.stop_token_id == ref[i]
    assert seq.output_token_ids == ref[:i + 1] and seq.text_token_ids == ref[:i]

    seq = run_one(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True), eos=(ref[i],), ahead=ahead)
    assert seq.finish_reason == "length" and seq.output_token_ids == ref and seq.text_token_ids == ref


def test_stop_token_ids_finish_with_stop(ahead):
    ref, _ = reference(PROMPT, SamplingParams(max_new_tokens=40))
    i = first_new_token_at(ref, 2)
    seq = run_one(PROMPT, SamplingParams(max_new_tokens=40, stop_token_ids=(ref[i],)), ahead=ahead)
    assert seq.finish_reason == "stop" and seq.output_token_ids == ref[:i + 1]
    assert seq.text_token_ids == ref[:i]
    # include_stop_str_in_output keeps the stop token's text too, as vLLM's detokenizer does
    kept = run_one(PROMPT, SamplingParams(max_new_tokens=40, stop_token_ids=(ref[i],), include_stop_str_in_output=True),
                   ahead=ahead)
    assert kept.finish_reason == "stop" and kept.text_token_ids == kept.output_token_ids == ref[:i + 1]


def test_max_new_tokens_finishes_with_length(ahead):
    seq = run_one(PROMPT, SamplingParams(max_new_tokens=3), ahead=ahead)
    assert seq.finish_reason == "length" and seq.output_token_ids == reference(PROMPT)[0][:3]
    assert seq.stop_token_id is None and seq.text_token_ids == seq.output_token_ids


def test_max_model_len_and_cache_size_finish_with_length(ahead):
    seq = run_one(PROMPT, max_model_len=10, ahead=ahead)
    assert seq.finish_reason == "length" and seq.num_tokens == 10
    # a sequence that would outgrow the whole cache (3 blocks of 4) stops at its size
    seq = run_one(PROMPT, num_blocks=3, block_size=4, max_model_len=100, ahead=ahead)
    assert seq.finish_reason == "length" and seq.num_tokens == 12
    assert seq.output_token_ids == reference(PROMPT)[0][:6]


def test_async_decodes_feed_the_token_in_flight_and_only_a_stop_costs_a_step():
    """With a step always in flight, every decode feeds SAMPLED; a sequence ending by length is
    never scheduled past its last token, one ending on eos decodes once more and drops that token."""
    ref, _ = reference(PROMPT, SamplingParams(max_new_tokens=40))
    i = first_new_token_at(ref, 3)
    sched, model = make_sched()
    stops = Sequence(PROMPT, SamplingParams(max_new_tokens=40), eos_token_ids=(ref[i],))
    lasts = Sequence(PROMPT[::-1], SamplingParams(max_new_tokens=5))
    finished, feeds, _ = drive(sched, [stops, lasts], model, ahead=True)
    assert stops.output_token_ids == ref[:i + 1] and stops.finish_reason == "stop"
    assert lasts.output_token_ids == reference(PROMPT[::-1], lasts.sampling)[0] and lasts.finish_reason == "length"
    for seq, wasted in ((stops, 1), (lasts, 0)):
        decodes = [step for is_prefill, step in feeds[seq.seq_id] if not is_prefill]
        assert decodes and all(step.token_ids == [SAMPLED] for step in decodes)
        assert len(decodes) == seq.num_completion_tokens - 1 + wasted


# ---- rejection, abort ---------------------------------------------------------------------------------
def test_sequence_that_can_never_fit_is_rejected_and_the_rest_go_on(ahead):
    sched, model = make_sched(num_blocks=4, block_size=4, max_model_len=100)
    ok1, too_big, empty, ok2 = Sequence([1, 2]), Sequence(list(range(16))), Sequence([]), Sequence([3] * 15)
    finished, _, _ = drive(sched, [ok1, too_big, empty, ok2], model, ahead=ahead)
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in (ok1, too_big, empty, ok2))
    assert too_big.finish_reason == "error" and "KV cache (4 blocks of 4 tokens)" in too_big.error
    assert empty.finish_reason == "error" and empty.error == "empty prompt"
    assert ok1.finish_reason == ok2.finish_reason == "length" and ok2.num_completion_tokens == 1

    sched, _ = make_sched(max_model_len=8)
    seq = Sequence([1] * 8)
    sched.add(seq)
    assert sched.schedule() == ([], False, [])
    assert not sched.has_work() and sched.take_rejected() == [seq] and sched.take_rejected() == []
    assert "max_model_len 8" in seq.error


def test_abort_frees_blocks_and_postprocess_skips_aborted():
    sched, model = make_sched(num_blocks=16, block_size=4, max_batch_size=2, max_batched_tokens=8)
    a, b, c = Sequence([1] * 5), Sequence([2] * 6), Sequence([3] * 3)
    for s in (a, b, c):
        sched.add(s)
    steps, is_prefill, seqs = sched.schedule()
    assert is_prefill and seqs == [a, b] and steps[1].token_ids == [2, 2, 2] and not steps[1].sample
    assert (sched.num_running, sched.num_waiting) == (1, 2)      # b's prefill is under way
    sched.abort(b)                                   # between schedule and postprocess
    sched.finish(c, "error")                         # still waiting
    assert b.finish_reason == "abort" and c.finish_reason == "error"
    assert sched.postprocess(seqs, model(steps)) == []
    assert a.num_completion_tokens == 1 and b.num_cached == 0 and b.output_token_ids == []
    assert sched.block_manager.num_free == 16 - len(a.block_table)
    sched.finish(b, "stop")                          # finishing twice changes nothing
    assert b.finish_reason == "abort"
    finished, _, _ = drive(sched, [], model)
    assert finished == [a]


def test_scoring_sequences_among_generating_ones_are_only_prefilled(ahead, caching):
    """A scoring sequence (its last tokens scored, nothing generated) runs its prompt in prefill
    chunks beside generating sequences and finishes "scored" after its last chunk: no decode is
    ever scheduled for it, also while that chunk is in flight (async: it samples nothing, so it has
    no pending token, and must still be left out)."""
    rng = random.Random(7)
    sched, model = make_sched(max_batched_tokens=8, prefix_caching=caching)
    gens = workload(rng, 6, 12, eos=())
    scored = [Sequence([rng.randrange(1, VOCAB) for _ in range(n)], SamplingParams(max_new_tokens=4), key=f"s{n}")
              for n in (5, 13, 21)]
    for seq in scored:
        seq.num_score_tokens = 3
    finished, feeds, _ = drive(sched, gens + scored, model, per_step=2, ahead=ahead)
    for seq in scored:
        assert seq.finish_reason == "scored" and seq.output_token_ids == []
        steps = feeds[seq.seq_id]
        assert all(is_prefill for is_prefill, _ in steps), f"{seq.key}: fed a decode"
        assert sum(len(s.token_ids) for _, s in steps) == len(seq.prompt_token_ids) - seq.num_cached_tokens
    for seq in gens:
        assert seq.output_token_ids == reference(seq.prompt_token_ids, seq.sampling)[0]


# ---- prefix caching ------------------------------------------------------------------------------------
def shared_prefix_workload(rng: random.Random, n: int, prefixes: int = 3, prefix_len: int = 13) -> list[Sequence]:
    """Prompts that start with one of a few shared prefixes (some of them repeated whole)."""
    heads = [[rng.randrange(1, VOCAB) for _ in range(prefix_len)] for _ in range(prefixes)]
    seqs = []
    for i in range(n):
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.choice([0, 1, 3, 9]))]
        seqs.append(Sequence(rng.choice(heads) + tail, SamplingParams(max_new_tokens=rng.randint(1, 12)),
                             key=i, eos_token_ids=(0,)))
    return seqs


def fed_tokens(feeds) -> int:
    return sum(len(s.token_ids) for steps in feeds.values() for _, s in steps)


@pytest.mark.parametrize("num_blocks", [200, 16], ids=["ample", "tight"])
def test_prefix_caching_gives_the_tokens_of_no_caching_and_prefills_less(ahead, num_blocks):
    def run(caching):
        sched, model = make_sched(num_blocks=num_blocks, block_size=4, max_batch_size=6, max_batched_tokens=16,
                                  max_model_len=48, prefix_caching=caching)
        seqs = shared_prefix_workload(random.Random(3), 40)
        finished, feeds, _ = drive(sched, seqs, model, per_step=4, ahead=ahead)
        return sched, fed_tokens(feeds), {s.key: (s.output_token_ids, s.finish_reason) for s in finished}

    plain, plain_fed, plain_out = run(False)
    cached, cached_fed, cached_out = run(True)
    assert cached_out == plain_out and len(plain_out) == 40
    assert plain.cached_tokens == 0 and cached.cached_tokens > 0
    if num_blocks == 16:            # preemptions differ between the runs, and re-prefills with them
        assert cached.num_preemptions > 0 and cached_fed < plain_fed
    else:
        assert plain_fed - cached_fed == cached.cached_tokens


def test_a_second_sequence_starts_on_the_first_ones_blocks_a_step_later_and_only_before_they_differ(ahead):
    sched, model = make_sched(block_size=4, max_batched_tokens=64, prefix_caching=True)
    prompt = list(range(1, 19))                          # 18 tokens: 4 full blocks and 2 tokens
    same, differs = Sequence(prompt), Sequence(prompt[:9] + [40] + prompt[10:])
    first = Sequence(prompt)
    finished, feeds, _ = drive(sched, [first, same, differs], model, ahead=ahead)
    # `same` waited for the step that writes `first`'s blocks instead of reading them in it
    (p0, s0), = feeds[first.seq_id][:1]
    (p1, s1), = feeds[same.seq_id][:1]
    assert p0 and p1 and s0.num_cached == 0 and s1.num_cached == 16 and s1.token_ids == prompt[16:]
    assert s1.block_table[:4] == s0.block_table[:4]
    # `differs` changes token 9 (block 2): blocks 0 and 1 are shared, block 2 is not
    (_, s2), = feeds[differs.seq_id][:1]
    assert s2.num_cached == 8 and s2.block_table[:2] == s0.block_table[:2] and s2.block_table[2] != s0.block_table[2]
    for seq in (first, same, differs):
        assert seq.output_token_ids == reference(seq.prompt_token_ids, max_model_len=128)[0]


def test_a_prompt_found_whole_in_the_cache_still_feeds_its_last_token():
    sched, model = make_sched(block_size=4, prefix_caching=True)
    prompt = list(range(1, 13))                          # exactly 3 blocks
    a, b = Sequence(prompt), Sequence(prompt)
    drive(sched, [a], model)
    _, feeds, _ = drive(sched, [b], model)
    (_, step), = feeds[b.seq_id][:1]
    assert step.num_cached == 8 and step.token_ids == prompt[8:] and step.sample
    assert b.output_token_ids == a.output_token_ids


def test_freed_cached_blocks_are_reused_until_evicted_least_recently_used_first():
    sched, model = make_sched(num_blocks=8, block_size=4, prefix_caching=True)
    bm = sched.block_manager
    p1, p2, p3 = [1] * 8 + [5], [2] * 8 + [5], [3] * 16 + [5]
    drive(sched, [Sequence(p1, SamplingParams(max_new_tokens=1))], model)
    drive(sched, [Sequence(p2, SamplingParams(max_new_tokens=1))], model)
    assert len(bm.cached) == 4 and bm.num_free == 8          # both prompts' 2 full blocks, held by none
    drive(sched, [Sequence(p1, SamplingParams(max_new_tokens=1))], model)    # p1 used again: now the newest
    assert sched.cached_tokens == 8
    # p3 needs 5 blocks: the 4 never cached go first, then p2's last full block (p2 is the least
    # recently used, and a sequence's blocks are let go of from its end); p1's stay
    drive(sched, [Sequence(p3, SamplingParams(max_new_tokens=1))], model)
    _, feeds, _ = drive(sched, [s1 := Sequence(p1), s2 := Sequence(p2)], model)
    assert feeds[s2.seq_id][0][1].num_cached == 4 and feeds[s1.seq_id][0][1].num_cached == 8
    for seq in (s1, s2):
        assert seq.output_token_ids == reference(seq.prompt_token_ids, max_model_len=32)[0]


def test_a_scored_continuation_reuses_its_prompts_blocks_and_scores_every_token():
    sched, model = make_sched(block_size=4, prefix_caching=True)
    prompt = list(range(1, 14))
    gen = Sequence(prompt, SamplingParams(max_new_tokens=2))
    scored = Sequence(prompt + [7, 8, 9])
    scored.num_score_tokens = 3
    _, feeds, _ = drive(sched, [gen], model)
    _, feeds, _ = drive(sched, [scored], model)
    steps = [s for _, s in feeds[scored.seq_id]]
    assert steps[0].num_cached == 12 and scored.num_cached_tokens == 12
    targets = [t for s in steps for t in s.targets if t >= 0]
    assert targets == [7, 8, 9] and scored.finish_reason == "scored"


def test_a_short_prefix_the_step_writes_is_computed_again_rather_than_waited_for(ahead):
    """Budget 64: a sequence waits a step only for 8 or more tokens (an eighth of the budget) that
    the step being built writes; 4 it computes again beside their writer. A sample of a record
    (prefix_wait) waits for any."""
    sched, model = make_sched(block_size=4, max_batched_tokens=64, prefix_caching=True)
    assert sched.wait_tokens == 8
    first, second = Sequence([1, 2, 3, 4, 9, 9]), Sequence([1, 2, 3, 4, 7, 7])
    sibling = Sequence([1, 2, 3, 4, 9, 9])
    sibling.prefix_wait = True
    _, feeds, _ = drive(sched, [first, second, sibling], model, ahead=ahead)
    assert feeds[first.seq_id][0][1].block_table[0] != feeds[second.seq_id][0][1].block_table[0]
    assert feeds[second.seq_id][0][1].num_cached == 0                     # in the first step, from scratch
    assert feeds[sibling.seq_id][0][1].num_cached == 4                    # the step after, on first's block
    for seq in (first, second, sibling):
        assert seq.output_token_ids == reference(seq.prompt_token_ids, max_model_len=128)[0]


def test_a_step_crosses_the_wire_whole():
    """pack_step / unpack_step, as every rank receives a step: each SeqStep's fields, the shared
    SamplingParams once, a history and scoring targets, and the released ids."""
    from msinfer.worker.protocol import pack_step, unpack_step
    sp = SamplingParams(max_new_tokens=7, temperature=0.5, seed=3)
    steps = [SeqStep(1, [SAMPLED], 9, [4, 5], sp, 2, True),
             SeqStep(2, [3, 4, 5], 0, [6], sp, 0, False, targets=[4, 5, -1]),
             SeqStep(3, [8], 12, [7, 8, 9], SamplingParams(), 1)]
    steps[2].history = ([1, 2, 3], [8])
    got, released = unpack_step(pack_step(steps, [11, 12]))
    assert got == steps and released == [11, 12]
    assert got[0].sampling is got[1].sampling            # one SamplingParams for the records that share it


def test_a_decode_step_crosses_the_wire_as_columns_and_a_rank_completes_its_rows():
    """A DecodeStep carries each sequence's token, cached and generated counts, and the block
    tables that grew; a rank (StepReader) completes each row from the sequence's last step. A
    decode of a sequence the rank does not hold (never prefilled there, or released) is an error
    that names it."""
    from msinfer.worker.protocol import pack_step, unpack_step
    sp = SamplingParams(max_new_tokens=7, temperature=0.5, seed=3)
    reader = StepReader()
    reader.read([SeqStep(1, [5, 6, 7], 0, [4], sp, 0, True), SeqStep(2, [8], 3, [6, 2], SamplingParams(), 1)])
    step = DecodeStep([1, 2], [SAMPLED, 9], [3, 4], [1, 2], {1: [4, 5]})
    got, released = unpack_step(pack_step(step, [7]))
    assert got == step and released == [7]
    assert reader.read(got, released) == [SeqStep(1, [SAMPLED], 3, [4, 5], sp, 1, True),
                                          SeqStep(2, [9], 4, [6, 2], SamplingParams(), 2, True)]
    assert reader.read(DecodeStep([1], [SAMPLED], [4], [2], {}))[0].block_table == [4, 5]   # kept
    with pytest.raises(ValueError, match="sequence 2: a decode step names it"):
        reader.read(DecodeStep([2], [SAMPLED], [5], [3], {}), released=[2])
