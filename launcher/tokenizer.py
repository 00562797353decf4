"""The driver's tokenizer: records to prompt token ids, generated ids to text, stop strings.

A thin layer over transformers' AutoTokenizer, reading local files only (nothing downloads).
Chat templates are applied as vLLM does: render the template to text, then encode that text
without adding special tokens again (the template already holds BOS and the role markers).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Sequence

from msinfer.launcher.errors import RecordError, SystemicError, TokenizerError
from msinfer.launcher.inputs import Record, as_part_messages, as_text_messages
from msinfer.launcher.tools import HERMES_START, history, renders_tools
from msinfer.worker.imports import before_transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model",
                   "vocab.json", "vocab.txt", "merges.txt")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False, chat_template: str | None = None
                   ) -> Tokenizer | None:
    """None when the folder holds no tokenizer files (results then carry token ids only).
    `chat_template`: a template's text in place of the tokenizer's own (input.chat_template)."""
    path = Path(path)
    if not path.is_dir():
        raise TokenizerError(f"tokenizer folder {path} does not exist (model.tokenizer, or model.path when "
                             f"model.tokenizer is null)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    tok = Tokenizer(path, trust_remote_code)
    if chat_template is not None:
        tok.tok.chat_template = chat_template
        tok.has_chat_template = True
    return tok


class Tokenizer:
    def __init__(self, path: str | Path, trust_remote_code: bool = False):
        before_transformers()
        from transformers import AutoTokenizer

        self.path = str(path)
        try:
            self.tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True,
                                                     trust_remote_code=trust_remote_code)
        except Exception as e:  # transformers raises OSError, ValueError, json errors, ... for bad files
            raise TokenizerError(f"the tokenizer files in {self.path} do not load: {type(e).__name__}: {e}") from None
        self.eos_token_id: int | None = self.tok.eos_token_id
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _ids(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """A token's text alone, as vLLM names a token in log-probabilities
        (convert_ids_list_to_tokens): decoded, with the leading spaces back that a Metaspace
        pre-tokenizer's decode drops (Mistral's "▁Paris" is " Paris", where decoding it alone
        gives "Paris")."""
        text = self.tok.decode([token_id], skip_special_tokens=False)
        if not hasattr(self, "_space_marker"):
            self._space_marker = _space_marker(self.tok)
        if self._space_marker is None:
            return text
        raw = self.tok.convert_ids_to_tokens(token_id) or ""
        missing = (len(raw) - len(raw.lstrip(self._space_marker))) - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def context(self, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> tuple[list[int], str, bool]:
        """The prompt's last tokens that a completion is decoded after (`decode_after`), their
        text and whether special tokens are left out of it (sampling.skip_special_tokens): 4 or
        more tokens (up to CONTEXT_TOKENS), so that no character is cut in two."""
        n = len(prompt_ids)
        for k in range(min(4, n), min(n, CONTEXT_TOKENS) + 1):
            tail = list(prompt_ids[n - k:])
            text = self.decode(tail, skip_special_tokens)
            if "\ufffd" not in text:
                return tail, text, skip_special_tokens
        return [], "", skip_special_tokens

    def decode_after(self, context: tuple[list[int], str, bool], ids: Sequence[int]) -> str:
        """A completion's text as it reads after its prompt (`context`): a SentencePiece
        tokenizer (Llama 2, Mistral) drops the space of a sequence's first word, which a
        completion's first token has when it continues the prompt (" Paris" after "The capital of
        France is"); decoding it after the prompt's last tokens keeps it, as vLLM's detokenizer
        does. A byte-level BPE gives the same text either way."""
        tail, before, skip = context
        if tail:
            text = self.decode(tail + list(ids), skip)
            if text.startswith(before):
                return text[len(before):]
        return self.decode(ids, skip)

    def apply_chat_template(self, messages: list[dict], kwargs: dict | None = None, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list | None = None,
                            add_special_tokens: bool = False) -> list[int]:
        """The messages through the chat template, as vLLM renders a chat request: `kwargs` the
        template's own variables (chat_template_kwargs), `tools` the chat's tools (its `tools`
        variable), then a new assistant message opened, or with `continue_final_message` the last
        (assistant) message left open to be continued."""
        messages = developer_as_system(messages, self.tok.chat_template)
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, tools=tools,
                                            **(kwargs or {}))
        if not isinstance(text, str):  # some versions hand back token ids (a list or BatchEncoding) anyway
            return _ids(text)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def renders_tools(self, kwargs: dict | None = None) -> bool:
        """Whether the chat template writes a chat's tools into its prompt (launcher.tools)."""
        return renders_tools(lambda tools: self.apply_chat_template([{"role": "user", "content": "Hello"}], kwargs,
                                                                    tools=tools))

    def check_chat_template(self, kwargs: dict | None = None, own: bool = False) -> None:
        """Renders the chat template once for a plain user message, with the job's template
        variables (`plan`, before any worker starts): a template that cannot render fails here,
        not on every record. `own`: the template is the spec's (input.chat_template), not the
        tokenizer's."""
        if not self.has_chat_template:
            return
        which = ("the chat template of input.chat_template (the spec's, in place of the tokenizer's)" if own else
                 f"the chat template in {self.path}")
        try:
            self.apply_chat_template([{"role": "user", "content": "Hello"}], kwargs)
        except ImportError as e:
            raise TokenizerError(f"{which} cannot be rendered: {e}; "
                                 + ("install jinja2 (pip install jinja2), " if "jinja" in str(e) else "")
                                 + "or set input.chat_template: false to encode prompts as they are") from None
        except Exception as e:  # a template that raises, or uses what transformers does not give it
            fix = ("fix it, or set input.chat_template: true for the tokenizer's own" if own else
                   "fix the template (tokenizer_config.json or chat_template.jinja), or give one of your own in "
                   "input.chat_template")
            raise TokenizerError(f"{which} fails on a plain user message: {type(e).__name__}: {e}; {fix}, or set "
                                 f"input.chat_template: false to encode prompts as they are") from None

    def encode_record(self, record: Record, chat_template: bool, template_kwargs: dict | None = None,
                      generation_prompt: bool = True) -> list[int]:
        """Prompt token ids of a record: `prompt_token_ids` as given; `messages` through the chat
        template; `prompt` text through the chat template as one user message when `chat_template`
        is on and the tokenizer has one, else encoded as is. The template renders with the job's
        `template_kwargs` (input.chat_template_kwargs) and the record's own chat keys over them
        (launcher.inputs.CHAT_KEYS); `generation_prompt`: add_generation_prompt unless the record
        sets it (off for task embed, as vLLM's embedding requests)."""
        where = f"record '{record.id}'"
        if record.prompt_token_ids is not None:
            return list(record.prompt_token_ids)
        if record.messages is not None and not self.has_chat_template:
            raise RecordError(f"{where}: has 'messages', but the tokenizer in {self.path} has no chat template; "
                              f"give one as input.chat_template (a Jinja file), or the prompt as 'prompt' text")
        if record.messages is None and record.prompt is None:
            raise RecordError(f"{where}: has no prompt to encode")
        own = record.chat or {}
        templated = record.messages is not None or (chat_template and self.has_chat_template)
        if (own or record.tools) and not templated:
            raise RecordError(f"{where}: has '{next(iter(own)) if own else 'tools'}', but its prompt does not go "
                              f"through the chat template (input.chat_template is off, or the tokenizer has none)")
        options = {"kwargs": {**(template_kwargs or {}), **own.get("chat_template_kwargs", {})},
                   "continue_final_message": own.get("continue_final_message", False), "tools": record.tools}
        options["add_generation_prompt"] = own.get("add_generation_prompt",
                                                   generation_prompt and not options["continue_final_message"])
        special = (record.embed_options or {}).get("add_special_tokens")     # (vLLM's, an embeddings request's)
        try:
            if record.messages is not None:
                as_given = as_part_messages if content_format(self.tok.chat_template) == "openai" else \
                    as_text_messages
                ids = self.apply_chat_template(history(as_given(record.messages)), **options,
                                               add_special_tokens=bool(special))
            elif templated:
                ids = self.apply_chat_template([{"role": "user", "content": record.prompt}], **options)
            else:
                ids = self.encode(record.prompt, add_special_tokens=special is not False)
        except (ImportError, OSError, MemoryError) as e:     # the environment's fault, not the record's
            raise SystemicError(
                f"the tokenizer in {self.path} cannot encode records ({where} was the first): {type(e).__name__}: "
                f"{e}. Every record would fail the same way, so the job stops; "
                + ("install jinja2, which chat templates need (pip install jinja2), " if "jinja2" in str(e) else "")
                + "then run the job again: finished records are kept") from None
        except Exception as e:  # a template's raise_exception(), a bad message, ...
            raise RecordError(f"{where}: the tokenizer cannot encode it: {type(e).__name__}: {e}") from None
        if not ids:
            raise RecordError(f"{where}: the prompt encodes to no tokens")
        return ids

    def encode_continuation(self, record: Record) -> list[int] | None:
        """Token ids of a scoring record's continuation, encoded on its own with no special tokens."""
        if record.continuation_token_ids is not None:
            return list(record.continuation_token_ids)
        if record.continuation is None:
            return None
        ids = self.encode(record.continuation, add_special_tokens=False)
        if not ids:
            raise RecordError(f"record '{record.id}': the continuation encodes to no tokens")
        return ids


