"""Position schemes (worker/positions.py): the engine computes positions on prefill and on every
decode step from the scheme in the spec; `rope2d` turns a share of the rotary frequency pairs
with a branch id and the rest with a time id.

The ratio > 0 reference is transformers' own Llama network with its rotary embedding swapped for
one that returns cos/sin of angles computed here in NumPy from the scheme's definition (branch
pairs written out literally, not taken from the engine): it checks the whole model's logits, so
a wrong angle, a wrong pair layout or a wrong decode position anywhere shows."""

from __future__ import annotations

import numpy as np
import pytest

from msinfer.sharding.config import EngineConfig, ModelConfig
from tests.conftest import PROMPTS
from tests.engine_driver import Driver
from tests.test_parity import LOGIT_ATOL, Recording, runner_for
from msinfer.worker.positions import Rope2DPositions, RopePositions, make_scheme
from msinfer.worker.protocol import SeqStep
from msinfer.worker.runner import ModelRunner

NAME = "llama_gqa_tied"        # head_dim 16: 8 rotary frequency pairs
RATIO = 0.25
BRANCH_PAIRS = [3, 7]          # every 4th of the 8 pairs, ending at the lowest frequency
N_NEW = 8


# ---- tier 1: the schemes --------------------------------------------------------------------------

def test_rope2d_spreads_the_branch_pairs_evenly_over_the_frequencies():
    assert Rope2DPositions(0.0).branch_pairs(8).tolist() == []
    assert Rope2DPositions(0.25).branch_pairs(8).tolist() == BRANCH_PAIRS
    assert Rope2DPositions(0.5).branch_pairs(8).tolist() == [1, 3, 5, 7]
    assert Rope2DPositions(0.3).branch_pairs(10).tolist() == [2, 5, 9]          # 3 of 10: as even as it gets
    assert Rope2DPositions(1.0).branch_pairs(8).tolist() == list(range(8))


def test_rope2d_angles_turn_branch_pairs_with_the_branch_id_and_the_rest_with_the_time_id(checkpoint):
    cfg = ModelConfig.from_dir(checkpoint(NAME))
    scheme, inv = Rope2DPositions(RATIO), cfg.inv_freq()
    comps = scheme.components(5, 3, branch=2)                         # tokens 5, 6, 7 of branch 2
    assert comps.tolist() == [[2, 5], [2, 6], [2, 7]]
    angles = comps @ scheme.freq_matrix(cfg)
    for row, t in zip(angles, (5, 6, 7)):
        expected = np.float32(t) * inv
        expected[BRANCH_PAIRS] = np.float32(2) * inv[BRANCH_PAIRS]
        np.testing.assert_array_equal(row, expected)
    # a plain prompt: branch 0, time = position; with ratio 0, exactly RoPE's angles
    plain = Rope2DPositions(0.0)
    np.testing.assert_array_equal(plain.components(0, 4) @ plain.freq_matrix(cfg),
                                  RopePositions().components(0, 4) @ RopePositions().freq_matrix(cfg))


def test_make_scheme_names_the_problem():
    assert isinstance(make_scheme("rope2d", ratio=0.5), Rope2DPositions)
    with pytest.raises(ValueError, match="scheme 'alibi' is unknown; choose one of rope, rope2d"):
        make_scheme("alibi")
    with pytest.raises(ValueError, match="scheme 'rope' does not take option"):
        make_scheme("rope", ratio=0.5)
    with pytest.raises(ValueError, match="ratio must be within"):
        make_scheme("rope2d", ratio=1.5)


def test_the_spec_chooses_the_scheme_and_plan_carries_it_to_the_engine(checkpoint, tmp_path):
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.job import plan_job
    from msinfer.launcher.spec import load_spec
    job = tmp_path / "job.yaml"
    job.write_text(f"model:\n  path: {checkpoint(NAME)}\n  positions: {{scheme: rope2d, ratio: {RATIO}}}\n"
                   f"input: {{path: in.jsonl}}\noutput: {{path: out.jsonl}}\n")
    plan = plan_job(load_spec(job), check_io=False)
    assert (plan.engine.position_scheme, plan.engine.position_options) == ("rope2d", {"ratio": RATIO})
    assert "positions rope2d: 2 of 8 rotary frequency pairs carry the branch id" in plan.describe()
    with pytest.raises(SpecError, match="model.positions: ratio 0.5 applies to scheme rope2d only"):
        load_spec(job, ["model.positions.scheme=rope", "model.positions.ratio=0.5"])


