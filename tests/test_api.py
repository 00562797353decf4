"""The Python API: an LLM object keeps its workers across generate() calls and returns results in
prompt order, the same tokens transformers gives."""

import io

import numpy as np
import pytest

from msinfer.launcher.api import LLM
from msinfer.launcher.errors import InputError, SpecError
from msinfer.launcher.job import StreamPrinter
from msinfer.launcher.spec import SamplingSpec, validate
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
        # sampled: a call that sets no seed samples afresh (the job seed is the call's number),
        # one that sets a seed draws the same tokens every time
        hot = {"max_new_tokens": 8, "temperature": 2.0}
        calls = [[r["output_token_ids"] for r in llm.generate([PROMPTS[0]] * 2, s)]
                 for s in (hot, hot, {**hot, "seed": 5}, {**hot, "seed": 5}, {**hot, "seed": 2})]
        assert calls[0] != calls[1] and calls[2] == calls[3] and calls[4] == calls[0]
        assert calls[0][0] != calls[0][1]            # two records of one prompt in a call differ too
        # one record alone (as vLLM takes one prompt), token ids as a numpy array
        one = llm.generate({"prompt_token_ids": PROMPTS[1]}, {"max_new_tokens": 3})
        assert len(one) == 1 and one[0]["output_token_ids"] == hf_greedy(name, PROMPTS[1], 6)[0][:3]
        ids = llm.generate([np.array(PROMPTS[0], np.int32)], {"max_new_tokens": 3})
        assert ids[0]["error"] is None and ids[0]["output_token_ids"] == hf_greedy(name, PROMPTS[0], 6)[0][:3]
        with pytest.raises(InputError, match=r"prompt 1: expected text, .* got int 5; one prompt of token ids is a "
                                             r"list in the list"):
            llm.generate([5, 7])
    finally:
        llm.shutdown()
    llm.shutdown()
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        llm.generate([PROMPTS[0]])


@pytest.mark.unit
def test_api_errors_read_like_the_commands(checkpoint):
    """A bad argument names its spec key and what was expected, as `msinfer run` does for a YAML
    file, with pydantic's own text nowhere."""
    with pytest.raises(SpecError) as e:
        LLM(str(checkpoint("qwen2_qkv_bias")), tensor_parallel=0)
    assert str(e.value) == "LLM(...): parallel.tensor_parallel: expected an integer >= 1, got 0"
    with pytest.raises(SpecError) as e:
        validate(SamplingSpec, {"temprature": 0.5}, "generate(sampling=...)", "sampling")
    assert str(e.value) == "generate(sampling=...): sampling.temprature: unknown key; did you mean 'temperature'?"
    assert "pydantic" not in str(e.value)


@pytest.mark.unit
def test_streamed_text_comes_a_line_at_a_time_behind_each_records_id():
    out = io.StringIO()
    printer = StreamPrinter(out)
    printer.write("a", "Hello")
    printer.write("b[1]", "One\nTw")
    printer.write("a", " world\nand")
    assert out.getvalue() == "[b][1] One\n[a] Hello world\n"
    printer.write("b[0]", "x")
    printer.end("a")
    printer.end("b")
    printer.write("c", "left")
    printer.close()
    printer.write("d[x]", "not a sample's key\n")
    printer.close()
    assert out.getvalue().splitlines()[2:] == ["[a] and", "[b][1] Tw", "[b][0] x", "[c] left",
                                               "[d[x]] not a sample's key"]


def test_a_records_streamed_lines_are_its_text_each_out_by_the_time_its_result_is(checkpoint, ray_local, capsys):
    """generate(stream=True): every record's text comes out on stderr whole, a line at a time
    behind its id, and a record that finishes first is printed in full before the call returns
    (its last line does not wait for the job's end, nor come split off)."""
    prompts = [{"prompt": "hello world", "sampling": {"max_new_tokens": 3}},
               {"prompt": "the capital of France is", "sampling": {"max_new_tokens": 40}}]
    with LLM(str(checkpoint("qwen2_tied_5_layers")), max_model_len=128, device="cpu", chat_template=False) as llm:
        printed = []
        real_end = StreamPrinter.end

        def end(self, record_id):       # what is out on stderr when each record's result comes
            real_end(self, record_id)
            printed.append((record_id, capsys.readouterr().err))
        StreamPrinter.end = end
        try:
            results = llm.generate(prompts, {"ignore_eos": True}, stream=True)
        finally:
            StreamPrinter.end = real_end
    assert [r["id"] for r in results] == ["0", "1"] and printed[0][0] == "0"
    err = "".join(text for _, text in printed) + capsys.readouterr().err
    for r in results:
        lines = [line[len(f"[{r['id']}] "):] for line in err.splitlines() if line.startswith(f"[{r['id']}] ")]
        assert "\n".join(lines) == r["output_text"].rstrip("\n"), (r["id"], lines, r["output_text"])
    first = [line for line in printed[0][1].splitlines() if line.startswith("[0] ")]
    assert "\n".join(line[4:] for line in first) == results[0]["output_text"].rstrip("\n")


@pytest.mark.unit
def test_the_embedded_ray_stops_with_the_last_llm_that_uses_it_not_the_first(checkpoint, monkeypatch):
    """Two LLMs in one process share the embedded Ray the first started: shutting that one down
    leaves Ray up for the other (whose calls failed in Ray's internals), and the last one stops it."""
    import ray

    import msinfer.launcher.api as api
    import msinfer.launcher.replica as replica

    class Controller:
        def shutdown(self):
            pass

    started, stopped = [True, False], []
    monkeypatch.setattr(api, "start_controller", lambda plan: (Controller(), started.pop(0)))
    monkeypatch.setattr(replica, "shutdown_ray", lambda: stopped.append(True))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    a, b = (LLM(str(checkpoint("qwen2_qkv_bias")), max_model_len=128, device="cpu") for _ in range(2))
    a.shutdown()
    assert stopped == [] and b.controller is not None
    b.shutdown()
    b.shutdown()
    assert stopped == [True] and (LLM._live, LLM._ray_ours) == (0, False)
