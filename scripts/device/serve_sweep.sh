#!/usr/bin/env bash
# The service on a GPU (issue 6; the DiffKV paper's Figure 16): for each KV mode, start `diffkv serve` on
# loopback, sweep Poisson request rates with loadtest/sweep.py, stop it; then one plot of both modes' per-token
# latency vs rate and the highest rate each sustains under a TTFT SLO.
#
#   bash scripts/device/serve_sweep.sh [--rates 0.5,1,2,4] [--num-requests 20] [--max-tokens 512] ...
#
# Run from the repository root (after the carried wheels: scripts/device/_wheels.sh). Everything goes under
# $OUT (default ./out): serve_sweep/<mode>.json (+ .png), serve_sweep/<mode>.serve.log, serve_sweep/fig16.png,
# serve_sweep/grid.png and serve_sweep_<gpu>.json (both runs, the SLO, the sustained rates, the setup).
# Fairness: both modes get the same KV pool (--kv-gb, so fp16 is memory-bound), the same max batch, admission
# control off (requests queue in the engine, as in vLLM's benchmark) and prefix caching off (the rates reuse the
# prompts; fp16 would otherwise skip their prefills). The API has no ignore_eos, so the prompts
# (scripts/device/long_prompts.jsonl) ask for long essays and stories: greedy SmolLM2 runs them to --max-tokens
# (8 of 8 did at 1024 on CPU; gsm_symbolic questions stop after ~100 tokens), so the KV cache fills. The whole
# script keeps within --budget-s: each mode gets an equal share of what is left, and the sweep skips rates that
# would not fit.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/_wheels.sh

MODES="fp16,diffkv"; RATES="0.5,1,2,4"; NUM_REQUESTS=20; MAX_TOKENS=512; KV_GB=0.125; MAX_SEQS=64
SLO_TTFT_MS=2000; SLO_PERCENTILE=90; DEVICE=auto; MODEL=""; PORT=8000; NUM_CPUS=""; WARMUP=2
DRAIN_TIMEOUT_S=60; BUDGET_S=450; HEALTH_TIMEOUT_S=240; STOP_TIMEOUT_S=45; REQUEST_TIMEOUT_S=120
PROMPTS=scripts/device/long_prompts.jsonl
usage() { sed -n '2,19p' "$0"; grep -o -- '--[a-z-]*)' "$0" | tr -d ')' | tr '\n' ' '; echo; }
while [ $# -gt 0 ]; do
  case "$1" in
    --modes) MODES="$2";; --rates) RATES="$2";; --num-requests) NUM_REQUESTS="$2";; --max-tokens) MAX_TOKENS="$2";;
    --kv-gb) KV_GB="$2";; --max-seqs) MAX_SEQS="$2";; --slo-ttft-ms) SLO_TTFT_MS="$2";;
    --slo-percentile) SLO_PERCENTILE="$2";; --device) DEVICE="$2";; --model) MODEL="$2";; --port) PORT="$2";;
    --num-cpus) NUM_CPUS="$2";; --warmup) WARMUP="$2";; --drain-timeout-s) DRAIN_TIMEOUT_S="$2";;
    --budget-s) BUDGET_S="$2";; --health-timeout-s) HEALTH_TIMEOUT_S="$2";; --prompts) PROMPTS="$2";;
    --request-timeout-s) REQUEST_TIMEOUT_S="$2";;
    -h|--help) usage; exit 0;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2;;
  esac
  shift 2
done
OUT="${OUT:-./out}"
RUNS="$OUT/serve_sweep"
mkdir -p "$RUNS"
T0=$SECONDS
COMMAND="bash scripts/device/serve_sweep.sh --modes $MODES --rates $RATES --num-requests $NUM_REQUESTS \
--max-tokens $MAX_TOKENS --kv-gb $KV_GB --max-seqs $MAX_SEQS --slo-ttft-ms $SLO_TTFT_MS \
--slo-percentile $SLO_PERCENTILE --warmup $WARMUP --drain-timeout-s $DRAIN_TIMEOUT_S --budget-s $BUDGET_S"

diffkv_wheels core,plot
IFS='|' read -r TAG GPU_NAME <<< "$(gpu_info)"
echo "serve sweep on $TAG: modes $MODES, rates $RATES x $NUM_REQUESTS requests, max_tokens $MAX_TOKENS, KV pool" \
     "$KV_GB GiB, TTFT SLO p$SLO_PERCENTILE <= $SLO_TTFT_MS ms, budget $BUDGET_S s"

SERVE_PID=""
stop_service() {  # SIGINT (Ctrl-C): `diffkv serve` shuts Serve and Ray down; then the process group (Ray's) if it hangs
  [ -n "$SERVE_PID" ] || return 0
  local t0=$SECONDS
  kill -INT "$SERVE_PID" 2>/dev/null || true
  while kill -0 "$SERVE_PID" 2>/dev/null && [ $((SECONDS - t0)) -lt "$STOP_TIMEOUT_S" ]; do sleep 1; done
  if kill -0 "$SERVE_PID" 2>/dev/null; then
    echo "service did not stop in $STOP_TIMEOUT_S s: killing its process group" >&2
    kill -KILL -- "-$SERVE_PID" 2>/dev/null || kill -KILL "$SERVE_PID" 2>/dev/null || true
  fi
  wait "$SERVE_PID" 2>/dev/null || true
  echo "service stopped in $((SECONDS - t0)) s"
  SERVE_PID=""
}
trap stop_service EXIT

