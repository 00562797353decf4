"""Not part of `make test` (pytest collects test_*.py): a loop that deals random subsets of
tests/test_pipeline.py's mixed records (greedy, shared prefixes, n = 2 sampled with a penalty,
log-probabilities, prompt log-probabilities, structured outputs) through one replica of
2 stages x tp 2, a new engine each time on the same workers, RUNS times. Its scoring steps
gather over the last stage's group in more than one chain; a graph that lets MindSpore's
runtime run them in either order fails the loop within some tens of runs with a core kept busy
(`yes > /dev/null &`), with the node group's "the ranks reached different collectives"
(sharding.layers.in_turn).

    .venv/bin/python -m pytest -p no:xdist -q -s tests/stress_pipeline.py
"""

from __future__ import annotations

import json
import random
import time

from msinfer.launcher.job import plan_job
from tests.conftest import PROMPTS
from tests.engine_driver import run_engine
from tests.test_pipeline import spec_for

RUNS = 600


def test_random_subsets_of_mixed_records_through_two_stages_of_tp2(checkpoint, tmp_path, ray_local):
    from msinfer.launcher.replica import Replica, ReplicaConfig
    path = checkpoint("qwen2_tied_5_layers")
    shared = [(5 * j) % 200 + 3 for j in range(16)]
    records = ([{"id": f"g{i}", "prompt_token_ids": p} for i, p in enumerate(PROMPTS)]
               + [{"id": f"c{i}", "prompt_token_ids": shared + [40 + i]} for i in range(3)]
               + [{"id": "n2", "prompt_token_ids": PROMPTS[0],
                   "sampling": {"n": 2, "temperature": 0.8, "seed": 3, "logprobs": 2, "presence_penalty": 0.5}},
                  {"id": "lp", "prompt_token_ids": PROMPTS[2], "sampling": {"logprobs": 2, "prompt_logprobs": 1}},
                  {"id": "regex", "prompt": "hello", "sampling": {"structured_outputs": {"regex": "[a-z]{3} [0-9]{2}"}}},
                  {"id": "choice", "prompt": "be brief", "sampling": {"structured_outputs": {
                      "choice": ["hello world", "stop here please"]}}}])
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plan = plan_job(spec_for(path, tmp_path, tensor_parallel=2, pipeline_parallel=2), check_io=False)
    replica = Replica(0, ReplicaConfig(2))
    replica.start(plan.engine)
    rng = random.Random(1)
    engine = None
    try:
        for run in range(RUNS):
            dealt = rng.sample(records, rng.randint(3, len(records)))
            t0 = time.perf_counter()
            _, engine = run_engine(plan, dealt, replica.workers, after=engine)
            print(f"run {run}: {len(dealt)} records in {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        replica.shutdown()
