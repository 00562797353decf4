"""The job's tail with one slow replica: `msinfer simulate`'s stand-ins at dp N, one of them
`--slow` times slower (a card slowed by heat, a node shared with another job), with the driver
handing the slow replica's queued records to idle replicas at the tail (launcher.controller,
"The tail") and without. Alternating rounds; each round's generation seconds and the records
moved.

    python scripts/measure_tail.py [--dp 4] [--records 400] [--batch 8] [--step-ms 10] [--slow 4]
                                   [--new 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msinfer.launcher import job as job_module  # noqa: E402
from msinfer.launcher.simulate import StandIn, StandInWorker  # noqa: E402


class SlowOne(StandInWorker):
    """The first stand-in rank of a run to step is `factor` times slower (`flag`: the file it claims;
    both are set before the run, and the class goes to the workers by value)."""
    flag, factor = "", 1.0

    def step(self, payload, is_prefill, index):
        if index == 0:
            try:
                os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
                self.timing = self.runner.timing = StandIn(step_ms=self.factor * self.timing.step_ms)
            except FileExistsError:
                pass
        return super().step(payload, is_prefill, index)


def one_run(spec_data: dict, step_ms: float, slow: float, rebalance: bool, folder: Path) -> dict:
    from msinfer.launcher.spec import JobSpec
    SlowOne.flag, SlowOne.factor = str(folder / f"slow-{os.urandom(4).hex()}"), slow
    start = job_module.start_controller

    def started(*args, **kwargs):
        controller, started_ray = start(*args, **kwargs)
        controller.rebalance = rebalance
        return controller, started_ray

    job_module.start_controller = started
    try:
        summary = job_module.run_job(JobSpec.model_validate(spec_data), overwrite=True, progress=False,
                                     simulate=StandIn(step_ms=step_ms, worker_cls=SlowOne))
    finally:
        job_module.start_controller = start
    return {"generation_s": summary["generation_s"], "moved": summary["records_rebalanced"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--slow", type=float, default=4.0)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import ray
    from ray import cloudpickle
    from msinfer.launcher.replica import shutdown_ray
    from scripts.make_demo_model import ensure_demo_model
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "in.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [20 + i % 900, 7, 8]})
                                                 + "\n" for i in range(args.records)))
        spec = {"model": {"path": str(ensure_demo_model()), "max_model_len": 256},
                "parallel": {"data_parallel": args.dp},
                "input": {"path": str(folder / "in.jsonl"), "chat_template": False, "order": "arrival"},
                "output": {"path": str(folder / "out.jsonl")},
                "sampling": {"max_new_tokens": args.new, "ignore_eos": True},
                "scheduler": {"max_batch_size": args.batch, "prefix_caching": False}}
        rounds: dict[bool, list[dict]] = {True: [], False: []}
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        try:
            for r in range(args.rounds):
                for rebalance in ((True, False) if r % 2 == 0 else (False, True)):
                    got = one_run(spec, args.step_ms, args.slow, rebalance, folder)
                    rounds[rebalance].append(got)
                    print(f"round {r + 1}, {'rebalanced' if rebalance else 'as dealt  '}: "
                          f"{got['generation_s']:.2f} s, {got['moved']} records moved", flush=True)
        finally:
            shutdown_ray()
    for rebalance in (True, False):
        times = [x["generation_s"] for x in rounds[rebalance]]
        print(f"{'rebalanced' if rebalance else 'as dealt'}: median {statistics.median(times):.2f} s "
              f"({', '.join(f'{t:.2f}' for t in times)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
