import json
import os

import pytest

from msinfer.launcher.errors import RecordError, TokenizerError
from msinfer.launcher.inputs import Record
from msinfer.launcher.tokenizer import StopStringMatcher, Tokenizer, load_tokenizer
from tests.checkpoints import build_tokenizer

@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_loads_local_folder(tok):
    assert isinstance(tok, Tokenizer) and tok.has_chat_template
    assert tok.eos_token_id == 2


def test_prompt_with_and_without_chat_template(tok):
    rec = Record(id="a", line=1, prompt="hello world")
    plain = tok.encode_record(rec, chat_template=False)
    assert plain[0] == 1 and tok.decode(plain) == "hello world"  # BOS added, skipped on decode
    chat = tok.encode_record(rec, chat_template=True)
    # the template's text encoded with no special tokens added: no BOS before <|user|>
    assert chat == tok.tok.encode("<|user|>hello world<|assistant|>", add_special_tokens=False)
    assert chat[0] == 3 and chat[-1] == 4


def test_messages_use_template_as_transformers_renders_it(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo wörld ✓"}]
    ids = tok.encode_record(Record(id="m", line=2, messages=messages), chat_template=False)
    text = tok.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == tok.tok.encode(text, add_special_tokens=False)
    # transformers 5 returns a BatchEncoding for tokenize=True; the ids agree
    enc = tok.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert ids == list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def test_a_content_list_of_text_parts_reaches_the_template_as_its_text(tok):
    """OpenAI's content parts ({"type": "text", "text": ...}, or strings) are joined into one string
    with newlines, as vLLM hands them to a template that takes strings. This test's template, like
    many text models', renders `m['content']` as it is: given the list, it would render its
    Python form without a word."""
    parts = [{"type": "text", "text": "hello"}, "world", {"type": "input_text", "text": "be brief"}]
    ids = tok.encode_record(Record(id="p", line=1, messages=[{"role": "user", "content": parts}]), True)
    text = Record(id="s", line=1, messages=[{"role": "user", "content": "hello\nworld\nbe brief"}])
    assert ids == tok.encode_record(text, True)
    assert "type" not in tok.decode(ids)


def test_token_ids_pass_through_and_decode(tok):
    assert tok.encode_record(Record(id="t", line=3, prompt_token_ids=[7, 8, 9]), chat_template=True) == [7, 8, 9]
    ids = tok.encode("héllo wörld ✓", add_special_tokens=False)
    assert tok.decode(ids + [tok.eos_token_id]) == "héllo wörld ✓"


def test_unencodable_record_raises_record_error(tok):
    bad = Record(id="x", line=4, messages=[{"role": "assistant", "content": "hi"}])
    with pytest.raises(RecordError, match="record 'x': the tokenizer cannot encode it: .*must not be the assistant"):
        tok.encode_record(bad, chat_template=True)


def test_a_failure_of_the_environment_stops_the_job_instead_of_failing_every_record(tok, monkeypatch):
    """transformers' chat templates need jinja2, which it does not install: without it every chat
    record would fail alike. That is not the record's fault: SystemicError (the job stops, exit
    2) with what to install, not an error line per record."""
    from msinfer.launcher.errors import SystemicError

    def no_jinja(*args, **kwargs):
        raise ImportError("apply_chat_template requires jinja2 to be installed.")
    monkeypatch.setattr(tok.tok, "apply_chat_template", no_jinja)
    with pytest.raises(SystemicError, match=r"cannot encode records \(record 'j' was the first\): ImportError: "
                                            r"apply_chat_template requires jinja2.* install jinja2"):
        tok.encode_record(Record(id="j", line=1, prompt="hello world"), chat_template=True)
    assert not issubclass(SystemicError, RecordError)          # the job does not write it as a record's error
    assert tok.encode_record(Record(id="k", line=2, prompt="hello world"), chat_template=False)   # no template used


def test_plan_renders_the_chat_template_once_and_names_what_fails(tok, monkeypatch):
    """`plan` renders the template for a plain user message before any worker starts: a missing
    jinja2 or a template that raises is one error naming the tokenizer folder and the way out."""
    from msinfer.launcher.errors import TokenizerError

    tok.check_chat_template()                                  # the test tokenizer's template renders

    def no_jinja(*args, **kwargs):
        raise ImportError("apply_chat_template requires jinja2 to be installed.")
    monkeypatch.setattr(tok.tok, "apply_chat_template", no_jinja)
    with pytest.raises(TokenizerError, match=rf"the chat template in {tok.path} cannot be rendered: .*install "
                                             rf"jinja2.*input.chat_template: false"):
        tok.check_chat_template()

    def raises(*args, **kwargs):
        raise ValueError("Conversation roles must alternate")
    monkeypatch.setattr(tok.tok, "apply_chat_template", raises)
    with pytest.raises(TokenizerError, match=r"fails on a plain user message: ValueError: Conversation roles"):
        tok.check_chat_template()


def test_continuation(tok):
    assert tok.encode_continuation(Record(id="s", line=1, prompt="a", continuation="hello")) == \
        tok.encode("hello", add_special_tokens=False)
    assert tok.encode_continuation(Record(id="s", line=1, prompt="a", continuation_token_ids=[5])) == [5]
    assert tok.encode_continuation(Record(id="s", line=1, prompt="a")) is None


def test_no_chat_template(tmp_path):
    tok = load_tokenizer(build_tokenizer(tmp_path / "plain", chat_template=None))
    assert not tok.has_chat_template
    rec = Record(id="p", line=1, prompt="hello")
    assert tok.encode_record(rec, chat_template=True) == tok.encode("hello")  # falls back to plain text
    with pytest.raises(RecordError, match="record 'm': has 'messages', but the tokenizer .* has no chat template"):
        tok.encode_record(Record(id="m", line=2, messages=[{"role": "user", "content": "hi"}]), chat_template=True)


def test_folder_without_tokenizer_files_is_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


def test_broken_tokenizer_files_raise(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(TokenizerError, match=f"the tokenizer files in {tmp_path} do not load"):
        load_tokenizer(tmp_path)


def test_stop_string_matcher_incremental():
    m = StopStringMatcher(["\n\n", "END"])
    text = ""
    cut = None
    for piece in ["Hello", " wor", "ld.\n", "\nmore"]:
        text += piece
        cut = m.check(text)
        if cut is not None:
            break
    assert text[:cut] == "Hello world."  # the stop string spans two tokens and is not in the output
    m = StopStringMatcher(["END", "D"])
    assert m.check("xxEN") is None and m.check("xxEND") == 2  # cut before the earliest stop string
    assert StopStringMatcher([]).check("anything") is None
    m = StopStringMatcher(["é!"])
    assert m.check("caf\ufffd") is None and m.check("café!") == 3  # an incomplete character is checked again
    m = StopStringMatcher(["ab", "a", "b"], include=True)          # vLLM's include_stop_str_in_output
    assert m.check("xxb") == 3 and StopStringMatcher(["ab", "a"], include=True).check("xab") == 2
    # of stop strings a token completes together, the one that ends first wins, as vLLM's
    # check_stop_strings picks it (the text as if it grew a character at a time); "xa" then "bc":
    for include, cut in ((False, 2), (True, 3)):
        m = StopStringMatcher(["abc", "b"], include=include)
        assert m.check("xa") is None and m.check("xabc") == cut          # "b", not "abc" that starts first
    # Text taken as seen without a search (a sequence's first min_tokens tokens) is never searched
    # again: only a stop string that ends after it counts, one that starts in it included (vLLM's
    # tests/detokenizer/test_min_tokens.py: min_tokens 5, stop "e" -> " is Lee, and I'm a stud").
    m = StopStringMatcher(["e"])
    pieces = [" is", " Lee", ",", " and", " I", "'m", " a", " student"]
    text, cut = "", None
    for n, piece in enumerate(pieces, 1):
        text += piece
        if (cut := m.check(text, search=n > 5)) is not None:
            break
    assert text[:cut] == " is Lee, and I'm a stud"
    m = StopStringMatcher(["END", "xy"])
    assert m.check("aEN", search=False) is None and m.check("aENDxy") == 1   # "END" ends in the new text
    m = StopStringMatcher(["xy"])
    assert m.check("axy", search=False) is None and m.check("axyb") is None


def test_a_scored_text_prompt_is_scored_as_written_and_a_generated_one_gets_the_template(tok):
    """With input.chat_template on (the default): a generated prompt text gets the chat template;
    a scored one, and an OpenAI completions prompt, are encoded as written, so a scored text
    prompt gets the token ids (and so the log-probabilities) of the same prompt given as ids;
    scored messages still get the template."""
    from types import SimpleNamespace

    from msinfer.launcher.inputs import parse_record
    from msinfer.launcher.records import RecordCodec
    from msinfer.launcher.spec import JobSpec
    spec = JobSpec.model_validate({"task": "score", "model": {"path": "m", "max_model_len": 512},
                                   "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"}})
    codec = RecordCodec(spec, SimpleNamespace(vocab_size=len(tok.tok), hidden_size=64, labels=(),
                                              classifier_activation="", eos_token_ids=(2,)), tok)
    text = "hello world"
    as_written = tok.encode(text)
    templated = tok.apply_chat_template([{"role": "user", "content": text}])
    assert as_written != templated

    def prompt_ids(record: dict) -> list[int]:
        seq = codec.sequences(parse_record(record, 1), 0)[0]
        return seq.prompt_token_ids[: len(seq.prompt_token_ids) - seq.num_score_tokens]

    assert prompt_ids({"id": "s", "prompt": text, "continuation": " world"}) == as_written
    assert prompt_ids({"id": "t", "prompt_token_ids": as_written, "continuation": " world"}) == as_written
    assert prompt_ids({"id": "m", "messages": [{"role": "user", "content": text}],
                       "continuation": " world"}) == templated
    assert prompt_ids({"id": "g", "prompt": text}) == templated
    completion = parse_record({"id": "c", "prompt": text}, 1)
    completion.openai = "/v1/completions"
    assert codec.sequences(completion, 0)[0].prompt_token_ids == as_written


def test_logprob_entries_give_each_tokens_text_beside_its_id(tok):
    from types import SimpleNamespace

    from msinfer.launcher.records import RecordCodec
    from msinfer.launcher.spec import JobSpec
    spec = JobSpec.model_validate({"model": {"path": "m", "max_model_len": 512}, "input": {"path": "in.jsonl"},
                                   "output": {"path": "out.jsonl"}})
    model = SimpleNamespace(vocab_size=len(tok.tok), hidden_size=64, labels=(),
                            classifier_activation="", eos_token_ids=(2,))
    ids = tok.encode("hello world", add_special_tokens=False)
    codec = RecordCodec(spec, model, tok)
    entry = codec.logprob_entry(ids[0], -0.5, [(ids[0], -0.5), (ids[1], -1.25)])
    assert entry == {"token_id": ids[0], "token": tok.decode([ids[0]]), "logprob": -0.5,
                     "top": [[ids[0], -0.5, tok.decode([ids[0]])], [ids[1], -1.25, tok.decode([ids[1]])]]}
    assert "".join(t for _, _, t in entry["top"]) == tok.decode(ids[:2])
    eos = codec.logprob_entry(2, -0.1, [(2, -0.1)])      # a special token is named, as vLLM names it, not ""
    assert eos["token"] == "</s>" and eos["top"][0][2] == "</s>"
    plain = RecordCodec(spec, model, None).logprob_entry(7, -0.5, [(7, -0.5)])
    assert plain == {"token_id": 7, "logprob": -0.5, "top": [[7, -0.5]]}


def test_the_check_for_torch_reads_the_modules_while_another_thread_imports():
    """transformers_without_torch looks through sys.modules while another thread of the process may
    import (rank 0 loads its model while its engine loads the tokenizer): it must not fail with
    "dictionary changed size during iteration". In a process of its own (where torch is not
    among the first modules, so the look goes through most of them), a thread adds and drops
    modules meanwhile, with the interpreter switching threads every microsecond."""
    import subprocess
    import sys
    code = ("import sys, threading, types\n"
            "import numpy\n"
            "from msinfer.worker.imports import transformers_without_torch\n"
            "stop = threading.Event()\n"
            "names = [f'_churn_{i}' for i in range(64)]\n"
            "def churn():\n"
            "    while not stop.is_set():\n"
            "        for n in names:\n"
            "            sys.modules[n] = types.ModuleType(n)\n"
            "        for n in names:\n"
            "            del sys.modules[n]\n"
            "sys.setswitchinterval(1e-6)\n"
            "t = threading.Thread(target=churn)\n"
            "t.start()\n"
            "try:\n"
            "    for _ in range(3000):\n"
            "        transformers_without_torch()\n"
            "finally:\n"
            "    stop.set()\n"
            "    t.join()\n"
            "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["ok"], p.stderr[-2000:]


@pytest.mark.slow          # two processes of their own
def test_a_worker_imports_transformers_only_to_load_a_tokenizer_and_then_without_torch(tok_dir):
    """A worker process (worker.imports.own_process, as Worker's constructor calls it) does not
    import transformers until it loads a tokenizer (0.6-0.8 CPU-seconds saved on every rank that
    loads none), and then transformers is told torch is absent, so no torch is imported. Without
    own_process (a program using the Python API) the same load imports torch, where it is
    installed, as transformers does."""
    import subprocess
    import sys
    code = ("import sys\n"
            "from msinfer.worker.imports import own_process\n"
            "if sys.argv[2] == 'worker': own_process()\n"
            "import msinfer.worker.actor, msinfer.worker.runner\n"
            "before = 'transformers' in sys.modules\n"
            "from msinfer.launcher.tokenizer import load_tokenizer\n"
            "assert load_tokenizer(sys.argv[1]).encode('hello')\n"
            "print(before, 'transformers' in sys.modules, 'torch' in sys.modules)\n")
    said = {kind: subprocess.run([sys.executable, "-c", code, str(tok_dir), kind], capture_output=True, text=True,
                                 timeout=120) for kind in ("worker", "program")}
    for p in said.values():
        assert p.returncode == 0, p.stderr
    assert said["worker"].stdout.split() == ["False", "True", "False"]
    assert said["program"].stdout.split() == ["False", "True", "True"]


THINKING = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
            "<|assistant|>{% if enable_thinking is defined and not enable_thinking %}be brief{% endif %}{% endif %}")


def test_chat_template_variables_and_switches_reach_the_template_as_in_vllm(tmp_path):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking), add_generation_prompt and
    continue_final_message: the job's variables (input.chat_template_kwargs) with a record's own
    over them, and the switches, render as transformers renders them; a bad value fails its record
    naming the key; a record that sets them where no template applies fails instead of being
    encoded without them."""
    from msinfer.launcher.inputs import parse_openai, parse_record
    tok = load_tokenizer(build_tokenizer(tmp_path / "tok", THINKING))
    messages = [{"role": "user", "content": "hello world"}]

    def text(obj, job=None, chat_template=True):
        rec = parse_record(obj, 1)
        assert rec.error is None, rec.error
        return tok.tok.decode(tok.encode_record(rec, chat_template, job))
    assert text({"messages": messages}).endswith("<|assistant|>")
    assert text({"messages": messages}, {"enable_thinking": False}).endswith("<|assistant|>be brief")
    assert text({"prompt": "hello world"}, {"enable_thinking": False}).endswith("<|assistant|>be brief")
    own = {"messages": messages, "chat_template_kwargs": {"enable_thinking": True}}
    assert text(own, {"enable_thinking": False}).endswith("<|assistant|>")          # the record's wins
    assert text({**own, "add_generation_prompt": False}).endswith("hello world")
    partial = {"messages": messages + [{"role": "assistant", "content": "the capital"}], "continue_final_message": True}
    assert text(partial).endswith("<|assistant|>the capital")
    with pytest.raises(RecordError, match=r"has 'chat_template_kwargs', but its prompt does not go through the chat"):
        text({"prompt": "hello world", "chat_template_kwargs": {"enable_thinking": False}}, chat_template=False)

    bad = [({"chat_template_kwargs": ["enable_thinking"]}, "'chat_template_kwargs' must be an object of template "
                                                           "variables, got a list"),
           ({"chat_template_kwargs": {"tools": []}}, "'chat_template_kwargs' cannot set 'tools'"),
           ({"add_generation_prompt": "yes"}, "'add_generation_prompt' must be true or false"),
           ({"add_generation_prompt": True, "continue_final_message": True}, "cannot both be true")]
    for extra, message in bad:
        assert message in parse_record({"messages": messages, **extra}, 3).error
    assert "is for a prompt that goes through the chat template, not token ids" in \
        parse_record({"prompt_token_ids": [5, 6], "chat_template_kwargs": {"enable_thinking": False}}, 4).error
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    rec = parse_openai({"custom_id": "q", "url": "/v1/chat/completions", "body": body}, 5)
    assert rec.error is None and rec.chat == {"chat_template_kwargs": {"enable_thinking": False}}
    rec = parse_openai({"custom_id": "c", "url": "/v1/completions",
                        "body": {"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}}, 6)
    assert "unknown body key 'chat_template_kwargs'" in rec.error


def test_a_completion_keeps_the_space_before_its_first_word_after_a_sentencepiece_prompt(tmp_path, tok):
    """A SentencePiece tokenizer (Llama 2, Mistral: Metaspace, the first word's space stripped as
    a sequence is decoded) gave "Paris" for the completion of "The capital of France is", whose
    text joined to the prompt lost its space; decoded after the prompt's last tokens it is
    " Paris", as vLLM's detokenizer gives. A byte-level BPE's completion text is unchanged."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    raw = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    raw.train_from_iterator(["the capital of France is Paris", "hello world"] * 5,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path / "sp")
    sp = load_tokenizer(tmp_path / "sp")
    prompt = sp.encode("the capital of France is", add_special_tokens=False)
    out = sp.encode("the capital of France is Paris", add_special_tokens=False)[len(prompt):]
    assert sp.decode(out) == "Paris"                                   # the first word's space stripped
    assert sp.decode_after(sp.context(prompt), out) == " Paris"
    assert sp.decode_after(sp.context([]), out) == "Paris"             # no prompt to read it after
    from msinfer.launcher.records import RecordCodec, RecordState
    from msinfer.launcher.scheduler import Sequence
    codec = RecordCodec.__new__(RecordCodec)                           # a result line's text, as the engine cuts it
    codec.tok = sp
    seq = Sequence(prompt)
    seq.record, seq.output_token_ids = RecordState(), list(out)
    assert codec.text(seq) == " Paris"
    for text in ("hello world", "héllo wörld ✓", "be brief"):
        ids = tok.encode(text, add_special_tokens=False)
        p = tok.encode("the capital of France is", add_special_tokens=False)
        assert tok.decode_after(tok.context(p), ids) == tok.decode(ids)


