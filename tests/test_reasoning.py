"""output.reasoning_parser: a chat completion's <think> text apart from its answer, as vLLM's
reasoning parsers of the same names split it, in msinfer's result lines and OpenAI's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from msinfer.launcher.tokenizer import load_tokenizer, split_reasoning
from tests.checkpoints import build_tokenizer

# Qwen3's template in small: thinking off puts an empty <think></think> in the prompt
THINK_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"
                  "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")


@pytest.fixture(scope="module")
def think_tok_dir(tmp_path_factory):
    """The test tokenizer with <think> and </think> as tokens of their own that are not special
    (the text keeps them), as Qwen3's and DeepSeek-R1's tokenizers have them."""
    from transformers import AutoTokenizer
    folder = build_tokenizer(tmp_path_factory.mktemp("think"), THINK_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(folder)
    hf.add_tokens(["<think>", "</think>"])
    hf.save_pretrained(folder)
    return folder


@pytest.mark.unit
@pytest.mark.parametrize("parser, text, thinking, want", [
    ("qwen3", "<think>\nplan\n</think>\n\nParis", True, ("\nplan\n", "\n\nParis")),
    ("qwen3", "plan</think>Paris", True, ("plan", "Paris")),              # <think> opened in the prompt
    ("qwen3", "<think>plan</think>", True, ("plan", None)),                # stopped right after thinking
    ("qwen3", "<think>still thinking", True, ("still thinking", None)),   # cut by max_new_tokens
    ("qwen3", "Paris", True, ("Paris", None)),
    ("qwen3", "Paris", False, (None, "Paris")),                           # enable_thinking false
    ("qwen3", "a</think>b</think>c", False, (None, "a</think>b</think>c")),   # not thinking: as it is
    ("qwen3", "<think>plan\n<tool_call>{}</tool_call>", True, ("plan\n", "<tool_call>{}</tool_call>")),  # a call
    ("qwen3", "plan <tool_call>{}</tool_call>", True, ("plan ", "<tool_call>{}</tool_call>")),  # ends the thinking
    ("qwen3", "<think></think>Paris", True, (None, "Paris")),             # empty reasoning: None
    ("qwen3", "a</think>b</think>c", True, ("a", "bc")),                  # a second </think> dropped
    ("qwen3", "x<think>a<think>b</think>c", True, ("xab", "c")),          # and every <think> in the reasoning
    ("deepseek_r1", "plan</think>Paris", True, ("plan", "Paris")),
    ("deepseek_r1", "Paris", False, ("Paris", None)),                      # R1 has no switch
    ("deepseek_v3", "plan</think>Paris", True, ("plan", "Paris")),         # V3.1 thinking: R1's split
    ("deepseek_v3", "plan</think>Paris", False, (None, "plan</think>Paris")),   # not thinking: as it is
])
def test_a_completion_splits_where_vllms_parser_splits_it(parser, text, thinking, want):
    assert split_reasoning(parser, text, thinking) == want


@pytest.mark.unit
def test_a_gated_grammar_is_fed_only_the_tokens_after_its_gate_also_when_a_history_is_rebuilt():
    """worker.sampler.History with SamplingParams.structured_after: nothing constrained or fed
    before the gate token; the tokens after it fed in order, also to a history rebuilt from an
    output that holds the gate already (a preempted or restarted sequence)."""
    from msinfer.worker.sampler import History

    class Matcher:                      # llguidance.LLMatcher's calls that History makes
        def __init__(self):
            self.fed = []

        def consume_token(self, t):
            self.fed.append(t)

        def consume_tokens(self, ts):
            self.fed += ts

        def is_error(self):
            return False

        def compute_bitmask(self):
            return bytes([0b101])

    m = Matcher()
    h = History([1, 2], [], m, gate=9)
    assert h.active is None and h.allowed(8) is None
    for t in (5, 6, 9, 3, 9):
        h.add(t)
    assert m.fed == [3, 9] and h.active is m and h.allowed(3).tolist() == [True, False, True]
    again = Matcher()
    assert History([1, 2], [5, 9, 3, 9], again, gate=9).active is again and again.fed == [3, 9]
    waiting = Matcher()
    assert History([1, 2], [5, 6], waiting, gate=9).active is None and waiting.fed == []
    plain = Matcher()
    assert History([1], [5, 9], plain).active is plain and plain.fed == [5, 9]


def test_result_lines_carry_the_reasoning_beside_the_answer_for_chat_prompts_only(think_tok_dir):
    from msinfer.launcher.inputs import parse_openai, parse_record
    from msinfer.launcher.records import RecordCodec
    from msinfer.launcher.spec import JobSpec
    tok = load_tokenizer(think_tok_dir)

    def codec(fmt="msinfer", **output):
        spec = JobSpec.model_validate({"model": {"path": "m", "max_model_len": 512}, "input": {"path": "in.jsonl"},
                                       "output": {"path": "out.jsonl", "reasoning_parser": "qwen3", **output}})
        return RecordCodec(spec, SimpleNamespace(vocab_size=len(tok.tok), hidden_size=64, labels=(),
                                                 classifier_activation="", eos_token_ids=(2,)), tok, fmt)

    def done(c, rec, text, finish="stop"):
        """The record's result line once each of its sequences has generated `text`."""
        seqs = c.sequences(rec, 0)
        for seq in seqs:
            seq.output_token_ids, seq.finish_reason = tok.encode(text, add_special_tokens=False), finish
        return json.loads((c.samples_result(seqs[0].record.samples) if len(seqs) > 1 else c.result(seqs[0])).line)

    msgs = [{"role": "user", "content": "hello world"}]
    line = done(codec(), parse_record({"id": "a", "messages": msgs}, 1), "<think>be brief</think>Paris")
    assert (line["output_text"], line["reasoning"]) == ("Paris", "be brief")
    assert line["output_token_ids"] == tok.encode("<think>be brief</think>Paris", add_special_tokens=False)
    cut = done(codec(), parse_record({"id": "b", "prompt": "hello world"}, 2), "<think>be brief", "length")
    assert (cut["output_text"], cut["reasoning"]) == ("", "be brief")
    off = parse_record({"id": "c", "messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}, 3)
    plain = done(codec(), off, "Paris")
    assert (plain["output_text"], plain["reasoning"]) == ("Paris", None)       # thinking off: all answer
    ids = parse_record({"id": "d", "prompt_token_ids": tok.encode("hello world")}, 4)   # not a chat: as written
    raw = done(codec(), ids, "<think>be brief</think>Paris")
    assert raw["output_text"] == "<think>be brief</think>Paris" and "reasoning" not in raw
    two = done(codec(), parse_record({"id": "e", "messages": msgs, "sampling": {"n": 2, "temperature": 1}}, 5),
               "be brief</think>Paris")
    assert [(o["output_text"], o["reasoning"]) for o in two["outputs"]] == [("Paris", "be brief")] * 2

    def request(custom_id, body, url="/v1/chat/completions"):
        return parse_openai({"custom_id": custom_id, "url": url, "body": body}, 1)

    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    chat = done(codec("openai"), request("q", {"messages": msgs}), "<think>be brief</think>Paris")["response"]["body"]
    message = ChatCompletion.model_validate(chat).choices[0].message
    assert (message.content, message.reasoning) == ("Paris", "be brief")
    hidden = done(codec("openai"), request("h", {"messages": msgs, "include_reasoning": False}), "a</think>Paris")
    assert hidden["response"]["body"]["choices"][0]["message"] | {"role": "", "refusal": None} == {
        "role": "", "content": "Paris", "refusal": None, "reasoning": None}          # vLLM's include_reasoning
    thought = done(codec("openai"), request("r", {"messages": msgs}), "be brief", "length")["response"]["body"]
    assert thought["choices"][0]["message"] == {"role": "assistant", "content": None, "refusal": None,
                                                     "reasoning": "be brief"}
    text = done(codec("openai"), request("s", {"prompt": "hello"}, "/v1/completions"), "<think>a</think>b")
    assert Completion.model_validate(text["response"]["body"]).choices[0].text == "<think>a</think>b"
    unset = done(codec(reasoning_parser=None), parse_record({"id": "f", "messages": msgs}, 6), "<think>a</think>b")
    assert unset["output_text"] == "<think>a</think>b" and "reasoning" not in unset
    v3 = codec(reasoning_parser="deepseek_v3")            # DeepSeek-V3.1: thinking only where the template was told
    plain = done(v3, parse_record({"id": "g", "messages": msgs}, 7), "a</think>b")
    assert (plain["output_text"], plain["reasoning"]) == ("a</think>b", None)
    told = parse_record({"id": "h", "messages": msgs, "chat_template_kwargs": {"thinking": True}}, 8)
    assert (done(v3, told, "a</think>b")["reasoning"], done(v3, told, "a</think>b")["output_text"]) == ("a", "b")


def test_plan_refuses_a_reasoning_parser_for_a_tokenizer_without_think_tokens(checkpoint, think_tok_dir, tmp_path):
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.job import plan_job, result_settings
    from msinfer.launcher.spec import JobSpec
    path = str(checkpoint("llama_gqa_tied"))

    def spec(**extra):
        return JobSpec.model_validate({"model": {"path": path, "max_model_len": 512, **extra.pop("model", {})},
                                       "input": {"path": "in.jsonl"}, **extra,
                                       "output": {"path": "out.jsonl", "reasoning_parser": "deepseek_r1"}})

    with pytest.raises(SpecError, match=r"output.reasoning_parser 'deepseek_r1' splits a completion at <think> and "
                                        r"</think>, but the tokenizer in .* has no token <think> or </think>"):
        plan_job(spec(model={"tokenizer": str(build_tokenizer(tmp_path / "plain"))}), check_io=False)
    with pytest.raises(SpecError, match=r"output.reasoning_parser 'deepseek_r1' splits a completion's text, and the "
                                        r"model has no tokenizer in"):
        plan_job(spec(), check_io=False)
    with pytest.raises(SpecError, match=r"output.reasoning_parser 'deepseek_r1' splits generated text, and task: "
                                        r"score generates none"):
        plan_job(spec(task="score", model={"tokenizer": str(think_tok_dir)}), check_io=False)
    plan = plan_job(spec(model={"tokenizer": str(think_tok_dir)}), check_io=False)
    assert result_settings(plan)["output"]["reasoning_parser"] == "deepseek_r1"


def test_a_structured_output_starts_after_the_reasoning_as_in_vllm(checkpoint, think_tok_dir):
    """With a reasoning parser, vLLM holds a structured output's grammar back until the reasoning
    ends (</think>), so that the model thinks freely and then answers in the constrained form; a
    prompt that ends the reasoning itself (Qwen3's template with thinking off) is constrained from
    the first token. Greedy, a small random model with the think tokenizer, in-process engine."""
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import JobSpec
    from tests.engine_driver import run_engine
    tok = load_tokenizer(think_tok_dir)
    end = tok.encode("</think>", add_special_tokens=False)[0]

    def run(parser, records):          # (without a parser: test_sampling's structured outputs)
        spec = JobSpec.model_validate({
            "model": {"path": str(checkpoint("qwen2_tied_5_layers")), "tokenizer": str(think_tok_dir),
                      "max_model_len": 64},
            "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl", "reasoning_parser": parser},
            "sampling": {"max_new_tokens": 6}, "scheduler": {"max_batch_size": 4, "max_batched_tokens": 64}})
        return run_engine(plan_job(spec, check_io=False), records)[0]

    msgs = [{"role": "user", "content": "hello world"}]
    choice = {"structured_outputs": {"choice": ["red", "blue"]}}
    forced = {**choice, "logit_bias": {str(end): 100}}       # </think> first, wherever the grammar allows it
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    lines = run("qwen3", [{"id": "free", "messages": msgs},
                          {"id": "thinking", "messages": msgs, "sampling": choice},
                          {"id": "forced", "messages": msgs, "sampling": forced},
                          {"id": "off", "messages": msgs, "sampling": choice, **off}])
    free = lines["free"]["output_token_ids"]
    assert end not in free and tok.decode(free) not in ("red", "blue")
    assert lines["thinking"]["output_token_ids"] == free            # no </think>: the grammar never began
    assert lines["forced"]["output_token_ids"][0] == end
    assert (lines["forced"]["reasoning"], lines["forced"]["output_text"]) in ((None, "red"), (None, "blue"))
    assert lines["forced"]["finish_reason"] == "stop"
    assert lines["off"]["output_text"] in ("red", "blue") and lines["off"]["reasoning"] is None


@pytest.mark.unit
def test_the_grammar_waits_for_this_turns_reasoning_only_as_vllms_qwen3_parser(tmp_path):
    """Where a structured output starts under the qwen3 parser, as vLLM's: a prompt's last turn
    decides (an earlier turn's </think>, as in a tool loop, does not end this turn's reasoning),
    and with thinking off the grammar applies from the first token even where the template writes
    no empty think block."""
    from transformers import AutoTokenizer
    from msinfer.launcher.inputs import parse_record
    from msinfer.launcher.records import RecordCodec
    from msinfer.launcher.spec import JobSpec
    folder = build_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(folder)
    hf.add_tokens(["<think>", "</think>", "<|im_start|>", "<|im_end|>"])
    hf.save_pretrained(folder)
    tok = load_tokenizer(folder)
    start, end, im_start, im_end = (tok.encode(t, add_special_tokens=False)[0]
                                    for t in ("<think>", "</think>", "<|im_start|>", "<|im_end|>"))
    spec = JobSpec.model_validate({"model": {"path": "m", "max_model_len": 64}, "input": {"path": "in.jsonl"},
                                   "output": {"path": "out.jsonl", "reasoning_parser": "qwen3"},
                                   "sampling": {"structured_outputs": {"choice": ["red", "blue"]}}})
    codec = RecordCodec(spec, SimpleNamespace(vocab_size=len(tok.tok), hidden_size=64, labels=(),
                                              classifier_activation="", eos_token_ids=(2,)), tok)
    earlier_turn = [im_start, 5, im_end, im_start, 7, start, 8, end, im_end, im_start, 9]
    assert codec.reasoning_end(earlier_turn) == end                      # waits for this turn's </think>
    assert codec.reasoning_end([im_start, 9, start, 8, end]) == -1       # this turn's thinking ended
    off = parse_record({"messages": [{"role": "user", "content": "hello"}],
                        "chat_template_kwargs": {"enable_thinking": False}}, 1)
    on = parse_record({"messages": [{"role": "user", "content": "hello"}]}, 2)
    assert [codec.sequences(r, 0)[0].sampling.structured_after for r in (off, on)] == [-1, end]
    from msinfer.launcher.inputs import parse_openai           # include_reasoning false: from the first token
    hidden = parse_openai({"custom_id": "h", "url": "/v1/chat/completions", "method": "POST", "body": {
        "messages": [{"role": "user", "content": "hello"}], "include_reasoning": False}}, 3)
    assert codec.sequences(hidden, 0)[0].sampling.structured_after == -1
