"""vLLM's sampling parameters through a whole engine on the real network: the penalties' history
kept by the worker across steps, async scheduling and preemption; min_tokens holding back stops;
bad words encoded as vLLM encodes them. The reference is a greedy loop over transformers' logits
processed by worker.sampler.process, whose formulas tests/test_sampler.py checks, and transformers'
own `generate` with the parameters it has (repetition_penalty, min_p, min_new_tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from msinfer.launcher.job import plan_job
from msinfer.launcher.spec import JobSpec
from tests.engine_driver import run_engine
from msinfer.worker import sampler

NAME = "llama_gqa_tied"
EOS = 2


def spec_for(path, max_new_tokens=8, **scheduler) -> JobSpec:
    return JobSpec.model_validate({
        "model": {"path": str(path), "max_model_len": 64},
        "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"},
        "sampling": {"max_new_tokens": max_new_tokens},
        "scheduler": {"max_batch_size": 4, "max_batched_tokens": 16, "block_size": 4, **scheduler}})


@pytest.fixture(scope="module")
def reference(checkpoint):
    """reference(prompt, params) -> greedy tokens over transformers' logits, processed as the
    sampler does, stopping as the scheduler does."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(NAME), dtype=torch.float32).eval()

    def run(prompt, p):
        out = []
        while len(out) < p.max_new_tokens:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out])).logits[0, -1].numpy()
            hist = sampler.History(prompt, out) if p.looks_back else None
            t = int(np.argmax(sampler.process(logits, p, len(out), hist)))
            out.append(t)
            if (t == EOS and not p.ignore_eos) or t in p.stop_token_ids:
                break
        return out
    return run


