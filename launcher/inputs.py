"""Input records, read lazily from .txt (one prompt a line), .jsonl or .parquet (same keys as
jsonl, as columns). A .jsonl line with `custom_id` or `body` is an OpenAI Batch API request
(`parse_openai`): its `custom_id` is the record's id and its body's parameters its sampling.

A bad record never raises: it comes back with `error` set (naming its line and the problem) so
that the caller writes an error result and reads on. Only a file that cannot be read at all
raises `InputError`, from `check_input` / `read_records`, before any record is served.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import heapq
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from msinfer.launcher.errors import InputError
from msinfer.launcher.idset import IdIndex, chunks, id_hash, place, unplace, words
from msinfer.launcher.openai_batch import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL
from msinfer.launcher.spec import INPUT_SUFFIXES, SYNONYMS, SamplingSpec, is_pattern
from msinfer.launcher.tools import ToolUse, check_message_calls, check_tools, tool_schema, tool_use

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
# how a record's messages go through the chat template, with vLLM's names (its chat requests and
# LLM.chat): the template's own variables (Qwen3's enable_thinking), and the two switches
CHAT_KEYS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")
# a chat's tools (launcher.tools), with OpenAI's names, in a record as in a chat completions request
TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")
KNOWN_KEYS = ("id", *PROMPT_KEYS, "sampling", "continuation", "continuation_token_ids", *CHAT_KEYS, *TOOL_KEYS)
# A record's sampling is read from its 'sampling' object only, and its chat template's variables
# from 'chat_template_kwargs'. Such a key at the top of a record (as OpenAI's and vLLM's requests
# put sampling keys, with their names, or as transformers' apply_chat_template takes Qwen3's
# enable_thinking) would be ignored without a word, so such a record fails instead
# (`misplaced_keys`), and so does a parquet file with such a column.
MISPLACED = {**{k: f"sampling.{k}" for k in SamplingSpec.model_fields},
             **{k: f"sampling.{v}" for k, v in SYNONYMS.items()}, "sampling_params": "sampling",
             "enable_thinking": "chat_template_kwargs.enable_thinking"}
ELSEWHERE = ("A record's sampling is read from its 'sampling' object only, and its chat template's variables "
             "from its 'chat_template_kwargs'")
PARQUET_BATCH_ROWS = 1024


@dataclass
class Record:
    id: str                                     # the key resume, shards and duplicates go by
    line: int                                   # 1-based line (.txt, .jsonl) or row (.parquet)
    prompt: str | None = None
    messages: list | None = None
    prompt_token_ids: list[int] | None = None
    prompts: list | None = None                 # an OpenAI completions request's list of prompts (texts or token ids)
    continuation: str | None = None
    continuation_token_ids: list[int] | None = None
    sampling: dict = field(default_factory=dict)
    error: str | None = None
    openai: str | None = None                   # an OpenAI Batch request's url: how its result is written
    openai_logprobs: int | None = None          # the log-probability alternatives it asks for (None: none)
    openai_reasoning: bool = True               # its include_reasoning (output.reasoning_parser's text in the line)
    openai_base64: bool = False                 # an embeddings request's encoding_format base64
    # an OpenAI request's echo: a completion's "all" (each choice after its prompt) or "prompt"
    # (max_tokens 0: the prompt alone); a chat completion's "chat" (`echoed_message`); or None
    openai_echo: str | None = None
    openai_token_ids: bool = False              # vLLM's return_token_ids: the token ids in the answer too
    dimensions: int | None = None               # an embeddings request's: its vector's first k values only
    # an embeddings request's vLLM options: use_activation (normalize or not), add_special_tokens,
    # truncation_side (of truncate_prompt_tokens); None: the job's and vLLM's defaults
    embed_options: dict | None = None
    digest: str | None = None                   # its input's `input_digest` (None: a line that is not UTF-8)
    chat: dict | None = None                    # its CHAT_KEYS given (`check_chat`), for the chat template
    tools: list | None = None                   # its tools, for the chat template (launcher.tools)
    tool_use: ToolUse | None = None             # how its completion's tool calls are found (tool_choice not none)
    given_id: int | None = None                 # an integer id as the input gave it: its result line keeps it so
    source: str = ""                            # its file, where input.path is a folder or a pattern (`input_files`)

    def at(self, unit: str = "line") -> str:
        """Where it is in the input (`location`)."""
        return location(self.source, self.line, unit)


def location(source: str, line: int, unit: str = "line") -> str:
    """Where a record is in the input, as messages name it: "line 3", or "b.jsonl line 3"."""
    return f"{source} {unit} {line}" if source else f"{unit} {line}"


def line_id(source: str, n: int) -> str:
    """The id of a record that gives none: its line (row) number, after its file's name where
    input.path has several files (`input_files`)."""
    return f"{source}:{n}" if source else str(n)


def file_label(path: Path, root: Path | None) -> str:
    """A file's name in ids and messages: relative to the folder `input_files` gives ("" for one
    file, named by line alone)."""
    if root is None:
        return ""
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def input_digest(text: str) -> str:
    """What a record's result answers, as the results file's side file keeps it (launcher.writer,
    `ResultWriter`): a hash of its line's text (a .txt prompt, a .jsonl line without the white
    space around it) or of its parquet row, so that a re-run can tell a record that changed since
    its result was written (launcher.job, `changed_records`)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def input_files(path: str | Path) -> tuple[list[Path], Path | None]:
    """input.path's files and the folder their names in ids and messages are relative to (None:
    one file, named by line alone): the file; a folder's .txt, .jsonl or .parquet files (not
    hidden ones); or a pattern's files (`data/*.parquet`, `data/**/*.jsonl`), relative to its
    folder before the first wildcard. In name order, and of one kind."""
    path = Path(path)
    if is_pattern(path):
        root = Path(*itertools.takewhile(lambda part: not is_pattern(part), path.parts))
        files = sorted(Path(f) for f in glob.glob(str(path), recursive=True) if os.path.isfile(f))
        if not files:
            raise InputError(f"input.path {path}: no file matches the pattern")
    elif path.is_dir():
        root = path
        files = sorted(f for f in path.iterdir()
                       if f.is_file() and f.suffix.lower() in INPUT_SUFFIXES and not f.name.startswith("."))
        if not files:
            raise InputError(f"input folder {path} holds no .txt, .jsonl or .parquet file")
    else:
        return [path], None
    kinds = sorted({f.suffix.lower() for f in files})
    if len(kinds) > 1 or kinds[0] not in INPUT_SUFFIXES:
        raise InputError(f"input.path {path} holds files of {len(kinds)} kind(s) ({', '.join(kinds)}); expected "
                         f".txt, .jsonl or .parquet files of one kind")
    return files, root


