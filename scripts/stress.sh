#!/usr/bin/env bash
# The suite's tests on sampled figures (heap peaks, elapsed times), run again and again beside a competing load:
# one busy process pinned to core 0 (issue #57: a tolerance must hold on a loaded CI machine, not only alone).
# Usage: bash scripts/stress.sh RUNS OUT_DIR PYTEST_ARGS...
#   e.g. bash scripts/stress.sh 20 stress-heap tests/e2e/test_heap.py
# OUT_DIR gets run-K.log for each run, figures.jsonl (each sampled figure a test compared: `tests.helpers.record_figure`)
# and summary.txt: one line a run (passed, failed, seconds), the totals, and each figure's spread over the runs.
# With STRESS_LOAD=0 no load is started (the same runs alone, to compare). With STRESS_PLANT=NAME the planted error
# scripts/plants/NAME/sitecustomize.py is in every process (each must make the tests fail).
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${1:?usage: stress.sh RUNS OUT_DIR PYTEST_ARGS...}" out="${2:?}"
shift 2
mkdir -p "$out"
load=""
if [ "${STRESS_LOAD:-1}" != 0 ]; then
  taskset -c 0 python3 -c 'while True: pass' &
  load=$!
  trap 'kill $load 2>/dev/null' EXIT
fi
if [ -n "${STRESS_PLANT:-}" ]; then
  export PYTHONPATH="$PWD/scripts/plants/$STRESS_PLANT${PYTHONPATH:+:$PYTHONPATH}"
fi
: > "$out/summary.txt"
: > "$out/figures.jsonl"
export STRATPACK_TEST_FIGURES="$(realpath "$out")/figures.jsonl"
for k in $(seq 1 "$runs"); do
  start=$SECONDS
  .venv/bin/python -m pytest -q -p no:cacheprovider "$@" > "$out/run-$k.log" 2>&1
  code=$?
  echo "run $k: exit $code, $(( SECONDS - start )) s, $(tail -1 "$out/run-$k.log")" | tee -a "$out/summary.txt"
done
failed=$(grep -c "exit [^0]" "$out/summary.txt")
echo "$runs runs, $failed failed (load: $([ -n "$load" ] && echo "one busy process on core 0" || echo none))" \
  | tee -a "$out/summary.txt"
.venv/bin/python scripts/stress_spread.py "$STRATPACK_TEST_FIGURES" | tee -a "$out/summary.txt"
