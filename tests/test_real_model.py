"""The engine on a real model: SmolLM2-135M-Instruct (30 layers, GQA 9/3, tied embeddings, rope
theta 100000), built once from the GGUF on PyPI by scripts/make_demo_model.py.

One batch of three chat prompts of different lengths runs through `ModelRunner` step by step
(prefill, then 32 greedy decode steps). Its first sequence must answer the France question, and
every sequence's tokens must equal transformers' greedy `generate` on that prompt alone. Both
checks share that one run, so the engine compiles three graphs (one prefill, and decode at two
context buckets, L=64 and L=128), ~5 s each on 2 cores.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from scripts.make_demo_model import ensure_demo_model  # noqa: E402
from msinfer.worker.protocol import SamplingParams, SeqStep  # noqa: E402
from msinfer.sharding.config import EngineConfig  # noqa: E402
from msinfer.worker.runner import ModelRunner  # noqa: E402

NEW_TOKENS = 32
MAX_MODEL_LEN = 128          # longest prompt (<= 64 tokens) + 32 new tokens fits 8 blocks of 16
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are brief."},
     {"role": "user", "content": "Name a primary color."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue during the day, "
                                 "and name the physical effect that causes it."}],
]


@pytest.fixture(scope="module")
def demo():
    """The checkpoint, its tokenizer, the three chat prompts as token ids, and both models."""
    path = ensure_demo_model()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [list(tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False)) for c in CHATS]
    assert len({len(p) for p in prompts}) == 3 and max(map(len, prompts)) <= 64, [len(p) for p in prompts]
    engine = ModelRunner(EngineConfig(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN,
                                      max_batch_size=len(prompts)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return dict(path=path, tok=tok, prompts=prompts, engine=engine, hf=hf)


def engine_greedy(engine: ModelRunner, prompts: list[list[int]], n: int):
    """Greedy-decodes all prompts together as one batch; returns per prompt the n tokens and,
    per token, the engine's top-2 log-probability margin (for the failure message)."""
    blocks = MAX_MODEL_LEN // engine.block_size
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(prompts))]
    greedy = SamplingParams(max_new_tokens=n, logprobs=2)
    tokens = [[] for _ in prompts]
    margins = [[] for _ in prompts]
    for step in range(n):
        if step == 0:
            seqs = [SeqStep(i, p, 0, tables[i], greedy) for i, p in enumerate(prompts)]
        else:
            seqs = [SeqStep(i, [tokens[i][-1]], len(p) + step - 1, tables[i], greedy, num_generated=step)
                    for i, p in enumerate(prompts)]
        out = engine.step(seqs, is_prefill=step == 0)
        for i, (t, (_, top)) in enumerate(zip(out.token_ids, out.logprobs)):
            tokens[i].append(t)
            margins[i].append(top[0][1] - top[1][1])
    return tokens, margins


@pytest.fixture(scope="module")
def generated(demo):
    return engine_greedy(demo["engine"], demo["prompts"], NEW_TOKENS)


def up_to_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_chat_answer_names_paris(demo, generated):
    tok = demo["tok"]
    answer = tok.decode(up_to_eos(generated[0][0], tok.eos_token_id), skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_batched_greedy_tokens_equal_transformers(demo, generated):
    """Each prompt alone (no padding) through transformers, against the engine's batch of three.
    EOS does not stop either side, so all 32 tokens are compared."""
    tokens, margins = generated
    hf, tok = demo["hf"], demo["tok"]
    for i, prompt in enumerate(demo["prompts"]):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
        expected = out.sequences[0, len(prompt):].tolist()
        assert len(expected) == NEW_TOKENS, f"transformers stopped after {len(expected)} tokens"
        if tokens[i] == expected:
            continue
        # A near-tie (tiny margins on both sides) is float noise; a large one is a bug.
        j = next(k for k, (a, b) in enumerate(zip(tokens[i], expected)) if a != b)
        logits = out.logits[j][0].float()
        pytest.fail(f"prompt {i} ({len(prompt)} tokens): first difference at new token {j}: "
                    f"engine {tokens[i][j:j + 4]} {tok.decode(tokens[i][:j + 1])!r}, "
                    f"transformers {expected[j:j + 4]} {tok.decode(expected[:j + 1])!r}; transformers' logit "
                    f"margin of its token over the engine's {float(logits[expected[j]] - logits[tokens[i][j]]):.4g}, "
                    f"the engine's top-2 log-prob margin {margins[i][j]:.4g}")


FP16_MARGIN = 0.1        # a top-2 log-prob margin within float16's reach on this model's logits


def test_the_emulated_ascend_path_generates_what_the_cpu_kernels_generate(demo, generated):
    """The same batch on the Ascend path with its fused kernels stood in (MSINFER_ASCEND_EMULATE)
    in float16, the dtype the kernels take: the first 8 tokens of every prompt are the CPU
    kernels' (float32, which the test above holds to transformers over 32), up to a token where
    the CPU kernels' two best are within FP16_MARGIN of each other, after which they may part."""
    engine = ModelRunner(EngineConfig(str(demo["path"]), dtype="float16", max_model_len=MAX_MODEL_LEN,
                                      max_batch_size=len(demo["prompts"]), device="ascend", emulate=True,
                                      kernel_check=False))
    tokens, margins = engine_greedy(engine, demo["prompts"], 8)
    cpu_tokens, cpu_margins = [t[:8] for t in generated[0]], generated[1]
    for i in range(len(tokens)):
        if tokens[i] != cpu_tokens[i]:
            j = next(k for k, (a, b) in enumerate(zip(tokens[i], cpu_tokens[i])) if a != b)
            assert cpu_margins[i][j] < FP16_MARGIN, (
                f"prompt {i}: first difference at new token {j}: emulated Ascend {tokens[i][j:j + 4]}, CPU kernels "
                f"{cpu_tokens[i][j:j + 4]}; top-2 margins {margins[i][j]:.4g} and {cpu_margins[i][j]:.4g}")