wait_healthy() {  # until GET /health answers 200, the service dies, or HEALTH_TIMEOUT_S passes
  local t0=$SECONDS
  while [ $((SECONDS - t0)) -lt "$HEALTH_TIMEOUT_S" ]; do
    if ! kill -0 "$SERVE_PID" 2>/dev/null; then echo "the service exited while starting" >&2; return 1; fi
    if "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
         "http://127.0.0.1:$PORT/health" 2>/dev/null; then
      echo "healthy after $((SECONDS - t0)) s"; return 0
    fi
    sleep 2
  done
  echo "not healthy after $HEALTH_TIMEOUT_S s" >&2
  return 1
}

IFS=, read -r -a MODE_LIST <<< "$MODES"
JSONS=(); TIMINGS=""
for i in "${!MODE_LIST[@]}"; do
  mode="${MODE_LIST[$i]}"
  t_mode=$SECONDS
  share=$(( (BUDGET_S - (SECONDS - T0)) / (${#MODE_LIST[@]} - i) ))  # an equal share of what is left
  cfg="$RUNS/$mode.config.json"
  "$PYTHON" - "$cfg" "$mode" "$DEVICE" "$MODEL" "$KV_GB" "$MAX_SEQS" <<'PY'
import json, sys
path, mode, device, model, kv_gb, max_seqs = sys.argv[1:]
cfg = {"kv_mode": mode, "device": device, "cache": {"kv_cache_memory_gb": float(kv_gb), "enable_prefix_caching": False},
       "scheduler": {"max_num_seqs": int(max_seqs)}, "admission": {"enabled": False}}
if model:
    cfg["model"] = model
json.dump(cfg, open(path, "w"), indent=2)
PY
  echo "== $mode: starting the service (share of the budget: $share s)"
  args=(-m diffkv_serve.service.cli serve --config "$cfg" --host 127.0.0.1 --port "$PORT")
  [ -n "$NUM_CPUS" ] && args+=(--num-cpus "$NUM_CPUS")
  "$PYTHON" "${args[@]}" > "$RUNS/$mode.serve.log" 2>&1 &
  SERVE_PID=$!
  if ! wait_healthy; then tail -40 "$RUNS/$mode.serve.log" >&2; exit 1; fi
  t_up=$((SECONDS - t_mode))
  # what is left of the share, less the stop; a rate starts only if its arrivals and drain fit in it
  left=$(( share - (SECONDS - t_mode) - STOP_TIMEOUT_S / 3 ))
  sweep_budget=$(( left - DRAIN_TIMEOUT_S ))
  [ "$sweep_budget" -gt 0 ] || { echo "no time left for $mode's sweep (budget $BUDGET_S s)" >&2; exit 1; }
  t_sweep=$SECONDS
  rc=0
  timeout -s INT "$((left + 30))" "$PYTHON" loadtest/sweep.py run --base-url "http://127.0.0.1:$PORT" \
    --rates "$RATES" --num-requests "$NUM_REQUESTS" --max-tokens "$MAX_TOKENS" --prompts "$PROMPTS" \
    --warmup "$WARMUP" --drain-timeout-s "$DRAIN_TIMEOUT_S" --time-budget-s "$sweep_budget" \
    --timeout "$REQUEST_TIMEOUT_S" --slo-ttft-ms "$SLO_TTFT_MS" --label "$mode" --out "$RUNS/$mode.json" || rc=$?
  t_run=$((SECONDS - t_sweep))
  stop_service
  [ -f "$RUNS/$mode.json" ] || { echo "$mode: the sweep wrote nothing (exit $rc)" >&2; exit 1; }
  [ "$rc" -eq 0 ] || echo "$mode: the sweep exited $rc (kept the rates it finished)" >&2
  JSONS+=("$RUNS/$mode.json")
  TIMINGS="$TIMINGS $mode:$t_up:$t_run:$((SECONDS - t_mode))"
  echo "== $mode: up in ${t_up} s, swept in ${t_run} s, $((SECONDS - t_mode)) s in all"
done
trap - EXIT

"$PYTHON" - "$RUNS/setup.json" "$COMMAND" "$KV_GB" "$MAX_SEQS" "$TIMINGS" "$((SECONDS - T0))" <<'PY'
import json, sys
path, command, kv_gb, max_seqs, timings, total = sys.argv[1:]
modes = {}
for item in timings.split():
    mode, up, sweep, all_s = item.split(":")
    modes[mode] = {"startup_s": int(up), "sweep_s": int(sweep), "mode_s": int(all_s)}
json.dump({"command": command, "kv_cache_memory_gb": float(kv_gb), "max_num_seqs": int(max_seqs),
           "admission": False, "prefix_caching": False, "timings": {"modes": modes, "total_s": int(total)}},
          open(path, "w"), indent=2)
PY
"$PYTHON" loadtest/sweep.py slo "${JSONS[@]}" --ttft-ms "$SLO_TTFT_MS" --percentile "$SLO_PERCENTILE" \
  --device "$GPU_NAME" --setup "$RUNS/setup.json" --out "$OUT/serve_sweep_$TAG.json"
if "$PYTHON" -c "import matplotlib" 2>/dev/null; then
  "$PYTHON" loadtest/sweep.py plot --kind per-token --ttft-ms "$SLO_TTFT_MS" --percentile "$SLO_PERCENTILE" \
    "${JSONS[@]}" -o "$RUNS/fig16.png"
  "$PYTHON" loadtest/sweep.py plot "${JSONS[@]}" -o "$RUNS/grid.png"
else
  echo "no matplotlib here (carry .carry/ray3 for PNGs): draw later with loadtest/sweep.py plot"
fi
echo "serve sweep done in $((SECONDS - T0)) s"