def reads_back(input_path: str | Path, output_path: str | Path) -> bool:
    """Whether input.path, a folder or a pattern, would take the results file `output_path` for
    one of its input files once it exists (a re-run would read its results as records)."""
    out = Path(output_path)
    if is_pattern(input_path):
        return fnmatch.fnmatch(str(out), str(input_path))       # (its * spans folders: it errs on the safe side)
    folder = Path(input_path)
    return folder.is_dir() and out.parent == folder and out.suffix.lower() in INPUT_SUFFIXES


FORMAT_LINES = 1000      # lines of a .jsonl input read at most to find its first JSON object


def is_openai_batch(path: str | Path) -> bool:
    """Whether a .jsonl input's first JSON object (in its files' order, past empty files and
    lines that are not JSON, up to FORMAT_LINES lines) is an OpenAI Batch API request
    (`is_openai_request`): one bad line first does not decide the format of every result."""
    try:
        files = input_files(path)[0]
    except InputError:
        return False
    read = 0
    for f in files:
        if f.suffix.lower() != ".jsonl" or not f.is_file():
            return False
        for _, text, error in _lines(f):
            read += 1
            if read > FORMAT_LINES:
                return False
            try:
                obj = json.loads(text) if not error else None
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return is_openai_request(obj)
    return False


def is_openai_request(obj: dict) -> bool:
    """Whether a .jsonl line's object is an OpenAI Batch API request: it has `custom_id` or
    `body`, which no record of msinfer's own has (one missing the other is such a request, and
    its error line keeps the custom_id it has)."""
    return "custom_id" in obj or "body" in obj


def check_input(path: str | Path, pick=None) -> tuple[list[Path], Path | None]:
    """Cheap checks that input.path's files (`input_files`) exist, are readable and have a known
    format (a parquet file's footer and columns are read, no rows); the files and their folder.
    `pick(files)`: the files to check and read, of all (a shard's, launcher.shards)."""
    files, root = input_files(path)
    if pick is not None:
        files = pick(files)
    for f in files:
        _check_file(f)
    return files, root


def _check_file(path: Path) -> None:
    suffix = path.suffix.lower()
    if suffix not in INPUT_SUFFIXES:
        raise InputError(f"input file {path}: expected a .txt, .jsonl or .parquet file")
    if not path.exists():
        raise InputError(f"input file {path} does not exist")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise InputError(f"input file {path} cannot be read: {e.strerror or e}") from None
    if suffix == ".parquet":
        names = _parquet_file(path).schema_arrow.names
        if not any(k in names for k in PROMPT_KEYS):
            raise InputError(f"input file {path} has no column {', '.join(map(repr, PROMPT_KEYS))}; "
                             f"its columns are {', '.join(names) or '(none)'}")
        if misplaced := misplaced_keys(names):
            raise InputError(f"input file {path} has columns that belong inside others: {misplaced}. "
                             f"{ELSEWHERE} (struct columns): move them there, or rename them")


def read_records(path: str | Path, pick=None) -> Iterator[Record]:
    """Checks the files now (raising InputError), then yields their records one by one, file by
    file. A record without an id takes its line (row) number; in a folder's or a pattern's files,
    "<file>:<line>", the file's name relative to the folder, so that ids stay unique and stay
    the same when files are added. `pick`: as check_input's."""
    files, root = check_input(path, pick)
    if not files:
        return iter(())
    reader = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}[files[0].suffix.lower()]
    records = itertools.chain.from_iterable(reader(f, file_label(f, root)) for f in files)
    return _unique_ids(records, unit_of(files[0]))


