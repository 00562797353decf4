"""Tier 2: the first job on a card -- what Ascend's fused kernels refuse (float32, shape buckets,
PyNative), the start-up kernel self-check settling each kernel's convention (the emulated
stand-ins' variants prove it adapts), the card's memory measured before the KV cache is sized,
and the environment a card's worker sets. On the emulated Ascend path (tests/test_ascend.py has
its parity tests)."""

from __future__ import annotations

import numpy as np
import pytest

from msinfer.sharding.config import EngineConfig
from msinfer.worker.protocol import SeqStep
from msinfer.worker.runner import ModelRunner
from tests.conftest import PROMPTS
from tests.engine_driver import Driver
from tests.test_ascend import ATOL, N_NEW, ascend_spec, assert_greedy_parity, runner_for
from tests.test_parity import Recording


def test_the_fused_kernels_refuse_what_they_cannot_run_and_auto_picks_a_16_bit_dtype(checkpoint, tmp_path,
                                                                                      monkeypatch):
    """On the fused kernels (emulated or not): float32, shape buckets and PyNative are refused by
    name before anything starts; auto is the checkpoint's 16-bit dtype, bfloat16 for a float32 one
    (emulated in float16); model.ops: portable takes float32."""
    from msinfer.launcher.job import plan_job
    from msinfer.sharding.layout import LayoutError
    path = checkpoint("llama_gqa_tied")
    sections = dict(model={"max_model_len": 128}, parallel={"tensor_parallel": 1}, sampling={"max_new_tokens": 8},
                    scheduler={"max_batch_size": 4, "max_batched_tokens": 256, "block_size": 16})
    for emulate in ("1", ""):
        monkeypatch.setenv("MSINFER_ASCEND_EMULATE", emulate)
        for model, refusal in (({"dtype": "float32"}, "model.dtype float32 does not run on Ascend's fused kernels"),
                               ({"shapes": "buckets"}, "model.shapes buckets does not run with Ascend's fused kernels"),
                               ({"graph_mode": False}, "model.graph_mode false does not run with Ascend's fused")):
            with pytest.raises(LayoutError, match=refusal):
                plan_job(ascend_spec(path, tmp_path, **{**sections, "model": {**sections["model"], **model}}),
                         check_io=False)
        card = plan_job(ascend_spec(path, tmp_path, **sections), check_io=False).engine.dtype
        assert card == ("float16" if emulate else "bfloat16")
        half = plan_job(ascend_spec(path, tmp_path, **{**sections, "model": {"max_model_len": 128, "dtype": "float16"}}),
                        check_io=False)
        assert half.engine.dtype == "float16" and not any("bfloat16" in n for n in half.notes)
        portable = {"max_model_len": 128, "ops": "portable", "dtype": "float32"}
        assert plan_job(ascend_spec(path, tmp_path, **{**sections, "model": portable}),
                        check_io=False).engine.dtype == "float32"


def test_the_kernel_self_check_settles_each_convention_and_the_tokens_stay(checkpoint, monkeypatch):
    """With stand-ins that read FlashAttentionScore's lengths as cumulative ends and apply no
    causal mask within a PagedAttention chunk (MSINFER_ASCEND_EMULATE_VARIANT fa_cumulative,
    pa_wrong), the start-up check picks cumulative lengths and replaces PagedAttention by the
    portable operators, and a workload with prefills, a chunk after cached tokens and decodes gives
    the plain emulation's logits; the same stand-ins without the check do not."""
    from msinfer.worker import ascend, kernel_check
    monkeypatch.setenv("MSINFER_CACHE", str(checkpoint("llama_gqa_tied").parent / "kernel-cache"))
    path = checkpoint("llama_gqa_tied")
    variants = ("fa_cumulative", "pa_wrong")

    def workload(runner):
        rec = Recording(runner)
        d = Driver(rec)
        d.prefill({4: PROMPTS[0], 5: PROMPTS[1]})
        runner.step([SeqStep(6, PROMPTS[2][:6], 0, d.table(6), sample=False)], True)
        rec.logits.append(runner.forward([SeqStep(6, PROMPTS[2][6:], 6, d.table(6))], True))   # a chunk
        d.decode()
        return rec.logits

    want = workload(runner_for(path, "ascend-emulated"))            # the stand-ins as documented
    checked = ModelRunner(EngineConfig(str(path), max_model_len=128, max_batch_size=8, device="ascend",
                                       emulate=True, dtype="float16", emulate_variants=variants))
    assert kernel_check.conventions(checked.kernel_check) == {
        "FlashAttentionScore": "cumulative", "PagedAttention": "portable", "ReshapeAndCache": "ok", "RmsNorm": "ok"}
    assert not checked.kernel_check["cached"]
    for a, b in zip(workload(checked), want):
        np.testing.assert_allclose(a, b, atol=ATOL["ascend-emulated"])
    trusted = runner_for(path, "ascend-emulated", emulate_variants=variants)     # no check: the variants as they are
    assert max(np.abs(a - b).max() for a, b in zip(workload(trusted), want)) > 10 * ATOL["ascend-emulated"]
    assert ascend.VARIANTS_IN_FORCE == variants


