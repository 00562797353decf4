import json
import os

import numpy as np
import pytest

from msinfer.launcher.errors import InputError
from msinfer.launcher.inputs import Record, check_input, read_records


def jsonl(tmp_path, lines, name="in.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"".join((l if isinstance(l, bytes) else (l if isinstance(l, str) else json.dumps(l)).encode())
                              + b"\n" for l in lines))
    return path


def test_txt_one_prompt_a_line_blank_lines_skipped(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xef\xbb\xbfhello\n\n   \nsecond line  \r\nthird")
    recs = list(read_records(path))
    assert [(r.id, r.line, r.prompt) for r in recs] == [("1", 1, "hello"), ("4", 4, "second line  "), ("5", 5, "third")]
    assert all(r.error is None and r.sampling == {} for r in recs)


def test_a_prompt_of_whitespace_is_a_prompt_as_vllm_takes_it(tmp_path):
    """" " is text to tokenize (vLLM generates from it); only "" is an empty prompt."""
    spaces, empty, several = read_records(jsonl(tmp_path, [{"id": "w", "prompt": "  "}, {"id": "e", "prompt": ""},
                                                           {"custom_id": "c", "url": "/v1/completions",
                                                            "method": "POST", "body": {"prompt": ["a", " "]}}]))
    assert (spaces.prompt, spaces.error) == ("  ", None)
    assert empty.error == "line 2: 'prompt' is empty"
    assert several.prompts == ["a", " "] and several.error is None


def test_jsonl_forms(tmp_path):
    path = jsonl(tmp_path, [
        {"id": "a", "prompt": "hi", "sampling": {"temperature": 0.5}},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"id": 17, "prompt_token_ids": [1, 2, 3]},
        {"id": "s", "prompt": "2+2=", "continuation": "4"},
        {"id": "t", "prompt_token_ids": [5], "continuation_token_ids": [6, 7]},
        {"id": "é", "prompt": "ünïcode ✓", "meta": {"ignored": True}},
    ])
    a, b, c, s, t, u = read_records(path)
    assert (a.id, a.prompt, a.sampling) == ("a", "hi", {"temperature": 0.5})
    assert (b.id, b.line, b.messages[1]["content"]) == ("2", 2, "hi")
    assert (c.id, c.given_id, c.prompt_token_ids) == ("17", 17, [1, 2, 3])      # kept as given for its result
    assert a.given_id is None and b.given_id is None
    assert (s.continuation, t.continuation_token_ids) == ("4", [6, 7])
    assert (u.id, u.prompt) == ("é", "ünïcode ✓")
    assert all(r.error is None for r in (a, b, c, s, t, u))


BAD = [
    (b'{"id": "x", "prompt": "ok"}', None),
    (b'{"id": "y", "prompt": ', "line 2: invalid JSON"),
    (b'\xff\xfe{"prompt": "latin"}', "line 3: not valid UTF-8"),
    (b'{"id": "z"}', "line 4: no prompt: expected one of the keys 'prompt', 'messages' or 'prompt_token_ids'"),
    (b'{"id": "e", "prompt": ""}', "line 5: 'prompt' is empty"),
    (b'{"id": "n", "prompt": 42}', "line 6: 'prompt' must be a string, got int 42"),
    (b'{"id": "m", "messages": [{"role": "user"}]}', "line 7: messages[0] needs a 'content' string"),
    (b'{"id": "p", "prompt_token_ids": [1, -2]}',
     "line 8: 'prompt_token_ids' must hold non-negative integers, found int -2"),
    (b'{"id": "q", "prompt_token_ids": [1, null]}', "line 9: 'prompt_token_ids' must hold non-negative integers"),
    (b'{"id": "b", "prompt": "a", "messages": []}', "line 10: has both 'prompt' and 'messages'"),
    (b'{"id": "s", "prompt": "a", "sampling": [1]}', "line 11: 'sampling' must be an object"),
    (b'[1, 2]', "line 12: expected a JSON object"),
    (b'{"id": true, "prompt": "a"}', "line 13: 'id' must be a non-empty string or an integer"),
    (b'{"id": "w", "prompt": "x", "continuation": ""}', "line 14: 'continuation' must be a non-empty string"),
    (b'{"id": "last", "prompt": "still read"}', None),
]


