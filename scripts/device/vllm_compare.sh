#!/usr/bin/env bash
# vLLM 0.26.0 and our engine on the same workload, in one device command (GPU box: Python 3.12, torch 2.11 +
# CUDA 13, no network). vLLM's wheels come in .carry/vllm1..7 (scripts/device/vllm_wheels.py build), our engine's
# in .carry/w; one device command carries one folder (.carry/vllm7 and .carry/w fit together), back to back (the box
# goes back after a short idle, and the stash with it):
#     bash scripts/device/vllm_compare.sh stash                  # carrying .carry/vllmN (N = 1..7; 7 with .carry/w)
# The call that completes the stash installs vLLM into $VSITE and our wheels into $SITE. Then, carrying nothing:
#     bash scripts/device/vllm_compare.sh long-decode [PART...]  # 128 prompts x 2,048 new tokens, 0.98 GiB pool
#     bash scripts/device/vllm_compare.sh serving [PART...]      # 1,024 x 512 in x 256 out, 8 GiB pool
#     bash scripts/device/vllm_compare.sh profile [FLAG...]      # one decode step of each engine, kernel by kernel
#                                                                # (benchmarks/decode_step_profile.py FLAGs)
# Our rows read nothing from the device between steps (--stats-every 0), as vLLM's generate() is timed.
# PARTs (default vllm ours-fp16 ours-fp8, in this order): vllm (bf16 then fp8, each in its own process), ours-fp16,
# ours-fp8, and on request ours-int4 (our K4V4 cache, which vLLM 0.26 has no counterpart of); each
# runs under its own time limit inside the command's budget ($BUDGET_S, default 570 s), so one failing or
# running long loses only its own row; a part the budget no longer fits is skipped and named at the end, to run
# in the next command. Every JSON (vllm_baseline_<workload>_<model>_<GPU>.json, throughput_<workload>_<model>_
# <mode>_<GPU>.json) is kept in $RESULTS (while the box stays warm) and copied to $OUT, with
# vllm_vs_ours_<workload>_<model>_<GPU>.json, the table pairing each vLLM cache dtype with our mode of the same
# format, made from whatever rows $RESULTS holds (ready for benchmarks/results/). Exit 3: wheels still missing
# (the message names the folders).
#   DRY_RUN=1          print the commands instead of running them (and skip the wheels)
#   SKIP_WHEELS=1      use this Python's packages (CPU checks on a dev machine)
#   MODEL              default random:qwen2.5-1.5b;  EXTRA: more flags for both benchmarks (e.g. --num-prompts 8)
set -uo pipefail
cd "$(dirname "$0")/../.."
WHAT="${1:-}"
shift || true
PYTHON="${PYTHON:-python3}"
VSITE="${VSITE:-/tmp/vsite}" SITE="${SITE:-/tmp/site}" WSTASH="${WSTASH:-/tmp/w-stash}"
RESULTS="${RESULTS:-/tmp/vllm-results}" BUDGET_S="${BUDGET_S:-570}" MODEL="${MODEL:-random:qwen2.5-1.5b}"
EXTRA="${EXTRA:-}" DRY_RUN="${DRY_RUN:-0}" SKIP_WHEELS="${SKIP_WHEELS:-0}"
OUT="${OUT:-/tmp/vllm-compare-out}"
mkdir -p "$OUT" "$RESULTS"
LOG="$OUT/vllm_compare_${WHAT:-none}.log"
T0=$SECONDS
log() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$LOG"; }

case "$WHAT" in
  stash|long-decode|serving|profile) ;;
  *) echo "usage: vllm_compare.sh stash | long-decode [PART...] | serving [PART...] | profile [FLAG...]" \
          "(PART: vllm ours-fp16 ours-fp8 ours-int4)"
     exit 2 ;;
esac
PARTS=("$@")
PROFILE_FLAGS=()
if [ "$WHAT" = profile ]; then PROFILE_FLAGS=("$@"); PARTS=(profile); fi
[ ${#PARTS[@]} -gt 0 ] || PARTS=(vllm ours-fp16 ours-fp8)
for p in "${PARTS[@]}"; do
  [ "$WHAT" = profile ] && break
  case "$p" in
    vllm|ours-fp16|ours-fp8|ours-int4) ;;
    *) echo "unknown PART '$p' (vllm, ours-fp16, ours-fp8, ours-int4)"; exit 2 ;;
  esac
done

# ---- wheels: stash what this command carried; install each site once complete -------------------------------
vllm_ready=0
if [ "$SKIP_WHEELS" = 1 ] || [ "$DRY_RUN" = 1 ]; then
  log "wheels: skipped (SKIP_WHEELS / DRY_RUN): this Python's packages"
  { [ "$DRY_RUN" = 1 ] || "$PYTHON" -c "import vllm" 2>/dev/null; } && vllm_ready=1
