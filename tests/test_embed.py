"""task: embed against transformers: a record's vector is its prompt's final hidden states
(transformers' AutoModel `last_hidden_state`) pooled by its last token, its mean or its first,
L2-normalized, whether the prompt is prefilled whole, in chunks, or after a cached prefix; a base
model's checkpoint (no `model.` prefix, no LM head) with sentence-transformers' pooling files;
OpenAI embeddings requests in and their response lines out."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from msinfer.launcher.job import plan_job
from msinfer.launcher.spec import JobSpec
from tests.engine_driver import exchange_until_done, in_process_rank

NAME = "llama_gqa_tied"
ATOL = 1e-5             # on unit vectors, float32 on both sides (observed differences ~1e-7)
_HF: dict = {}


def hf_states(path, ids) -> np.ndarray:
    """transformers' final hidden states (after the last norm) of prompt ids, [len(ids), hidden]."""
    import torch
    import transformers
    if str(path) not in _HF:
        _HF[str(path)] = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return _HF[str(path)](torch.tensor([list(ids)])).last_hidden_state[0].double().numpy()


def hf_embedding(path, ids, how: str, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
    h = hf_states(path, ids)
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[how][:dimensions]
    return v / np.linalg.norm(v) if normalize else v


def spec_for(path, task="embed", **sections) -> JobSpec:
    spec = {"task": task, "model": {"path": str(path), "max_model_len": 64}, "input": {"path": "in.jsonl"},
            "output": {"path": "out.jsonl"}}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return JobSpec.model_validate(spec)


def run(plan, records, output_format="msinfer", stats=None) -> list[dict]:
    """The records through an engine on a rank in this process: their result lines, in order
    (`stats`: a dict to update with the engine's engine_stats)."""
    from msinfer.launcher.engine import Engine, EngineSetup
    from msinfer.launcher.inputs import parse_openai, parse_record
    engine = Engine(EngineSetup(plan.spec, plan.model, plan.engine, output_format), 0, plan.tokenizer)
    engine.attach([in_process_rank(plan.engine)])
    parsed = [parse_openai(r, i + 1) if "custom_id" in r else parse_record(r, i + 1) for i, r in enumerate(records)]
    try:
        done = exchange_until_done(engine, parsed, timeout=120)
    finally:
        engine.close(wait_s=60)
    assert len(done) == len(records)
    if stats is not None:
        stats.update(engine.engine_stats())
    return [json.loads(d.line) for d in sorted(done, key=lambda d: d.serial)]


PROMPTS = [[(7 * i + 3) % 200 + 5 for i in range(37)],      # three chunks of 16
           [(7 * i + 3) % 200 + 5 for i in range(20)] + [9, 8, 7],     # the first's prefix, then its own
           [42, 17, 5]]


@pytest.mark.parametrize("how", ["last", "mean", "cls"])
def test_each_pooling_gives_transformers_vector_whole_in_chunks_and_after_a_cached_prefix(checkpoint, how):
    """Prompts of 37, 23 and 3 tokens at max_batched_tokens 16 (the longest in three chunks, the
    second after the first's cached blocks where last pooling lets it skip them): each vector
    within 1e-5 of transformers' pooled and normalized final hidden states; prompt_tokens counted;
    truncate_prompt_tokens -1 keeps the first max_model_len tokens (vLLM's pooling truncates on
    the right; no room for a generated one is kept);
    n > 1 and prompt_logprobs are the record's error."""
    path = checkpoint(NAME)
    plan = plan_job(spec_for(path, pooling={"type": how}, scheduler={"max_batched_tokens": 16, "max_batch_size": 4}),
                    check_io=False)
    assert plan.spec.pooling.normalize is True and plan.model.lm_head is False
    records = [{"id": f"r{i}", "prompt_token_ids": p} for i, p in enumerate(PROMPTS)]
    stats = {}
    long = [(5 * i + 1) % 200 + 3 for i in range(70)]           # past max_model_len 64: its first 64
    lines = run(plan, records + [{"id": "n", "prompt_token_ids": [5, 6], "sampling": {"n": 2}},
                                 {"id": "lp", "prompt_token_ids": [5, 6], "sampling": {"prompt_logprobs": 0}},
                                 {"id": "cut", "prompt_token_ids": long, "sampling": {"truncate_prompt_tokens": -1}}],
                stats=stats)
    # the second prompt's first 16 tokens (a block) come from the first's cache where the last
    # token alone is pooled; mean and cls pooling feed every token
    assert stats["cached_tokens"] == (16 if how == "last" else 0)
    for line, ids in zip(lines[:3] + lines[5:], PROMPTS + [long[:64]]):
        assert line["error"] is None and line["prompt_tokens"] == len(ids) and line["completion_tokens"] == 0
        got = np.array(line["embedding"])
        assert got.shape == (plan.model.hidden_size,)
        np.testing.assert_allclose(got, hf_embedding(path, ids, how), atol=ATOL)
    assert "sampling.n is 2, but an embedded record generates nothing" in lines[3]["error"]["message"]
    assert lines[4]["error"]["message"] == ("record 'lp': sampling.prompt_logprobs: task embed computes no "
                                            "log-probabilities")


def base_model(src, dst, pooling: str | None, normalize: bool):
    """A base model's checkpoint saved from `src` (transformers' LlamaModel: tensors without the
    `model.` prefix, no LM head), with sentence-transformers' files for `pooling`."""
    import torch
    import transformers
    transformers.AutoModel.from_pretrained(src, dtype=torch.float32).save_pretrained(dst)
    if pooling is None:
        return dst
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    modes = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": pooling == "lasttoken"}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return dst


def test_a_base_models_checkpoint_pools_as_its_sentence_transformers_files_say_and_answers_openai_requests(
        checkpoint, tmp_path):
    """A checkpoint saved as a base model (LlamaModel: no `model.` prefix, no lm_head) with
    modules.json naming mean pooling and no Normalize: pooling auto reads them, and each vector
    is transformers' mean, not normalized. OpenAI /v1/embeddings lines: a string list of token
    ids, several inputs (one vector each, in order), `dimensions` (the first k, as pooled), base64
    (float32 little-endian), and a chat request under task embed is its record's 400."""
    from msinfer.launcher.errors import SpecError
    path = base_model(checkpoint(NAME), tmp_path / "base", "mean", normalize=False)
    assert not (path / "model.safetensors.index.json").exists()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))     # dimensions: cut it
    plan = plan_job(spec_for(path, output={"format": "openai"}), check_io=False)
    assert (plan.spec.pooling.type, plan.spec.pooling.normalize) == ("mean", False)
    assert ("task embed: mean pooling of the final hidden states, not normalized (from the checkpoint's "
            "sentence-transformers files (modules.json))") in plan.notes
    a, b = PROMPTS[2], PROMPTS[1]
    url = "/v1/embeddings"
    lines = run(plan, [
        {"custom_id": "one", "method": "POST", "url": url, "body": {"model": "m", "input": a}},
        {"custom_id": "two", "method": "POST", "url": url, "body": {"input": [a, b], "dimensions": 16}},
        {"custom_id": "b64", "method": "POST", "url": url, "body": {"input": b, "encoding_format": "base64"}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}]}},
        # vLLM's request options: use_activation (normalized here), truncation_side
        {"custom_id": "unit", "method": "POST", "url": url, "body": {"input": a, "use_activation": True}},
        {"custom_id": "first", "method": "POST", "url": url, "body": {"input": a, "truncate_prompt_tokens": 4}},
        {"custom_id": "last", "method": "POST", "url": url, "body": {"input": a, "truncate_prompt_tokens": 4,
                                                                       "truncation_side": "left"}}], "openai")
    one, two, b64, chat, unit, first, last = (x["response"] for x in lines)
    np.testing.assert_allclose(unit["body"]["data"][0]["embedding"], hf_embedding(path, a, "mean"), atol=1e-4)
    np.testing.assert_allclose(first["body"]["data"][0]["embedding"], hf_embedding(path, a[:4], "mean", False),
                               atol=1e-4)
    np.testing.assert_allclose(last["body"]["data"][0]["embedding"], hf_embedding(path, a[-4:], "mean", False),
                               atol=1e-4)
    assert one["status_code"] == 200 and one["body"]["object"] == "list"
    assert one["body"]["usage"] == {"prompt_tokens": len(a), "total_tokens": len(a)}
    [entry] = one["body"]["data"]
    assert entry["object"] == "embedding" and entry["index"] == 0
    np.testing.assert_allclose(entry["embedding"], hf_embedding(path, a, "mean", normalize=False), atol=1e-4)
    assert [d["index"] for d in two["body"]["data"]] == [0, 1]
    for d, ids in zip(two["body"]["data"], (a, b)):
        np.testing.assert_allclose(d["embedding"], hf_embedding(path, ids, "mean", False, 16), atol=1e-4)
    assert two["body"]["usage"]["prompt_tokens"] == len(a) + len(b)
    packed = np.frombuffer(base64.b64decode(b64["body"]["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(packed, hf_embedding(path, b, "mean", normalize=False), atol=1e-4)
    assert chat["status_code"] == 400 and chat["body"]["error"]["message"] == (
        "record 'chat': a /v1/chat/completions request generates, and the job's task is embed: give it a job of "
        "its own (task: generate)")

    # last-token pooling with Normalize; a Dense module is refused, naming it
    lasttoken = base_model(checkpoint(NAME), tmp_path / "last", "lasttoken", normalize=True)
    plan = plan_job(spec_for(lasttoken), check_io=False)
    assert (plan.spec.pooling.type, plan.spec.pooling.normalize) == ("last", True)
    modules = json.loads((lasttoken / "modules.json").read_text())
    (lasttoken / "modules.json").write_text(json.dumps(modules + [
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(SpecError, match=r"modules.json: module sentence_transformers.models.Dense \(3_Dense\) is "
                                        r"not applied by msinfer"):
        plan_job(spec_for(lasttoken), check_io=False)
    assert plan_job(spec_for(lasttoken, pooling={"type": "last", "normalize": True}), check_io=False)
    with pytest.raises(SpecError, match="pooling.dimensions 65 is more than the model's hidden size 64"):
        plan_job(spec_for(path, pooling={"dimensions": 65}), check_io=False, weights=False)
    # as vLLM: a model that is no Matryoshka model is not cut, nor one to a size it does not list
    with pytest.raises(SpecError, match=r"pooling.dimensions 16: the model does not support Matryoshka embeddings "
                                        r"\(its config.json has neither is_matryoshka nor matryoshka_dimensions\)"):
        plan_job(spec_for(lasttoken, pooling={"type": "last", "normalize": True, "dimensions": 16}), check_io=False,
                 weights=False)
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    assert plan_job(spec_for(path, pooling={"dimensions": 32}), check_io=False, weights=False).spec.pooling.dimensions == 32
    with pytest.raises(SpecError, match=r"pooling.dimensions 8 is not one of the model's Matryoshka dimensions "
                                        r"\[16, 32\]"):
        plan_job(spec_for(path, pooling={"dimensions": 8}), check_io=False, weights=False)
    # pooling is for task embed, and an embeddings request is its record's error in a generate job
    from msinfer.launcher.inputs import parse_openai
    from msinfer.launcher.records import RecordCodec
    generate = {"model": {"path": str(path), "max_model_len": 64}, "input": {"path": "in.jsonl"},
                "output": {"path": "out.jsonl"}, "sampling": {"max_new_tokens": 8}}
    with pytest.raises(ValueError, match="pooling applies to task: embed, and the task is generate"):
        JobSpec.model_validate({**generate, "pooling": {"type": "mean"}})
    gen = plan_job(JobSpec.model_validate(generate), check_io=False, weights=False)
    done = RecordCodec(gen.spec, gen.model, None, "openai").sequences(
        parse_openai({"custom_id": "e", "url": url, "body": {"input": [1, 2]}}, 1), 0)
    assert done.failed and "record 'e': a /v1/embeddings request needs task: embed; the job's task is " \
                            "'generate'" in done.line


def test_the_demo_model_embeds_text_as_written_and_messages_through_its_template(ray_local):
    """The real demo model through the Python API (LLM(task='embed').embed): a text prompt is
    embedded as its tokenizer encodes it, without the chat template; messages through the
    template without a generation prompt (as vLLM's embedding requests); each vector within 1e-4
    of transformers'. generate() on an embedding LLM says what to call."""
    from transformers import AutoTokenizer
    from msinfer.launcher.api import LLM
    from msinfer.launcher.errors import SpecError
    from scripts.make_demo_model import ensure_demo_model
    path = ensure_demo_model()
    texts = ["The capital of France is Paris.", "Bananas are yellow."]
    messages = [{"role": "user", "content": "Hello there"}]
    llm = LLM(str(path), task="embed", max_model_len=256, device="cpu")
    try:
        out = llm.embed(texts + [messages])
        with pytest.raises(SpecError, match=r"LLM\(task='embed'\) generates nothing: call embed\(prompts\)"):
            llm.generate(texts)
        with pytest.raises(SpecError, match=r"classify\(\) needs LLM\(..., task='classify'\); this LLM's task is "
                                            r"embed"):
            llm.classify(texts)
    finally:
        llm.shutdown()
    tok = AutoTokenizer.from_pretrained(path)
    chat = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    ids = [tok(t)["input_ids"] for t in texts] + [tok(chat, add_special_tokens=False)["input_ids"]]
    for r, want in zip(out, ids):
        assert r["prompt_tokens"] == len(want)
        np.testing.assert_allclose(r["embedding"], hf_embedding(path, want, "last"), atol=1e-4)


@pytest.mark.unit
def test_an_embeddings_request_becomes_a_record_and_a_bad_one_names_its_key(tmp_path):
    from msinfer.launcher.inputs import parse_openai

    def req(body, url="/v1/embeddings"):
        return parse_openai({"custom_id": "e", "method": "POST", "url": url, "body": body}, 3)
    rec = req({"model": "m", "input": "hi", "dimensions": 8, "encoding_format": "base64", "user": "u"})
    assert (rec.error, rec.prompt, rec.dimensions, rec.openai_base64) == (None, "hi", 8, True)
    assert req({"input": [1, 2]}).prompt_token_ids == [1, 2] and req({"input": ["a", "b"]}).prompts == ["a", "b"]
    assert req({"input": [[1], [2, 3]], "truncate_prompt_tokens": 2}).sampling == {"truncate_prompt_tokens": 2}
    assert req({"input": "a", "add_special_tokens": False, "use_activation": False}).embed_options == \
        {"use_activation": False, "add_special_tokens": False}
    # add_special_tokens (vLLM's: true for input, false for messages, whose template holds them)
    from msinfer.launcher.tokenizer import Tokenizer
    from tests.checkpoints import build_tokenizer
    tok = Tokenizer(str(build_tokenizer(tmp_path)))
    with_bos, without = (tok.encode_record(req({"input": "hello world", **f}), False)
                         for f in ({}, {"add_special_tokens": False}))
    assert with_bos == [1, *without]
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    plain, special = (tok.encode_record(req({**chat, **f}), True, generation_prompt=False)
                      for f in ({}, {"add_special_tokens": True}))
    assert special == [1, *plain]
    for body, error in [({}, "the body of a /v1/embeddings request needs 'input' (or vLLM's 'messages')"),
                        ({"input": ""}, "'input' must be a non-empty string, a list of token ids, or a list of "
                                        "several inputs (non-empty strings, or lists of token ids)"),
                        ({"input": ["a", ""]}, "'input' must be a non-empty string"),
                        ({"input": [1, -2]}, "'input' must hold non-negative integers, found int -2"),
                        ({"input": "a", "encoding_format": "int8"}, "'encoding_format' must be float or base64"),
                        ({"input": "a", "dimensions": 0}, "'dimensions' must be a positive integer, got 0"),
                        ({"input": "a", "temperature": 1}, "unknown body key 'temperature'"),
                        ({"input": "a", "use_activation": 1}, "'use_activation' must be true or false"),
                        ({"input": "a", "truncation_side": "middle"}, "'truncation_side' must be left or right"),
                        ({"input": "a", "messages": []}, "give 'input' or 'messages', not both")]:
        assert req(body).error.startswith("line 3: " + error), (body, req(body).error)


def test_the_emulated_ascend_path_pools_as_the_cpu_does(checkpoint, monkeypatch):
    """device ascend, emulated (bfloat16 compute, the fused kernels stood in): the pool step
    compiles under its own phase, and each vector points where transformers' float32 one does
    (cosine > 0.999; 16-bit rounding keeps it from 1e-5)."""
    monkeypatch.setenv("MSINFER_ASCEND_EMULATE", "1")
    path = checkpoint(NAME)
    plan = plan_job(spec_for(path, pooling={"type": "mean"}, parallel={"device": "ascend"},
                             scheduler={"max_batched_tokens": 16, "max_batch_size": 4, "block_size": 128}),
                    check_io=False)
    assert plan.engine.emulate and plan.engine.dtype in ("bfloat16", "float16")
    lines = run(plan, [{"id": f"r{i}", "prompt_token_ids": p} for i, p in enumerate(PROMPTS)])
    for line, ids in zip(lines, PROMPTS):
        assert float(np.dot(line["embedding"], hf_embedding(path, ids, "mean"))) > 0.999


def classifier(src, dst, cls_name: str, labels: dict):
    """A sequence classifier saved from a causal LM's checkpoint: transformers' `cls_name` with
    the LM's decoder and a random `score` head of len(labels) rows."""
    import torch
    import transformers
    torch.manual_seed(0)
    model = getattr(transformers, cls_name).from_pretrained(src, dtype=torch.float32, num_labels=len(labels),
                                                            id2label=labels, label2id={v: k for k, v in labels.items()})
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(dst)
    return dst


@pytest.mark.parametrize("name, cls_name, labels", [
    ("qwen3_qknorm_odd_head_dim", "Qwen3ForSequenceClassification", {0: "negative", 1: "neutral", 2: "positive"}),
    ("llama_gqa_tied", "LlamaForSequenceClassification", {0: "reward"})], ids=["three-labels", "reward-model"])
def test_a_classifier_gives_transformers_logits_of_the_last_token_whole_and_in_chunks(
        checkpoint, tmp_path, name, cls_name, labels):
    """task classify on *ForSequenceClassification checkpoints, prompts of 37, 23 and 3 tokens at
    max_batched_tokens 16: each record's logits within 1e-4 of transformers' (its head on the last
    token), probs their softmax (one label, a reward model's: its sigmoid), label the most likely
    one's name. A causal LM under task classify, and a classifier under task generate, stop the
    plan with what to set."""
    import torch
    import transformers
    from msinfer.launcher.errors import SpecError
    path = classifier(checkpoint(name), tmp_path / "cls", cls_name, labels)
    plan = plan_job(spec_for(path, task="classify", scheduler={"max_batched_tokens": 16, "max_batch_size": 4}),
                    check_io=False)
    lines = run(plan, [{"id": f"r{i}", "prompt_token_ids": p} for i, p in enumerate(PROMPTS)])
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    for line, ids in zip(lines, PROMPTS):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0].double().numpy()
        np.testing.assert_allclose(line["logits"], want, atol=1e-4)
        probs = 1 / (1 + np.exp(-want)) if len(labels) == 1 else np.exp(want) / np.exp(want).sum()
        np.testing.assert_allclose(line["probs"], probs, atol=1e-4)
        assert line["label"] == labels[int(np.argmax(want))] and line["prompt_tokens"] == len(ids)
    with pytest.raises(SpecError, match=rf"is a sequence classifier \({cls_name}, {len(labels)} label\(s\)\), with no "
                                        r"LM head to generate with; set task: classify"):
        plan_job(JobSpec.model_validate({"model": {"path": str(path), "max_model_len": 64},
                                         "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"},
                                         "sampling": {"max_new_tokens": 8}}), check_io=False, weights=False)
    with pytest.raises(SpecError, match=r"task classify needs a sequence classifier's checkpoint"):
        plan_job(spec_for(checkpoint(name), task="classify"), check_io=False, weights=False)


def test_a_causal_lm_classifies_by_the_lm_head_rows_of_given_tokens_as_a_reranker_does():
    """model.classifier_from_tokens: ["no", "yes"] under task classify (Qwen3-Reranker's way, as
    vLLM's classifier_from_token): the demo model's logits are its LM head's rows of those tokens on
    the last token, within 1e-4 of transformers' next-token logits there; probs[1] is the
    relevance. A label is a vocabulary entry, looked up as vLLM does; one that is not stops the
    plan, naming it."""
    import torch
    import transformers
    from msinfer.launcher.errors import SpecError
    from scripts.make_demo_model import ensure_demo_model
    path = ensure_demo_model()
    spec = spec_for(path, task="classify", model={"classifier_from_tokens": ["no", "yes"], "max_model_len": 256})
    plan = plan_job(spec, check_io=False)
    assert plan.model.labels == ("no", "yes") and plan.engine.head_tokens == plan.model.head_tokens
    question = ("Judge whether the Document answers the Query. Answer only \"yes\" or \"no\".\n"
                "Query: What is the capital of France?\nDocument: {}\nAnswer:")
    docs = ["Paris is the capital and largest city of France.", "Bananas are yellow when they are ripe."]
    lines = run(plan, [{"id": f"d{i}", "prompt": question.format(d)} for i, d in enumerate(docs)])
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for line, doc in zip(lines, docs):
        ids = tok(question.format(doc))["input_ids"]
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0, -1, list(plan.model.head_tokens)].double().numpy()
        np.testing.assert_allclose(line["logits"], want, atol=1e-4)
        assert line["prompt_tokens"] == len(ids) and line["label"] in ("no", "yes")
    with pytest.raises(SpecError, match=r"model.classifier_from_tokens: 'maybe not' is not a token of the "
                                        r"tokenizer's vocabulary \(as text it is \d+ token\(s\)"):
        plan_job(spec_for(path, task="classify", model={"classifier_from_tokens": ["no", "maybe not"]}),
                 check_io=False, weights=False)


@pytest.mark.unit
def test_a_config_of_attention_both_ways_is_refused_rather_than_run_causally():
    """An embedding model trained with bidirectional attention (config.json is_causal: false)
    would give other vectors under causal attention, with no error: its config is refused."""
    from msinfer.sharding.config import ModelConfig, ModelConfigError
    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "intermediate_size": 128, "num_hidden_layers": 2}
    assert ModelConfig.from_dict({**config, "is_causal": True}).family == "qwen2"
    with pytest.raises(ModelConfigError, match="is_causal=false .* is not supported: msinfer's attention is causal"):
        ModelConfig.from_dict({**config, "is_causal": False}, "config.json")


@pytest.mark.parametrize("name", ["qwen3_moe_top2_dense_layer", "deepseek_v3_yarn_groups"])
def test_a_mixture_of_experts_and_latent_attention_embed_as_transformers_base_model(checkpoint, name):
    """task embed on a Qwen3-MoE and a DeepSeek-V3 causal LM (routed experts; latent attention
    with YaRN): mean-pooled vectors within 1e-4 of transformers' AutoModel, chunked at 16 tokens."""
    path = checkpoint(name)
    plan = plan_job(spec_for(path, pooling={"type": "mean"}, scheduler={"max_batched_tokens": 16, "max_batch_size": 4}),
                    check_io=False)
    lines = run(plan, [{"id": f"r{i}", "prompt_token_ids": p} for i, p in enumerate(PROMPTS)])
    for line, ids in zip(lines, PROMPTS):
        np.testing.assert_allclose(line["embedding"], hf_embedding(path, ids, "mean"), atol=1e-4)


@pytest.mark.unit
def test_a_classifiers_probs_and_a_checkpoints_pooling_are_read_as_vllms_pooler_reads_them(tmp_path):
    """config.json's problem_type and a cross-encoder's activation decide `probs` (regression: the
    logits; multi-label: a sigmoid each; Identity: the logits), as vLLM's pooler; modules.json
    without a Pooling module leaves the model's defaults (last token, normalized), and the newer
    sentence-transformers module names read as the old."""
    from msinfer.launcher.embed import checkpoint_pooling
    from msinfer.launcher.records import classified
    from msinfer.sharding.config import ModelConfig, ModelConfigError
    z = [1.0, 1.0, -1.0]
    sig = [1 / (1 + np.exp(-x)) for x in z]
    assert classified(z, ("a", "b", "c"), "sigmoid")["probs"] == pytest.approx(sig)
    assert classified([2.0], ("score",), "identity")["probs"] == [2.0]
    assert classified([2.0], ("score",))["probs"] == pytest.approx([1 / (1 + np.exp(-2.0))])
    assert classified(z, ("a", "b", "c"))["probs"] == pytest.approx(np.exp(z) / np.exp(z).sum())
    base = {"architectures": ["Qwen2ForSequenceClassification"], "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 64, "num_labels": 1}
    kinds = {json.dumps(extra): ModelConfig.from_dict({**base, **extra}).classifier_activation for extra in (
        {}, {"problem_type": "regression"}, {"problem_type": "multi_label_classification"},
        {"problem_type": "single_label_classification"},
        {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}},
        {"sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"})}
    assert list(kinds.values()) == ["", "identity", "sigmoid", "", "identity", "sigmoid"]
    with pytest.raises(ModelConfigError, match=r"the classifier's activation 'my.Module' is not one msinfer applies"):
        ModelConfig.from_dict({**base, "sentence_transformers": {"activation_fn": "my.Module"}})
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "",
                                                        "type": "sentence_transformers.models.Transformer"}]))
    assert checkpoint_pooling(tmp_path) == (None, None)             # no Pooling module: the defaults
    new = "sentence_transformers.sentence_transformer.modules."
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "", "type": new + "transformer.Transformer"}, {"path": "1_Pooling", "type": new + "pooling.Pooling"},
        {"path": "2_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"}]))
    assert checkpoint_pooling(tmp_path) == ("mean", True)


@pytest.mark.unit
def test_a_classifier_token_is_the_vocabulary_entry_of_that_name_as_vllm_looks_it_up(checkpoint, tmp_path):
    """model.classifier_from_tokens names vocabulary entries (vLLM: convert_tokens_to_ids): with a
    tokenizer that puts "▁" before a text's first word, "yes" is the entry "yes", not the "▁yes"
    that encoding the text gives."""
    from tokenizers import Tokenizer as Raw, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from msinfer.launcher.job import token_classifier
    from msinfer.launcher.tokenizer import Tokenizer
    from msinfer.sharding.config import ModelConfig
    vocab = {"<unk>": 0, "▁no": 1, "▁yes": 2, "no": 3, "yes": 4}
    raw = Raw(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(tmp_path)
    tok = Tokenizer(str(tmp_path))
    assert tok.encode("yes", add_special_tokens=False) == [2]
    path = checkpoint(NAME)
    spec = spec_for(path, task="classify", model={"classifier_from_tokens": ["no", "yes"]})
    assert token_classifier(spec, ModelConfig.from_dir(path), tok, weights=False).head_tokens == (3, 4)