RECORDS = [
    {"id": "long", "prompt_token_ids": list(range(40, 70)),
     "sampling": {"ignore_eos": True, "frequency_penalty": -1.0, "max_new_tokens": 20}},
    {"id": "plain", "prompt_token_ids": [5, 17, 33, 9, 100, 7], "sampling": {"ignore_eos": True}},
    {"id": "penalties", "prompt_token_ids": [5, 17, 33, 9, 100, 7],
     "sampling": {"ignore_eos": True, "repetition_penalty": 1.8, "frequency_penalty": 1.2, "presence_penalty": 0.7}},
    {"id": "bias", "prompt_token_ids": [44, 3, 8, 8],
     "sampling": {"ignore_eos": True, "logit_bias": {"77": 4.0, "78": 3.5}, "presence_penalty": 2.0}},
    {"id": "allowed", "prompt_token_ids": [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
     "sampling": {"ignore_eos": True, "allowed_token_ids": [30, 31, 32, 33], "repetition_penalty": 3.0}},
]


@pytest.mark.parametrize("kv_cache_blocks", [None, 16], ids=["ample", "tight"])
def test_penalties_bias_and_allowed_tokens_give_the_reference_tokens(kv_cache_blocks, checkpoint, reference):
    """Five records with different parameters in one batch, async scheduling; (tight) a cache
    that preempts them, so that histories are sent again on re-admission and released."""
    plan = plan_job(spec_for(checkpoint(NAME), kv_cache_blocks=kv_cache_blocks), check_io=False)
    lines, engine = run_engine(plan, RECORDS)
    for rec in RECORDS:
        p = plan.spec.sampling.merge(rec["sampling"]).to_params()
        assert lines[rec["id"]]["output_token_ids"] == reference(rec["prompt_token_ids"], p), rec["id"]
    assert set(lines["allowed"]["output_token_ids"]) <= {30, 31, 32, 33}
    assert lines["penalties"]["output_token_ids"] != lines["plain"]["output_token_ids"]
    if kv_cache_blocks:
        assert engine.engine_stats()["preemptions"] > 0
    # the rank keeps the histories and last steps of the sequences whose release no later step
    # has carried, only
    runner = engine.workers[0].runner
    assert set(runner.histories) | set(runner.steps.last) <= set(engine.scheduler.released)


def test_min_tokens_holds_back_eos_and_stop_tokens_until_then(checkpoint, reference):
    path = checkpoint(NAME)
    plan = plan_job(spec_for(path, max_new_tokens=12), check_io=False)
    prompt = [44, 3]
    free = reference(prompt, plan.spec.sampling.merge({"ignore_eos": True}).to_params())
    stop = free[1]                                           # greedy would stop at its second token
    records = [{"id": "early", "prompt_token_ids": prompt, "sampling": {"stop_token_ids": [stop]}},
               {"id": "held", "prompt_token_ids": prompt, "sampling": {"stop_token_ids": [stop], "min_tokens": 5}}]
    lines, _ = run_engine(plan, records)
    assert lines["early"]["output_token_ids"] == free[:2] and lines["early"]["finish_reason"] == "stop"
    assert lines["early"]["stop_reason"] == stop                  # vLLM's: the stop token that ended it
    held = lines["held"]["output_token_ids"]
    p = plan.spec.sampling.merge({"stop_token_ids": [stop], "min_tokens": 5}).to_params()
    p = plan_codec(plan).complete(p, _rec("held"))
    assert p.min_tokens_ban == (EOS, stop)
    ignoring = plan.spec.sampling.merge({"ignore_eos": True, "min_tokens": 5}).to_params()
    assert plan_codec(plan).complete(ignoring, _rec("i")).min_tokens_ban == (EOS,)    # vLLM bans it then too
    assert held == reference(prompt, p) and len(held) >= 5 and stop not in held[:4]


def test_records_with_one_prompt_sample_apart_rerun_alike_and_a_records_own_seed_is_its_stream(checkpoint):
    """Four records of one prompt at temperature 1 and the job's default seed draw from their own
    streams (at least two outputs differ); a second run, with the records in another order and so
    in other batches, gives each the same tokens; two records with the same own seed give the same
    tokens; a first token drawn under top_k is among the k most likely, its log-probability the
    same number as its entry there."""
    plan = plan_job(spec_for(checkpoint(NAME), max_new_tokens=6), check_io=False)
    prompt = [5, 17, 33, 9, 100, 7]
    hot = {"temperature": 1.0, "ignore_eos": True}
    records = ([{"id": f"same-{i}", "prompt_token_ids": prompt, "sampling": hot} for i in range(4)]
               + [{"id": f"seeded-{i}", "prompt_token_ids": prompt, "sampling": {**hot, "seed": 42}} for i in range(2)]
               + [{"id": "top-k", "prompt_token_ids": prompt, "sampling": {**hot, "top_k": 3, "logprobs": 3}}])
    first, _ = run_engine(plan, records)
    again, _ = run_engine(plan, records[::-1])
    outputs = {k: v["output_token_ids"] for k, v in first.items()}
    assert len({tuple(outputs[f"same-{i}"]) for i in range(4)}) >= 2
    assert outputs == {k: v["output_token_ids"] for k, v in again.items()}
    assert outputs["seeded-0"] == outputs["seeded-1"]
    lp = first["top-k"]["logprobs"][0]
    assert lp["token_id"] == outputs["top-k"][0]
    assert lp["logprob"] == dict((t, v) for t, v, *_ in lp["top"])[lp["token_id"]]     # one figure, in top


def test_repetition_penalty_min_p_and_min_tokens_give_transformers_generate_tokens(checkpoint):
    """Greedy with repetition_penalty, min_p and min_tokens (a stop token held back) against
    transformers' own logits processors of the same names, through its `generate`."""
    import torch
    import transformers
    path = checkpoint(NAME)
    plan = plan_job(spec_for(path, max_new_tokens=12), check_io=False)
    prompt = [44, 3, 44, 17]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def generate(**kw):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, repetition_penalty=1.3,
                                 pad_token_id=EOS, **kw)
        return out[0, len(prompt):].tolist()
    free = generate(eos_token_id=None)
    stop = free[1]                                  # the penalized greedy run would stop at its second token
    want = generate(eos_token_id=[EOS, stop], min_new_tokens=5, min_p=0.1)
    sampling = {"repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 5, "stop_token_ids": [stop]}
    lines, _ = run_engine(plan, [{"id": "r", "prompt_token_ids": prompt, "sampling": sampling}])
    got = lines["r"]["output_token_ids"]
    assert got == want and len(got) >= 5 and stop not in got[:4], (got, want, free)


def plan_codec(plan):
    from msinfer.launcher.records import RecordCodec
    return RecordCodec(plan.spec, plan.model, plan.tokenizer)


def _rec(rid):
    from msinfer.launcher.inputs import Record
    return Record(rid, 1, prompt_token_ids=[1])


def test_bad_words_are_encoded_as_vllm_does_and_need_a_tokenizer(checkpoint):
    from msinfer.launcher.errors import RecordError
    from scripts.make_demo_model import ensure_demo_model
    spec = JobSpec.model_validate({"model": {"path": str(ensure_demo_model()), "max_model_len": 512},
                                   "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"}})
    plan = plan_job(spec, check_io=False, weights=False)
    codec = plan_codec(plan)
    tok = plan.tokenizer
    p = codec.complete(spec.sampling.merge({"bad_words": ["Paris", " London Bridge"]}).to_params(), _rec("b"))
    want = [tuple(tok.encode("Paris", add_special_tokens=False)), tuple(tok.encode(" Paris", add_special_tokens=False)),
            tuple(tok.encode("London Bridge", add_special_tokens=False)),
            tuple(tok.encode(" London Bridge", add_special_tokens=False))]
    assert p.bad_words_ids == tuple(want) and len(want[2]) > 1 and p.looks_back
    bare = plan_codec(plan_job(spec_for(checkpoint(NAME)), check_io=False))
    with pytest.raises(RecordError, match="record 'b': sampling.bad_words: the model has no tokenizer"):
        bare.complete(spec.sampling.merge({"bad_words": ["x"]}).to_params(), _rec("b"))
    with pytest.raises(RecordError, match=r"record 'b': sampling.logit_bias: token id 300 is outside the vocabulary"):
        bare.complete(spec.sampling.merge({"logit_bias": {"300": 1}}).to_params(), _rec("b"))


