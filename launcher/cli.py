"""`msinfer run job.yaml`, `msinfer plan job.yaml`, `msinfer simulate job.yaml`, `msinfer bench ...`.

User errors (spec, model folder, input, output, launch) print one paragraph and exit non-zero,
with no traceback; a job that completed exits 0 even when some records failed (they are counted
in the summary). A run stopped early by SIGTERM, SIGUSR1 or a deadline (launcher.drain) exits
EXIT_DRAINED; the exit codes are in launcher.errors and the README."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import textwrap
import threading
import time

from msinfer.launcher.drain import SIGNALS
from msinfer.launcher.errors import (EXIT_DRAINED, EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_TERMINATED,
                                     EXIT_USER_ERROR, Terminated)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="msinfer", description="Batch inference of Hugging Face LLMs on MindSpore, "
                                "one worker per card, driven by Ray.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("run", "run a job: one result line per input record"),
                        ("plan", "check a job spec, the model and the files, print the layout; start nothing"),
                        ("check-device", "run the Ascend kernel self-check at the job's shapes and print what "
                                         "each fused kernel does on this card"),
                        ("simulate", "run a job on stand-in workers that take --step-ms a step and load no "
                                     "weights: what the driver sustains at the job's dp x tp"),
                        ("merge", "check that the input.shard jobs' results files hold every record once, and "
                                  "write them as one file at output.path")):
        c = sub.add_parser(name, help=help_)
        c.add_argument("spec", help="the YAML job spec")
        c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a spec key, e.g. --set parallel.tensor_parallel=2 (repeatable)")
        if name in ("run", "simulate"):
            c.add_argument("--overwrite", action="store_true", help="start the results file afresh (no resume)")
            c.add_argument("--stream", action="store_true",
                           help="print each record's text as it is generated, line by line behind its id, on stderr")
            c.add_argument("--no-progress", action="store_true", help="no progress bar")
            c.add_argument("--redo-changed", action="store_true",
                           help="compute again the records whose input changed since their result line was "
                                "written (without it such a re-run stops, naming them)")
        if name == "run":
            c.add_argument("--retry-failed", action="store_true",
                           help="compute again the records whose result line is an error (the file keeps one "
                                "line per id)")
        if name == "simulate":
            c.add_argument("--output", metavar="PATH",
                           help="the stand-ins' results file (default <output.path>.simulate.jsonl; the job's "
                                "own results are never touched)")
            c.add_argument("--step-ms", type=float, default=20.0, help="a stand-in step's milliseconds (default 20); with pipeline stages, "
                           "each stage's call takes its 1/stages share")
            c.add_argument("--prefill-ms-per-token", type=float, default=0.0,
                           help="and milliseconds per token a prefill step feeds (default 0)")
    from msinfer.launcher.bench import add_bench_parser
    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """The `msinfer` command; `own_process`: the command's own process (entry), whose transformers
    may be told that torch is absent (worker.imports.own_process)."""
    t_start = time.perf_counter()
    args = _parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread() and args.command in ("run", "simulate", "bench"):
        SIGNALS.install()           # the commands that run for long (the others end as signals end processes)
    os.environ.setdefault("GLOG_v", "3")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")     # "PyTorch was not found": no torch is needed
    from msinfer.launcher.errors import SpecError
    from msinfer.launcher.spec import load_spec

    spec = None
    if args.command != "bench":
        try:               # before the modules below (transformers, Ray: ~1.5 s), so a bad spec fails at once
            spec = load_spec(args.spec, args.overrides)
        except SpecError as e:
            _say(str(e))
            return EXIT_USER_ERROR
    if own_process:                 # transformers without torch, once a tokenizer needs it
        from msinfer.worker.imports import own_process as mark
        mark()
    from msinfer.launcher.errors import JobFailed, LaunchError, StartupTimeout
    from msinfer.launcher.job import USER_ERRORS, plan_job, resume_summary, run_job
    from msinfer.launcher.shards import for_shard

    try:
        if args.command == "bench":
            from msinfer.launcher.bench import run_bench
            return run_bench(args)
        if args.command == "plan":
            plan = plan_job(spec, sizing=True)
            resume = resume_summary(plan)
            print(plan.describe() + (f"\nresults     {resume}" if resume else ""))
            return 0
        if args.command == "merge":
            print(json.dumps(merge_job(spec)))
            return 0
        if args.command == "check-device":
            plan = plan_job(spec, check_io=False)
            if plan.device != "ascend" or spec.model.ops != "auto":
                raise SpecError(f"check-device checks Ascend's fused kernels; this job runs "
                                f"{'portable operators' if spec.model.ops == 'portable' else 'on ' + plan.device} "
                                f"(parallel.device {spec.parallel.device}, model.ops {spec.model.ops})")
            from msinfer.worker.kernel_check import check_device
            try:
                _, table = check_device(plan.engine, plan.model, spec.parallel.tensor_parallel)
            except RuntimeError as e:
                raise LaunchError(f"check-device: MindSpore cannot use an Ascend device in this process "
                                  f"({(str(e).strip().splitlines() or [type(e).__name__])[0]}); on a machine "
                                  f"without NPUs, MSINFER_ASCEND_EMULATE=1 checks the emulated kernels") from None
            print(table)
            return 0
        simulate = None
        if args.command == "simulate":
            from msinfer.launcher.simulate import StandIn, simulate_output
            if args.step_ms <= 0 or args.prefill_ms_per_token < 0:
                raise SpecError(f"--step-ms must be > 0 and --prefill-ms-per-token >= 0, got {args.step_ms:g} "
                                f"and {args.prefill_ms_per_token:g}")
            simulate = StandIn(args.step_ms, args.prefill_ms_per_token)
            spec = simulate_output(spec, args.output)
            print(f"msinfer simulate: stand-in results go to {for_shard(spec).output.path}", file=sys.stderr)
        summary = run_job(spec, overwrite=args.overwrite, stream=args.stream, progress=not args.no_progress,
                          t_start=t_start, simulate=simulate, retry_failed=getattr(args, "retry_failed", False),
                          redo_changed=getattr(args, "redo_changed", False))
        print_summary(summary, spec.task)
        if summary.get("records_cut") and simulate is None:
            _say(cut_note(summary), prefix="msinfer: ")
        again = "running the same job again" + (" (without --overwrite, which starts over)"
                                                if getattr(args, "overwrite", False) else "")
        results = for_shard(spec).output.path       # (this task's shard's file, where input.shard is set)
        sets = "".join(f" --set {shlex.quote(o)}" for o in args.overrides)
        drained = summary.get("drained")
        if drained:
            lost = []
            if drained["records_in_flight_abandoned"]:
                lost.append(f"{drained['records_in_flight_abandoned']} record(s) in flight given up")
            if drained["records_not_dealt"]:
                lost.append(f"{'at least ' if drained.get('records_not_dealt_at_least') else ''}"
                            f"{drained['records_not_dealt']} record(s) not started")
            _say(f"drained ({drained['why']}){': ' + ' and '.join(lost) if lost else ''}; every finished record is in "
                 f"{results}, and {again} resumes after them", prefix="msinfer: ")
            return EXIT_DRAINED
        if summary.get("records_skipped_failed"):
            _say(f"note: {summary['records_skipped_failed']} record(s) already in {results} are error "
                 f"lines and were not computed again; `msinfer run {args.spec}{sets} --retry-failed` computes them "
                 f"again", prefix="msinfer: ")
        return 0
    except (JobFailed, StartupTimeout) as e:
        print_summary(getattr(e, "summary", None))
        _say(str(e))
        return EXIT_JOB_FAILED
    except (*USER_ERRORS, LaunchError) as e:
        _say(str(e))
        return EXIT_USER_ERROR
    except KeyboardInterrupt as e:
        e = SIGNALS.cause(e)
        print_summary(getattr(e, "summary", None))
        resume = ("every finished record is in the results file, and running the same job again"
                  + (" (without --overwrite, which starts over)" if getattr(args, "overwrite", False) else "")
                  + " resumes after them")
        if isinstance(e, Terminated) and e.drained:
            _say(f"drained ({e.signal_name} before any record was in flight): stopped; {resume}", prefix="msinfer: ")
            return EXIT_DRAINED
        if isinstance(e, Terminated):
            _say(f"terminated ({e.signal_name} while draining: stopped at once); {resume}")
            return EXIT_TERMINATED
        _say(f"interrupted; {resume}")
        return EXIT_INTERRUPTED


def print_summary(summary: dict | None, task: str | None = None) -> None:
    """The run's summary in one JSON line on stdout (docs/spec.md), where the run wrote one."""
    if not summary:
        return
    from msinfer.sharding.config import POOLING_TASKS
    task = task or summary.get("spec", {}).get("task")
    made = ("prompt_tokens", "records_per_s") if task in POOLING_TASKS else ("completion_tokens", "tokens_per_s")
    keys = ("records_done", "records_failed", "records_skipped", "records_cut", *made, "startup_s", "generation_s",
            "replica_restarts") + (("simulate",) if "simulate" in summary else ())
    print(json.dumps({k: summary.get(k) for k in keys}), flush=True)