else
  mkdir -p "$WSTASH"
  if [ -d .carry/w ]; then cp .carry/w/*.whl "$WSTASH/" && log "stashed .carry/w ($(ls "$WSTASH" | wc -l) wheels)"; fi
  "$PYTHON" scripts/device/vllm_wheels.py install --target "$VSITE" --stash /tmp/vllm-stash 2>&1 | tee -a "$LOG"
  vrc=${PIPESTATUS[0]}
  [ "$vrc" = 0 ] && vllm_ready=1
  have=$(ls "$WSTASH"/*.whl 2>/dev/null | wc -l)
  if [ "$have" -gt 0 ] && [ "$(cat "$SITE/.w-count" 2>/dev/null)" != "$have" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WSTASH"/*.whl 2>&1 | tee -a "$LOG" && echo "$have" > "$SITE/.w-count" && log "our wheels: installed into $SITE"
  fi
  [ -f "$SITE/.w-count" ] || log "our wheels: .carry/w not carried yet (our engine needs pydantic, gguf, ...)"
  if [ "$WHAT" = stash ]; then
    [ "$vrc" = 0 ] && [ -f "$SITE/.w-count" ] && log "stash complete: run long-decode / serving next" && exit 0
    exit 3
  fi
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
gpu() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
}
TAG=$("$PYTHON" -c "import sys; sys.path.insert(0, 'benchmarks'); import torch; from _results import gpu_tag
print(gpu_tag(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo unknown)
# file names as the benchmarks name their results: what they measure, then the GPU
NAME="${WHAT}_${MODEL#random:}"
V_JSON="$RESULTS/vllm_baseline_${NAME}_${TAG}.json" C_JSON="$RESULTS/vllm_vs_ours_${NAME}_${TAG}.json"
ours_json() { echo "$RESULTS/throughput_${NAME}_$1_${TAG}.json"; }
log "workload $WHAT, model $MODEL, parts ${PARTS[*]}, budget ${BUDGET_S} s; GPU: $(gpu || echo none) ($TAG)"

# ---- parts -------------------------------------------------------------------------------------------------
RESERVE=20  # seconds kept for the comparison at the end
skipped=()
# part NAME CAP_S CMD...: run CMD under min(CAP_S, what the budget has left); its output into the log
part() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET_S - (SECONDS - T0) - RESERVE))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 60 ]; then
    log "$name: skipped, ${left} s left of the budget"; skipped+=("$name"); return 0
  fi
  log "$name: start (limit ${limit} s): $*"
  if [ "$DRY_RUN" = 1 ]; then return 0; fi
  timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  log "$name: exit $rc$([ "$rc" = 124 ] && echo ' (time limit)'); GPU after: $(gpu || echo none)"
}

common=(--model "$MODEL" --workload "$WHAT" $EXTRA)
for p in "${PARTS[@]}"; do
  case "$p" in
    profile)
      P_JSON="$RESULTS/decode_step_profile_${MODEL#random:}_${TAG}.json"
      part profile $((BUDGET_S - RESERVE)) "$PYTHON" benchmarks/decode_step_profile.py --model "$MODEL" \
        --vllm-site "$VSITE" "${PROFILE_FLAGS[@]}" --out "$P_JSON"
      [ -f "$P_JSON" ] && cp "$P_JSON" "$OUT/"
      log "done in $((SECONDS - T0)) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
      exit 0 ;;
    vllm)
      if [ "$vllm_ready" = 1 ]; then
        limit=$((BUDGET_S - (SECONDS - T0) - RESERVE)); [ "$limit" -gt 320 ] && limit=320
        part vllm 320 "$PYTHON" benchmarks/vllm_baseline.py "${common[@]}" --vllm-site "$VSITE" \
          --child-timeout $((limit / 2 - 5)) --out "$V_JSON"
      else
        log "vllm: skipped, vLLM is not installed (carry the .carry/vllm* folders with 'stash' first)"
        skipped+=(vllm)
      fi ;;
    ours-fp16|ours-fp8|ours-int4)
      mode=${p#ours-}
      part "$p" $([ "$mode" = fp16 ] && echo 220 || echo 180) "$PYTHON" benchmarks/throughput.py "${common[@]}" \
        --no-hf --modes "$mode" --warmup full --quiet --stats-every 0 --out "$(ours_json "$mode")" ;;
  esac
done

# ---- comparison from whatever rows are there (this command's and earlier ones' on this box) ------------------
ours=()
for m in fp16 fp8 int4; do f=$(ours_json $m); [ -f "$f" ] && ours+=("$f"); done
if [ "$DRY_RUN" = 1 ]; then
  log "compare: $PYTHON benchmarks/vllm_baseline.py --compare $V_JSON --ours ${ours[*]:-} --out $C_JSON"
elif [ -f "$V_JSON" ]; then
  timeout 60 "$PYTHON" benchmarks/vllm_baseline.py --compare "$V_JSON" --ours "${ours[@]}" --out "$C_JSON" 2>&1 \
    | tee -a "$LOG"
else
  log "compare: no vLLM rows for $WHAT yet"
fi
for f in "$V_JSON" "$(ours_json fp16)" "$(ours_json fp8)" "$(ours_json int4)" "$C_JSON"; do
  [ -f "$f" ] && cp "$f" "$OUT/"
done
if [ ${#skipped[@]} -gt 0 ]; then
  log "not run: ${skipped[*]} -> next command: bash scripts/device/vllm_compare.sh $WHAT ${skipped[*]}"
fi
log "done in $((SECONDS - T0)) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