def unit_of(path: str | Path) -> str:
    """What a record is in an input file of this kind: a parquet row, a line of text."""
    return "row" if str(path).lower().endswith(".parquet") else "line"


# characters a token, for ordering records only: BPE vocabularies of English text hold about 4
CHARS_PER_TOKEN = 4


def expected_length(rec: Record, max_new_tokens: int, score: bool = False) -> int:
    """The tokens a record is expected to run for: its prompt's (token ids as given, text at
    CHARS_PER_TOKEN characters a token) plus its max_new_tokens (its own sampling override where
    that is a positive whole number), or, where `score` and it has a continuation (task: score
    scores those and generates the others), its continuation's. Its samples (n) run side by side,
    so they do not lengthen it. A record with an error costs nothing."""
    if rec.error:
        return 0
    if rec.prompt_token_ids is not None:
        prompt = len(rec.prompt_token_ids)
    elif rec.prompts is not None:       # (several prompts: the longest sets when the record ends)
        prompt = max(len(p) if isinstance(p, list) else len(p) // CHARS_PER_TOKEN for p in rec.prompts)
    elif isinstance(rec.messages, list):
        prompt = sum(len(str(m.get("content", ""))) if isinstance(m, dict) else len(str(m))
                     for m in rec.messages) // CHARS_PER_TOKEN
    else:
        prompt = len(rec.prompt or "") // CHARS_PER_TOKEN
    if score and (rec.continuation_token_ids is not None or rec.continuation is not None):
        cont = rec.continuation_token_ids
        return prompt + (len(cont) if cont is not None else len(rec.continuation) // CHARS_PER_TOKEN)
    own = rec.sampling.get("max_new_tokens") if isinstance(rec.sampling, dict) else None
    new = own if isinstance(own, int) and not isinstance(own, bool) and own > 0 else max_new_tokens
    return prompt + new


def longest_first(records: Iterator[Record], window: int, length) -> Iterator[Record]:
    """`records`, read `window` ahead: of the records read and not yet given out, the one of the
    greatest `length(record)` comes first (the earliest of equal ones). Long records start early
    and short ones fill in behind them, so the job's tail is not one long record dealt last
    (longest processing time first, within the window)."""
    heap: list = []
    for i, rec in enumerate(records):
        heapq.heappush(heap, (-length(rec), i, rec))
        if len(heap) >= window:
            yield heapq.heappop(heap)[2]
    while heap:
        yield heapq.heappop(heap)[2]


def _unique_ids(records: Iterator[Record], unit: str) -> Iterator[Record]:
    # a repeated id becomes an error record with its own id "<id>@<line>" (or "<id>@<line>.2", .3,
    # ... where an earlier record holds that one): the results file keeps one line per id, resuming
    # never takes the duplicate's error for the first record's result, and a re-run names it alike.
    # Each id's place is held for every record read, compactly (launcher.idset: 24 bytes an id), a
    # chunk of records at a time.
    index, sources = IdIndex(), {"": 0}     # a record's place (launcher.idset.place): its file's number, its line
    names = [""]
    for chunk in chunks(records):
        keys = [id_hash(r.id) for r in chunk]
        held = index.find(*words(keys)).tolist()
        fresh: dict[bytes, int] = {}            # this chunk's ids (`id_hash`): their places
        for r, key, seen in zip(chunk, keys, held):
            if seen < 0:
                seen = fresh.get(key, -1)
            if seen >= 0:
                file, line = unplace(seen)
                error = (f"{r.at(unit)}: id '{r.id}' was already used on {location(names[file], line, unit)}; ids must "
                         f"be unique")
                where = line_id(r.source, r.line)
                rid, k = f"{r.id}@{where}", 1
                while (key := id_hash(rid)) in fresh or index.find(*words(key))[0] >= 0:
                    k += 1
                    rid = f"{r.id}@{where}.{k}"
                r = Record(id=rid, line=r.line, error=r.error or error, digest=r.digest, source=r.source)
            number = sources.get(r.source)
            if number is None:
                number = sources[r.source] = len(names)
                names.append(r.source)
            fresh[key] = place(number, r.line)
            yield r
        index.add(*words(b"".join(fresh)), np.fromiter(fresh.values(), np.uint64, len(fresh)))


def _lines(path: Path, source: str = "") -> Iterator[tuple[int, str, str | None]]:
    """(line number, text, error) of every line that is not blank; a line that is not UTF-8
    comes with its error and no text. `source`: the file's name in messages (input_files)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            text, error = _decode(raw, n, source)
            if error or text.strip():
                yield n, text, error


def _read_txt(path: Path, source: str = "") -> Iterator[Record]:
    for n, text, error in _lines(path, source):
        rid = line_id(source, n)
        if error:
            yield Record(id=rid, line=n, error=error, source=source)
        else:
            prompt = text.removesuffix("\n").removesuffix("\r")
            yield Record(id=rid, line=n, prompt=prompt, digest=input_digest(prompt), source=source)


def _read_jsonl(path: Path, source: str = "") -> Iterator[Record]:
    for n, text, error in _lines(path, source):
        if error:
            yield Record(id=line_id(source, n), line=n, error=error, source=source)
            continue
        digest = input_digest(text.strip())
        text = text.rstrip()
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            cut = " (the line ends before its JSON does)" if e.pos >= len(text) else ""
            yield Record(id=line_id(source, n), line=n, source=source, digest=digest,
                         error=f"{location(source, n)}: invalid JSON{cut}: {e.msg} at column {e.colno}")
            continue
        rec = parse_openai(obj, n, "line", source) if isinstance(obj, dict) and is_openai_request(obj) \
            else parse_record(obj, n, "line", source)
        rec.digest = digest
        yield rec


def _read_parquet(path: Path, source: str = "") -> Iterator[Record]:
    pf = _parquet_file(path)
    columns = [c for c in pf.schema_arrow.names if c in KNOWN_KEYS]
    n = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
        for row in batch.to_pylist():
            n += 1
            row = _drop_nulls(row)
            rec = parse_record(row, n, "row", source)
            rec.digest = input_digest(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str))
            yield rec


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise InputError(f"input file {path}: reading .parquet needs pyarrow, which does not import here "
                         f"({e})") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
        raise InputError(f"input file {path} is not a readable parquet file: {e}") from None


def _drop_nulls(row: dict) -> dict:
    # parquet columns and struct fields exist in every row; a null means "not given"
    out = {}
    for k, v in row.items():
        if v is None:
            continue
        if k in ("sampling", "chat_template_kwargs") and isinstance(v, dict):    # (a struct's fields unite the rows')
            v = {sk: sv for sk, sv in v.items() if sv is not None}
        elif k == "messages" and isinstance(v, list):
            v = [{mk: mv for mk, mv in m.items() if mv is not None} if isinstance(m, dict) else m for m in v]
        out[k] = v
    return out


def _decode(raw: bytes, n: int, source: str = "") -> tuple[str, str | None]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return "", (f"{location(source, n)}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of "
                    f"the line)")
    return (text.removeprefix("\ufeff") if n == 1 else text), None


def parse_record(obj: Any, n: int, unit: str = "line", source: str = "") -> Record:
    """One JSON object (a jsonl line, a parquet row) as a Record; problems go to `error`.
    `source`: its file's name where input.path has several (a record without an id is named by it)."""
    where, by_line = location(source, n, unit), line_id(source, n)
    if not isinstance(obj, dict):
        return Record(id=by_line, line=n, source=source, error=f"{where}: expected a JSON object with a 'prompt', "
                                                              f"'messages' or 'prompt_token_ids' key, got {_type(obj)}")
    rid = obj.get("id")
    given = None
    if rid is None:
        rid = by_line
    elif isinstance(rid, float) and rid.is_integer():  # pandas stores integer ids with gaps as floats
        given = int(rid)
        rid = str(given)
    elif isinstance(rid, bool) or not isinstance(rid, (str, int)) or not str(rid).strip():
        return Record(id=by_line, line=n, source=source,
                      error=f"{where}: 'id' must be a non-empty string or an integer, got {rid!r}")
    else:
        given = rid if isinstance(rid, int) else None
        rid = str(rid)
    rec = Record(id=rid, line=n, given_id=given, source=source)
    rec.error = _fill(rec, obj)
    if rec.error:
        rec = Record(id=rid, line=n, given_id=given, source=source, error=f"{where}: {rec.error}")
    elif misplaced := misplaced_keys(obj):
        # (named by its id, as the sampling checks name a record: records alike fail alike, and the
        # job stops when its first ones all do, launcher/job.py)
        rec = Record(id=rid, line=n, given_id=given, source=source,
                     error=f"record '{rid}': keys at the top of the record that belong inside others: {misplaced}. "
                           f"{ELSEWHERE}")
    return rec


def misplaced_keys(keys) -> str | None:
    """The top-level keys of a record (or columns of a parquet file) that name sampling parameters
    or chat template variables (MISPLACED), listed with where each belongs; None if none does."""
    found = [k for k in keys if k in MISPLACED]
    if not found:
        return None
    return ", ".join(f"'{k}' (meant as {MISPLACED[k]}?)" for k in found)


OPENAI_URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
# body keys msinfer serves, and what each becomes; `model` names nothing here (the job has one model)
OPENAI_SAMPLING = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                   "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop", "n": "n",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "logit_bias": "logit_bias",
                   # vLLM's extra sampling parameters, which its OpenAI server takes in the body too
                   "top_k": "top_k", "min_p": "min_p", "min_tokens": "min_tokens",
                   "repetition_penalty": "repetition_penalty", "allowed_token_ids": "allowed_token_ids",
                   "bad_words": "bad_words", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
                   "prompt_logprobs": "prompt_logprobs", "include_stop_str_in_output": "include_stop_str_in_output",
                   "skip_special_tokens": "skip_special_tokens", "truncate_prompt_tokens": "truncate_prompt_tokens"}
OPENAI_IGNORED = ("model", "user", "stream", "logprobs", "response_format", "top_logprobs", "metadata", "store",
                  "guided_decoding_backend", "include_reasoning",
                  # vLLM's, which change nothing a batch answers: its scheduling priority (vLLM's
                  # default first-come policy ignores it too), its own request id, and the options of
                  # a stream (a batch has none)
                  "priority", "request_id", "stream_options")
# vLLM's reasoning_effort (renderers/params.py ReasoningEffort): a chat's template variable, and
# enable_thinking (unless chat_template_kwargs sets it) true for any but "none"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# parameters that change what would be generated and that msinfer does not serve yet: refused
# per request (a 400), not silently ignored, unless they have their neutral value
OPENAI_NEUTRAL = {"best_of": 1, "suffix": None,
                  "spaces_between_special_tokens": True,
                  "guided_whitespace_pattern": None}
# vLLM's structured outputs in a request's body: its `structured_outputs` object (vLLM >= 0.10.2,
# sampling.structured_outputs' names) or, before it, the guided_* keys
OPENAI_STRUCTURED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                     "guided_grammar": "grammar", "structured_outputs": None}


