#!/usr/bin/env bash
# The GPU check: the project's GPU claims measured again on one NVIDIA GPU, in about 9 minutes.
#
#   bash benchmarks/gpu_check.sh OUT            # with a GPU: OUT/summary.md, raw JSON, logs
#   bash benchmarks/gpu_check.sh --dry-run OUT  # anywhere: runs nothing; every command must parse
#
# It needs only the torch already installed (and pytest, pytest-xdist, pytest-timeout for step 1)
# and reads only the bundled data (models/mnist/): no network. Steps, in order of value, each under
# its own timeout (seconds), so that a hang in one leaves the others' results:
#   env     10   torch, CUDA, the GPU, the commit, the date (no GPU: one error line, exit code 2)
#   pytest 150   python -m pytest tests/test_gpu.py
#   quick   65   each script's quick start through its run_*.sh, one process (NCCL, one rank)
#   speed  160   train_ddp.py eager and --compile against the bare loop, batch 64 and 512
#   gpt     55   --model gpt-gpu, nanoGPT's size and recipe, 1,000 of 5,000 steps, against 1.4697
#   bf16    40   train_ddp.py in bf16 against fp32 on MNIST: samples/s, loss, accuracy
#   resume  60   SIGTERM mid-run through the launcher, the same command again, weights compared,
#                all under --deterministic
# The budgets: on H200s on 2026-11-28 the steps took 7-8, 112-136+, 55, 131-160 (a compile takes
# about 30 s: 101 s and one run cut off at first), 51, 33 and 50-58 s. GPU_CHECK_STEPS="env pytest
# ..." runs only those steps (the others are listed as left out), GPU_CHECK_SECONDS caps the whole
# (default 545): a rerun after a fix, in what is left of a GPU's lease.
# PYTHON: the interpreter that has torch (default python3, as launch.sh runs). Exit code: 0 when
# every step ran and passed, 1 when one failed or timed out (summary.md says which), 2 when the
# check cannot start. In a dry run: 1 when a command would not start (each is named).
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dry=""
if [ "${1:-}" = --dry-run ]; then dry=--dry-run; shift; fi
if [ $# -ne 1 ] || [[ $1 == -* ]]; then
    echo "error: usage: bash benchmarks/gpu_check.sh [--dry-run] OUT (the results' directory)" >&2
    exit 2
fi
python=${PYTHON:-python3}
if ! command -v timeout > /dev/null; then
    echo "error: the GPU check needs GNU timeout (coreutils) to bound each step" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
out="$(cd "$1" && pwd)"

# name:seconds. The budgets sum to 540 s; with each step's start and the summary, about 9 minutes.
steps=(env:10 pytest:150 quick:65 speed:160 gpt:55 bf16:40 resume:60)
total=${GPU_CHECK_SECONDS:-545}  # no step starts past this, a late one gets what is left
only=" ${GPU_CHECK_STEPS:-} "     # "  ": every step
# A rerun into the same directory starts afresh: an old checkpoint would make step 6 resume at once.
rm -rf "$out/runs" "$out/logs" "$out"/{steps.tsv,machine.json,verify.json,pytest.xml,summary.*}
for entry in "${steps[@]}"; do rm -f "$out/${entry%%:*}.json"; done

child=""
# Ctrl-C or a SIGTERM reaches this shell only: timeout runs each step in a process group of its own.
stop() {
    if [ -n "$child" ]; then kill -TERM "$child" 2> /dev/null; wait "$child"; fi
    exit 130
}
trap stop INT TERM
for entry in "${steps[@]}"; do
    name=${entry%%:*}
    budget=${entry#*:}
    left=$((total - SECONDS))
    if ((budget > left)); then budget=$left; fi
    if [ "$only" != "  " ] && [[ $only != *" $name "* ]]; then
        printf '%s\tleft-out\t0\t0\n' "$name" >> "$out/steps.tsv"
        continue
    fi
    if ((budget < 10)); then
        printf '%s\tskipped\t0\t0\n' "$name" >> "$out/steps.tsv"
        continue
    fi
    echo "gpu_check: $name (at most $budget s)"
    began=$SECONDS
    # In the background, waited for: the trap above runs at once on a signal, not after the step.
    timeout -k 5 "$budget" "$python" "$here/gpu_check.py" step "$name" "$out" \
        --budget "$budget" $dry &
    child=$!
    wait "$child"
    code=$?
    child=""
    printf '%s\t%s\t%s\t%s\n' "$name" "$code" "$budget" "$((SECONDS - began))" >> "$out/steps.tsv"
    if [ "$name" = env ] && [ "$code" -ne 0 ]; then exit 2; fi  # it said why, in one line
done

verified=0
if [ -n "$dry" ]; then
    "$python" "$here/gpu_check.py" verify "$out"
    verified=$?
fi
"$python" "$here/gpu_check.py" summary "$out" $dry
summarised=$?
echo "gpu_check: wrote $out/summary.md in $SECONDS s"
if [ "$verified" -ne 0 ] || [ "$summarised" -ne 0 ]; then exit 1; fi