def test_a_completion_cut_inside_a_character_ends_before_it_as_in_vllm(tok):
    """max_new_tokens can end a completion between the bytes of one character (an emoji is 4
    bytes, often 2-3 byte-level tokens): the text ended in U+FFFD, where vLLM's detokenizer holds
    the incomplete bytes back and its text ends before them. One in the middle stays, as in vLLM."""
    from msinfer.launcher.records import RecordCodec, RecordState
    from msinfer.launcher.scheduler import Sequence
    codec = RecordCodec.__new__(RecordCodec)
    codec.tok = tok
    prompt = tok.encode("Write an emoji:", add_special_tokens=False)
    ids = tok.encode(" smile 😀 ok", add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, "the test tokenizer must split the emoji's bytes over tokens"

    def text(out):
        seq = Sequence(prompt)
        seq.record, seq.output_token_ids = RecordState(), list(out)
        return codec.text(seq)

    assert text(ids[:cuts[0]]) == " smile "
    assert text(ids) == " smile 😀 ok"
    broken = ids[:cuts[0]] + tok.encode(" ok", add_special_tokens=False)   # the character never completed
    assert text(broken) == tok.decode(broken) and "\ufffd" in text(broken)


def test_a_byte_fallback_completion_cut_inside_a_character_keeps_the_whole_ones_before_it(tmp_path):
    """A byte-fallback tokenizer (Llama 2, Mistral v0.1) writes a character it has no token for
    as its UTF-8 bytes, a token each, and decodes a run of them that ends incomplete all as
    U+FFFD: a completion cut after the first byte of its second "語" kept neither, where vLLM's
    text (decoded a character at a time) ends after the first."""
    from tokenizers import Tokenizer as Raw, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from msinfer.launcher.records import RecordCodec, RecordState
    from msinfer.launcher.scheduler import Sequence
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "o", "k", "▁ok", "▁The", "▁sky"):
        vocab[piece] = len(vocab)
    raw = Raw(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    tok = Tokenizer(str(tmp_path))
    codec = RecordCodec.__new__(RecordCodec)
    codec.tok = tok
    ids = tok.encode("ok 語語", add_special_tokens=False)
    assert ids[-6:] == [3 + b for b in "語語".encode()]            # each byte a token

    def text(out):
        seq = Sequence(tok.encode("The sky", add_special_tokens=False))
        seq.record, seq.output_token_ids = RecordState(), list(out)
        return codec.text(seq)

    whole = text(ids)
    assert whole.endswith("ok 語語") and "\ufffd" not in whole
    assert [text(ids[:k]) for k in range(len(ids) - 5, len(ids))] == [whole[:-2]] * 2 + [whole[:-1]] * 3


def test_a_chat_template_of_the_specs_own_renders_the_chats_as_vllms_chat_template_flag(tmp_path):
    """A checkpoint whose tokenizer has no chat template (a base or older fine-tuned model) failed
    every 'messages' record; input.chat_template takes a template of one's own as vLLM's
    --chat-template does: a Jinja file (relative to the spec's folder) or the template's text. It
    renders for every engine (the spec carries its text), is checked by plan, and counts among a
    run's settings."""
    from types import SimpleNamespace

    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.inputs import parse_record
    from msinfer.launcher.records import RecordCodec
    from msinfer.launcher.spec import load_spec
    bare = build_tokenizer(tmp_path / "bare", chat_template=None)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    (tmp_path / "chat.jinja").write_text(template)
    job = tmp_path / "job.yaml"

    def spec(chat_template):
        job.write_text(json.dumps({"model": {"path": str(tmp_path), "tokenizer": str(bare), "max_model_len": 512},
                                   "input": {"path": "in.jsonl", "chat_template": chat_template},
                                   "output": {"path": "out.jsonl"}}))
        return load_spec(job)

    def prompt_ids(s, record):
        tok = load_tokenizer(bare, chat_template=s.input.template_text())
        codec = RecordCodec(s, SimpleNamespace(vocab_size=len(tok.tok), hidden_size=64, labels=(),
                                               classifier_activation="", eos_token_ids=(2,)), tok)
        out = codec.sequences(parse_record(record, 1), 0)
        return out[0].prompt_token_ids if isinstance(out, list) else json.loads(out.line)["error"]["message"]

    chat = {"id": "m", "messages": [{"role": "user", "content": "hello world"}]}
    want = load_tokenizer(bare).encode("[user] hello world\n[assistant]", add_special_tokens=False)
    from_file = spec("chat.jinja")                               # relative to the spec's folder
    assert from_file.input.chat_template == template
    typed = tmp_path / "here"                                      # --set: where it was typed, as other paths
    typed.mkdir()
    (typed / "chat.jinja").write_text("[own]{{ messages[0]['content'] }}")
    cwd = os.getcwd()
    try:
        os.chdir(typed)
        assert load_spec(job, ["input.chat_template=chat.jinja"]).input.chat_template.startswith("[own]")
    finally:
        os.chdir(cwd)
    assert prompt_ids(from_file, chat) == want
    assert prompt_ids(spec(template), chat) == want              # the text itself
    assert prompt_ids(from_file, {"id": "p", "prompt": "hello world"}) == want
    assert "give one as input.chat_template" in prompt_ids(spec(True), chat)
    with pytest.raises(SpecError, match=r"input.chat_template: .*'missing.jinja' is not a template and .*missing.jinja "
                                        r"does not read as a file"):
        spec("missing.jinja")
    (tmp_path / "empty.jinja").write_text(" \n")
    with pytest.raises(SpecError, match=r"the chat template file .*empty.jinja is empty"):
        spec("empty.jinja")
    broken = spec("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(TokenizerError, match=r"the chat template of input.chat_template \(the spec's, in place of "
                                             r"the tokenizer's\) fails on a plain user message: TemplateSyntaxError: "
                                             r".*; fix it, or set input.chat_template: true for the tokenizer's own"):
        load_tokenizer(bare, chat_template=broken.input.template_text()).check_chat_template(own=True)


def test_vllms_truncate_prompt_tokens_and_skip_special_tokens_per_record(tok):
    """sampling.truncate_prompt_tokens keeps a prompt's last k tokens (after the template, as
    vLLM's left truncation; -1: as many as leave room for one token) where a longer prompt failed
    its record; sampling.skip_special_tokens: false keeps the special tokens a completion holds in
    its text. Both come in an OpenAI body too."""
    from types import SimpleNamespace

    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.inputs import parse_openai, parse_record
    from msinfer.launcher.records import RecordCodec
    from msinfer.launcher.spec import JobSpec, SamplingSpec, validate
    spec = JobSpec.model_validate({"model": {"path": "m", "max_model_len": 16}, "input": {"path": "in.jsonl"},
                                   "output": {"path": "out.jsonl"}, "sampling": {"max_new_tokens": 4}})
    codec = RecordCodec(spec, SimpleNamespace(vocab_size=len(tok.tok), hidden_size=64, labels=(),
                                              classifier_activation="", eos_token_ids=(2,)), tok)
    text = "the capital of France is Paris " * 3
    full = tok.apply_chat_template([{"role": "user", "content": text}])
    assert len(full) > 16

    def run(record, out=()):
        seqs = codec.sequences(parse_record(record, 1), 0)
        if not isinstance(seqs, list):
            return json.loads(seqs.line)
        seqs[0].output_token_ids, seqs[0].finish_reason = list(out), "length"
        return json.loads(codec.result(seqs[0]).line) | {"ids": seqs[0].prompt_token_ids}

    assert "the prompt has" in run({"id": "a", "prompt": text})["error"]["message"]
    assert run({"id": "b", "prompt": text, "sampling": {"truncate_prompt_tokens": 5}})["ids"] == full[-5:]
    last = run({"id": "c", "prompt": text, "sampling": {"truncate_prompt_tokens": -1}})
    assert last["ids"] == full[-15:] and last["prompt_tokens"] == 15
    zero = run({"id": "d", "prompt": text, "sampling": {"truncate_prompt_tokens": 0}})
    assert "at least 1" in zero["error"]["message"]
    user = tok.encode("<|user|>", add_special_tokens=False)
    out = tok.encode("hello", add_special_tokens=False) + user + tok.encode(" world", add_special_tokens=False)
    assert run({"id": "e", "prompt": "hi"}, out)["output_text"] == "hello world"
    kept = run({"id": "f", "prompt": "hi", "sampling": {"skip_special_tokens": False}}, out)
    assert kept["output_text"] == "hello<|user|> world"
    body = {"messages": [{"role": "user", "content": "hi"}], "skip_special_tokens": False, "truncate_prompt_tokens": 8}
    rec = parse_openai({"custom_id": "g", "url": "/v1/chat/completions", "body": body}, 1)
    assert rec.sampling == {"skip_special_tokens": False, "truncate_prompt_tokens": 8}
    with pytest.raises(SpecError, match="truncate_prompt_tokens must be at least 1"):
        validate(SamplingSpec, {"truncate_prompt_tokens": 0}, "spec", "sampling")


@pytest.mark.unit
def test_a_developer_message_renders_as_vllm_renders_it_for_a_template_without_that_role(tmp_path):
    """OpenAI's `developer` role: for a template that does not name it, vLLM renders it as a
    system message, and all the system messages as one at the front; a template that names the
    role gets it as written."""
    from tests.checkpoints import build_tokenizer
    tok = Tokenizer(str(build_tokenizer(tmp_path / "plain")))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "developer", "content": "Answer in French."}]
    assert tok.decode(tok.apply_chat_template(chat), False) == \
        "<|system|>Be brief.\n\nAnswer in French.<|user|>hi<|assistant|>"
    assert tok.decode(tok.apply_chat_template(chat[1:]), False) == "<|system|>Answer in French.<|user|>hi<|assistant|>"
    named = ("{% for m in messages %}{% if m['role'] == 'developer' %}[dev]{% endif %}<|{{ m['role'] }}|>"
             "{{ m['content'] }}{% endfor %}")
    tok = Tokenizer(str(build_tokenizer(tmp_path / "named", named)))
    assert tok.decode(tok.apply_chat_template(chat, add_generation_prompt=False), False) == \
        "<|system|>Be brief.<|user|>hi[dev]<|developer|>Answer in French."


