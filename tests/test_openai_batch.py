"""OpenAI Batch API files: request lines in, output lines that the `openai` package's own types
parse, a 400 line for a request msinfer cannot serve, resume by custom_id, also of a torn file."""

from __future__ import annotations

import json

import pytest

from msinfer.launcher.inputs import parse_openai
from msinfer.launcher.openai_batch import openai_line
from msinfer.launcher.records import error_result, ok_result

CHAT = "/v1/chat/completions"


def request(custom_id, body, url=CHAT, **extra):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}


@pytest.mark.unit
def test_a_request_becomes_a_record_with_its_sampling():
    rec = parse_openai(request("a", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                     "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                                     "stop": "\n", "logprobs": True, "top_logprobs": 2}), 1)
    assert rec.error is None and rec.id == "a" and rec.openai == CHAT and rec.messages[0]["content"] == "hi"
    assert rec.sampling == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n"],
                            "logprobs": 2}
    assert rec.openai_logprobs == 2
    text = parse_openai(request("b", {"prompt": "Once", "max_tokens": 4, "logprobs": 0}, "/v1/completions"), 2)
    assert text.error is None and text.prompt == "Once" and text.sampling == {"max_new_tokens": 4, "logprobs": 1}
    assert text.openai_logprobs == 0
    ids = parse_openai(request("c", {"prompt": [5, 6, 7]}, "/v1/completions"), 3)
    assert ids.error is None and ids.prompt_token_ids == [5, 6, 7]
    tuned = parse_openai(request("d", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                       "presence_penalty": 0.5, "frequency_penalty": -0.25,
                                       "logit_bias": {"50256": -100}, "top_k": -1, "min_p": 0.1,
                                       "repetition_penalty": 1.1, "min_tokens": 3}), 4)
    assert tuned.error is None and tuned.sampling == {
        "n": 2, "presence_penalty": 0.5, "frequency_penalty": -0.25, "logit_bias": {"50256": -100}, "top_k": -1,
        "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 3}
    from msinfer.launcher.spec import SamplingSpec
    params = SamplingSpec().merge(tuned.sampling, "d").to_params()
    assert params.logit_bias == ((50256, -100.0),) and params.top_k == 0          # vLLM's -1: no top-k
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    shaped = parse_openai(request("e", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}}), 5)
    assert shaped.error is None and shaped.sampling == {"structured_outputs": {"json": schema}}
    obj = parse_openai(request("f", {"messages": [{"role": "user", "content": "hi"}],
                                     "response_format": {"type": "json_object"}}), 6)
    assert obj.sampling == {"structured_outputs": {"json_object": True}}