def _ids(x: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding (a dict) from apply_chat_template(tokenize=True)
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    x = list(x)
    if x and isinstance(x[0], (list, tuple)):
        x = list(x[0])
    return [int(t) for t in x]


# prompt tokens a completion is decoded after at most (Tokenizer.context). vLLM primes its decode
# stream with the prompt (vllm/v1/engine/detokenizer.py, FastIncrementalDetokenizer; earlier
# versions with its last 4 to 24 tokens); a decoder's word boundary needs only the last few.
CONTEXT_TOKENS = 24


@functools.lru_cache(maxsize=32)
def content_format(template: Any) -> str:
    """How vLLM gives a chat template a message's content (renderers/hf.py
    _detect_content_format): "openai", a list of parts, where the template loops over a
    message's content (Gemma 3, Llama 4: `for item in message['content']`), else "string", the
    parts' texts joined. Found in the template's syntax tree: a loop over `X['content']` (or
    `X.content`) where X is a message (a loop variable over `messages`, or over a variable set
    from it), or over a variable named `content`. A template that does not parse: "string"."""
    if not isinstance(template, str):
        return "string"
    try:
        from jinja2 import nodes
        from transformers.utils.chat_template_utils import _compile_jinja_template
        root = _compile_jinja_template(template).environment.parse(template)
    except Exception:       # (a template transformers cannot compile fails where it renders, named)
        return "string"

    def base(node):         # through filters, tests and slices to what they read
        while isinstance(node, (nodes.Filter, nodes.Test)) or (
                isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            node = node.node
        return node

    def dotted(node) -> str | None:     # ns.rest, a namespace's attribute, as one name
        if isinstance(node, nodes.NSRef):
            return f"{node.name}.{node.attr}"
        if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name):
            return f"{node.node.name}.{node.attr}"
        return node.name if isinstance(node, nodes.Name) else None

    def reads(node, names: set, key: str | None = None) -> bool:
        node = base(node)
        if key is None:
            return dotted(node) in names
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key:
            return reads(node.node, names)
        return isinstance(node, nodes.Getattr) and node.attr == key and reads(node.node, names)

    lists = {"messages"}
    while True:             # variables set from messages (loop_messages = messages[1:], a namespace's
        more = set()        # ns.rest), and theirs
        for a in root.find_all(nodes.Assign):
            if reads(a.node, lists) and (name := dotted(a.target)):
                more.add(name)
            elif isinstance(a.target, nodes.Name) and isinstance(a.node, nodes.Call) and \
                    isinstance(a.node.node, nodes.Name) and a.node.node.name == "namespace":
                more |= {f"{a.target.name}.{k.key}" for k in a.node.kwargs if reads(k.value, lists)}
        more -= lists
        if not more:
            break
        lists |= more
    items = {loop.target.name for loop in root.find_all(nodes.For)
             if isinstance(loop.target, nodes.Name) and reads(loop.iter, lists)}
    for loop in root.find_all(nodes.For):
        if reads(loop.iter, items, "content") or reads(loop.iter, {"content"}):
            return "openai"
    return "string"


def _space_marker(tok) -> str | None:
    """The character a Metaspace pre-tokenizer writes for a space ("▁"), read from the tokenizer's
    own description as vLLM reads it (get_leading_space_marker); None for others (byte-level BPE
    decodes a token's space itself)."""
    try:
        pre = json.loads(tok.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    except (AttributeError, ValueError, TypeError):
        return None
    for p in [pre, *(pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else [])]:
        if isinstance(p, dict) and p.get("type") == "Metaspace":
            return p.get("replacement", "\u2581")
    return None


def developer_as_system(messages: list[dict], template: Any) -> list[dict]:
    """OpenAI's `developer` messages for a chat template that does not name that role, as vLLM
    renders them (renderers/hf.py, _convert_developer_to_system, _consolidate_system_messages):
    as system messages, and every system message then one at the front, their texts joined by a
    blank line. A template that names "developer" gets the messages as they are."""
    if not any(m.get("role") == "developer" for m in messages) or (
            isinstance(template, str) and ('"developer"' in template or "'developer'" in template)):
        return messages
    converted = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m.get("role") == "developer"
                 else m for m in messages]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if systems == [0]:
        return converted
    texts = [converted[i].get("content") for i in systems]
    return [{"role": "system", "content": "\n\n".join(t for t in texts if t)},
            *(m for m in converted if m["role"] != "system")]


class StopStringMatcher:
    """Finds the first stop string in one sequence's growing output text.

    Call `check(text)` with the whole decoded output after each new token; it returns the index
    at which to cut the output or None: where the stop string that ends first starts (the stop string
    is not part of the output), or with `include` (vLLM's include_stop_str_in_output) where it
    ends. As vLLM's detokenizer (check_stop_strings), only a stop string that ends in the text
    added since the last call is looked for, so a long output costs no more per step than a
    short one; `check(text, search=False)` takes the text as seen without looking in it (the
    text of a sequence's first min_tokens tokens, which vLLM never searches).
    """

    def __init__(self, stop: Sequence[str], include: bool = False):
        self.stop = tuple(s for s in stop if s)
        self.include = include
        self.matched: str | None = None     # the stop string it found
        self.checked = 0  # leading characters of the text already seen
        # the characters at the end of a running sequence's text that a stream holds back: the
        # start of a stop string that the next tokens may complete (vLLM's stop_buffer_length)
        self.held = 0 if include else max(map(len, self.stop), default=1) - 1

    def check(self, text: str, search: bool = True) -> int | None:
        if not self.stop:
            return None
        seen = min(self.checked, len(text))
        # a trailing U+FFFD is a multi-byte character still incomplete: the next token may change it
        self.checked = len(text.rstrip("\ufffd"))
        if not search:
            return None
        hits = [(i + len(s), k, i) for k, s in enumerate(self.stop)
                if (i := text.find(s, max(0, seen - len(s) + 1))) >= 0]
        if not hits:
            return None
        end, k, i = min(hits)       # the one that ends first (as text grows a character at a time);
        self.matched = self.stop[k]             # of those ending together, the first listed
        return end if self.include else i


# output.reasoning_parser (qwen3, deepseek_r1): vLLM's parsers of the same names, for the models
# that write their reasoning between <think> and </think> before the answer
THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(parser: str, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    """A chat completion's text as (reasoning, content), as vLLM's reasoning parsers split it
    (vllm/reasoning: BaseThinkingReasoningParser for deepseek_r1, and DeepSeekV3ReasoningParser:
    deepseek_r1's where thinking is on, else the text as it is; qwen3: _qwen3_split): a <think>
    the model wrote is dropped (a template may open it in the prompt instead); the text before
    </think> is the reasoning and the rest the content (None where empty). Without </think> it is
    all reasoning, cut before the model finished thinking. `thinking`: RecordCodec.thinking's,
    per parser (chat_template_kwargs enable_thinking, thinking)."""
    if parser == "qwen3":
        return _qwen3_split(text) if thinking else (None, text)
    if parser == "deepseek_v3" and not thinking:
        return None, text
    before, start, after = text.partition(THINK_START)
    text = after if start else before
    if THINK_END in text:
        reasoning, _, content = text.partition(THINK_END)
        return reasoning, content or None
    return text, None


_QWEN3_TAGS = re.compile(f"({re.escape(THINK_START)}|{re.escape(THINK_END)}|{re.escape(HERMES_START)})")


def _qwen3_split(text: str) -> tuple[str | None, str | None]:
    """vLLM's Qwen3 reasoning parser with thinking on (vllm/parser/qwen3.py, qwen3_config's
    transitions): the text is reasoning until </think>, or until a <tool_call>, which ends the
    thinking and starts the content (a call written before </think> is still a call); a <think> in
    the reasoning and a </think> in the content are dropped; an empty part is None."""
    reasoning, content, thinking = [], [], True
    for part in _QWEN3_TAGS.split(text):
        if thinking and part == THINK_END:
            thinking = False
        elif thinking and part == HERMES_START:
            thinking = False
            content.append(part)
        elif part != (THINK_START if thinking else THINK_END):
            (reasoning if thinking else content).append(part)
    return "".join(reasoning) or None, "".join(content) or None


def check_reasoning_tokens(tok: Tokenizer, parser: str) -> str | None:
    """The problem with splitting this tokenizer's outputs with `parser`, or None: vLLM's parsers
    need <think> and </think> as tokens of their own, which the text keeps as it is decoded."""
    missing = [t for t in (THINK_START, THINK_END)
               if len(ids := tok.encode(t, add_special_tokens=False)) != 1 or tok.decode(ids) != t]
    if missing:
        return (f"output.reasoning_parser '{parser}' splits a completion at {THINK_START} and {THINK_END}, but the "
                f"tokenizer in {tok.path} has no token {' or '.join(missing)} that its text keeps: the model does not "
                f"write its reasoning so; leave output.reasoning_parser unset")
    return None
