"""Issue 3's figures for the demo model, side by side in one run: each rank's peak resident memory
after loading its shard, time from start to all ranks ready, and the decode step time at tp 1 and
tp 3 as one synchronous call sees it, with the share spent outside the model. Worker and model
times are rank 0's, as each step reports them (StepOutput.worker_s, .model_s): the network includes
its collectives; the worker adds step inputs and sampling; the driver adds Ray.

Then issue 7's: decode steps of a batch as the job runs them, through the controller (scheduler,
Ray calls, postprocessing), with async scheduling off and on, alternating on the same workers:
the wall time a step accounts for against rank 0's time in the network.

    .venv/bin/python scripts/measure_tp.py [--batch 16] [--steps 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from msinfer.launcher.inputs import Record  # noqa: E402
from msinfer.launcher.job import make_controller, plan_job  # noqa: E402
from msinfer.launcher.replica import Replica, ReplicaConfig, init_ray, shutdown_ray  # noqa: E402
from msinfer.launcher.spec import JobSpec  # noqa: E402
from scripts.make_demo_model import ensure_demo_model  # noqa: E402
from msinfer.worker.protocol import SeqStep  # noqa: E402
from msinfer.sharding.config import EngineConfig  # noqa: E402


def measure(path: Path, tp: int, batch: int, steps: int) -> dict:
    t0 = time.perf_counter()
    r = Replica(0, ReplicaConfig(tp))
    r.start(EngineConfig(str(path), max_model_len=256, max_batch_size=batch, threads=max(1, 2 // tp)))
    ready_s = time.perf_counter() - t0
    try:
        per = 256 // 16
        tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
        prompt = list(range(100, 132))
        r.step([SeqStep(i, prompt, 0, tables[i]) for i in range(batch)], True)
        driver, inside, model = [], [], []
        for s in range(steps):
            seqs = [SeqStep(i, [200 + s], 32 + s, tables[i], num_generated=s + 1) for i in range(batch)]
            t = time.perf_counter()
            out = r.step(seqs, False)
            driver.append(time.perf_counter() - t)
            inside.append(out.worker_s)
            model.append(out.model_s)
        skip = 2                                  # the first steps compile
        d, i, m = (statistics.median(x[skip:]) for x in (driver, inside, model))
        return {"tp": tp, "ready_s": ready_s,
                "peak_rss_mib": [round(x["peak_rss_bytes"] / 2**20) for x in r.setup_info],
                "param_mib": [round(x["param_bytes"] / 2**20) for x in r.setup_info],
                "step_ms": d * 1e3, "worker_step_ms": i * 1e3, "model_ms": m * 1e3}
    finally:
        r.shutdown()


def through_controller(path: Path, tp: int, batch: int, steps: int, rounds: int) -> list[dict]:
    """Decode figures per run of `batch` prompts (17-47 tokens) generating steps + 1 tokens each,
    through a job's driver and engine, async scheduling off and on in turn, after a run that
    compiles."""
    spec = JobSpec.model_validate({
        "model": {"path": str(path), "max_model_len": 256}, "parallel": {"tensor_parallel": tp},
        "input": {"path": "unused.jsonl"}, "output": {"path": "unused.jsonl"},
        "scheduler": {"max_batch_size": batch}, "sampling": {"max_new_tokens": steps + 1, "ignore_eos": True}})
    c = make_controller(plan_job(spec, check_io=False))
    c.start()
    try:
        def run(async_scheduling: bool) -> dict:
            c.configure(spec.model_copy(update={"scheduler": spec.scheduler.model_copy(
                update={"async_scheduling": async_scheduling})}))
            before = c.step_stats()
            records = [Record(str(i), i, prompt_token_ids=list(range(100 + i, 117 + 2 * i))) for i in range(batch)]
            c.run(iter(records), lambda done, rec: None)
            after = c.step_stats()
            n = after["decode_steps"] - before["decode_steps"]
            per = {k: (after[f"decode_{k}"] - before[f"decode_{k}"]) / n * 1e3 for k in ("s", "worker_s", "model_s")}
            return {"tp": tp, "async": async_scheduling, "steps": n, "step_ms": per["s"],
                    "worker_step_ms": per["worker_s"], "model_ms": per["model_s"]}
        run(True)
        return [run(a) for _ in range(rounds) for a in (False, True)]
    finally:
        c.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="of async scheduling off, then on")
    args = ap.parse_args()
    path = ensure_demo_model()
    init_ray(None, 4)
    rows = [measure(path, tp, args.batch, args.steps) for tp in (1, 3)]
    print(f"demo model, decode batch {args.batch}, context ~40 tokens, float32, CPU")
    print(f"{'tp':>3} {'ready s':>8} {'peak RSS MiB/rank':>20} {'params MiB/rank':>16} {'step ms':>8} "
          f"{'worker ms':>10} {'model ms':>9} {'outside model':>14}")
    for x in rows:
        outside = 1 - x["model_ms"] / x["step_ms"]
        print(f"{x['tp']:>3} {x['ready_s']:>8.1f} {str(x['peak_rss_mib']):>20} {str(x['param_mib']):>16} "
              f"{x['step_ms']:>8.1f} {x['worker_step_ms']:>10.1f} {x['model_ms']:>9.1f} {outside:>13.0%}")
    runs = [x for tp in (1, 3) for x in through_controller(path, tp, args.batch, args.steps, args.rounds)]
    print(f"\nthe same decode batch through the controller ({args.steps} decode steps a run), per step:")
    print(f"{'tp':>3} {'async':>6} {'step ms':>8} {'worker ms':>10} {'model ms':>9} {'outside model':>14}")
    for x in runs:
        outside = 1 - x["model_ms"] / x["step_ms"]
        print(f"{x['tp']:>3} {'on' if x['async'] else 'off':>6} {x['step_ms']:>8.1f} {x['worker_step_ms']:>10.1f} "
              f"{x['model_ms']:>9.1f} {outside:>13.0%}")
    shutdown_ray()


if __name__ == "__main__":
    main()