@pytest.mark.unit
@pytest.mark.unit
def test_vllms_reasoning_effort_is_a_template_variable_and_its_scheduling_keys_change_nothing():
    """vLLM's chat body keys: reasoning_effort goes to the template as a variable and turns
    enable_thinking on (off for "none") unless chat_template_kwargs sets it; priority, request_id
    and stream_options (which a batch has no use for) are taken and change nothing."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    low = parse_openai(request("a", {**chat, "reasoning_effort": "low", "priority": 5, "request_id": "r-1",
                                     "stream_options": {"include_usage": True}}), 1)
    assert low.error is None and low.chat == {"chat_template_kwargs": {"enable_thinking": True,
                                                                       "reasoning_effort": "low"}}
    off = parse_openai(request("b", {**chat, "reasoning_effort": "none"}), 2)
    assert off.chat["chat_template_kwargs"] == {"enable_thinking": False, "reasoning_effort": "none"}
    kept = parse_openai(request("c", {**chat, "reasoning_effort": "none",
                                      "chat_template_kwargs": {"enable_thinking": True}}), 3)
    assert kept.chat["chat_template_kwargs"] == {"enable_thinking": True, "reasoning_effort": "none"}
    bad = parse_openai(request("d", {**chat, "reasoning_effort": "extreme"}), 4)
    assert bad.error == ("line 4: 'reasoning_effort' must be one of none, minimal, low, medium, high, xhigh, max, "
                         "got str 'extreme'")
    assert parse_openai(request("e", {"prompt": "hi", "reasoning_effort": "low"}, "/v1/completions"), 5).error == \
        "line 5: unknown body key 'reasoning_effort'"


def test_vllms_structured_output_keys_in_a_body_constrain_the_output_as_in_vllm():
    """A batch file written for vLLM's run-batch gives structured outputs in vLLM's body keys: its
    `structured_outputs` object, or before it guided_json / guided_regex / guided_choice /
    guided_grammar. Each was an unknown key (a 400 for every line); now each is the record's
    sampling.structured_outputs, and the record's output follows it."""
    from msinfer.launcher.spec import SamplingSpec
    msgs = [{"role": "user", "content": "Pick a color"}]
    schema = {"type": "object", "properties": {"c": {"type": "string"}}}
    for body, want in [({"guided_json": schema}, {"json": schema}),
                       ({"guided_json": json.dumps(schema)}, {"json": json.dumps(schema)}),
                       ({"guided_regex": "[a-z]+"}, {"regex": "[a-z]+"}),
                       ({"guided_choice": ["red", "blue"]}, {"choice": ["red", "blue"]}),
                       ({"guided_grammar": 'start: "a"'}, {"grammar": 'start: "a"'}),
                       ({"structured_outputs": {"choice": ["red"]}}, {"choice": ["red"]}),
                       ({"guided_json": schema, "guided_decoding_backend": "xgrammar"}, {"json": schema})]:
        rec = parse_openai(request("g", {"messages": msgs, **body}), 1)
        assert rec.error is None and rec.sampling == {"structured_outputs": want}, body
        assert SamplingSpec().merge(rec.sampling, "g").structured_outputs is not None
    two = parse_openai(request("g", {"messages": msgs, "guided_regex": "a",
                                     "response_format": {"type": "json_object"}}), 2)
    assert two.error == "line 2: 'guided_regex' and 'response_format' each constrain the output; give one"
    bad = parse_openai(request("g", {"messages": msgs, "structured_outputs": "json"}), 3)
    assert bad.error == "line 3: 'structured_outputs' must be an object such as {\"json\": <schema>}, got str 'json'"
    rec = parse_openai(request("g", {"messages": msgs, "spaces_between_special_tokens": False}), 5)
    assert rec.error == "line 5: 'spaces_between_special_tokens' is not supported by msinfer yet"
    rec = parse_openai(request("g", {"messages": msgs, "include_reasoning": "no"}), 5)
    assert rec.error == "line 5: 'include_reasoning' must be true or false, got str 'no'"


@pytest.mark.unit
@pytest.mark.parametrize("line, message", [
    (request("x", {"messages": [{"role": "user", "content": "hi"}]}, "/v1/responses"),
     "line 4: url '/v1/responses' is not one of /v1/chat/completions, /v1/completions, /v1/embeddings"),
    (request("x", {"prompt": "hi", "best_of": 3}, "/v1/completions"),
     "line 4: 'best_of' is not supported by msinfer yet"),
    (request("x", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "/v1/completions"),
     "line 4: unknown body key 'tools'"),
    (request("x", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}),
     "line 4: 'response_format' type 'xml' is not one of text, json_object, json_schema"),
    (request("x", {"prompt": ["a", ""]}, "/v1/completions"), "line 4: 'prompt[1]' is empty"),
    (request("x", {"prompt": [1, "a"]}, "/v1/completions"),
     "line 4: 'prompt' must be a non-empty string, a list of token ids, or a list of several prompts (strings, or "
     "lists of token ids)"),
    (request("x", {"prompt": "hi", "echo": "yes"}, "/v1/completions"), "line 4: 'echo' must be true or false, got str 'yes'"),
    (request("x", {"messages": [{"role": "user", "content": "hi"}], "temprature": 1}),
     "line 4: unknown body key 'temprature'"),
    (request("x", {"prompt": "hi"}), "line 4: the body of a /v1/chat/completions request needs 'messages'"),
    (request("x", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}),
     "line 4: 'top_logprobs' must be an integer from 0 to 20"),
    (request("x", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}),
     "line 4: 'logprobs' must be true or false, got int 2"),
    (request("x", {"messages": [{"role": "user", "content": "hi"}], "logprobs": "true"}),
     "line 4: 'logprobs' must be true or false, got str 'true'"),
    (request("x", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
     "line 4: 'top_logprobs' asks for alternatives, and 'logprobs' is not true; set \"logprobs\": true"),
    ({"custom_id": "x", "method": "POST", "url": CHAT},
     "line 4: the request has no 'body' (the /v1/chat/completions request itself)"),
])
def test_a_request_msinfer_cannot_serve_is_that_requests_error(line, message):
    rec = parse_openai(line, 4)
    assert rec.id == "x" and rec.error == message