def test_structured_outputs_and_tool_choices_follow_their_schema_regex_choice_grammar_and_tools():
    """The real demo model, greedy, with a chat template that renders tools (tests/test_tools.py)
    and output.tool_call_parser hermes: each output is what its constraint allows, complete (it
    ends on end-of-sequence when the grammar is done); an invalid schema fails only its record,
    naming it. A named function's call and "required"'s calls follow the tools' schemas and end the
    completion ("stop"; "tool_calls" for required); tool_choice auto reads a call from the
    completion's text (held to a call's form by a regex, as this small model does not call tools
    by itself) and leaves a plain answer as text."""
    import json
    import re
    import jsonschema
    from scripts.make_demo_model import ensure_demo_model
    from tests.test_tools import HERMES_TEMPLATE, TIME, WEATHER
    spec = JobSpec.model_validate({"model": {"path": str(ensure_demo_model()), "max_model_len": 512},
                                   "input": {"path": "in.jsonl", "chat_template": HERMES_TEMPLATE},
                                   "output": {"path": "out.jsonl", "tool_call_parser": "hermes"},
                                   "sampling": {"max_new_tokens": 48},
                                   "scheduler": {"max_batch_size": 4, "max_batched_tokens": 512}})
    plan = plan_job(spec, check_io=False)
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Rome"]},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    question = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    own = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Tokyo)"\}\}\n</tool_call>'
    records = [
        {"id": "json", "messages": question, "sampling": {"structured_outputs": {"json": schema}}},
        {"id": "regex", "prompt": "Write a time of day.",
         "sampling": {"structured_outputs": {"regex": "[0-2][0-9]:[0-5][0-9]"}}},
        {"id": "choice", "messages": [{"role": "user", "content": "Is Paris in France?"}],
         "sampling": {"structured_outputs": {"choice": ["yes", "no"]}}},
        {"id": "grammar", "prompt": "Say something.", "sampling": {"structured_outputs": {
            "grammar": 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'}}},
        {"id": "named", "messages": ask, "tools": [WEATHER, TIME],
         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"id": "required", "messages": ask, "tools": [WEATHER], "tool_choice": "required",
         "sampling": {"max_new_tokens": 96}},
        {"id": "auto", "messages": ask, "tools": [WEATHER], "sampling": {"structured_outputs": {"regex": own}}},
        {"id": "answer", "messages": ask, "tools": [WEATHER], "sampling": {"max_new_tokens": 8}},
    ]
    lines, _ = run_engine(plan, records)
    out = {k: v["output_text"] for k, v in lines.items()}
    assert all(lines[k]["finish_reason"] == "stop" for k in ("json", "regex", "choice", "grammar", "named")), lines
    jsonschema.validate(json.loads(out["json"]), schema)
    assert re.fullmatch(r"[0-2][0-9]:[0-5][0-9]", out["regex"])
    assert out["choice"] in ("yes", "no")
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", out["grammar"])

    named = lines["named"]
    assert named["output_text"] == "" and len(named["tool_calls"]) == 1
    jsonschema.validate(json.loads(named["tool_calls"][0]["function"]["arguments"]), WEATHER["function"]["parameters"])
    required = lines["required"]
    assert required["finish_reason"] == "tool_calls" and required["tool_calls"], required
    for c in required["tool_calls"]:
        assert c["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(c["function"]["arguments"]), WEATHER["function"]["parameters"])
    auto = lines["auto"]
    assert auto["finish_reason"] == "tool_calls" and auto["output_text"] == ""
    assert [c["function"]["name"] for c in auto["tool_calls"]] == ["get_weather"]
    assert lines["answer"]["tool_calls"] == [] and lines["answer"]["output_text"]

    from msinfer.launcher.inputs import parse_record
    bad = plan_codec(plan).sequences(parse_record({"id": "bad", "prompt": "x", "sampling": {
        "structured_outputs": {"json": {"type": "bogus"}}}}, 1), 0)
    assert bad.failed and "record 'bad': sampling.structured_outputs: Invalid type: bogus" in bad.line


def test_a_json_schema_allows_only_the_keys_it_names_as_vllms_default_backend_does():
    """A schema that lists its properties and says nothing of others: the grammar takes an
    object of those keys and stops at another key's first token (vLLM's xgrammar is strict so;
    the JSON Schema standard would take it); `additionalProperties: true` takes it. A schema
    given as text that is not JSON is refused, naming what is wrong with it."""
    import json
    import llguidance
    import llguidance.hf
    import transformers
    from pydantic import ValidationError
    from msinfer.launcher.spec import StructuredSpec
    from scripts.make_demo_model import ensure_demo_model
    tok = transformers.AutoTokenizer.from_pretrained(ensure_demo_model())
    lltok = llguidance.hf.from_tokenizer(tok)

    def taken(schema, text: str) -> int:            # of text's tokens, how many the grammar takes
        ids = tok.encode(text)
        return llguidance.LLMatcher(lltok, StructuredSpec.model_validate({"json": schema}).grammar_text(),
                                    log_level=0).validate_tokens(ids) - len(ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "object", "properties": {}}}}
    assert taken(schema, '{"a": 1, "b": {}}') == 0 and taken(json.dumps(schema), '{"a": 1}') == 0
    assert taken(schema, '{"a": 1, "c": 2}') < 0 and taken(schema, '{"b": {"c": 2}}') < 0
    assert taken({**schema, "additionalProperties": True}, '{"a": 1, "c": 2}') == 0
    # only subschemas are closed, as vLLM's guidance backend walks them: an enum's values and a
    # property named "properties" stay as written
    assert taken({"enum": [{"properties": 1}]}, '{"properties": 1}') == 0
    named = {"type": "object", "properties": {"properties": {"type": "string"}}, "additionalProperties": True}
    assert taken(named, '{"additionalProperties": 1}') == 0
    nested = {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}]}}
    assert taken(nested, '[{"a": 1}]') == 0 and taken(nested, '[{"b": 1}]') < 0
    with pytest.raises(ValidationError, match=r"the schema's text is not JSON \(Expecting property name enclosed in "
                                              r"double quotes at character 2 of 9\)"):
        StructuredSpec.model_validate({"json": "{not json"})


