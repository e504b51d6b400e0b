#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (issue 6): TP=2 gives TP=1's greedy tokens, and decode throughput TP=1 vs TP=2
# on the Llama-3-8B shape (random weights), by benchmarks/tensor_parallel.py on a 2 x H200 box.
#
#   bash scripts/device/tp_bench.sh [extra tensor_parallel.py flags, e.g. --batches 1 32 128 --skip-check]
#
# Run from the repository root after the carried wheels (scripts/device/_wheels.sh: Ray is needed for the TP=2
# worker actors). NVLink multicast stays off (NCCL NVLS, torch symmetric memory, NVSHMEM). Writes
# $OUT/tensor_parallel_<gpu>.json, its log and the GPU topology. Bounded by --limit-s (default 560 s, under a
# device command's 600 s): past it the benchmark is stopped and the log says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/_wheels.sh

LIMIT_S=560
if [ "${1:-}" = "--limit-s" ]; then LIMIT_S="$2"; shift 2; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 RAY_USAGE_STATS_ENABLED=0
OUT="${OUT:-./out}"
mkdir -p "$OUT"
T0=$SECONDS

diffkv_wheels core
IFS='|' read -r TAG GPU_NAME <<< "$(gpu_info)"
echo "tensor parallel on $GPU_NAME x $("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi topo -m > "$OUT/tp_topology_$TAG.txt" 2>&1 || true; fi

rc=0
timeout -s INT "$((LIMIT_S - (SECONDS - T0)))" "$PYTHON" benchmarks/tensor_parallel.py --model random:llama3-8b \
  --tp 1 2 --out "$OUT/tensor_parallel_$TAG.json" "$@" 2>&1 | tee "$OUT/tensor_parallel_$TAG.log" || rc=$?
case "$rc" in
  0) echo "tensor parallel done in $((SECONDS - T0)) s";;
  124|130) echo "stopped at the $LIMIT_S s limit after $((SECONDS - T0)) s (try --batches 1 32, or --skip-check)" >&2;;
  1) echo "greedy tokens differ from TP=1 (see the checks in $OUT/tensor_parallel_$TAG.json)" >&2;;
  *) echo "tensor_parallel.py exited $rc" >&2;;
esac
exit "$rc"