@pytest.mark.unit
def test_a_jsonl_file_is_a_batch_file_by_its_first_json_object_and_a_request_keeps_its_custom_id(tmp_path):
    """output.format auto: a line that is not JSON, or an empty file, before the first request
    does not make every result msinfer's; a request without its body, or a custom_id without a
    url, is a request whose error line keeps its custom_id. A chat request's logprobs 1 is true
    (vLLM reads it so)."""
    from msinfer.launcher.inputs import is_openai_batch, read_records
    good = json.dumps(request("c1", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
    (tmp_path / "in.jsonl").write_text('{"custom_id": "c0", "url": "/v1/chat/completions"\n' + good + "\n"
                                       + json.dumps({"custom_id": "nobody", "url": CHAT}) + "\n")
    assert is_openai_batch(tmp_path / "in.jsonl")
    bad, ok, nobody = read_records(tmp_path / "in.jsonl")
    assert bad.error == "line 1: invalid JSON (the line ends before its JSON does): Expecting ',' delimiter at column 50"
    assert ok.error is None and (nobody.id, nobody.error) == (
        "nobody", "line 3: the request has no 'body' (the /v1/chat/completions request itself)")
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "a.jsonl").write_text("\n")
    (tmp_path / "parts" / "b.jsonl").write_text(good + "\n")
    assert is_openai_batch(tmp_path / "parts")
    (tmp_path / "parts" / "b.jsonl").write_text('{"id": "n", "prompt": "hi"}\n' + good + "\n")
    assert not is_openai_batch(tmp_path / "parts")
    rec = parse_openai(request("x", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1,
                                     "top_logprobs": 2}), 1)
    assert rec.error is None and rec.openai_logprobs == 2