def parse_openai(obj: dict, n: int, unit: str = "line", source: str = "") -> Record:
    """One OpenAI Batch API request line: {custom_id, method, url, body}. The body is a chat
    completion (messages) or a completion (prompt: a string or token ids) request. `source`: as
    parse_record's."""
    where = location(source, n, unit)
    rid = obj.get("custom_id")
    if not isinstance(rid, str) or not rid.strip():
        return Record(id=line_id(source, n), line=n, source=source,
                      error=f"{where}: 'custom_id' must be a non-empty string, got {rid!r:.40}")
    url, body = obj.get("url"), obj.get("body")
    rec = Record(id=rid, line=n, source=source, openai=url if url in OPENAI_URLS else CHAT_URL)
    if obj.get("method", "POST") != "POST":
        rec.error = f"{where}: method {obj.get('method')!r} is not POST"
    elif url not in OPENAI_URLS:
        rec.error = f"{where}: url {url!r} is not one of {', '.join(OPENAI_URLS)}"
    elif "body" not in obj:
        rec.error = f"{where}: the request has no 'body' (the {url} request itself)"
    elif not isinstance(body, dict):
        rec.error = f"{where}: 'body' must be an object, got {_type(body)}"
    else:
        rec.error = _fill_embedding(rec, body) if url == EMBEDDINGS_URL else _fill_openai(rec, body, url == CHAT_URL)
        if rec.error:
            rec.error = f"{where}: {rec.error}"
    return rec


