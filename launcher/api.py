"""The Python API, for notebooks and scripts:

    from msinfer.launcher.api import LLM, run_job
    llm = LLM("~/models/Qwen3-0.6B", tensor_parallel=2)
    results = llm.generate(["What is the capital of France?"], {"max_new_tokens": 32})
    llm.shutdown()

    summary = run_job("job.yaml", overrides=["sampling.temperature=0.7"])

`LLM` keeps its workers between `generate` calls; results come back in prompt order, each the
same dict as a line of the results file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from msinfer.launcher.errors import InputError, SpecError
from msinfer.launcher.inputs import parse_record
from msinfer.launcher.job import StreamPrinter, plan_job, run_job as _run_job, start_controller
from msinfer.launcher.spec import JobSpec, SamplingSpec, load_spec, validate


def run_job(spec: str | Path | JobSpec, overrides: list[str] | tuple[str, ...] = (), **kwargs) -> dict:
    """`msinfer run` as a function: a spec file (with --set style overrides) or a JobSpec."""
    if not isinstance(spec, JobSpec):
        spec = load_spec(spec, overrides)
    return _run_job(spec, **kwargs)


class LLM:
    # the LLMs of this process not shut down, and whether one of them started the embedded Ray
    # they all use: the last to shut down stops it (a user's own ray.init is theirs to stop)
    _live = 0
    _ray_ours = False

    def __init__(self, model: str, *, tensor_parallel: int = 1, data_parallel: int = 1, dtype: str = "auto",
                 max_model_len: int | None = None, device: str = "auto", chat_template: bool | str = True,
                 max_batch_size: int = 32, ray_address: str | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, task: str = "generate", pooling: dict | None = None,
                 **model_options):
        """task embed (with `pooling`: the spec's pooling section) serves `embed`, task classify
        `classify`; the others `generate`."""
        spec = validate(JobSpec, {
            "task": task, **({"pooling": pooling} if pooling is not None else {}),
            "model": {"path": str(model), "dtype": dtype, "max_model_len": max_model_len, **model_options},
            "parallel": {"tensor_parallel": tensor_parallel, "data_parallel": data_parallel, "device": device},
            "input": {"path": "in-memory.jsonl", "chat_template": chat_template},
            "output": {"path": "in-memory-results.jsonl", "reasoning_parser": reasoning_parser,
                       "tool_call_parser": tool_call_parser},
            "scheduler": {"max_batch_size": max_batch_size},
            "ray": {"address": ray_address},
        }, "LLM(...)")
        self.plan = plan_job(spec, check_io=False)
        self.controller, started_ray = start_controller(self.plan)
        LLM._live += 1
        LLM._ray_ours = LLM._ray_ours or started_ray
        self.calls = 0              # generate() calls so far: the job seed of a call that sets none

    def generate(self, prompts: list, sampling: dict | SamplingSpec | None = None, stream: bool = False) -> list[dict]:
        """prompts: text, chat messages (a list of {role, content}) or token ids (a list or numpy
        array of integers), or whole records ({"prompt": ..., "sampling": {...}}); or one text or
        record alone. Returns one result dict per prompt, in order.
        Records are numbered from 0 in each call, and a record's random stream is keyed by the
        job's seed and its id (docs/spec.md, "Random streams"): a call whose sampling sets no
        seed takes the call's number (0 for the first) as the job's seed, so that calling again
        samples afresh, as vLLM's LLM does, and a process making the same calls gets the same
        tokens; a call that sets one gets the same tokens each time."""
        task = self.plan.spec.task
        if task in ("embed", "classify"):
            raise SpecError(f"LLM(task='{task}') generates nothing: call {task}(prompts)")
        return self._run(prompts, sampling, stream)

    def embed(self, prompts: list) -> list[dict]:
        """prompts as generate's (text as written: no chat template; messages through it). Returns
        one result dict per prompt, in order, each with its `embedding` (launcher.embed)."""
        return self._pooled("embed", prompts)

    def classify(self, prompts: list) -> list[dict]:
        """As `embed`, for task classify: each result with its `label`, `logits` and `probs`."""
        return self._pooled("classify", prompts)

    def _pooled(self, task: str, prompts: list) -> list[dict]:
        if self.plan.spec.task != task:
            raise SpecError(f"{task}() needs LLM(..., task='{task}'); this LLM's task is {self.plan.spec.task}")
        return self._run(prompts, None, False)

    def _run(self, prompts: list, sampling, stream: bool) -> list[dict]:
        if self.controller is None:
            raise RuntimeError("this LLM was shut down (shutdown(), or the end of its with block); make a new LLM")
        if isinstance(prompts, (str, dict)):            # one prompt, as vLLM's LLM takes it
            prompts = [prompts]
        records = [parse_record({**as_record(p, i + 1), "id": str(i)}, i + 1, "prompt") for i, p in enumerate(prompts)]
        defaults = (sampling if isinstance(sampling, SamplingSpec) else
                    validate(SamplingSpec, sampling or {}, "generate(sampling=...)", "sampling"))
        if self.plan.spec.model.generation_config == "auto":
            defaults, _ = defaults.with_model_defaults(self.plan.model.generation_sampling,
                                                       "the model's generation_config.json")
        if "seed" not in defaults.model_fields_set:
            defaults = defaults.model_copy(update={"seed": self.calls})
        self.calls += 1
        self.controller.configure(self.plan.spec.model_copy(update={"sampling": defaults}), stream)
        results: dict[str, dict] = {}
        printer = StreamPrinter(sys.stderr) if stream else None
        def on_done(done, rec) -> None:
            results[rec.id] = json.loads(done.line)
            if printer is not None:
                printer.end(rec.id)

        self.controller.run(iter(records), on_done, printer.write if printer else None)
        if printer is not None:
            printer.close()
        return [results[str(i)] for i in range(len(prompts))]

    def shutdown(self) -> None:
        import ray
        if self.controller is None:
            return
        self.controller.shutdown()
        self.controller = None
        LLM._live -= 1
        if LLM._live == 0 and LLM._ray_ours and ray.is_initialized():    # (the last of them)
            from msinfer.launcher.replica import shutdown_ray
            shutdown_ray()
            LLM._ray_ours = False

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def as_record(p, n: int) -> dict:
    """Prompt `n` (from 1) of a generate() call as a record: a record itself, text, chat messages
    or token ids (a list, tuple or numpy array)."""
    if hasattr(p, "tolist"):                        # numpy: its values as Python's
        p = p.tolist()
    if isinstance(p, dict):
        return p
    if isinstance(p, str):
        return {"prompt": p}
    if isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
        return {"messages": list(p)}
    if isinstance(p, (list, tuple)):
        return {"prompt_token_ids": list(p)}
    hint = "; one prompt of token ids is a list in the list, [[1, 2, 3]]" if isinstance(p, int) else ""
    raise InputError(f"prompt {n}: expected text, chat messages (a list of {{role, content}}), token ids (a list of "
                     f"integers) or a record (a dict), got {type(p).__name__} {p!r:.40}{hint}")
