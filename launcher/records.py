"""A record's way through an engine (launcher.engine): Record -> Sequence, stop strings and
streamed text while it runs, finished Sequence -> its result line.

Everything here is per record or per token and runs in the replica's engine, not in the driver.
A result leaves as `Done`: the line already encoded as JSON, and the few figures the driver's
summary counts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import NamedTuple

import numpy as np

from msinfer.launcher.errors import RecordError
from msinfer.launcher.inputs import Record, echoed_message
from msinfer.launcher.openai_batch import EMBEDDINGS_URL
from msinfer.launcher.scheduler import Sequence, fits
from msinfer.launcher.tokenizer import THINK_END, THINK_START, StopStringMatcher, Tokenizer, split_reasoning
from msinfer.launcher.tools import PARSER_TOKENS, ToolUse, constrained_calls, parse_calls, tool_calls_field
from msinfer.sharding.config import POOLING_TASKS
from msinfer.worker.protocol import SamplingParams
from msinfer.worker.sampler import draw_key


class OpenAIRequest(NamedTuple):
    """How an OpenAI Batch line answers a record (RecordCodec.request)."""
    url: str
    top_logprobs: int | None        # the log-probability alternatives asked for (None: none)
    reasoning: bool                 # include_reasoning: the reasoning in the message
    base64: bool                    # an embedding's encoding_format base64
    # its echo: a completion's (its mode, each prompt as written or None for token ids), a chat
    # completion's ("chat", the text before each choice's content), or None
    echo: tuple | None
    forced: bool = False            # tool_choice "required" or a named function: content "" beside calls
    token_ids: bool = False         # vLLM's return_token_ids: the prompt's and each choice's token ids
    role: str = "assistant"         # a chat answer's role: the last message's without a generation prompt


class Done(NamedTuple):
    """One record's result as it leaves an engine."""
    serial: int                 # the driver's number for the record (launcher.controller)
    line: str                   # the results file's line, JSON without the newline
    failed: bool
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None        # from its arrival in the engine to its first token
    cause: str | None = None    # a failed record's error message, its id left out: alike records' alike
    cached_tokens: int = 0      # prompt tokens found in the prefix cache
    cut: bool = False           # it (or one of its n samples) stopped at its length limit: finish_reason "length"