def _fill_openai(rec: Record, body: dict, chat: bool) -> str | None:
    key = "messages" if chat else "prompt"
    if body.get(key) is None:
        return f"the body of a {rec.openai} request needs '{key}'"
    if chat:
        rec.messages = body["messages"]
        if error := _check_messages(rec.messages):
            return error
    elif isinstance(body["prompt"], str) and body["prompt"]:
        rec.prompt = body["prompt"]
    elif isinstance(body["prompt"], list) and body["prompt"] and all(isinstance(t, int) for t in body["prompt"]):
        rec.prompt_token_ids = body["prompt"]
        if error := _check_ids(rec.prompt_token_ids, "prompt"):
            return error
    elif isinstance(body["prompt"], list) and body["prompt"] and all(isinstance(p, str) for p in body["prompt"]):
        rec.prompts = body["prompt"]           # several prompts: a choice (n of them) for each, in order
        if not all(rec.prompts):
            return f"'prompt[{rec.prompts.index('')}]' is empty"
    elif isinstance(body["prompt"], list) and body["prompt"] and all(isinstance(p, list) for p in body["prompt"]):
        rec.prompts = body["prompt"]
        for i, ids in enumerate(rec.prompts):
            if error := _check_ids(ids, f"prompt[{i}]"):
                return error
    else:
        return ("'prompt' must be a non-empty string, a list of token ids, or a list of several prompts (strings, "
                "or lists of token ids)")
    for k, neutral in OPENAI_NEUTRAL.items():
        if body.get(k, neutral) not in (neutral, None):
            return f"'{k}' is not supported by msinfer yet"
    echo = body.get("echo")
    if echo not in (None, False):
        if echo is not True:
            return f"'echo' must be true or false, got {_type(echo)}"
    if chat and (error := _fill_chat(rec, body)):
        return error
    if chat and (effort := body.get("reasoning_effort")) is not None:
        if effort not in REASONING_EFFORTS:
            return f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {_type(effort)}"
        own = (rec.chat or {}).get("chat_template_kwargs", {})
        rec.chat = {**(rec.chat or {}), "chat_template_kwargs": {
            "enable_thinking": effort != "none", **own, "reasoning_effort": effort}}
    unknown = [k for k in body if k not in (key, "echo", "return_token_ids", *OPENAI_SAMPLING, *OPENAI_IGNORED,
                                            *OPENAI_NEUTRAL, *OPENAI_STRUCTURED,
                                            *((*CHAT_KEYS, *TOOL_KEYS, "reasoning_effort") if chat else ()))]
    if unknown:
        return f"unknown body key '{unknown[0]}'"
    if body.get("stream"):
        return "'stream' is not available in a batch"
    sampling = {OPENAI_SAMPLING[k]: v for k, v in body.items() if k in OPENAI_SAMPLING and v is not None}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    structured = {k: v for k, v in body.items() if k in OPENAI_STRUCTURED and v is not None}
    if body.get("response_format") is not None:
        rf = _response_format(body["response_format"])
        if isinstance(rf, str):
            return rf
        if rf:
            structured["response_format"] = rf
    if len(structured) > 1:
        return f"{' and '.join(map(repr, structured))} each constrain the output; give one"
    for k, v in structured.items():
        if k == "structured_outputs" and not isinstance(v, dict):
            return f"'structured_outputs' must be an object such as {{\"json\": <schema>}}, got {_type(v)}"
        sampling["structured_outputs"] = v if k in ("structured_outputs", "response_format") \
            else {OPENAI_STRUCTURED[k]: v}
    if body.get("include_reasoning") is not None:
        if not isinstance(body["include_reasoning"], bool):
            return f"'include_reasoning' must be true or false, got {_type(body['include_reasoning'])}"
        rec.openai_reasoning = body["include_reasoning"]
    logprobs = body.get("logprobs")
    if chat:     # chat: logprobs true (or 1, as vLLM's pydantic reads it), top_logprobs 0-20 alternatives
        if logprobs is not None and not (isinstance(logprobs, bool) or type(logprobs) is int and logprobs in (0, 1)):
            return f"'logprobs' must be true or false, got {_type(logprobs)}"
        if body.get("top_logprobs") is not None and not logprobs:      # (vLLM's check_logprobs)
            return "'top_logprobs' asks for alternatives, and 'logprobs' is not true; set \"logprobs\": true"
        if logprobs:
            rec.openai_logprobs = body.get("top_logprobs") or 0
    elif logprobs is not None and logprobs is not False:    # completions: logprobs 0-5
        rec.openai_logprobs = logprobs
    if rec.openai_logprobs is not None:
        if isinstance(rec.openai_logprobs, bool) or not isinstance(rec.openai_logprobs, int) \
                or not 0 <= rec.openai_logprobs <= 20:
            return f"'{'top_logprobs' if chat else 'logprobs'}' must be an integer from 0 to 20"
        sampling["logprobs"] = max(1, rec.openai_logprobs)      # the chosen token's comes with one
    if (token_ids := body.get("return_token_ids")) not in (None, False):
        if token_ids is not True:
            return f"'return_token_ids' must be true or false, got {_type(token_ids)}"
        rec.openai_token_ids = True
    if echo and chat:
        rec.openai_echo = "chat"            # (echoed_message: what goes before each choice's content)
    elif echo:
        # vLLM's echo: each choice's text after its prompt's and, with logprobs, the prompt's
        # log-probabilities (prompt_logprobs at the same k) before its tokens'; max_tokens 0 gives
        # the prompt alone (one token is generated and left out of the answer)
        rec.openai_echo = "prompt" if sampling.get("max_new_tokens") == 0 else "all"
        if rec.openai_echo == "prompt":
            sampling["max_new_tokens"] = 1
        if rec.openai_logprobs is not None and sampling.get("prompt_logprobs") is None:
            sampling["prompt_logprobs"] = rec.openai_logprobs
    rec.sampling = sampling
    return _fill_tools(rec, body) if chat else None