def test_bad_records_become_error_records_and_the_rest_are_read(tmp_path):
    recs = list(read_records(jsonl(tmp_path, [line for line, _ in BAD])))
    assert len(recs) == len(BAD)
    for rec, (_, expected) in zip(recs, BAD):
        if expected is None:
            assert rec.error is None and rec.prompt
        else:
            assert rec.error is not None and rec.error.startswith(expected), (rec.error, expected)
    # its own id when readable, else the line number
    assert [r.id for r in recs[1:5]] == ["2", "3", "z", "e"]
    assert recs[12].id == "13"


def test_duplicate_ids_name_both_lines(tmp_path):
    path = jsonl(tmp_path, [{"id": "a", "prompt": "1"}, {"id": "b", "prompt": "2"}, {"id": "a", "prompt": "3"},
                            {"prompt": "id defaults to line 4"}, {"id": 4, "prompt": "collides with line 4"}])
    recs = list(read_records(path))
    assert [r.id for r in recs] == ["a", "b", "a@3", "4", "4@5"]
    assert recs[2].error == "line 3: id 'a' was already used on line 1; ids must be unique"
    assert "line 5: id '4' was already used on line 4" in recs[4].error
    assert len({r.id for r in recs}) == len(recs)  # one results line per id


def test_parquet_in_row_batches(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import msinfer.launcher.inputs as inputs

    monkeypatch.setattr(inputs, "PARQUET_BATCH_ROWS", 2)
    table = pa.table({
        "id": ["a", "b", None, "d", "e"],
        "prompt": ["hello", None, None, "", "x"],
        "prompt_token_ids": [None, [1, 2], None, None, None],
        "sampling": [{"temperature": 0.5, "top_k": None}, None, None, None, {"temperature": None, "top_k": 3}],
        "extra": [1, 2, 3, 4, 5],
    })
    path = tmp_path / "in.parquet"
    pq.write_table(table, path, row_group_size=2)
    seen_batches = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *a, **k):
        seen_batches.append(k.get("batch_size"))
        assert "extra" not in k.get("columns")
        return real(self, *a, **k)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    a, b, c, d, e = read_records(path)
    assert seen_batches == [2]
    assert (a.id, a.prompt, a.sampling) == ("a", "hello", {"temperature": 0.5})
    assert (b.id, b.prompt_token_ids, b.sampling) == ("b", [1, 2], {})
    assert c.id == "3" and c.error.startswith("row 3: no prompt")
    assert d.error == "row 4: 'prompt' is empty"
    assert e.sampling == {"top_k": 3}


def test_parquet_messages_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "m.parquet"
    messages = [[{"role": "user", "content": "hi"}],
                [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]]
    pq.write_table(pa.table({"id": [1, 2], "messages": messages}), path)
    a, b = read_records(path)
    assert a.id == "1" and a.messages == [{"role": "user", "content": "hi"}] and b.messages[1]["content"] == "q"
    # a struct column's fields unite the rows': a row's template variables are only those it gives
    kwargs = [{"enable_thinking": False}, {"tone": "dry"}]
    pq.write_table(pa.table({"id": [1, 2], "messages": messages, "chat_template_kwargs": kwargs}), path)
    a, b = read_records(path)
    assert a.chat == {"chat_template_kwargs": {"enable_thinking": False}}
    assert b.chat == {"chat_template_kwargs": {"tone": "dry"}}