# ---- tier 2: the engine ------------------------------------------------------------------------------

_RUNS: dict = {}


def rope2d_run(path, ratio):
    """(runner, {prompt index: generated tokens}, recorded logits per step) of a greedy run of PROMPTS."""
    if ratio not in _RUNS:
        runner = ModelRunner(EngineConfig(str(path), max_model_len=128, max_batch_size=8, position_scheme="rope2d",
                                          position_options={"ratio": ratio}))
        rec = Recording(runner)
        out = Driver(rec).generate(dict(enumerate(PROMPTS)), N_NEW)
        _RUNS[ratio] = runner, out, rec.logits
    return _RUNS[ratio]


def test_rope2d_with_ratio_0_gives_exactly_the_default_schemes_logits(checkpoint):
    rec = Recording(runner_for(checkpoint(NAME)))
    default = Driver(rec).generate(dict(enumerate(PROMPTS)), N_NEW)
    _, out, logits = rope2d_run(checkpoint(NAME), 0.0)
    assert out == default
    for step, (a, b) in enumerate(zip(logits, rec.logits)):
        assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"


def reference_logits(path, tokens: list[int], ratio_pairs: list[int]) -> np.ndarray:
    """transformers' network over `tokens` (one prefill), its rotary angles replaced by this
    file's NumPy angles: branch 0 on the branch pairs, the position on the others."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    inv = ModelConfig.from_dir(path).inv_freq()

    def rotary(x, position_ids):
        pos = position_ids[0].numpy().astype(np.float32)
        angles = pos[:, None] * inv[None, :]
        angles[:, ratio_pairs] = np.float32(0) * inv[ratio_pairs]     # branch id 0
        emb = torch.from_numpy(np.concatenate([angles, angles], -1))[None]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    model.model.rotary_emb.forward = rotary
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def test_rope2d_prefill_and_decode_equal_a_reference_with_the_same_angles(checkpoint):
    path = checkpoint(NAME)
    _, out, logits = rope2d_run(path, RATIO)
    for i, prompt in enumerate(PROMPTS):
        ref = reference_logits(path, prompt + out[i][:-1], BRANCH_PAIRS)
        for step in range(N_NEW):                           # step 0: the prefill; then each decode step
            diff = np.abs(logits[step][i] - ref[len(prompt) - 1 + step]).max()
            assert diff < LOGIT_ATOL, f"prompt {i} step {step}: max |logit diff| {diff}"
    # and the scheme matters: plain RoPE's logits differ
    _, _, plain = rope2d_run(path, 0.0)
    assert np.abs(plain[0][0] - logits[0][0]).max() > 1e-2


def test_rope2d_decoded_step_by_step_equals_one_prefill_of_the_same_tokens(checkpoint):
    import mindspore as ms
    runner, out, logits = rope2d_run(checkpoint(NAME), RATIO)
    prompt = PROMPTS[0]
    tokens = prompt + out[0][:-1]
    from msinfer.worker.model import STEP_INPUTS
    inputs, _ = runner.prepare([SeqStep(7, tokens, 0, list(range(56, 64)))], True)
    inputs["out_index"] = ms.Tensor(np.arange(len(tokens), dtype=np.int32))    # one sequence: row j is position j
    once = runner.step_fn(*(inputs[name] for name in STEP_INPUTS))[0].asnumpy()
    for step in range(N_NEW):
        diff = np.abs(once[len(prompt) - 1 + step] - logits[step][0]).max()
        assert diff < 1e-4, f"step {step}: max |logit diff| {diff}"
