"""Tool calls (launcher.tools): a chat's `tools` through the chat template, the calls a completion
writes read by output.tool_call_parser, and tool_choice "required" or a named function constrained
to their JSON schema, as vLLM's OpenAI server serves them; in msinfer's result lines and OpenAI's.
The demo model's tool calls through a whole engine: tests/test_sampling.py, with structured outputs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from msinfer.launcher.inputs import parse_openai, parse_record
from msinfer.launcher.tools import parse_calls, tool_schema, tool_use
from tests.checkpoints import build_tokenizer

# Qwen2.5's way of telling a model its tools and of writing calls and their results, in small
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You are a helpful assistant.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "additionalProperties": False, "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def tool_tok_dir(tmp_path_factory):
    """The test tokenizer with the hermes template, <tool_call> and </tool_call> as special tokens
    (so that only a text that keeps special tokens shows them) and <think>, </think> as tokens."""
    from transformers import AutoTokenizer
    folder = build_tokenizer(tmp_path_factory.mktemp("tools"), HERMES_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(folder)
    hf.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    hf.add_tokens(["<think>", "</think>"])
    hf.save_pretrained(folder)
    return folder


B, SEP = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>"
E = "<\uff5ctool\u2581call\u2581end\uff5c>"
CALLS, CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"


@pytest.mark.unit
@pytest.mark.parametrize("parser, text, want", [
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": "{x}"}}; {"name": "g", "arguments": {}}',
     (None, [("f", '{"a": "{x}"}'), ("g", "{}")])),
    ("llama3_json", 'Sure. {"name": "f", "arguments": {"a": 1}} done', (None, [("f", '{"a": 1}')])),
    ("llama3_json", '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": [1]}}]',
     (None, [("f", "{}"), ("g", '{"b": [1]}')])),
    ("llama3_json", 'Use {"city": "Paris"} here', None),                  # an object without a name: all text
    ("llama3_json", 'A set {1, 2} and {"name": "f", "arguments": {}}', None),   # a { that starts no JSON
    ("llama3_json", "Paris is sunny.", None),
    ("pythonic", '[get_weather(city="Paris", days=3), get_time()]',
     (None, [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")])),
    ("pythonic", "[f(x=-1.5, flags={'a': [1, True, None]}, note='caf\u00e9')]",
     (None, [("f", '{"x": -1.5, "flags": {"a": [1, true, null]}, "note": "caf\u00e9"}')])),
    ("pythonic", "\n[f(x=1)]\n", (None, [("f", '{"x": 1}')])),
    ("pythonic", "[f(x=1)] is what I would call", None),                     # text after the list
    ("pythonic", "[f(a=null, b=true, c=false)]", (None, [("f", '{"a": null, "b": true, "c": false}')])),  # JSON's
    ("pythonic", "[f(1)]", None),                                            # a positional argument
    ("pythonic", "[f(x=g())]", None),                                        # a value that is no literal
    ("pythonic", "[f(x=float('inf'))]", None),
    ("pythonic", "[f(x=1e999)]", None),                                      # inf: no JSON
    ("pythonic", "[a.b(x=1)]", None),                                        # not a plain name
    ("pythonic", "[1, 2]", None),
    ("pythonic", "[f(x=1)", None),                                           # cut before its end
    ("pythonic", "Paris is sunny.", None),
    ("llama4_pythonic", '<|python_start|>[f(a="b")]<|python_end|>', (None, [("f", '{"a": "b"}')])),
    ("llama4_pythonic", '[f(a="b")]', (None, [("f", '{"a": "b"}')])),
    ("pythonic", '<|python_start|>[f(a="b")]<|python_end|>', None),         # pythonic keeps the markers
    ("mistral", 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "f", "arguments": {}}]',
     ("Sure.", [("get_weather", '{"city": "Paris"}'), ("f", "{}")])),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}] and then', (None, [("f", '{"a": 1}')])),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]f[ARGS]{}',
     (None, [("get_weather", '{"city": "Rome"}'), ("f", "{}")])),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}',
     (None, [("get_weather", '{"city": "Rome"}')])),
    ("mistral", 'Let me check.[TOOL_CALLS]get_weather{"city": "Oslo"}',
     ("Let me check.", [("get_weather", '{"city": "Oslo"}')])),
    ("mistral", '[TOOL_CALLS] [{"name": "f"}]', None),                       # no arguments
    ("mistral", 'Sure. [TOOL_CALLS]f[ARGS]{"a": 1} and more[TOOL_CALLS]g[ARGS]',     # text after the JSON dropped;
     ("Sure.", [("f", '{"a": 1}'), ("g", "{}")])),                           # no arguments: {}
    ("mistral", "[TOOL_CALLS] [not json", None),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}][TOOL_CALLS][{"name": "g", "arguments": {}}]', None),
    ("mistral", 'The weather is fine [{"name": "f", "arguments": {}}]', None),   # no [TOOL_CALLS]
    ("deepseek_v3", f'Let me see.{CALLS}{B}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{E}'
                    f'{B}function{SEP}get_time\n```json\n{{\n  "zone": "UTC"\n}}\n```{E}{CALLS_END}',
     ("Let me see.", [("get_weather", '{"city": "Paris"}'), ("get_time", '{\n  "zone": "UTC"\n}')])),
    ("deepseek_v3", f'{CALLS}{B}retrieval{SEP}f\n```json\n{{}}\n```{E}{CALLS_END}', None),
    ("deepseek_v3", f'A{CALLS}{B}function{SEP}f\n```json\n{{}}\n```{E}{CALLS_END} then B',   # V3 keeps the
     ("A then B", [("f", "{}")])),                                           # text after the calls
    ("deepseek_v31", f'A{CALLS}{B}f{SEP}{{}}{E}{CALLS_END} then B', ("A", [("f", "{}")])),   # V3.1 does not
    ("deepseek_v3", f"{CALLS}{B}function{SEP}f", None),                       # cut before its arguments
    ("deepseek_v31", f'{CALLS}{B}get_weather{SEP}{{"city": "Rome"}}{E}{CALLS_END}',
     (None, [("get_weather", '{"city": "Rome"}')])),
    ("deepseek_v31", f'no call {B}f{SEP}{{}}{E}', None),                      # no calls' begin marker
    ("kimi_k2", 'Checking.<|tool_calls_section_begin|><|tool_call_begin|> functions.get_weather:0 '
                '<|tool_call_argument_begin|> {"city": "Paris"} <|tool_call_end|><|tool_call_begin|>get_time:1'
                '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>',
     ("Checking.", [("get_weather", '{"city": "Paris"}', "functions.get_weather:0"), ("get_time", "{}", "get_time:1")])),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": ',
     None),                                                                  # cut before its end
    ("kimi_k2", '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>', None),   # no section
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.web.search:0<|tool_call_argument_begin|>'
                '{}<|tool_call_end|><|tool_calls_section_end|>', (None, [("web.search", "{}", "functions.web.search:0")])),
    ("qwen3_coder", "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     ("I'll look.", [("get_weather", '{"city": "Paris", "days": 3}')])),      # (the content stripped)
    ("qwen3_coder", "<function=f>\n<parameter=x>\n1.50\n</parameter>\n<parameter=y>\n2.0\n<parameter=z>\nnull\n"
                    "</function>",                                         # bare, a parameter left open
     (None, [("f", '{"x": 1.5, "y": 2, "z": null}')])),
    ("qwen3_coder", "<tool_call><function=f><parameter=flags>\n{'a': [1, True]}\n</parameter></function></tool_call>"
                    "<tool_call><function=g></function></tool_call>",
     (None, [("f", '{"flags": {"a": [1, true]}}'), ("g", "{}")])),
    ("qwen3_coder", "<tool_call><function=f</tool_call>", None),               # no '>' after the name
    ("qwen3_coder", "<tool_call>{\"name\": \"f\"}</tool_call>", None),        # hermes' form: no function
])
def test_the_llama_pythonic_mistral_deepseek_kimi_and_qwen3_coder_parsers_read_calls_where_vllms_read_them(
        parser, text, want):
    number = {"type": "object", "properties": {"days": {"type": "integer"}, "city": {"type": "string"}}}
    tools = ({"type": "function", "function": {"name": "get_weather", "parameters": number}},
             {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
                 "x": {"type": "number"}, "y": {"anyOf": [{"type": "null"}, {"type": "number"}]},
                 "z": {"type": ["integer", "null"]}, "flags": {"type": "object"}}}}})
    assert parse_calls(parser, text, tools) == want


@pytest.mark.unit
@pytest.mark.parametrize("schema, text, want", [
    (None, "null", "null"), ({"type": "string"}, "null", "null"), ({"type": "integer"}, "NULL", None),
    ({"type": "integer"}, " 7 ", 7), ({"type": "integer"}, "7.5", "7.5"), ({"type": "number"}, "1e3", 1000),
    ({"type": "number"}, "inf", "inf"), ({"type": "number"}, "-0.25", -0.25),
    ({"type": "boolean"}, "True", True), ({"type": "boolean"}, "false", False), ({"type": "boolean"}, "yes", "yes"),
    ({"type": "array"}, "[1, 2]", [1, 2]), ({"type": "array"}, "(1, 2)", (1, 2)), ({"type": "object"}, "{x", "{x"),
    ({"type": "object"}, "{1, 2}", "{1, 2}"),           # a Python set is no JSON: stays text
    ({"type": ["string", "null"]}, "null", "null"), ({}, "5", "5"),
])
def test_a_qwen3_coder_value_is_typed_by_its_schema_as_vllm_types_it(schema, text, want):
    from msinfer.launcher.tools import coder_value
    assert coder_value(text, schema) == want


@pytest.mark.unit
@pytest.mark.parametrize("text, want", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', (None, [("f", '{"a": 1}')])),
    ('Let me look.\n<tool_call>{"name": "f", "arguments": {"q": "é"}}</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {}}</tool_call>', ("Let me look.\n", [("f", '{"q": "é"}'), ("g", "{}")])),
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}', (None, [("f", '{"a": [1, 2]}')])),    # cut after the JSON
    ("  \n<tool_call>{\"name\": \"f\", \"arguments\": null}</tool_call>", (None, [("f", "null")])),
    ('<tool_call>{"name": "f", "arguments": {"a": </tool_call>', None),       # not JSON: the text is the content
    ('<tool_call>{"name": "f"}</tool_call>', None),                           # no arguments
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', None),
    ("Paris is sunny.", None),
])
def test_the_hermes_parser_reads_calls_where_vllms_reads_them(text, want):
    assert parse_calls("hermes", text) == want


@pytest.mark.unit
@pytest.mark.parametrize("record, message", [
    ({"messages": ASK, "tool_choice": "auto"}, "'tool_choice' needs 'tools' to choose from"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": "any"},
     "'tool_choice' must be one of none, auto, required or a named function"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "'tool_choice' names the function 'get_time', which is not in 'tools'"),
    ({"messages": ASK, "tools": [WEATHER, WEATHER]}, "'tools' names the function 'get_weather' twice"),
    ({"messages": ASK, "tools": {"get_weather": {}}}, "'tools' must be a list"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"description": "x"}}]},
     "'tools[0].function' needs a 'name' string"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "'tools[0].function.parameters' must be a JSON schema object, got str"),
    ({"messages": ASK, "tools": [WEATHER], "parallel_tool_calls": "no"}, "'parallel_tool_calls' must be true or false"),
    ({"prompt_token_ids": [1, 2], "tools": [WEATHER]}, "'tools' are for a prompt that goes through the chat template"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": "required",
      "sampling": {"structured_outputs": {"regex": "a+"}}},
     "tool_choice 'required' constrains the output to tool calls, and so does its structured output; give one"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris}"}}]}]},
     "messages[1].tool_calls[0].function.arguments is not JSON"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
     "messages[0].tool_calls must be a list, in an assistant message"),
    ({"messages": [*ASK, {"role": "assistant", "content": None}]}, "messages[1] needs a 'content' string"),
])
def test_a_records_tools_are_checked_as_vllm_checks_them(record, message):
    rec = parse_record({"id": "t", **record}, 3)
    assert rec.error is not None and rec.error.startswith(f"line 3: {message}"), rec.error


@pytest.mark.unit
def test_required_and_a_named_function_constrain_the_output_to_vllms_schema():
    rec = parse_record({"id": "r", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required"}, 1)
    schema = rec.sampling["structured_outputs"]["json"]
    assert schema == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"],
         "additionalProperties": False},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {k: v for k, v in TIME["function"]["parameters"].items() if k != "$defs"}},
         "required": ["name", "parameters"], "additionalProperties": False}]},
        "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}
    assert "$defs" in TIME["function"]["parameters"]        # (the request's own schema is left as it is)
    import jsonschema
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "CET"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"zone": "Mars"}}], schema)
    named = parse_openai({"custom_id": "n", "url": "/v1/chat/completions", "body": {
        "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False}}, 1)
    assert named.error is None and named.sampling["structured_outputs"] == {"json": WEATHER["function"]["parameters"]}
    assert (named.tool_use.choice, named.tool_use.name, named.tool_use.parallel) == ("named", "get_weather", False)
    bare = {"type": "function", "function": {"name": "now"}}
    assert tool_schema([bare], tool_use({"function": {"name": "now"}}, None)) == {"type": "object", "properties": {}}
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {}, "$defs": {"zone": {"type": "integer"}}}}}
    bad = parse_record({"id": "c", "messages": ASK, "tools": [TIME, clash], "tool_choice": "required"}, 2)
    assert bad.error == "line 2: 'tools': the tools define '$defs.zone' twice, with two schemas"
    none = parse_record({"id": "x", "messages": ASK, "tool_choice": "required"}, 3)    # no tools: "none", as vLLM
    assert none.error is None and none.tool_use is None and "structured_outputs" not in none.sampling
    plain = parse_record({"id": "y", "messages": ASK, "tools": [WEATHER], "tool_choice": "none"}, 4)
    assert plain.tools == [WEATHER] and plain.tool_use is None
    text = parse_record({"id": "z", "messages": ASK, "tools": json.dumps([WEATHER])}, 5)    # a dataset's JSON column
    assert text.error is None and text.tools == [WEATHER] and text.tool_use.choice == "auto"
    assert parse_record({"id": "w", "messages": ASK, "tools": "[{"}, 6).error.startswith("line 6: 'tools' is text "
                                                                                         "that is not JSON")


@pytest.mark.unit
def test_a_parquet_files_tools_column_of_json_text_and_its_calls_in_messages_are_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from msinfer.launcher.inputs import read_records
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    pq.write_table(pa.Table.from_pylist([
        {"id": "a", "messages": ASK, "tools": json.dumps([WEATHER]), "tool_choice": None},
        {"id": "b", "messages": history, "tools": json.dumps([WEATHER, TIME]), "tool_choice": "required"}]),
        tmp_path / "in.parquet")
    a, b = read_records(tmp_path / "in.parquet")
    assert (a.error, a.tools, a.tool_use.choice) == (None, [WEATHER], "auto")
    assert b.error is None and b.tools == [WEATHER, TIME] and b.tool_use.choice == "required"
    assert b.messages[1]["tool_calls"] == calls and "tool_calls" not in b.messages[2]


def test_a_chats_tools_and_its_call_history_render_as_transformers_renders_them(tool_tok_dir):
    """The tools go into the prompt (also with tool_choice none, as vLLM's default); an assistant
    message's calls, whose arguments OpenAI gives as JSON text, reach the template as objects and
    a tool message keeps its tool_call_id: the prompt is transformers' apply_chat_template's with
    the arguments as objects."""
    from transformers import AutoTokenizer
    from msinfer.launcher.tokenizer import load_tokenizer
    tok, hf = load_tokenizer(tool_tok_dir), AutoTokenizer.from_pretrained(tool_tok_dir)
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
             {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "c2", "content": "noon"}]
    as_objects = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {**calls[0], "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        {**calls[1], "function": {"name": "get_time", "arguments": {}}}]}, *messages[2:]]
    for choice in ("auto", "none"):
        rec = parse_record({"id": "h", "messages": messages, "tools": [WEATHER, TIME], "tool_choice": choice}, 1)
        assert rec.error is None
        want = hf.apply_chat_template(as_objects, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True)
        assert '{"city": "Rome"}' in want and "<tool_response>\nnoon" in want and '"name": "get_time"' in want
        assert tok.encode_record(rec, True) == hf.encode(want, add_special_tokens=False)
    bare = parse_record({"id": "b", "messages": ASK}, 2)
    assert "<tools>" not in tok.decode(tok.encode_record(bare, True))
    assert tok.renders_tools() and not load_tokenizer(build_tokenizer(tool_tok_dir / "plain")).renders_tools()


def test_result_lines_carry_the_calls_in_msinfer_and_openai_form(tool_tok_dir):
    from openai.types.chat import ChatCompletion
    from msinfer.launcher.records import RecordCodec
    from msinfer.launcher.spec import JobSpec
    from msinfer.launcher.tokenizer import load_tokenizer
    from msinfer.launcher.tools import call_id
    tok = load_tokenizer(tool_tok_dir)

    def codec(fmt="msinfer", **output):
        spec = JobSpec.model_validate({"model": {"path": "m", "max_model_len": 2048}, "input": {"path": "in.jsonl"},
                                       "output": {"path": "out.jsonl", "tool_call_parser": "hermes", **output}})
        model = SimpleNamespace(vocab_size=len(tok.tok), hidden_size=64, labels=(),
                                classifier_activation="", eos_token_ids=(2,))
        return RecordCodec(spec, model, tok, fmt)

    def done(c, rec, text, finish="stop"):
        """The record's result line once each of its sequences has generated `text`."""
        seqs = c.sequences(rec, 0)
        if not isinstance(seqs, list):         # its error
            return json.loads(seqs.line)
        for seq in seqs:
            seq.output_token_ids, seq.finish_reason = tok.encode(text, add_special_tokens=False), finish
        return json.loads((c.samples_result(seqs[0].record.samples) if len(seqs) > 1 else c.result(seqs[0])).line)

    def record(rid, **keys):
        return parse_record({"id": rid, "messages": ASK, "tools": [WEATHER, TIME], **keys}, 1)

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    line = done(codec(), record("a"), "I will check." + call)
    assert line["output_text"] == "I will check." and line["finish_reason"] == "tool_calls"
    assert line["tool_calls"] == [{"id": call_id("a", 0, 0), "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert tok.decode(line["output_token_ids"], skip_special_tokens=True).startswith("I will check.\n{")
    none = done(codec(), record("b"), "Paris is sunny.")
    assert (none["output_text"], none["tool_calls"], none["finish_reason"]) == ("Paris is sunny.", [], "stop")
    broken = done(codec(), record("c"), '<tool_call>{"name": "get_weather", "arguments": {', "length")
    assert broken["output_text"] == '<tool_call>{"name": "get_weather", "arguments": {' and broken["tool_calls"] == []
    cut = done(codec(), record("c2"), call + "\nand", "length")            # calls read, then cut: vLLM keeps
    assert cut["finish_reason"] == "length" and len(cut["tool_calls"]) == 1      # the length (it said tool_calls)
    both = done(codec(), record("d", parallel_tool_calls=False), call + call.replace("Paris", "Rome"))
    assert [c["function"]["arguments"] for c in both["tool_calls"]] == ['{"city": "Paris"}']
    n2 = done(codec(), record("e", sampling={"n": 2, "temperature": 1.0}), call)
    assert [o["tool_calls"][0]["id"] for o in n2["outputs"]] == [call_id("e", 0, 0), call_id("e", 1, 0)]
    assert [o["finish_reason"] for o in n2["outputs"]] == ["tool_calls"] * 2
    off = done(codec(), record("f", tool_choice="none"), call)      # not read, and the text keeps no special token
    assert "tool_calls" not in off and off["output_text"].startswith("\n{") and off["finish_reason"] == "stop"
    thought = done(codec(reasoning_parser="qwen3"), record("g"), "<think>the weather?</think>" + call)
    assert (thought["reasoning"], thought["output_text"]) == ("the weather?", "")
    assert thought["tool_calls"][0]["function"]["name"] == "get_weather"

    named = record("h", tool_choice={"type": "function", "function": {"name": "get_time"}})
    line = done(codec(), named, '{"zone": "UTC"}')
    assert (line["output_text"], line["finish_reason"]) == ("", "stop")      # a named call: "stop", as OpenAI's
    assert line["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    required = record("i", tool_choice="required")
    line = done(codec(), required, '[{"name": "get_time", "parameters": {"zone": "CET"}}, '
                                   '{"name": "get_weather", "parameters": {"city": "Tokyo"}}]')
    assert line["finish_reason"] == "tool_calls" and [c["function"] for c in line["tool_calls"]] == [
        {"name": "get_time", "arguments": '{"zone": "CET"}'}, {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}]
    cut = done(codec(), required, '[{"name": "get_time", "param', "length")
    assert (cut["output_text"], cut["tool_calls"], cut["finish_reason"]) == ('[{"name": "get_time", "param', [],
                                                                             "length")
    forecast = {"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    coder = done(codec(tool_call_parser="qwen3_coder"),
                 parse_record({"id": "k", "messages": ASK, "tools": [forecast]}, 1),
                 "<tool_call>\n<function=forecast>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n"
                 "</parameter>\n</function>\n</tool_call>")
    assert coder["finish_reason"] == "tool_calls" and coder["tool_calls"][0]["function"] == {
        "name": "forecast", "arguments": '{"city": "42", "days": 3}'}          # typed by the record's tools
    kimi = done(codec(tool_call_parser="kimi_k2"), record("m"),
                "Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>')
    assert (kimi["output_text"], kimi["finish_reason"]) == ("Let me look.", "tool_calls")
    assert kimi["tool_calls"] == [{"id": "functions.get_weather:0", "type": "function",      # the model's id
                                   "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    embed = RecordCodec(JobSpec.model_validate({"task": "embed", "model": {"path": "m", "max_model_len": 2048},
                                                "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"}}),
                        SimpleNamespace(vocab_size=len(tok.tok), hidden_size=64, labels=(),
                                        classifier_activation="", eos_token_ids=(2,)), tok)
    assert json.loads(embed.sequences(record("l", tool_choice="none"), 0).line)["error"]["message"] == (
        "record 'l': has 'tools', which are for generated chat completions; the job's task is 'embed'")
    unparsed = done(codec(tool_call_parser=None), record("j"), "x")
    assert unparsed["error"]["message"] == (
        "record 'j': tool_choice 'auto' needs output.tool_call_parser in the job spec (the model's: hermes, "
        "llama3_json, pythonic, llama4_pythonic, mistral, deepseek_v3, deepseek_v31, kimi_k2 or qwen3_coder), as vLLM "
        "needs --tool-call-parser; or tool_choice 'none'")

    def request(custom_id, **body):
        return parse_openai({"custom_id": custom_id, "url": "/v1/chat/completions",
                             "body": {"messages": ASK, "tools": [WEATHER], **body}}, 1)

    body = done(codec("openai"), request("q"), call)["response"]["body"]
    choice = ChatCompletion.model_validate(body).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        (call_id("q", 0, 0), "get_weather", {"city": "Paris"})]
    text = ChatCompletion.model_validate(done(codec("openai"), request("r"), "Sunny.")["response"]["body"])
    assert (text.choices[0].message.content, text.choices[0].message.tool_calls) == ("Sunny.", None)
    again = done(codec("openai"), request("q"), call)["response"]["body"]["choices"][0]["message"]["tool_calls"]
    assert again == body["choices"][0]["message"]["tool_calls"]        # a re-run writes the same ids


def test_plan_refuses_a_tool_call_parser_it_cannot_serve(checkpoint, tool_tok_dir, tmp_path):
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.job import plan_job, result_settings
    from msinfer.launcher.spec import JobSpec
    path = str(checkpoint("llama_gqa_tied"))

    def spec(**extra):
        return JobSpec.model_validate({"model": {"path": path, "max_model_len": 512, **extra.pop("model", {})},
                                       "input": {"path": "in.jsonl", **extra.pop("input", {})},
                                       "output": {"path": "out.jsonl", "tool_call_parser": "hermes",
                                                  **extra.pop("output", {})}, **extra})

    with pytest.raises(SpecError, match=r"the chat template of .* leaves a chat's tools out of the prompt"):
        plan_job(spec(model={"tokenizer": str(build_tokenizer(tmp_path / "plain"))}), check_io=False)
    with pytest.raises(SpecError, match=r"output.tool_call_parser 'hermes' reads tool calls in chat completions, "
                                        r"and the model has no tokenizer in"):
        plan_job(spec(), check_io=False)
    with pytest.raises(SpecError, match=r"output.tool_call_parser 'deepseek_v3' reads the calls its models write with "
                                        r"<｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, which the tokenizer has no "
                                        r"token for: it is another model's parser; the tokenizer is "):
        plan_job(spec(model={"tokenizer": str(tool_tok_dir)}, output={"tool_call_parser": "deepseek_v3"}),
                 check_io=False)
    with pytest.raises(SpecError, match=r"output.tool_call_parser 'mistral' reads the calls its models write with "
                                        r"\[TOOL_CALLS\], which the tokenizer has no token for"):
        plan_job(spec(model={"tokenizer": str(tool_tok_dir)}, output={"tool_call_parser": "mistral"}), check_io=False)
    with pytest.raises(SpecError, match=r"task: score generates none"):
        plan_job(spec(task="score", model={"tokenizer": str(tool_tok_dir)}), check_io=False)
    plan = plan_job(spec(model={"tokenizer": str(tool_tok_dir)}), check_io=False)
    assert result_settings(plan)["output"]["tool_call_parser"] == "hermes"
    plain = plan_job(spec(model={"tokenizer": str(tmp_path / "plain")},           # its own template, given
                          input={"chat_template": HERMES_TEMPLATE}), check_io=False)
    assert plain.spec.output.tool_call_parser == "hermes"