@pytest.mark.unit
def test_echo_puts_the_prompt_and_its_log_probabilities_before_each_choice_as_vllm_does():
    """A completions request with echo (vLLM's): its logprobs k asks for prompt_logprobs at k;
    max_tokens 0 generates one token and answers with the prompt alone. The answer's text is the
    prompt's, as written, then the choice's; its logprobs run over the prompt's tokens (None for
    the first) and then the choice's, with one text offset scale."""
    from openai.types import Completion
    rec = parse_openai(request("e", {"prompt": "Hi there", "echo": True, "logprobs": 2, "max_tokens": 3},
                               "/v1/completions"), 1)
    assert rec.error is None and rec.openai_echo == "all"
    assert rec.sampling["prompt_logprobs"] == 2 and rec.sampling["logprobs"] == 2 and rec.sampling["max_new_tokens"] == 3
    only = parse_openai(request("e0", {"prompt": [5, 6], "echo": True, "max_tokens": 0}, "/v1/completions"), 1)
    assert only.error is None and only.openai_echo == "prompt" and only.sampling["max_new_tokens"] == 1
    assert "prompt_logprobs" not in only.sampling                              # no logprobs asked
    result = ok_result("e", [11, 12], " Paris.", "length", 3,
                       {"logprobs": [{"logprob": -0.1, "top": [[11, -0.1], [13, -2.5]]},
                                     {"logprob": -0.2, "top": [[12, -0.2], [14, -3.0]]}],
                        "prompt_logprobs": [None, {"logprob": -4.0, "top": [[7, -1.0], [8, -4.0]]},
                                            {"logprob": -0.5, "top": [[9, -0.5], [7, -2.0]]}],
                        "prompt_token_ids": [5, 8, 9], "prompt_ranks": [None, 2, 1], "prompt_text": "Hi there"})
    text = lambda t: f"<{t}>"                                                     # noqa: E731
    # the first prompt token has no log-probability: null, as OpenAI's and vLLM's answers have it
    # (where the openai package's Completion type wants floats)
    choice = openai_line(result, "/v1/completions", 2, "m", text, echo="all")["response"]["body"]["choices"][0]
    assert choice["text"] == "Hi there Paris."
    assert choice["logprobs"]["tokens"] == ["<5>", "<8>", "<9>", "<11>", "<12>"]
    assert choice["logprobs"]["token_logprobs"] == [None, -4.0, -0.5, -0.1, -0.2]
    assert choice["logprobs"]["top_logprobs"] == [None, {"<7>": -1.0, "<8>": -4.0}, {"<9>": -0.5, "<7>": -2.0},
                                                  {"<11>": -0.1, "<13>": -2.5}, {"<12>": -0.2, "<14>": -3.0}]
    assert choice["logprobs"]["text_offset"] == [0, 3, 6, 9, 13]
    # vLLM's (OpenAI's "logprobs + 1"): the token's own first, then the k most likely, so that with
    # logprobs 1 a token that is not the most likely comes with the one that is
    assert [list(d) if d else d for d in choice["logprobs"]["top_logprobs"]] == \
        [None, ["<8>", "<7>"], ["<9>", "<7>"], ["<11>", "<13>"], ["<12>", "<14>"]]
    one = openai_line(result, "/v1/completions", 1, "m", text, echo="all")["response"]["body"]["choices"][0]
    assert one["logprobs"]["top_logprobs"][1:3] == [{"<8>": -4.0, "<7>": -1.0}, {"<9>": -0.5}]
    assert Completion.model_validate(openai_line(result, "/v1/completions", None, "m", text, echo="all")
                                     ["response"]["body"]).choices[0].text == "Hi there Paris."
    alone = openai_line(result, "/v1/completions", 2, "m", text, echo="prompt")["response"]["body"]["choices"][0]
    assert alone["text"] == "Hi there" and alone["logprobs"]["tokens"] == ["<5>", "<8>", "<9>"]
    plain = openai_line(result, "/v1/completions", None, "m", text, echo="all")["response"]["body"]["choices"][0]
    assert plain["text"] == "Hi there Paris." and plain["logprobs"] is None
    floats = dict(result, prompt_logprobs=[None, -4.0, -0.5])                  # prompt_logprobs 0: the values
    zero = openai_line(floats, "/v1/completions", 0, "m", text, echo="all")["response"]["body"]["choices"][0]
    assert zero["logprobs"]["token_logprobs"][:3] == [None, -4.0, -0.5]
    assert zero["logprobs"]["top_logprobs"][1:] == [{"<8>": -4.0}, {"<9>": -0.5}, {"<11>": -0.1}, {"<12>": -0.2}]