# vLLM's embeddings request options msinfer serves: use_activation false leaves the vector
# unnormalized; add_special_tokens (default true for `input`, false for `messages`, whose template
# holds them); truncation_side of truncate_prompt_tokens (default right: the first k tokens)
EMBED_OPTIONS = ("use_activation", "add_special_tokens", "truncation_side")


def _fill_embedding(rec: Record, body: dict) -> str | None:
    """An embeddings request's body (task embed): `input`, a string, token ids, or a list of
    several (one vector each, in order), or vLLM's `messages` through the chat template;
    `encoding_format` float or base64, `dimensions`, and vLLM's truncate_prompt_tokens."""
    given = [k for k in ("input", "messages") if body.get(k) is not None]
    if len(given) != 1:
        return (f"the body of a {rec.openai} request needs 'input' (or vLLM's 'messages')" if not given
                else "give 'input' or 'messages', not both")
    value = body[given[0]]
    if given[0] == "messages":
        rec.messages = value
        if error := _check_messages(value) or _fill_chat(rec, body):
            return error
    elif isinstance(value, str) and value:
        rec.prompt = value
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        rec.prompt_token_ids = value
        if error := _check_ids(value, "input"):
            return error
    elif isinstance(value, list) and value and all(isinstance(p, str) and p for p in value):
        rec.prompts = value
    elif isinstance(value, list) and value and all(isinstance(p, list) for p in value):
        rec.prompts = value
        for i, ids in enumerate(value):
            if error := _check_ids(ids, f"input[{i}]"):
                return error
    else:
        return ("'input' must be a non-empty string, a list of token ids, or a list of several inputs (non-empty "
                "strings, or lists of token ids)")
    unknown = [k for k in body if k not in ("input", "messages", "model", "user", "encoding_format", "dimensions",
                                            "truncate_prompt_tokens", *EMBED_OPTIONS,
                                            *(CHAT_KEYS if rec.messages else ()))]
    if unknown:
        return f"unknown body key '{unknown[0]}'"
    if body.get("encoding_format", "float") not in ("float", "base64"):
        return f"'encoding_format' must be float or base64, got {body['encoding_format']!r:.40}"
    rec.openai_base64 = body.get("encoding_format") == "base64"
    if (k := body.get("dimensions")) is not None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            return f"'dimensions' must be a positive integer, got {k!r:.40}"
        rec.dimensions = k
    if body.get("truncate_prompt_tokens") is not None:
        rec.sampling = {"truncate_prompt_tokens": body["truncate_prompt_tokens"]}
    for k in ("use_activation", "add_special_tokens"):
        if body.get(k) is not None and not isinstance(body[k], bool):
            return f"'{k}' must be true or false, got {_type(body[k])}"
    if body.get("truncation_side") not in (None, "left", "right"):
        return f"'truncation_side' must be left or right, got {_type(body['truncation_side'])}"
    rec.embed_options = {k: body[k] for k in EMBED_OPTIONS if body.get(k) is not None} or None
    return None