def test_unreadable_input_raises_before_reading(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")  # raises on the call, not on the first next()
    with pytest.raises(InputError, match="input folder .*d.jsonl holds no .txt, .jsonl or .parquet file"):
        check_input(_mkdir(tmp_path / "d.jsonl"))
    with pytest.raises(InputError, match="expected a .txt, .jsonl or .parquet"):
        check_input(tmp_path / "x.csv")


def test_bad_parquet_file_raises(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(InputError, match="bad.parquet is not a readable parquet file"):
        check_input(bad)
    nocol = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"text": ["a"]}), nocol)
    with pytest.raises(InputError,
                       match="has no column 'prompt', 'messages', 'prompt_token_ids'; its columns are text"):
        check_input(nocol)


def test_a_content_list_holds_text_parts_only(tmp_path):
    """msinfer runs text models: an image (or any part that is not text) in a message's content
    list fails its record, naming the part; text parts and strings are read."""
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    path = jsonl(tmp_path, [{"id": "i", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, image]}]},
                            {"id": "n", "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
                            {"id": "t", "messages": [{"role": "user", "content": ["a", {"type": "text", "text": "b"}]}]}])
    i, n, t = read_records(path)
    assert i.error == ("line 1: messages[0].content[1] is a part of type 'image_url'; a content list holds text "
                       "parts only ({\"type\": \"text\", \"text\": ...}): the models msinfer runs take text")
    assert n.error == "line 2: messages[0].content[0]: a 'text' part needs a 'text' string, got null"
    assert t.error is None


def test_a_parquet_file_with_a_sampling_key_as_a_column_is_refused_before_reading(tmp_path):
    """Only the 'sampling' struct column is read for sampling: a 'temperature' column would be
    ignored, so check_input (plan, and run before anything starts) refuses the file, naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "temperature": [0.5, 0.7], "topic": ["x", "y"]}), path)
    with pytest.raises(InputError, match=r"in.parquet has columns that belong inside others: 'temperature' \(meant "
                                         r"as sampling.temperature\?\)\. A record's sampling is read from its "
                                         r"'sampling' object only"):
        check_input(path)
    pq.write_table(pa.table({"prompt": ["a"], "topic": ["x"], "sampling": [{"temperature": 0.5}]}), path)
    assert check_input(path) == ([path], None)


def test_qwen3_s_enable_thinking_at_the_top_of_a_record_fails_it_naming_where_it_belongs():
    """transformers' apply_chat_template takes enable_thinking as an argument; at the top of a
    record it would be one of the user's own keys, and Qwen3 would think without a word."""
    from msinfer.launcher.inputs import parse_record
    rec = parse_record({"id": "q", "messages": [{"role": "user", "content": "hi"}], "enable_thinking": False}, 1)
    assert rec.error.startswith("record 'q': keys at the top of the record that belong inside others: "
                                "'enable_thinking' (meant as chat_template_kwargs.enable_thinking?)")
    rec = parse_record({"id": "q", "messages": [{"role": "user", "content": "hi"}], "source": "wiki",
                        "chat_template_kwargs": {"enable_thinking": False}}, 1)
    assert rec.error is None and rec.chat == {"chat_template_kwargs": {"enable_thinking": False}}


def _mkdir(path):
    os.mkdir(path)
    return path


def test_records_are_read_lazily(tmp_path):
    """Records are read a chunk at a time (launcher.idset.CHUNK, where their ids are
    checked), not with the file's first record: a line rewritten in place after the first record
    was served, a chunk and 4 MB on (past any read-ahead), is read as rewritten."""
    from msinfer.launcher.idset import CHUNK
    chunk = [{"id": f"r{i}", "prompt": "a"} for i in range(CHUNK)]
    path = jsonl(tmp_path, [*chunk, {"id": "big", "prompt": "x" * 4_000_000}, {"id": "last", "prompt": "old"}])
    it = read_records(path)
    assert isinstance(first := next(it), Record) and first.id == "r0"
    data = path.read_bytes()
    with open(path, "r+b") as f:                    # same length, same file: a reader's open handle sees it
        f.seek(data.rindex(b'"old"'))
        f.write(b'"new"')
    *read, big, last = it
    assert len(read) == CHUNK - 1 and big.prompt == "x" * 4_000_000 and (last.id, last.prompt) == ("last", "new")


