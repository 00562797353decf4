#!/usr/bin/env bash
# Throughput of the demo job at data parallel 1 and 2 (tensor parallel 1), side by side: records/s
# and tokens/s from each run's <output>.summary.json. Every record generates exactly
# --max-new-tokens tokens (ignore_eos), so the runs do the same work. A warm-up run of each setting
# first fills a graph cache of its own (MindSpore's compile cache replays graphs in the order they
# were compiled, so it is only valid for the same job again), so the measured runs do not compile.
set -euo pipefail

PROG=bench_dp.sh
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
    cat <<'EOF'
Usage: scripts/bench_dp.sh [--prompts N] [--max-new-tokens N] [--dp "1 2"] [--no-warmup] [--keep DIR]

Runs configs/demo.yaml with tensor_parallel 1 at each data-parallel size (embedded local Ray), on N
prompts made from configs/prompts/demo.jsonl, and prints records/s and tokens/s of each.

Options:
  --prompts N          records per run (default 16)
  --max-new-tokens N   tokens generated per record (default 32)
  --dp "A B ..."       data-parallel sizes to compare (default "1 2")
  --no-warmup          measure the first run of each size (includes graph compilation)
  --keep DIR           keep the prompts, results and summaries in DIR (default: a temporary folder)
  --set KEY=VALUE      another override for every run (repeatable)
  -h, --help           this help
EOF
}
die() { echo "$PROG: error: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value (see --help)"; }

prompts=16 max_new=32 dps="1 2" warmup=1 keep="" sets=()
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --prompts) need_value "$@"; prompts=$2; shift 2 ;;
        --max-new-tokens) need_value "$@"; max_new=$2; shift 2 ;;
        --dp) need_value "$@"; dps=$2; shift 2 ;;
        --no-warmup) warmup=0; shift ;;
        --keep) need_value "$@"; keep=$2; shift 2 ;;
        --set) need_value "$@"; sets+=(--set "$2"); shift 2 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[[ $prompts =~ ^[1-9][0-9]*$ ]] || die "--prompts expects a positive whole number, got '$prompts'"
[[ $max_new =~ ^[1-9][0-9]*$ ]] || die "--max-new-tokens expects a positive whole number, got '$max_new'"

msinfer=${MSINFER:-$(command -v msinfer || echo "$ROOT/.venv/bin/msinfer")}
[[ -x $msinfer ]] || die "msinfer not found; run \`make install\` or activate .venv"
python=$(dirname "$msinfer")/python
model=$HOME/.cache/msinfer/SmolLM2-135M-Instruct    # configs/demo.yaml's model.path
[[ -f $model/config.json ]] || die "the demo model is not at $model; run: python scripts/make_demo_model.py"

if [[ -n $keep ]]; then mkdir -p "$keep"; work=$(cd "$keep" && pwd); else
    work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fi

# N records from the demo prompts (prompt or messages only; the demo's per-record sampling is dropped)
"$python" - "$ROOT/configs/prompts/demo.jsonl" "$work/prompts.jsonl" "$prompts" <<'PY'
import itertools, json, sys
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = [json.loads(line) for line in open(src) if line.strip()]
with open(dst, "w") as f:
    for i, rec in zip(range(n), itertools.cycle(base)):
        body = {k: rec[k] for k in ("prompt", "messages") if k in rec}
        f.write(json.dumps({"id": f"{rec['id']}-{i}", **body}) + "\n")
PY

run() {     # run DP OUTPUT
    MSINFER_CACHE="$work/cache-dp$1" "$msinfer" run "$ROOT/configs/demo.yaml" --overwrite --no-progress \
        --set input.path="$work/prompts.jsonl" --set output.path="$2" \
        --set parallel.tensor_parallel=1 --set parallel.data_parallel="$1" \
        --set sampling.max_new_tokens="$max_new" --set sampling.ignore_eos=true \
        ${sets[@]+"${sets[@]}"} >/dev/null
}

for dp in $dps; do
    if [[ $warmup == 1 ]]; then echo "$PROG: dp $dp: warm-up run" >&2; run "$dp" "$work/warmup-dp$dp.jsonl"; fi
    echo "$PROG: dp $dp: measured run" >&2
    run "$dp" "$work/dp$dp.jsonl"
done

# shellcheck disable=SC2086  # one argument per data-parallel size
"$python" - "$work" "$prompts" "$max_new" $dps <<'PY'
import json, os, sys
work, n, m, dps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
rows = [("records/s", "records_per_s"), ("tokens/s", "tokens_per_s"), ("generation s", "generation_s"),
        ("start-up s", "startup_s"), ("TTFT p50 s", "ttft_p50_s"), ("records done", "records_done"),
        ("tokens", "completion_tokens")]
sums = {dp: json.load(open(os.path.join(work, f"dp{dp}.jsonl.summary.json"))) for dp in dps}
print(f"demo model, tensor parallel 1, {n} records x {m} new tokens, {os.cpu_count()} CPUs")
print(f"{'':14}" + "".join(f"{'dp ' + dp:>12}" for dp in dps))
for label, key in rows:
    print(f"{label:14}" + "".join(f"{sums[dp].get(key, float('nan')):>12}" for dp in dps))
PY