@pytest.mark.unit
def test_a_chat_echo_puts_the_last_message_of_the_answers_role_before_each_choice_as_vllm_does():
    """vLLM's chat echo: the last message's text goes before each choice's content where that
    message is in the answer's role: the assistant's when the template opens a new message
    (add_generation_prompt, the default unless continue_final_message), else any role; a content
    list's text parts joined by newlines. Content only: the log-probabilities stay the choice's."""
    from openai.types.chat import ChatCompletion
    from msinfer.launcher.inputs import echoed_message
    user = {"role": "user", "content": "Name a colour."}
    said = {"role": "assistant", "content": "The colour is"}
    cases = [({"messages": [user]}, ""),
             ({"messages": [user, said]}, "The colour is"),
             ({"messages": [user, said], "continue_final_message": True}, "The colour is"),
             ({"messages": [user], "add_generation_prompt": False}, "Name a colour."),
             ({"messages": [user, {"role": "assistant", "content": [{"type": "text", "text": "A"},
                                                                    {"type": "text", "text": "B"}]}]}, "A\nB")]
    for body, echoed in cases:
        rec = parse_openai(request("c", {**body, "echo": True, "max_tokens": 2}), 1)
        assert rec.error is None and rec.openai_echo == "chat", rec.error
        assert echoed_message(rec) == echoed, body
    result = {"id": "c", "outputs": [{"index": 0, "output_text": " red.", "output_token_ids": [11, 12],
                                      "finish_reason": "stop", "completion_tokens": 2,
                                      "logprobs": [{"logprob": -0.1, "top": []}, {"logprob": -0.2, "top": []}]},
                                     {"index": 1, "output_text": "", "output_token_ids": [13], "finish_reason": "stop",
                                      "completion_tokens": 1, "logprobs": [{"logprob": -0.3, "top": []}],
                                      "tool_calls": [{"id": "call_1", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]}],
              "prompt_tokens": 9, "completion_tokens": 3, "prompt_text": "The colour is", "error": None}
    body = openai_line(result, CHAT, 0, "m", lambda t: f"<{t}>", echo="chat")["response"]["body"]
    chat = ChatCompletion.model_validate(body)
    assert chat.choices[0].message.content == "The colour is red."
    assert [c.token for c in chat.choices[0].logprobs.content] == ["<11>", "<12>"]
    assert chat.choices[1].message.content == "The colour is" and chat.choices[1].message.tool_calls
    plain = openai_line(result, CHAT, None, "m", str)["response"]["body"]["choices"]
    assert plain[0]["message"]["content"] == " red." and plain[1]["message"]["content"] is None


@pytest.mark.unit
def test_prompt_logprobs_come_back_in_vllm_s_shape_on_a_completion_s_choices_and_beside_a_chat_s():
    """A request's prompt_logprobs, as vLLM's server answers them: per prompt token null (the first)
    or {token id: {logprob, rank, decoded_token}}, the prompt token's own first with its rank (the
    tokens at least as likely), then the k most likely ranked by place. On each choice of a
    completion, beside the choices of a chat completion."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    text = lambda t: f"<{t}>"                                                     # noqa: E731
    top = {"prompt_token_ids": [5, 8, 9], "prompt_ranks": [None, 9, 1],
           "prompt_logprobs": [None, {"token_id": 8, "logprob": -4.0, "top": [[7, -1.0, "<7>"], [6, -2.0, "<6>"]]},
                               {"token_id": 9, "logprob": -0.5, "top": [[9, -0.5, "<9>"], [7, -2.0, "<7>"]]}]}
    result = ok_result("p", [11], "x", "length", 3, top)
    expected = [None, {"8": {"logprob": -4.0, "rank": 9, "decoded_token": "<8>"},
                       "7": {"logprob": -1.0, "rank": 1, "decoded_token": "<7>"},
                       "6": {"logprob": -2.0, "rank": 2, "decoded_token": "<6>"}},
                {"9": {"logprob": -0.5, "rank": 1, "decoded_token": "<9>"},
                 "7": {"logprob": -2.0, "rank": 2, "decoded_token": "<7>"}}]
    completion = openai_line(result, "/v1/completions", None, "m", text)["response"]["body"]
    assert completion["choices"][0]["prompt_logprobs"] == expected
    assert Completion.model_validate(completion).choices[0].text == "x"
    chat = openai_line(result, CHAT, None, "m", text)["response"]["body"]
    assert chat["prompt_logprobs"] == expected and "prompt_logprobs" not in chat["choices"][0]
    assert ChatCompletion.model_validate(chat).choices[0].message.content == "x"
    values = ok_result("p", [11], "x", "length", 3, {"prompt_token_ids": [5, 8], "prompt_logprobs": [None, -4.0],
                                                     "prompt_ranks": [None, 7]})
    assert openai_line(values, CHAT, None, "m", text)["response"]["body"]["prompt_logprobs"] == \
        [None, {"8": {"logprob": -4.0, "rank": 7, "decoded_token": "<8>"}}]                # prompt_logprobs 0
    assert "prompt_logprobs" not in openai_line(ok_result("p", [11], "x", "length", 3), CHAT, None, "m",
                                                text)["response"]["body"]


@pytest.mark.unit
def test_output_lines_parse_as_openai_types():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    result = ok_result("q1", [11, 12], "Paris.", "stop", 9,
                       {"logprobs": [{"logprob": -0.1, "top": [[11, -0.1], [13, -2.5]]},
                                     {"logprob": -0.2, "top": [[12, -0.2], [14, -3.0]]}]})
    line = openai_line(result, CHAT, 1, "SmolLM2", lambda t: f"<{t}>")
    assert line["custom_id"] == "q1" and line["error"] is None and line["response"]["status_code"] == 200
    chat = ChatCompletion.model_validate(line["response"]["body"])
    assert chat.choices[0].message.content == "Paris." and chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens == 9 and chat.usage.total_tokens == 11 and chat.model == "SmolLM2"
    assert [c.token for c in chat.choices[0].logprobs.content] == ["<11>", "<12>"]
    assert [[t.token for t in c.top_logprobs] for c in chat.choices[0].logprobs.content] == [["<11>"], ["<12>"]]
    plain = Completion.model_validate(openai_line(result, "/v1/completions", None, "m", str)["response"]["body"])
    assert plain.choices[0].text == "Paris." and plain.choices[0].logprobs is None
    failed = openai_line(error_result("q2", "InvalidRecord", "line 2: bad"), CHAT, None, "m", str)
    assert failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["message"] == "line 2: bad"
    assert failed["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert failed["error"] == "line 2: bad"                                    # (vLLM's place and form)
    # a record quarantined for the crashes it ran in: the server's failure, not the request's
    crashed = openai_line(error_result("q3", "quarantined", "record 'q3' was running when a replica failed"),
                          CHAT, None, "m", str)["response"]
    assert crashed["status_code"] == 500 and crashed["body"]["error"]["type"] == "server_error"
    assert openai_line(result, CHAT, None, "m", str)["id"] == line["id"]       # the same id on a re-run


@pytest.mark.unit
def test_a_sampled_chat_token_heads_its_top_logprobs_and_forced_calls_have_content_as_in_vllm():
    """vLLM's engine puts a position's sampled token first among its candidates, and a chat
    completion takes the first top_logprobs of them: a token sampled below the most likely comes
    first (greedy, where it is the most likely, the same as the k most likely); a message whose
    calls tool_choice "required" or a named function forced has content "", not null."""
    sampled = ok_result("s", [11, 12], "x", "stop", 3,
                        {"logprobs": [{"logprob": -1.5, "top": [[13, -0.4], [11, -1.5], [14, -2.0]]},
                                      {"logprob": -0.2, "top": [[12, -0.2], [14, -3.0]]}]})
    content = openai_line(sampled, CHAT, 2, "m", lambda t: f"<{t}>")["response"]["body"]["choices"][0]["logprobs"]
    assert [[t["token"] for t in c["top_logprobs"]] for c in content["content"]] == [["<11>", "<13>"], ["<12>", "<14>"]]
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    called = ok_result("t", [5], {"output_text": "", "tool_calls": call}, "tool_calls", 3)
    forced, auto = (openai_line(called, CHAT, None, "m", str, forced=f)["response"]["body"]["choices"][0]["message"]
                    for f in (True, False))
    assert (forced["content"], auto["content"]) == ("", None) and forced["tool_calls"] == call
    # include_reasoning false (with a reasoning parser) leaves the reasoning out, and its tokens'
    # log-probabilities with it, as vLLM's suppressed metadata
    thought = ok_result("u", [11, 12], {"output_text": "x", "reasoning": "hmm"}, "stop", 3,
                        {"logprobs": [{"logprob": -0.1, "top": []}, {"logprob": -0.2, "top": []}]})
    hidden, shown = (openai_line(thought, CHAT, 0, "m", str, reasoning=r)["response"]["body"]["choices"][0]
                     for r in (False, True))
    assert (hidden["message"]["reasoning"], hidden["logprobs"]) == (None, None)
    # the answer's role: the last message's where the request opens no assistant message (vLLM's)
    from types import SimpleNamespace
    from msinfer.launcher.records import RecordCodec
    from msinfer.launcher.spec import JobSpec
    codec = RecordCodec(JobSpec.model_validate({"model": {"path": "m"}, "input": {"path": "in.jsonl"},
                                                "output": {"path": "out.jsonl"}}),
                        SimpleNamespace(vocab_size=100, hidden_size=8, labels=(), classifier_activation="",
                                        eos_token_ids=(2,)), None, "openai")
    msgs = [{"role": "user", "content": "hi"}]
    roles = [codec.request(parse_openai(request("r", {"messages": msgs, **extra}), 1)).role
             for extra in ({}, {"add_generation_prompt": False}, {"add_generation_prompt": True})]
    assert roles == ["assistant", "user", "assistant"]
    assert openai_line(thought, CHAT, None, "m", str, role="user")["response"]["body"]["choices"][0]["message"][
        "role"] == "user"
    assert shown["message"]["reasoning"] == "hmm" and len(shown["logprobs"]["content"]) == 2


def test_a_batch_file_runs_to_openai_lines_and_resumes_by_custom_id(tmp_path, ray_local):
    """A job on an OpenAI Batch file (output.format auto -> openai), on stand-in workers with the
    demo model's config and tokenizer: chat and completion requests answered in OpenAI's shapes,
    the bad ones with status 400, each request once; a second run skips them all."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    from msinfer.launcher.job import plan_job, run_job
    from msinfer.launcher.simulate import StandIn
    from msinfer.launcher.spec import JobSpec
    from scripts.make_demo_model import ensure_demo_model
    continued = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    lines = [request("chat-1", {"model": "x", "messages": [{"role": "user", "content": "What is 2+2?"}],
                                "max_completion_tokens": 5}),
             request("chat-2", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                "logprobs": True, "top_logprobs": 2}),
             request("text-1", {"prompt": "Once upon a time", "max_tokens": 4}, "/v1/completions"),
             request("two", {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 2}),
             request("list", {"prompt": ["Once upon a time", "The sky is"], "n": 2, "max_tokens": 3},
                     "/v1/completions"),
             request("echo", {"prompt": "The sky is", "max_tokens": 3, "echo": True}, "/v1/completions"),
             request("echo-0", {"prompt": [504, 3575, 282], "max_tokens": 0, "echo": True, "logprobs": 1},
                     "/v1/completions"),
             request("list-echo", {"prompt": ["Once upon a time", "The sky is"], "n": 2, "max_tokens": 3,
                                   "echo": True, "logprobs": 1}, "/v1/completions"),
             request("chat-echo", {"messages": continued, "continue_final_message": True, "max_tokens": 3,
                                   "echo": True}),
             request("chat-plain", {"messages": continued, "continue_final_message": True, "max_tokens": 3}),
             request("list-plp", {"prompt": ["Once upon a time", "The sky is"], "max_tokens": 2, "prompt_logprobs": 1},
                     "/v1/completions"),
             request("ids-chat", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                  "return_token_ids": True}),
             request("ids-list", {"prompt": ["Once upon a time", "The sky is"], "max_tokens": 2,
                                  "return_token_ids": True}, "/v1/completions"),
             request("bad-n", {"messages": [{"role": "user", "content": "Hi"}], "n": 0}),
             {"custom_id": "bad-body", "url": CHAT, "body": "not an object"}]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    spec = JobSpec.model_validate({"model": {"path": str(ensure_demo_model()), "max_model_len": 256},
                                   "sampling": {"max_new_tokens": 16},
                                   "input": {"path": str(tmp_path / "batch.jsonl")},
                                   "output": {"path": str(tmp_path / "out.jsonl")},
                                   "scheduler": {"max_batch_size": 4, "max_batched_tokens": 256}})
    summary = run_job(spec, progress=False, simulate=StandIn(step_ms=1.0))
    out = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert sorted(out) == sorted(x["custom_id"] for x in lines)
    assert summary["records_done"] == 13 and summary["records_failed"] == 2
    for cid, n in (("chat-1", 5), ("chat-2", 3)):
        body = ChatCompletion.model_validate(out[cid]["response"]["body"])
        assert out[cid]["response"]["status_code"] == 200 and body.usage.completion_tokens == n
        assert body.choices[0].finish_reason == "length" and body.choices[0].message.role == "assistant"
    lp = ChatCompletion.model_validate(out["chat-2"]["response"]["body"]).choices[0].logprobs.content
    assert len(lp) == 3 and all(len(c.top_logprobs) == 2 for c in lp)
    text = Completion.model_validate(out["text-1"]["response"]["body"])
    assert text.object == "text_completion" and text.usage.completion_tokens == 4 and text.choices[0].text
    two = ChatCompletion.model_validate(out["two"]["response"]["body"])
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 4
    assert all(c.finish_reason == "length" and c.message.content for c in two.choices)
    # a list of prompts, as OpenAI's and vLLM's completions take it: n choices for each, in order
    from msinfer.launcher.simulate import StandInRunner
    from msinfer.launcher.tokenizer import load_tokenizer
    tok, runner = load_tokenizer(ensure_demo_model()), StandInRunner(plan_job(spec, weights=False).engine, StandIn())
    several = Completion.model_validate(out["list"]["response"]["body"])
    prompts = [tok.encode(p) for p in ("Once upon a time", "The sky is")]
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert [c.text for c in several.choices] == [tok.decode(runner.tokens(p, 3)) for p in prompts for _ in range(2)]
    assert several.usage.prompt_tokens == sum(map(len, prompts)) and several.usage.completion_tokens == 12
    # echo: the prompt as written before the completion; with max_tokens 0 the prompt alone, its
    # tokens in the logprobs (a stand-in's log-probabilities are 0.0; the first token has none)
    echo = Completion.model_validate(out["echo"]["response"]["body"])
    assert echo.choices[0].text == "The sky is" + tok.decode(runner.tokens(tok.encode("The sky is"), 3))
    alone = out["echo-0"]["response"]["body"]["choices"][0]
    assert alone["text"] == tok.decode([504, 3575, 282]) and alone["finish_reason"] == "length"
    assert alone["logprobs"]["tokens"] == [tok.decode([t]) for t in (504, 3575, 282)]
    assert alone["logprobs"]["token_logprobs"] == [None, 0.0, 0.0]
    # echo of several prompts: each choice after its own prompt, its logprobs over that prompt's tokens
    listed = out["list-echo"]["response"]["body"]["choices"]         # (a null first logprob: raw JSON)
    assert [c["index"] for c in listed] == [0, 1, 2, 3]
    for c in listed:
        p = ("Once upon a time", "The sky is")[c["index"] // 2]
        assert c["text"] == p + tok.decode(runner.tokens(tok.encode(p), 3))
        assert c["logprobs"]["tokens"][:len(tok.encode(p))] == [tok.decode([t]) for t in tok.encode(p)]
        assert c["logprobs"]["token_logprobs"][0] is None and len(c["logprobs"]["tokens"]) == len(tok.encode(p)) + 3
    # vLLM's return_token_ids: a chat's prompt ids beside its choices, each choice's own ids; a
    # completion's prompt ids on each choice (its own prompt's, of several)
    ids_chat = out["ids-chat"]["response"]["body"]
    assert len(ids_chat["prompt_token_ids"]) == ids_chat["usage"]["prompt_tokens"]
    assert ids_chat["choices"][0]["token_ids"] == runner.tokens(ids_chat["prompt_token_ids"], 2)
    for c in out["ids-list"]["response"]["body"]["choices"]:
        ids = tok.encode(("Once upon a time", "The sky is")[c["index"]])
        assert c["prompt_token_ids"] == ids and c["token_ids"] == runner.tokens(ids, 2)
    assert "token_ids" not in out["text-1"]["response"]["body"]["choices"][0]
    # prompt_logprobs of several prompts: each choice its own prompt's, keyed by its tokens
    for c in out["list-plp"]["response"]["body"]["choices"]:
        ids = tok.encode(("Once upon a time", "The sky is")[c["index"]])
        assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == len(ids)
        assert [next(iter(e)) for e in c["prompt_logprobs"][1:]] == [str(t) for t in ids[1:]]
    # a chat echo: the continued assistant message's text, then the choice's
    echoed = ChatCompletion.model_validate(out["chat-echo"]["response"]["body"]).choices[0].message.content
    plain = ChatCompletion.model_validate(out["chat-plain"]["response"]["body"]).choices[0].message.content
    assert plain and echoed == "Hel" + plain
    assert out["bad-n"]["response"]["status_code"] == 400
    assert "sampling.n" in out["bad-n"]["response"]["body"]["error"]["message"]
    assert out["bad-body"]["response"]["status_code"] == 400
    again = run_job(spec, progress=False, simulate=StandIn(step_ms=1.0))
    assert again["nothing_to_do"] and again["records_skipped"] == 15     # resumed by custom_id: nothing to do,
    assert again["records_skipped_failed"] == 2                           # the 400 lines among them
    # a run killed while writing leaves a torn last line: the next run drops it and computes that
    # request again, each custom_id once
    data = (tmp_path / "out.jsonl").read_bytes()
    torn = data[: len(data) - 10]
    (tmp_path / "out.jsonl").write_bytes(torn)
    last = json.loads(data.splitlines()[-1])["custom_id"]
    resumed = run_job(spec, progress=False, simulate=StandIn(step_ms=1.0))
    assert resumed["records_skipped"] == 14 and resumed["records_done"] + resumed["records_failed"] == 1
    again_out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in again_out) == sorted(x["custom_id"] for x in lines)
    assert again_out[-1]["custom_id"] == last