def test_every_renamed_duplicate_gets_an_id_no_other_record_has(tmp_path):
    """A duplicate's "<id>@<line>" can be an id an earlier record holds: it then gets the next free
    "<id>@<line>.<k>". The first record of an id keeps it (a later record given an id that a
    duplicate was renamed to is a duplicate too), and a second read names every record alike, so
    a resumed run skips exactly the records the first run wrote."""
    path = jsonl(tmp_path, [{"id": "a@3", "prompt": "1"}, {"id": "a", "prompt": "2"}, {"id": "a", "prompt": "3"},
                            {"id": "a@3.2", "prompt": "4"}, {"id": "a", "prompt": "5"}, {"id": "a@5", "prompt": "6"}])
    recs = list(read_records(path))
    ids = [r.id for r in recs]
    assert len(set(ids)) == len(recs)  # one results line per record
    assert ids == ["a@3", "a", "a@3.2", "a@3.2@4", "a@5", "a@5@6"]
    assert [r.error is None for r in recs] == [True, True, False, False, False, False]
    assert recs[2].error == "line 3: id 'a' was already used on line 2; ids must be unique"
    assert [r.id for r in read_records(path)] == ids


def test_longest_first_deals_the_longest_record_read_within_its_window():
    """Of the records read ahead and not yet given out, the longest comes first, the earliest of
    equal ones; nothing is lost or repeated, and the window bounds how far ahead it reads."""
    from msinfer.launcher.inputs import longest_first
    lengths = [3, 9, 1, 9, 5, 20, 2, 4]
    recs = [Record(f"r{i}", i + 1, prompt_token_ids=[1] * n) for i, n in enumerate(lengths)]
    read = []

    def source():
        for r in recs:
            read.append(r.id)
            yield r
    out = longest_first(source(), 3, lambda r: len(r.prompt_token_ids))
    assert next(out).id == "r1" and read == ["r0", "r1", "r2"]        # the first 3 read: 9 is the longest
    assert [r.id for r in out] == ["r3", "r4", "r5", "r0", "r7", "r6", "r2"]
    one = longest_first(iter(recs), 1, lambda r: len(r.prompt_token_ids))
    assert [r.id for r in one] == [r.id for r in recs]          # a window of 1: as read
    assert [r.id for r in longest_first(iter(recs), 100, lambda r: len(r.prompt_token_ids))] == [
        "r5", "r1", "r3", "r4", "r7", "r0", "r6", "r2"]


def test_a_records_expected_length_is_its_prompt_and_the_tokens_it_may_generate():
    from msinfer.launcher.inputs import expected_length
    assert expected_length(Record("a", 1, prompt_token_ids=[1] * 10), 50) == 60
    assert expected_length(Record("a", 1, prompt="x" * 400), 50) == 150                   # 4 characters a token
    assert expected_length(Record("a", 1, messages=[{"role": "user", "content": "y" * 80}]), 50) == 70
    assert expected_length(Record("a", 1, prompt="x" * 40, sampling={"max_new_tokens": 500, "n": 4}), 50) == 510
    assert expected_length(Record("a", 1, prompt="x" * 40, sampling={"max_new_tokens": "lots"}), 50) == 60
    assert expected_length(Record("a", 1, prompt_token_ids=[1] * 10, continuation_token_ids=[2] * 5), 50,
                           score=True) == 15
    assert expected_length(Record("a", 1, prompt_token_ids=[1] * 10), 50, score=True) == 60     # generated
    assert expected_length(Record("a", 1, error="line 1: bad"), 50) == 0