@pytest.mark.unit
def test_a_metaspace_tokens_text_keeps_its_leading_space_as_vllms_logprobs_name_it(tmp_path):
    """A Metaspace tokenizer (Mistral's, Llama's newer ones) decodes "▁Paris" alone as "Paris":
    vLLM's log-probabilities name it " Paris" (convert_ids_list_to_tokens puts the space back), and
    so do msinfer's; a byte-level BPE's token keeps its own space either way."""
    from tokenizers import Tokenizer as Raw, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Paris": 1, "Paris": 2, "▁is": 3, "▁▁": 4, "!": 5}
    raw = Raw(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(tmp_path / "meta")
    meta = Tokenizer(str(tmp_path / "meta"))
    assert meta.decode([1]) == "Paris"                                  # what decoding it alone gives
    assert [meta.token_text(i) for i in (1, 2, 3, 4, 5)] == [" Paris", "Paris", " is", "  ", "!"]
    byte_level = Tokenizer(str(build_tokenizer(tmp_path / "bpe")))
    ids = byte_level.encode(" hello", add_special_tokens=False)
    assert byte_level.token_text(ids[0]) == byte_level.decode(ids[:1], False)


@pytest.mark.unit
def test_a_template_that_loops_over_content_parts_gets_them_as_parts_as_vllm_gives_them(tmp_path):
    """vLLM gives a chat template that loops over a message's content (Gemma 3, Llama 4) the
    parts themselves ("openai" content format, found in the template's syntax tree), and any other
    the parts' texts joined by newlines ("string"). The formats below are what vLLM 0.33's
    detector says of each template."""
    from msinfer.launcher.inputs import parse_record
    from msinfer.launcher.tokenizer import content_format
    from tests.checkpoints import build_tokenizer
    formats = {
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}": "string",
        "{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}": "openai",
        "{% set loop_messages = messages[1:] %}{% for message in loop_messages %}{% if message['content'] is string %}"
        "{{ message['content'] | trim }}{% else %}{% for item in message['content'] | list %}{{ item['text'] }}"
        "{% endfor %}{% endif %}{% endfor %}": "openai",
        "{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}{% for c in m.content %}{{ c.text }}{% endfor %}"
        "{% endfor %}": "openai",
        "{% macro render(content) %}{% for c in content %}{{ c.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ render(m.content) }}{% endfor %}": "openai",
    }
    assert {t: content_format(t) for t in formats} == formats
    parts = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}"
             "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{% endfor %}<|assistant|>")
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Translate:"},
                                                      {"type": "text", "text": "Bonjour"}]}]}
    rendered = {}
    for name, template in (("openai", parts), ("string", "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                                                         "{% endfor %}<|assistant|>")):
        tok = Tokenizer(str(build_tokenizer(tmp_path / name, template)))
        rendered[name] = tok.decode(tok.encode_record(parse_record(chat, 1), True), False)
    assert rendered == {"openai": "<|system|>Be brief.<|user|>Translate:Bonjour<|assistant|>",
                        "string": "<|system|>Be brief.<|user|>Translate:\nBonjour<|assistant|>"}
