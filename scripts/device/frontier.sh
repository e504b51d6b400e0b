#!/usr/bin/env bash
# Accuracy against KV bytes per token on Qwen2.5-Coder-1.5B: uniform points and DiffKV sweeps, teacher-forced on
# 64 fp16 generations of 2,048 tokens (evals/fidelity_compare.py: top-1 agreement and NLL, paired, each against
# fp16 and against uniform K4V4). Carry the model first (`bash scripts/device/qwen_run.sh stash` once per
# .carry/qNN, the last call with .carry/w), then, in the next call:
#     bash scripts/device/frontier.sh            # writes $OUT/fidelity_frontier_qwen2.5-1.5b.json row by row
# (the recorded frontier, evals/results/qwen2.5-coder-1.5b/fidelity_frontier_2048.json, is this list). The DiffKV
# sweep is the issue's: high K8V4 or K4V4, low K4V2 or K2V2, at alpha_low 0 (no pruning: every pruning point measured
# lost 8-45 task points) over alpha_high; plus the default (K8V4/K4V4) and K8V8/K8V4 points for the 8-bit caches.
# FRONTIER_CONFIGS replaces the list; the JSON keeps every row measured before the time limit.
set -uo pipefail
UNIFORM="fp8 k8v8 k8v4 k4v2 uniform:K2V2"
DIFFKV="diffkv
diffkv:alpha_high=2,alpha_low=0,high=K4V4,low=K4V2
diffkv:alpha_high=4,alpha_low=0,high=K4V4,low=K4V2
diffkv:alpha_high=8,alpha_low=0,high=K8V4,low=K4V2
diffkv:alpha_high=16,alpha_low=0,high=K8V4,low=K4V2
diffkv:alpha_high=32,alpha_low=0,high=K8V4,low=K4V2
diffkv:alpha_high=64,alpha_low=0,high=K8V4,low=K4V2
diffkv:alpha_high=16,alpha_low=0,high=K8V4,low=K2V2
diffkv:alpha_high=4,alpha_low=0,high=K4V4,low=K2V2
diffkv:alpha_high=8,alpha_low=0,high=K4V4,low=K2V2
diffkv:alpha_high=64,alpha_low=0,high=K4V4,low=K2V2
diffkv:alpha_high=4,alpha_low=0,high=K8V4,low=K4V4
diffkv:alpha_high=2,alpha_low=0,high=K8V8,low=K8V4
diffkv:alpha_high=64,alpha_low=0,high=K8V8,low=K8V4"
CONFIGS=${FRONTIER_CONFIGS:-$(echo $UNIFORM $DIFFKV)}
bash scripts/device/qwen_run.sh timeout "${FRONTIER_LIMIT:-540}" python3 -m evals.fidelity_compare \
  --model qwen2.5-coder-1.5b --device cuda --fidelity-n 64 --gen-len 2048 --max-model-len 2600 \
  --max-num-seqs 64 --kv-cache-memory-gb 8 --baseline k4v4 --configs $CONFIGS \
  --out "${OUT:-/tmp}/fidelity_frontier_qwen2.5-1.5b.json"
