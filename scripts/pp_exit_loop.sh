#!/usr/bin/env bash
# Usage: OUT=folder bash scripts/pp_exit_loop.sh   (issue #57: a pp script must exit 0, no abort, 20 times in a row)
# 20 runs of the user's script (tests/e2e/_user_script.py) under every pp schedule, both builds, beside a busy core;
# the schedules rotated so that each is the last fit before the script's exit in some runs.
cd "$(dirname "$0")/.."
taskset -c 0 python3 -c 'while True: pass' & load=$!
trap 'kill $load' EXIT
plans=(pp2_1f1b_mb4 pp2_gpipe_mb4 pp2_interleaved_v2_mb4 pp2_zb1p_mb4 pp2_zbv_mb4 pp2_dualpipev_mb4)
mkdir -p ${OUT:-/tmp/pp_exit}
for i in $(seq 0 19); do
  r=$(( i % 6 ))
  order=("${plans[@]:$r}" "${plans[@]:0:$r}")
  start=$SECONDS
  .venv/bin/python tests/e2e/_user_script.py ${OUT:-/tmp/pp_exit}/fits-$i.txt 2 "${order[@]}" > ${OUT:-/tmp/pp_exit}/run-$i.log 2>&1
  code=$?
  echo "run $i: exit $code, last ${order[5]}, $(( SECONDS - start )) s, terminate: $(grep -c 'terminate called' ${OUT:-/tmp/pp_exit}/run-$i.log), fits: $(wc -l < ${OUT:-/tmp/pp_exit}/fits-$i.txt)"
done
