"""Tool calls in chat records: OpenAI's `tools` and `tool_choice`, served as vLLM's OpenAI server
serves them (vllm/entrypoints/openai/chat_completion/serving.py, vllm/tool_parsers).

- The tools go to the chat template (its `tools` variable), which tells the model about them;
  also with tool_choice "none", as vLLM does by default.
- tool_choice "auto" (the default where tools are given): the model writes its calls in its own
  form, and `output.tool_call_parser` finds them in the completion's text (`parse_calls`: hermes,
  llama3_json, pythonic, llama4_pythonic, mistral, deepseek_v3, deepseek_v31, kimi_k2,
  qwen3_coder, as vLLM's parsers of those names).
- tool_choice "required", or a named function: the output is constrained by a JSON schema
  (structured outputs), as vLLM's ToolParser.adjust_request constrains it: for a named function its
  parameters, for "required" a list of one or more {"name", "parameters"} of the given tools.
- With a tool choice other than "none", special tokens stay in the text (the call tags are special
  tokens in some tokenizers), as vLLM's hermes parser asks; here for every parser.

A call's id is derived from the record's id, its choice and the call's place, so a re-run writes
the same ids (vLLM's are random: chatcmpl-tool-<32 hex digits>).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
LLAMA_TAG = "<|python_tag|>"
# DeepSeek's markers: a fullwidth bar (U+FF5C) and U+2581 between words
DEEPSEEK_START, DEEPSEEK_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
_CALL, _SEP, _CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>", \
    "<\uff5ctool\u2581call\u2581end\uff5c>"
DEEPSEEK_V3_CALL = re.compile(f"{_CALL}(.*?){_SEP}(.*?)\n```json\n(.*?)\n```{_CALL_END}", re.DOTALL)
DEEPSEEK_V31_CALL = re.compile(f"{_CALL}(.*?){_SEP}(.*?){_CALL_END}", re.DOTALL)
# qwen3_coder's: each call a <function=NAME> of <parameter=NAME>value</parameter>, in <tool_call>
CODER_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
CODER_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
CODER_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
# Llama 4's markers around pythonic calls, which it writes at times
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# Mistral's: the calls' token, and (models of tokenizer v11 on) the ones between a name, the call's
# id, which some write, and its arguments
MISTRAL_CALLS, MISTRAL_CALL_ID, MISTRAL_ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
MISTRAL_LIST = re.compile(r"\[{.*}\]", re.DOTALL)
# Kimi K2's: its calls' section, and each call's id (functions.NAME:INDEX) and arguments
KIMI_START, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*([^<]+:\d+)\s*<\|tool_call_argument_begin\|>\s*"
                       r"((?:(?!<\|tool_call_begin\|>).)*?)\s*<\|tool_call_end\|>", re.DOTALL)
# the tokens each parser's model writes its calls with, which its tokenizer must have (plan checks)
PARSER_TOKENS = {"hermes": (), "llama3_json": (LLAMA_TAG,), "pythonic": (), "llama4_pythonic": (),
                 "mistral": (MISTRAL_CALLS,), "deepseek_v3": (DEEPSEEK_START, DEEPSEEK_END),
                 "deepseek_v31": (DEEPSEEK_START, DEEPSEEK_END), "kimi_k2": (KIMI_START, KIMI_END),
                 "qwen3_coder": (HERMES_START, HERMES_END)}
CHOICES = ("none", "auto", "required")
NAMED = 'a named function {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ToolUse:
    """How a record's completion becomes a message with tool calls (RecordCodec.message)."""
    choice: str                     # auto, required, or named (tool_choice none: no ToolUse)
    name: str | None = None         # the named function's
    parallel: bool = True           # OpenAI's parallel_tool_calls: false keeps the first call only
    tools: tuple = ()               # the record's tools (qwen3_coder types a call's values by their schemas)

    def said(self) -> str:
        """The tool choice as messages name it: 'required', or naming the function 'f'."""
        return f"'{self.choice}'" if self.choice != "named" else f"naming the function {self.name!r}"