def cut_note(summary: dict) -> str:
    """The run's note on the records that stopped at their length limit before the model ended
    them (a thinking model's answers under the default max_new_tokens are the case to catch)."""
    spec = summary["spec"]              # (as the run resolved it: the model's generation_config taken)
    return (f"note: {summary['records_cut']} of {summary['records_done']} record(s) stopped at their length limit "
            f"before the model ended them (finish_reason 'length': sampling.max_new_tokens, "
            f"{spec['sampling']['max_new_tokens']} for the job's records, or model.max_model_len "
            f"{spec['model']['max_model_len']}); a higher sampling.max_new_tokens lets them finish")


def merge_job(spec) -> dict:
    """`msinfer merge`: the shards of spec's input.shard (K/N, or auto under a Slurm array) merged
    into output.path (launcher.shards.merge_shards), once each shard's results were computed with
    the spec's settings (launcher.job.result_settings); the merged file's status file keeps them,
    for a run on it to check as it checks a run's."""
    import time

    from msinfer.launcher.errors import OutputError, SpecError
    from msinfer.launcher.inputs import read_records
    from msinfer.launcher.job import changed_settings, plan_job, result_id_key, result_settings, \
        shown_settings
    from msinfer.launcher.shards import merge_shards, merged_path, resolve_shard, shard_path
    from msinfer.launcher.writer import holds_results, kept_settings, read_summary, status_path, write_json_atomic
    shard = resolve_shard(spec.input.shard)
    if shard is None:
        raise SpecError("msinfer merge: the job spec has no input.shard; set the one its tasks ran with, "
                        "e.g. --set input.shard=0/4 (any K: merge reads all N shards)")
    plan = plan_job(spec, weights=False)
    # the shards of `msinfer simulate` merge too, as stand-in results (which a run then refuses);
    # all of them or none
    paths = [shard_path(spec.output.path, k, shard[1]) for k in range(shard[1])]
    stand_in = [bool((kept_settings(path) or {}).get("simulate")) for path in paths]
    if any(stand_in) and not all(stand_in):
        raise OutputError(f"msinfer merge: shard(s) {', '.join(str(k) for k, s in enumerate(stand_in) if s)} of "
                          f"{shard[1]} hold stand-in results of msinfer simulate, and shard(s) "
                          f"{', '.join(str(k) for k, s in enumerate(stand_in) if not s)} a run's; run the stand-in "
                          f"shards again with `msinfer run --overwrite`. Nothing was written")
    settings = result_settings(plan, any(stand_in))
    for k, path in enumerate(paths):
        if changed := changed_settings(kept_settings(path), settings):
            raise OutputError(f"msinfer merge: shard {k} of {shard[1]} ({path}) holds results of a run with other "
                              f"settings than the spec's ({shown_settings(changed)}); merge the shards of one job, "
                              f"with the spec they ran with. Nothing was written")
    out = merged_path(spec.output.path)
    if holds_results(out) and (read_summary(status_path(out)) or {}).get("merged_shards") != shard[1]:
        raise OutputError(f"msinfer merge: {out} holds results that are not a merge of these "
                          f"{shard[1]} shards (a run's, written there before); merging would replace them. Move "
                          f"that file, or merge to another with --set output.path=<merged file>. Nothing was written")
    ids = (r.id for r in read_records(spec.input.path))       # (read as the merge asks: none are held)
    merged = merge_shards(ids, spec.output.path, shard[1], result_id_key(plan.output_format))
    write_json_atomic(status_path(out), {"state": "done", "updated_unix": time.time(),
                                         "merged_shards": shard[1], "settings": settings})
    return merged


def entry() -> int:
    """The `msinfer` command's process (pyproject's console script): main, in a process of its own.
    Where a second signal stopped Ray's start in its middle (launcher.replica.INIT_CUT), the
    process ends at once with the command's code, everything written: Ray's exit handler would
    crash on the half-made driver (SIGSEGV)."""
    code = main(own_process=True)
    replica = sys.modules.get("msinfer.launcher.replica")
    if replica is not None and replica.INIT_CUT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _say(message: str, prefix: str = "msinfer: error: ") -> None:
    lines = message.splitlines() or [""]
    first = textwrap.fill(lines[0], width=100, initial_indent=prefix, subsequent_indent="  ",
                          break_on_hyphens=False, break_long_words=False)
    print("\n".join([first, *("  " + line for line in lines[1:])]), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(entry())