def test_a_folder_or_a_pattern_of_files_is_read_file_by_file_with_ids_named_by_file(tmp_path):
    """input.path a folder (its .txt/.jsonl/.parquet files of one kind, hidden ones left out) or a
    pattern (`**` for subfolders), as Ray Data reads a folder of shards: the files in name order;
    a record without an id is "<file>:<line>", so ids stay unique across files and stable when
    files are added; messages and duplicate ids name the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from msinfer.launcher.inputs import input_files, reads_back
    d = _mkdir(tmp_path / "shards")
    jsonl(d, [{"id": "q1", "prompt": "a"}, {"prompt": "b"}], "a.jsonl")
    jsonl(d, [{"prompt": "c"}, b'{"prompt": ', {"id": "q1", "prompt": "again"}], "b.jsonl")
    jsonl(d, [{"prompt": "hidden"}], ".partial.jsonl")
    (d / "README.md").write_text("not an input")
    recs = list(read_records(d))
    assert [r.id for r in recs] == ["q1", "a.jsonl:2", "b.jsonl:1", "b.jsonl:2", "q1@b.jsonl:3"]
    assert [r.prompt for r in recs[:3]] == ["a", "b", "c"]
    assert recs[3].error.startswith("b.jsonl line 2: invalid JSON (the line ends before its JSON does): Expecting value")
    assert recs[4].error == "b.jsonl line 3: id 'q1' was already used on a.jsonl line 1; ids must be unique"
    sub = _mkdir(d / "more")
    jsonl(sub, [{"prompt": "d"}], "c.jsonl")
    assert [r.id for r in read_records(f"{d}/**/*.jsonl")][-1] == "more/c.jsonl:1"   # relative to the pattern's folder
    assert [r.id for r in read_records(f"{d}/b*.jsonl")][:1] == ["b.jsonl:1"]
    assert [r.id for r in read_records(d / "a.jsonl")] == ["q1", "2"]                    # one file: lines alone
    rows = _mkdir(tmp_path / "rows")
    for name, prompts in (("p0.parquet", ["x", "y"]), ("p1.parquet", ["z"])):
        pq.write_table(pa.table({"prompt": prompts}), rows / name)
    assert [(r.id, r.prompt) for r in read_records(rows)] == [("p0.parquet:1", "x"), ("p0.parquet:2", "y"),
                                                             ("p1.parquet:1", "z")]
    (rows / "extra.jsonl").write_text('{"prompt": "w"}\n')
    with pytest.raises(InputError, match=r"holds files of 2 kind\(s\) \(.jsonl, .parquet\)"):
        input_files(rows)
    with pytest.raises(InputError, match="holds no .txt, .jsonl or .parquet file"):
        read_records(_mkdir(tmp_path / "empty"))
    with pytest.raises(InputError, match="no file matches the pattern"):
        read_records(f"{tmp_path}/nothing-*.jsonl")
    assert reads_back(d, d / "results.jsonl") and reads_back(f"{d}/*.jsonl", d / "out.jsonl")
    assert not reads_back(d, tmp_path / "results.jsonl") and not reads_back(d, d / "results.json")
    assert not reads_back(d / "a.jsonl", d / "results.jsonl")


@pytest.mark.unit
def test_shards_by_file_read_only_their_files_and_hold_every_record_once(tmp_path):
    """input.shard_by file: shard K of N reads files K, K+N, ... in name order, and no other (a
    file that is not even a parquet file, in another shard, is not looked at); the shards hold
    every record once; the progress bar counts a shard's rows; plan refuses fewer files than tasks."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.job import count_lines
    from msinfer.launcher.shards import check_shard_by, shard_files, shard_input
    from msinfer.launcher.spec import JobSpec
    for i in range(5):
        pq.write_table(pa.Table.from_pylist([{"prompt": f"p{i}-{j}"} for j in range(i + 1)]), tmp_path / f"{i}.parquet")
    (tmp_path / "5.parquet").write_bytes(b"not parquet")

    def spec(shard, by="file", path=tmp_path):
        return JobSpec.model_validate({"model": {"path": "m"}, "output": {"path": str(tmp_path.parent / "o.jsonl")},
                                       "input": {"path": str(path), "shard": shard, "shard_by": by}})

    with pytest.raises(InputError, match="5.parquet"):
        list(shard_input(spec("2/3")))                          # files 2 and 5
    got = {k: [r.id for r in shard_input(spec(f"{k}/3"))] for k in (0, 1)}
    assert got == {0: ["0.parquet:1", *[f"3.parquet:{j}" for j in range(1, 5)]],
                   1: [*[f"1.parquet:{j}" for j in (1, 2)], *[f"4.parquet:{j}" for j in range(1, 6)]]}
    assert count_lines(str(tmp_path), shard_files(spec("1/3"))) == 7
    (tmp_path / "5.parquet").unlink()
    everything = [r.id for r in read_records(tmp_path)]
    for n in (2, 5):
        shards = [[r.id for r in shard_input(spec(f"{k}/{n}"))] for k in range(n)]
        assert sorted(sum(shards, [])) == sorted(everything) and len(sum(shards, [])) == len(everything)
    check_shard_by(spec("4/5"))
    with pytest.raises(SpecError, match=r"input.shard_by: file deals input.path's files to the 6 tasks of input.shard, "
                                        r"and .* is 5 file\(s\): task 5 would read nothing"):
        check_shard_by(spec("5/6"))
    with pytest.raises(SpecError, match=r"is one file"):
        check_shard_by(spec("0/2", path=tmp_path / "0.parquet"))
    with pytest.raises(SpecError, match=r"the spec sets no input.shard"):
        check_shard_by(spec(None))