def check_tools(tools: Any, choice: Any, parallel: Any = None) -> tuple[list | None, Any, str | None]:
    """A record's tools, tool_choice and parallel_tool_calls, checked as vLLM's
    ChatCompletionRequest checks them: (tools or None, the tool choice with OpenAI's default:
    "auto" with tools, else "none"; the problem, or None)."""
    if tools is not None:
        if not isinstance(tools, list):
            return None, None, f"'tools' must be a list of {{\"type\": \"function\", \"function\": {{...}}}}, got " \
                               f"{type(tools).__name__}"
        for i, tool in enumerate(tools):
            if error := _check_tool(tool, f"tools[{i}]"):
                return None, None, error
        names = [t["function"]["name"] for t in tools]
        if dup := next((n for n in names if names.count(n) > 1), None):
            return None, None, f"'tools' names the function {dup!r} twice"
        tools = tools or None             # an empty list: no tools (OpenAI's and vLLM's)
    if parallel is not None and not isinstance(parallel, bool):
        return None, None, f"'parallel_tool_calls' must be true or false, got {type(parallel).__name__}"
    if choice is None:
        return tools, "auto" if tools else "none", None
    if choice == "none":
        return tools, choice, None
    if tools is None:
        if choice == "required":
            return None, "none", None       # (vLLM: "required" with no tools is "none", as OpenAI)
        return None, None, "'tool_choice' needs 'tools' to choose from"
    if isinstance(choice, str):
        if choice not in CHOICES:
            return None, None, f"'tool_choice' must be one of {', '.join(CHOICES)} or {NAMED}, got {choice!r:.40}"
        return tools, choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" \
            or not isinstance(name, str) or not name:
        return None, None, f"'tool_choice' must be one of {', '.join(CHOICES)} or {NAMED}, got {choice!r:.60}"
    if name not in names:
        return None, None, f"'tool_choice' names the function {name!r}, which is not in 'tools'"
    return tools, choice, None


