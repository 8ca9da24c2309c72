#!/usr/bin/env bash
# Everything the GPU issue measures, in one call of at most ~8 minutes on one lent GPU, each part bounded in time and
# the next one run whatever the last did:
#   1. stratpack bench --accelerator gpu on the demo GPT 24 x 2048 (plain loop, Lightning's single device, dp, zero3,
#      compiled), four rows traced with torch's profiler;
#   2. stratpack rehearse zero3_tp2 --world-size 8 on Llama 3 8B, rank 0: on meta (the rehearsal) and on the GPU's
#      real tensors (the allocator's peak);
#   3. stratpack bench --accelerator gpu on a Hugging Face Llama 16 x 2048 (single, dp, zero1-3, compiled).
# Usage: bash scripts/gpu_check_all.sh OUT_DIR [TOTAL_SECONDS]
# Env: ORDER (parts and their order, default "gpt rehearse llama"), GPT_ROWS, LLAMA_ROWS, GPT_PROFILE, LLAMA_PROFILE,
# GPT_SHARE / LLAMA_SHARE (percent of the time left that the part may take), LLAMA_REPEAT (runs per row, alternating).
# The next window (#61's open item, the compiled Llama within 2%): ORDER=llama LLAMA_REPEAT=3 LLAMA_PROFILE=
#   LLAMA_ROWS=single+compile,dp+compile,zero1+compile,zero2+compile,zero3+compile bash scripts/gpu_check_all.sh $OUT 540
# OUT_DIR gets report.md (what to read first), log.txt and bundle.tar.gz (every JSON, trace and run-store folder).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: gpu_check_all.sh OUT_DIR [TOTAL_SECONDS]}"
total="${2:-520}"
work="$(mktemp -d)"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 STRATPACK_RUNS="$work/runs"
py="${PY:-$(command -v python3 || command -v python)}"
acc="${ACCELERATOR:-gpu}"  # (cpu with a tiny SIZE: the script's own dry run)
size=(${SIZE:-})
start=$SECONDS
left() { echo $(( total - (SECONDS - start) )); }
log() { echo "[$(( SECONDS - start ))s] $*" | tee -a "$out/log.txt"; }

{
  echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | head -3
  "$py" -c 'import torch, lightning; print("torch", torch.__version__, "cuda", torch.version.cuda, "lightning", lightning.__version__)' 2>&1
  "$py" -c 'import transformers; print("transformers", transformers.__version__)' 2>&1
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') (plus uncommitted changes: $(git status --porcelain 2>/dev/null | wc -l) files)"
  echo '```'
} > "$out/report.md"
log "start; $(left) s budget"

bench() {  # name, seconds, args...
  local name="$1" budget="$2"; shift 2
  log "$name: up to ${budget} s"
  timeout --kill-after=10 "$(( budget + 20 ))" "$py" -m strategies.cli bench --accelerator "$acc" --budget-s "$budget" \
    --folder "$work/$name" --report "$work/$name.md" --runs-dir "$work/runs" "$@" "${size[@]}" >>"$out/log.txt" 2>&1
  log "$name: exit $?"
  { echo; echo "## $name"; echo; cat "$work/$name.md" 2>/dev/null | tail -n +3 || echo "(no report)"; } >> "$out/report.md"
}

# 1. the demo GPT (the acceptance's dp eager and compiled, zero3 within 2%, the peak beside the plain loop's)
part_gpt() {
  bench gpt $(( $(left) * ${GPT_SHARE:-45} / 100 )) --model gpt --steps 16 --warmup-steps 6 \
    --rows "${GPT_ROWS:-plain,dp,zero3,single,dp+compile,plain+compile}" --profile "${GPT_PROFILE:-plain,dp,single,dp+compile}"
}

# 2. the rehearsal of rank 0 of zero3_tp2 at 8 ranks, Llama 3 8B, beside the GPU's allocator
# sequence 4096 needs ~79 GiB on rank 0 (an H200's 139 fit it; an H100's 80 do not): 2048 on a smaller GPU
part_rehearse() {
seq=$("$py" -c 'import torch; print(4096 if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 2048)' 2>/dev/null || echo 2048)
reh=(zero3_tp2 --world-size 8 --workload demos.sizes:LLAMA3_8B --seq-len "$seq" --batch-size 8 --precision bf16-mixed
     --steps 4 --runs-dir "$work/runs")
log "rehearse (meta, then real on cuda)"
timeout 60 "$py" -m strategies.cli rehearse "${reh[@]}" --target cuda --out "$work/rehearse-meta.json" \
  > "$work/rehearse-meta.txt" 2>&1; log "rehearse meta: exit $?"
timeout 100 "$py" -m strategies.cli rehearse "${reh[@]}" --target cuda --real --out "$work/rehearse-real.json" \
  > "$work/rehearse-real.txt" 2>&1; log "rehearse real: exit $?"
{
  echo; echo "## rehearse ${reh[*]}"; echo
  echo '```'; tail -n 25 "$work/rehearse-meta.txt"; echo; tail -n 25 "$work/rehearse-real.txt"; echo '```'
  "$py" - "$work/rehearse-meta.json" "$work/rehearse-real.json" <<'EOF' 2>&1
import json, sys
G = 2**30
try:
    meta, real = (json.load(open(p)) for p in sys.argv[1:3])
    meta, real = (x[0] if isinstance(x, list) else x for x in (meta, real))
    m, r = meta["memory_bytes"], real["memory_bytes"]
    print(f"\nsteady peak: rehearsed on meta {m.get('heap_peak', 0) / G:.2f} GiB; on the GPU (allocator, above the "
          f"set-up) {r.get('heap_peak', 0) / G:.2f} GiB; max_allocated {r.get('max_allocated', 0) / G:.2f} GiB, "
          f"max_reserved {r.get('max_reserved', 0) / G:.2f} GiB; meta / GPU = "
          f"{m.get('heap_peak', 0) / max(r.get('heap_peak', 1), 1):.4f}")
except Exception as err:  # noqa: BLE001
    print(f"\n(no comparison: {type(err).__name__}: {err})")
EOF
} >> "$out/report.md"
}

# 3. the Hugging Face Llama (dp and zero1-3 against Lightning's single device, eager and compiled)
part_llama() {
  bench llama $(( $(left) * ${LLAMA_SHARE:-100} / 100 - 25 )) --model llama --steps 16 --warmup-steps 6 --repeat "${LLAMA_REPEAT:-1}" \
    --rows "${LLAMA_ROWS:-single,dp,zero1,zero2,zero3,single+compile,zero3+compile,dp+compile,plain}" \
    --profile "${LLAMA_PROFILE:-single,dp}"
}

# ORDER picks and orders the parts (a later window measures what the last one left open first)
for part in ${ORDER:-gpt rehearse llama}; do "part_$part"; done

log "done"
cp "$out/log.txt" "$work/" 2>/dev/null
tar -czf "$out/bundle.tar.gz" -C "$work" . 2>/dev/null
if [ "$(stat -c %s "$out/bundle.tar.gz")" -gt 15000000 ]; then  # the device tool brings back files of 16 MiB at most
  tar -czf "$out/bundle.tar.gz" -C "$work" --exclude='trace.json.gz' . 2>/dev/null
  log "bundle without the traces: $(stat -c %s "$out/bundle.tar.gz") bytes"
fi
cat "$out/report.md"