def test_prompt_logprobs_are_transformers_log_softmax_over_chunks_and_generation_goes_on(checkpoint, reference):
    """prompt_logprobs: 0 on a 30-token prompt prefilled in chunks of 16: per prompt token its
    log-probability given the ones before it (None first), within 1e-4 of transformers' float32,
    and the record still generates its greedy tokens; with prompt_logprobs: 3, also the token's
    rank and the three most likely tokens there; more than 20 is the record's error."""
    import torch
    import transformers
    from msinfer.launcher.errors import RecordError
    path = checkpoint(NAME)
    plan = plan_job(spec_for(path, max_new_tokens=3), check_io=False)
    prompt = [(11 * i + 5) % 250 + 3 for i in range(30)]
    lines, _ = run_engine(plan, [{"id": "p", "prompt_token_ids": prompt,
                                  "sampling": {"prompt_logprobs": 0, "ignore_eos": True}},
                                 {"id": "k", "prompt_token_ids": prompt, "sampling": {"prompt_logprobs": 3}}])
    got = lines["p"]["prompt_logprobs"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    want = [lp[j, prompt[j + 1]] for j in range(len(prompt) - 1)]
    assert got[0] is None and len(got) == len(prompt)
    np.testing.assert_allclose(got[1:], want, atol=1e-4)
    p = plan.spec.sampling.merge({"ignore_eos": True}).to_params()
    assert lines["p"]["output_token_ids"] == reference(prompt, p)
    alternatives = lines["k"]["prompt_logprobs"]
    assert alternatives[0] is None and len(alternatives) == len(prompt)
    for j, entry in enumerate(alternatives[1:]):
        np.testing.assert_allclose(entry["logprob"], want[j], atol=1e-4)
        # its rank: how many tokens are at least as likely (float32 against float64: a margin)
        assert (lp[j] > want[j] + 1e-4).sum() + 1 <= entry["rank"] <= (lp[j] >= want[j] - 1e-4).sum(), j
        ids = [t for t, _, *_ in entry["top"]]
        assert ids == np.argsort(-lp[j], kind="stable")[:3].tolist()
        np.testing.assert_allclose([v for _, v, *_ in entry["top"]], lp[j, ids], atol=1e-4)
    with pytest.raises(RecordError, match=r"record .p.: sampling.prompt_logprobs: expected an integer <= 20, got 21"):
        plan.spec.sampling.merge({"prompt_logprobs": 21}, "p")