def _check_tool(tool: Any, where: str) -> str | None:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(tool.get("function"), dict):
        return f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}"
    function = tool["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        return f"'{where}.function' needs a 'name' string"
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        kind = type(function["parameters"]).__name__
        return f"'{where}.function.parameters' must be a JSON schema object, got {kind}"
    if function.get("description") is not None and not isinstance(function["description"], str):
        return f"'{where}.function.description' must be a string"
    return None


def tool_use(choice: Any, parallel: bool | None, tools: list | None = None) -> ToolUse | None:
    """The ToolUse of a checked tool choice (None for "none")."""
    if choice == "none":
        return None
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    return ToolUse("named" if named else choice, named, parallel is not False, tuple(tools or ()))


def tool_schema(tools: list, use: ToolUse) -> dict | None:
    """The JSON schema a tool choice constrains the output to (vLLM's get_json_schema_from_tools):
    a named function's parameters; for "required", a list of one or more calls of the tools,
    their $defs gathered at the top. None for "auto". Raises ValueError where two tools' $defs
    give one name two schemas. Unlike vLLM's, a call holds no key beside "name" and "parameters"
    (vLLM's lets a model write more, which its reading of the calls then drops)."""
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if use.choice == "named":
        return functions[use.name].get("parameters") or {"type": "object", "properties": {}}
    if use.choice != "required":
        return None
    defs: dict[str, Any] = {}
    calls = []
    for name, f in functions.items():
        params = dict(f.get("parameters") or {"type": "object", "properties": {}})
        for key, schema in params.pop("$defs", {}).items():
            if defs.setdefault(key, schema) != schema:
                raise ValueError(f"the tools define '$defs.{key}' twice, with two schemas")
        calls.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if defs:
        schema["$defs"] = defs
    return schema


def history(messages: list[dict]) -> list[dict]:
    """Messages for a chat template: an assistant message's tool call arguments, which OpenAI's
    messages give as JSON text, as objects (vLLM's _postprocess_messages; templates write them
    with `| tojson`); none or empty ones as {}. Raises ValueError naming a call whose arguments
    are not JSON."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if m.get("role") != "assistant" or not isinstance(calls, list):
            out.append(m)
            continue
        if not calls:               # (an empty list would lead a template to its tool-call path)
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
            continue
        parsed = []
        for j, call in enumerate(calls):
            args = call["function"].get("arguments")
            if isinstance(args, str) and args:
                try:
                    args = json.loads(args)
                except ValueError as e:
                    raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}") from None
            parsed.append({**call, "function": {**call["function"], "arguments": args or {}}})
        out.append({**m, "tool_calls": parsed})
    return out


def check_message_calls(m: dict, where: str) -> str | None:
    """The problem with an assistant message's tool_calls, or None."""
    calls = m.get("tool_calls")
    if calls is None:
        return None
    if m.get("role") != "assistant" or not isinstance(calls, list):
        return f"{where}.tool_calls must be a list, in an assistant message"
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            return f"{where}.tool_calls[{j}] must be {{\"id\": ..., \"type\": \"function\", \"function\": " \
                   f"{{\"name\": ..., \"arguments\": ...}}}}"
        args = function.get("arguments")
        if not isinstance(args, (str, dict, type(None))):
            return f"{where}.tool_calls[{j}].function.arguments must be JSON text"
        if isinstance(args, str) and args:
            try:
                json.loads(args)
            except ValueError as e:
                return f"{where}.tool_calls[{j}].function.arguments is not JSON: {e}"
    return None


def parse_calls(parser: str, text: str, tools: tuple = ()) -> tuple[str | None, list[tuple]] | None:
    """A completion's (content, calls) as vLLM's parser of that name finds them, each call (name,
    arguments as JSON text), or (name, arguments, id) where the model writes the call's id (Kimi
    K2); None where it holds no call the parser can read: the text then stays the message's
    content, as vLLM gives it back.

    - hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
      each; the content is the text before the first.
    - llama3_json (Llama 3.1-3.3, Llama 4 in JSON): every JSON object in the text that holds a
      "name" and "arguments" (or "parameters"), after `<|python_tag|>` or not, with any separator
      (`; `); the text around them is dropped (content None). An object without them, or a `{`
      that starts no JSON, leaves the whole text as content.
    - pythonic (Llama 3.2, ToolACE): the whole text one Python list of calls with keyword
      arguments, `[get_weather(city="Paris", days=3), get_time()]`, whose values are literals
      (strings, numbers, True, False, None or null, true, false, and lists and dicts of them)
      that JSON can hold;
      llama4_pythonic (Llama 4) the same after `<|python_start|>`, its `<|python_end|>`s dropped.
      Anything else (text around the list, a positional argument, a name that is not a plain
      name) leaves the whole text as content. The content of calls is None. (vLLM's parser
      also reads sets and f-strings, and reads the first of several statements; those leave the
      text as content here.)
    - mistral (Mistral 7B v0.3, Mixtral, Mistral Small, Devstral): after `[TOOL_CALLS]`, a JSON
      list of {"name": ..., "arguments": {...}} (tokenizers before v11), or each call its own
      `[TOOL_CALLS]NAME[ARGS]ARGS` or `[TOOL_CALLS]NAME{...}` (v11 on), the arguments taken as
      written up to the end of their JSON (text after it dropped). The content is the text before
      the first `[TOOL_CALLS]`, stripped. (vLLM reads the second
      form only through mistral_common's tokenizer; with a Hugging Face tokenizer, as here, only
      the list.)
    - deepseek_v3 (DeepSeek-V3, R1): after <｜tool▁calls▁begin｜>, each
      `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>`;
      deepseek_v31 (DeepSeek-V3.1): `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`.
      The content is the text before the calls (and for deepseek_v3 the text after
      <｜tool▁calls▁end｜>); the arguments are taken as written. (vLLM's
      patterns stop at a line break, so it drops arguments written over several lines; these do
      not.)
    - kimi_k2 (Kimi K2): after <|tool_calls_section_begin|>, each `<|tool_call_begin|>
      functions.NAME:INDEX<|tool_call_argument_begin|>ARGS<|tool_call_end|>` (NAME may hold
      dots); the call's id is
      the model's `functions.NAME:INDEX`, as vLLM keeps it (Kimi's chat template reads it back
      from the tool messages), and the arguments are taken as written. The content is the text
      before the section.
    - qwen3_coder (Qwen3-Coder): `<tool_call><function=NAME><parameter=P>value</parameter>...
      </function></tool_call>`; a bare <function= is read too. Each value loses one line break at
      either end and is typed by its parameter's schema in `tools` (`coder_value`). The content
      is the text before the first call, stripped.

    A content that is blank is None."""
    if parser == "hermes":
        if HERMES_START not in text:
            return None
        try:
            objects = [json.loads(closed or open_) for closed, open_ in HERMES_CALL.findall(text)]
            calls = [(o["name"], json.dumps(o["arguments"], ensure_ascii=False)) for o in objects]
        except (ValueError, TypeError, KeyError):
            return None
        content = text[:text.find(HERMES_START)]
    elif parser == "llama3_json":
        calls, content = _json_objects(text), None
    elif parser in ("pythonic", "llama4_pythonic"):
        if parser == "llama4_pythonic" and text.startswith(PYTHON_START):
            text = text[len(PYTHON_START):].replace(PYTHON_END, "")
        calls, content = _pythonic_calls(text), None
    elif parser == "mistral":
        if MISTRAL_CALLS not in text:
            return None
        content, *raw = text.split(MISTRAL_CALLS)
        calls = _mistral_calls(raw)
    elif parser in ("deepseek_v3", "deepseek_v31"):
        if DEEPSEEK_START not in text:
            return None
        if parser == "deepseek_v3":
            found = DEEPSEEK_V3_CALL.findall(text)
            if any(kind != "function" for kind, _, _ in found):
                return None
            calls = [(name, args) for _, name, args in found]
        else:
            calls = DEEPSEEK_V31_CALL.findall(text)
        content = text[:text.find(DEEPSEEK_START)]
        if parser == "deepseek_v3" and (end := text.rfind(DEEPSEEK_END)) >= 0:
            content += text[end + len(DEEPSEEK_END):]       # (V3's parser keeps the text after the calls)
    elif parser == "kimi_k2":
        if KIMI_START not in text:
            return None
        calls = [(ident.strip().split(":")[0].removeprefix("functions."), args, ident.strip())
                 for ident, args in KIMI_CALL.findall(text)]
        content = text[:text.find(KIMI_START)]
    elif parser == "qwen3_coder":
        if "<function=" not in text:
            return None
        blocks = [closed or open_ for closed, open_ in CODER_BLOCK.findall(text)] or [text]
        functions = [closed or open_ for block in blocks for closed, open_ in CODER_FUNCTION.findall(block)]
        try:
            calls = [_coder_call(f, tools) for f in functions]
        except ValueError:
            return None
        first = next((i for i in (text.find(HERMES_START), text.find("<function=")) if i >= 0))
        content = text[:first]
    else:
        raise ValueError(f"unknown tool call parser {parser!r}")
    if not calls or not all(isinstance(call[0], str) and call[0] for call in calls):
        return None
    if parser in ("mistral", "qwen3_coder"):
        content = content.strip()        # (their parsers' engine strips the content beside calls)
    return (content if content and content.strip() else None), calls


def _coder_call(function: str, tools: tuple) -> tuple[str, str]:
    """One qwen3_coder call, `NAME>` and its parameters (the text after `<function=`), as (name,
    arguments). Raises ValueError where it has no `>`."""
    name, sep, body = function.partition(">")
    if not sep:
        raise ValueError("a function without its '>'")
    schema = next((t["function"].get("parameters") or {} for t in tools if t["function"]["name"] == name), {})
    properties = schema.get("properties", {}) if isinstance(schema.get("properties"), dict) else {}
    args = {}
    for param in CODER_PARAMETER.findall(body):
        key, sep, value = param.partition(">")
        if not sep:
            raise ValueError("a parameter without its '>'")
        value = value[1:] if value.startswith("\n") else value
        args[key] = coder_value(value[:-1] if value.endswith("\n") else value, properties.get(key))
    return name, json.dumps(args, ensure_ascii=False)


def coder_value(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's value, written as text, typed by its schema as vLLM's parser
    types it: a parameter the tool does not declare, or a string, stays text; "null" is None for
    the other types; an integer is int(), a number float() (an integral one an int); a boolean
    is true or false; an object or array, JSON or a Python literal. A value that does not read as
    its type stays text. A schema's `anyOf` or list of types takes its first type but null."""
    if not isinstance(schema, dict):
        return value
    kind = schema.get("type")
    if kind is None and isinstance(schema.get("anyOf"), list):
        kind = next((s.get("type") for s in schema["anyOf"] if isinstance(s, dict) and s.get("type") != "null"), None)
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind or "string").strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if value.lower() in ("null", "none"):
        return None
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            if not math.isfinite(number):       # (JSON has no inf or nan)
                return value
            return int(number) if number.is_integer() else number
    except (ValueError, OverflowError):
        return value
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(value.strip().lower(), value)
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        parsed = ast.literal_eval(value)
        json.dumps(parsed)
        return parsed
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _json_objects(text: str) -> list[tuple[str, str]] | None:
    """llama3_json's calls: each JSON object that starts at a `{` outside the objects before it."""
    if LLAMA_TAG not in text and "{" not in text:
        return None
    decoder, end, calls = json.JSONDecoder(), -1, []
    for match in re.finditer(r"\{", text):
        start = match.start()
        if start <= end:
            continue
        try:
            obj, length = decoder.raw_decode(text[start:])
            end = start + length
            args = obj["arguments"] if "arguments" in obj else obj["parameters"]
            calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
        except (ValueError, TypeError, KeyError):
            return None
    return calls


def _pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """pythonic's calls: the text one Python list of calls by plain names with keyword arguments
    whose values are literals JSON can hold; None for anything else."""
    if not text.lstrip().startswith("["):
        return None
    try:
        body = ast.parse(text.strip()).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    value = body[0].value if len(body) == 1 and isinstance(body[0], ast.Expr) else None
    if not isinstance(value, ast.List) or not all(isinstance(e, ast.Call) for e in value.elts):
        return None
    calls = []
    for call in value.elts:
        if not isinstance(call.func, ast.Name) or call.args or any(k.arg is None for k in call.keywords):
            return None
        try:
            args = {k.arg: ast.literal_eval(_JsonNames().visit(k.value)) for k in call.keywords}
            calls.append((call.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return calls


class _JsonNames(ast.NodeTransformer):
    """null, true and false written as JSON writes them, read as None, True and False (as vLLM's
    pythonic parser reads them)."""
    NAMES = {"null": None, "true": True, "false": False}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self.NAMES[node.id]) if node.id in self.NAMES else node


def _mistral_calls(raw: list[str]) -> list[tuple[str, str]] | None:
    """mistral's calls from the texts after each [TOOL_CALLS]: one JSON list of {"name",
    "arguments"} (a list found within the text if the whole is no JSON, as vLLM looks for one),
    or each text `NAME[ARGS]ARGS` (`NAME[CALL_ID]ID[ARGS]ARGS`) or `NAME{...}`, whose arguments are
    taken as written."""
    if len(raw) == 1 and raw[0].lstrip().startswith("["):
        written = raw[0].strip()
        try:
            items = json.loads(written)
        except ValueError:
            found = MISTRAL_LIST.search(written)
            try:
                items = json.loads(found.group(0)) if found else None
            except ValueError:
                items = None
        try:
            return [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in items] or None
        except (TypeError, KeyError):
            return None
    calls = []
    for call in raw:
        if call.lstrip().startswith("["):
            return None                  # a list after one of several [TOOL_CALLS]: neither form
        name, sep, args = call.partition(MISTRAL_ARGS)
        if not sep:
            if "{" not in call:
                continue                 # (vLLM passes over a call without arguments)
            name, args = call[:call.find("{")], call[call.find("{"):]
        calls.append((name.partition(MISTRAL_CALL_ID)[0].strip(), _first_json(args.strip())))
    return calls


def _first_json(args: str) -> str:
    """A mistral call's arguments as written up to the end of their first JSON value (the model
    may write text after them, which vLLM's parser drops); "{}" where none are written."""
    if not args:
        return "{}"
    try:
        return args[:json.JSONDecoder().raw_decode(args)[1]]
    except ValueError:
        return args


def constrained_calls(use: ToolUse, text: str) -> list[tuple[str, str]] | None:
    """The calls of a completion constrained by `tool_schema`: a named function's arguments are
    the text itself (as vLLM takes them, unchecked); "required"'s text is a JSON list of
    {"name", "parameters"}. None where it cannot be read (cut by max_new_tokens)."""
    if use.choice == "named":
        return [(use.name, text)]
    try:
        items = json.loads(text)
        return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items] or None
    except (ValueError, TypeError, KeyError):
        return None


def call_id(record_id: str, choice: int, k: int) -> str:
    """Call k of a record's choice `choice`: the same id on every run."""
    return "chatcmpl-tool-" + hashlib.sha256(f"{record_id}\0{choice}\0{k}".encode()).hexdigest()[:32]


def tool_calls_field(record_id: str, choice: int, calls: list[tuple]) -> list[dict]:
    """OpenAI's message.tool_calls: each call's id the model's where it wrote one, else `call_id`."""
    return [{"id": call[2] if len(call) > 2 else call_id(record_id, choice, k), "type": "function",
             "function": {"name": call[0], "arguments": call[1]}} for k, call in enumerate(calls)]


def check_parser_tokens(parser: str, encode) -> str | None:
    """The problem with reading `parser`'s calls from this tokenizer's outputs, or None: the
    markers its model writes calls with must be tokens of the vocabulary (vLLM's parsers refuse
    to start without them). `encode(text)`: its token ids, no special tokens added."""
    missing = [t for t in PARSER_TOKENS[parser] if len(encode(t)) != 1]
    if missing:
        return (f"output.tool_call_parser '{parser}' reads the calls its models write with {' and '.join(missing)}, "
                f"which the tokenizer has no token for: it is another model's parser")
    return None


def renders_tools(apply_template) -> bool:
    """Whether a chat template writes the tools it is given into the prompt: `apply_template(tools)`
    renders a user message with those tools (None: without)."""
    probe = [{"type": "function", "function": {"name": "msinfer_probe_tool", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    return apply_template(probe) != apply_template(None)