def _fill_chat(rec: Record, obj: dict) -> str | None:
    """The record's CHAT_KEYS into rec.chat, checked (`check_chat`); they apply to messages, and
    to prompt text where the job applies the chat template."""
    given = {k: obj[k] for k in CHAT_KEYS if obj.get(k) is not None}
    if not given:
        return None
    if rec.prompt_token_ids is not None:
        return f"'{next(iter(given))}' is for a prompt that goes through the chat template, not token ids"
    rec.chat = given
    return check_chat(given)


# apply_chat_template's own parameters, which chat_template_kwargs cannot pass as template variables
_TEMPLATE_PARAMS = ("conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
                    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                    "tokenizer_kwargs", *CHAT_KEYS)


def check_chat(chat: dict, where: str = "") -> str | None:
    """The problem with CHAT_KEYS' values (a record's, or input.chat_template_kwargs alone), or None."""
    kwargs = chat.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        return f"'{where}chat_template_kwargs' must be an object of template variables, got {_type(kwargs)}"
    if clash := [k for k in kwargs if k in _TEMPLATE_PARAMS]:
        return (f"'{where}chat_template_kwargs' cannot set '{clash[0]}': it is a parameter of the template's "
                f"rendering, not a variable of the template")
    for k in ("add_generation_prompt", "continue_final_message"):
        if k in chat and not isinstance(chat[k], bool):
            return f"'{where}{k}' must be true or false, got {_type(chat[k])}"
    if chat.get("add_generation_prompt") and chat.get("continue_final_message"):
        return ("'add_generation_prompt' and 'continue_final_message' cannot both be true: the first opens a new "
                "assistant message, the second continues the last one")
    return None


def _response_format(rf) -> dict | str | None:
    """OpenAI's response_format as sampling.structured_outputs (None: plain text), or the
    request's error."""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = rf.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            return "'response_format' of type json_schema needs 'json_schema': {'name': ..., 'schema': {...}}"
        return {"json": schema["schema"]}
    return f"'response_format' type {kind!r} is not one of text, json_object, json_schema"


def _fill(rec: Record, obj: dict) -> str | None:
    given = [k for k in PROMPT_KEYS if obj.get(k) is not None]
    if not given:
        return "no prompt: expected one of the keys 'prompt', 'messages' or 'prompt_token_ids'"
    if len(given) > 1:
        return f"has both '{given[0]}' and '{given[1]}'; give exactly one"
    if "prompt" in given:
        rec.prompt = obj["prompt"]
        if not isinstance(rec.prompt, str):
            return f"'prompt' must be a string, got {_type(rec.prompt)}"
        if not rec.prompt:      # (whitespace is a prompt: its tokens, as vLLM takes it)
            return "'prompt' is empty"
    elif "messages" in given:
        rec.messages = obj["messages"]
        if error := _check_messages(rec.messages):
            return error
    else:
        rec.prompt_token_ids = obj["prompt_token_ids"]
        if error := _check_ids(rec.prompt_token_ids, "prompt_token_ids"):
            return error
    if error := _fill_chat(rec, obj):
        return error
    if obj.get("continuation") is not None and obj.get("continuation_token_ids") is not None:
        return "has both 'continuation' and 'continuation_token_ids'; give at most one"
    if obj.get("continuation") is not None:
        rec.continuation = obj["continuation"]
        if not isinstance(rec.continuation, str) or not rec.continuation:
            return f"'continuation' must be a non-empty string, got {rec.continuation!r:.60}"
    if obj.get("continuation_token_ids") is not None:
        rec.continuation_token_ids = obj["continuation_token_ids"]
        if error := _check_ids(rec.continuation_token_ids, "continuation_token_ids"):
            return error
    sampling = obj.get("sampling")
    if sampling is not None and not isinstance(sampling, dict):
        return f"'sampling' must be an object of sampling keys, got {_type(sampling)}"
    rec.sampling = dict(sampling or {})
    tools = obj.get("tools")
    if isinstance(tools, str):      # as datasets keep them (a parquet column of JSON text)
        try:
            tools = json.loads(tools)
        except ValueError as e:
            return f"'tools' is text that is not JSON: {e}"
    return _fill_tools(rec, obj, tools)