def test_a_job_runs_on_the_emulated_ascend_path_like_on_a_card(checkpoint, hf_greedy, tmp_path, monkeypatch,
                                                                ray_local):
    """run_job with parallel.device ascend and MSINFER_ASCEND_EMULATE=1: Ray places the worker on an
    (emulated) NPU, the step graphs are the Ascend path's, the results are transformers' (float16
    rounding aside), the summary names the kernel check's verdicts and the card's memory as the
    worker measured it (MSINFER_ASCEND_EMULATE_MEMORY_GB=8) beside the plan's figures. A 1 GiB card
    cannot hold the runtime's share: the job stops (exit 2's LaunchError) naming its memory."""
    import json
    from msinfer.launcher.job import run_job
    from msinfer.launcher.replica import LaunchError
    monkeypatch.setenv("MSINFER_ASCEND_EMULATE", "1")
    monkeypatch.setenv("MSINFER_ASCEND_EMULATE_MEMORY_GB", "8")
    name = "qwen2_qkv_bias"
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": p}) + "\n"
                                               for i, p in enumerate(PROMPTS)))
    spec = ascend_spec(checkpoint(name), tmp_path, model={"max_model_len": 128},
                       parallel={"tensor_parallel": 1},
                       sampling={"max_new_tokens": N_NEW, "ignore_eos": True},
                       scheduler={"max_batch_size": 4, "max_batched_tokens": 64, "block_size": 16})
    summary = run_job(spec, progress=False)
    results = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for i, prompt in enumerate(PROMPTS):
        assert_greedy_parity(f"prompt {i}", results[f"r{i}"]["output_token_ids"], None,
                             *hf_greedy(name, prompt, N_NEW), ATOL["ascend-emulated"])
    assert summary["replicas"][0]["device"] == "ascend:0"
    assert set(summary["steps"]["graphs"]) == {"replica 0 prefill", "replica 0 decode"}
    setup = summary["setup"][0]
    assert {k: v["convention"] for k, v in setup["kernel_check"].items() if isinstance(v, dict)} == {
        "FlashAttentionScore": "ok", "PagedAttention": "ok", "ReshapeAndCache": "ok", "RmsNorm": "ok"}
    memory = setup["memory"]
    assert memory["measured"] and memory["card_total"] == 8 * 1024 ** 3 and memory["plan"]["card_total"] == 64 * 1024 ** 3
    assert memory["kv_cache_allocated"] == memory["kv_cache"] and memory["weights_loaded"] > 0
    assert any("emulation computes it in float16" in n for n in summary["notes"])
    monkeypatch.setenv("MSINFER_ASCEND_EMULATE_MEMORY_GB", "1")
    with pytest.raises(LaunchError, match=r"does not fit the card's measured 1 GiB .* runtime 2.00 leave room for 0 "
                                          r"KV blocks"):
        run_job(spec, overwrite=True, progress=False)


@pytest.mark.unit
def test_a_kernel_verdict_is_kept_per_card_model(monkeypatch, tmp_path):
    """Two card models with one MindSpore and one CANN keep their own start-up check verdicts: the
    cache key names the model MindSpore's hal.get_device_name gives on a card (stood in for here,
    there is no card), nothing off a card, and nothing where the driver cannot say."""
    import mindspore as ms
    from msinfer.worker import ascend, kernel_check
    monkeypatch.setenv("MSINFER_CACHE", str(tmp_path))
    shapes = (4, 2, 16, 16, "float16")
    assert kernel_check.check_key(ascend.EmulatedAscendOps, *shapes)["card"] == ""          # the CPU
    real = ms.get_context
    monkeypatch.setattr(ms, "get_context", lambda key: {"device_target": "Ascend", "device_id": 3}.get(key) or real(key))
    asked = []

    def device_name(device_id, target=None):
        asked.append((device_id, target))
        if len(asked) == 4:
            raise RuntimeError("the driver does not say")
        return ["Ascend910B3", "Ascend910B3", "Ascend910B1"][len(asked) - 1]

    monkeypatch.setattr(ms.hal, "get_device_name", device_name)
    b3, again, b1, unknown = (kernel_check.check_key(ascend.EmulatedAscendOps, *shapes) for _ in range(4))
    assert asked[0] == (3, "Ascend") and (b3["card"], b1["card"], unknown["card"]) == ("Ascend910B3", "Ascend910B1", "")
    assert b3 == again and {k: v for k, v in b1.items() if k != "card"} == {k: v for k, v in b3.items() if k != "card"}
    kernel_check.store(b3, {"PagedAttention": {"convention": "portable"}})
    assert kernel_check.cache_path(b3).exists() and kernel_check.cache_path(again) == kernel_check.cache_path(b3)
    assert not kernel_check.cache_path(b1).exists() and not kernel_check.cache_path(unknown).exists()


@pytest.mark.unit
def test_a_card_gets_hccl_timeouts_from_the_fault_settings_and_a_users_variables_win():
    from msinfer.worker.device import apply_environment, card_environment
    env = card_environment(startup_timeout_s=900, step_timeout_s=600)
    assert env == {"HCCL_CONNECT_TIMEOUT": "900", "HCCL_EXEC_TIMEOUT": "600", "HCCL_OP_EXPANSION_MODE": "AIV",
                   "MS_ENABLE_LCCL": "off", "MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST": "FlashAttentionScore,PagedAttention"}
    assert card_environment(5, 10 ** 6)["HCCL_CONNECT_TIMEOUT"] == "120"          # within HCCL's ranges
    assert card_environment(5, 10 ** 6)["HCCL_EXEC_TIMEOUT"] == "17340"
    mine = {"HCCL_EXEC_TIMEOUT": "60"}
    assert apply_environment(env, mine) == {k: v for k, v in env.items() if k != "HCCL_EXEC_TIMEOUT"}
    assert mine["HCCL_EXEC_TIMEOUT"] == "60" and mine["MS_ENABLE_LCCL"] == "off"