class Samples:
    """The sequences of a record with sampling.n > 1, or with several prompts (an OpenAI
    completions request's list): each prompt's n samples share it (and, with prefix caching, its
    KV blocks), and all of them make one result line together."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = seqs
        self.num_finished = 0
        self.closed = False                 # its result has been made (or its error reported)


@dataclasses.dataclass
class RecordState:
    """What the engine keeps for a sequence's record beside the scheduler's state (Sequence.record):
    where its result goes and what the result line is built from."""
    serial: int = 0                     # the driver's number for its record
    given_id: int | None = None         # its record's id as an integer, as its input gave it (Record.given_id)
    request: OpenAIRequest | None = None    # how its OpenAI Batch line answers it, or None
    samples: Samples | None = None      # its record's n samples, n > 1
    stop_matcher: StopStringMatcher | None = None   # its stop strings
    cut_text: str | None = None         # its output text, cut before the stop string it hit
    context: tuple | None = None        # the prompt's last tokens and text its output is decoded after
    # output.reasoning_parser applies (a chat completion): whether its template had thinking on; None: it does not
    thinking: bool | None = None
    tools: ToolUse | None = None        # its tool calls are read from its completion (launcher.tools)
    logprobs: list = dataclasses.field(default_factory=list)    # per generated token: (logprob, [(token, logprob)])
    # scoring: per continuation token (logprob, rank: 1 where no other token is as likely)
    continuation_logprobs: list = dataclasses.field(default_factory=list)
    # sampling.prompt_logprobs: per prompt token after the first, (logprob, rank), and with k > 0
    # [(token, logprob)] of the k most likely third
    prompt_logprobs: list = dataclasses.field(default_factory=list)
    pooled: object = None               # embed, classify: what its prompt's chunks pooled so far (numpy)
    dimensions: int | None = None       # task embed: its vector's first k values only
    normalize: bool | None = None       # task embed: its request's use_activation (None: pooling.normalize)
    t_added: float = 0.0                # perf_counter when the engine received it
    t_first: float | None = None        # perf_counter of its first token


QWEN3_TURNS = ("<|im_start|>", "<|im_end|>")      # a ChatML turn's boundaries (vLLM's CHATML_TURN_BOUNDARIES)


class RecordCodec:
    """Records to sequences and finished sequences to result lines, for one job spec."""

    def __init__(self, spec, model, tokenizer: Tokenizer | None, output_format: str = "msinfer"):
        """spec: launcher.spec.JobSpec; model: sharding.config.ModelConfig."""
        self.spec, self.tok, self.model = spec, tokenizer, model
        self.vocab_size, self.hidden_size = model.vocab_size, model.hidden_size
        self.labels = model.labels                      # a classifier's (task classify)
        self.activation = model.classifier_activation
        eos = model.eos_token_ids
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = tuple(dict.fromkeys([*eos, tokenizer.eos_token_id]))
        self.eos = tuple(eos)
        # the end-of-sequence token vLLM stops at as its own (its stop_reason null); the others it
        # counts among the stop tokens (stop_reason: the token)
        self.primary_eos = tokenizer.eos_token_id if tokenizer is not None and tokenizer.eos_token_id is not None \
            else next(iter(eos), None)
        self.openai = output_format == "openai"
        self.embed = spec.task == "embed"
        self.pools = spec.task in POOLING_TASKS        # embed, classify: a prefill pools, nothing is generated
        self.reasoning = spec.output.reasoning_parser if tokenizer is not None else None
        self.tool_parser = spec.output.tool_call_parser
        self.think_ids: tuple[int, int] | None = None     # <think> and </think> (reasoning_end)
        self.defaults: tuple = (None, None)       # (the spec's sampling, its SamplingParams, completed)
        self.model_name = os.path.basename(os.path.normpath(spec.model.path))
        self.texts: dict[int, str] = {}           # token id -> its text (`token_text`)

    def token_text(self, token_id: int) -> str:
        """A token's own text (decoded alone), remembered: logprobs name the same few often."""
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = self.tok.token_text(token_id) if self.tok is not None else str(token_id)
        return text

    # ---- records in -----------------------------------------------------------------------------
    def sequences(self, rec: Record, serial: int) -> list[Sequence] | Done:
        """The record's sequences (one per sample, see Samples), or its error result. Raises
        SystemicError where the cause is not the record (launcher.tokenizer)."""
        spec = self.spec
        max_len = spec.model.max_model_len
        if rec.error:
            return self.error(serial, rec, rec.error)
        try:
            if rec.openai is not None and (rec.openai == EMBEDDINGS_URL) != self.embed:
                raise RecordError(f"record '{rec.id}': a {rec.openai} request " + (
                    f"generates, and the job's task is embed: give it a job of its own (task: generate)"
                    if self.embed else f"needs task: embed; the job's task is '{spec.task}'"))
            merged = spec.sampling.merge(rec.sampling, rec.id)
            if merged is self.defaults[0]:  # no overrides: one SamplingParams for all (a step's
                sampling = self.defaults[1]     # pickle then holds it once)
            else:
                try:
                    params = merged.to_params()
                except ValueError as e:     # a structured output that llguidance cannot read
                    raise RecordError(f"record '{rec.id}': sampling.structured_outputs: {e}") from None
                sampling = self.complete(params, rec)
                if merged is spec.sampling:
                    self.defaults = (merged, sampling)
            if rec.tools is not None and self.spec.task != "generate":
                raise RecordError(f"record '{rec.id}': has 'tools', which are for generated chat completions; the "
                                  f"job's task is '{self.spec.task}'")
            if rec.tool_use is not None:
                sampling = self.tool_sampling(rec, sampling)
            thinking = None
            if rec.prompts is not None:         # an OpenAI completions request's several prompts, as written
                if self.tok is None and not all(isinstance(p, list) for p in rec.prompts):
                    raise RecordError(f"record '{rec.id}': the model has no tokenizer, so prompts must be token ids")
                special = (rec.embed_options or {}).get("add_special_tokens") is not False
                prompts = [list(p) if isinstance(p, list) else self.tok.encode(p, special) for p in rec.prompts]
                if [] in prompts:
                    raise RecordError(f"record '{rec.id}': prompt[{prompts.index([])}] encodes to no tokens")
            elif self.tok is None:
                if rec.prompt_token_ids is None:
                    raise RecordError(f"record '{rec.id}': the model has no tokenizer, so records need "
                                      f"'prompt_token_ids'")
                prompts = [list(rec.prompt_token_ids)]
            else:
                # a scored prompt is scored as it is written (a template would change what is
                # scored), an OpenAI completions request's prompt is sent as written, and so is an
                # embedded one (its `messages` go through the template, without a generation
                # prompt unless they ask for one, as vLLM's embedding requests)
                scored = rec.continuation is not None or rec.continuation_token_ids is not None
                template = bool(spec.input.chat_template) and not scored and rec.openai is None and not self.pools
                prompts = [self.tok.encode_record(rec, template, spec.input.chat_template_kwargs,
                                                  generation_prompt=not self.pools)]
                thinking = self.thinking(rec, template)
            if k := sampling.truncate_prompt_tokens:    # -1: as many as fit, with room for a generated
                keep = max_len - (not self.pools) if k == -1 else k     # token unless it generates none
                # vLLM's sides: a generated prompt keeps its last k tokens, a pooled one (embed,
                # classify) its first k (its tokenizer's truncation_side "right" for pooling, which
                # an embeddings request's truncation_side may set)
                side = (rec.embed_options or {}).get("truncation_side", "right" if self.pools else "left")
                prompts = [ids[:keep] if side == "right" else ids[-keep:] for ids in prompts]
            continuation = self.continuation(rec)
            prompts = [ids + continuation for ids in prompts]
            for ids in prompts:
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise RecordError(f"record '{rec.id}': token id {bad[0]} is outside the vocabulary "
                                      f"(0..{self.vocab_size - 1})")
                if not fits(len(ids), bool(continuation) or self.pools, max_len):
                    raise RecordError(f"record '{rec.id}': the prompt and continuation have {len(ids)} tokens; "
                                      f"model.max_model_len is {max_len}" if continuation else
                                      f"record '{rec.id}': the prompt has {len(ids)} tokens; model.max_model_len "
                                      f"is {max_len}" if self.pools else
                                      f"record '{rec.id}': the prompt has {len(ids)} tokens; model.max_model_len "
                                      f"is {max_len}, which must also leave room for generated tokens")
            if (continuation or self.pools) and sampling.n > 1:
                done = "scored" if continuation else "embedded" if self.embed else "classified"
                raise RecordError(f"record '{rec.id}': sampling.n is {sampling.n}, but a{'n' * (done[0] == 'e')} "
                                  f"{done} record generates nothing; n applies to task: generate")
            dimensions = self.dimensions(rec)
        except RecordError as e:
            return self.error(serial, rec, str(e))
        # (vLLM waits for the reasoning where the model thinks: DeepSeek-R1 always, Qwen3 and V3.1
        # with thinking on; not for a chat request with include_reasoning false)
        if sampling.structured and thinking is not None and (thinking or self.reasoning == "deepseek_r1") \
                and rec.openai_reasoning and (gate := self.reasoning_end(prompts[0])) >= 0:
            sampling = dataclasses.replace(sampling, structured_after=gate)
        if not sampling.greedy:     # its draws' stream (greedy ones draw nothing: they share one SamplingParams)
            own = isinstance(rec.sampling, dict) and rec.sampling.get("seed") is not None
            sampling = dataclasses.replace(sampling, draw_key=draw_key(sampling.seed, None if own else rec.id))
        request, now = self.request(rec, sampling.logprobs), time.perf_counter()
        seqs = []
        for i in range(sampling.n * len(prompts)):     # prompt p's samples are choices p * n ... p * n + n - 1
            params = dataclasses.replace(sampling, index=i) if i else sampling
            seq = Sequence(prompts[i // sampling.n], params, rec.id, () if sampling.ignore_eos else self.eos, max_len)
            seq.num_score_tokens = len(continuation)
            stops = (StopStringMatcher(sampling.stop, sampling.include_stop_str_in_output)
                     if sampling.stop and self.tok else None)
            seq.record = RecordState(serial, rec.given_id, request, t_added=now, stop_matcher=stops,
                                     thinking=thinking, tools=rec.tool_use, dimensions=dimensions,
                                     normalize=(rec.embed_options or {}).get("use_activation"))
            seqs.append(seq)
        if len(seqs) > 1:
            samples = Samples(seqs)
            for i, seq in enumerate(seqs):
                seq.record.samples = samples
                seq.prefix_wait = i % sampling.n > 0    # a prompt is prefilled once, by its first sample
        return seqs

    def thinking(self, rec: Record, template: bool) -> bool | None:
        """For output.reasoning_parser: whether the record's chat template rendered with thinking on
        (its chat_template_kwargs over the job's: enable_thinking, on unless false; for deepseek_v3,
        DeepSeek-V3.1's `thinking` or enable_thinking, off unless true, as vLLM reads them); None
        where no parser applies:
        none is set, or the prompt is not a chat (token ids, text without the template), as vLLM's
        parsers apply to chat completions only."""
        if self.reasoning is None or rec.prompt_token_ids is not None:
            return None
        if rec.messages is None and not (template and self.tok.has_chat_template):
            return None
        kwargs = {**self.spec.input.chat_template_kwargs, **(rec.chat or {}).get("chat_template_kwargs", {})}
        if self.reasoning == "deepseek_v3":
            return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
        return kwargs.get("enable_thinking", True) is not False

    def reasoning_end(self, prompt_ids: list[int]) -> int:
        """For a structured output under output.reasoning_parser: the token after which its grammar
        applies, as vLLM holds a grammar back until the reasoning ends: </think>, unless the prompt
        has ended the reasoning already (its last think token is </think>: Qwen3's template with
        thinking off); -1 then. A prompt with neither waits for the model's </think>. As vLLM's
        Qwen3 parser, the search stops at the last turn's boundary (<|im_start|>, <|im_end|>): an
        earlier turn's </think> ended that turn's reasoning, not this one's."""
        if self.think_ids is None:      # (one token each: plan checks it, launcher.tokenizer.check_reasoning_tokens)
            self.think_ids = tuple(self.tok.encode(t, add_special_tokens=False)[0] for t in (THINK_START, THINK_END))
            self.turn_ids = frozenset(t for t in map(self.tok.tok.convert_tokens_to_ids, QWEN3_TURNS)
                                      if t is not None and t != self.tok.tok.unk_token_id) \
                if self.reasoning == "qwen3" else frozenset()
        start, end = self.think_ids
        for t in reversed(prompt_ids):
            if t == end:
                return -1
            if t == start or t in self.turn_ids:
                break
        return end

    def tool_sampling(self, rec: Record, sampling: SamplingParams) -> SamplingParams:
        """A record whose tool calls are read from its completion needs output.tool_call_parser (as
        vLLM needs --tool-call-parser), and keeps special tokens in its text: the call tags are
        special tokens in some tokenizers (vLLM's hermes parser does the same)."""
        if self.tool_parser is None:
            *names, last = PARSER_TOKENS
            raise RecordError(f"record '{rec.id}': tool_choice {rec.tool_use.said()} needs output.tool_call_parser "
                              f"in the job spec (the model's: {', '.join(names)} or {last}), as vLLM needs "
                              f"--tool-call-parser; or tool_choice 'none'")
        return dataclasses.replace(sampling, skip_special_tokens=False)

    def complete(self, p: SamplingParams, rec: Record) -> SamplingParams:
        """A record's sampling with what the workers need from the tokenizer and the model: its
        bad words' token ids, the token ids min_tokens holds back; its token ids checked against
        the vocabulary."""
        where = f"record '{rec.id}': sampling"
        if bad := outside_vocabulary(p, self.vocab_size):
            raise RecordError(f"{where}.{bad[0]}: token id {bad[1]} is outside the vocabulary "
                              f"(0..{self.vocab_size - 1})")
        extra = {}
        if self.pools and p.prompt_logprobs is not None:
            raise RecordError(f"{where}.prompt_logprobs: task {self.spec.task} computes no log-probabilities")
        if p.structured:
            from llguidance import LLMatcher
            if self.tok is None:
                raise RecordError(f"{where}.structured_outputs: the model has no tokenizer to build token masks with")
            error = LLMatcher.validate_grammar(p.structured, None)
            if error:
                raise RecordError(f"{where}.structured_outputs: {error.strip()}")
        if p.bad_words:
            if self.tok is None:
                raise RecordError(f"{where}.bad_words: the model has no tokenizer to encode them with")
            extra["bad_words_ids"] = tuple(ids for word in p.bad_words for ids in self.word_ids(word))
        if p.min_tokens:        # (the end-of-sequence ids also with ignore_eos, as vLLM's _all_stop_token_ids)
            extra["min_tokens_ban"] = tuple(dict.fromkeys([*self.eos, *p.stop_token_ids]))
        if self.pools:              # (a classifier's head reads the last token)
            extra["pooling"] = self.spec.pooling.type if self.embed else "last"
        return dataclasses.replace(p, **extra) if extra else p

    def dimensions(self, rec: Record) -> int | None:
        """task embed: how many of its vector's values a record keeps (its OpenAI request's
        `dimensions`, else pooling.dimensions), checked against the model's hidden size."""
        k = rec.dimensions if rec.dimensions is not None else self.spec.pooling.dimensions if self.embed else None
        if k is not None and (problem := self.matryoshka_problem(k)):
            raise RecordError(f"record '{rec.id}': dimensions {problem}")
        return k

    def matryoshka_problem(self, k: int) -> str | None:
        """Why a vector cannot be cut to its first k values, as vLLM refuses it: the model is no
        Matryoshka model (config.json says neither is_matryoshka nor matryoshka_dimensions), k is
        more than its hidden size, or not one of the sizes it lists."""
        return matryoshka_problem(self.model, k)

    def word_ids(self, word: str) -> list[tuple[int, ...]]:
        """A bad word's token ids as vLLM finds them: the word as it is, and with a space before
        it where that encodes to another first token and as many tokens."""
        plain = tuple(self.tok.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(self.tok.encode(" " + word.lstrip(), add_special_tokens=False))
        out = [plain] if plain else []
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
        return out

    def continuation(self, rec: Record) -> list[int]:
        """The token ids a record asks to score: its continuation with task: score, else none."""
        if rec.continuation is None and rec.continuation_token_ids is None:
            return []
        if self.spec.task != "score":
            raise RecordError(f"record '{rec.id}': has a continuation to score, but the job's task is "
                              f"'{self.spec.task}'; set task: score")
        if self.tok is None and rec.continuation_token_ids is None:
            raise RecordError(f"record '{rec.id}': the model has no tokenizer, so the continuation must be "
                              f"given as 'continuation_token_ids'")
        if self.tok is None:
            return list(rec.continuation_token_ids)
        return self.tok.encode_continuation(rec)

    def request(self, rec: Record, logprobs: int = 0) -> OpenAIRequest | None:
        """How an OpenAI Batch line answers the record (output.format openai): the url it was
        sent to (for a plain record: embeddings with task embed, else chat completions where a
        chat template applies), the log-probability alternatives it asked for (else `logprobs`,
        its sampling's: the job's default, or a plain record's own), whether its message
        holds the reasoning (include_reasoning), whether its embedding is base64 (encoding_format)
        and its echo (OpenAIRequest.echo). None with output.format msinfer."""
        if not self.openai:
            return None
        from msinfer.launcher.openai_batch import CHAT_URL, COMPLETIONS_URL
        chat = rec.messages is not None or (rec.prompt is not None and self.spec.input.chat_template
                                            and self.tok is not None and self.tok.has_chat_template)
        url = rec.openai or (EMBEDDINGS_URL if self.embed else CHAT_URL if chat else COMPLETIONS_URL)
        echo = None
        if rec.openai_echo == "chat":
            echo = ("chat", echoed_message(rec))
        elif rec.openai_echo:
            given = rec.prompts if rec.prompts is not None else [rec.prompt]
            echo = (rec.openai_echo, tuple(p if isinstance(p, str) else None for p in given))
        top = rec.openai_logprobs
        if top is None:         # the job's sampling.logprobs (or a plain record's own): computed, so answered
            top = logprobs or None
        forced = rec.tool_use is not None and rec.tool_use.choice != "auto"
        chat_keys = rec.chat or {}          # (vLLM's get_chat_request_role)
        opened = chat_keys.get("add_generation_prompt", not chat_keys.get("continue_final_message", False))
        role = "assistant" if opened or not rec.messages else str(rec.messages[-1].get("role", "assistant"))
        return OpenAIRequest(url, top, rec.openai_reasoning, rec.openai_base64, echo, forced, rec.openai_token_ids,
                             role)

    # ---- while it runs --------------------------------------------------------------------------
    def stop_string(self, seq: Sequence) -> bool:
        """Whether the text of the sequence's newest token completes one of its stop strings (its
        text is then cut before it, in `seq.record.cut_text`). As vLLM's detokenizer, the text of
        its first min_tokens tokens is not searched: a stop string must end after it."""
        out = len(seq.output_token_ids)
        if seq.record.stop_matcher is None or not out:
            return False
        text = self.decoded(seq)
        cut = seq.record.stop_matcher.check(text, search=out > seq.sampling.min_tokens)
        if cut is None:
            return False
        seq.record.cut_text = text[:cut]
        return True

    def text(self, seq: Sequence) -> str:
        return seq.record.cut_text if seq.record.cut_text is not None else self.decoded(seq)

    def decoded(self, seq: Sequence) -> str:
        """Its completion's text, decoded after its prompt's last tokens (Tokenizer.decode_after),
        without a trailing U+FFFD: the bytes of a character that the tokens so far leave
        incomplete (a sequence cut by max_new_tokens in the middle of an emoji), which vLLM's
        detokenizer holds back and never writes; one in the middle stays. A byte-fallback
        tokenizer (Llama 2, Mistral) decodes a run of byte tokens that ends incomplete all as
        U+FFFD, whole characters in it too: there the text without the last 1-3 tokens (the
        incomplete character's bytes) keeps them, as vLLM's character by character decoding does."""
        if seq.record.context is None:
            seq.record.context = self.tok.context(seq.prompt_token_ids, seq.sampling.skip_special_tokens)
        ids = seq.text_token_ids
        text = self.tok.decode_after(seq.record.context, ids)
        if not text.endswith("\ufffd"):
            return text
        shorter = (self.tok.decode_after(seq.record.context, ids[:-k]) for k in range(1, min(4, len(ids))))
        return max((text.rstrip("\ufffd"), *(t for t in shorter if not t.endswith("\ufffd"))), key=len)

    # ---- results out ----------------------------------------------------------------------------
    def result(self, seq: Sequence) -> Done:
        if seq.finish_reason in ("error", "abort"):
            message = seq.error or f"sequence {seq.finish_reason}"
            return self._done(seq.record.serial, error_result(seq.key, "InvalidRecord", message), seq.record.request,
                              given_id=seq.record.given_id)
        if seq.sampling.pooling:
            made = self.embedded(seq) if self.embed else classified(seq.record.pooled, self.labels, self.activation)
            return self._done(seq.record.serial, {"id": seq.key, **made, "prompt_tokens": seq.num_prompt_tokens,
                                                  "completion_tokens": 0, "error": None},
                              seq.record.request, given_id=seq.record.given_id)
        if seq.is_scoring:
            n = seq.num_score_tokens
            return self._done(seq.record.serial, score_result(seq.key, seq.prompt_token_ids[-n:],
                                                              seq.record.continuation_logprobs,
                                                              seq.num_prompt_tokens - n), given_id=seq.record.given_id)
        extra = {**self.stop_reason(seq), **self.logprobs(seq), **self.prompt_logprobs(seq), **self.echoed(seq)}
        fields, finish = self.message(seq) if self.tok is not None else (None, seq.finish_reason)
        result = ok_result(seq.key, seq.output_token_ids, fields, finish, seq.num_prompt_tokens, extra)
        return self._done(seq.record.serial, result, seq.record.request, self.ttft([seq]), seq.num_cached_tokens,
                          seq.record.given_id)

    def stop_reason(self, seq: Sequence) -> dict:
        """`stop_reason` where a stop string or a stop token ended the sequence, as vLLM's output
        names it: the string, or the token (one of stop_token_ids, or an end-of-sequence token other
        than the tokenizer's own: vLLM counts those among the stop tokens); nothing where the
        tokenizer's end-of-sequence token or a length limit ended it."""
        if seq.record.cut_text is not None and seq.record.stop_matcher is not None:
            return {"stop_reason": seq.record.stop_matcher.matched}
        token = seq.stop_token_id
        return {} if token is None or token == self.primary_eos else {"stop_reason": token}

    def embedded(self, seq: Sequence) -> dict:
        """A task embed sequence's `embedding`: a list of floats, or base64 for an OpenAI request
        that asks so."""
        from msinfer.launcher.embed import embedding, encoded
        pooling = self.spec.pooling
        normalize = pooling.normalize if seq.record.normalize is None else seq.record.normalize
        vector = embedding(seq.record.pooled, pooling.type, seq.num_prompt_tokens, normalize, seq.record.dimensions)
        as_base64 = seq.record.request is not None and seq.record.request.base64
        return {"embedding": encoded(vector, as_base64)}

    def samples_result(self, samples: Samples) -> Done:
        """The one result of a record's n samples: `outputs`, one entry per sample in order (an
        OpenAI embeddings request's several inputs: `embeddings`, one per input)."""
        first = samples.seqs[0]
        if first.sampling.pooling:
            result = {"id": first.key, "embeddings": [self.embedded(seq)["embedding"] for seq in samples.seqs],
                      "prompt_tokens": sum(seq.num_prompt_tokens for seq in samples.seqs), "completion_tokens": 0,
                      "error": None}
            return self._done(first.record.serial, result, first.record.request, given_id=first.record.given_id)
        outputs = []
        # an OpenAI request's several prompts with echo or prompt_logprobs: each choice holds its own
        # prompt's (from that prompt's first sample), else the result holds the one prompt's
        several = first.sampling.n < len(samples.seqs) and first.record.request is not None \
            and (first.record.request.echo is not None or first.sampling.prompt_logprobs is not None
                 or first.record.request.token_ids)
        prompts: dict[int, dict] = {}
        for i, seq in enumerate(samples.seqs):
            fields, finish = self.message(seq, i) if self.tok is not None else ({}, seq.finish_reason)
            outputs.append({"index": i, **fields, "output_token_ids": list(seq.output_token_ids),
                            "finish_reason": finish, **self.stop_reason(seq),
                            "completion_tokens": seq.num_completion_tokens, **self.logprobs(seq)})
            if several:
                p = i - i % seq.sampling.n
                if p not in prompts:
                    prompts[p] = self.prompt_logprobs(samples.seqs[p]) | self.echoed(samples.seqs[p])
                outputs[-1].update(prompts[p])
        result = {"id": first.key, "outputs": outputs,     # (each prompt's tokens once: its first sample's)
                  "prompt_tokens": sum(seq.num_prompt_tokens for seq in samples.seqs if not seq.prefix_wait),
                  "completion_tokens": sum(o["completion_tokens"] for o in outputs),
                  **({} if several else self.prompt_logprobs(first) | self.echoed(first)), "error": None}
        return self._done(first.record.serial, result, first.record.request, self.ttft(samples.seqs),
                          max(seq.num_cached_tokens for seq in samples.seqs), first.record.given_id)

    def message(self, seq: Sequence, index: int = 0) -> tuple[dict, str]:
        """Its text fields (`output_text`; with output.reasoning_parser, `reasoning`; for a record
        with tools, `tool_calls`) and its finish reason, as vLLM's chat completion gives them: the
        reasoning is split off first and the calls read from the rest; finish_reason "tool_calls"
        where tool_choice auto found calls, or "required" stopped after its calls; `index`: its
        choice among the record's samples."""
        text = self.text(seq)
        if seq.record.thinking is None:
            fields = {"output_text": text}
        else:
            reasoning, content = split_reasoning(self.reasoning, text, seq.record.thinking)
            fields = {"output_text": content or "", "reasoning": reasoning}
        use = seq.record.tools
        if use is None:
            return fields, seq.finish_reason
        content = fields["output_text"]
        if use.choice == "auto":
            found = parse_calls(self.tool_parser, content, use.tools)
            content, calls = (content, []) if found is None else (found[0] or "", found[1])
        else:                       # (an output its schema constrained: "" for the content, as vLLM)
            calls = constrained_calls(use, content) or []
            content = "" if calls else content
        calls = calls if use.parallel else calls[:1]
        finish = seq.finish_reason
        if calls and finish == "stop" and use.choice in ("auto", "required"):   # (vLLM's: a length cut
            finish = "tool_calls"                                           # stays; a named one stops)
        return {**fields, "output_text": content, "tool_calls": tool_calls_field(seq.key, index, calls)}, finish

    def logprob_entry(self, token: int, lp: float, top: list, rank: int | None = None) -> dict:
        """One token's `logprobs` entry: its id, its text (with a tokenizer), its log-probability,
        its rank where known (a prompt token's: how many tokens are at least as likely, as vLLM
        ranks it), and the most likely tokens as [id, log-probability, text] ([id,
        log-probability] without a tokenizer), as vLLM's and OpenAI's logprobs give each token's
        text beside it."""
        entry = {"token_id": token} if self.tok is None else {"token_id": token, "token": self.token_text(token)}
        entry["logprob"] = lp
        if rank is not None:
            entry["rank"] = rank
        entry["top"] = ([[t, v] for t, v in top] if self.tok is None
                        else [[t, v, self.token_text(t)] for t, v in top])
        return entry

    def logprobs(self, seq: Sequence) -> dict:
        if not seq.record.logprobs:
            return {}
        return {"logprobs": [self.logprob_entry(t, lp, top) for t, (lp, top) in zip(seq.output_token_ids,
                                                                                   seq.record.logprobs)]}

    def prompt_logprobs(self, seq: Sequence) -> dict:
        """As vLLM gives them: per prompt token, its log-probability given the ones before it
        (None for the first); with `prompt_logprobs: k` > 0, as `logprobs` entries with the
        token's rank and the k most likely alternatives. A preempted sequence computes them
        again: the first are kept."""
        if seq.sampling.prompt_logprobs is None:
            return {}
        scored = seq.record.prompt_logprobs[:seq.num_prompt_tokens - 1]
        if seq.sampling.prompt_logprobs:
            got = [self.logprob_entry(t, lp, top, rank)
                   for t, (lp, rank, top) in zip(seq.prompt_token_ids[1:], scored)]
        else:
            got = [lp for lp, _ in scored]
        if seq.record.request is None:
            return {"prompt_logprobs": [None, *got]}
        # an OpenAI line keys them by token id and gives their ranks (launcher.openai_batch)
        return {"prompt_logprobs": [None, *got], "prompt_ranks": [None, *(s[1] for s in scored)],
                "prompt_token_ids": list(seq.prompt_token_ids[:seq.num_prompt_tokens])}

    def echoed(self, seq: Sequence) -> dict:
        """An OpenAI completions request with echo (launcher.inputs): its prompt's token ids and
        text, which its answer puts before each choice's (launcher.openai_batch). The text is the
        prompt as written; decoded from the ids where it was token ids or was truncated. A chat
        completion's: the text before each choice's content (inputs.echoed_message)."""
        request = seq.record.request
        if request is None or request.echo is None and not request.token_ids:
            return {}
        ids = list(seq.prompt_token_ids[:seq.num_prompt_tokens])
        if request.echo is None:                # (return_token_ids alone: the ids)
            return {"prompt_token_ids": ids}
        if request.echo[0] == "chat":
            return {"prompt_text": request.echo[1], **({"prompt_token_ids": ids} if request.token_ids else {})}
        given = request.echo[1][seq.sampling.index // seq.sampling.n]       # (its prompt's: choices go n a prompt)
        text = given if given is not None and not seq.sampling.truncate_prompt_tokens else \
            self.tok.decode(ids) if self.tok is not None else ""
        return {"prompt_token_ids": ids, "prompt_text": text}

    @staticmethod
    def ttft(seqs: list[Sequence]) -> float | None:
        firsts = [seq.record.t_first for seq in seqs if seq.record.t_first is not None]
        return min(firsts) - seqs[0].record.t_added if firsts else None

    def error(self, serial: int, rec: Record, message: str) -> Done:
        return self._done(serial, error_result(rec.id, "InvalidRecord", message), self.request(rec),
                          given_id=rec.given_id)

    def _done(self, serial: int, result: dict, request=None, ttft: float | None = None, cached: int = 0,
              given_id: int | None = None) -> Done:
        """`cached`: prompt tokens found in the prefix cache (an OpenAI line's usage reports them);
        `given_id`: the record's integer id, which its msinfer line keeps as an integer (an OpenAI
        line's custom_id is a string)."""
        if given_id is not None and request is None:
            result["id"] = given_id
        line = result
        if request is not None:
            from msinfer.launcher.openai_batch import openai_line
            line = openai_line(result, request.url, request.top_logprobs, self.model_name, self.token_text, cached,
                               request.reasoning, request.echo[0] if request.echo else None, request.forced,
                               request.token_ids, request.role)
        error = result.get("error")
        cause = error["message"].replace(f"record '{result['id']}'", "a record") if error else None
        cut = any(o.get("finish_reason") == "length" for o in result.get("outputs") or [result])
        return Done(serial, json.dumps(line, ensure_ascii=False), bool(error), result.get("prompt_tokens") or 0,
                    result.get("completion_tokens") or 0, ttft, cause, cached, cut)


# ---- result lines -------------------------------------------------------------------------------

def outside_vocabulary(p: SamplingParams, vocab_size: int) -> tuple[str, int] | None:
    """The first of the token ids a sampling names (logit_bias, allowed_token_ids, stop_token_ids)
    that is outside the vocabulary, and its key; None where there is none."""
    for key, ids in (("logit_bias", [t for t, _ in p.logit_bias]), ("allowed_token_ids", p.allowed_token_ids),
                     ("stop_token_ids", p.stop_token_ids)):
        if bad := [t for t in ids if not 0 <= t < vocab_size]:
            return key, bad[0]
    return None


def ok_result(id: str, token_ids: list[int], text: str | dict | None, finish_reason: str, prompt_tokens: int,
              extra: dict | None = None) -> dict:
    """`text`: its `output_text`, or its text fields (RecordCodec.message); None where there is no
    tokenizer to decode with."""
    result = {"id": id}
    if text is not None:
        result.update(text if isinstance(text, dict) else {"output_text": text})
    result.update(output_token_ids=list(token_ids), finish_reason=finish_reason, prompt_tokens=prompt_tokens,
                  completion_tokens=len(token_ids))
    result.update(extra or {})
    result["error"] = None
    return result


def matryoshka_problem(model, k: int) -> str | None:
    """RecordCodec.matryoshka_problem's, for `model` (a ModelConfig)."""
    if not getattr(model, "matryoshka", False):
        return (f"{k}: the model does not support Matryoshka embeddings (its config.json has neither "
                f"is_matryoshka nor matryoshka_dimensions), so its vectors are not cut; leave dimensions unset")
    if k > model.hidden_size:
        return f"{k} is more than the model's hidden size {model.hidden_size}"
    if model.matryoshka_dimensions and k not in model.matryoshka_dimensions:
        return f"{k} is not one of the model's Matryoshka dimensions {list(model.matryoshka_dimensions)}"
    return None


def classified(logits, labels: tuple, activation: str = "") -> dict:
    """A classified record's fields (task classify): its classifier's `logits`, their `probs` and
    the most likely label's name (id2label). `activation` (ModelConfig.classifier_activation):
    "identity" (a regression's values), "sigmoid" (each label on its own), "softmax", or ""
    (softmax; a one-label model's, such as a reward model's, sigmoid), as vLLM's pooler."""
    z = np.asarray(logits, np.float64)
    if activation == "identity":
        probs = z
    elif activation == "sigmoid" or (len(z) == 1 and activation != "softmax"):
        probs = 1.0 / (1.0 + np.exp(-z))
    else:
        e = np.exp(z - z.max())
        probs = e / e.sum()
    return {"label": labels[int(np.argmax(z))],
            "logits": [float(x) for x in z], "probs": [float(x) for x in probs]}


def score_result(id: str, continuation_ids: list[int], scores: list[tuple], prompt_tokens: int) -> dict:
    """A scored record (task: score): log p of each continuation token given everything before it,
    and whether each was the most likely token there (lm-eval's is_greedy): `scores` holds
    (log-probability, rank) per token, rank 1 where no other token is as likely."""
    if len(scores) != len(continuation_ids):
        return error_result(id, "InternalError", f"{len(scores)} log-probabilities for "
                                                 f"{len(continuation_ids)} continuation tokens")
    logprobs = [lp for lp, _ in scores]
    return {"id": id, "continuation_token_ids": list(continuation_ids), "continuation_logprobs": logprobs,
            "continuation_logprob_sum": float(sum(logprobs)),
            "continuation_greedy": all(rank == 1 for _, rank in scores), "prompt_tokens": prompt_tokens,
            "completion_tokens": 0, "error": None}


def error_result(id: str, type: str, message: str) -> dict:
    return {"id": id, "error": {"type": type, "message": message}}