def _fill_tools(rec: Record, obj: dict, tools: Any = None) -> str | None:
    """The record's TOOL_KEYS (`tools`: its tools, where not obj's), checked
    (launcher.tools.check_tools), into rec.tools and rec.tool_use; a tool choice that constrains
    the output ("required", a named function) into its sampling.structured_outputs."""
    tools, choice, error = check_tools(obj.get("tools") if tools is None else tools, obj.get("tool_choice"),
                                       obj.get("parallel_tool_calls"))
    if error:
        return error
    if tools is not None and rec.prompt_token_ids is not None:
        return "'tools' are for a prompt that goes through the chat template, not token ids"
    rec.tools, rec.tool_use = tools, tool_use(choice, obj.get("parallel_tool_calls"), tools)
    if rec.tool_use is None or rec.tool_use.choice == "auto":
        return None
    if rec.sampling.get("structured_outputs") is not None:
        return (f"tool_choice {rec.tool_use.said()} constrains the output to tool calls, and so does its structured "
                f"output; give one")
    try:
        rec.sampling["structured_outputs"] = {"json": tool_schema(tools, rec.tool_use)}
    except ValueError as e:
        return f"'tools': {e}"
    return None


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"'messages' must be a non-empty list of {{\"role\": ..., \"content\": ...}}, got {_type(messages)}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object with 'role' and 'content', got {_type(m)}"
        if not isinstance(m.get("role"), str) or not m["role"]:
            return f"messages[{i}] needs a 'role' string (system, user, assistant, ...)"
        if error := check_message_calls(m, f"messages[{i}]"):
            return error
        if m.get("content") is None and m.get("tool_calls"):     # an assistant's calls without text
            continue
        if not isinstance(m.get("content"), (str, list)):
            return f"messages[{i}] needs a 'content' string (or a list of content parts), got {_type(m.get('content'))}"
        if isinstance(m["content"], list):
            for j, part in enumerate(m["content"]):
                if part_text(part) is not None:
                    continue
                where = f"messages[{i}].content[{j}]"
                if isinstance(part, dict) and part.get("type") in TEXT_PARTS:
                    return f"{where}: a {part['type']!r} part needs a 'text' string, got {_type(part.get('text'))}"
                kind = f"a part of type {part.get('type')!r}" if isinstance(part, dict) and "type" in part \
                    else _type(part)
                return (f"{where} is {kind}; a content list holds text parts only "
                        f"({{\"type\": \"text\", \"text\": ...}}): the models msinfer runs take text")
    return None


TEXT_PARTS = ("text", "input_text", "output_text")     # OpenAI's types of a text content part


def part_text(part: Any) -> str | None:
    """The text of a chat content part (a string, or {"type": "text", "text": ...}), else None."""
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    return None


def echoed_message(rec: Record) -> str:
    """What a chat completion with echo puts before each choice's content, as vLLM does: the last
    message's text where that message is in the answer's role, the assistant's where the template
    opens an assistant message (add_generation_prompt, on unless the record continues its last
    message or turns it off), else the last message's own role; "" otherwise. A content list's
    text parts are joined by newlines."""
    own = rec.chat or {}
    opens = own.get("add_generation_prompt", not own.get("continue_final_message", False))
    last = rec.messages[-1]
    if opens and last.get("role") != "assistant":
        return ""
    return as_text_messages([last])[0]["content"]


def as_text_messages(messages: list[dict]) -> list[dict]:
    """Messages whose content lists are joined into one string, their text parts separated by a
    newline, as vLLM gives them to a chat template that takes strings ("string" content format):
    many text models' templates render a list's Python form, or fail, instead of its text. An
    assistant message of tool calls alone has content "" (vLLM's)."""
    return [{**m, "content": "\n".join(map(part_text, m["content"]))} if isinstance(m.get("content"), list)
            else {**m, "content": ""} if m.get("content") is None else m for m in messages]


def as_part_messages(messages: list[dict]) -> list[dict]:
    """Messages as vLLM gives them to a chat template that loops over a message's content parts
    ("openai" content format, launcher.tokenizer.content_format): every content a list of
    {"type": "text", "text": ...} parts (a string one part, none for no content); a tool
    message's parts joined into one string by newlines, as vLLM's."""
    out = []
    for m in messages:
        content = m.get("content")
        parts = [] if content is None else [content] if isinstance(content, str) else content
        texts = [part_text(p) for p in parts]
        out.append({**m, "content": "\n".join(texts) if m.get("role") == "tool" and isinstance(content, list)
                    else [{"type": "text", "text": t} for t in texts]})
    return out


def _check_ids(ids: Any, key: str) -> str | None:
    if not isinstance(ids, list) or not ids:
        return f"'{key}' must be a non-empty list of token ids, got {_type(ids)}"
    if set(map(type, ids)) == {int} and min(ids) >= 0:     # the common case, at C speed (bool is not int)
        return None
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
    if bad:
        return f"'{key}' must hold non-negative integers, found {_type(bad[0])}"
    return None


def _type(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, list):
        return "an empty list" if not x else "a list"
    if isinstance(x, dict):
        return "an object"
    return f"{type(x).__name__} {x!r:.40}"
