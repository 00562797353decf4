"""`msinfer bench`'s results: one row per case in DIR/bench.csv and DIR/bench.json (rewritten after
every case, so an interrupted run keeps what finished), a table on stdout and DIR/bench.png."""

from __future__ import annotations

import csv
import dataclasses
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from msinfer.launcher.errors import OutputError, gist

CSV_NAME, JSON_NAME, PNG_NAME = "bench.csv", "bench.json", "bench.png"
COLUMNS = ("batch_size", "input_len", "output_len", "kv_cache_bytes", "status", "compile_s", "graphs_compiled",
           "prefill_steps", "decode_steps", "prefill_ms", "ttft_ms", "decode_ms_per_step", "decode_tok_s", "e2e_s",
           "e2e_tok_s", "peak_mem_mib", "peak_mem_mib_per_rank", "error")
# what each figure is; every one comes from the job's own engine and controller (launcher.bench)
DEFINITIONS = {
    "kv_cache_bytes": "2 x dtype bytes x batch x (input + output) x kv heads x head_dim x layers (MLA: dtype bytes "
                      "x batch x (input + output) x latent width x layers)",
    "compile_s": "first pass minus the fastest timed pass, when the first pass compiled new graph shapes",
    "prefill_steps": "steps that fed prompt tokens in the reported pass (1 unless --max-batched-tokens splits them)",
    "decode_steps": "steps that fed one generated token per sequence in the reported pass",
    "prefill_ms": "rank 0's prompt steps of the batch (forward + sampling), per step",
    "ttft_ms": "from the records' arrival in the engine to the first token of the batch's last",
    "decode_ms_per_step": "the seconds the engine's decode steps account for (submit or previous result to "
                          "result, async scheduling as in a job) per step",
    "decode_tok_s": "batch x (output_len - 1) / decode time",
    "e2e_s": "from dealing the batch to the engine to its last result in the driver",
    "e2e_tok_s": "batch x output_len / e2e_s",
    "peak_mem_mib": "ru_maxrss of each rank's process: the high-water mark since it started"}


@dataclass
class BenchRun:
    plan: object                       # launcher.bench.BenchPlan
    rows: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def record(self, case, metrics: dict | None = None, error: str | None = None) -> dict:
        """One row; a failure's full text goes to the JSON only, its gist to the error column."""
        row = {k: None for k in COLUMNS}
        row.update(batch_size=case.batch_size, input_len=case.input_len, output_len=case.output_len,
                   kv_cache_bytes=case.kv_bytes, status="error" if error else "ok", error=error and gist(error))
        if error and error != row["error"]:
            row["error_detail"] = error
        row.update(metrics or {})
        self.rows.append(row)
        self.write()
        return row

    def write(self) -> None:
        d = self.plan.out_dir
        from msinfer.launcher.writer import Replacement, write_json_atomic
        try:
            write_json_atomic(d / JSON_NAME, {"bench": self.meta, "cases": self.rows})
            with Replacement(d / CSV_NAME) as r:
                w = csv.DictWriter(r.file, fieldnames=COLUMNS)
                w.writeheader()
                for row in self.rows:
                    w.writerow({k: csv_value(k, row[k]) for k in COLUMNS})
        except OSError as e:
            raise OutputError(f"--output {d}: cannot write the results ({e.strerror or e})") from None


def csv_value(key: str, v):
    if v is None:
        return ""
    if isinstance(v, list):
        return ";".join(f"{x:.1f}" for x in v)
    if isinstance(v, float):
        return f"{v:.4f}" if key in ("compile_s", "e2e_s") else f"{v:.2f}"
    return v


def bench_meta(plan) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    m = plan.model
    return {
        "model": plan.model_dir, "architecture": m.architecture,
        "shape": {"layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
                  "head_dim": m.head_dim, "vocab": m.vocab_size},
        "weights": "random (--skip-load)" if plan.skip_load else "checkpoint",
        "tensor_parallel": plan.tp, "pipeline_parallel": max(1, len(plan.engine.pipeline)),
        "expert_parallel": plan.engine.expert_parallel, "device": plan.device,
        "dtype": plan.dtype, "max_model_len": plan.max_model_len,
        "engine": dataclasses.asdict(plan.engine), "repeats": plan.repeats,
        "seed": plan.seed, "weight_bytes_per_rank": plan.weight_bytes_per_rank,
        "checkpoint_bytes": plan.checkpoint_bytes,
        "versions": {"mindspore": ver("mindspore"), "ray": ver("ray"), "python": sys.version.split()[0]},
        "machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0]},
        "started_unix": time.time(),
        "scheduler": {"async_scheduling": plan.job.spec.scheduler.async_scheduling, "prefix_caching": False,
                      "max_batched_tokens": plan.max_batched_tokens or "batch x input_len"},
        "definitions": DEFINITIONS,
    }


# ---- reporting ----------------------------------------------------------------------------------------
def plot_results(path: Path, rows: list[dict], title: str = "msinfer bench") -> str | None:
    """Decode and end-to-end tokens/s against batch size, one line per input (and output) length.
    Returns a note instead when there is no plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed, so no {path.name} (pip install matplotlib)"
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return f"no case succeeded, so no {path.name}"
    several_out = len({r["output_len"] for r in ok}) > 1
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, name in ((axes[0], "decode_tok_s", "decode tokens/s"), (axes[1], "e2e_tok_s", "end-to-end tokens/s")):
        groups: dict[tuple, list] = {}
        for r in ok:
            if r[key] is not None:
                groups.setdefault((r["input_len"], r["output_len"] if several_out else None), []).append(r)
        for (n_in, n_out), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            rs = sorted(rs, key=lambda r: r["batch_size"])
            label = f"input {n_in}" + (f", output {n_out}" if n_out is not None else "")
            ax.plot([r["batch_size"] for r in rs], [r[key] for r in rs], marker="o", label=label)
        batches = sorted({r["batch_size"] for r in ok})
        if batches[-1] >= 4 * batches[0]:
            ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        return f"cannot write {path} ({e.strerror or e})"
    finally:
        plt.close(fig)
    return None


def format_table(rows: list[dict]) -> str:
    head = ("batch", "in", "out", "KV MiB", "compile s", "prefill ms", "TTFT ms", "decode tok/s", "e2e tok/s",
            "peak MiB/rank", "error")

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = []
    for r in rows:
        mem = "/".join(f"{m:.0f}" for m in r["peak_mem_mib_per_rank"]) if r["peak_mem_mib_per_rank"] else "-"
        lines.append((str(r["batch_size"]), str(r["input_len"]), str(r["output_len"]),
                      f"{r['kv_cache_bytes'] / 2**20:.1f}", f(r["compile_s"], ".2f"), f(r["prefill_ms"], ".1f"),
                      f(r["ttft_ms"], ".1f"), f(r["decode_tok_s"], ".1f"), f(r["e2e_tok_s"], ".1f"), mem,
                      r["error"] or ""))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths[:-1]) + "  {}"
    return "\n".join([fmt.format(*head), *(fmt.format(*line) for line in lines)])
