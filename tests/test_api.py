"""The Python API: an LLM object keeps its workers across generate() calls and returns results in
prompt order, the same tokens transformers gives."""

from msinfer.launcher.api import LLM
from tests.conftest import PROMPTS


def test_llm_generate_keeps_order_and_matches_transformers(checkpoint, hf_greedy, ray_local):
    name = "qwen2_qkv_bias"
    llm = LLM(str(checkpoint(name)), max_model_len=128, device="cpu")
    try:
        first = llm.generate(PROMPTS, {"max_new_tokens": 6})
        assert [r["id"] for r in first] == ["0", "1", "2"]
        for r, p in zip(first, PROMPTS):
            assert r["output_token_ids"] == hf_greedy(name, p, 6)[0]
            assert r["finish_reason"] == "length" and r["prompt_tokens"] == len(p)
        # the same workers again, with a per-record override next to the defaults
        second = llm.generate([{"prompt_token_ids": PROMPTS[1], "sampling": {"max_new_tokens": 2}}, PROMPTS[0]],
                              {"max_new_tokens": 3})
        assert second[0]["output_token_ids"] == hf_greedy(name, PROMPTS[1], 6)[0][:2]
        assert second[1]["output_token_ids"] == hf_greedy(name, PROMPTS[0], 6)[0][:3]
    finally:
        llm.shutdown()