@pytest.mark.unit
def test_a_repeated_id_is_found_across_chunks_as_a_set_of_the_ids_finds_it(monkeypatch):
    """launcher.inputs._unique_ids holds the ids as hashes in sorted runs (launcher.idset), a
    chunk at a time: over chunks of 7 records, and runs that merge, every record gets the id and
    error that holding every id in a dict gives, and the index holds 24 bytes an id."""
    import random
    from msinfer.launcher import inputs
    from msinfer.launcher.idset import IdIndex

    def reference(records, unit):              # the plain dict of every id and its place
        first = {}
        for r in records:
            if r.id in first:
                where = inputs.line_id(r.source, r.line)
                error = (f"{r.at(unit)}: id '{r.id}' was already used on {inputs.location(*first[r.id], unit)}; "
                         f"ids must be unique")
                rid, k = f"{r.id}@{where}", 1
                while rid in first:
                    k += 1
                    rid = f"{r.id}@{where}.{k}"
                r = Record(id=rid, line=r.line, error=r.error or error, source=r.source)
            first[r.id] = (r.source, r.line)
            yield r

    rng = random.Random(5)
    pool = [f"q{i}" for i in range(60)] + ["q3@b.jsonl:4", "q3@4"]
    records = [Record(id=rng.choice(pool), line=n, source=rng.choice(["", "a.jsonl", "b.jsonl"]))
               for n in range(1, 400)]
    from msinfer.launcher import idset
    monkeypatch.setattr(idset, "CHUNK", 7)
    got = list(inputs._unique_ids(iter(records), "line"))
    want = list(reference(iter(records), "line"))
    assert [(r.id, r.error) for r in got] == [(r.id, r.error) for r in want]
    assert sum(r.error is not None for r in got) > 300 and len({r.id for r in got}) == len(got)
    index = IdIndex()
    rng_words = np.random.default_rng(0).integers(0, 2 ** 63, (3, 10_000), dtype=np.int64).astype(np.uint64)
    for part in np.array_split(np.arange(10_000), 9):
        index.add(rng_words[0][part], rng_words[1][part], rng_words[2][part])
    assert len(index.runs) < 9 and index.nbytes() == 24 * 10_000
    assert (index.find(rng_words[0], rng_words[1]) == rng_words[2].astype(np.int64)).all()
    assert (index.find(rng_words[0], rng_words[1] + np.uint64(1)) == -1).all()
