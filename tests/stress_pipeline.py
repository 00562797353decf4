"""Not part of `make test` (pytest collects test_*.py): a loop that deals random subsets of
tests/test_pipeline.py's mixed records (`mixed_records`) through one replica of
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
from tests.engine_driver import run_engine
from tests.test_pipeline import mixed_records, spec_for

RUNS = 600


def test_random_subsets_of_mixed_records_through_two_stages_of_tp2(checkpoint, tmp_path, ray_local):
    from msinfer.launcher.replica import Replica, ReplicaConfig
    path = checkpoint("qwen2_tied_5_layers")
    records = mixed_records()
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
